"""Gemma-3's sliding and full layers under SDPA with a window shorter than the sequence: the sliding
layers pass SDPA an explicit mask (kept, k and v repeated to every head), the full layers none
(``is_causal``), so the two layer kinds keep different bytes (``blocks.attention.full_layer_setup``).
``modeling_gemma3.py`` under fake tensors, small widths: each layer's bytes, the total and the FLOPs
exact, with and without transformers' checkpointing, use_cache on and off."""

from __future__ import annotations

import pytest

from memplan.engine import estimate
from memplan.measure.compare.tensors import estimated_layers
from memplan.measure.frameworks.hf import measure_hf
from memplan.presets import load_model_preset
from tests.hf.harness import hf_setup

SEQ, WINDOW = 64, 16
SMALL = {
    "hidden_size": 64,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 16,
    "query_pre_attn_scalar": 16,
    "ffn_size": 128,
    "vocab_size": 128,
    "sliding_window": WINDOW,
}


def setup_of(checkpointing: str = "none", use_cache: bool = True, layers: int = 6, every: int = 3) -> object:
    base = load_model_preset("gemma-3-1b").model
    return hf_setup(
        base,
        layers=layers,
        seq=SEQ,
        checkpointing=checkpointing,
        use_cache=use_cache,
        sliding_window_pattern=every,
        **SMALL,
    )


@pytest.mark.parametrize("checkpointing", ["none", "full"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_gemma3_sdpa_windows_exact(checkpointing: str, use_cache: bool) -> None:
    setup = setup_of(checkpointing, use_cache)
    est, meas = estimate(setup), measure_hf(setup)  # type: ignore[arg-type]
    layers = [meas.layer_bytes(i) for i in range(6)]
    assert estimated_layers(est) == layers, (estimated_layers(est), layers)
    assert est.activations == meas.activations
    f = est.flops
    assert (f.forward, f.backward, f.recompute) == tuple(
        meas.flops[k] for k in ("forward", "backward", "recompute")
    )


def test_the_two_layer_kinds_by_hand() -> None:
    """Layers 2 and 5 are full (every 3rd), the other four slide. A sliding layer keeps beyond a full one:
    SDPA's mask [1, 1, 64, 64] in bf16 (8,192 B), and k and v repeated from 2 to 4 heads [1, 4, 64, 16]
    bf16 (8,192 B each) instead of k [1, 2, 64, 16] (4,096 B) and v as the projection's [1, 64, 32]
    output (4,096 B): 8,192 + 2·(8,192 − 4,096) = 16,384 B more."""
    per_layer = estimated_layers(estimate(setup_of()))  # type: ignore[arg-type]
    sliding, full = per_layer[0], per_layer[2]
    assert [i for i, b in enumerate(per_layer) if b == full] == [2, 5]
    assert sliding - full == 2 * 64 * 64 + 2 * (2 * 4 * 64 * 16 - 2 * 2 * 64 * 16) == 16_384
