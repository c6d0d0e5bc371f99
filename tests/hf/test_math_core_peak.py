"""SDPA's math kernel's backward (``Core.MATH``: transformers' SDPA in training on CPU with attention
dropout, which torch's CPU flash kernel does not take) against the step transformers runs, at Granite's and
StarCoder2's own widths under fake tensors (``measure.frameworks.hf_peak``).

The layer backward's top is P·V's backward: fp32 dO (the cast's backward; W_O's input gradient and W_O's
input are freed by then), dV and d(attn) [b, a, s, s] (``blocks.attention.core.math_backward_buffers``).
Before, the math core was read as the flash kernel's (dq, dk, dv, dO in the activation dtype) with W_O's
input kept: Granite-3.0-8B at s 512 was 29,360,128 B under (full checkpointing: 29,364,224), StarCoder2-3B
27,787,264 B (27,791,360)."""

from __future__ import annotations

import pytest

from memplan.analytic.moments import layer_backward as lb
from memplan.blocks.attention.core import Core, core_of, math_backward_buffers
from memplan.blocks.inventory import Dims
from memplan.config import Setup
from memplan.pieces import core_of as pieces_core
from memplan.pieces import pieces
from tests.hf.harness import hf_setup, layer_difference

NARROW = {"hidden_size": 64, "ffn_size": 48, "num_heads": 4, "num_kv_heads": 2}
CASES = [
    hf_setup("granite-3.0-8b", seq=512),
    hf_setup("granite-3.0-8b", seq=512, checkpointing="full"),
    hf_setup("starcoder2-3b", seq=512),
    hf_setup("starcoder2-3b", seq=512, checkpointing="full"),
    # two sequences: torch.matmul folds the transposed fp32 dO into a contiguous [b·a, s, d] first
    hf_setup("granite-3.0-8b", seq=64, batch=2, **NARROW),
]


@pytest.mark.parametrize(
    "setup",
    CASES,
    ids=lambda s: (
        f"{s.model.name}-b{s.training.micro_batch}-s{s.training.seq_len}-{s.strategy.checkpointing.name}"
    ),
)
def test_math_core_layer_backward_is_transformers(setup: Setup) -> None:
    """Exact, with and without transformers' checkpointing (the int64 [s] position ids its checkpointed
    layers hold modelled: ``constants.checkpointed_position_ids``)."""
    assert core_of(setup) is Core.MATH
    assert layer_difference(setup) == 0


def test_math_core_tops_granites_layer() -> None:
    """At Granite-3.0-8B's widths (a 32, d 128, s 512) P·V's backward tops the layer: fp32 dO and dV
    [32, 512, 128] (8,388,608 B each) and d(attn) [32, 512, 512] (33,554,432 B)."""
    p = pieces(pieces_core(CASES[0]))
    dims = Dims.of(p.setup)
    assert math_backward_buffers(dims) == 2 * 32 * 512 * 128 * 4 + 32 * 512 * 512 * 4 == 50_331_648
    top = lb.layer_backward_transient(p.setup, dims, p.params)
    assert lb.attention_backward_transient(p.setup, dims, p.params) == top
