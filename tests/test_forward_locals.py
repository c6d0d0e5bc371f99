"""A layer's forward temporaries in the timeline and the allocator's stream (``blocks.forward_locals``,
``timeline.layer_peak``, ``alloc_stream.codes``' split layer; issue #22). The program's own check
against the CPU tracker is tests/measure/test_forward_locals.py."""

from __future__ import annotations

from collections import Counter

import pytest

from memplan import alloc_stream
from memplan.api import build_setup
from memplan.blocks.forward_locals import Kind, applies, layer_forward_ops, layer_forward_peak
from memplan.blocks.inventory import Dims
from memplan.config import Device, Impl, ImplConfig, Precision
from memplan.engine import estimate
from memplan.options import AttentionChoice
from memplan.timeline import timeline

MIB = 2**20
EAGER = AttentionChoice.EAGER


@pytest.mark.parametrize(
    ("model", "checkpointing"),
    [
        ("llama-2-7b", "selective"),
        ("llama-2-7b", "none"),
        ("llama-3.2-1b", "selective"),
        ("llama-3.2-1b", "none"),
    ],
)
def test_the_programs_saves_are_the_inventorys(model: str, checkpointing: str) -> None:
    setup = build_setup(model, seq=2048, checkpointing=checkpointing, attention=EAGER, device=Device.CUDA)
    dims = Dims.of(setup)
    assert applies(setup, dims)
    saves = [o.size for o in layer_forward_ops(setup, dims) if o.size and o.kind is Kind.SAVE]
    kept = alloc_stream.layer_saves(estimate(setup))
    assert Counter(saves) == Counter(kept)
    j = layer_forward_peak(setup, dims).saves_before
    assert Counter(saves[:j]) == Counter(kept[:j])  # the inventory follows the layer's data flow


def test_llama_2_7b_selective_eager_peaks_at_the_softmax() -> None:
    # Llama-2-7B, s 2048, b 1: at the eager core's softmax, beyond the saves (the norm's, W_Q/W_K/W_V's
    # input, RoPE's q and k, W_V's output): the core's contiguous q, k, v [b, a, s, d] (2048·4096·2 B =
    # 16 MiB each), the scaled scores, the masked scores and the probabilities [b, a, s, s]
    # (32·2048²·2 B = 256 MiB each)
    setup = build_setup(
        "llama-2-7b", seq=2048, checkpointing="selective", attention=EAGER, device=Device.CUDA
    )
    peak = layer_forward_peak(setup, Dims.of(setup))
    assert peak.temporaries == (16 * MIB,) * 3 + (256 * MIB,) * 3
    assert peak.saves_before == 7
    r = estimate(setup)
    points = timeline(r, forward_points=32)
    at = {p.label: p for p in points}
    core, before = at["forward: layer 5/32 peak"], at["forward: 4/32 layers"]
    first = sum(alloc_stream.layer_saves(r)[:7])
    assert core.pieces == peak.temporaries
    assert core.terms["activations"] - before.terms["activations"] == first
    assert core.terms["transient"] == sum(peak.temporaries)
    assert at["forward: 5/32 layers"].terms["transient"] == 0
    # the forward's peaks stay below the step's (the optimizer step's, measured: docs/gpu-profile.md)
    assert max(p.bytes for p in points) == r.peak.bytes
    assert alloc_stream.stream_inputs(r).split == 7


@pytest.mark.parametrize(
    "kw",
    [
        {"attention": AttentionChoice.FLASH},
        {"checkpointing": "full"},
        {"impl": ImplConfig(impl=Impl.HF)},
        {"precision": Precision.FP32},
    ],
)
def test_not_modelled_elsewhere(kw: dict[str, object]) -> None:
    setup = build_setup("llama-3.2-1b", seq=1024, **{"attention": EAGER, **kw})  # type: ignore[arg-type]
    assert layer_forward_peak(setup, Dims.of(setup)).temporaries == ()
    r = estimate(setup)
    assert not any("peak" in p.label for p in timeline(r))
    assert alloc_stream.stream_inputs(r).split == 0


def test_a_split_layer_is_made_as_its_tensors() -> None:
    # one layer saves 1, 2 and 3 bytes, the first before its peak: the peak's rise is that tensor and its
    # temporaries (4, then 5), freed at the boundary, where the rest of the saves (2 and 3) are made
    inputs = alloc_stream.StreamInputs(
        points=((0, 0, 0, 0, 0), (0, 0, 0, 1, 9), (0, 0, 0, 6, 0), (0, 0, 0, 7, 9), (0, 0, 0, 12, 0)),
        per_tensor=(),
        states=(0, 0, 0),
        layer=(1, 2, 3),
        pieces=((), (4, 5), (), (4, 5), ()),
        split=1,
    )
    assert alloc_stream.codes(inputs, steps=1) == [1, 4, 5, -3, -2, 2, 3, 1, 4, 5, -8, -7, 2, 3]
