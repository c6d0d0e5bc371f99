"""The memory of the most loaded device over one training step, term by term: a picture of the step.

Points, in step order:

- the forward pass, layer by layer: the resident states (weights, optimizer; gradients too when micro-batches
  accumulate) and the saved activations growing by one layer's saves per layer the device holds (its
  micro-batches in flight included), from the embedding's and the per-forward constants' saves to every
  save at the forward's end (the head's added last);
- then each moment of the backward and the optimizer step that ``analytic.peak`` models, with the terms it
  holds (``Peak.moments``): loss backward, final norm backward, the largest layer backward, embedding
  backward, optimizer step.

Exact at each point (the same figures the estimate reports); NB: between points nothing is drawn, and
the forward's own temporaries (a layer's forward locals, the fp32 logits) are not points of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from memplan.analytic.peak import TERMS, terms
from memplan.engine import Result
from memplan.strategies.offload import offloads_activations
from memplan.strategies.pipeline_parallel import Group

FORWARD_POINTS = 8
"""Forward points drawn at most (evenly spread over the layers), beside the forward's start and end."""


@dataclass(frozen=True)
class Point:
    label: str
    terms: dict[str, int]
    """Bytes of each of ``analytic.peak.TERMS`` alive then."""

    @property
    def bytes(self) -> int:
        return sum(self.terms.values())


def saved_after(r: Result, layer_sets: int) -> list[int]:
    """Bytes the layers (or checkpointed segments) have saved after the first n of them, n = 0 … all.
    Fine-tuning's layers keep different bytes along the gradient flow (``Pieces.layer_bytes``, first layer
    first): their running sum; else n × one layer's."""
    per_layer = r.pieces.layer_bytes
    if per_layer and not r.setup.strategy.segment and len(per_layer) == layer_sets:
        return [sum(per_layer[:n]) for n in range(layer_sets + 1)]
    group = Group.CHECKPOINT if r.setup.strategy.segment else Group.LAYER
    return [r.pieces.group_bytes[group] * n for n in range(layer_sets + 1)]


def _forward(r: Result, forward_points: int) -> tuple[tuple[int, int, int], list[int], list[int], int, str]:
    """What ``timeline``'s forward points hold: the resident states (weights, optimizer, gradients), the
    activations at each forward point (start, the drawn layer boundaries, end), those boundaries' layer
    counts, the layer sets and their unit."""
    dev = r.device
    st, g = dev.states, r.pieces.group_bytes
    accumulating = r.setup.training.grad_accum > 1
    grads = st.gradients if accumulating else 0
    layer_group = Group.CHECKPOINT if r.setup.strategy.segment else Group.LAYER
    layer_sets = dev.counts[layer_group]
    saved = saved_after(r, layer_sets)
    # What the forward saves before its first layer and after its last one: the embedding's and the
    # constants' (and, reversible, the stack's outputs) first; the head's at the end.
    head = g[Group.HEAD] * dev.counts[Group.HEAD] + g[Group.HEAD_FREED] * dev.counts[Group.HEAD_FREED]
    before = dev.activations - head - saved[-1]
    if offloads_activations(r.setup):  # every save goes to the host as it is made: none stays on the GPU
        before, saved = 0, [0] * (layer_sets + 1)
    unit = "segments" if r.setup.strategy.segment else "layers"  # a checkpointed segment keeps its input
    steps = sorted({round(layer_sets * k / forward_points) for k in range(1, forward_points + 1)} - {0})
    activations = [before, *(before + saved[n] for n in steps), dev.activations]
    return (st.weights, st.optimizer, grads), activations, steps, layer_sets, unit


def timeline(r: Result, forward_points: int = FORWARD_POINTS) -> list[Point]:
    """The most loaded device's memory at the forward's layer boundaries and at the modelled moments."""
    (weights, optimizer, grads), activations, steps, layer_sets, unit = _forward(r, forward_points)
    labels = ["forward: start", *(f"forward: {n}/{layer_sets} {unit}" for n in steps), "forward: end"]
    forward = zip(labels, activations, strict=True)
    points = [Point(label, terms(weights, optimizer, grads, a, 0)) for label, a in forward]
    points += [Point(name, dict(parts)) for name, parts in r.device.peak.moments.items()]
    assert all(set(p.terms) == set(TERMS) for p in points)  # NB: one vocabulary of terms throughout
    return points


def timeline_terms(r: Result, forward_points: int = FORWARD_POINTS) -> tuple[tuple[int, ...], ...]:
    """``timeline``'s points as the bytes of each of ``TERMS``, in order, without labels (the allocator
    stream's inputs: ``reserved.stream_inputs``; tests/test_timeline.py checks it equals ``timeline``)."""
    states, activations, *_ = _forward(r, forward_points)
    rows: list[tuple[int, ...]] = [(*states, a, 0) for a in activations]
    rows += [tuple(parts[t] for t in TERMS) for parts in r.device.peak.moments.values()]
    return tuple(rows)
