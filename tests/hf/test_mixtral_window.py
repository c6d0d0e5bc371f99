"""transformers' Mixtral (``modeling_mixtral.py``) with a sliding window shorter than the sequence against
``--impl hf``: ``MixtralModel.forward`` masks with ``create_sliding_window_causal_mask`` when
``config.sliding_window`` is set, so SDPA gets an explicit mask per layer (kept converted to the query's
dtype) and ``repeat_kv`` copies k and v to a heads (``Profile.window_mask``). Mixtral-8x7B's widths, 2
layers, seq 256 > window 128; exact per layer, in total and FLOPs per phase."""

from __future__ import annotations

import pytest

from memplan.engine import estimate
from memplan.presets.hf import model_from_hf_config
from tests.hf.harness import check_exact, hf_setup
from tests.plan.test_moe import MIXTRAL_HF as MIXTRAL_8X7B  # its published config.json


@pytest.mark.parametrize(
    ("attention", "checkpointing"), [("flash", "none"), ("flash", "full"), ("eager", "none")]
)
def test_mixtral_window(attention: str, checkpointing: str) -> None:
    check_exact(
        hf_setup(
            "mixtral-8x7b", seq=256, attention=attention, checkpointing=checkpointing, sliding_window=128
        )
    )


def test_mixtral_window_keeps_mask_and_repeated_kv() -> None:
    """Mixtral-8x7B (a 32, kv 8, d 128), b 1, s 256 ≥ W 128, SDPA, bf16, per layer: the window's mask
    [1, 1, 256, 256]·2 B = 131,072 B, and k and v repeated to 32 heads, 2·(32 − 8)·256·128·2 B =
    3,145,728 B more than the kv-head k and v without the window: 3,276,800 B in all."""
    windowed = estimate(hf_setup("mixtral-8x7b", seq=256, sliding_window=128)).per_layer
    full = estimate(hf_setup("mixtral-8x7b", seq=256)).per_layer
    assert windowed - full == 256 * 256 * 2 + 2 * (32 - 8) * 256 * 128 * 2 == 3_276_800


def test_mixtral_sliding_window_is_read() -> None:
    """MixtralConfig.sliding_window: default None (full causal); a number is honoured."""
    assert model_from_hf_config(MIXTRAL_8X7B, "m").sliding_window is None
    assert model_from_hf_config({**MIXTRAL_8X7B, "sliding_window": 4096}, "m").sliding_window == 4096
    del_window = {k: v for k, v in MIXTRAL_8X7B.items() if k != "sliding_window"}
    assert model_from_hf_config(del_window, "m").sliding_window is None
