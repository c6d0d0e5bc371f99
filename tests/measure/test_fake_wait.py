"""A functional collective's wait under fake tensors (``measure.instruments.tracker.WAIT_TENSOR``): the
real op returns the collective's own tensor, the fake one a new storage, which a live-memory tracker
would count as memory the GPU never holds."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan.measure.distributed.titan import fake_world
from memplan.measure.instruments.tracker import WAIT_TENSOR, LiveMemoryTracker


def _gather_and_wait(x: torch.Tensor, group: str) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.ops._c10d_functional.all_gather_into_tensor(x, 2, group)
    return out, torch.ops._c10d_functional.wait_tensor(out)


def test_the_wait_returns_the_collectives_tensor_and_is_counted_once() -> None:
    with fake_world(0, 2):
        group = dist.group.WORLD.group_name
        out, waited = _gather_and_wait(torch.randn(4, 8), group)
        assert waited is out  # the real kernel: the same tensor
        with FakeTensorMode() as mode:
            x = mode.from_tensor(torch.randn(4, 8))
            out, waited = _gather_and_wait(x, group)
            assert waited.untyped_storage()._cdata != out.untyped_storage()._cdata  # fake: a new one
            with LiveMemoryTracker() as tracker:
                out, waited = _gather_and_wait(x, group)
            assert waited is out
            assert tracker.peak == 8 * 8 * 4  # the gathered [8, 8] fp32 once
    assert WAIT_TENSOR is torch.ops._c10d_functional.wait_tensor
