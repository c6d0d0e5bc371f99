"""The layer backward of transformers' mixtures of experts (``grouped_mm`` experts, fused ``gate_up_proj``)
at each family's real widths, fake tensors, two layers: the highest point measured
(``measure.frameworks.hf_peak``) against the estimate's (``blocks.moe.backward``: the MoE's backward
replayed op by op).

Before, the moment was the dense MLP's with the experts' [S, f] buffers: at Mixtral 8x7B's widths and s
2,048 under full checkpointing the estimate's layer backward — the step's peak there — was 134,299,648 B
above the measured one (its attention moment freed the dense MLP's saves where the MoE keeps 2.2 times as
many, and the moment the MoE tops at, W_gate_up's [E, 2f, h] gradient beside d(gate_up) [S, 2f], was not
counted); without checkpointing 96 MB over at s 1,024, Qwen3-30B-A3B's 53 MB; Qwen1.5-MoE's (a gated
shared expert) 10,617,344 B under at h 256, s 256."""

from __future__ import annotations

import pytest

from memplan.blocks.moe import backward as moe_backward
from memplan.config import Setup
from tests.hf.harness import hf_setup, layer_difference

CASES = [
    # full widths: the weight gradients outweigh the [S, f] buffers, the top after W_gate_up's gradient
    hf_setup("mixtral-8x7b", seq=1024),
    hf_setup("mixtral-8x7b", seq=512, checkpointing="full"),  # its fp32 routing weights, checkpointed
    # Qwen3-30B-A3B: 128 experts, top-8, weights cast to bf16 and renormalised (4 heads: its q and k norms'
    # backward, not modelled, would top the layer at 32: docs/peak-accuracy.md)
    hf_setup("qwen3-30b-a3b", seq=256, num_heads=4, num_kv_heads=2),
    # Qwen1.5-MoE (Qwen2-MoE's code): a gated shared expert, its gate's backward first, its MLP's last
    hf_setup("qwen1.5-moe-a2.7b", seq=256, hidden_size=256, num_heads=4, num_kv_heads=4, ffn_size=256),
    # a narrow layer: the [S, f] buffers outweigh the gradients, the top at the product's gradient
    hf_setup(
        "qwen3-30b-a3b",
        seq=256,
        checkpointing="full",
        hidden_size=256,
        ffn_size=128,
        num_heads=2,
        num_kv_heads=1,
    ),
]


def moe_tops(setup: Setup) -> bool:
    """The MoE's own moment is the layer backward's largest rise (``blocks.moe.backward.rise``)."""
    from memplan.analytic.moments import layer_backward as lb
    from memplan.blocks.inventory import Dims
    from memplan.pieces import core_of, pieces

    p = pieces(core_of(setup))
    dims = Dims.of(p.setup)
    return lb.mlp_moment(p.setup, dims) == lb.layer_backward_transient(p.setup, dims, p.params)


@pytest.mark.parametrize(
    "setup",
    CASES,
    ids=lambda s: (
        f"{s.model.name}-h{s.model.hidden_size}-s{s.training.seq_len}-{s.strategy.checkpointing.name.lower()}"
    ),
)
def test_moe_layer_backward_is_transformers(setup: Setup) -> None:
    """Exact, with and without transformers' checkpointing (its int64 [s] position ids modelled:
    ``constants.checkpointed_position_ids``). The MoE's moment is the layer's top in all but the
    checkpointed Mixtral (there the re-run's: exact too)."""
    assert moe_backward.applies(setup)
    assert moe_tops(setup) == (setup is not CASES[1])
    assert layer_difference(setup) == 0
