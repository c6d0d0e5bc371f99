"""A layer's forward temporaries (``blocks.forward_locals``) against the CPU tracker: the reference
layer's allocations and frees in its forward are the program's, size by size and in order, and the
timeline's "forward: layer n/L peak" points rise above the layer boundary before them as the measured
curve does (issue #22: the allocator replay's forward temporaries)."""

from __future__ import annotations

import functools

import pytest

from memplan.analytic.allocator import Alloc, Event
from memplan.blocks.forward_locals import Op, applies, layer_forward_ops
from memplan.blocks.inventory import Dims
from memplan.config import Attention, Device, ModelConfig, Setup, StrategyConfig, TrainingConfig
from memplan.config import parse_checkpointing as ckpt
from memplan.config.model import MlpType
from memplan.engine import estimate
from memplan.measure.instruments.moments import read_points
from memplan.measure.instruments.tracker import LiveMemoryTracker
from memplan.measure.runs.profile import StepRunner, cpu_tracking
from memplan.timeline import timeline


def setup_of(checkpointing: str, kv: int, seq: int, mlp: MlpType = MlpType.SWIGLU) -> Setup:
    mode, k = ckpt(checkpointing)
    model = ModelConfig(
        hidden_size=64,
        num_layers=3,
        num_heads=4,
        num_kv_heads=kv,
        ffn_size=160,
        vocab_size=1024,
        max_positions=512,
        mlp=mlp,
    )
    return Setup(
        model=model,
        training=TrainingConfig(micro_batch=2, seq_len=seq, precision="bf16-mixed"),
        strategy=StrategyConfig(attention=Attention.EAGER, checkpointing=mode, checkpoint_every=k),
        device=Device.CPU,
    )


CASES = {
    "selective, GQA, the core peaks": setup_of("selective", 2, 256),
    "none, GQA, the core peaks": setup_of("none", 2, 256),
    "selective, MHA, the MLP peaks": setup_of("selective", 4, 64),
    "none, MQA, gelu": setup_of("none", 1, 128, MlpType.GELU),
}


@functools.cache
def measured(case: str) -> tuple[LiveMemoryTracker, dict[str, int]]:
    """One CPU step of ``CASES[case]``: its tracker and where each boundary note falls in its events."""
    runner = StepRunner(CASES[case], "cpu")
    notes: dict[str, int] = {}
    with cpu_tracking(runner) as tracker:

        def note(label: str) -> None:  # a backward hook: returns None (the gradient unchanged)
            tracker.note(label)
            notes.setdefault(label, len(tracker.events))

        runner.step(lambda _: None, {}, note=note)
    return tracker, notes


def window(tracker: LiveMemoryTracker, notes: dict[str, int], layer: int) -> list[Event]:
    """Layer ``layer``'s forward (0-based) in the tracker's events, from the boundary note before it
    to its own: the frees of tensors made before it (the layer before's input, which the layers' loop
    frees after that boundary) left out."""
    events = tracker.events[notes[f"forward {layer - 1}"] : notes[f"forward {layer}"]]
    made = {e.id for e in events if isinstance(e, Alloc)}
    return [e for e in events if isinstance(e, Alloc) or e.id in made]


def signed(ops: list[Op]) -> list[int]:
    """The program as sizes: + made, − freed."""
    made: dict[str, int] = {}
    out = []
    for op in ops:
        if op.size:
            made[op.key] = op.size
        out.append(op.size or -made[op.key])
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_the_layers_forward_allocates_and_frees_as_the_program(case: str) -> None:
    setup = CASES[case]
    dims = Dims.of(setup)
    assert applies(setup, dims)
    tracker, notes = measured(case)
    size = {e.id: e.size for e in tracker.events if isinstance(e, Alloc)}
    for layer in (1, 2):  # between the boundaries: layer i's forward
        got = [e.size if isinstance(e, Alloc) else -size[e.id] for e in window(tracker, notes, layer)]
        assert got == signed(layer_forward_ops(setup, dims))


@pytest.mark.parametrize("case", list(CASES))
def test_the_layer_peak_points_rise_as_measured(case: str) -> None:
    setup = CASES[case]
    est = estimate(setup)
    points = timeline(est)
    labels = [p.label for p in points]
    tracker, notes = measured(case)
    size = {e.id: e.size for e in tracker.events if isinstance(e, Alloc)}
    read = dict(zip(labels, read_points(tracker.curve, labels), strict=True))
    want = {p.label: p.bytes for p in points}
    layers = setup.model.num_layers
    for n in range(2, layers + 1):
        peak, before = read[f"forward: layer {n}/{layers} peak"], read[f"forward: {n - 1}/{layers} layers"]
        assert peak is not None and before is not None
        rise = want[f"forward: layer {n}/{layers} peak"] - want[f"forward: {n - 1}/{layers} layers"]
        # what the loop frees after the boundary note (the input of the layer before) is no tensor of the
        # timeline's: the measured rise from there
        events = tracker.events[notes[f"forward {n - 2}"] : notes[f"forward {n - 1}"]]
        made = {e.id for e in events if isinstance(e, Alloc)}
        freed = sum(size[e.id] for e in events if not isinstance(e, Alloc) and e.id not in made)
        assert peak[1] - before[1] + freed == rise, n
