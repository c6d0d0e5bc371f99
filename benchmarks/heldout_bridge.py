"""NVIDIA Megatron-Bridge's published pre-training throughput of dense Llama models on DGX-H100 and DGX-B200
(NeMo container 25.11, Megatron-core with Transformer Engine, float8): rows of the held-out set
(benchmarks/heldout.py), typed as its performance recipes ran them.

Source (stored copy read): NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md at 00b7660, the version
whose only section is "25.11 NeMo Container" (the copy at df0289c holds the same 25.11 tables below a
26.02 section and above a 25.09 one). Each row states the model, #-GPUs, precision, GBS, MBS, sequence
length, FSDP (1: Megatron FSDP, 0: DDP), TP, PP, CP, VP, EP, GA and the measured tokens/s per GPU (and model
TFLOP/s per GPU, not used here); "FP8-CS (FP8-MX)" rows give both recipes' figures, the second in brackets.

The recipes the table points to (scripts/performance), stored copies at 0fa501a: configs/llama3/ and
configs/llama31/workload_base_configs.py (each row's preset: layout, MBS, GBS, use_megatron_fsdp, CUDA
graphs — the stored version whose H100 and B200 presets are the table's rows; the later
configs/llama/llama3_workload_base_configs.py at 00919dc runs the 8B H100 FP8-CS preset under DDP with
recompute_num_layers 5, not the table's FSDP 1), configs/llama3/llama3_llm_pretrain.py,
configs/llama31/llama31_llm_pretrain.py, utils/helpers.py, utils/utils.py; the library's
src/megatron/bridge/recipes/llama/llama3.py (the stored copy whose recipes take ``**user_kwargs`` into
``_llama3_common``, as those scripts call them), training/mixed_precision.py (0509780),
training/comm_overlap.py (0685ff5), recipes/utils/optimizer_utils.py (0d7a394).

Readings (what the table does not state; ``NOTE`` on each row):
- The stack: Megatron-core GPT with TE. "FP8-CS" is ``get_precision_config("fp8", "cs")`` (helpers.py):
  ``bf16_with_fp8_current_scaling_mixed()`` — fp8 "hybrid", fp8_recipe "tensorwise" (TE's
  Float8CurrentScaling) — with ``first_last_layers_bf16 = False`` (every layer in float8): typed ``--impl
  megatron --fp8 tensorwise``. "FP8-MX" is ``bf16_with_mxfp8_mixed()`` (fp8_recipe "mxfp8", TE's
  MXFP8BlockScaling): ``--fp8 mxfp8``. Both set ``fp8_param_gather = True`` (mixed_precision.py at
  0509780; an older stored copy sets it False for MXFP8): float8 primary weights, gathered in float8 —
  typed ``--fp8-param-gather`` on the current-scaling rows with the distributed optimizer; memplan
  models it for per-tensor recipes under ``--zero 1`` only, so the MXFP8 rows and the Megatron-FSDP row
  keep 16-bit weights beside TE's float8 cache (each row's note says which). The
  table's footnote gives B200's bracketed figures "32×32" blocks; MXFP8 scales 1×32 blocks, and the
  header and the recipes (``fp8_recipe == "mx"``) name MXFP8: read as MXFP8.
- The optimizer: ``_llama3_common``'s ``DistributedDataParallelConfig(overlap_grad_reduce=True,
  overlap_param_gather=True, use_distributed_optimizer=True)`` with ``distributed_fused_adam_with_cosine_
  annealing`` (optimizer "adam", ``clip_grad=1.0``); ``CommOverlapConfig.setup`` sets both overlaps again
  for dp > 1: ``--zero 1 --overlap-grad-reduce --overlap-param-gather --clip-grad``. FSDP 1 (the 8B H100
  row): ``set_megatron_fsdp_overrides`` — Megatron FSDP, ``data_parallel_sharding_strategy =
  "optim_grads_params"`` (parameters, gradients and optimizer states sharded): ``--zero 3``. The scripts'
  ``set_llama3(1)_common_configs`` set ``grad_reduce_in_fp32 = False``: ``--reduce-dtype bf16``.
- The layout: ``set_workload_base_configs`` writes the preset's TP, PP, CP, VP, MBS and GBS (the 8B
  recipe's own CP 2 becomes the preset's 1); ``WorkloadBaseConfig.sequence_parallel = TP > 1``: ``--sp``
  with TP; sequence 8192 (the common configs). No preset of these rows sets ``recompute_num_layers``
  and ``_llama3_common`` sets no recompute: no checkpointing.
- Llama 3.1 405B's 126 layers: ``llama31_405b_pretrain_config`` sets ``account_for_embedding_in_pipeline_
  split`` and ``account_for_loss_in_pipeline_split``; Megatron-core's ``get_num_layers_to_build``
  (transformer_block.py, read in stored copies of the function: the stored NVIDIA/Megatron-LM copy
  predates the options) counts the embedding and the loss as a layer each — (126 + 2)/(PP·VP) = 2 per
  virtual stage — and builds one fewer on the first virtual stage of the first rank and on the last of the
  last: typed ``--pp-layers 1,2,…,2,1`` (the 64 virtual stages in model order).
- Context parallelism: no ``cp_comm_type`` is set; Megatron-core's ``TEDotProductAttention`` then passes
  TE "p2p" (its ring of point-to-point K/V sends): ``--cp-rotate alltoall``, as heldout_nemo.py types it.
- Models: memplan's presets llama-3-8b and llama-3-70b (the recipes' hf_path meta-llama/Meta-Llama-3-8B,
  -70B) and llama-3.1-405b. The scripts set ``should_pad_vocab = True`` for the 128,256-token vocabulary:
  Megatron would pad it to a multiple of 128·TP (128,512 at TP 4, 129,024 at TP 8, ≤ 0.6 % of the head);
  memplan holds ⌈v/t⌉ rows (strategies/tensor_parallel.py): not typed.
- GPUs: DGX-H100 ``--gpu h100-sxm``, DGX-B200 ``--gpu b200`` (both presets: 8 GPUs a node on NVSwitch,
  one 400 Gb/s NIC per GPU).

- TE's tensor-parallel communication overlap: the 70B and 405B recipes (recipes/llama/llama3.py) build
  ``CommOverlapConfig(tp_comm_overlap=True)`` and the scripts pick the float8 userbuffers configurations
  (``userbuffers_fp8_h100_h8192_tp4_mbs1_seqlen8192``, ``..._h100_h16384_tp8_cp2_...``,
  ``..._b200_h16384_tp4_cp2_...``: training/comm_overlap.py); ``_get_model_comm_overlap_cfgs`` keeps it
  with TP ≥ 2 and sequence parallelism, which these rows have (25.11 applies the scripts' configuration:
  ``finalize``, PR #1395 cherry-picked into r0.2.0): typed ``--tp-comm-overlap`` (TE's default methods;
  those configurations run W_O's and W_fc2's reduce-scatters as ring exchanges, whose buffers are
  (2t − 1)/t of [T, h], not typed: memplan holds TE's default one [T, h] each).

Not typed, each run's note says which (memplan has no option for them):
- ``overlap_p2p_comm`` under VP (comm_overlap.py): memplan's pipeline sends are not overlapped;
  ``overlap_param_gather_with_optimizer_step`` (helpers.py, dp > 1, pp > 1, vp > 1): memplan overlaps the
  parameter gather with the next forward.
- CUDA graphs (the 8B B200 preset: ``cuda_graph_impl = "local"``, scope "full_iteration", which 0fa501a's
  ``set_user_overrides`` may overwrite with the command line's scope): memplan charges the eager launch
  gaps, and no graph pool in memory.
- Megatron FSDP's own buffers and switches (``nccl_ub``, ``gradient_accumulation_fusion = False``):
  memplan's ZeRO-3 under ``--impl megatron``.
- TE's attention backend is not set (TE chooses): memplan's default kernel.

Typed since (every Megatron-Bridge row of this module and its siblings): TE's fused cross entropy,
``--loss te`` — GPTModelProvider's ``cross_entropy_loss_fusion: bool = True`` ("Generally beneficial",
src/megatron/bridge/models/gpt_provider.py at 0254ddd; the Llama and Qwen3 providers keep it) with the
performance scripts' ``cross_entropy_fusion_impl = "te"`` (above; Megatron-core's ``compute_language_model_
loss`` then calls ``te_parallel_cross_entropy``); before it the rows were typed with memplan's Megatron
vocabulary-parallel cross entropy (its fp32 softmax [T, v/t] kept, two more in its backward). The step
times do not move (the loss's element-wise work is not timed); the verdicts do.

Left out, with the reason:
- DGX-GB200 and DGX-GB300 rows: typed in benchmarks/heldout_bridge_gb.py (the gb200 and gb300 presets), the
  BF16 Qwen3 235B-A22B rows in benchmarks/heldout_bridge_moe.py.
- GPT OSS 120B (BF16, H100 and B200): memplan models gpt-oss's sliding-window and sink attention under
  ``--impl hf`` only ("sliding_window_pattern: modelled for transformers' code only"): Megatron's run
  cannot be typed. (The H100 row's GA 2 also disagrees with its own layout: 64 GPUs at PP 4 leave dp 16,
  and GBS 512 / (MBS 4 × 16) = 8.)
- Qwen3 30B-A3B and 235B-A22B (FP8-CS on H100, FP8-MX on B200): typed in benchmarks/heldout_bridge_moe_fp8.py
  but the H100 235B-A22B row (its EP 32 drawn across TP × DP, which ``--ep`` cannot express; the reason
  there). DeepSeekV3 (FP8-MX on B200): its MLA and MTP are not modelled under ``--impl megatron``, and
  ``--fp8`` with experts refuses shared experts and dense first layers.
- The df0289c copy's 26.02 and 25.09 tables: other containers, whose recipes are other versions
  (26.02's H100 Llama rows are the later ``*_V2`` presets): 26.02's typed from its version in
  benchmarks/heldout_bridge_more.py; 25.09's states no precision (left out there, with the reason).
"""

from __future__ import annotations

from benchmarks.heldout_types import Run, megatron_layout, megatron_stated

SOURCE = "Megatron-Bridge performance-summary.md (25.11)"
SEQ = 8192
LAYERS_405B = 126
NOTE = (
    "Megatron-Bridge (Megatron-core + TE float8): distributed optimizer with overlapped gradient and "
    "parameter sync, gradients in bf16, SP with TP, no AC, as its performance recipes set them"
)
PRIMARY = "fp8_param_gather typed --fp8-param-gather (float8 primary weights)"
TE_LOSS = "--loss te"
"""Megatron-Bridge's loss: TE's fused cross entropy (module docstring)."""
PRIMARY_MX = (
    "fp8_param_gather with reuse_grad_buf_for_mxfp8_param_ag typed --fp8-param-gather (MXFP8 primary "
    "weights, gathered in bf16 into the gradient buffer)"
)
NO_PRIMARY = "not typed: fp8_param_gather (MXFP8 primary weights; not modelled under Megatron FSDP)"
NO_GATHER = "fp8_param_gather False in that MXFP8 recipe: 16-bit primary weights, as typed"
FSDP = "Megatron FSDP (optim_grads_params) typed --zero 3; nccl_ub not modelled"
TP_OVERLAP = "TE TP comm overlap typed --tp-comm-overlap; the pipeline's p2p overlap not modelled"
CUDA_GRAPHS = "CUDA graphs (local, full_iteration) not modelled"
SPLIT = "405B split with embedding and loss as layers: --pp-layers 1,2,…,2,1"
SYSTEMS = {
    "h100-sxm": "DGX-H100",
    "b200": "DGX-B200",
    "b300": "DGX-B300",
    "gb200": "DGX-GB200",
    "gb300": "DGX-GB300",
}
"""The page's system headings by memplan's GPU preset (heldout_bridge_gb.py: the GB200 and GB300 rows)."""


def embedding_loss_split(layers: int, pp: int, vpp: int) -> tuple[int, ...]:
    """Layers of each virtual stage, model order, under Megatron-core's ``account_for_embedding_in_pipeline_
    split`` and ``account_for_loss_in_pipeline_split`` (``get_num_layers_to_build``): (L + 2)/(p·v) each,
    one fewer on the first (the embedding) and on the last (the loss)."""
    per, rest = divmod(layers + 2, pp * vpp)
    assert rest == 0, (layers, pp, vpp)
    counts = [per] * (pp * vpp)
    counts[0] -= 1
    counts[-1] -= 1
    return tuple(counts)


def bridge_run(
    name: str,
    model: str,
    gpu: str,
    gpus: int,
    batches: tuple[int, int],
    layout: tuple[int, int, int, int],
    fp8: str,
    published: float,
    *,
    fsdp: bool = False,
    notes: tuple[str, ...] = (),
    source: str = SOURCE,
    note: str = NOTE,
    gather: bool = True,
) -> Run:
    """One row: ``batches`` is the table's (GBS, MBS), ``layout`` its (TP, PP, CP, VP); data parallelism is
    the GPUs left over; ``fp8`` memplan's recipe (tensorwise: FP8-CS, mxfp8: FP8-MX); ``source`` and ``note``
    the table's container and the readings every row of it shares (heldout_bridge_more.py: 26.02);
    ``gather``: the recipe sets fp8_param_gather."""
    gbs, mbs = batches
    tp, pp, cp, vp = layout
    dp = gpus // (tp * pp * cp)
    assert dp * tp * pp * cp == gpus and gbs % (mbs * dp) == 0, name
    zero = 3 if fsdp else 1
    parts = [
        f"-m {model} --seq {SEQ} --batch {mbs} --global-batch {gbs} --gpus {gpus} --gpu {gpu}",
        f"--impl megatron --fp8 {fp8}",
        f"--zero {zero} --overlap-grad-reduce --overlap-param-gather --reduce-dtype bf16 --clip-grad",
        TE_LOSS,
    ]
    split = embedding_loss_split(LAYERS_405B, pp, vp) if model == "llama-3.1-405b" else ()
    # the recipes' CommOverlapConfig(tp_comm_overlap=True), kept with TP ≥ 2 and sp (module docstring)
    parts += megatron_layout(layout, split, userbuffers=tp > 1)
    # the recipes' fp8_param_gather (MXFP8's with reuse_grad_buf_for_mxfp8_param_ag), where modelled: every
    # recipe but MXFP8 under Megatron FSDP
    primary = gather and not (fp8 == "mxfp8" and fsdp)
    parts += ["--fp8-param-gather"] if primary else []
    stated = megatron_stated(model, gpu, (gpus, SEQ, mbs, gbs), layout, zero, fp8, loss="te")
    system = SYSTEMS[gpu]
    kept = (PRIMARY_MX if fp8 == "mxfp8" else PRIMARY) if primary else NO_PRIMARY if gather else NO_GATHER
    note = "; ".join((note, kept, *notes))
    return Run(name, f"{source}, {system}", stated, published, " ".join(parts), note)


H100_405B = (8, 8, 2, 8)
B200_405B = (4, 8, 2, 8)

BRIDGE_RUNS: tuple[Run, ...] = (
    bridge_run(
        "Llama 3 8B, 8 × H100, FSDP, FP8-CS",
        "llama-3-8b",
        "h100-sxm",
        8,
        (128, 1),
        (1, 1, 1, 1),
        "tensorwise",
        14451,
        fsdp=True,
        notes=(FSDP,),
    ),
    bridge_run(
        "Llama 3 70B, 64 × H100, TP 4 PP 8 VP 5, FP8-CS",
        "llama-3-70b",
        "h100-sxm",
        64,
        (128, 1),
        (4, 8, 1, 5),
        "tensorwise",
        1602,
        notes=(TP_OVERLAP,),
    ),
    bridge_run(
        "Llama 3.1 405B, 1024 × H100, TP 8 PP 8 CP 2 VP 8, FP8-CS",
        "llama-3.1-405b",
        "h100-sxm",
        1024,
        (512, 1),
        H100_405B,
        "tensorwise",
        292,
        notes=(TP_OVERLAP, SPLIT),
    ),
    *(
        bridge_run(
            f"Llama 3 8B, 8 × B200, {kind}",
            "llama-3-8b",
            "b200",
            8,
            (128, 2),
            (1, 1, 1, 1),
            fp8,
            tps,
            notes=(CUDA_GRAPHS,),
        )
        for kind, fp8, tps in (("FP8-CS", "tensorwise", 30624), ("FP8-MX", "mxfp8", 29521))
    ),
    *(
        bridge_run(
            f"Llama 3.1 405B, 128 × B200, TP 4 PP 8 CP 2 VP 8, {kind}",
            "llama-3.1-405b",
            "b200",
            128,
            (64, 1),
            B200_405B,
            fp8,
            tps,
            notes=(TP_OVERLAP, SPLIT),
        )
        for kind, fp8, tps in (("FP8-CS", "tensorwise", 661), ("FP8-MX", "mxfp8", 624))
    ),
)
