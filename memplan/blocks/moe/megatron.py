"""What Megatron-core's ``MoELayer`` keeps for backward (``--impl megatron`` with a mixture of experts), in
place of the reference MoE's router, dispatch and combine (``blocks.moe``); the shared experts and the MLP
input stay ``blocks.moe``'s.

The configuration memplan models is Megatron-Bridge's MoE performance recipes' (Qwen3 MoE, late 2025):
``moe_token_dispatcher_type="alltoall"``, ``moe_grouped_gemm`` (``TEGroupedMLP``: Transformer Engine's
``GroupedLinear``), ``moe_permute_fusion`` and ``moe_router_fusion`` (TE's fused permutation and top-k),
expert tensor parallelism 1 (with tp > 1, ``--etp 1``: parallel folding, S the slots of the rank's own
s/t tokens, ``blocks.moe.rank_slots``), no recompute. Per layer, with T tokens on the rank (before
dispatch), S slots after it (T·k dropless, balanced over the expert-parallel ranks), E experts, L = E/ep
local ones, f an expert's width (read from stored copies of megatron/core/transformer/moe/ and
TransformerEngine's pytorch/router.py, permutation.py and module/grouped_linear.py in 2025 forks; NVIDIA's
stored Megatron-LM copies predate them):

- router: ``RouterGatingLinearFunction`` saves its input — the MoE input, ``mlp.input`` — and the weight;
  TE's ``FusedTopkScoreFunction`` saves the routing map [T, E] bool and its score output [T, E] in the
  logits' dtype (``moe_router_dtype`` unset: the activation dtype), not the logits;
- dispatch: TE's ``moe_permute`` (mask map), on the rank's own tokens before the all-to-all (T/t of them
  under sequence parallelism, like the router's), saves its ``row_id_map`` [T, 2E + 1] int32 only (the
  permuted tokens and probabilities are not kept); the all-to-alls keep nothing; with more than one local
  expert the chunk sort (``_moe_chunk_sort``) saves a [S] int32 map, and the combine's restoring sort another;
- experts: each ``GroupedLinear`` keeps its input (fc1: the dispatched tokens [S, h]; fc2: the weighted
  activation [S, f]); ``WeightedSwiGLUFunction`` (``weighted_bias_swiglu_impl``: the routing
  probabilities applied inside the activation, before fc2 — TE 2.1's move, "to avoid saving huge input
  tensor") keeps fc1's [S, 2f] output and the probabilities [S, 1];
- combine: the all-to-all back keeps nothing and ``moe_unpermute`` without probabilities saves the same
  ``row_id_map``: no [S, h] tensor (the reference MoE keeps two: the expert output and ``index_add_``'s
  source).

NB: Megatron-core's default dispatcher is ``allgather`` (not modelled: the recipes set ``alltoall``); the
flex dispatchers (HybridEP, DeepEP) keep their probabilities in fp32 and permute inside their kernels;
the auxiliary load-balancing loss's [T, E] scores (kept when ``moe_aux_loss_coeff`` > 0) are not counted
(as in ``blocks.moe``); derived from the code, not measured (no Megatron in this environment).
"""

from __future__ import annotations

from memplan.blocks import te_fp8
from memplan.blocks.inventory import Block, Dims, Role, Rule, save
from memplan.blocks.mlp import mlp_inner_rules
from memplan.config import DType, MlpType, MoEConfig, Setup


def routed_rules(setup: Setup, moe: MoEConfig, slots: int) -> list[Rule]:
    """One MoE layer's router, dispatch, routed experts and combine as Megatron-core keeps them (module
    docstring); ``slots`` the rank's S."""
    dims = Dims.of(setup)
    t, e, a = dims.tokens, moe.experts, dims.act

    def keep(part: str, shape: tuple[int, ...], dtype: DType, role: Role, why: str) -> Rule:
        return save(Block.MOE, part, shape, dtype, role, why)

    rules = [
        keep("routing_map", (t, e), DType.BOOL, Role.ROUTER, "TE's fused top-k: its backward's mask"),
        keep("router_scores", (t, e), a, Role.ROUTER, "TE's fused top-k score output: its backward"),
        # permuted before the all-to-all, on the rank's own tokens: s/t of them under sp, as the router's
        keep("row_id_map", (t, 2 * e + 1), DType.INT32, Role.ROUTER, "TE's moe_permute / unpermute"),
    ]
    if e // setup.parallel.ep > 1:  # the local experts' chunks sorted after the all-to-all, and back
        why = "the chunk sort's map: its backward"
        rules += [
            keep("chunk_sort_map", (slots,), DType.INT32, Role.DISPATCH_INDEX, why),
            keep("chunk_restore_map", (slots,), DType.INT32, Role.DISPATCH_INDEX, why),
        ]
    why = "GroupedLinear fc1's input: the dispatched tokens"
    experts = [
        keep("expert_input", (slots, dims.h), a, Role.EXPERT_TOKENS, why),
        *mlp_inner_rules(setup, Block.MOE, "", (slots, dims.f), a),
        keep("probs", (slots, 1), a, Role.EXPERT_TOKENS, "weighted SwiGLU: the probabilities scale it"),
    ]
    if te_fp8.applies(setup):  # TE's float8: fc1 and fc2 keep float8 casts of their inputs, per expert
        inputs = ("moe.expert_input", "moe.down_input")
        experts = [
            c
            for r in experts
            for c in (te_fp8.expert_casts(setup, r, r.name[4:]) if r.name in inputs else [r])
        ]
    return [*rules, *experts]


def fp8_backward_extra(setup: Setup, tokens: int, slots: int, f: int) -> int:
    """Under Transformer Engine's float8 (``te_fp8.applies``): what fc1's backward moment
    (``blocks.mlp.te_first_backward``, counted at the layer's T tokens) grows by when the experts run on
    S slots — d(fc1)'s float8 rowwise and columnwise casts over S rows, less the larger release of fc2's
    saved float8 input; 0 otherwise (``blocks.moe.mlp_backward_extra`` adds the [S, f] gradient buffers).
    NB: the per-expert ``[1]`` scale_invs of the casts are counted once; derived, not measured."""
    if not te_fp8.applies(setup):
        return 0
    w = 2 * f if setup.model.mlp is MlpType.SWIGLU else f
    casts = te_fp8.grad_output_casts(setup, slots, w) - te_fp8.grad_output_casts(setup, tokens, w)
    return casts - (te_fp8.saved_cast_bytes(setup, slots, f) - te_fp8.saved_cast_bytes(setup, tokens, f))
