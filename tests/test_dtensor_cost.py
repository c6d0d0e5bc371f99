"""``blocks.dtensor_cost``: DTensor's own cost model (torch 2.13 ``_collective_utils``) deciding whether a
row-parallel weight gradient with a ``Partial`` output gradient comes out whole, derived by hand."""

from __future__ import annotations

import pytest

from memplan.blocks.dtensor_cost import (
    all_gather_us,
    all_reduce_us,
    reduce_scatter_us,
    rowwise_weight_grad_whole,
)

GIB = 2**30


def test_costs_are_torchs_formulas() -> None:
    """6.6 µs + hops × 0.6 µs + GiB × hops / devices / 87.7 GB/s inside a host (t ≤ 8), 2.7 µs and
    0.22 × 87.7 GB/s between hosts; all-reduce twice the hops."""
    assert all_gather_us(GIB, 2) == pytest.approx(6.6 + 0.6 + 0.5 / 87.7 * 1e6)
    assert reduce_scatter_us(GIB, 8) == pytest.approx(6.6 + 7 * 0.6 + 7 / 8 / 87.7 * 1e6)
    assert all_reduce_us(GIB, 2) == pytest.approx(6.6 + 2 * 0.6 + 1.0 / 87.7 * 1e6)
    assert all_gather_us(GIB, 16) == pytest.approx(6.6 + 15 * 2.7 + 15 / 16 / (87.7 * 0.22) * 1e6)


def test_llama_3_8b_w_o_whole_w2_shard() -> None:
    """Llama 3 8B at 8,192 tokens, tp 2, bf16. W_O (in = a·d = h = 4,096): all-gathering its 64 MiB input
    (7.2 + 356.3 µs) is cheaper than all-reducing the 64 MiB output gradient (7.8 + 712.6 µs) or the
    contracting split (7.2 + 178.2 + 1 + 7.2 + 356.3 µs): ``Partial``, whole. W2 (in = f = 14,336): its
    224 MiB input (7.2 + 1,247 µs) costs more than the all-reduce: the shard."""
    assert rowwise_weight_grad_whole(8192, 4096, 4096, 2, 2)
    assert not rowwise_weight_grad_whole(8192, 4096, 14336, 2, 2)


def test_the_tiny_models_are_whole_where_latency_decides() -> None:
    """64 tokens, h 64, f 128 (f = 2h: the bandwidth terms tie, the all-reduce's extra hop decides): both
    whole, as measured (tests/hf/test_torchtitan_ranks.py)."""
    assert rowwise_weight_grad_whole(64, 64, 64, 2, 2)
    assert rowwise_weight_grad_whole(64, 64, 128, 2, 2)
