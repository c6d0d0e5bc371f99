"""Grouped-query attention under the FLOP meter on a torch whose SDPA formula refuses fewer K/V heads.

torch 2.11's ``sdpa_flop_count`` asserted equal heads; on an H200 (docs/gpu-profile.md) ``memplan profile``
of Llama 3.2 1B (8 K/V heads for 32 query heads) died there. torch 2.13 counts a grouped-query call as
if K and V were broadcast to the query's heads; ``record.formula_flops`` does the same on an older torch.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.flop_counter import sdpa_flop_count

from memplan.measure.instruments.record import formula_flops, kv_as_query


def _strict(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *_: Any, **__: Any) -> int:
    """torch 2.11's formula: equal heads or an assertion."""
    if not query.shape[1] == key.shape[1] == value.shape[1]:
        raise AssertionError("sdpa_flop_count: query/key/value shapes are incompatible")
    b, h, s, d = query.shape
    return 2 * 2 * b * h * s * key.shape[2] * d  # two bmm's of 2·m·n·k each


def test_a_grouped_query_call_counts_as_the_query_heads() -> None:
    q = torch.empty(2, 32, 128, 64, device="meta")
    kv = torch.empty(2, 8, 128, 64, device="meta")
    got = formula_flops(_strict, "aten._scaled_dot_product_flash_attention", (q, kv, kv), {}, None)
    # 2 bmm's of [b·h, s, d]·[b·h, d, s]: 2 · 2 · 2·32 · 128 · 128 · 64; torch 2.13's own count agrees
    assert got == 2 * 2 * 2 * 32 * 128 * 128 * 64 == sdpa_flop_count(q.shape, kv.shape, kv.shape)


def test_only_attention_formulas_are_widened() -> None:
    def refuse(*_: Any, **__: Any) -> int:
        raise AssertionError("other")

    with pytest.raises(AssertionError):
        formula_flops(refuse, "aten.mm", (torch.empty(2, 2),), {}, None)


def test_kv_as_query_leaves_other_arguments() -> None:
    q, kv, lse = torch.empty(1, 4, 8, 2), torch.empty(1, 2, 8, 2), torch.empty(1, 4, 8)
    out = kv_as_query((q, kv, kv, lse, 0.5, True))
    assert out[0] is q and out[3] is lse and out[4:] == (0.5, True)
    assert out[1].shape == out[2].shape == (1, 4, 8, 2) and out[1].device.type == "meta"
