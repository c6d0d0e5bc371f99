"""The layer backward of transformers' PhiMoE and gpt-oss under full training (two layers, s 512, fake
tensors): the highest point measured (``measure.frameworks.hf_peak``) against the estimate's.

Before, at their real widths (none / full checkpointing), each read under the measured top:
- Phi-3.5-MoE: 8,110,080 / 8,368,128 B. W_Q's backward, the last of its three biased projections on one
  ``nn.LayerNorm``'s output, tops layer 0 above the norm's backward, as StableLM's
  (``Profile.q_input_gradient_top``: 8,372,224 B);
- gpt-oss-20b: 196,608 / 200,704 B. The eager core with sinks tops layer 0 at ``max.dim``'s backward:
  the softmax's gradient and the scatter [b, a, s, s+1] with the sink column, the max values' gradient
  [b, a, s, 1] (``blocks.attention.core.sink_backward_extra``).
Their MoE MLP's backward is replayed op by op (``blocks.moe.hf_routers``: PhiMoE's sparsemixer and input
jitter, gpt-oss's biased experts, clamped SwiGLU and top-k-then-softmax router); where the experts top
the layer (h 512, f 128) it is exact; before, the dense reading was under by 3,205,184 / 3,209,280 B
(PhiMoE) and 1,598,528 / 1,602,624 B (gpt-oss).
Under checkpointing the int64 [s] position ids the checkpointed layers hold are modelled
(``attention.constants.checkpointed_position_ids``); so are PhiMoE's rotary tables, which layer 0's
rotary backward frees (``attention.constants.tables_freed_by_layer0``)."""

from __future__ import annotations

import pytest

from memplan.blocks.moe import backward as moe_backward
from memplan.config import Setup
from tests.hf.harness import hf_setup, layer_difference

NARROW = {"hidden_size": 512, "ffn_size": 128, "num_heads": 2, "num_kv_heads": 1, "head_dim": 16}
REAL = [
    hf_setup(name, seq=512, checkpointing=checkpointing, attention=attention)
    for name, attention in (("phi-3.5-moe", "flash"), ("gpt-oss-20b", "eager"))
    for checkpointing in ("none", "full")
]
EXPERTS_TOP = [
    hf_setup(name, seq=512, checkpointing=checkpointing, attention=attention, **NARROW)
    for name, attention in (("phi-3.5-moe", "flash"), ("gpt-oss-20b", "eager"))
    for checkpointing in ("none", "full")
]


def moe_tops(setup: Setup) -> bool:
    """The MoE's own moment is the layer backward's largest rise (``blocks.moe.backward.rise``)."""
    from memplan.analytic.moments import layer_backward as lb
    from memplan.blocks.inventory import Dims
    from memplan.pieces import core_of, pieces

    p = pieces(core_of(setup))
    dims = Dims.of(p.setup)
    return lb.mlp_moment(p.setup, dims) == lb.layer_backward_transient(p.setup, dims, p.params)


def case_id(setup: Setup) -> str:
    return f"{setup.model.name}-h{setup.model.hidden_size}-{setup.strategy.checkpointing.name.lower()}"


@pytest.mark.parametrize("setup", REAL, ids=case_id)
def test_layer_backward_is_transformers(setup: Setup) -> None:
    assert moe_backward.applies(setup)
    assert layer_difference(setup) == 0


@pytest.mark.parametrize("setup", EXPERTS_TOP, ids=case_id)
def test_replayed_moe_tops_the_layer_exactly(setup: Setup) -> None:
    assert moe_backward.applies(setup) and moe_tops(setup)
    assert layer_difference(setup) == 0
