"""Qwen2.5 with ``use_sliding_window`` and ``max_window_layers``: the first N layers attend to all keys,
the later ones through the window (``ModelConfig.full_layers``; ``Qwen2Config.layer_types``).
``modeling_qwen2.py`` under fake tensors at small widths, SDPA and eager, with and without transformers'
checkpointing, use_cache on and off: each layer's bytes, the total and the FLOPs exact."""

from __future__ import annotations

from typing import Any

from memplan.engine import estimate
from memplan.measure.compare.tensors import estimated_layers
from memplan.measure.frameworks.hf import measure_hf
from memplan.presets.hf import model_from_hf_config
from tests.grids import pairwise_cases
from tests.hf.harness import hf_setup
from tests.test_hf_config import QWEN25_7B

SEQ, WINDOW, LAYERS, FIRST = 64, 16, 4, 1
SMALL: dict[str, Any] = {
    **QWEN25_7B,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": LAYERS,
    "vocab_size": 128,
    "use_sliding_window": True,
    "sliding_window": WINDOW,
    "max_window_layers": FIRST,
}


def setup_of(**kw: Any) -> Any:
    model = model_from_hf_config(SMALL, "qwen2.5-small")
    assert (model.sliding_window, model.full_layers) == (WINDOW, FIRST)
    return hf_setup(model, layers=LAYERS, seq=SEQ, **kw)


@pairwise_cases("attention, checkpointing, use_cache", ["flash", "eager"], ["none", "full"], [True, False])
def test_qwen2_max_window_layers_exact(attention: str, checkpointing: str, use_cache: bool) -> None:
    setup = setup_of(attention=attention, checkpointing=checkpointing, use_cache=use_cache)
    est, meas = estimate(setup), measure_hf(setup)
    layers = [meas.layer_bytes(i) for i in range(LAYERS)]
    if attention == "eager" and checkpointing == "full":
        # The recorder names a storage after the first layer that keeps it: the full layers' additive
        # mask [1, 1, 64, 64] bf16 (2·64·64 = 8,192 B), bound in layer 0's checkpoint, is its; the estimate
        # counts it once, at model level (attn.full_mask), as the sliding layers' (attn.mask).
        layers[0] -= 2 * SEQ * SEQ
    assert estimated_layers(est) == layers, (estimated_layers(est), layers)
    assert est.activations == meas.activations, (est.activations, meas.activations)
    f = est.flops
    assert (f.forward, f.backward, f.recompute) == tuple(
        meas.flops[k] for k in ("forward", "backward", "recompute")
    )


def test_the_full_layer_is_the_first() -> None:
    """Layer 0 (< max_window_layers 1) is full, 1–3 slide; under SDPA a sliding layer keeps SDPA's mask
    [1, 1, 64, 64] bf16 (8,192 B) and k, v repeated to 4 heads [1, 4, 64, 16] bf16 (8,192 B each) where
    the full layer keeps k [1, 2, 64, 16] and v [1, 64, 32] (4,096 B each): 16,384 B more."""
    per_layer = estimated_layers(estimate(setup_of()))
    assert per_layer[1] == per_layer[2] == per_layer[3] == per_layer[0] + 2 * 64 * 64 + 2 * (8192 - 4096)
