"""A held-out set of published training runs, typed into ``memplan estimate`` as a user would: predicted
throughput against the published one (issue #21).

    python benchmarks/heldout.py            # print the Markdown table and its summary
    python benchmarks/heldout.py --write    # and replace docs/step-time.md's held-out table

Each run is a row of a public benchmark table whose configuration is stated there (model, sequence,
micro-batch, global batch, GPUs, GPU type, layout, activation checkpointing, precision, compile, float8),
with the published throughput in tokens/s per GPU. ``typed`` is what a user types from that statement; it
runs through the command line itself (``memplan estimate … --json``), and the table compares
``time.tokens_per_s / time.devices``. Nothing here is used to set a constant: these runs are held out
(memplan/time/published.py holds the runs the constants were chosen with in view).
tests/test_heldout.py checks that the typed setups are what the sources state and that docs/step-time.md
holds this output; it asserts no error bound (that would be fitting by test).

Sources (stored copies; commit of the copy read):
- llm-foundry: mosaicml/llm-foundry scripts/train/benchmarking/README.md (061f2c7), tables "H100 80GB
  BF16", "A100 80GB with 1600 Gbps node-node interconnect (RoCE)", "A100 40GB with 1600 Gbps node-node
  interconnect (RoCE)". Models: scripts/train/yamls/pretrain/mpt-*.yaml (d_model, n_heads, n_layers,
  expansion_ratio 4, vocab 50,368, learned positions up to max_seq_len = the run's SeqLen), typed as
  benchmarks/published/mpt-*.toml. Composer's FSDP: FULL_SHARD is ZeRO-3; "MP Mode" DEFAULT reduces
  gradients in fp32 (Composer's ``get_mixed_precision``: DEFAULT = param bf16, reduce fp32, buffers bf16;
  PURE = all bf16); the MPT loss is flash_attn's fused cross-entropy (``loss_fn: fused_crossentropy``,
  docs/published-memory.md), typed ``--loss xentropy``; its attention is flash-attn's Triton kernel
  (``submit_benchmarks.py``: ``--attn_impl`` default ``triton``), typed ``--attention-kernel fa1`` (before
  that option existed: the default, FlashAttention-2). The image: ``mosaicml/pytorch:2.1.0_cu121-
  nightly20230827`` (a torch 2.1 nightly, CUDA 12.1), the Image column of scripts/train/benchmarking/
  h100new.md (beb8dee), whose H100 and A100-80GB rows carry the README's figures (760m at 2,048 on 8 GPUs:
  63,147 and 32,434 tokens/s/GPU); ``sweep.sh`` names torch 2.0.1 with CUDA 11.8, read here before.
  The optimizer: the yamls' ``decoupled_adamw``, Composer's ``DecoupledAdamW``, whose ``step`` runs its
  ``adamw`` one parameter at a time (``mul_``, ``mul_``/``add_``, ``mul_``/``addcmul_``, ``sqrt``/``div``/
  ``add_``, ``addcdiv_``) on FSDP's fp32 flat parameters with fp32 gradients: typed ``--optimizer-impl
  for-loop`` (torch's ``_single_tensor_adam``, the same passes but one ``lerp_`` for Composer's ``mul_`` and
  ``add_``: 80 against 88 bytes a parameter; before issue #21's optimizer model it was typed as memplan's
  reference optimizer). torchtitan's rows are typed ``--optimizer-impl foreach`` (all of them, the ones
  typed with the reference model too): its 2024 config (``config_manager.py``'s ``--optimizer.fused``, a
  store-true flag, in the stored copies) builds foreach unless fused is set, and the performance docs do
  not say the runs set it (``--impl torchtitan``'s own default is 0.3.0's ``implementation = "fused"``).
- torchtitan 2024 (A100): pytorch/torchtitan docs/performance.md (0413364), Llama 3 and Llama 2 tables,
  FSDP2 over 64 A100-80GB; sequence 8192 (Llama 3) and 4096 (Llama 2) as the doc states; torchtitan's
  ``mixed_precision_reduce`` default ``float32``.
- torchtitan 2025 (H100): pytorch/torchtitan docs/performance.md (eaea6f6), Tables 1-4 (Grand Teton: H100
  96 GB HBM2e at a 500 W limit, 400 Gb/s RDMA per GPU; Llama 3.1 at sequence 8192, train_configs'
  ``seq_len``, unless the table states it). Float8 of that date: torchao's tensorwise dynamic scaling.

The runs' RMSNorm: torchtitan's 2024 code (norms.py: ``self._norm(x.float()).type_as(x) * self.weight``,
plain ops) on the torch of the time, before ``aten._fused_rms_norm`` had a CUDA kernel (torch 2.8): typed
``--norm-kernel composite`` (op by op), where ``--impl torchtitan``'s ``nn.RMSNorm`` would otherwise run
today's fused kernel (``blocks.norm.cuda_fused_rms_norm``).

Readings that memplan cannot state exactly (the ``note`` of each run):
- torchtitan's "selective" AC is its per-op policy (every other matmul's output saved, and on CUDA the SDPA
  op's, the rest re-run; the 64-A100 preset train_configs/llama3_8b.toml: ``selective_ac_option = 'op'``):
  typed ``--impl torchtitan --checkpointing selective`` (torchtitan 0.3.0's code: fused ``wqkv``, where the
  runs' Dec-2024 code had separate wq, wk, wv and also re-ran W_K), the float8 rows too.
- FSDP2's units: the runs' 2024 torchtitan (0413364's and 9dec370's parallelize_llama.py) wrapped each block,
  the last not resharded after forward, then ``fully_shard(model)`` — a root unit of the embedding, the
  final norm and the output, which the torch of the time never resharded after forward — where 0.3.0 wraps
  the embedding and [norm, output] apart: the ``--impl torchtitan`` rows are typed ``--fsdp-wrap root``
  where it is modelled (ZeRO-3 without cp or pp; Table 4's TP row too); Table 2's CP rows keep 0.3.0's
  units (``--fsdp-wrap root`` refuses cp: not measured there).
- Float8 (T1-T4): the runs' torchtitan 9dec370 converter (torchtitan/float8.py of Dec 2024) made torchao's
  ``Float8LinearConfig`` — tensorwise dynamic scaling, its only recipe then — for every linear but the
  output head: typed ``--impl torchtitan --fp8 tensorwise`` (torchtitan's FSDP2 mixed precision, its
  trainer's, is what ``--impl torchtitan`` runs under the default bf16-mixed). The doc does not say whether
  the runs set ``float8.enable_fsdp_float8_all_gather`` (docs/float8.md's suggested launch line did):
  typed without it (weights all-gathered in bf16).
- Float8 with tensor parallelism (T4): 9dec370's ``apply_tp`` (torchtitan/parallelisms/parallelize_llama.py,
  ``enable_float8=job_config.float8.enable_float8_linear``) laid each block out with torchao's
  ``Float8ColwiseParallel``, ``Float8RowwiseParallel`` and ``PrepareFloat8ModuleInput``
  (torchao/float8/float8_tensor_parallel.py): the attention's and the MLP's inputs are cast to float8 on
  their sequence shard [T/t, h] before the tensor-parallel all-gather, which then moves float8, and the
  row-parallel outputs' gradients are cast on their shard before the backward's all-gather
  (``NoopFwToFloat8BwDynamic``). torchtitan 0.3.0 (what ``--impl torchtitan`` traces) has no float8
  tensor-parallel plan (it gathers bf16 and casts the gathered [T, h]); ``--fp8-tp`` lays 0.3.0's blocks
  out with torchao's styles as 9dec370 did (``measure.distributed.titan_fp8_tp``): typed with it.
- Tables 5-6's pipelines (405B, PP 8): the tables state no split and no micro-batch count, so the code's
  defaults of the time ran (torchtitan/parallelisms/pipelining_utils.py, late 2024): ``generate_split_points``
  (``split_points``) and ``build_pipeline_schedule``'s micro-batch count, the total number of stages when
  ``pipeline_parallel_microbatches`` is not set (8 under 1F1B, 16 interleaved over 2 stages a rank; an
  earlier version took the pp degree, which gives 1F1B's 8 too). FSDP2's units are 0.3.0's (``--fsdp-wrap
  root`` refuses pp). Table 6's CP rows run torch's ring with its default allgather rotation, as Table 2's
  (its K/V repeated to the query heads, as Table 2's note says, not typed).
- Async TP (Table 4's second row, Tables 5-6): 9dec370's ``apply_tp`` under
  ``experimental.enable_async_tensor_parallel`` set ``torch._inductor.config._micro_pipeline_tp`` and
  enabled symmetric memory on the tp group (its blocks compiled, as the tables' "torch.compile" says):
  typed ``--async-tp`` (``time.async_tp``).
- Grand Teton's H100 is typed ``--gpu h100-teton`` (presets/gpus/h100-teton.toml: the doc's 96 GB HBM2e at
  2.4 TB/s); its peak is "between SXM and NVL, and we don't know the exact value" (the doc's footnote) at a
  500 W limit, and no published figure of an H100's tensor-core throughput under 500 W was found: the
  preset keeps the SXM5's peak, an upper bound (before the preset: ``--gpu h100-sxm``).
- llm-foundry's H100 cluster's network is not stated: the preset's (one 400 Gb/s NIC per GPU).
- Table 2's context parallelism is torch's ring (torchtitan's ``context_parallel`` with its default
  ``allgather`` rotation: ``--cp-rotate allgather``, the default). The runs' December-2024 model repeated K/V
  to the 32 query heads before SDPA (``repeat_kv``), so its ring moved and merged 4× the K/V that
  ``--impl torchtitan`` (0.3.0's grouped call) passes: not typed (+1.9, +2.2, +2.4 % of the cp 2, 4, 8
  steps in the model; docs/step-time.md).
"""

from __future__ import annotations

import functools
import json
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

if __name__ == "__main__":  # run as a script: the repository root on the path, for benchmarks.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.heldout_bridge import BRIDGE_RUNS
from benchmarks.heldout_bridge_gb import BRIDGE_GB_RUNS
from benchmarks.heldout_bridge_moe import BRIDGE_MOE_RUNS
from benchmarks.heldout_bridge_moe_fp8 import BRIDGE_MOE_FP8_RUNS
from benchmarks.heldout_bridge_more import BRIDGE_MORE_RUNS
from benchmarks.heldout_nemo import NEMO_RUNS
from benchmarks.heldout_types import Run, Stated
from benchmarks.sections import section_main
from memplan.cli.app import app

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "step-time.md"
START, END = "<!-- heldout:start -->", "<!-- heldout:end -->"
MODELS = "benchmarks/published/"

LF = "llm-foundry benchmarking/README.md"
TT24 = "torchtitan performance.md (0413364)"
TT25 = "torchtitan performance.md (eaea6f6)"
FP8 = "float8: torchao tensorwise, FSDP2 all-gather in bf16 (the doc does not state float8 all-gather)"
FP8_TP = (
    "tensor parallelism as the run's 9dec370 laid it out under float8: torchao's float8 TP plan (--fp8-tp: "
    "casts on the sequence shard, float8 all-gathers)"
)
ASYNC_TP = (
    "async TP as 9dec370's apply_tp set it up (Inductor's micro-pipeline pass, symmetric memory on the tp "
    "group): --async-tp"
)
PIPE = (
    "torchtitan's generated split points and its default micro-batch count (the total stage count); FSDP2's "
    "units as torchtitan 0.3.0 wraps them (--fsdp-wrap root refuses pp)"
)
OP_SAC = (
    "torchtitan's per-op selective AC typed as --impl torchtitan's (0.3.0: fused wqkv; the run's separate "
    "wq, wk, wv also re-ran W_K)"
)
TETON = (
    "Grand Teton H100 typed as h100-teton (2.4 TB/s HBM2e; 500 W peak not stated: the SXM5's, an upper bound)"
)


def _mpt(
    size: str,
    seq: int,
    gpus: int,
    gpu: str,
    mb: int,
    ga: int,
    ac: bool,
    published: float,
    *,
    pure: bool = False,
    table: str,
) -> Run:
    """One row of llm-foundry's tables: micro-batch ``mb`` × ``ga`` accumulations × ``gpus`` sequences."""
    model = f"mpt-{size}" + ("-8k" if seq == 8192 else "")
    reduce = "bf16" if pure else "fp32"
    ckpt = "full" if ac else "none"
    typed = (
        f"-m {MODELS}{model}.toml --seq {seq} --batch {mb} --global-batch {mb * ga * gpus} --gpus {gpus} "
        f"--zero 3 --gpu {gpu} --loss xentropy --reduce-dtype {reduce} --attention-kernel fa1 "
        "--optimizer-impl for-loop --clip-grad" + (" --checkpointing full" if ac else "")
    )
    stated = Stated(
        model,
        gpus,
        gpu,
        seq,
        mb,
        mb * ga * gpus,
        ckpt,
        reduce_dtype=reduce,
        attention_kernel="fa1",
        optimizer_impl="for-loop",
        loss="xentropy",
    )
    label = f"MPT-{size.upper()}, s {seq:,}, {gpus} × {gpu}" + (", AC" if ac else "")
    return Run(label, f"{LF}, {table}", stated, published, typed)


H100, A80, A40 = "H100 80GB BF16", "A100 80GB", "A100 40GB"

MPT_RUNS: tuple[Run, ...] = (
    _mpt("760m", 2048, 8, "h100-sxm", 24, 2, False, 63147, table=H100),
    _mpt("760m", 2048, 32, "h100-sxm", 24, 1, False, 67971, table=H100),
    _mpt("1b", 2048, 8, "h100-sxm", 14, 1, False, 45455, table=H100),
    _mpt("1b", 2048, 64, "h100-sxm", 20, 1, False, 44402, table=H100),
    _mpt("1b", 8192, 8, "h100-sxm", 3, 4, False, 29157, table=H100),
    _mpt("3b", 2048, 16, "h100-sxm", 10, 3, False, 24142, table=H100),
    _mpt("3b", 2048, 64, "h100-sxm", 6, 3, False, 22525, table=H100),
    _mpt("7b", 2048, 8, "h100-sxm", 6, 1, False, 10643, table=H100),
    _mpt("7b", 8192, 8, "h100-sxm", 8, 2, True, 6935, table=H100),
    _mpt("13b", 2048, 8, "h100-sxm", 2, 1, False, 4792, table=H100),
    _mpt("13b", 2048, 64, "h100-sxm", 2, 1, False, 4800, table=H100),
    _mpt("30b", 2048, 8, "h100-sxm", 3, 21, True, 2002, table=H100),
    _mpt("30b", 2048, 32, "h100-sxm", 14, 3, True, 2308, table=H100),
    _mpt("70b", 2048, 32, "h100-sxm", 2, 16, True, 882, table=H100),
    _mpt("70b", 2048, 64, "h100-sxm", 8, 4, True, 1039, table=H100),
    _mpt("125m", 2048, 8, "a100-80gb", 40, 2, False, 142830, table=A80),
    _mpt("350m", 2048, 8, "a100-80gb", 32, 2, False, 58782, table=A80),
    _mpt("760m", 2048, 8, "a100-80gb", 24, 2, False, 32434, table=A80),
    _mpt("1b", 2048, 8, "a100-80gb", 14, 4, False, 20513, table=A80),
    _mpt("1b", 8192, 8, "a100-80gb", 3, 4, False, 13814, table=A80),
    _mpt("3b", 2048, 8, "a100-80gb", 10, 2, False, 10811, table=A80),
    _mpt("7b", 2048, 8, "a100-80gb", 6, 2, False, 4641, table=A80),
    _mpt("7b", 8192, 8, "a100-80gb", 8, 2, True, 3206, table=A80),
    _mpt("13b", 2048, 8, "a100-80gb", 2, 3, False, 2262, table=A80),
    _mpt("30b", 2048, 8, "a100-80gb", 3, 21, True, 916, table=A80),
    _mpt("70b", 2048, 64, "a100-80gb", 8, 4, True, 410, pure=True, table=A80),
    _mpt("3b", 2048, 128, "a100-40gb", 6, 1, False, 9538, pure=True, table=A40),
    _mpt("7b", 2048, 8, "a100-40gb", 12, 4, True, 3679, pure=True, table=A40),
    _mpt("7b", 2048, 128, "a100-40gb", 18, 1, True, 3623, pure=True, table=A40),
    _mpt("13b", 2048, 128, "a100-40gb", 16, 1, True, 1972, pure=True, table=A40),
    _mpt("30b", 2048, 128, "a100-40gb", 6, 1, True, 865, pure=True, table=A40),
    _mpt("70b", 2048, 128, "a100-40gb", 4, 1, True, 376, pure=True, table=A40),
)


def _titan(
    name: str,
    source: str,
    stated: Stated,
    published: float,
    note: str = "",
) -> Run:
    """A torchtitan run: FSDP2 (ZeRO-3) over the data-parallel ranks, local batch = micro-batch (no
    accumulation without pipelining), tp with sequence parallelism, gradients reduced in fp32, AdamW by
    torch's foreach (the 2024 trainers' ``--optimizer.fused`` is a store-true flag: foreach unless set; the
    docs do not say it was; 0.3.0's own default, ``implementation = "fused"``, came later)."""
    norm = "composite" if stated.impl == "torchtitan" else stated.norm_kernel  # the runs' RMSNorm: plain ops
    stated = Stated(
        **{**stated.__dict__, "optimizer_impl": stated.optimizer_impl or "foreach", "norm_kernel": norm}
    )
    s = stated
    dp = s.gpus // (s.tp * s.cp * s.pp)
    parts = [
        f"-m {s.model} --seq {s.seq} --batch {s.micro_batch} --global-batch {s.global_batch} --gpus {s.gpus}",
        f"--zero {s.zero} --gpu {s.gpu} --reduce-dtype {s.reduce_dtype}",
    ]
    if s.clip_grad:
        parts.append("--clip-grad")
    if s.tp > 1:
        parts.append(f"--tp {s.tp} --sp")
    if s.cp > 1:
        parts.append(f"--cp {s.cp}")
    if s.pp > 1:
        parts.append(f"--pp {s.pp}" + (f" --vpp {s.vpp}" if s.vpp > 1 else ""))
        parts.append("--pp-layers " + ",".join(map(str, s.pp_layers)))
    if s.checkpointing != "none":
        parts.append(f"--checkpointing {s.checkpointing}")
    if s.compile:
        parts.append("--compile" if s.compile_loss else "--compile --no-compile-loss")
    if s.fp8 != "none":
        parts.append(f"--fp8 {s.fp8}")
    if s.fp8_tp:
        parts.append("--fp8-tp")
    if s.async_tp:
        parts.append("--async-tp")
    if s.fsdp_wrap != "units":
        parts.append(f"--fsdp-wrap {s.fsdp_wrap}")
    if s.impl != "reference":
        parts.append(f"--impl {s.impl}")
    if s.norm_kernel != "auto":
        parts.append(f"--norm-kernel {s.norm_kernel}")
    parts.append(f"--optimizer-impl {s.optimizer_impl}")
    # without pipelining the local batch is one micro-batch; a pipeline splits it (``_titan_pp``)
    assert s.pp > 1 or s.micro_batch * dp == s.global_batch, name
    return Run(name, source, stated, published, " ".join(parts), note)


def _teton_8b(gpus: int, table: str, tps: tuple[float, float, float]) -> tuple[Run, ...]:
    """Tables 1 and 3: Llama 3.1 8B, FSDP, local batch 2, selective AC; eager, compiled, compiled + float8."""
    base = Stated(
        "llama-3.1-8b",
        gpus,
        "h100-teton",
        8192,
        2,
        2 * gpus,
        "selective",
        impl="torchtitan",
        fsdp_wrap="root",
    )
    compiled = _with(base, compile=True, compile_loss=False)  # the December-2024 code: the blocks only
    kinds = (("FSDP", base, OP_SAC), ("+ compile", compiled, OP_SAC))
    kinds += (("+ compile + float8", _with(compiled, fp8="tensorwise"), f"{OP_SAC}; {FP8}"),)
    return tuple(
        _titan(f"Llama 3.1 8B, {gpus} × H100, {k}", f"{TT25} {table}", st, p, f"{note}; {TETON}")
        for (k, st, note), p in zip(kinds, tps, strict=True)
    )


def _with(s: Stated, **changes: Any) -> Stated:
    return Stated(**{**s.__dict__, **changes})


def _teton_cp(cp: int, tps: float) -> Run:
    """Table 2: Llama 3.1 8B on 8 GPUs, FSDP 8/cp × CP cp, sequence 32,768·cp, local batch 1, full AC,
    compile, float8."""
    seq = 32768 * cp
    stated = Stated(
        "llama-3.1-8b",
        8,
        "h100-teton",
        seq,
        1,
        8 // cp,
        "full",
        cp=cp,
        compile=True,
        compile_loss=False,
        fp8="tensorwise",
        impl="torchtitan",
    )
    name = f"Llama 3.1 8B, 8 × H100, CP {cp}, s {seq:,}"
    return _titan(name, f"{TT25} T2", stated, tps, f"{FP8}; {TETON}")


def _teton_70b(async_tp: bool, published: float) -> Run:
    """Table 4's rows: Llama 3.1 70B on 256 H100s, FSDP 32 × TP 8, local batch 16, full AC, compile, float8
    with torchao's TP plan (9dec370's), the 2024 root wrapping; ``async_tp``: its "2D + AsyncTP" row."""
    stated = Stated(
        "llama-3.1-70b",
        256,
        "h100-teton",
        8192,
        16,
        512,
        "full",
        tp=8,
        compile=True,
        compile_loss=False,
        fp8="tensorwise",
        fp8_tp=True,
        async_tp=async_tp,
        impl="torchtitan",
        fsdp_wrap="root",
    )
    name = "Llama 3.1 70B, 256 × H100, TP 8, full AC, compile + float8" + (" + AsyncTP" if async_tp else "")
    note = f"{FP8}; {FP8_TP}; {ASYNC_TP}; {TETON}" if async_tp else f"{FP8}; {FP8_TP}; {TETON}"
    return _titan(name, f"{TT25} T4", stated, published, note)


TITAN_RUNS: tuple[Run, ...] = (
    _titan(
        "Llama 2 13B, 64 × A100, no AC",
        f"{TT24} Llama 2",
        Stated("llama-2-13b", 64, "a100-80gb", 4096, 2, 128),
        2162,
    ),
    _titan(
        "Llama 2 13B, 64 × A100, selective op",
        f"{TT24} Llama 2",
        Stated(
            "llama-2-13b", 64, "a100-80gb", 4096, 2, 128, "selective", impl="torchtitan", fsdp_wrap="root"
        ),
        1904,
        OP_SAC,
    ),
    _titan(
        "Llama 3 8B, 64 × A100, selective op",
        f"{TT24} Llama 3",
        Stated("llama-3-8b", 64, "a100-80gb", 8192, 1, 64, "selective", impl="torchtitan", fsdp_wrap="root"),
        2973,
        OP_SAC,
    ),
    _titan(
        "Llama 3 70B, 64 × A100, full AC",
        f"{TT24} Llama 3",
        Stated("llama-3-70b", 64, "a100-80gb", 8192, 1, 64, "full"),
        331,
    ),
    _titan(
        "Llama 2 70B, 64 × A100, full AC",
        f"{TT24} Llama 2",
        Stated("llama-2-70b", 64, "a100-80gb", 4096, 2, 128, "full"),
        353,
    ),
    *_teton_8b(8, "T1", (5762, 6667, 8532)),
    *_teton_8b(128, "T3", (5605, 6514, 8380)),
    *(_teton_cp(cp, p) for cp, p in ((1, 3890), (2, 2540), (4, 1071), (8, 548))),
    _teton_70b(async_tp=False, published=829),
    _teton_70b(async_tp=True, published=876),
)


def split_points(layers: int, stages: int) -> tuple[int, ...]:
    """torchtitan's generated split of ``layers`` blocks over ``stages`` (virtual) stages when none is given
    (``generate_split_points``, torchtitan/parallelisms/pipelining_utils.py of late 2024): ``layers //
    stages`` on the first, one more on each of the next ``layers % stages``, the last takes what is left."""
    base, extra = divmod(layers, stages)
    middle = [base + 1 if i < extra else base for i in range(stages - 2)]
    return (base, *middle, layers - base - sum(middle))


def _titan_pp(name: str, table: str, seq: int, local: int, vpp: int, published: float, cp: int = 1) -> Run:
    """A 405B pipeline row of Tables 5-6: 512 H100s, TP 8, PP 8, ``cp`` ranks of context parallelism (torch's
    ring, allgather rotation) and FSDP over the other 8/cp, full AC, compile, float8 with torchao's TP plan,
    AsyncTP; the local batch split into the schedule's micro-batches (the total stage count: 8, 16
    interleaved over 2 stages a rank), the blocks placed by ``split_points``."""
    stages = 8 * vpp
    stated = Stated(
        "llama-3.1-405b",
        512,
        "h100-teton",
        seq,
        local // stages,
        local * 8 // cp,
        "full",
        tp=8,
        cp=cp,
        pp=8,
        vpp=vpp,
        pp_layers=split_points(126, stages),
        compile=True,
        compile_loss=False,
        fp8="tensorwise",
        fp8_tp=True,
        async_tp=True,
        impl="torchtitan",
    )
    return _titan(name, f"{TT25} {table}", stated, published, f"{FP8}; {FP8_TP}; {ASYNC_TP}; {PIPE}; {TETON}")


_405 = "Llama 3.1 405B, 512 × H100, TP 8 PP 8"
_STACK = "full AC, compile + float8 + AsyncTP"
PIPELINE_RUNS: tuple[Run, ...] = (
    _titan_pp(f"{_405} 1F1B, {_STACK}", "T5", 8192, 32, 1, 100),
    _titan_pp(f"{_405} interleaved 1F1B, {_STACK}", "T5", 8192, 32, 2, 128),
    _titan_pp(f"{_405}, FSDP 8, s 32,768, {_STACK}", "T6", 32768, 8, 1, 76),
    _titan_pp(f"{_405}, FSDP 4, CP 2, s 65,536, {_STACK}", "T6", 65536, 8, 1, 47, cp=2),
    _titan_pp(f"{_405}, FSDP 2, CP 4, s 131,072, {_STACK}", "T6", 131072, 8, 1, 31, cp=4),
    _titan_pp(f"{_405}, FSDP 1, CP 8, s 262,144, {_STACK}", "T6", 262144, 8, 1, 16, cp=8),
)
"""Tables 5 and 6."""

RUNS: tuple[Run, ...] = (
    MPT_RUNS
    + TITAN_RUNS
    + PIPELINE_RUNS
    + NEMO_RUNS
    + BRIDGE_RUNS
    + BRIDGE_MORE_RUNS
    + BRIDGE_GB_RUNS
    + BRIDGE_MOE_RUNS
    + BRIDGE_MOE_FP8_RUNS
)

_runner = CliRunner(env={"COLUMNS": "120", "NO_COLOR": "1"})


@functools.cache
def predict(run: Run) -> dict[str, Any]:
    """``memplan estimate <typed> --json``, through the command line, from the repository root (cached:
    the table and the tests read the same runs)."""
    args = [a.replace(MODELS, f"{ROOT}/{MODELS}") for a in shlex.split(run.typed)]
    res = _runner.invoke(app, ["estimate", *args, "--json"])
    if res.exit_code != 0:
        raise RuntimeError(f"{run.name}: {res.output.strip()}")
    out: dict[str, Any] = json.loads(res.stdout)
    return out


def tokens_per_gpu(out: dict[str, Any]) -> float:
    t = out["time"]
    return float(t["tokens_per_s"]) / int(t["devices"])


HEADER = ("run", "source", "published tok/s/GPU", "predicted", "Δ", "MFU", "largest exposed comm", "note")


def rows() -> list[tuple[tuple[str, ...], float]]:
    """The table's rows and each run's error (predicted / published − 1)."""
    out = []
    for run in RUNS:
        j = predict(run)
        got = tokens_per_gpu(j)
        err = got / run.published - 1
        exposed = j["time"]["predicted"]["exposed_s"]
        comm = max(exposed.items(), key=lambda kv: kv[1], default=None)
        step = j["time"]["step_time_s"]
        comm_cell = f"{comm[0]} {comm[1] / step:.0%} of step" if comm and comm[1] >= 0.005 * step else "–"
        cells = (
            run.name,
            run.source,
            f"{run.published:,.0f}",
            f"{got:,.0f}",
            f"{err:+.1%}",
            f"{j['time']['mfu']:.1%}",
            comm_cell,
            run.note or "–",
        )
        out.append((cells, err))
    return out


def summary(errors: list[float]) -> str:
    """Median and worst |error|, and how many runs fall within ±10 % and ±25 %."""
    abs_err = [abs(e) for e in errors]
    worst = max(errors, key=abs)
    n = len(errors)
    inside10 = sum(a <= 0.10 for a in abs_err)
    inside25 = sum(a <= 0.25 for a in abs_err)
    return (
        f"{n} runs: median |error| {statistics.median(abs_err):.1%}, worst {worst:+.1%}; "
        f"{inside10}/{n} within ±10 %, {inside25}/{n} within ±25 %."
    )


def markdown() -> str:
    """The table and its summary line, as docs/step-time.md holds them."""
    got = rows()
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(cells) + " |" for cells, _ in got]
    return "\n".join(lines) + "\n\n" + summary([e for _, e in got]) + "\n"


def main(argv: list[str] | None = None) -> int:
    return section_main(argv, (__doc__ or "").splitlines()[0], DOC, START, END, markdown)


if __name__ == "__main__":
    sys.exit(main())
