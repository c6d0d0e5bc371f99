"""A mixture-of-experts MLP's backward, tensor by tensor: the highest point it reaches above the layer's
live set (``analytic.moments.layer_backward.mlp_moment``'s for a dense MLP).

A dense MLP's backward peaks at its product's gradient, three [T, f] buffers beside dY
(``blocks.mlp.mlp_backward_transient``). An MoE layer's runs over S = T·k slots and E experts, in an order
its code fixes, and its highest point moves with the shapes: at the product's gradient where the [S, f]
buffers outweigh the experts' weight gradients (short layers, many slots), after the last expert
gradient where those outweigh them (Mixtral: 2.8 GB of weight gradients against 117 MB a buffer at s
2,048). So the backward is replayed here as its code runs it: each step frees what autograd releases
before an op (a node's saves once it has run, a gradient once summed or consumed) and then makes the
op's outputs; the highest running total is the moment. Where the layer is checkpointed (torch's
non-reentrant checkpoint hands each node its re-run saves, dropped when the node's function returns),
a node's saves die before the engine's own work on its outputs — the reductions of broadcast inputs'
gradients (``sum_to``: a bias, the routing weights [S, 1]) and the casts to an input's dtype —; without
it they die after (``Stream``'s ``early``). Every size is a save the estimate already keeps
(``blocks.moe.moe_rules``, by name) or a gradient of one of them; the order and the frees were read off
the ops of a real step (``memplan.measure.instruments.tracker`` with each storage's maker), the code:

- memplan's reference MoE (``measure/reference/moe.py``): ``index_add_`` back to the tokens, per-expert
  ``nn.Linear`` on slices of the sorted slots (each expert's weight gradient and input-gradient piece,
  the pieces concatenated), the router's fp32 softmax, top-k and renormalisation, shared experts first
  (autograd runs the later-made branch first) with their sigmoid gate;
- transformers' ``grouped_mm`` experts (``integrations/moe.py::grouped_mm_experts_forward``, 5.x): one
  ``_grouped_mm`` a projection (weight gradients [E, ·, ·] whole), the fused ``gate_up_proj`` [S, 2f],
  ``weighted_out[inv_perm]`` and ``view(T, k, h).sum(1)`` back to the tokens, Mixtral's fp32 routing
  weights (``Profile.routing_weights_fp32``); Qwen2-MoE's gated shared expert, made first and gated last:
  its gate's backward first, the routed experts' and the router's, its MLP's last (the MLP input's save
  dies before its final sum);
- transformers' Llama 4 (``Llama4TextMoe``): every token through all E experts, its input scaled by the
  sigmoid scores, the experts' ``bmm``s over [E, T, ·], the shared expert first (``_llama4``);
- transformers' DeepSeek-V2 (``DeepseekV2Moe``): the ungated shared MLP first, the grouped_mm experts, its
  fp32 softmax router with ``routed_scaling_factor`` and group-limited routing's mask, its weight kept in
  fp32 (``_deepseek``); DeepSeek-V3's sigmoid router the same way, its top-k weights gathered from the
  scores and renormalised (``_v3_choice``);
- transformers' PhiMoE (``PhimoeSparseMoeBlock``): the grouped_mm experts, then ``sparsemixer``'s two
  ``PhimoeMultiplier`` backwards and the input jitter's in-place multiplies (``hf_routers.sparsemixer``);
- transformers' gpt-oss (``GptOssMLP``): the grouped_mm experts with their gathered biases and the
  clamped SwiGLU, the top-k-then-softmax router with its bias (``hf_routers.gpt_oss``).

A later micro-batch sums each new weight gradient into the ``.grad`` the earlier ones left and frees it
as soon as its node has run (``blocks.profiles.accumulates_in_place``): one linear's gradients at a time
(``Stream.summed``; measured on the reference, tests/measure/test_moe_peak.py; transformers' step is
measured one micro-batch at a time).

Measured (tests/measure/test_moe_peak.py: the reference on CPU, every storage, the layer backward's
moment equal to the byte; tests/hf/test_moe_peak.py: transformers' Mixtral and Qwen3-MoE under fake
tensors; tests/hf/test_layer_kinds.py: Llama 4 Scout and Maverick at their widths, DeepSeek-V2's and
V3's layers; tests/hf/test_moe_families_peak.py: PhiMoE and gpt-oss at h 512, f 128, where the experts
top the layer).
Elsewhere — Megatron's MoE layer, expert biases but gpt-oss's, capacity
factors, transformers' eager experts, expert, tensor, context
or pipeline parallelism, fine-tuning — the dense moment with the experts'
[S, f] buffers stays (``applies``; ``blocks.moe.mlp_backward_extra``), not measured.
"""

from __future__ import annotations

from collections.abc import Iterable

from memplan.blocks import llama4
from memplan.blocks.inventory import Dims, Kept
from memplan.blocks.moe.hf_routers import gpt_oss, sparsemixer
from memplan.blocks.moe.stream import Stream, bias_grads, grads, linears, shared_gate, shared_mlp
from memplan.blocks.profiles import accumulates_in_place, profile_of
from memplan.config import DType, GateActivation, Impl, MlpType, Setup


def applies(setup: Setup) -> bool:
    """Whether ``rise`` models this MoE layer: full training of a softmax top-k router without biases,
    dropless, on one rank's whole layer, in memplan's reference model or transformers' grouped_mm
    experts (gated experts fused as ``gate_up_proj``)."""
    m, moe = setup.model, setup.model.moe
    if moe is None or not setup.finetune.trains_everything or setup.strategy.reversible:
        return False
    p = profile_of(setup)
    plain_router = not (p.megatron_moe or p.deepseek_router or p.sparsemixer_router or p.router_topk_softmax)
    plain_moe = not (
        moe.router_sigmoid
        or moe.router_bias
        or moe.expert_bias
        or moe.capacity_factor is not None
        or (moe.input_jitter and not p.sparsemixer_router)  # PhiMoE's (``hf_routers.input_jitter``)
        or moe.dense_layers
        or moe.sigmoid
        or moe.groups is not None
    )
    par = setup.parallel
    whole = par.tp == 1 and par.ep == 1 and par.cp == 1 and par.pp == 1
    if llama4.applies(setup):  # ``Llama4TextMoe`` (``_llama4``): a uniform MoE kind (``llama4.kind_model``)
        return whole and setup.model.moe_every is None and m.mlp is MlpType.SWIGLU
    if p.deepseek_router:  # DeepSeek-V2's and V3's routers (``_deepseek``); its dense layers are a kind apart
        # V2's softmax router, not renormalised; V3's sigmoid router (``_v3_choice``)
        v2 = (moe.sigmoid or not moe.renormalises) and not moe.shared_gate
        # 16-bit activations: the router's fp32 copy of its input (grouped_mm runs no fp32 on CPU or CUDA)
        copy = setup.training.precision.activation_dtype is not DType.FP32
        return whole and v2 and copy and p.experts_grouped_mm
    fused = p.experts_grouped_mm and p.experts_gate_up_fused and m.mlp is MlpType.SWIGLU
    if p.sparsemixer_router:  # PhiMoE's grouped_mm experts and sparsemixer (``hf_routers.sparsemixer``)
        return plain_moe and whole and fused and not moe.shared_width(m)
    if p.router_topk_softmax:  # gpt-oss's biased experts and router (``hf_routers.gpt_oss``)
        return whole and fused and _gpt_oss_moe(setup)
    code = (setup.impl.impl is Impl.REFERENCE and not setup.impl.compile) or (
        p.experts_grouped_mm
        and p.experts_gate_up_fused
        and m.mlp is MlpType.SWIGLU
        and (moe.shared_gate or not moe.shared_width(m))  # Qwen2-MoE's shared expert, gated
    )
    acts = m.mlp in (MlpType.SWIGLU, MlpType.GELU) and m.gate_act is not GateActivation.CLAMPED
    return plain_router and plain_moe and whole and code and acts


def _gpt_oss_moe(setup: Setup) -> bool:
    """gpt-oss's MoE as ``hf_routers.gpt_oss`` replays it: the clamped SwiGLU, a biased router and biased
    experts, nothing else of the others'."""
    moe = setup.model.moe
    assert moe is not None
    clamped = setup.model.gate_act is GateActivation.CLAMPED
    plain = not (
        moe.router_sigmoid or moe.input_jitter or moe.dense_layers or moe.sigmoid or moe.renormalises
    )
    dropless = moe.capacity_factor is None and moe.groups is None and not moe.shared_width(setup.model)
    return clamped and moe.router_bias and moe.expert_bias and plain and dropless


def rise(setup: Setup, layer: Iterable[Kept]) -> int:
    """The MoE MLP backward's highest point above the layer's live set (every save alive, the layer's
    output gradient dY [T, h] arriving: counted here, as the dense moment counts it), ``applies`` holding;
    ``layer``: one layer's saves (``blocks.moe.moe_rules``' and the MLP's input among them)."""
    kept = {k.name: k.bytes for k in layer}
    dims = Dims.of(setup)
    early, summed = bool(setup.strategy.segment), accumulates_in_place(setup)
    s = Stream(dims.tokens * dims.h * dims.act.bytes, early, summed)
    grouped = setup.impl.impl is not Impl.REFERENCE
    moe = setup.model.moe
    assert moe is not None
    if moe.router_sigmoid:  # transformers' Llama 4: every token through every expert
        _llama4(s, setup, kept)
    elif profile_of(setup).deepseek_router:  # DeepSeek-V2 and V3: the shared MLP first, its own router last
        _deepseek(s, setup, kept)
    elif profile_of(setup).router_topk_softmax:  # gpt-oss: biased experts, the clamped SwiGLU, its router
        gpt_oss(s, setup, kept)
    elif profile_of(setup).sparsemixer_router:  # PhiMoE: the grouped_mm experts, its two-round router
        _grouped_routed(s, setup, kept)
        sparsemixer(s, setup, kept)
    elif not grouped:
        shared = _reference_shared(s, setup, kept) if moe.shared_width(setup.model) else 0
        _reference_routed(s, setup, kept)
        _router(s, setup, kept, shared, frees_input=True)
    elif moe.shared_width(setup.model):  # Qwen2-MoE: the gate (made last) first, the shared MLP last
        dy = shared_gate(s, setup, kept)
        _grouped_routed(s, setup, kept)
        _router(s, setup, kept, dy, frees_input=False)
        shared_mlp(s, setup, kept, dy, dy, last=True)
    else:
        _grouped_routed(s, setup, kept)
        _router(s, setup, kept, 0, frees_input=True)
    return s.peak


def _reference_shared(s: Stream, setup: Setup, kept: dict[str, int]) -> int:
    """``out = routed + [sigmoid(x·w_g) ·] shared(x)`` in the reference: the shared branch, made last, runs
    first, its gate then its MLP; returns the MLP input's partial gradient (``_router`` adds the routed
    d(x) to it)."""
    moe = setup.model.moe
    assert moe is not None
    if moe.shared_gate:
        dy = shared_gate(s, setup, kept)
        return shared_mlp(s, setup, kept, dy, dy, last=False)  # the gate's input gradient first
    return shared_mlp(s, setup, kept, 0, 0, last=False)


def _reference_routed(s: Stream, setup: Setup, kept: dict[str, int]) -> None:
    """The reference's routed experts: ``index_add_``'s, the weights', W_down's, the activation's, W_up's and
    W_gate's backward, each expert on its slice of the slots, the pieces concatenated."""
    moe = setup.model.moe
    assert moe is not None
    dims = Dims.of(setup)
    a, t, h, f, e = dims.act.bytes, dims.tokens, dims.h, dims.f, moe.experts
    slots = kept["moe.weight_index"] // 8  # [S] int64
    sha, sfa, tha = slots * h * a, slots * f * a, t * h * a
    w = kept["moe.routing_weights"]  # [S, 1] in the weights' dtype
    # index_add_'s backward gathers dY at the slots, its source freed; out · w's: d(out) = d·w and d·out,
    # whose sum over h is d(w) [S, 1], out and w dying with the node; the gathered dY freed
    s.step((), (sha,))
    s.step((kept["moe.weighted_output"],))
    s.node((sha, sha), (w,), (w, kept["moe.expert_output"]))
    s.step((sha, sha))
    s.step((), (w, w))  # the weight gather's backward: zeros, index_add
    s.step((w, w, kept["moe.weight_index"]))
    # W_down: the experts' weight gradients and input-gradient pieces; its input and d(out) freed
    linears(s, grads(setup, e * f * h), bias_grads(setup, h), sfa, e, kept["moe.down_input"])
    s.step((sha,))
    if setup.model.mlp is MlpType.SWIGLU:
        s.step((), (sfa,))  # the pieces concatenated: d(down input)
        s.step((sfa,), (sfa, sfa))  # the pieces freed; d·up, d·act
        s.step((sfa, kept["moe.up"], kept["moe.act"]), (sfa,))  # silu's backward: d(gate)
        s.step((sfa, kept["moe.gate"]))
        projections = 2  # W_up's, then W_gate's
    else:  # gelu's backward: d(up); d(down input) and up freed
        s.step((), (sfa,))
        s.step((sfa,), (sfa,))
        s.step((sfa, kept["moe.up"]))
        projections = 1
    cats: list[int] = []
    for i in range(projections):
        last = i == projections - 1
        into = grads(setup, e * h * f)
        linears(s, into, bias_grads(setup, f), sha, e, kept["moe.expert_input"] if last else 0)
        s.step((sfa,))  # d(up) or d(gate) freed
        s.step((), (sha,))  # the pieces concatenated
        if cats:  # W_gate's and W_up's input gradients summed: the pieces freed, the sum made
            s.step((sha,), (sha,))
            s.step((*cats, sha), (tha,))  # the two [S, h] freed; index_add's zeros [T, h]
            cats = [sha]  # the sum
        elif last:  # GELU: the pieces freed, index_add's zeros [T, h] made
            s.step((sha,), (tha,))
            cats = [sha]
        else:
            s.step((sha,))
            cats.append(sha)
    # index_select's backward: index_add into the zeros; then the zeros, the [S, h] sum and the token index
    s.step((), (tha,))
    s.step((tha, *cats, kept["moe.dispatch_index"]))


def _grouped_routed(s: Stream, setup: Setup, kept: dict[str, int]) -> None:
    """transformers' grouped_mm experts: ``sum(1)``'s, ``[inv_perm]``'s, the weights', W_down's, SwiGLU's,
    ``cat``'s and ``gate_up_proj``'s backward, then ``hidden_states[perm // k]``'s."""
    moe = setup.model.moe
    assert moe is not None
    dims = Dims.of(setup)
    a, t, h, f, e = dims.act.bytes, dims.tokens, dims.h, dims.f, moe.experts
    slots = kept["moe.weight_index"] // 8
    sha, sfa, tha = slots * h * a, slots * f * a, t * h * a
    w, out = kept["moe.routing_weights"], kept["moe.expert_output"]
    wide = w // slots  # the weighted output's bytes an element: fp32 weights promote it (Mixtral)
    shw, thw = slots * h * wide, t * h * wide
    if wide != a:  # ``.to(hidden dtype)``'s backward: dY upcast [T, h]
        s.step((), (thw,))
    s.step((), (shw,))  # sum(1)'s backward: dY expanded to [T, k, h], a copy
    s.step((thw,) if wide != a else (), (shw, shw))  # [inv_perm]'s backward: zeros, index_put
    # proj · w's: d(proj) = d·w and d·proj in the wide dtype; the engine casts d(proj) to the projection's
    # dtype (fp32 weights) and sums d·proj over h, d(w) [S, 1]; proj and w die with the node
    s.step((shw, shw, kept["moe.inverse_index"]), (shw, shw))
    if s.early:
        s.step((out, w))
    if wide != a:
        s.step((), (sha,))
        s.step((shw,), (w,))
    else:
        s.step((), (w,))
    s.step((shw, shw) if s.early else (shw, shw, w, out))  # d·proj and d(weighted) freed
    d_proj = sha if wide != a else shw
    down = grads(setup, e * h * f)
    s.step((), (down, sfa))  # W_down: the [E, h, f] gradient, d(down input) [S, f]
    s.grads((down,))
    s.step((d_proj, kept["moe.down_input"]), (sfa, sfa))  # d·up and d·act
    s.step((sfa, kept["moe.act"]), (sfa,))  # silu's backward: d(gate)
    s.step((sfa, kept["moe.gate_up"]), (2 * sfa,))  # cat(d(gate), d(up)): [S, 2f]
    s.step((sfa, sfa))
    gate_up = grads(setup, e * 2 * f * h)
    s.step((), (gate_up, sha))  # gate_up_proj: the [E, 2f, h] gradient, d(x) [S, h]
    s.grads((gate_up,))
    s.step((2 * sfa, kept["moe.offsets"], kept["moe.expert_input"]))
    s.step((), (w, w))  # sample_weights[perm]'s backward: zeros, index_put
    s.step((w, w, kept["moe.weight_index"]), (tha, tha))  # hidden_states[perm // k]'s: zeros, index_put
    s.step((tha, sha, kept["moe.dispatch_index"]))


def _router(s: Stream, setup: Setup, kept: dict[str, int], shared: int, frees_input: bool) -> None:
    """After the routed experts (their d(x) [T, h] and the weights' gradient, as the slots' [S] in the
    routing weights' dtype, alive): the shared branch's partial d(x) (``shared`` bytes) added; the
    router's backward — the renormalisation's (when it divides by the top-k sum), the top-k's scatter into
    [T, E], the fp32 softmax's, the router linear's weight and input gradients —; the MLP input's
    gradients summed (its save, the norm's output, freed where ``frees_input``: no shared MLP reads it
    later)."""
    moe = setup.model.moe
    assert moe is not None
    dims = Dims.of(setup)
    a, t, h, e, k = dims.act.bytes, dims.tokens, dims.h, moe.experts, moe.top_k
    tha, tk4, te4 = t * h * a, t * k * 4, t * e * 4
    w = kept["moe.routing_weights"]  # d(weights) [T, k] as the slots' [S] in w's dtype
    if shared:  # the shared branch's partial sum and the routed d(x) added at once
        s.step((), (tha,))
        s.step((shared, tha))
    if moe.renormalises:
        upcast = w // (t * k) != 4  # weights cast to the activation dtype: d(weights) back to fp32 first
        if upcast:
            s.step((), (tk4,))
            s.step((w,))
        d_weights = tk4 if upcast else w
        # weights / total: d/total and d(total) = −d·weights/total², summed over k by the engine, the
        # dividend and divisor dying with the node
        s.step((), (tk4, tk4, tk4, tk4))
        s.step((tk4, tk4, tk4), (tk4,))
        saves = (kept["moe.topk_sum"], kept["moe.topk_weights"])
        s.node((), (t * 4,), saves)
        s.step((tk4, d_weights), (tk4,))  # the two parts of d(weights) added
        s.step((tk4, t * 4), (te4, te4))  # topk's backward: zeros, scatter
        s.step((te4, tk4, kept["moe.topk_indices"]), (te4,))  # the softmax's backward
    else:
        s.step((), (te4, te4))
        s.step((te4, w, kept["moe.topk_indices"]), (te4,))
    s.step((te4, kept["moe.router_probs"]))
    if a != 4:  # the fp32 softmax's gradient cast to the router's dtype
        s.step((), (t * e * a,))
        s.step((te4,))
        te_router = t * e * a
    else:
        te_router = te4
    router = grads(setup, e * h)
    s.step((), (router, tha))  # the router's weight gradient [E, h] and input gradient
    s.grads((router,))
    s.step((te_router, kept["mlp.input"] if frees_input else 0), (tha,))  # the MLP input's gradients summed
    s.step((tha, tha))  # the routed (or summed) d(x) and the router's


def _llama4(s: Stream, setup: Setup, kept: dict[str, int]) -> None:
    """transformers' ``Llama4TextMoe`` (``blocks.llama4``: every token through all E experts, scaled by its
    sigmoid scores): ``sum(0)``'s backward expanded and reshaped, a copy [E·T, h]; the shared expert
    (``shared_expert(hidden)``, made after the routed ``bmm``s, runs first); the experts' ``bmm``s, SwiGLU's
    and ``chunk``'s backward over [E, T, ·]; ``routed_in · scores``' (d(routed_in) and d·routed_in, summed
    over h by the engine to d(scores) [E·T, 1], both operands dying with the node); ``repeat``'s (a sum over
    E) into the MLP input's gradient; the scores' way back — the cast to fp32, the fp32 sigmoid's, the cast
    back, ``scatter_``'s gather [T, k], ``topk``'s zeros and scatter [T, E] —; the router linear's, the MLP
    input's save dying with it. Read off a step of transformers' Llama 4 Scout (fake tensors, each storage's
    maker; tests/hf/test_llama4.py)."""
    moe = setup.model.moe
    assert moe is not None
    dims = Dims.of(setup)
    a, t, h, f, e, k = dims.act.bytes, dims.tokens, dims.h, dims.f, moe.experts, moe.top_k
    tha, eth, etf = t * h * a, e * t * h * a, e * t * f * a
    s.step((), (eth,))  # the routed output's gradient [E·T, h]: sum(0)'s expand, reshaped (a copy)
    partial = shared_mlp(s, setup, kept, 0, 0, last=False)
    down = grads(setup, e * f * h)
    s.step((), (down, etf))  # the down bmm: the [E, f, h] gradient, d(down input) [E, T, f]
    s.grads((down,))
    s.step((eth, kept["moe.down_input"]), (etf, etf))  # d·up and d·act
    s.step((etf, kept["moe.act"]), (etf,))  # silu's backward: d(gate)
    s.step((etf, kept["moe.gate_up"]), (2 * etf,))  # chunk's backward: cat(d(gate), d(up)) [E, T, 2f]
    s.step((etf, etf))
    gate_up = grads(setup, e * h * 2 * f)
    s.step((), (gate_up, eth))  # the gate_up bmm: the [E, h, 2f] gradient, d(expert input) [E, T, h]
    s.grads((gate_up,))
    s.step((2 * etf, kept["moe.expert_input"]))
    scores = kept["moe.scores"]  # [E·T, 1] in the activation dtype
    s.node((eth, eth), (scores,), (scores, kept["moe.routed_in"]))  # routed_in · scores
    s.step((eth, eth))  # d·routed_in (before its sum over h) and d(expert input) freed
    s.step((), (tha,))  # repeat's backward: d(routed_in) summed over the E copies
    s.step((eth,), (tha,))  # added to the shared expert's d(x)
    s.step((partial, tha))
    te4, tea = t * e * 4, t * e * a
    s.step((), (te4,))  # d(scores) [T, E] cast to the sigmoid's fp32
    s.step((scores,), (te4,))  # the sigmoid's backward
    s.step((te4, kept["moe.router_scores"]), (tea,))  # cast back to the logits' dtype
    s.step((te4,), (t * k * a,))  # scatter_'s backward: gather [T, k]
    s.step((tea,), (tea, tea))  # topk's backward: zeros, scatter
    s.step((tea, t * k * a, kept["moe.topk_indices"]))
    router = grads(setup, e * h)
    s.step((), (router, tha))  # the router linear: its [E, h] gradient and d(x)
    s.grads((router,))
    s.step((tea, kept["mlp.input"]), (tha,))  # the MLP input's gradients summed, its save freed
    s.step((tha, tha))


def _deepseek(s: Stream, setup: Setup, kept: dict[str, int]) -> None:
    """transformers' ``DeepseekV2Moe``: ``experts(...) + shared_experts(residuals)`` — the shared MLP, made
    last, runs first, the MLP input's save dying with its W_gate's backward where the router reads an fp32
    copy of it —; the grouped_mm experts with the fp32 routing weights (``_grouped_routed``), their d(x)
    added to the shared MLP's; then ``DeepseekV2TopkRouter``'s: ``routed_scaling_factor``'s multiply
    (d(weights)·scale [T, k] fp32), ``topk``'s zeros and scatter [T, E], group-limited routing's
    ``masked_fill`` (its bool mask dying), the fp32 softmax's, the fp32 linear's — its weight kept in fp32
    (``_keep_in_fp32_modules_strict``: a [E, h] fp32 gradient) and d(x) in fp32, cast back to the
    activations' dtype (``hidden_states.type(float32)``'s backward). Read off a step of transformers'
    DeepSeek-V2 (fake tensors, each storage's maker; tests/hf/test_layer_kinds.py)."""
    moe = setup.model.moe
    assert moe is not None
    dims = Dims.of(setup)
    a, t, h, e, k = dims.act.bytes, dims.tokens, dims.h, moe.experts, moe.top_k
    tha, th4, tk4, te4 = t * h * a, t * h * 4, t * k * 4, t * e * 4
    partial = shared_mlp(s, setup, kept, 0, 0, last=True)  # the router reads an fp32 copy of the input
    _grouped_routed(s, setup, kept)
    s.step((), (tha,))  # the routed d(x) added to the shared MLP's
    s.step((partial, tha))
    s.step((), (tk4,))  # routed_scaling_factor's multiply: d(weights)·scale
    if moe.sigmoid:
        _v3_choice(s, setup, kept)
    else:
        s.step((kept["moe.routing_weights"],), (te4, te4))  # topk's backward: zeros, scatter
        s.step((te4, tk4, kept["moe.topk_indices"]))
        if moe.groups is not None:  # masked_fill(~group_mask, 0)'s backward
            s.step((), (te4,))
            s.step((te4, kept["moe.group_mask"]))
    s.step((), (te4,))  # the fp32 softmax's (V3: sigmoid's) backward
    s.step((te4, kept["moe.router_scores"]))
    router = 4 * e * h if grads(setup, e * h) else 0  # the router's fp32 weight gradient [E, h]
    s.step((), (router, th4))
    s.grads((router,))
    s.step((te4, kept["moe.router_input"]), (tha,))  # d(x) in fp32 cast back
    s.step((th4,), (tha,))  # added to the MLP input's gradient
    s.step((tha, tha))


def _v3_choice(s: Stream, setup: Setup, kept: dict[str, int]) -> None:
    """``DeepseekV3TopkRouter``'s way back from d(weights)·scale [T, k] fp32 to the sigmoid's output: the
    experts' d(weights) [S] freed; the renormalisation's (``norm_topk_prob``: ``topk_weights /= sum +
    1e-20``; d/total, d(total) = −d·weights/total² summed over k by the engine, the dividend's clone and
    the divisor dying with the node; the two parts of d(weights) added); ``scores.gather(1, topk_indices)``'s
    (zeros and scatter_add [T, E]), the indices dying. The choice itself (the correction bias, the groups'
    top-2 sums, ``masked_fill(-inf)``, ``topk``) passes on indices only: no gradient flows through it.
    Read off a step of transformers' DeepSeek-V3 (fake tensors, each storage's maker;
    tests/hf/test_layer_kinds.py)."""
    moe = setup.model.moe
    assert moe is not None
    dims = Dims.of(setup)
    t, e, k = dims.tokens, moe.experts, moe.top_k
    tk4, te4 = t * k * 4, t * e * 4
    if moe.renormalises:
        s.step((kept["moe.routing_weights"],))
        s.step((), (tk4, tk4, tk4, tk4))
        s.step((tk4, tk4, tk4), (tk4,))
        s.node((), (t * 4,), (kept["moe.topk_sum"], kept["moe.topk_weights"]))
        s.step((tk4, tk4), (tk4,))  # the scaled d(weights) freed, the two parts of d(weights) added
        s.step((tk4, t * 4), (te4, te4))  # gather's backward: zeros, scatter_add
    else:
        s.step((kept["moe.routing_weights"],), (te4, te4))
    s.step((te4, tk4, kept["moe.topk_indices"]))
