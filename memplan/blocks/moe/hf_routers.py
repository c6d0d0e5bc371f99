"""transformers' PhiMoE and gpt-oss MoE layers' backward on ``blocks.moe.backward``'s running total
(``Stream``): PhiMoE's ``sparsemixer`` router and input jitter after its grouped_mm experts; gpt-oss's
experts (expert biases, the clamped SwiGLU ``_apply_gate`` on the interleaved gate/up) and its top-k-then-
softmax router with a bias. Read off steps of transformers' code (fake tensors, each storage's maker;
tests/hf/test_moe_families_peak.py measures both at their widths)."""

from __future__ import annotations

from memplan.blocks.inventory import Dims
from memplan.blocks.moe.stream import Stream, grads
from memplan.config import Setup


def sparsemixer(s: Stream, setup: Setup, kept: dict[str, int]) -> None:
    """PhiMoE's router after its experts (their d(x) [T, h] and d(routing weights) [S] in the activation
    dtype alive): ``torch.concat`` of the two rounds' multipliers hands each round a [T, 1] slice of
    d(weights); the later round's ``PhimoeMultiplier.backward`` first — ``grad · multiplier`` and its
    ``mul(-1)`` [T, 1], ``masked_gates · ...`` [T, E], ``scatter_add_`` into it in place — returning None
    for every input but the logits: the gather, softmax and masked_fill nodes never run and their saves
    (the multiplier [T, 1], the sampled expert [T, 1] int64, the softmax [T, E], the bool mask [T, E]) die
    as the node is released; the first round's the same, d(weights) freed with it; the two rounds'
    d(logits) added [T, E]; the router linear's [E, h] weight gradient and d(x); the MLP input's gradients
    summed, its save (the norm's output) freed; then the input jitter's in-place multiplies
    (``input_jitter``). The same order checkpointed or not (measured)."""
    moe = setup.model.moe
    assert moe is not None
    dims = Dims.of(setup)
    a, t, h, e = dims.act.bytes, dims.tokens, dims.h, moe.experts
    t1, te, tha = t * a, t * e * a, t * h * a
    for r in (2, 1):
        s.step((), (t1, t1, te))  # grad · multiplier, its mul(-1), masked_gates · that
        s.step((t1,))  # scatter_add_ in place: mul(-1) freed
        d_weights = kept["moe.routing_weights"] if r == 1 else 0  # the concat's input gradient [S]
        s.step((t1, kept[f"moe.sparsemixer{r}_multiplier"], d_weights))
        if r == 1:
            s.step((), (te,))  # the two rounds' d(logits) added
            s.step((te, te))
        s.step((kept[f"moe.sparsemixer{r}_expert"], kept[f"moe.sparsemixer{r}_softmax"]))
        s.step((kept[f"moe.sparsemixer{r}_mask"],))
    router = grads(setup, e * h)
    s.step((), (router, tha))  # the router linear: its [E, h] gradient and d(x)
    s.grads((router,))
    s.step((te, kept["mlp.input"]), (tha,))  # the MLP input's gradients summed, its save freed
    s.step((tha, tha))
    if moe.input_jitter > 0:
        input_jitter(s, tha, kept)


def input_jitter(s: Stream, tha: int, kept: dict[str, int]) -> None:
    """``hidden_states *= noise`` twice, in place, on the MLP input (``PhimoeTopKRouter.forward`` on the
    reshaped view, then — run later, its backward earlier — ``PhimoeSparseMoeBlock.forward`` on the
    tensor itself). The view's ``CopySlices``: ``new_empty_strided`` [T, h], the gradient's slice cloned,
    ``mul``'s backward (d·noise), copied in (the clone, the product and the incoming gradient freed, the
    router's noise [T, h] with them); the block's ``mul``'s backward (d·noise), the strided copy and the
    block's noise freed."""
    s.step((), (tha, tha, tha))
    s.step((tha, tha, tha, kept["moe.router_jitter"]))
    s.step((), (tha,))
    s.step((tha, kept["moe.block_jitter"]))


def gpt_oss(s: Stream, setup: Setup, kept: dict[str, int]) -> None:
    """gpt-oss's ``GptOssMLP`` (``GptOssExperts`` on transformers' grouped_mm experts, ``GptOssTopKRouter``):
    the way back to the slots as Mixtral's (bf16 weights), then the experts (``_gpt_oss_experts``), the
    gathers' backward to the tokens and the router (``_topk_softmax_router``)."""
    moe = setup.model.moe
    assert moe is not None
    dims = Dims.of(setup)
    a, t, h = dims.act.bytes, dims.tokens, dims.h
    slots = kept["moe.weight_index"] // 8
    sha, tha = slots * h * a, t * h * a
    w, out = kept["moe.routing_weights"], kept["moe.expert_output"]
    s.step((), (sha,))  # sum(1)'s backward: dY expanded to [T, k, h], a copy
    s.step((), (sha, sha))  # [inv_perm]'s backward: zeros, index_put
    s.step((sha, sha, kept["moe.inverse_index"]), (sha, sha))  # proj · w's: d·w, d·proj
    s.node((), (w,), (out, w))  # d·proj summed over h: d(w) [S, 1]
    s.step((sha, sha))  # d·proj and d(weighted) freed; d(proj) = d·w stays for the down bias
    _gpt_oss_experts(s, setup, kept, sha)
    s.step((), (w, w))  # sample_weights[perm]'s backward: zeros, index_put
    s.step((w, w, kept["moe.weight_index"]), (tha, tha))  # hidden_states[perm // k]'s: zeros, index_put
    s.step((tha, sha, kept["moe.dispatch_index"]))
    _topk_softmax_router(s, setup, kept)


def _gpt_oss_experts(s: Stream, setup: Setup, kept: dict[str, int], d_proj: int) -> None:
    """The grouped_mm down projection (its [E, f, h] weight gradient, d(down input) [S, f], its input
    freed), ``out.add_(down_proj_bias[expert_ids_g])``'s gather backward (zeros and ``index_put`` [E, h],
    d(proj) [S, h] freed after it); ``_apply_gate``'s backward over [S, f]: ``(up + 1) · glu``'s two
    products, ``gate · σ(α·gate)``'s, sigmoid's, the α multiply's, the two parts of d(gate) added;
    ``up.clamp(±limit)``'s ``where`` (its 0-dim zero and two bool masks), ``gate.clamp(max=limit)``'s (one
    mask), the gate_up buffer freed; the two strided slices' backward ([S, 2f] each) added; the gate_up
    grouped_mm's [E, h, 2f] gradient and d(x) [S, h] (its input and the offsets freed), the gate_up bias
    gather's zeros and ``index_put`` [E, 2f] (d(gate_up) and the sorted expert ids freed after it)."""
    moe = setup.model.moe
    assert moe is not None
    dims = Dims.of(setup)
    a, h, f, e = dims.act.bytes, dims.h, dims.f, moe.experts
    slots = kept["moe.weight_index"] // 8
    sha, sfa, mask = slots * h * a, slots * f * a, slots * f
    down = grads(setup, e * f * h)
    s.step((), (down, sfa))  # W_down: the [E, f, h] gradient, d(down input)
    s.grads((down,))
    s.step((kept["moe.down_input"],))
    bias = grads(setup, e * h)
    s.step((), (bias, bias))  # the down bias gather's backward: zeros, index_put [E, h]
    s.step((bias,))
    s.grads((bias,))
    s.step((d_proj,))
    s.step((), (sfa, sfa))  # (up + 1) · glu: d(up + 1), d(glu)
    s.step((sfa, kept["moe.glu"], kept["moe.up_plus_one"]))  # d(down input) and both operands freed
    s.step((), (sfa, sfa))  # gate · σ: d·σ, d·gate
    s.step((sfa, kept["moe.gate_clamped"]))  # d(glu) and the clamped gate freed
    s.step((), (sfa,))  # sigmoid's backward
    s.step((sfa, kept["moe.gate_sigmoid"]))
    s.step((), (sfa,))  # the α multiply's
    s.step((sfa,))
    s.step((), (sfa,))  # the two parts of d(gate) added
    s.step((sfa, sfa))
    s.step((), (a, mask, mask, sfa))  # up's clamp: where(min ≤ up ≤ max, d, 0)
    s.step((mask, mask, a))
    s.step((sfa,))  # d(up + 1) freed
    s.step((), (a, mask, sfa))  # the gate's clamp: where(gate ≤ max, d, 0)
    s.step((mask, a))
    s.step((sfa, kept["moe.gate_up"]))  # d(gate) and the gate_up buffer freed
    for _ in range(2):  # the strided slices' backward: [S, 2f] each, its where freed
        s.step((), (2 * sfa,))
        s.step((sfa,))
    s.step((), (2 * sfa,))  # the two added
    s.step((2 * sfa, 2 * sfa))
    gate_up = grads(setup, e * h * 2 * f)
    s.step((), (gate_up, sha))  # gate_up: the [E, h, 2f] gradient, d(x) [S, h]
    s.grads((gate_up,))
    s.step((kept["moe.offsets"], kept["moe.expert_input"]))
    bias = grads(setup, e * 2 * f)
    s.step((), (bias, bias))  # the gate_up bias gather's backward: zeros, index_put [E, 2f]
    s.step((bias,))
    s.grads((bias,))
    s.step((2 * sfa, kept["moe.bias_index"]))


def _topk_softmax_router(s: Stream, setup: Setup, kept: dict[str, int]) -> None:
    """``softmax(topk(x·Wᵀ + b).values)``'s backward: the softmax's [T, k] (its output and d(weights) [S]
    freed), ``topk``'s zeros and scatter [T, E] (the indices freed), the router linear's d(x), [E, h]
    weight gradient and its bias's [E] — the engine's sum, after the node's saves die where checkpointed
    (the MLP input's save, its last use) —; the MLP input's gradients summed."""
    moe = setup.model.moe
    assert moe is not None
    dims = Dims.of(setup)
    a, t, h, e, k = dims.act.bytes, dims.tokens, dims.h, moe.experts, moe.top_k
    tha, tea, tka = t * h * a, t * e * a, t * k * a
    s.step((), (tka,))
    s.step((kept["moe.routing_weights"], kept["moe.topk_softmax"]))
    s.step((), (tea, tea))
    s.step((tea,))
    s.step((tka, kept["moe.topk_indices"]))
    router, bias = grads(setup, e * h), grads(setup, e)
    s.node((tha, router), (bias,), (kept["mlp.input"],))
    s.grads((router, bias))
    s.step((tea,))
    s.step((), (tha,))  # the MLP input's gradients summed
    s.step((tha, tha))
