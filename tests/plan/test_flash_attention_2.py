"""``--impl hf --flash-attn``: transformers' flash_attention_2 against its sdpa, on CUDA, derived by hand.

flash-attn's ``FlashAttnFunc`` keeps a [2] int64 RNG state (16 B) where torch's flash kernel keeps a [2] and
a [] uint64 (24 B); it takes the sliding window as ``window_size``, so at s ≥ W transformers passes no mask
and does not repeat k and v to the query heads, where its sdpa path keeps a bf16 [b, 1, s, s] mask per layer
and k, v repeated to a heads (``Profile.window_mask``).
"""

from __future__ import annotations

import pytest

from memplan.api import Options, setup_of
from memplan.engine import estimate


def per_layer(**options: object) -> int:
    return estimate(setup_of(Options(model="mistral-7b", impl="hf", **options))).per_layer


@pytest.mark.parametrize("seq", [2048, 8192])
def test_flash_attention_2_against_sdpa(seq: int) -> None:
    sdpa, fa2 = per_layer(seq=seq), per_layer(seq=seq, flash_attn=True)
    a, kv, d, window = 32, 8, 128, 4096  # Mistral-7B-v0.1: heads, kv heads, head dim, sliding window
    rng = 24 - 16  # torch's [2] + [] uint64 vs flash-attn's [2] int64
    masked = 2 * seq * seq + 2 * (a - kv) * seq * d * 2 if seq >= window else 0  # bf16 mask, k and v
    assert sdpa - fa2 == masked + rng


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"flash_attn": True}, "flash_attn"),  # the reference model has no flash_attention_2
        ({"impl": "hf", "flash_attn": True, "attention": "eager"}, "flash_attn"),
        ({"impl": "hf", "flash_attn": True, "device": "cpu"}, "flash_attn"),
    ],
)
def test_flash_attention_2_refusals(options: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"{field}: "):
        setup_of(Options(model="mistral-7b", **options))
