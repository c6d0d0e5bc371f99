"""Mixture of experts: routed experts with top-k routing, shared experts, a capacity factor.

``ModelConfig.moe`` (``config.MoEConfig``) makes a model a mixture of experts: its ``ffn_size`` is the
width of ONE routed expert; every layer's MLP is replaced by a router (h×E, no bias), E routed experts of
that width (each a full MLP of the model's kind) and optionally shared experts every token goes through.
Its parameters (router, one expert, shared experts) are ``blocks.moe.params``'s; ``analytic.params``
counts the whole model's, total and active, from them.

Activations follow the Hugging Face modules (``MixtralSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock``) with
Megatron-Core's sort-based dispatch, as the reference model (memplan/measure/reference/moe.py) runs them, with
T = b·s tokens and S expert slots (T·k when dropless; E·⌈c·T·k/E⌉ with capacity factor c, the slots of
token-dropping Megatron/GShard with padding to capacity):
- router: linear on the MLP input (already kept as ``mlp.input``), softmax in fp32 → saves [T, E] fp32;
  top-k → saves its [T, k] int64 indices; renormalised (``norm_topk_prob``: Mixtral) the division saves
  the top-k probabilities [T, k] and their sum [T, 1], fp32;
- dispatch: the slots sorted by expert; ``hidden.index_select(token)`` saves the token of each slot [S]
  int64 (index_add's backward reuses it), the routing-weight gather the slot order [S] int64;
- each expert: its input [S, h] and, like a dense MLP, gate / act / up / down-input [S, f] (SwiGLU), one
  tensor per name (the experts' outputs concatenated, as a grouped GEMM lays them out);
- combine: ``expert(x) · weight`` saves the expert output [S, h] and the weight [S, 1]; ``index_add_``
  back to the tokens keeps its source, the product [S, h] (its backward reads the shape via expand_as);
- shared experts: a dense MLP of width n·f_s on every token, and with a shared gate (Qwen2-MoE)
  ``sigmoid(x·w_g) · shared(x)`` saves the sigmoid [T, 1] and the shared output [T, h].

Checked against autograd: per tensor name and per FLOP phase, the estimate equals the reference model's
measurement (tests/measure/test_moe.py: no / full / selective / every-k checkpointing, flash and eager,
SwiGLU and GELU experts, shared experts with and without a gate; real tiny tensors and fake ones at
Mixtral-8x7B's size).

Routing assumption (``routing``, in the JSON's ``moe``): dropless top-k, S = T·k slots. On one device the
kept bytes and FLOPs do not depend on how the slots split among the experts: every buffer is [S, ·], or
E per-expert pieces whose rows sum to S (checked with realised, unbalanced routings of random routers,
tests/measure/test_moe.py and tests/hf/test_moe.py). A split only matters per expert-parallel rank, which
is assumed balanced (S/ep slots: the most loaded rank can take more).

Known limitations (NB):
the capacity factor's token dropping is estimated but not measured (the reference model refuses it);
the router's auxiliary loss is not counted; the MoE MLP's backward is replayed op by op where
``blocks.moe.backward`` models the code (``applies``: memplan's reference and transformers' grouped_mm
experts — PhiMoE's and gpt-oss's among them —, full training on one rank's whole layer; exact,
tests/measure/test_moe_peak.py, tests/hf/test_moe_peak.py and test_moe_families_peak.py), elsewhere
read as a dense MLP's with its [S, f] buffers (``mlp_backward_extra``); tensor and sequence parallelism
are not measured (strategies/sequence_parallel.py's rules for the MoE roles).
"""

from __future__ import annotations

from memplan.blocks import mm
from memplan.blocks.inventory import Block, Dims, Role, Rule, save
from memplan.blocks.mlp import mlp_inner_rules
from memplan.blocks.moe import megatron as megatron_moe
from memplan.blocks.profiles import profile_of
from memplan.config import DType, GateActivation, MlpType, MoEConfig, Setup

FP32, INT32, INT64 = DType.FP32, DType.INT32, DType.INT64
B, R = Block, Role


def moe_save(part: str, shape: tuple[int, ...], dtype: DType, role: Role, why: str) -> Rule:
    """One tensor the MoE layer keeps (block ``moe``)."""
    return save(B.MOE, part, shape, dtype, role, why)


def dense_mlp_layers(setup: Setup) -> int:
    """DeepSeek's first k layers with a dense MLP (``MoEConfig.dense_layers``: ``first_k_dense_replace``)."""
    moe = setup.model.moe
    return moe.dense_layers if moe else 0


def dense_layer_setup(setup: Setup) -> Setup | None:
    """The setup of one of DeepSeek's dense first layers: the model without ``moe``, its MLP
    ``dense_ffn`` wide (``DeepseekV3DecoderLayer``: ``layer_idx < first_k_dense_replace`` → a
    ``DeepseekV3MLP`` of ``intermediate_size``); None without dense layers."""
    moe = setup.model.moe
    if moe is None or not moe.dense_layers:
        return None
    model = setup.model.model_copy(update={"moe": None, "ffn_size": moe.dense_ffn})
    return setup.model_copy(update={"model": model})


# ----------------------------------------------------------------------------------------------------
# Activations
# ----------------------------------------------------------------------------------------------------


def rank_slots(setup: Setup, moe: MoEConfig, tokens: int) -> int:
    """The expert slots a rank's experts take for a tensor-parallel group's ``tokens`` T (b·s/cp): S =
    T·k (``MoEConfig.slots``) — with tp > 1 the expert-tensor-parallel ranks gather their dispatched
    tokens over tp —, or under parallel folding (``Parallel.fold``, whole experts) the slots of the rank's
    own s/t tokens, balanced over the expert-parallel ranks (Megatron-core's alltoall dispatcher with an
    expert tensor-parallel group of one rank: no gather)."""
    return moe.slots(tokens // setup.parallel.fold)


def moe_rules(setup: Setup, moe: MoEConfig) -> list[Rule]:
    """What one MoE layer keeps beyond ``mlp.input`` (which the router, experts and shared experts share)."""
    dims = Dims.of(setup)
    t, h, a = dims.tokens, dims.h, dims.act
    s = rank_slots(setup, moe, t)

    if profile_of(setup).megatron_moe:  # Megatron-core's MoELayer (blocks/moe/megatron.py)
        rules = megatron_moe.routed_rules(setup, moe, s)
    else:
        rules = router_rules(setup, moe) + dispatch_rules(setup, moe, s)
    width = moe.shared_width(setup.model)
    if width:
        rules += mlp_inner_rules(setup, B.MOE, "shared.", (t, width), a)
    if moe.shared_gate:
        rules += [
            moe_save(
                "shared_gate",
                (t, 1),
                a,
                R.SHARED_GATE,
                "sigmoid of the shared-expert gate: d(shared output) needs it",
            ),
            moe_save(
                "shared_output", (t, h), a, R.SHARED_GATE, "shared experts' output × gate: d(gate) needs it"
            ),
        ]
    return rules


def router_rules(setup: Setup, moe: MoEConfig) -> list[Rule]:
    """The router's saves: its fp32 softmax over E, the top-k indices and the renormalisation; or
    gpt-oss's top-k of the logits and softmax over those k (``Profile.router_topk_softmax``)."""
    dims = Dims.of(setup)
    t, k = dims.tokens, moe.top_k
    if profile_of(setup).deepseek_router:
        return deepseek_router_rules(setup, moe)
    if profile_of(setup).sparsemixer_router:
        return sparsemixer_rules(setup, moe)

    indices = moe_save(
        "topk_indices", (t, k), INT64, R.ROUTER, "top-k backward scatters into [T, E] at these indices"
    )
    if profile_of(setup).router_topk_softmax:
        why = "softmax over the top-k logits: its backward needs the output"
        return [indices, moe_save("topk_softmax", (t, k), dims.act, R.ROUTER, why)]
    rules = [
        moe_save(
            "router_probs",
            (t, moe.experts),
            FP32,
            R.ROUTER,
            "router softmax in fp32: its backward needs the output",
        ),
        indices,
    ]
    if moe.renormalises:  # weights / weights.sum(-1, keepdim=True), in fp32 before the cast
        rules += [
            moe_save(
                "topk_sum",
                (t, 1),
                FP32,
                R.ROUTER,
                "sum of the top-k probabilities, divisor: d(numerator) needs it",
            ),
            moe_save(
                "topk_weights", (t, k), FP32, R.ROUTER, "top-k probabilities, dividend: d(divisor) needs them"
            ),
        ]
    return rules


def sparsemixer_rules(setup: Setup, moe: MoEConfig) -> list[Rule]:
    """PhiMoE's ``sparsemixer`` in training (``Profile.sparsemixer_router``), per round r = 1, 2 (its top-2
    is two rounds whatever ``num_experts_per_tok``): the bool mask [T, E] of ``masked_fill`` (computed
    under ``no_grad``, kept by masked_fill's backward), the softmax output [T, E] in the activation dtype
    (softmax's backward and ``PhimoeMultiplier``'s ``masked_gates``), the sampled expert [T, 1] int64
    (``gather``'s, ``PhimoeMultiplier``'s and, of round 1, ``torch.scatter``'s index) and the gathered
    multiplier [T, 1] (``PhimoeMultiplier``'s ``multiplier``). The router's logits are not kept: masked_fill,
    scatter and ``PhimoeMultiplier`` keep only their masks and indices. ``max`` over the softmax (the
    midpoint mask) keeps its indices on a node that dies with the local ``max_scores``.
    With ``input_jitter`` > 0, ``PhimoeSparseMoeBlock.forward`` and then ``PhimoeTopKRouter.forward`` each
    multiply the MLP input in place by ``torch.empty_like(x).uniform_(1 − ε, 1 + ε)``: ``mul_``'s backward
    keeps each noise [T, h] (the input needs none: the noise needs no gradient)."""
    dims = Dims.of(setup)
    t, e, a = dims.tokens, moe.experts, dims.act
    rules = []
    if moe.input_jitter > 0:
        why = "input jitter noise, multiplied in place into the MLP input: mul_'s backward needs it"
        rules += [save(B.MOE, f"{who}_jitter", (t, dims.h), a, R.ROUTER, why) for who in ("block", "router")]
    for r in (1, 2):
        rules += [
            save(B.MOE, f"sparsemixer{r}_mask", (t, e), DType.BOOL, R.ROUTER, "masked_fill's mask"),
            save(
                B.MOE,
                f"sparsemixer{r}_softmax",
                (t, e),
                a,
                R.ROUTER,
                "softmax of the masked logits: its backward and PhimoeMultiplier's need it",
            ),
            save(
                B.MOE,
                f"sparsemixer{r}_expert",
                (t, 1),
                INT64,
                R.ROUTER,
                "the sampled expert: gather's, scatter's and PhimoeMultiplier's index",
            ),
            save(
                B.MOE,
                f"sparsemixer{r}_multiplier",
                (t, 1),
                a,
                R.ROUTER,
                "the gathered softmax: PhimoeMultiplier's backward scales by it",
            ),
        ]
    return rules


def deepseek_router_rules(setup: Setup, moe: MoEConfig) -> list[Rule]:
    """DeepSeek-V2's and V3's routers (``Profile.deepseek_router``), op by op: the fp32 copy of the input
    (16-bit A) for the fp32 linear; the scores (softmax or sigmoid: both keep their output); with groups
    (``n_group``) V2's ``masked_fill(~mask, 0)`` its bool [T, E] mask; ``topk`` over the scores [T, k]
    int64 (V3's ``gather`` the same storage); V3's renormalisation (``norm_topk_prob``) keeps the dividend
    [T, k] and divisor [T, 1] in fp32.

    NB: the group choice's other saves are freed before the forward ends (never kept for backward), each
    by a node whose output is read for its indices or shape only, so the node dies with its saves when
    the router returns (tests/hf/test_deepseek.py derives the bytes):
    - V3 (sigmoid): ``view(T, G, E/G).topk(2)``'s [T, G, 2] int64 indices, on the chain ``[0].sum(-1)``
      → ``group_scores``, which only ``topk(group_scores)[1]`` (indices: no gradient) and ``zeros_like``
      (its shape) read; ``topk(group_scores)``'s [T, topk_group] int64, its values dropped by ``[1]``;
      ``masked_fill(~mask, -inf)``'s bool [T, E] mask, its output ``scores_for_choice`` read by
      ``topk(...)[1]`` only (the weights are ``scores.gather(1, topk_indices)``: that topk's indices
      live on as gather's, its own node dies);
    - V2 (``group_limited_greedy``): ``view(T, G, E/G).max(-1)``'s [T, G] int64 indices, its values read
      by ``topk(group_scores)[1]`` and ``zeros_like`` only; ``topk(group_scores)``'s [T, topk_group]
      int64, values dropped. Its ``masked_fill(~mask, 0)`` output feeds the kept ``topk`` (the weights
      are its values): that mask stays."""
    dims = Dims.of(setup)
    t, k, e = dims.tokens, moe.top_k, moe.experts

    def moe_save(part: str, shape: tuple[int, ...], dtype: DType, why: str) -> Rule:
        return save(B.MOE, part, shape, dtype, R.ROUTER, why)

    rules = []
    if dims.act is not FP32:
        rules.append(
            moe_save("router_input", (t, dims.h), FP32, "hidden.type(float32): the fp32 router's input")
        )
    score = "sigmoid" if moe.sigmoid else "softmax"
    rules.append(moe_save("router_scores", (t, e), FP32, f"{score} scores in fp32: its backward needs them"))
    if moe.groups is not None and not moe.sigmoid:  # V2's group_limited_greedy
        why = "masked_fill(~mask, 0) of the experts outside the chosen groups, read by the kept topk"
        rules.append(moe_save("group_mask", (t, e), DType.BOOL, why))
    rules.append(moe_save("topk_indices", (t, k), INT64, "topk (and V3's gather) backward scatters at them"))
    if moe.sigmoid and moe.renormalises:  # DeepseekV3TopkRouter: topk_weights /= sum + 1e-20
        rules += [
            moe_save("topk_sum", (t, 1), FP32, "sum of the top-k scores, divisor: d(dividend) needs it"),
            moe_save("topk_weights", (t, k), FP32, "top-k scores, dividend: d(divisor) needs them"),
        ]
    return rules


def dispatch_rules(setup: Setup, moe: MoEConfig, s: int) -> list[Rule]:
    """The slots' way to the experts, through them and back; with expert biases (gpt-oss) the bias
    gather ``gate_up_proj_bias[expert_ids_g]`` keeps the sorted expert ids [S] int64 (one storage for
    both biases)."""
    dims = Dims.of(setup)
    h, a = dims.h, dims.act

    bias = []
    if moe.expert_bias:
        why = "sorted expert of each slot: the bias gather's backward scatters at it"
        bias = [moe_save("bias_index", (s,), INT64, R.DISPATCH_INDEX, why)]
    return [
        moe_save(
            "weight_index",
            (s,),
            INT64,
            R.DISPATCH_INDEX,
            "top-k slot of each expert slot: the weight gather's backward",
        ),
        moe_save(
            "dispatch_index",
            (s,),
            INT64,
            R.DISPATCH_INDEX,
            "token of each expert slot: gather / index_add backward",
        ),
        moe_save(
            "expert_input",
            (s, h),
            a,
            R.EXPERT_TOKENS,
            "tokens dispatched to the experts, input of W_gate/W_up",
        ),
        *expert_inner_rules(setup, s),
        moe_save(
            "expert_output", (s, h), a, R.EXPERT_TOKENS, "expert output × routing weight: d(weight) needs it"
        ),
        *combine_rules(setup, moe, s),
        *bias,
    ]


def expert_inner_rules(setup: Setup, slots: int) -> list[Rule]:
    """The experts' [S, f] tensors, as a dense MLP's; with transformers' fused ``gate_up_proj``
    (``Profile.experts_gate_up_fused``) gate and up are views of one [S, 2f] output, kept whole."""
    dims = Dims.of(setup)
    if setup.model.gate_act is GateActivation.CLAMPED:
        return clamped_rules(slots, dims)
    inner = mlp_inner_rules(setup, B.MOE, "", (slots, dims.f), dims.act)
    if not profile_of(setup).experts_gate_up_fused:
        return inner
    why = "gate_up grouped_mm output, chunked: silu'(gate) needs gate, d silu(gate) needs up"
    fused = save(B.MOE, "gate_up", (slots, 2 * dims.f), dims.act, R.MLP_INNER, why)
    return [fused, *(r for r in inner if r.name not in ("moe.gate", "moe.up"))]


def clamped_rules(slots: int, dims: Dims) -> list[Rule]:
    """gpt-oss's ``_apply_gate`` on the grouped gate_up output [S, 2f] (gate and up interleaved,
    strided views): ``gate.clamp(max=limit)`` and ``up.clamp(±limit)`` keep their inputs (views of the
    one buffer); ``gate·α`` keeps nothing; ``sigmoid`` its output; ``gate · σ`` both (the clamped gate a
    new tensor); ``up + 1`` nothing, but ``(up + 1) · glu`` both; W_down its input. All [S, f], A."""
    f, act = dims.f, dims.act

    def inner(name: str, why: str) -> Rule:
        return save(B.MOE, name, (slots, f), act, R.MLP_INNER, why)

    why = "gate_up grouped output: both clamps' backward read their input views of it"
    return [
        save(B.MOE, "gate_up", (slots, 2 * f), act, R.MLP_INNER, why),
        inner("gate_clamped", "min(gate, limit) for gate·σ(α·gate): dσ-term needs it"),
        inner("gate_sigmoid", "σ(α·gate): its backward and gate·σ's need it"),
        inner("up_plus_one", "clamp(up) + 1 for (up + 1)·glu: d glu needs it"),
        inner("glu", "gate·σ(α·gate) for (up + 1)·glu: d up needs it"),
        inner("down_input", "input of W_down: dW = Xᵀ·dY"),
    ]


def combine_rules(setup: Setup, moe: MoEConfig, slots: int) -> list[Rule]:
    """What the slots' way back to the tokens keeps: the routing weight of each slot and, in the reference
    model, ``index_add_``'s source (the weighted product); in transformers' grouped_mm experts the
    grouped_mm offsets and the inverse permutation of ``weighted_out[inv_perm]`` instead."""
    p, dims = profile_of(setup), Dims.of(setup)
    weight = save(
        B.MOE,
        "routing_weights",
        (slots, 1),
        FP32 if p.routing_weights_fp32 else dims.act,
        R.EXPERT_TOKENS,
        "routing weight of each slot: d(expert output) needs it",
    )
    if not p.experts_grouped_mm:
        why = "source of index_add_: its backward (expand_as) keeps it"
        product = save(B.MOE, "weighted_output", (slots, dims.h), dims.act, R.EXPERT_TOKENS, why)
        return [weight, product]
    return [
        weight,
        save(
            B.MOE, "offsets", (moe.experts,), INT32, R.DISPATCH_INDEX, "grouped_mm's group ends, kept by both"
        ),
        save(
            B.MOE, "inverse_index", (slots,), INT64, R.DISPATCH_INDEX, "weighted_out[inv_perm]: its backward"
        ),
    ]


def routing(setup: Setup, moe: MoEConfig) -> dict[str, int | str]:
    """The routing assumption of the estimate, for the JSON: the slots S and what they assume."""
    t = Dims.of(setup).tokens
    if moe.router_sigmoid:  # Llama 4's Llama4TextMoe: hidden_states.repeat(E, 1) scaled by the scores
        how = f"every token through all {moe.experts} experts (inputs scaled by the top-{moe.top_k} "
        how += "sigmoid scores, the others' by 0), S = E·T"
    elif moe.capacity_factor is None:
        how = f"dropless top-{moe.top_k}: every choice computed, S = T·k; bytes independent of the split"
    else:
        how = (
            f"capacity factor {moe.capacity_factor}: each expert padded to ⌈c·T·k/E⌉ slots, overflow dropped"
        )
    if setup.parallel.fold > 1:
        how += f"; parallel folding: each rank's s/{setup.parallel.tp} tokens, S a rank"
    return {"tokens": t, "slots": rank_slots(setup, moe, t), "assumption": how}


# ----------------------------------------------------------------------------------------------------
# FLOPs
# ----------------------------------------------------------------------------------------------------
def mlp_flops(setup: Setup, dims: Dims) -> int:
    """Forward FLOPs of one MoE layer's MLP: the router h×E, the S expert slots through an expert's
    matrices, the shared experts and their gate, on T tokens."""
    moe = setup.model.moe
    assert moe is not None  # NB: called for mixtures of experts only
    t, h, f = dims.tokens, dims.h, dims.f
    mats = 3 if setup.model.mlp is MlpType.SWIGLU else 2
    routed = mm(t, h, moe.experts) + mats * mm(moe.slots(t), h, f)
    return routed + mats * mm(t, h, moe.shared_width(setup.model)) + (mm(t, h, 1) if moe.shared_gate else 0)


def early_stop_skip(setup: Setup, dims: Dims) -> int:
    """The forward FLOPs a checkpointed segment of MoE layers never re-runs (``strategies.checkpointing``):
    its last save is, without residual dropout, the shared gate's product (nothing skipped), else the shared
    experts' W_down input (their W_down, [T, n·f_s]·[n·f_s, h], is skipped), else the routed combine
    (``index_add_``: nothing skipped)."""
    moe = setup.model.moe
    assert moe is not None  # NB: called for mixtures of experts only
    width = moe.shared_width(setup.model)
    return mm(dims.tokens, width, dims.h) if width and not moe.shared_gate else 0


def mlp_backward_extra(setup: Setup, moe: MoEConfig | None) -> int:
    """What the MLP backward's [T, f] gradient buffers (``peak.mlp_backward_transient``) grow by when the
    experts' gate/up/product gradients cover S slots instead of T tokens: the dense reading of an MoE's
    backward, where ``blocks.moe.backward`` does not replay it (not measured there)."""
    if moe is None:
        return 0
    dims, buffers = Dims.of(setup), 3 if setup.model.mlp is MlpType.SWIGLU else 2
    slots = rank_slots(setup, moe, dims.tokens)  # with TE's float8 the casts grow too (moe.megatron)
    extra = buffers * (slots - dims.tokens) * dims.f * dims.act.bytes
    return extra + megatron_moe.fp8_backward_extra(setup, dims.tokens, slots, dims.f)
