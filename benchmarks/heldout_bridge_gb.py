"""NVIDIA Megatron-Bridge's published pre-training throughput of dense Llama models on DGX-GB200 and DGX-GB300
(GB200 and GB300 NVL72: 72 GPUs in one NVLink domain, ``--gpu gb200`` / ``--gpu gb300``) in the "25.11 NeMo
Container" and "26.02 NeMo Container" tables: rows of the held-out set (benchmarks/heldout.py), typed as the
performance scripts of each release ran them (heldout_bridge.py types the 25.11 DGX-H100 and DGX-B200 rows
and holds the readings all these share; heldout_bridge_more.py the 26.02 DGX-H100 rows).

Source (stored copies read): NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md at 00b7660 (its only
section "25.11 NeMo Container") and at df0289c (the same 25.11 tables below a "26.02 NeMo Container"
section). The dense Llama rows, FP8-CS and FP8-MX: 25.11 DGX-GB200 — Llama 3 8B (both) on 8 GPUs, Llama 3
70B FP8-CS on 64 (FSDP 1), Llama 3.1 405B FP8-CS on 256 (TP 4, PP 16, VP 4); 25.11 DGX-GB300 — the same
models, the 405B at TP 2, PP 8, CP 2, VP 4; 26.02 DGX-GB200 — Llama 3 70B FP8-CS (FSDP 1) and FP8-MX (TP 2,
PP 4, VP 5) on 64, Llama 3.1 405B FP8-CS (TP 4, PP 16, VP 4) and FP8-MX (TP 4, PP 16, VP 8) on 256; 26.02
DGX-GB300 — Llama 3 70B FP8-CS (FSDP 1) and FP8-MX (PP 4, VP 5), Llama 3.1 405B FP8-CS (TP 4, PP 8, VP 4)
and FP8-MX (TP 2, PP 8, CP 2, VP 4). Every row's GA is GBS / (MBS × dp), dp = GPUs / (TP·PP·CP).

25.11 — the recipes read (stored copies):
- scripts/performance/configs/llama3/workload_base_configs.py (0fa501a, the copy heldout_bridge.py reads):
  ``LLAMA3_8B_GB200_FP8_CS_BASE_CONFIG`` — GBS 128, MBS 2, nothing else (no CUDA graphs, no recompute, no
  offloading); ``LLAMA3_8B_GB200_FP8_MX_BASE_CONFIG`` — GBS 128, MBS 2, ``cuda_graph_impl = "local"``,
  scope "full_iteration" (a later copy, configs/llama/llama3_workload_base_configs.py at 00919dc, sets the
  same graphs on the FP8-CS preset too); ``LLAMA3_8B_GB300_FP8_CS_BASE_CONFIG`` — MBS 4, the same CUDA
  graphs, and ``..._GB300_FP8_MX_...`` the same preset (00919dc's V1 alike); ``LLAMA3_70B_GB200_FP8_CS_BASE_
  CONFIG`` — MBS 2, ``use_megatron_fsdp = True``, ``cpu_offloading_num_layers = 40``, GBS 128
  (``BASE_LLAMA3_70B_CONFIG``); ``LLAMA3_70B_GB300_FP8_CS_BASE_CONFIG`` — the same with 20 layers offloaded.
- configs/llama31/workload_base_configs.py (0fa501a): ``LLAMA31_405B_GB200_FP8_CS_BASE_CONFIG`` — TP 2, GBS
  64, ``use_megatron_fsdp = True``, ``cpu_offloading_num_layers = 95`` (another stored copy: 128 GPUs, the
  same preset); ``LLAMA31_405B_GB300_FP8_CS_BASE_CONFIG`` — TP 2, GBS 64, Megatron FSDP, 10 layers
  offloaded; configs/llama31/llama31_llm_pretrain.py (0fa501a): ``llama31_405b_gb200_config`` and
  ``..._gb300_config`` ("128xGPU") take them with ``userbuffers_fp8_b200_h16384_tp4_cp2_mbs1_seqlen8192``.
- configs/llama3/llama3_llm_pretrain.py (0fa501a): ``llama3_8b_gb200_config`` / ``..._gb300_config`` — the
  library recipe, ``set_llama3_common_configs`` (sequence 8192, ``grad_reduce_in_fp32 = False``:
  ``--reduce-dtype bf16``), ``set_workload_base_configs``, ``CommOverlapConfig(tp_comm_overlap = TP > 1)``
  (off at TP 1); ``llama3_70b_gb200_config`` / ``..._gb300_config`` — the same with
  ``userbuffers_fp8_b200_h8192_tp2_mbs1_seqlen8192`` (moot at TP 1: ``_get_model_comm_overlap_cfgs`` keeps
  TE's overlap only with TP ≥ 2 and SP) and, under Megatron FSDP, ``fsdp_double_buffer = True``,
  ``gradient_accumulation_fusion = False``, ``suggested_communication_unit_size = 800000000``.
- utils/helpers.py (0fa501a): ``get_precision_config`` ("cs": current scaling with
  ``first_last_layers_bf16 = False``; "mx": ``bf16_with_mxfp8_mixed()``), ``set_workload_base_configs``
  (layout, GBS, MBS, sp = TP > 1), ``set_megatron_fsdp_overrides`` (``optim_grads_params``: ``--zero 3``;
  ``keep_fp8_transpose_cache = False``), ``set_cuda_graph_overrides``, ``set_recompute_overrides``
  (``cpu_offloading_num_layers``: ``cpu_offloading = True``, ``cpu_offloading_weights = False`` — Megatron's
  activation offload of that many layers).

What the 25.11 tables state against those presets (each row typed as the table prints it, the rest of the
configuration as the presets set it, the note saying so):
- Llama 3 8B on GB300: MBS 2, GA 8 — the presets' MBS is 4 (GA 4).
- Llama 3 70B (both): GBS 256, GA 2 (MBS 2, dp 64) — the 25.11 presets' GBS is 128 (GA 1); the later
  presets with GBS 256 (``LLAMA3_70B_PRETRAIN_CONFIG_GB200_FP8_CS_V2`` and ``..._GB300_...``, 00919dc) keep
  MBS 2, Megatron FSDP and 40 (GB300: 20) offloaded layers.
- Llama 3.1 405B: 256 GPUs, GBS 1536, FSDP 0 — no stored preset of that release has them (TP 2 and
  Megatron FSDP on 128 GPUs, above). GB200's TP 4, PP 16, CP 1, VP 4 is the 26.02 preset
  ``LLAMA31_405B_PRETRAIN_CONFIG_GB200_FP8_CS_V2`` (below: no FSDP, no offloading); GB300's TP 2, PP 8, CP
  2, VP 4 is no FP8-CS preset's (0013c9a's ``..._GB300_FP8_CS_V2``: TP 4, PP 8, VP 4) but the 26.02 FP8-MX
  one's (``..._GB300_FP8_MX_V2``, also without FSDP or offloading). Typed so.

26.02 — the recipes read (stored copies, as heldout_bridge_more.py reads them):
- configs/llama/llama3_workload_base_configs.py (00919dc), the V2 presets (``BASE_LLAMA3_70B_CONFIG_GBS256``:
  64 GPUs, GBS 256): ``LLAMA3_70B_PRETRAIN_CONFIG_GB200_FP8_CS_V2`` — MBS 2, ``use_megatron_fsdp = True``,
  ``cpu_offloading_num_layers = 40``; ``..._GB300_FP8_CS_V2`` — the same with 20; ``LLAMA3_70B_PRETRAIN_
  CONFIG_GB200_FP8_MX_V2`` — TP 2, PP 4, VP 5 (MBS 1); ``..._GB300_FP8_MX_V2`` — PP 4, VP 5 (TP 1, MBS 1);
  none sets CUDA graphs or recompute.
- configs/llama/llama31_workload_base_configs.py (0013c9a; another stored copy holds the same V2 presets):
  ``LLAMA31_405B_PRETRAIN_CONFIG_GB200_FP8_CS_V2`` — 256 GPUs, TP 4, PP 16, CP 1, VP 4, GBS 1536,
  ``use_megatron_fsdp = False``, ``cpu_offloading_num_layers = None``; ``..._GB200_FP8_MX_V2`` — the V1
  preset (TP 4, PP 8, CP 2, VP 8) with 256 GPUs, PP 16, CP 1, GBS 1536; ``..._GB300_FP8_CS_V2`` — 256 GPUs,
  TP 4, PP 8, CP 1, VP 4, GBS 1536, no FSDP, no offloading; ``..._GB300_FP8_MX_V2`` — the V1 preset (TP 4,
  PP 8, CP 2, VP 4) with TP 2, 256 GPUs, GBS 1536; none sets CUDA graphs or recompute. utils/utils.py
  (01b2977): ``WorkloadBaseConfig``'s defaults (MBS 1, ``cuda_graph_impl = None``: the library's, none) and
  ``sequence_parallel = TP > 1``.
- configs/llama/llama3_llm_pretrain.py (2a0d46e), ``llama3_70b_pretrain_config_gb200`` / ``..._gb300``: the
  library recipe, ``get_precision_config`` (utils/precision.py, 84fba28: "fp8_cs" current scaling with
  ``first_last_layers_bf16 = False``, "fp8_mx" ``bf16_with_mxfp8_mixed()``), ``set_llama3_common_configs``,
  ``set_workload_base_configs``, the FSDP switches above, ``userbuffers_fp8_b200_h8192_tp2_mbs1_seqlen8192``
  with the recipe's ``tp_comm_overlap`` (off for NVFP4 only): ``--tp-comm-overlap`` on GB200's TP 2 row.
  configs/llama/llama31_llm_pretrain.py (0013c9a), ``llama31_405b_pretrain_config_gb200`` / ``..._gb300``:
  the same, with ``userbuffers_fp8_b200_h16384_tp4_cp2_mbs1_seqlen8192``: ``--tp-comm-overlap`` at TP 2 and 4.
- utils/overrides.py (00538e2): ``set_workload_base_configs`` as 25.11's, and the same FSDP, CUDA-graph and
  offloading overrides; ``set_post_overrides``: ``overlap_param_gather_with_optimizer_step`` for dp > 1,
  pp > 1, vp > 1 (not modelled).

Both releases (the readings heldout_bridge.py states): TE float8 — FP8-CS ``--fp8 tensorwise``, FP8-MX
``--fp8 mxfp8``; both recipes set ``fp8_param_gather = True`` (training/mixed_precision.py, 0509780), typed
``--fp8-param-gather`` where memplan models it (per-tensor float8 under the distributed optimizer, ``--zero
1``, or Megatron FSDP, ``--zero 3``): the FP8-MX rows keep 16-bit weights beside TE's float8 cache. The
distributed optimizer with
overlapped gradient and parameter sync and clipping at 1.0 (src/megatron/bridge/recipes/llama/llama3.py);
no recompute; TE's p2p context-parallel ring (``--cp-rotate alltoall``); the 405B recipe's
``account_for_embedding_in_pipeline_split`` and ``account_for_loss_in_pipeline_split`` (``--pp-layers``,
heldout_bridge.py's ``embedding_loss_split``: (126 + 2)/(PP·VP) a virtual stage, one fewer on the first and
the last — PP 16 × VP 4: 2, and 1 at the ends; PP 8 × VP 4: 4, and 3; PP 16 × VP 8: 1, and none on the
first and the last, which hold the embedding and the loss alone: ``--pp-layers 0,1,…,1,0``); TE's
userbuffers typed ``--tp-comm-overlap`` with TP ≥ 2 and SP (the b200 configurations' ring-exchange buffers
as heldout_bridge.py says, not typed).

Not typed (each row's note says which; the shared ones as in heldout_bridge.py):
- Megatron's activation offload (``cpu_offloading_num_layers`` 40 on GB200, 20 on GB300, of the 70B's 80
  layers, over NVLink-C2C to the Grace): ``--offload activations`` offloads every layer (torch's
  ``save_on_cpu``), and neither preset states a host link (``memplan estimate`` refuses to time it): the
  70B FSDP rows are typed with every layer's activations on the GPU (their predicted peak fits neither GPU:
  the offload is what fits them). These rows are compared on the step time; memplan's verdict also puts
  GB300's two 26.02 FP8-MX rows (70B PP 4 VP 5, 405B TP 2 PP 8 CP 2 VP 4) over the driver's memory, where
  they ran (one difference: their fp8_param_gather, not modelled for MXFP8, keeps no 16-bit weights).
- Megatron FSDP's double buffer (``fsdp_double_buffer``) and ``gradient_accumulation_fusion = False``:
  memplan's ZeRO-3 under ``--impl megatron`` (its ``keep_fp8_transpose_cache = False`` is what memplan
  models, ``te_fp8.fsdp_primary``).
- CUDA graphs (25.11's GB200 8B FP8-MX preset, both GB300 8B presets): memplan charges the eager launch
  gaps, and no graph pool.
- ``overlap_param_gather_with_optimizer_step`` and the pipeline's ``overlap_p2p_comm``; TE's fused cross
  entropy; the vocabulary padding (heldout_bridge.py).

Left out, with the reason:
- The 26.02 NVFP4 rows (GB200: Llama 3 70B, 5041, Llama 3.1 405B, 1145; GB300: 6798 and 1347
  tokens/s/GPU): memplan has no NVFP4 recipe (``--fp8`` takes none, tensorwise, rowwise, delayed, mxfp8,
  blockwise).
- The DeepSeekV3 and GPT OSS rows of these tables, for the reasons heldout_bridge.py gives for their H100
  and B200 rows; 25.11's two BF16 Qwen3 235B-A22B rows are typed in heldout_bridge_moe.py, the float8 Qwen3
  30B-A3B and 235B-A22B rows in heldout_bridge_moe_fp8.py.
- The 25.09 section's DGX-GB200 table: it states no precision (heldout_bridge_more.py).
"""

from __future__ import annotations

from benchmarks.heldout_bridge import CUDA_GRAPHS, NOTE, SOURCE, SPLIT, TP_OVERLAP, bridge_run
from benchmarks.heldout_bridge_more import NOTE_2602
from benchmarks.heldout_bridge_more import SOURCE as SOURCE_2602
from benchmarks.heldout_types import Run

FSDP_GB = (
    "Megatron FSDP (optim_grads_params) typed --zero 3 (keep_fp8_transpose_cache False as modelled); its "
    "double buffer and gradient_accumulation_fusion False not modelled"
)
GBS_2511 = "GBS 256 as the table prints it (the 25.11 preset at 0fa501a: 128; the V2 preset at 00919dc: 256)"
LAYOUT_2511 = (
    "layout as the table prints it, the 26.02 V2 preset's (0013c9a; the 25.11 preset at 0fa501a: TP 2, "
    "Megatron FSDP, 128 GPUs)"
)
LAYOUT_2511_GB300 = (
    "layout as the table prints it, the 26.02 FP8-MX V2 preset's (0013c9a); no stored FP8-CS preset has it "
    "(0fa501a: TP 2, Megatron FSDP, 128 GPUs; 0013c9a's V2: TP 4 PP 8 VP 4)"
)
MBS_2511_GB300 = "MBS 2 as the table prints it (GA 8; the preset at 0fa501a and 00919dc's V1: MBS 4)"
SPLIT_VP8 = "405B split with embedding and loss as layers: --pp-layers 0,1,…,1,0 (embedding, loss alone)"
SPLIT_4 = "405B split with embedding and loss as layers: --pp-layers 3,4,…,4,3"
LAYOUT_1 = (1, 1, 1, 1)


def offload(layers: int, gpu: str) -> str:
    """The note of a preset's ``cpu_offloading_num_layers`` (Megatron's activation offload), not typed."""
    return (
        f"not typed: cpu_offloading_num_layers {layers} (Megatron's activation offload to the Grace; "
        f"--offload activations offloads every layer and {gpu} states no host link): every layer's "
        "activations on the GPU"
    )


def _row(
    release: str,
    gpu: str,
    name: str,
    model: str,
    sizes: tuple[int, int, int],
    layout: tuple[int, int, int, int],
    kind: str,
    published: float,
    notes: tuple[str, ...] = (),
    *,
    fsdp: bool = False,
) -> Run:
    """One row of ``release``'s (25.11 or 26.02) DGX-GB200 or -GB300 table: ``sizes`` its (#-GPUs, GBS,
    MBS), ``kind`` FP8-CS (``--fp8 tensorwise``) or FP8-MX (``--fp8 mxfp8``); the recipes' fp8_param_gather,
    typed where modelled."""
    source, note = (SOURCE, NOTE) if release == "25.11" else (SOURCE_2602, NOTE_2602)
    fp8 = {"FP8-CS": "tensorwise", "FP8-MX": "mxfp8"}[kind]
    gpus, gbs, mbs = sizes
    label = f"{name.format(gpus=gpus, gpu=gpu.upper())}, {kind} ({release})"
    return bridge_run(
        label,
        model,
        gpu,
        gpus,
        (gbs, mbs),
        layout,
        fp8,
        published,
        fsdp=fsdp,
        notes=notes,
        source=source,
        note=note,
        gather=True,
    )


L8B = "Llama 3 8B, {gpus} × {gpu}"
L70B = "Llama 3 70B, {gpus} × {gpu}"
L405B = "Llama 3.1 405B, {gpus} × {gpu}"

# (release, GPU, name, model, (#-GPUs, GBS, MBS), (TP, PP, CP, VP), recipe, published tokens/s/GPU, notes,
# Megatron FSDP), in the tables' order
TABLE: tuple[tuple[str, str, str, str, tuple[int, int, int], tuple[int, int, int, int], str, float,
                   tuple[str, ...], bool], ...] = (
    ("25.11", "gb200", L8B, "llama-3-8b", (8, 128, 2), LAYOUT_1, "FP8-CS", 31508, (), False),
    ("25.11", "gb200", L8B, "llama-3-8b", (8, 128, 2), LAYOUT_1, "FP8-MX", 29789, (CUDA_GRAPHS,), False),
    ("25.11", "gb200", L70B + ", FSDP", "llama-3-70b", (64, 256, 2), LAYOUT_1, "FP8-CS", 4312,
     (FSDP_GB, offload(40, "gb200"), GBS_2511), True),
    ("25.11", "gb200", L405B + ", TP 4 PP 16 VP 4", "llama-3.1-405b", (256, 1536, 1), (4, 16, 1, 4), "FP8-CS",
     813, (TP_OVERLAP, SPLIT, LAYOUT_2511), False),
    # 26.02: the V2 presets
    ("26.02", "gb200", L70B + ", FSDP", "llama-3-70b", (64, 256, 2), LAYOUT_1, "FP8-CS", 4040,
     (FSDP_GB, offload(40, "gb200")), True),
    ("26.02", "gb200", L70B + ", TP 2 PP 4 VP 5", "llama-3-70b", (64, 256, 1), (2, 4, 1, 5), "FP8-MX", 3887,
     (TP_OVERLAP,), False),
    ("26.02", "gb200", L405B + ", TP 4 PP 16 VP 4", "llama-3.1-405b", (256, 1536, 1), (4, 16, 1, 4), "FP8-CS",
     793, (TP_OVERLAP, SPLIT), False),
    ("26.02", "gb200", L405B + ", TP 4 PP 16 VP 8", "llama-3.1-405b", (256, 1536, 1), (4, 16, 1, 8), "FP8-MX",
     786, (TP_OVERLAP, SPLIT_VP8), False),
    # GB300, 25.11
    ("25.11", "gb300", L8B, "llama-3-8b", (8, 128, 2), LAYOUT_1, "FP8-CS", 37556,
     (CUDA_GRAPHS, MBS_2511_GB300), False),
    ("25.11", "gb300", L8B, "llama-3-8b", (8, 128, 2), LAYOUT_1, "FP8-MX", 36108,
     (CUDA_GRAPHS, MBS_2511_GB300), False),
    ("25.11", "gb300", L70B + ", FSDP", "llama-3-70b", (64, 256, 2), LAYOUT_1, "FP8-CS", 4520,
     (FSDP_GB, offload(20, "gb300"), GBS_2511), True),
    ("25.11", "gb300", L405B + ", TP 2 PP 8 CP 2 VP 4", "llama-3.1-405b", (256, 1536, 1), (2, 8, 2, 4),
     "FP8-CS", 999, (TP_OVERLAP, SPLIT_4, LAYOUT_2511_GB300), False),
    # 26.02: the V2 presets
    ("26.02", "gb300", L70B + ", FSDP", "llama-3-70b", (64, 256, 2), LAYOUT_1, "FP8-CS", 5003,
     (FSDP_GB, offload(20, "gb300")), True),
    ("26.02", "gb300", L70B + ", PP 4 VP 5", "llama-3-70b", (64, 256, 1), (1, 4, 1, 5), "FP8-MX", 4596, (),
     False),
    ("26.02", "gb300", L405B + ", TP 4 PP 8 VP 4", "llama-3.1-405b", (256, 1536, 1), (4, 8, 1, 4), "FP8-CS",
     988, (TP_OVERLAP, SPLIT_4), False),
    ("26.02", "gb300", L405B + ", TP 2 PP 8 CP 2 VP 4", "llama-3.1-405b", (256, 1536, 1), (2, 8, 2, 4),
     "FP8-MX", 931, (TP_OVERLAP, SPLIT_4), False),
)  # fmt: skip

BRIDGE_GB_RUNS: tuple[Run, ...] = tuple(_row(*row[:-1], fsdp=row[-1]) for row in TABLE)
