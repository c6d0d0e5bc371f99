"""``LiveMemoryTracker`` counts a wrapper tensor subclass by its inner tensors (``tracker.data_tensors``):
torchao's ``WeightWithDynamicFloat8CastTensor`` around an fp32 [64, 32] weight holds 64 · 32 · 4 = 8,192 B,
once, however many wrappers (views, detaches) share its inner storage; its own storage holds nothing."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchao.float8")

from memplan.measure.instruments.tracker import LiveMemoryTracker, data_tensors


def wrapped() -> torch.Tensor:
    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    return Float8Linear.from_float(torch.nn.Linear(64, 32, bias=False), config).weight


def test_wrapper_counted_once_by_its_inner_tensor() -> None:
    w = wrapped()
    assert [type(t) for t in data_tensors(w)] == [torch.nn.Parameter]  # the wrapped Parameter's fp32 data
    tracker = LiveMemoryTracker()
    tracker.track([w])
    with tracker:
        v, d = w.view(-1), w.detach()  # new wrappers, the same inner storage
    assert tracker.current == 32 * 64 * 4
    del v, d


def test_a_new_inner_storage_is_counted() -> None:
    """``clone`` keeps the subclass (torchao's ``_ops_to_preserve_subclass``) around a new fp32 copy: 8,192 B
    more."""
    w = wrapped()
    tracker = LiveMemoryTracker()
    tracker.track([w])
    with tracker:
        c = w.clone()
    assert tracker.current == 2 * 32 * 64 * 4
    del c
