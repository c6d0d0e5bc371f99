"""NVIDIA Megatron-Bridge's published pre-training throughput of Qwen3 30B-A3B and 235B-A22B (mixtures of
experts: 48 and 94 layers, 128 experts, top-8) in float8 — FP8-CS (TE current scaling, ``--fp8 tensorwise``)
and FP8-MX (MXFP8, ``--fp8 mxfp8``) — on DGX-GB300, -GB200, -B300, -B200 and -H100, the "25.11 NeMo
Container" and "26.02 NeMo Container" tables: rows of the held-out set (benchmarks/heldout.py), typed as
the performance scripts ran them (heldout_bridge_moe.py types the 25.11 BF16 Qwen3 rows, heldout_bridge.py and
heldout_bridge_gb.py the dense float8 Llama rows, whose readings of the float8 recipes this module shares).

Source (stored copies read): NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md at 00b7660 (its only
section "25.11 NeMo Container") and at df0289c (sections 26.02, 25.11, 25.09). Every row: sequence 4096,
FSDP 0, CP 1, TP 1 (but the H100 235B rows), GA = GBS / (MBS × dp), dp = GPUs / (TP·PP·CP); VP "n/a" read
as 1; the footnote "In MoE training benchmarks, we force-balance the token distribution among experts and
all benchmarks are token-dropless."; no Qwen3 row has bracketed figures. Typed (tokens/s per GPU):
- 25.11: GB300 30B-A3B 8 GPUs FP8-MX, GBS 512, MBS 4, EP 8, GA 16 → 28934; GB200 30B-A3B, the same → 23766;
  B200 30B-A3B 8 GPUs FP8-MX, GBS 512, MBS 1, EP 8, GA 64 → 9299; B200 235B-A22B 64 GPUs FP8-MX, GBS 1024,
  MBS 1, PP 8, VP 2, EP 8, GA 128 → 3269; H100 30B-A3B 16 GPUs FP8-CS, GBS 512, MBS 2, PP 2, VP 24, EP 8, GA
  32 → 5275.
- 26.02 (df0289c only): GB300 30B-A3B 8 GPUs FP8-MX, GBS 512, MBS 8, EP 8, GA 8 → 30376; GB300 235B-A22B 256
  GPUs FP8-MX, GBS 8192, MBS 2, PP 4, EP 32, GA 64 → 6583; GB200 30B-A3B 8 GPUs, GBS 512, MBS 4, EP 8, GA 16
  → 26084; GB200 235B-A22B 256 GPUs, GBS 8192, MBS 1, PP 8, EP 32, GA 256 → 5448; B300 30B-A3B 8 GPUs, GBS
  512, MBS 8, EP 8, GA 8 → 29521; B300 235B-A22B 256 GPUs, GBS 8192, MBS 1, PP 8, VP 4, EP 8, GA 256 → 2691
  (the b300 preset, added after the first twelve were typed); B200 30B-A3B 8 GPUs, GBS
  512, MBS 1, EP 8, GA 64 → 9691; B200 235B-A22B 256 GPUs, GBS 8192, MBS 1, PP 8, EP 8, GA 256 → 3805 (all
  FP8-MX); H100 30B-A3B 16 GPUs FP8-CS, GBS 1024, MBS 1, PP 2, VP 12, EP 8, GA 128 → 2557.

The recipes read (stored copies; scripts/performance unless a path says otherwise):
- 25.11: configs/qwen3/workload_base_configs.py, configs/qwen3/qwen3_llm_pretrain.py and utils/helpers.py at
  0fa501a (the copies heldout_bridge.py reads as 25.11's): the scripts take
  ``QWEN3_<SIZE>_<GPU>_FP8_{CS,MX}_PARALLEL_CONFIG`` — GB300 and GB200 30B-A3B EP 8, GBS 512, MBS 8 (GB300)
  and 4 (GB200), ``cuda_graph_impl = "local"`` with scope "full_iteration"; B200 30B-A3B EP 8, MBS 1, the
  same graphs; B200 235B-A22B PP 8, VP 2, EP 8, GBS 1024, MBS 1, no graphs; H100 30B-A3B PP 2, VP 12, EP 8,
  MBS 2, GBS 512, no graphs. Another stored copy of the same path, 767255d (``*_BASE_CONFIG`` with
  ``num_gpus``), holds the same layouts with TE-scoped CUDA graphs (attn, moe_router, moe_preprocess) on the
  30B-A3B Blackwell presets and ``moe_a2a_overlap = True`` on the B200 235B-A22B and H100 presets; which of
  the two the container shipped is not settled (notes say where they differ). configs/qwen3/
  qwen3_30b_a3b_llm_pretrain.py at 4054233 (the per-GPU scripts before the preset files): H100 16 GPUs PP 2,
  VP 12, EP 8, MBS 2, GBS 512. No 25.11 library recipe copy at 0fa501a is stored: src/megatron/bridge/
  recipes/qwen/qwen3_moe.py in its ``**user_kwargs`` / ``_qwen3_moe_common`` version (the index names no
  commit) is read as the one those scripts call: the 235B-A22B's embedding-and-loss split, TE's cross
  entropy, the distributed optimizer with both overlaps, no flex backend (``apply_flex_dispatcher_backend(
  model_cfg, None)``: the provider's alltoall dispatcher).
- 26.02: configs/qwen/qwen3_workload_base_configs.py at f29a269 (``QWEN3_<SIZE>_PRETRAIN_CONFIG_<GPU>_
  <FP8_CS|FP8_MX>_<V1|V2>``, utils' ``get_workload_base_config`` falling back from V2 to V1): GB300 30B-A3B V1
  MBS 8, EP 8, HybridEP (``moe_flex_dispatcher_backend = "hybridep"``), TE CUDA graphs (moe_router,
  moe_preprocess); GB300 235B-A22B V2 256 GPUs, PP 4, EP 32, GBS 8192, MBS 2, HybridEP, TE graphs (attn,
  moe_router, moe_preprocess); GB200 30B-A3B V1 MBS 4, HybridEP, graphs (moe_router, moe_preprocess); GB200
  235B-A22B V2 PP 8, EP 32, MBS 1, HybridEP, graphs with attn; B200 30B-A3B V1 MBS 1, no backend, graphs
  (moe_router, moe_preprocess); B300 30B-A3B V1 (``..._B300_FP8_MX_V1`` = ``..._FP8_CS_V1``) MBS 8, EP 8,
  HybridEP, graphs (moe_router, moe_preprocess); B300 235B-A22B V2 (= ``..._B300_FP8_CS_V2``): V1's PP 8, VP
  4, EP 8, ``moe_a2a_overlap = True``, with 256 GPUs and GBS 8192, no backend, no graphs (01b2977's copy and
  another drop VP 4 and the overlap: not the table); B200 235B-A22B V2 PP 8, EP 8, 256 GPUs, GBS 8192, no
  graphs, ``moe_a2a_overlap = False`` — each the table's row exactly. H100 30B-A3B V1: 16 GPUs, GBS 1024, MBS
  1, **PP 1, EP 16**, HybridEP (the script sets ``moe_token_dispatcher_type = "flex"``): not the table's PP 2,
  VP 12, EP 8 (nor are 01b2977's copy or another stored copy whose commit the index does not name); typed as
  printed. 01b2977's copy adds VP to the 235B FP8-MX V2 presets (GB300 VP 12, GB200 VP 3): not the table.
  configs/qwen/qwen3_llm_pretrain.py at f29a269: the no-argument library recipe
  (src/megatron/bridge/recipes/qwen/qwen3_moe.py at 2afd2d3), ``get_precision_config``,
  ``set_qwen3_common_configs``, ``set_workload_base_configs``, the preset's flex backend written after the
  recipe. utils/overrides.py at 00538e2, utils/precision.py at 84fba28.
- Both: ``set_qwen3_common_configs`` (the same at 0fa501a and f29a269): no recompute (it overrides the
  library 30B-A3B recipe's full recompute), ``moe_router_fusion = True``, sequence 4096, ``grad_reduce_in_
  fp32 = False`` (``--reduce-dtype bf16``), ``moe_router_force_load_balancing = True``. The library recipe
  (2afd2d3; the kwargs copy alike): ``_pretrain_common``'s distributed fused Adam with clipping at 1.0, DDP
  ``overlap_grad_reduce``, ``overlap_param_gather``, ``use_distributed_optimizer`` (``--zero 1
  --overlap-grad-reduce --overlap-param-gather --clip-grad``), ``moe_grouped_gemm``, ``moe_permute_fusion``,
  ``expert_tensor_parallel_size = 1``, ``moe_router_padding_for_fp8 = False``, no shared expert, no
  offloading, ``use_precision_aware_optimizer = False`` — and ``set_post_overrides`` (26.02) and
  ``set_user_overrides`` (25.11) turn it on for bf16 only, so the float8 rows run the plain distributed
  optimizer, memplan's (the BF16 rows' note names it untyped; these do not). The 235B-A22B recipe sets
  ``account_for_embedding_in_pipeline_split`` and ``account_for_loss_in_pipeline_split`` (``--pp-layers``
  from heldout_bridge.py's ``embedding_loss_split``: (94 + 2)/(PP·VP) a virtual stage, one fewer at each
  end — PP 8 × VP 2: 5,6,…,6,5; PP 4: 23,24,24,23; PP 8: 11,12,…,12,11); the 30B-A3B recipe sets neither
  and 48 divides evenly (no ``--pp-layers``).
- Float8: FP8-CS is ``get_precision_config("fp8", "cs")`` (25.11, helpers.py) / ``("fp8_cs")`` (26.02,
  precision.py): ``bf16_with_fp8_current_scaling_mixed()`` with ``first_last_layers_bf16 = False`` —
  ``--fp8 tensorwise``; FP8-MX ``bf16_with_mxfp8_mixed()`` — ``--fp8 mxfp8``. Both recipes set
  ``fp8_param_gather`` (training/mixed_precision.py at 0509780, as heldout_bridge.py reads it; MXFP8's with
  ``reuse_grad_buf_for_mxfp8_param_ag``; an older stored copy sets it False for MXFP8): typed
  ``--fp8-param-gather`` (each note: PRIMARY or PRIMARY_MX), modelled for the experts too (their primary
  weights gathered over the expert-data-parallel group).
- The models: src/megatron/bridge/models/qwen/qwen_provider.py at 07d0d14 — ``Qwen3MoEModelProvider30B_A3B``
  (48 layers, hidden 2048, 32 heads, 4 query groups, kv_channels 128, ``moe_ffn_hidden_size = 768``) and
  ``..._235B_A22B`` (heldout_bridge_moe.py), both 128 experts, top-8, vocabulary 151,936, untied, no shared
  expert, ``moe_router_load_balancing_type = "aux_loss"``, alltoall, grouped GEMM, permute fusion: memplan's
  presets qwen3-30b-a3b and qwen3-235b-a22b (tests/test_heldout.py checks the figures).

Readings not settled, typed as the table prints them (each row's note says so):
- 25.11 GB300 30B-A3B: MBS 4 (GA 16 agrees with it); 0fa501a's and 767255d's presets say MBS 8.
- 25.11 H100 30B-A3B: VP 24 (1 layer a virtual stage; 25.09 prints 24 too); every stored preset (0fa501a,
  767255d, 4054233) says VP 12. With ``--vpp 12`` memplan predicts 13,434 tokens/s (typed: 12,658).
- 26.02 H100 30B-A3B: PP 2, VP 12, EP 8 is in no stored 26.02 preset (above).
- The dispatcher that ran: 25.11 alltoall (no backend reaches the recipe). 26.02 (flex_dispatcher_backend.py
  at 183c5c0, my reading of the code, no log): the recipe asks for DeepEP, applied on B200 and H100
  (capability 9 or the "NVIDIA B200" / "NVIDIA B300" names) and fallen back to alltoall on GB200/GB300;
  the script then writes the preset's backend without re-applying it — GB rows alltoall with "hybridep"
  written, B200 rows and B300's 235B-A22B flex with none, B300's 30B-A3B and H100 flex with "hybridep".
  memplan has no dispatcher option: it times an all-to-all of the routed tokens each way per MoE layer,
  not overlapped.
- Which 25.11 preset copy ran (0fa501a or 767255d: CUDA graphs and ``moe_a2a_overlap``), and which
  mixed_precision.py the containers shipped.

Not typed (memplan has no option; each row's note says which):
- CUDA graphs (25.11 30B-A3B: local full_iteration, or TE-scoped in 767255d; 26.02: TE-scoped on the
  Blackwell rows but B200 235B): memplan charges the eager launch gaps and no graph pool.
- HybridEP and DeepEP (``moe_hybridep_num_sms = 32``); ``moe_a2a_overlap`` (EP all-to-all overlap with
  ``delay_wgrad_compute``; 767255d's B200 235B and H100 presets only, among the typed rows);
  ``overlap_param_gather_with_optimizer_step`` and the pipeline's ``overlap_p2p_comm`` (dp, pp, vp > 1: the
  B200 235B 25.11 and both H100 rows); the router's fusion and auxiliary loss (TE's fused cross entropy is
  typed ``--loss te``, heldout_bridge.py).
- TE's per-expert float8 padding: ``moe_router_padding_for_fp8 = False`` leaves TE's ``Fp8Padding`` in the
  grouped MLP, padding each expert's rows to 16 (32 under MXFP8). memplan takes each expert's rows balanced
  (S·ep/E: 256 × MBS × EP on these rows, a multiple of 32), so it adds nothing; the runs' forced balancing
  is random router logits (megatron/core/transformer/moe/router.py, a stored copy whose repository and
  commit the index does not name: ``apply_random_logits`` under ``moe_router_force_load_balancing``, "for
  benchmark"; transformer_config.py's docstring of ``moe_router_padding_for_fp8``, likewise unnamed: "This
  can remove the explicit padding in the GroupedMLP layer"), balanced only on average: up to 15 (31) rows
  an expert, not counted.

memplan's verdict, when the rows were typed: three rows that ran are called "does not fit" — 26.02 GB300 and
B300 30B-A3B at MBS 8 (295.7 GiB reserved of 275.3 and 266.3 usable: 159 GiB of activations, 37 GiB of the
loss's backward transients on top, 37 GiB between allocated and reserved) and 25.11 H100 30B-A3B at MBS 2, PP
2, VP 24 (88.6 of 77.4 GiB; at the presets' VP 12, 87.9). The rest fit. Typed with TE's fused cross entropy
since (``--loss te``, heldout_bridge.py: its logits kept in bf16, the gradient written over them, where
memplan's Megatron loss kept an fp32 softmax and made two more in its backward), every row fits: GB300 and
B300 30B-A3B at MBS 8 212.5 GiB, H100's at VP 24 70.2 of 77.4. The step times (with Megatron's token dispatch
and combine, ``time.layer_elementwise.dispatch``): the 235B-A22B rows +0.3 % (GB300) to +134 % (B300, 26.02);
the 30B-A3B rows +4.8 … +36 % on GB300, B300 and GB200 at MBS 4–8, +120 … +366 % on B200 and H100 at MBS 1–2.
The published tokens/s follow the micro-batch where memplan's barely move (B200 at MBS 1 9,299 and 9,691
against GB200 at MBS 4 23,766 and 26,084, memplan 29,140 and 32,353; H100 at MBS 1 2,557 against MBS 2 5,275,
memplan 11,911 and 11,581): a cost per micro-batch or per MoE layer memplan does not have (candidates, not
measured: the alltoall dispatcher's host synchronisation for its splits — the "moe_preprocess" the CUDA graph
scopes name —, the router's and permutation's launches, per-expert GEMMs of 2,048 rows at MBS 1, EP 8).

The DGX-H100 235B-A22B rows (25.11: 256 GPUs, FP8-CS, GBS 2048 — df0289c's copy; 00b7660's row has 14
cells for 15 columns, its GBS missing —, TP 2, PP 8, VP 4, EP 32 → 1575; 26.02: GBS 8192, the same layout →
1633) were left out while memplan's ``--ep`` took its ranks from dp only: with ETP 1 Megatron draws EP 32
across TP × DP (2 × 16). Typed since with ``--etp 1`` (MoE parallel folding, ``Parallel.fold``): each rank
routes its own s/2 tokens to 4 whole experts, EP 32 is 32 consecutive ranks over 4 nodes, the experts'
states over tp·dp/ep = 1; the 25.11 recipe's TE userbuffers (``tp_comm_overlap``) overlap the attention's
linears (the folded MoE layer has no sequence-parallel collective). They read −12.7 % (25.11; −13.4 % with
the userbuffers left out) and −15.6 % (26.02): the 4-node all-to-alls are 57 % of the predicted step,
exposed (the 26.02 V2 preset's ``moe_a2a_overlap`` would hide part of them, not modelled).

Left out, with the reason:
- Qwen3-Next: no row in either table (presets only). The 25.09 section: no Precision column and its Qwen3 rows
  "(tokendrop)" (heldout_bridge_more.py's reason). No FP8-DS Qwen3 row exists.
"""

from __future__ import annotations

from benchmarks.heldout_bridge import PRIMARY, PRIMARY_MX, SYSTEMS, TE_LOSS, embedding_loss_split
from benchmarks.heldout_bridge import SOURCE as SOURCE_2511
from benchmarks.heldout_bridge_moe import GRAPHS_GB200 as GRAPHS_ATTN
from benchmarks.heldout_bridge_moe import GRAPHS_GB300 as GRAPHS_TE
from benchmarks.heldout_bridge_more import SOURCE as SOURCE_2602
from benchmarks.heldout_types import Run, megatron_layout, megatron_stated

SEQ = 4096
MODELS = {"qwen3-30b-a3b": ("Qwen3 30B-A3B", 48), "qwen3-235b-a22b": ("Qwen3 235B-A22B", 94)}
"""memplan's preset → (the row's name, layers)."""
NOTE = (
    "Megatron-Bridge (Megatron-core + TE float8, GroupedLinear experts): distributed optimizer with "
    "overlapped gradient and parameter sync, gradients in bf16, no AC, force-balanced dropless routing "
    "(memplan's S/ep a rank), as its {recipes} set them (Megatron-core's MoE layer: TE grouped GEMM, fused "
    "permutation and router, no shared expert, ETP 1); TE's per-expert fp8 padding "
    "(moe_router_padding_for_fp8 False) not modelled: memplan's balanced rows an expert are multiples of 32 "
    "here, the runs' random router logits balance only on average"
)
RECIPES = {"25.11": "25.11 performance recipes", "26.02": "26.02 performance recipes (*_V1/_V2 presets)"}
SPLIT = "embedding and loss counted in the pipeline split"
ALLTOALL = "alltoall dispatcher (no flex backend reaches the 25.11 recipe), no expert-parallel overlap"
GRAPHS_2511 = (
    "CUDA graphs (0fa501a: local, full_iteration; 767255d: TE attn, moe_router, moe_preprocess) not modelled"
)
A2A_767 = (
    "767255d's copy of the preset sets moe_a2a_overlap (EP all-to-all overlap + delay_wgrad_compute), not "
    "modelled; 0fa501a's does not"
)
PG_OPT = "overlap_param_gather_with_optimizer_step and the pipeline's overlap_p2p_comm not modelled"
A2A_B300 = "the preset's moe_a2a_overlap (EP all-to-all overlap + delay_wgrad_compute) not modelled"
HYBRIDEP = "HybridEP dispatcher (moe_hybridep_num_sms 32) not modelled, no expert-parallel overlap"
DEEPEP = "the recipe's DeepEP (flex) dispatcher not modelled, no expert-parallel overlap"
PLACED = "EP 32 in 32 consecutive ranks (Megatron's tp-cp-ep-dp-pp order)"
MBS_A1 = "MBS 4 as the table prints it (GA 16 agrees; the presets at 0fa501a and 767255d: MBS 8)"
VP_A5 = (
    "VP 24 as the table prints it (1 layer a virtual stage); every stored preset (0fa501a, 767255d, 4054233) "
    "says VP 12"
)
FOLDED = (
    "ETP 1 with TP 2 (BASE_QWEN3_235B_A22B_CONFIG's expert_tensor_parallel_size=1) typed --etp 1: MoE "
    "parallel folding, EP 32 drawn across TP × DP, 32 consecutive ranks over 4 nodes (Megatron's etp-ep-dp "
    "order), each rank dispatching its own s/2 tokens to whole experts"
)
H100_2511 = (
    "layout, MBS and GBS as a stored copy of qwen3_workload_base_configs.py's (its *_BASE_CONFIG naming) "
    "QWEN3_235B_A22B_H100_FP8_CS_BASE_CONFIG: TP 2, PP 8, VP 4, EP 32, GBS 2048, no moe_a2a_overlap"
)
UB_2511 = (
    "that copy's qwen3_235b_a22b_h100_config sets tp_comm_overlap: typed --tp-comm-overlap (TE's userbuffers "
    "on the attention's linears; the folded MoE layer has no sequence-parallel collective)"
)
H100_2602 = (
    "f29a269's QWEN3_235B_A22B_PRETRAIN_CONFIG_H100_FP8_CS_V2 (V1's layout, GBS 8192) sets moe_a2a_overlap "
    "(EP all-to-all overlap + delay_wgrad_compute), not modelled: its all-to-alls counted exposed; "
    "qwen3_235b_a22b_pretrain_config_h100: tp_comm_overlap off, the alltoall dispatcher"
)
LAYOUT_B9 = (
    "layout as the table prints it (25.11's PP 2 VP 12 EP 8); no stored 26.02 preset has it (f29a269's and "
    "01b2977's H100_FP8_CS_V1: PP 1, EP 16, MBS 1, GBS 1024, HybridEP)"
)


def _row(
    release: str,
    gpu: str,
    model: str,
    sizes: tuple[int, int, int],
    layout: tuple[int, int, int, int],
    ep: int,
    kind: str,
    published: float,
    notes: tuple[str, ...],
) -> Run:
    """One float8 row of ``release``'s (25.11 or 26.02) table: ``sizes`` its (#-GPUs, GBS, MBS), ``layout``
    its (TP, PP, CP, VP), ``ep`` its EP (from the data-parallel ranks; with TP > 1 from TP × DP, the recipes'
    ETP 1 typed ``--etp 1``), ``kind`` FP8-CS (``--fp8
    tensorwise``) or FP8-MX (``--fp8 mxfp8``); the recipes' fp8_param_gather typed ``--fp8-param-gather``;
    235B-A22B's 94 layers split with the embedding and the loss, 30B-A3B's 48 evenly."""
    gpus, gbs, mbs = sizes
    tp, pp, cp, vp = layout
    dp = gpus // (tp * pp * cp)
    label, layers = MODELS[model]
    folded = dp * tp if tp > 1 else dp  # ETP 1 draws EP from TP × DP (``Parallel.fold``)
    assert dp * tp * pp * cp == gpus and gbs % (mbs * dp) == 0 and folded % ep == 0, (release, gpu, model)
    assert layers % (pp * vp) == 0 or model == "qwen3-235b-a22b", (release, gpu, model)
    fp8 = {"FP8-CS": "tensorwise", "FP8-MX": "mxfp8"}[kind]
    split = embedding_loss_split(layers, pp, vp) if model == "qwen3-235b-a22b" and pp > 1 else ()
    parts = [
        f"-m {model} --seq {SEQ} --batch {mbs} --global-batch {gbs} --gpus {gpus} --gpu {gpu}",
        f"--impl megatron --fp8 {fp8}",
        "--zero 1 --overlap-grad-reduce --overlap-param-gather --reduce-dtype bf16 --clip-grad",
        TE_LOSS,
        *megatron_layout(layout, split, userbuffers=UB_2511 in notes),
        f"--ep {ep}" + (" --etp 1" if tp > 1 else ""),  # the recipes' ETP 1: parallel folding with TP
        "--fp8-param-gather",
    ]
    stated = megatron_stated(model, gpu, (gpus, SEQ, mbs, gbs), layout, 1, fp8, ep=ep, loss="te")
    shape = " ".join(
        [f"TP {tp}"] * (tp > 1) + [f"PP {pp}"] * (pp > 1) + [f"VP {vp}"] * (vp > 1) + [f"EP {ep}"]
    )
    name = f"{label}, {gpus} × {gpu.upper()}, {shape}, {kind} ({release})"
    source = SOURCE_2511 if release == "25.11" else SOURCE_2602
    note = NOTE.format(recipes=RECIPES[release])
    kept = PRIMARY_MX if fp8 == "mxfp8" else PRIMARY
    split_note = (SPLIT,) if split else ()
    return Run(
        name,
        f"{source}, {SYSTEMS[gpu]}",
        stated,
        published,
        " ".join(parts),
        "; ".join((note, *split_note, kept, *notes)),
    )


M30 = "qwen3-30b-a3b"
M235 = "qwen3-235b-a22b"
ONE = (1, 1, 1, 1)
P2511 = "layout, MBS and GBS as 0fa501a's {}_PARALLEL_CONFIG"
P2602 = "layout, MBS and GBS as f29a269's {} exactly"

# (release, GPU, model, (#-GPUs, GBS, MBS), (TP, PP, CP, VP), EP, recipe, published tokens/s/GPU, notes), in
# the tables' order
TABLE: tuple[tuple[str, str, str, tuple[int, int, int], tuple[int, int, int, int], int, str, float,
                   tuple[str, ...]], ...] = (
    # 25.11 (00b7660; df0289c prints the same rows)
    ("25.11", "gb300", M30, (8, 512, 4), ONE, 8, "FP8-MX", 28934, (ALLTOALL, GRAPHS_2511, MBS_A1)),
    ("25.11", "gb200", M30, (8, 512, 4), ONE, 8, "FP8-MX", 23766,
     (ALLTOALL, GRAPHS_2511, P2511.format("QWEN3_30B_A3B_GB200_FP8_MX"))),
    ("25.11", "b200", M30, (8, 512, 1), ONE, 8, "FP8-MX", 9299,
     (ALLTOALL, GRAPHS_2511, P2511.format("QWEN3_30B_A3B_B200_FP8_MX"))),
    ("25.11", "b200", M235, (64, 1024, 1), (1, 8, 1, 2), 8, "FP8-MX", 3269,
     (ALLTOALL, A2A_767, PG_OPT, P2511.format("QWEN3_235B_A22B_B200_FP8_MX"))),
    ("25.11", "h100-sxm", M30, (16, 512, 2), (1, 2, 1, 24), 8, "FP8-CS", 5275,
     (ALLTOALL, A2A_767, PG_OPT, VP_A5)),
    ("25.11", "h100-sxm", M235, (256, 2048, 1), (2, 8, 1, 4), 32, "FP8-CS", 1575,
     (FOLDED, ALLTOALL, UB_2511, PG_OPT, H100_2511)),
    # 26.02 (df0289c): the V1 (30B-A3B) and V2 (235B-A22B) presets
    ("26.02", "gb300", M30, (8, 512, 8), ONE, 8, "FP8-MX", 30376,
     (GRAPHS_TE, HYBRIDEP, P2602.format("QWEN3_30B_A3B_PRETRAIN_CONFIG_GB300_FP8_MX_V1"))),
    ("26.02", "gb300", M235, (256, 8192, 2), (1, 4, 1, 1), 32, "FP8-MX", 6583,
     (GRAPHS_ATTN, HYBRIDEP, PLACED, P2602.format("QWEN3_235B_A22B_PRETRAIN_CONFIG_GB300_FP8_MX_V2"))),
    ("26.02", "gb200", M30, (8, 512, 4), ONE, 8, "FP8-MX", 26084,
     (GRAPHS_TE, HYBRIDEP, P2602.format("QWEN3_30B_A3B_PRETRAIN_CONFIG_GB200_FP8_MX_V1"))),
    ("26.02", "gb200", M235, (256, 8192, 1), (1, 8, 1, 1), 32, "FP8-MX", 5448,
     (GRAPHS_ATTN, HYBRIDEP, PLACED, P2602.format("QWEN3_235B_A22B_PRETRAIN_CONFIG_GB200_FP8_MX_V2"))),
    ("26.02", "b300", M30, (8, 512, 8), ONE, 8, "FP8-MX", 29521,
     (GRAPHS_TE, HYBRIDEP, P2602.format("QWEN3_30B_A3B_PRETRAIN_CONFIG_B300_FP8_MX_V1"))),
    ("26.02", "b300", M235, (256, 8192, 1), (1, 8, 1, 4), 8, "FP8-MX", 2691,
     (DEEPEP, A2A_B300, PG_OPT, P2602.format("QWEN3_235B_A22B_PRETRAIN_CONFIG_B300_FP8_MX_V2"))),
    ("26.02", "b200", M30, (8, 512, 1), ONE, 8, "FP8-MX", 9691,
     (GRAPHS_TE, DEEPEP, P2602.format("QWEN3_30B_A3B_PRETRAIN_CONFIG_B200_FP8_MX_V1"))),
    ("26.02", "b200", M235, (256, 8192, 1), (1, 8, 1, 1), 8, "FP8-MX", 3805,
     (DEEPEP, P2602.format("QWEN3_235B_A22B_PRETRAIN_CONFIG_B200_FP8_MX_V2"))),
    ("26.02", "h100-sxm", M30, (16, 1024, 1), (1, 2, 1, 12), 8, "FP8-CS", 2557,
     (HYBRIDEP, PG_OPT, LAYOUT_B9)),
    ("26.02", "h100-sxm", M235, (256, 8192, 1), (2, 8, 1, 4), 32, "FP8-CS", 1633,
     (FOLDED, H100_2602, PG_OPT)),
)  # fmt: skip

BRIDGE_MOE_FP8_RUNS: tuple[Run, ...] = tuple(_row(*row) for row in TABLE)
