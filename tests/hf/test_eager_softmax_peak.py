"""transformers' eager attention core at its softmax's backward, against the step transformers runs (fake
tensors, the families' own widths, two layers, s 512, bf16-mixed; ``measure.frameworks.hf_peak``).

``eager_attention_forward`` runs ``softmax(dtype=float32).to(A)``: P·V's backward makes dP in A and frees
the probabilities' A copy, ``.to(A)``'s backward casts dP to fp32, the softmax's backward makes dS in fp32
(``blocks.attention.core.fp32_softmax_gradients``); MLA's P·V keeps v as a view of ``kv_b_proj``'s whole
output, so its backward frees the key rows too (``blocks.attention.mla.value_save_over_gradient``). The
layer backward before, measured − estimated (none / full checkpointing): Llama 3 8B +16,777,216 /
+16,781,312; DeepSeek-V2-Lite +4,718,592 / +4,722,688; DeepSeek-V3 (four layers, three dense) +57,671,680 /
+57,675,776. Now each is exact but for DeepSeek's named difference (the checkpointed layers' int64 [s]
position ids are modelled since: ``constants.checkpointed_position_ids``): its routers' weight kept in
fp32 (``_keep_in_fp32_modules_strict``), which the model states count in bf16 — E·h·2 B a MoE layer,
and as much for the router gradient of each MoE layer above the moment's (here the dense layers'
softmax backward: one MoE layer above). A narrow vocabulary keeps the step short; the layers' widths are
the models'."""

from __future__ import annotations

import pytest

from memplan.analytic import activations as act
from memplan.analytic.moments import layer_backward as lb
from memplan.analytic.params import count_params
from memplan.blocks.attention.core import fp32_softmax_gradients
from memplan.blocks.attention.mla import value_save_over_gradient
from memplan.blocks.inventory import Dims
from memplan.config import Setup
from memplan.engine import estimate
from memplan.measure.frameworks.hf_peak import measure_hf_peak
from memplan.measure.instruments.moments import estimated_moments
from memplan.pieces import core_of, pieces
from tests.hf.harness import hf_setup

CASES = [
    # (model, layers, MoE layers above the moment's layer)
    ("llama-3-8b", 2, 0),
    ("deepseek-v2-lite", 2, 1),  # layer 0 dense (its softmax backward the top), layer 1 MoE
    ("deepseek-v3", 4, 1),  # layers 0-2 dense, layer 3 MoE (V3's sigmoid router: the dense reading)
]


def case(model: str, layers: int, checkpointing: str) -> Setup:
    return hf_setup(
        model, layers=layers, seq=512, attention="eager", checkpointing=checkpointing, vocab_size=512
    )


@pytest.mark.parametrize("checkpointing", ["none", "full"])
@pytest.mark.parametrize(("model", "layers", "above"), CASES)
def test_eager_softmax_backward_is_transformers(
    model: str, layers: int, above: int, checkpointing: str
) -> None:
    setup = case(model, layers, checkpointing)
    est = estimated_moments(estimate(setup))
    measured, buffers = measure_hf_peak(setup)
    layer = measured["layer backward"]
    assert layer is not None
    moe = setup.model.moe
    fp32_router = 0
    if moe is not None:
        precision = setup.training.precision
        moe_layers = layers - moe.dense_layers
        excess = (4 - precision.weight_bytes) * moe_layers + (4 - precision.grad_bytes) * above
        fp32_router = excess * moe.experts * setup.model.hidden_size
    assert layer - buffers - est["layer backward"] == fp32_router


def test_deepseek_v2_lite_dense_layer_tops_at_its_softmax_backward() -> None:
    """DeepSeek-V2-Lite (a 16, s 512, d_n 128): the dense layer's attention moment is its layer's largest,
    8,388,608 B (a [16, 512, 512] bf16) above the A-dtype reading for the fp32 dP and dS, 2,097,152 B (the
    key rows of ``kv_b_proj``'s [512, 16·256] output) below it for v's save."""
    p = pieces(core_of(case("deepseek-v2-lite", 2, "none")))
    dense = act.layer_kind_setups(p.setup)[0]
    dims = Dims.of(dense)
    params = count_params(dense.model)
    assert fp32_softmax_gradients(dense, dims) == 16 * 512 * 512 * 2
    assert value_save_over_gradient(dense, dims) == 512 * 16 * 128 * 2
    attention = lb.attention_backward_transient(dense, dims, params)
    assert attention == lb.layer_backward_transient(dense, dims, params)


@pytest.mark.parametrize("checkpointing", ["none", "full"])
@pytest.mark.parametrize(("model", "seq"), [("gemma-3-1b", 4096), ("falcon-7b", 1024)])
def test_multi_query_value_gradient_is_wider_than_its_save(model: str, seq: int, checkpointing: str) -> None:
    """MQA (one kv head) at b = 1: ``repeat_kv`` is a view, so P·V's backward frees v's own storage — its
    one head (Gemma-3 1B; Falcon-7B's KV cache copy), or the fused ``query_key_value`` output it is a view
    of (Falcon without the cache, under checkpointing) — and makes dV at a heads
    (``core.mqa_value_gradient_over_save``: dV less that storage). The layer backward before, measured −
    estimated (none / full): Gemma-3 1B at s 4,096 +6,291,454 / +6,291,454 (its top the softmax's
    backward), Falcon-7B at s 1,024 +9,175,040 / −262,144; exact now (Gemma's ``embed_scale``, −2 B)."""
    from memplan.blocks.attention.core import mqa_value_gradient_over_save

    setup = hf_setup(model, seq=seq, attention="eager", checkpointing=checkpointing)
    dims = Dims.of(setup)
    v = dims.tokens * dims.d * 2 * (73 if model == "falcon-7b" and checkpointing == "full" else 1)
    assert mqa_value_gradient_over_save(setup, dims) == dims.tokens * dims.a * dims.d * 2 - v  # by hand
    measured, buffers = measure_hf_peak(setup)
    layer = measured["layer backward"]
    assert layer is not None
    gemma_embed_scale = 2 if model.startswith("gemma") else 0
    assert layer - buffers - estimated_moments(estimate(setup))["layer backward"] == -gemma_embed_scale
