"""NVIDIA Megatron-Bridge's published pre-training throughput of dense Llama models on DGX-H100 in the
"26.02 NeMo Container" table: rows of the held-out set (benchmarks/heldout.py), typed as the performance
scripts of that release ran them (heldout_bridge.py types the 25.11 table of the same page, and holds the
readings both share).

Source (stored copy read): NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md at df0289c, section
"26.02 NeMo Container" (DGX-GB300, -GB200, -B300, -B200, -H100; a Precision column). The dense Llama rows of
DGX-H100 typed here: Llama 3 70B and Llama 3.1 405B (FP8-CS; 26.02's B200 table has no Llama row). Every
row's GA is GBS / (MBS × dp), dp = GPUs / (TP·PP·CP).

26.02 — the recipes read (stored copies; their H100 presets are the table's rows):
- scripts/performance/configs/llama/llama3_workload_base_configs.py (00919dc): the table's 70B row is
  ``LLAMA3_70B_PRETRAIN_CONFIG_H100_FP8_CS_V2`` — ``BASE_LLAMA3_70B_CONFIG_GBS256`` (64 GPUs, GBS 256) with
  TP 4, PP 8, VP 5 (``V2: GBS=256``); configs/llama/llama31_workload_base_configs.py (0013c9a):
  ``LLAMA31_405B_PRETRAIN_CONFIG_H100_FP8_CS_V2`` — the V1 preset (1,024 GPUs, TP 8, PP 8, CP 2, VP 8, GBS
  512) with GBS 1536. Neither sets FSDP, CUDA graphs, recompute or offloading; MBS is ``WorkloadBaseConfig``'s
  default 1 and ``sequence_parallel`` is TP > 1 (utils/utils.py, the stored copy with config variants).
- configs/llama/llama3_llm_pretrain.py (2a0d46e) and llama31_llm_pretrain.py (0013c9a),
  ``llama3_70b_pretrain_config_h100`` / ``llama31_405b_pretrain_config_h100``: the library recipe, then
  ``get_precision_config("fp8_cs")`` (utils/precision.py, 84fba28: ``bf16_with_fp8_current_scaling_mixed()``
  with ``first_last_layers_bf16 = False`` — TE current scaling on every layer: ``--fp8 tensorwise``),
  ``set_llama3(1)_common_configs`` (sequence 8192, ``grad_reduce_in_fp32 = False``: ``--reduce-dtype bf16``;
  the vocabulary padded as heldout_bridge.py says, not typed), ``set_workload_base_configs``, and the float8
  H100 userbuffers configuration (``userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192``,
  ``..._h16384_tp8_cp2_...``).
- utils/overrides.py (00538e2): ``set_workload_base_configs`` writes the preset's layout, GBS and MBS;
  ``_set_common_perf_overrides`` turns TE's op fuser off and picks TE's cross entropy; ``set_post_overrides``
  sets ``overlap_param_gather_with_optimizer_step`` for dp > 1, pp > 1, vp > 1 (not modelled).
- src/megatron/bridge/recipes/llama/llama3.py (0d5f555), ``llama3_70b_pretrain_config`` and
  ``llama31_405b_pretrain_config``: the distributed optimizer with ``overlap_grad_reduce`` and
  ``overlap_param_gather`` (``--zero 1 --overlap-grad-reduce --overlap-param-gather``), ``_pretrain_common``'s
  ``distributed_fused_adam_with_cosine_annealing`` (``clip_grad=1.0``: ``--clip-grad``), no recompute
  (``recompute_granularity = None``: no checkpointing), ``CommOverlapConfig(tp_comm_overlap=True)`` (kept with
  TP ≥ 2 and SP by comm_overlap.py's ``_get_model_comm_overlap_cfgs``, 0685ff5: ``--tp-comm-overlap``), and
  for 405B ``account_for_embedding_in_pipeline_split`` / ``account_for_loss_in_pipeline_split``: the split of
  heldout_bridge.py (``--pp-layers 1,2,…,2,1``).
- training/mixed_precision.py: every stored copy's current-scaling recipe sets ``fp8_param_gather = True``:
  typed ``--fp8-param-gather`` (distributed optimizer, per-tensor float8).

Not typed (each row's note says which; the shared ones as in heldout_bridge.py): the pipeline's
``overlap_p2p_comm``; ``overlap_param_gather_with_optimizer_step``; the userbuffers configurations'
ring-exchange buffers (TE's fused cross entropy is typed ``--loss te``, heldout_bridge.py).

Left out, with the reason:
- DGX-GB200 and DGX-GB300 rows: typed in heldout_bridge_gb.py. DGX-B300: no preset, no dense Llama row.
- Qwen3 30B-A3B and 235B-A22B (FP8-MX, FP8-CS): typed in heldout_bridge_moe_fp8.py (but the B300 rows and
  the H100 235B-A22B row; the reasons there). DeepSeekV3 (FP8-MX; MLA, MTP): heldout_bridge.py's reason; GPT
  OSS 120B (BF16): memplan models gpt-oss's attention under ``--impl hf`` only.
- The page's "25.09 NeMo Container" section: its table states no precision (no Precision column; only a
  footnote on its bracketed B200 figures' block size), and that release's presets hold float8 current- and
  delayed-scaling entries of the same layouts (configs/llama3/*.yaml ``perf_matrix``, 0aa7db3; its
  argument parser's ``--fp8_recipe`` default "ds"): the configuration is not stated in full, so its rows
  (Llama 3 8B, 70B, 3.1 405B on H100; 8B and 405B on B200) are not typed.
"""

from __future__ import annotations

from benchmarks.heldout_bridge import H100_405B, NOTE, SPLIT, TP_OVERLAP, bridge_run
from benchmarks.heldout_types import Run

SOURCE = "Megatron-Bridge performance-summary.md (26.02)"
NOTE_2602 = NOTE.replace("performance recipes", "26.02 performance recipes (*_V2 presets)")
H100_70B = (4, 8, 1, 5)


def _row(
    name: str,
    model: str,
    gpus: int,
    batches: tuple[int, int],
    layout: tuple[int, int, int, int],
    published: float,
    notes: tuple[str, ...],
) -> Run:
    """One FP8-CS row of the 26.02 DGX-H100 table (``--fp8 tensorwise``; the recipes' fp8_param_gather)."""
    label = f"{name}, FP8-CS (26.02)"
    return bridge_run(
        label,
        model,
        "h100-sxm",
        gpus,
        batches,
        layout,
        "tensorwise",
        published,
        notes=notes,
        source=SOURCE,
        note=NOTE_2602,
        gather=True,
    )


BRIDGE_MORE_RUNS: tuple[Run, ...] = (
    # the *_V2 presets
    _row(
        "Llama 3 70B, 64 × H100, TP 4 PP 8 VP 5, GBS 256",
        "llama-3-70b",
        64,
        (256, 1),
        H100_70B,
        1621,
        (TP_OVERLAP,),
    ),
    _row(
        "Llama 3.1 405B, 1024 × H100, TP 8 PP 8 CP 2 VP 8, GBS 1536",
        "llama-3.1-405b",
        1024,
        (1536, 1),
        H100_405B,
        311,
        (TP_OVERLAP, SPLIT),
    ),
)
