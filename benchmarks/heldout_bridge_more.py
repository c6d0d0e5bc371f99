"""NVIDIA Megatron-Bridge's published pre-training throughput of dense Llama models on DGX-H100 and DGX-B200
in the "26.02 NeMo Container" and "25.09 NeMo Container" tables: rows of the held-out set
(benchmarks/heldout.py), typed as the performance scripts of those releases ran them (heldout_bridge.py types
the 25.11 table of the same page, and holds the readings both share).

Source (stored copy read): NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md at df0289c, sections
"26.02 NeMo Container" (DGX-GB300, -GB200, -B300, -B200, -H100; a Precision column) and "25.09 NeMo
Container" (DGX-GB200, -B200, -H100; no Precision column; "(…)" figures are "different quantization
granularities: In case of GB200 and B200 systems, 32×32 for both weights and activations"). The dense
Llama rows of DGX-H100 and DGX-B200 typed here: 26.02 H100 Llama 3 70B and Llama 3.1 405B (FP8-CS; 26.02's
B200 table has no Llama row); 25.09 H100 Llama 3 8B, 70B, 3.1 405B and B200 Llama 3 8B, 3.1 405B (each
B200 row two figures). Every row's GA is GBS / (MBS × dp), dp = GPUs / (TP·PP·CP).

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

25.09 — the scripts of that container are the YAML ``perf_matrix`` generation: PR #982 (October 2025, #976
cherry-picked into r0.1.0, the release branch before r0.2.0, which carries the 25.11 tables) tests
``setup_experiment.py … --config_file scripts/performance/configs/llama3/llama3_8b_llm_pretrain.yaml``. Read
(stored copies; their H100 and B200 entries are the table's rows):
- configs/llama3/llama3_8b_llm_pretrain.yaml and llama3_70b_llm_pretrain.yaml (0aa7db3),
  configs/llama31/llama31_405b_llm_pretrain.yaml (0cfe9a4): ``perf_matrix`` — 8B H100: MBS 1, GBS 128, TP
  and PP 1, float8 ``cp: 1, use_megatron_fsdp: true, nccl_ub: true``; 8B B200: MBS 2, GBS 128,
  ``cuda_graphs: true``; 70B H100: MBS 1, GBS 128, TP 4, VP 5, float8 PP 8 CP 1; 405B H100: MBS 1, GBS 512,
  TP 8, PP 8, CP 2, VP 8; 405B B200: MBS 1, GBS 64, TP 4, PP 8, CP 2, VP 8. None sets
  ``recompute_num_layers``: no checkpointing.
  ``ConfigContainer``: ``mixed_precision: grad_reduce_in_fp32: false`` (copied into the DDP config by
  ``MixedPrecisionConfig.setup``: ``--reduce-dtype bf16``), ``cross_entropy_fusion_impl: "te"``,
  ``use_transformer_engine_op_fuser: true`` for 8B and 70B (false for 405B).
- utils/helpers.py (0aa7db3): ``get_precision_config`` ("cs": current scaling with ``first_last_layers_bf16
  = False``; "mx": ``bf16_with_mxfp8_mixed()``); ``COMM_OVERLAP_CONFIG_MAP`` (the float8 userbuffers
  configurations of 70B and 405B on H100 and B200); ``set_megatron_fsdp_overrides`` (``optim_grads_params``:
  ``--zero 3``); ``set_cuda_graph_overrides`` (``enable_cuda_graph``); ``apply_perf_matrix_overrides``
  (sequence parallelism = TP > 1).
- scripts/performance/run_script.py (a stored YAML-era copy; the index names no commit for it): the recipe
  ``pretrain_config(mock=True, precision_config=…)``, the map's userbuffers configuration, the YAML and its
  perf_matrix; then the op fuser off under MXFP8 or FSDP, and for Llama under FSDP: ``nccl_ub`` (8B H100) and
  ``gradient_accumulation_fusion = False`` (8B, 70B).
- src/megatron/bridge/recipes/llama/llama3_8b.py (1c6b292), llama3_70b.py (203599b), llama31_405b.py
  (3594df9): the distributed optimizer with both overlaps, ``distributed_fused_adam_with_cosine_annealing``
  (``clip_grad`` 1.0), no recompute; 70B and 405B ``CommOverlapConfig(tp_comm_overlap=True, …)``
  (``--tp-comm-overlap`` with TP ≥ 2 and SP), 8B ``tp_comm_overlap=False``; 405B ``account_for_embedding_in_
  pipeline_split`` and ``account_for_loss_in_pipeline_split`` (the 1,2,…,2,1 split). Their NullTokenizer
  vocabulary (8B, 70B: 128,256; 405B: ``DEFAULT_NULL_TOKENIZER_VOCAB_SIZE``, tokenizer_utils.py not stored)
  and any padding: not typed (memplan's presets hold 128,256).
- training/mixed_precision.py of the time (the stored copies whose ``bf16_with_mxfp8_mixed`` sets
  ``fp8_param_gather = False``): current scaling sets it True (``--fp8-param-gather`` where modelled), MXFP8
  False (16-bit primary weights, typed so).
- The precision: the 25.09 table states none. Read as FP8-CS, with FP8-MX the bracketed B200 figures: the
  page's later copy (df0289c) gives the brackets 32×32 blocks on B200 (MXFP8, as heldout_bridge.py reads the
  same footnote), and the 25.11 table prints the same presets' figures as "FP8-CS (FP8-MX)"; the 8B H100
  row's FSDP 1 is a float8 preset's (the BF16 one runs CP 2 under DDP). Not certain: the YAMLs hold
  ``fp8_ds`` (delayed scaling) entries with the same layouts, and the argument_parser.py of that generation
  (the stored copy with ``--config_file``, ``--use_nccl_ub``) defaults ``--fp8_recipe`` to "ds": each row's
  note says the recipe is read, not stated. (Typed ``--fp8 delayed --fp8-amax-history-len 1024`` instead, the
  CS rows' predictions rise by 1 to 3 %.)

Not typed (each row's note says which; the shared ones as in heldout_bridge.py): TE's op fuser; CUDA graphs
(25.09 8B B200: Megatron's ``enable_cuda_graph``); the pipeline's ``overlap_p2p_comm``;
``overlap_param_gather_with_optimizer_step``; Megatron FSDP's own buffers (``nccl_ub``); TE's fused cross
entropy; the userbuffers configurations' ring-exchange buffers.

Left out, with the reason:
- DGX-GB300, DGX-GB200 (both sections) and DGX-B300 (26.02) rows: no Grace-Blackwell or B300 preset.
- 26.02 B200 and H100 and 25.09 B200 and H100 rows of DeepSeekV3 (FP8-MX; MLA, MTP) and Qwen3 30B-A3B and
  235B-A22B (FP8-MX, FP8-CS, or the unstated 25.09 float8): ``--impl megatron --fp8`` with experts is refused;
  GPT OSS 120B (BF16): memplan models gpt-oss's attention under ``--impl hf`` only.
"""

from __future__ import annotations

from benchmarks.heldout_bridge import B200_405B, FSDP, H100_405B, NOTE, SPLIT, TP_OVERLAP, bridge_run
from benchmarks.heldout_types import Run

RELEASES = {
    # the table's container → (the row's source, the readings every row of it shares)
    "26.02": (
        "Megatron-Bridge performance-summary.md (26.02)",
        NOTE.replace("performance recipes", "26.02 performance recipes (*_V2 presets)"),
    ),
    "25.09": (
        "Megatron-Bridge performance-summary.md (25.09)",
        NOTE.replace("performance recipes", "25.09 performance recipes (YAML perf_matrix)"),
    ),
}
PRECISION = (
    "float8 recipe not stated by the 25.09 table: read as FP8-CS (brackets FP8-MX) as the 25.11 table labels "
    "these presets; the YAMLs also hold fp8_ds (delayed scaling) entries"
)
OP_FUSER = "TE op fuser (use_transformer_engine_op_fuser) not modelled"
GRAPHS = "CUDA graphs (enable_cuda_graph) not modelled"
H100_70B = (4, 8, 1, 5)
ONE = (1, 1, 1, 1)


def _row(
    release: str,
    name: str,
    model: str,
    gpus: int,
    batches: tuple[int, int],
    layout: tuple[int, int, int, int],
    kind: str,
    published: float,
    *,
    fsdp: bool = False,
    notes: tuple[str, ...] = (),
) -> Run:
    """One row of the ``release`` table: ``kind`` FP8-CS (``--fp8 tensorwise``) or FP8-MX (``--fp8 mxfp8``);
    the GPU is the name's (× H100: DGX-H100, × B200: DGX-B200). The 25.09 recipes' MXFP8 sets no
    fp8_param_gather, and their float8 recipe is read, not stated (``PRECISION``)."""
    source, note = RELEASES[release]
    fp8 = {"FP8-CS": "tensorwise", "FP8-MX": "mxfp8"}[kind]
    gpu = "h100-sxm" if "× H100" in name else "b200"
    notes = ((PRECISION,) if release == "25.09" else ()) + notes
    gather = not (release == "25.09" and fp8 == "mxfp8")
    label = f"{name}, {kind} ({release})"
    return bridge_run(
        label,
        model,
        gpu,
        gpus,
        batches,
        layout,
        fp8,
        published,
        fsdp=fsdp,
        notes=notes,
        source=source,
        note=note,
        gather=gather,
    )


B200_8B = ("Llama 3 8B, 8 × B200", "llama-3-8b", 8, (128, 2), ONE)
B200_405B_ROW = ("Llama 3.1 405B, 128 × B200, TP 4 PP 8 CP 2 VP 8", "llama-3.1-405b", 128, (64, 1), B200_405B)

BRIDGE_MORE_RUNS: tuple[Run, ...] = (
    # 26.02, DGX-H100 (the *_V2 presets)
    _row(
        "26.02",
        "Llama 3 70B, 64 × H100, TP 4 PP 8 VP 5, GBS 256",
        "llama-3-70b",
        64,
        (256, 1),
        H100_70B,
        "FP8-CS",
        1621,
        notes=(TP_OVERLAP,),
    ),
    _row(
        "26.02",
        "Llama 3.1 405B, 1024 × H100, TP 8 PP 8 CP 2 VP 8, GBS 1536",
        "llama-3.1-405b",
        1024,
        (1536, 1),
        H100_405B,
        "FP8-CS",
        311,
        notes=(TP_OVERLAP, SPLIT),
    ),
    # 25.09, DGX-H100
    _row(
        "25.09",
        "Llama 3 8B, 8 × H100, FSDP",
        "llama-3-8b",
        8,
        (128, 1),
        ONE,
        "FP8-CS",
        14079,
        fsdp=True,
        notes=(FSDP,),
    ),
    _row(
        "25.09",
        "Llama 3 70B, 64 × H100, TP 4 PP 8 VP 5",
        "llama-3-70b",
        64,
        (128, 1),
        H100_70B,
        "FP8-CS",
        1619,
        notes=(TP_OVERLAP, OP_FUSER),
    ),
    _row(
        "25.09",
        "Llama 3.1 405B, 1024 × H100, TP 8 PP 8 CP 2 VP 8",
        "llama-3.1-405b",
        1024,
        (512, 1),
        H100_405B,
        "FP8-CS",
        302,
        notes=(TP_OVERLAP, SPLIT),
    ),
    # 25.09, DGX-B200: each "a (b)" figure an FP8-CS and a bracketed FP8-MX row
    _row("25.09", *B200_8B, "FP8-CS", 29994, notes=(GRAPHS, OP_FUSER)),
    _row("25.09", *B200_8B, "FP8-MX", 29388, notes=(GRAPHS,)),
    _row("25.09", *B200_405B_ROW, "FP8-CS", 664, notes=(TP_OVERLAP, SPLIT)),
    _row("25.09", *B200_405B_ROW, "FP8-MX", 622, notes=(TP_OVERLAP, SPLIT)),
)
