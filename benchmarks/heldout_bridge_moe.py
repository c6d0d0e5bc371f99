"""NVIDIA Megatron-Bridge's published pre-training throughput of Qwen3 235B-A22B (a mixture of experts: 94
layers, 128 experts, top-8) in BF16 on DGX-GB300 and DGX-GB200 (NVL72: ``--gpu gb300`` / ``--gpu gb200``),
the "25.11 NeMo Container" tables: rows of the held-out set (benchmarks/heldout.py), typed as the
performance scripts ran them (heldout_bridge.py and heldout_bridge_gb.py type the page's dense Llama rows).

Source (stored copy read): NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md at df0289c, section "25.11
NeMo Container" (another stored copy, whose sections are 25.11 and 25.09, prints the same rows):
- DGX-GB300: Qwen3_235B_a22B, 256 GPUs, BF16, GBS 8192, MBS 2, sequence 4096, FSDP 0, TP 1, PP 4, CP 1,
  VP 12, EP 16, GA 32 → 6131 tokens/s/GPU;
- DGX-GB200: the same model, 256 GPUs, BF16, GBS 8192, MBS 1, sequence 4096, FSDP 0, TP 1, PP 8, CP 1, VP
  3, EP 32, GA 256 → 4916 tokens/s/GPU.
The footnote: "In MoE training benchmarks, we force-balance the token distribution among experts and all
benchmarks are token-dropless." GB200's GA is GBS / (MBS × dp), dp = GPUs / (TP·PP·CP) = 32; GB300's is
not: dp = 256 / 4 = 64 makes 8192 / (2 × 64) = 64 micro-batches, not the printed 32 (no layout of the row
gives 32). Typed as the row's GBS, MBS and layout (64 micro-batches: the interleaved bubble, (p − 1)/(v·m),
is 0.4 % of the step where 32 would make it 0.8 %); the note says so.

The recipes read (stored copies; scripts/performance unless a path says otherwise):
- configs/qwen3/workload_base_configs.py, configs/qwen3/qwen3_llm_pretrain.py, utils/helpers.py and
  utils/utils.py at 0fa501a (the copies heldout_bridge.py reads as 25.11's): 64-GPU presets only —
  ``QWEN3_235B_A22B_GB300_BF16_PARALLEL_CONFIG`` TP 2, EP 64, GBS 1024, MBS 4, ``cuda_graph_impl = "none"``;
  ``..._GB200_BF16_...`` PP 8, EP 8, GBS 1024, MBS 1, CUDA graphs "local" (full_iteration); neither is the
  table's 256-GPU row (nor are 767255d's, also 64 GPUs). ``set_qwen3_common_configs`` (the same at 0fa501a,
  826618b and f29a269): ``bias_activation_fusion = True``, ``recompute_granularity``, ``recompute_method``,
  ``recompute_num_layers`` None (no recompute), ``moe_router_fusion = True``, sequence 4096,
  ``grad_reduce_in_fp32 = False`` (mixed precision and DDP: ``--reduce-dtype bf16``),
  ``moe_router_force_load_balancing = True`` (the footnote's balanced, dropless routing).
- configs/qwen/qwen3_workload_base_configs.py at f29a269, the V2 presets ("num_gpus=256 for Blackwell,
  GBS=8192"): ``QWEN3_235B_A22B_PRETRAIN_CONFIG_GB300_BF16_V2`` is ``..._GB300_BF16_V1`` (TP 1, EP 64, MBS 2,
  ``moe_flex_dispatcher_backend = "hybridep"``, ``cuda_graph_impl = "transformer_engine"``, scope
  ["moe_router", "moe_preprocess"], ``expert_tensor_parallel_size = 1`` from the base) with 256 GPUs, PP 4,
  VP 12, EP 16, GBS 8192 — the table's GB300 row exactly. ``..._GB200_BF16_V2`` is ``..._GB200_BF16_V1`` (PP
  8, EP 8, MBS 1, HybridEP, TE CUDA graphs of ["attn", "moe_router", "moe_preprocess"]) with 256 GPUs, GBS
  8192: PP 8, EP 8 and no VP, not the table's PP 8, VP 3, EP 32. 01b2977's copy has the same GB200 BF16 V2
  (its GB300 BF16 V2: PP 4, EP 32, no VP); its ``..._GB200_FP8_MX_V2`` has the printed layout (PP 8, VP 3,
  EP 32). No stored BF16 preset has the GB200 row's layout: typed as the table prints it, the rest as the
  GB200 BF16 presets set it (the note says so). Neither preset sets ``recompute_modules``,
  ``recompute_num_layers``, ``cpu_offloading_num_layers`` or ``moe_a2a_overlap`` (utils/utils.py at 01b2977:
  ``WorkloadBaseConfig`` defaults None, None, None, False; ``sequence_parallel = TP > 1``).
- configs/qwen/qwen3_llm_pretrain.py at f29a269, ``qwen3_235b_a22b_pretrain_config_gb300`` / ``..._gb200``:
  the library recipe ``qwen3_235b_a22b_pretrain_config()``, ``get_precision_config("bf16")``,
  ``CommOverlapConfig(tp_comm_overlap=True)`` (moot at TP 1), the preset's ``moe_flex_dispatcher_backend``,
  ``set_qwen3_common_configs``, ``set_workload_base_configs``; 826618b's copy passes the backend into the
  recipe instead (``moe_flex_dispatcher_backend=base_cfg.moe_flex_dispatcher_backend``).
- utils/overrides.py at 00538e2: ``set_workload_base_configs`` writes the preset's TP, PP, CP, VP, EP, ETP,
  SP, GBS, MBS, CUDA graphs, ``moe_a2a_overlap`` (False: no expert-parallel overlap), recompute and offload
  (none); ``_set_common_perf_overrides``: TE's cross entropy, RoPE fusion, ``moe_hybridep_num_sms = 32``;
  ``set_post_overrides``: BF16 → ``optimizer.use_precision_aware_optimizer = True``, and
  ``overlap_param_gather_with_optimizer_step`` for dp > 1, pp > 1, vp > 1 (both rows).
- src/megatron/bridge/recipes/qwen/qwen3_moe.py at 2afd2d3 (the no-argument ``qwen3_235b_a22b_pretrain_
  config`` f29a269's scripts call): ``_pretrain_common`` (recipes/common.py at 0eca073: ``distributed_fused_
  adam_with_cosine_annealing``, clipping at 1.0 as heldout_bridge.py reads optimizer_utils.py; bf16_mixed),
  ``account_for_embedding_in_pipeline_split`` and ``account_for_loss_in_pipeline_split`` True,
  ``expert_tensor_parallel_size = 1``, ``moe_token_dispatcher_type = "alltoall"`` with ``moe_flex_dispatcher_
  backend = "deepep"`` (``apply_flex_dispatcher_backend`` at the end), ``moe_grouped_gemm = True``,
  ``moe_permute_fusion = True``, ``cross_entropy_fusion_impl = "te"``, ``recompute_granularity = None``,
  ``fine_grained_activation_offloading = False``, the optimizer's main grads, main params and both Adam
  moments fp32, and the DDP config's ``overlap_grad_reduce``, ``overlap_param_gather``,
  ``use_distributed_optimizer`` True, ``use_megatron_fsdp`` False: ``--zero 1 --overlap-grad-reduce
  --overlap-param-gather --clip-grad``, no checkpointing, no offload.
- src/megatron/bridge/training/flex_dispatcher_backend.py at 183c5c0: DeepEP only on compute capability 8 or
  9 or GPUs named "NVIDIA B200" / "NVIDIA B300" (else the alltoall dispatcher); HybridEP on capability 8, 9,
  10 (GB200, GB300) → ``moe_token_dispatcher_type = "flex"``. Which dispatcher the 25.11 runs used is not
  settled by the copies: 826618b's scripts hand "hybridep" to the recipe, which applies it (flex); f29a269's
  set the backend after the recipe's own "deepep" request fell back to alltoall on GB200/GB300, leaving the
  alltoall type. memplan has no dispatcher option: it times an all-to-all of the routed tokens each way per
  MoE layer, not overlapped (time/comm/collectives.py ``ep_rows``) — as ``moe_a2a_overlap`` False runs it.
- The model: src/megatron/bridge/models/qwen/qwen_provider.py at 07d0d14 (``Qwen3MoEModelProvider235B_A22B``:
  94 layers, hidden 4096, 64 heads, 4 query groups, ``moe_ffn_hidden_size = 1536``, 128 experts, top-8,
  vocabulary 151,936, untied embeddings, no shared expert) and qwen3_moe_bridge.py at 3ec0b0a (the provider
  from the Hugging Face config: ``moe_grouped_gemm = True``, "aux_loss" balancing at 1e-3,
  ``moe_router_pre_softmax = False``, alltoall, ``moe_permute_fusion = True``): memplan's preset
  qwen3-235b-a22b (the Hugging Face config.json; tests/test_heldout.py checks the figures). 151,936 = 1,187 ×
  128: no vocabulary padding at TP 1.

Typed (each row; heldout_types.py's ``megatron_layout``): ``--impl megatron`` in BF16 (no ``--fp8``),
``--zero 1 --overlap-grad-reduce --overlap-param-gather --reduce-dtype bf16 --clip-grad``, ``--pp``,
``--vpp``, ``--ep`` as printed, no checkpointing. The 94 layers: the recipe's embedding-and-loss split
(heldout_bridge.py's ``embedding_loss_split``: (94 + 2)/(PP·VP) a virtual stage, one fewer on the first
and the last) — PP 4 × VP 12: 2 a virtual stage, 1 at the ends (``--pp-layers 1,2,…,2,1``, 48 stages); PP 8
× VP 3: 4, and 3 at the ends (``--pp-layers 3,4,…,4,3``, 24 stages). ``bridge_run`` (heldout_bridge.py) is
not used: it types sequence 8192, float8 and the 405B's split; this module's ``_row`` builds on the same
helpers (``megatron_layout``, ``megatron_stated``, ``embedding_loss_split``), and the dense rows' commands
and notes are untouched. ``--experts`` is ``--impl hf``'s (transformers' experts_implementation): under
``--impl megatron`` it changes no byte (checked: grouped_mm and eager give the same estimate), not typed.

Not typed (each row's note says which):
- TE CUDA graphs (GB300: ["moe_router", "moe_preprocess"]; GB200: with "attn"): memplan charges the eager
  launch gaps and no graph pool.
- ``use_precision_aware_optimizer`` (fp32 main params and moments as the recipe sets them: the bytes of
  memplan's fused Adam), ``overlap_param_gather_with_optimizer_step``, HybridEP's SM count, the router's
  fusion and its auxiliary loss (blocks/moe.py: not counted). TE's fused cross entropy is typed ``--loss
  te`` (heldout_bridge.py).

memplan's verdict, when the rows were typed: neither fitted the GPU (``fit.fits`` false) though both ran:
GB300 reserved 325.0 GiB of 273.2 GiB usable (activations 292.7 GiB: 98 layer-micro-batches in flight on
the busiest stage, 2.99 GiB each); GB200 190.8 of 183.0 GiB (116 in flight, 1.49 GiB each). Neither
recipe recomputes or offloads (the readings above), so this is memplan's activation model, not a setting
left untyped: memplan's Megatron MoE layer is its reference MoE (blocks/megatron.py, "Known limitations":
"MoE token dispatchers (the reference MoE)"), whose combine keeps the expert output and ``index_add_``'s
source, two [S, h] tensors a layer (blocks/moe.py; S = T·k: 1 GiB a layer-micro-batch at MBS 2) — 98.0
GiB of GB300's peak, 58.0 of GB200's; and Qwen3's q/k norms were memplan's unfused RMSNorms (the fp32
input and the normalised output kept) where Megatron-core's TE layer spec builds ``q_layernorm = TENorm``
(stored copies of gpt_layer_specs.py in Megatron-LM forks; the stored NVIDIA copy, efbfb5f, predates
qk_layernorm) — 26.0 and 15.4 GiB. The q/k norms are now TE's fused norms under ``--impl megatron``
(``blocks.norm.qk_norm_rules``): GB300 298.0 GiB reserved (does not fit), GB200 175.4 of 177.9 (fits, as
it ran). Megatron-core's own MoE layer is modelled since (``blocks.moe.megatron``: TE's maps, the grouped
GEMMs' inputs, fc1's output and the probabilities; no [S, h] in the combine): GB300 200.8 of 273.2 GiB,
GB200 118.2 of 177.9 — both fit, as they ran.

Placement: typed first when memplan numbered every implementation's ranks [TP, CP, PP, DP] (expert
parallelism inside dp, stride tp·cp·pp), GB200's EP 32 at PP 8 spanned all 256 ranks — across the 72-GPU
NVLink domains, over the NICs (51.8 s of a predicted 67.8 s step exposed in its all-to-alls: −60.7 %) —
where Megatron-core's ``initialize_model_parallel`` defaults to ``order = "tp-cp-ep-dp-pp"``
(megatron/core/parallel_state.py at 934c826), pp outermost, its EP group 32 consecutive ranks inside one
NVL72 domain. memplan places Megatron's (and torchtitan's) ranks so since (``comm.rows.order``): GB200
+27.2 %, GB300 +7.3 % (EP 16 at PP 4 inside one domain either way).

Left out, with the reason:
- The 26.02 section's Qwen3 235B-A22B and 30B-A3B rows (FP8-MX) and 25.11's Qwen3 30B-A3B (FP8-MX): refused
  by ``--impl megatron --fp8`` with a mixture of experts when these rows were typed ("not modelled (dense
  Transformer Engine layers only)"); typed since, with the other float8 Qwen3 rows, in
  heldout_bridge_moe_fp8.py.
- DeepSeekV3 (BF16 and FP8-MX; MLA is modelled for transformers' code only) and GPT OSS 120B (BF16; its
  attention under ``--impl hf`` only): heldout_bridge.py's reasons.
"""

from __future__ import annotations

from benchmarks.heldout_bridge import SOURCE, SYSTEMS, TE_LOSS, embedding_loss_split
from benchmarks.heldout_types import Run, megatron_layout, megatron_stated

MODEL = "qwen3-235b-a22b"
LAYERS = 94
SEQ = 4096
NOTE = (
    "Megatron-Bridge (Megatron-core + TE, BF16): distributed optimizer with overlapped gradient and "
    "parameter sync, gradients in bf16, no AC, embedding and loss counted in the pipeline split, "
    "force-balanced dropless routing (memplan's S/ep a rank), no expert-parallel overlap, as its "
    "performance recipes set them (Megatron-core's MoE layer: alltoall dispatcher, TE grouped GEMM); "
    "use_precision_aware_optimizer, "
    "overlap_param_gather_with_optimizer_step and the HybridEP dispatcher not modelled"
)
GRAPHS_GB300 = "TE CUDA graphs (moe_router, moe_preprocess) not modelled"
GRAPHS_GB200 = "TE CUDA graphs (attn, moe_router, moe_preprocess) not modelled"
PRESET_GB300 = "layout as the table prints it, f29a269's QWEN3_235B_A22B_PRETRAIN_CONFIG_GB300_BF16_V2"
PRESET_GB200 = (
    "layout as the table prints it; no stored BF16 preset has it (f29a269's and 01b2977's GB200_BF16_V2: "
    "PP 8, EP 8, no VP; 01b2977's GB200_FP8_MX_V2: PP 8, VP 3, EP 32)"
)
PLACED_GB200 = "EP 32 in 32 consecutive ranks (Megatron's tp-cp-ep-dp-pp order): inside one NVL72 domain"
GA_GB300 = (
    "the printed GA 32 disagrees with the row's layout: 8192 / (2 × dp 64) = 64 micro-batches, as typed"
)


def _row(
    gpu: str,
    sizes: tuple[int, int, int],
    layout: tuple[int, int, int, int],
    ep: int,
    published: float,
    notes: tuple[str, ...],
) -> Run:
    """One BF16 row of the 25.11 tables: ``sizes`` its (#-GPUs, GBS, MBS), ``layout`` its (TP, PP, CP, VP),
    ``ep`` its EP (from the data-parallel ranks); the 94 layers split with the embedding and the loss."""
    gpus, gbs, mbs = sizes
    tp, pp, cp, vp = layout
    dp = gpus // (tp * pp * cp)
    assert dp * tp * pp * cp == gpus and gbs % (mbs * dp) == 0 and dp % ep == 0, gpu
    parts = [
        f"-m {MODEL} --seq {SEQ} --batch {mbs} --global-batch {gbs} --gpus {gpus} --gpu {gpu}",
        "--impl megatron",
        "--zero 1 --overlap-grad-reduce --overlap-param-gather --reduce-dtype bf16 --clip-grad",
        TE_LOSS,
        *megatron_layout(layout, embedding_loss_split(LAYERS, pp, vp)),
        f"--ep {ep}",
    ]
    stated = megatron_stated(MODEL, gpu, (gpus, SEQ, mbs, gbs), layout, 1, "none", ep=ep, loss="te")
    name = f"Qwen3 235B-A22B, {gpus} × {gpu.upper()}, PP {pp} VP {vp} EP {ep}, BF16 (25.11)"
    return Run(
        name, f"{SOURCE}, {SYSTEMS[gpu]}", stated, published, " ".join(parts), "; ".join((NOTE, *notes))
    )


BRIDGE_MOE_RUNS: tuple[Run, ...] = (
    _row("gb300", (256, 8192, 2), (1, 4, 1, 12), 16, 6131, (GRAPHS_GB300, PRESET_GB300, GA_GB300)),
    _row("gb200", (256, 8192, 1), (1, 8, 1, 3), 32, 4916, (GRAPHS_GB200, PRESET_GB200, PLACED_GB200)),
)
