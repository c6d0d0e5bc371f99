"""The running total ``blocks.moe.backward`` replays an MoE MLP's backward on (``Stream``), and the pieces
every replay shares: a linear's (or E experts') backward, a gated shared expert's gate, a shared MLP."""

from __future__ import annotations

from collections.abc import Iterable

from memplan.blocks.inventory import Dims
from memplan.blocks.profiles import top_layer_grads
from memplan.config import MlpType, Setup
from memplan.config.finetune import MLP_TARGETS


class Stream:
    """A running total of bytes and its highest point: ``step(frees, makes)`` releases ``frees`` first (what
    autograd drops before an op), then makes each of ``makes`` in turn. ``early``: the layer is
    checkpointed (``blocks.moe.backward``'s docstring: a node's saves die before the engine reduces or
    casts its outputs); ``node`` replays one node that way. ``summed``: a weight gradient is added into the
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


def grads(setup: Setup, params: int) -> int:
    """Bytes of the gradients of ``params`` of the MLP as its backward makes them (summed or not)."""
    return top_layer_grads(setup, params, MLP_TARGETS, summed=False)


def bias_grads(setup: Setup, out: int) -> int:
    """A projection's bias gradient, where the model's MLPs have biases."""
    return grads(setup, out) if setup.model.mlp_bias else 0


def linears(s: Stream, weights: int, bias: int, inputs: int, count: int, saved: int) -> None:
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


def shared_gate(s: Stream, setup: Setup, kept: dict[str, int]) -> int:
    """``sigmoid(x·w_g) · shared``'s backward (a gated shared expert): d(shared) = dY·gate and dY·shared,
    whose sum over h is d(gate) [T, 1], the shared output dying with the node (the sigmoid stays: its own
    node keeps it); sigmoid's backward; the gate linear's weight gradient [1, h] and input gradient
    [T, h]. Returns d(shared)'s bytes (the input gradient stays too, the first of the MLP input's)."""
    dims = Dims.of(setup)
    a, t, h = dims.act.bytes, dims.tokens, dims.h
    tha = t * h * a
    s.node((tha, tha), (t * a,), (kept["moe.shared_output"],))
    s.step((tha,), (t * a,))
    gate = grads(setup, h)
    s.step((t * a, kept["moe.shared_gate"]), (gate, tha))
    s.grads((gate,))
    s.step((t * a,))
    return tha


def shared_mlp(s: Stream, setup: Setup, kept: dict[str, int], dy: int, partial: int, last: bool) -> int:
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
    linears(s, grads(setup, width * h), bias_grads(setup, h), tfa, 1, kept["moe.shared.down_input"])
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
        linears(s, grads(setup, h * width), bias_grads(setup, width), tha, 1, 0)
        dies = kept["mlp.input"] if last and name == firsts[-1] else 0
        if partial:  # d(up) or d(gate) freed, the sum with the partial made; then both parts freed
            s.step((tfa, dies), (tha,))
            s.step((partial, tha))
        else:
            s.step((tfa, dies))
        partial = tha
    return partial
