"""NVIDIA NeMo's published pre-training throughput on DGX-H100 (Megatron-core with Transformer Engine,
float8): rows of the held-out set (benchmarks/heldout.py), typed as a user types them from the table.

Source (stored copy read): NVIDIA/NeMo docs/source/performance/performance_summary.md, the version whose
tables are "Pretraining" and "Finetuning" (container NeMo 24.07, DGX-H100, "at FP8 precision") and "Long
Input Sequences" (container NeMo 24.03.01.framework, DGX-H100, LLAMA2-7B "at FP8 precision"). Each row
states the model, GPUs, global batch (GBS), micro-batch (MBS), sequence length, TP, PP, CP, VP and the
measured tokens/s per GPU (and model TFLOP/s per GPU, not used here).

Readings (what the table does not state; ``NOTE`` on each row):
- The stack: NeMo's Megatron-core GPT (``mcore_gpt: True``) under Transformer Engine's float8 recipe,
  typed ``--impl megatron --fp8 delayed`` (TE's ``DelayedScaling``; NeMo-Megatron-Launcher's configs,
  launcher_scripts/conf/training/gpt3/*.yaml at 0c6c960: ``fp8_hybrid: True``, ``fp8_amax_history_len:
  1024``, ``fp8_amax_compute_algo: max``), so ``--fp8-amax-history-len 1024`` — except Llama 2 70B, whose
  NeMo-Framework-Launcher ``llama/llama2_70b.yaml`` (4a9b61b) sets ``fp8_amax_history_len: 1`` and
  ``most_recent`` (the same bytes moved either way, ``blocks/te_fp8.py``): ``--fp8-amax-history-len 1``.
  None of the configs or H100 scripts sets ``fp8_params`` (NeMo's default False): 16-bit primary weights.
- The optimizer: those configs' ``optim: name: distributed_fused_adam`` with ``overlap_grad_sync: True``
  and ``overlap_param_sync: true`` — optimizer states sharded over the data-parallel ranks, the gradient
  reduction overlapped with the backward and the parameter all-gather with the next forward: typed
  ``--zero 1 --overlap-grad-reduce --overlap-param-gather``; ``gradient_clip_val: 1.0``: ``--clip-grad``.
  (Llama 3 70B's ``llama3_70b.yaml`` at 3dd3561 names ``mcore_distributed_optim``, Megatron-core's
  distributed optimizer: the same sharding, typed the same; its overlap settings not read apart.)
  The gradients' dtype: the launcher's H100 example run scripts for these models (stored copies read:
  the ``llama3_8b_fp8`` run, 1 node, GBS 128; ``llama3_70b_fp8``, 8 nodes, GBS 128; ``llama2_70b_bf16``;
  ``20b_h100_fp8_1node``) all add ``+training.model.optim.grad_sync_dtype=bf16`` (NeMo's docs:
  ``grad_sync_dtype`` default ``dtype``, fp32; "reduction in bf16 ensures improved performance at large
  scale"): typed ``--reduce-dtype bf16`` (the gradient buffer and its reduce-scatter in bf16).
- ``sequence_parallel: True`` in the launcher's tensor-parallel configs (20b.yaml, 175b_fp8.yaml): ``--sp``
  wherever TP > 1. Activation checkpointing ``null`` in them: none. TE's attention backend (cuDNN fused
  or FlashAttention) is not stated: memplan's default kernel.
- Tensor-parallel communication overlap (TE's userbuffers, ``--tp-comm-overlap``): the Llama 70B rows
  ran it — NVIDIA/NeMo-Framework-Launcher (the launcher's later name; the 0c6c960 copy holds the GPT
  configs only) ``llama/llama2_70b.yaml`` (4a9b61b) and ``llama/llama3_70b.yaml`` (3dd3561, this row's
  layout) set ``ub_tp_comm_overlap: true`` with an ``ub_cfg_h100_*_h8192_tp4`` userbuffers configuration
  (the ``llama3_70b_fp8`` H100 script picks ``ub_cfg_h100_fp8_h8192_tp4_mbs1_seqlen8192``): typed
  ``--tp-comm-overlap`` (TE's default methods; those files' SM counts and splits not typed). The GPT-3
  configs of every stored launcher copy (20b.yaml, 175b.yaml, 175b_fp8.yaml) set ``ub_tp_comm_overlap:
  False`` and the H100 scripts override nothing: typed without it (userbuffers files for the GPT rows'
  own layouts exist, which suggests NVIDIA's runs may have used it: not typed on that inference); the
  long-sequence rows (no stored config; ``llama2_7b.yaml``: False) without it.
- Context parallelism: Transformer Engine's of the time, a ring of point-to-point K/V sends to the next
  rank, each block's transfer under the attention of the block before (TE's ``AttnFuncWithCP``; TE's later
  ``cp_comm_type`` options name it ``p2p``, Megatron-core's ``--cp-comm-type`` default): typed ``--cp-rotate
  alltoall``, memplan's per-block rotation (torch's ``_AllToAllRotater``; memplan's default under ``--impl
  megatron`` since, typed here all the same), not torch's default all-gather.
  Its timing is the ring's; TE's own ring buffers are not modelled in memory (torch's ring's ledger).
- Models: the Llama rows are memplan's presets (Llama 2 7B/13B/70B, Llama 3 8B/70B); the GPT3 rows are
  the launcher's gpt3/5b.yaml, 20b.yaml and 175b.yaml as benchmarks/published/nemo-gpt3-*.toml (their
  vocabulary padded as Megatron pads it for the row's TP).
- Left out, with the reason: Nemotron-8B, -22B and -340B (a squared-ReLU MLP, which memplan's model
  config cannot state); the fine-tuning rows (SQuAD samples packed to 4,096 tokens: the attention runs
  per packed sample, whose lengths the table does not state).
"""

from __future__ import annotations

from benchmarks.heldout_types import Run, megatron_layout, megatron_stated

NEMO = "NeMo performance_summary.md (24.07)"
NEMO_LONG = "NeMo performance_summary.md (24.03.01, long sequences)"
PUBLISHED = "benchmarks/published/"
NOTE = (
    "NeMo (Megatron-core + TE float8): distributed optimizer with overlapped gradient and parameter sync, "
    "gradients in bf16, SP with TP, no AC, as NeMo-Megatron-Launcher's configs and H100 scripts set them "
    "(the table states the layout only)"
)


def _nemo(
    name: str,
    source: str,
    model: str,
    gpus: int,
    gbs: int,
    mbs: int,
    seq: int,
    layout: tuple[int, int, int, int],
    published: float,
    *,
    userbuffers: bool = False,
    amax_history: int = 1024,
) -> Run:
    """One row: ``layout`` is the table's (TP, PP, CP, VP); data parallelism is the GPUs left over;
    ``userbuffers``: the row's config sets ``ub_tp_comm_overlap`` (module docstring)."""
    tp, pp, cp, _ = layout
    dp = gpus // (tp * pp * cp)
    assert dp * tp * pp * cp == gpus and gbs % (mbs * dp) == 0, name
    parts = [
        f"-m {model} --seq {seq} --batch {mbs} --global-batch {gbs} --gpus {gpus} --gpu h100-sxm",
        f"--impl megatron --fp8 delayed --fp8-amax-history-len {amax_history}",
        "--zero 1 --overlap-grad-reduce --overlap-param-gather --reduce-dtype bf16 --clip-grad",
    ]
    parts += megatron_layout(layout, userbuffers=userbuffers)
    name_of = model.removeprefix(PUBLISHED).removesuffix(".toml")
    stated = megatron_stated(name_of, "h100-sxm", (gpus, seq, mbs, gbs), layout, 1, "delayed")
    note = f"{NOTE}; TE's TP comm overlap (ub_tp_comm_overlap)" if userbuffers else NOTE
    return Run(name, source, stated, published, " ".join(parts), note)


def _gpt3(size: str) -> str:
    return f"{PUBLISHED}nemo-gpt3-{size}.toml"


def _long(k: int, gpus: int, gbs: int, tp: int, pp: int, cp: int, published: float) -> Run:
    """A row of the long-sequence table: Llama 2 7B at ``k`` K tokens (K = 1,024), micro-batch 1, VP 1."""
    seq = k * 1024
    name = f"Llama 2 7B, s {seq:,}, {gpus} × H100, TP {tp} PP {pp} CP {cp}"
    return _nemo(name, NEMO_LONG, "llama-2-7b", gpus, gbs, 1, seq, (tp, pp, cp, 1), published)


NEMO_RUNS: tuple[Run, ...] = (
    _nemo("GPT3-5B, 64 × H100", NEMO, _gpt3("5b"), 64, 2048, 4, 2048, (1, 1, 1, 1), 23406),
    _nemo("GPT3-20B, 64 × H100, TP 2", NEMO, _gpt3("20b"), 64, 256, 2, 2048, (2, 1, 1, 1), 5851),
    _nemo("GPT3-175B, 128 × H100, TP 4 PP 8 VP 6", NEMO, _gpt3("175b"), 128, 256, 1, 2048, (4, 8, 1, 6), 716),
    _nemo(
        "GPT3-175B, 512 × H100, TP 4 PP 8 VP 6", NEMO, _gpt3("175b"), 512, 2048, 2, 2048, (4, 8, 1, 6), 825
    ),
    _nemo("Llama 2 7B, 8 × H100", NEMO, "llama-2-7b", 8, 128, 1, 4096, (1, 1, 1, 1), 16934),
    _nemo("Llama 2 13B, 16 × H100, PP 4 VP 10", NEMO, "llama-2-13b", 16, 128, 1, 4096, (1, 4, 1, 10), 8715),
    _nemo(
        "Llama 2 70B, 64 × H100, TP 4 PP 4 VP 20",
        NEMO,
        "llama-2-70b",
        64,
        128,
        1,
        4096,
        (4, 4, 1, 20),
        1728,
        userbuffers=True,
        amax_history=1,
    ),
    _nemo("Llama 3 8B, 8 × H100, CP 2", NEMO, "llama-3-8b", 8, 128, 1, 8192, (1, 1, 2, 1), 12273),
    _nemo(
        "Llama 3 70B, 64 × H100, TP 4 PP 4 CP 2 VP 5",
        NEMO,
        "llama-3-70b",
        64,
        128,
        1,
        8192,
        (4, 4, 2, 5),
        1524,
        userbuffers=True,
    ),
    _long(4, 4, 1024, 1, 1, 1, 16671),
    _long(8, 8, 512, 1, 2, 1, 13907),
    _long(16, 16, 256, 2, 1, 1, 10082),
    _long(32, 32, 128, 2, 1, 2, 6687),
    _long(64, 64, 64, 4, 1, 2, 4021),
    _long(128, 128, 32, 4, 1, 4, 2260),
    _long(256, 256, 16, 4, 1, 8, 1214),
    _long(512, 512, 8, 8, 1, 16, 635),
    _long(1024, 1024, 4, 8, 1, 32, 318),
)
