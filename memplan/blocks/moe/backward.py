"""A mixture-of-experts MLP's backward, tensor by tensor: the highest point it reaches above the layer's
live set (``analytic.layer_backward.mlp_moment``'s for a dense MLP).

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
  dies before its final sum).

A later micro-batch sums each new weight gradient into the ``.grad`` the earlier ones left and frees it
as soon as its node has run (``blocks.profiles.accumulates_in_place``): one linear's gradients at a time
(``Stream.summed``; measured on the reference, tests/measure/test_moe_peak.py; transformers' step is
measured one micro-batch at a time).

Measured (tests/measure/test_moe_peak.py: the reference on CPU, every storage, the layer backward's
moment equal to the byte; tests/hf/test_moe_peak.py: transformers' Mixtral and Qwen3-MoE under fake
tensors). Elsewhere — Megatron's MoE layer, DeepSeek's, PhiMoE's, gpt-oss's and Llama 4's routers,
expert biases, capacity factors, transformers' eager experts, expert, tensor, context
or pipeline parallelism, fine-tuning — the dense moment with the experts'
[S, f] buffers stays (``applies``; ``blocks.moe.mlp_backward_extra``), not measured.
"""

from __future__ import annotations

from collections.abc import Iterable

from memplan.blocks.inventory import Dims, Kept
from memplan.blocks.profiles import accumulates_in_place, profile_of, top_layer_grads
from memplan.config import GateActivation, Impl, MlpType, Setup
from memplan.config.finetune import MLP_TARGETS


class Stream:
    """A running total of bytes and its highest point: ``step(frees, makes)`` releases ``frees`` first (what
    autograd drops before an op), then makes each of ``makes`` in turn. ``early``: the layer is
    checkpointed (the module docstring: a node's saves die before the engine reduces or casts its
    outputs); ``node`` replays one node that way. ``summed``: a weight gradient is added into the
    ``.grad`` an earlier micro-batch left and freed as soon as its node has run (``accumulates_in_place``:
    torch's ``AccumulateGrad`` runs first among the ready nodes); ``grads`` replays that."""

    def __init__(self, start: int, early: bool, summed: bool) -> None:
        self.now = self.peak = start
        self.early, self.summed = early, summed

    def step(self, frees: Iterable[int] = (), makes: Iterable[int] = ()) -> None:
        self.now -= sum(frees)
        for n in makes:
            self.now += n
            self.peak = max(self.peak, self.now)

    def node(self, outputs: Iterable[int], engine: Iterable[int], saves: Iterable[int] = ()) -> None:
        """A node whose function makes ``outputs``, the engine then its reductions or casts ``engine``,
        its ``saves`` dying (their last reference) with it: before ``engine`` when ``early``."""
        self.step((), outputs)
        if self.early:
            self.step(saves, engine)
        else:
            self.step((), engine)
            self.step(saves)

    def grads(self, made: Iterable[int]) -> None:
        """Weight gradients just made: summed into the ``.grad`` and freed under ``summed``, else kept."""
        if self.summed:
            self.step(made)


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
        or moe.input_jitter
        or moe.dense_layers
        or moe.sigmoid
        or moe.groups is not None
    )
    par = setup.parallel
    whole = par.tp == 1 and par.ep == 1 and par.cp == 1 and par.pp == 1
    code = (setup.impl.impl is Impl.REFERENCE and not setup.impl.compile) or (
        p.experts_grouped_mm
        and p.experts_gate_up_fused
        and m.mlp is MlpType.SWIGLU
        and (moe.shared_gate or not moe.shared_width(m))  # Qwen2-MoE's shared expert, gated
    )
    acts = m.mlp in (MlpType.SWIGLU, MlpType.GELU) and m.gate_act is not GateActivation.CLAMPED
    return plain_router and plain_moe and whole and code and acts


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
    if not grouped:
        shared = _reference_shared(s, setup, kept) if moe.shared_width(setup.model) else 0
        _reference_routed(s, setup, kept)
        _router(s, setup, kept, shared, frees_input=True)
    elif moe.shared_width(setup.model):  # Qwen2-MoE: the gate (made last) first, the shared MLP last
        dy = _shared_gate(s, setup, kept)
        _grouped_routed(s, setup, kept)
        _router(s, setup, kept, dy, frees_input=False)
        _shared_mlp(s, setup, kept, dy, dy, last=True)
    else:
        _grouped_routed(s, setup, kept)
        _router(s, setup, kept, 0, frees_input=True)
    return s.peak


def _grads(setup: Setup, params: int) -> int:
    """Bytes of the gradients of ``params`` of the MLP as its backward makes them (summed or not)."""
    return top_layer_grads(setup, params, MLP_TARGETS, summed=False)


def _bias(setup: Setup, out: int) -> int:
    """A projection's bias gradient, where the model's MLPs have biases."""
    return _grads(setup, out) if setup.model.mlp_bias else 0


def _linears(s: Stream, weights: int, bias: int, inputs: int, count: int, saved: int) -> None:
    """``count`` linears' backward (one, or an expert each on its slice of the slots): their weight
    gradients ``weights`` and input gradients ``inputs`` together, each bias gradient (``bias`` one) the
    engine's reduction after its node, ``saved`` (the input they keep, where this is its last use) dying
    with the last node. Summed into ``.grad`` (``Stream.summed``), one linear's gradients live at a time."""
    if s.summed:  # each node's gradients summed and freed before the next: the last's beside every input
        one = weights // count
        s.step((), (inputs, one))
        s.node((), (bias,), (saved,))
        s.grads((one, bias))
        return
    s.step((), (weights + (count - 1) * bias, inputs))
    s.node((), (bias,), (saved,))


def _shared_gate(s: Stream, setup: Setup, kept: dict[str, int]) -> int:
    """``sigmoid(x·w_g) · shared``'s backward (a gated shared expert): d(shared) = dY·gate and dY·shared,
    whose sum over h is d(gate) [T, 1], the shared output dying with the node (the sigmoid stays: its own
    node keeps it); sigmoid's backward; the gate linear's weight gradient [1, h] and input gradient
    [T, h]. Returns d(shared)'s bytes (the input gradient stays too, the first of the MLP input's)."""
    dims = Dims.of(setup)
    a, t, h = dims.act.bytes, dims.tokens, dims.h
    tha = t * h * a
    s.node((tha, tha), (t * a,), (kept["moe.shared_output"],))
    s.step((tha,), (t * a,))
    gate = _grads(setup, h)
    s.step((t * a, kept["moe.shared_gate"]), (gate, tha))
    s.grads((gate,))
    s.step((t * a,))
    return tha


def _shared_mlp(s: Stream, setup: Setup, kept: dict[str, int], dy: int, partial: int, last: bool) -> int:
    """The shared experts' MLP (n·f_s wide) on every token: ``dy`` its incoming gradient's own bytes (0:
    the layer's dY itself), freed after W_down's backward; its input gradients summed into the MLP
    input's ``partial`` one (0: none yet) as they come; ``last``: its W_gate's (W_up's) input gradient is
    the MLP input's last, whose save (the norm's output) dies before that sum. Returns the partial sum's
    bytes."""
    moe = setup.model.moe
    assert moe is not None
    dims = Dims.of(setup)
    a, t, h = dims.act.bytes, dims.tokens, dims.h
    tha, width = t * h * a, moe.shared_width(setup.model)
    tfa = t * width * a
    # W_down: its weight gradient and d(down input); then d(shared) freed
    _linears(s, _grads(setup, width * h), _bias(setup, h), tfa, 1, kept["moe.shared.down_input"])
    s.step((dy,))
    if setup.model.mlp is MlpType.SWIGLU:  # d·up and d·act; then d(down input), up and act freed
        s.step((), (tfa, tfa))
        s.step((tfa, kept["moe.shared.up"], kept["moe.shared.act"]))
        firsts = ["up", "gate"]  # W_up's backward first, then silu's and W_gate's
    else:  # gelu's backward: d(up); d(down input) and up freed
        s.step((), (tfa,))
        s.step((tfa, kept["moe.shared.up"]))
        firsts = ["up"]
    for name in firsts:
        if name == "gate":  # silu's backward, then d(act) and the gate freed
            s.step((), (tfa,))
            s.step((tfa, kept["moe.shared.gate"]))
        _linears(s, _grads(setup, h * width), _bias(setup, width), tha, 1, 0)
        dies = kept["mlp.input"] if last and name == firsts[-1] else 0
        if partial:  # d(up) or d(gate) freed, the sum with the partial made; then both parts freed
            s.step((tfa, dies), (tha,))
            s.step((partial, tha))
        else:
            s.step((tfa, dies))
        partial = tha
    return partial


def _reference_shared(s: Stream, setup: Setup, kept: dict[str, int]) -> int:
    """``out = routed + [sigmoid(x·w_g) ·] shared(x)`` in the reference: the shared branch, made last, runs
    first, its gate then its MLP; returns the MLP input's partial gradient (``_router`` adds the routed
    d(x) to it)."""
    moe = setup.model.moe
    assert moe is not None
    if moe.shared_gate:
        dy = _shared_gate(s, setup, kept)
        return _shared_mlp(s, setup, kept, dy, dy, last=False)  # the gate's input gradient first
    return _shared_mlp(s, setup, kept, 0, 0, last=False)


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
    _linears(s, _grads(setup, e * f * h), _bias(setup, h), sfa, e, kept["moe.down_input"])
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
        into = _grads(setup, e * h * f)
        _linears(s, into, _bias(setup, f), sha, e, kept["moe.expert_input"] if last else 0)
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
    down = _grads(setup, e * h * f)
    s.step((), (down, sfa))  # W_down: the [E, h, f] gradient, d(down input) [S, f]
    s.grads((down,))
    s.step((d_proj, kept["moe.down_input"]), (sfa, sfa))  # d·up and d·act
    s.step((sfa, kept["moe.act"]), (sfa,))  # silu's backward: d(gate)
    s.step((sfa, kept["moe.gate_up"]), (2 * sfa,))  # cat(d(gate), d(up)): [S, 2f]
    s.step((sfa, sfa))
    gate_up = _grads(setup, e * 2 * f * h)
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
    router = _grads(setup, e * h)
    s.step((), (router, tha))  # the router's weight gradient [E, h] and input gradient
    s.grads((router,))
    s.step((te_router, kept["mlp.input"] if frees_input else 0), (tha,))  # the MLP input's gradients summed
    s.step((tha, tha))  # the routed (or summed) d(x) and the router's
