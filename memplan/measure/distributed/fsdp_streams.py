"""FSDP2's all-gather stream as a rank runs it: every ``all_gather_output`` FSDP2 allocates and the moment it
is dropped, recorded on torch's fake process group and coded as ``analytic.fsdp.buffers.codes`` codes the
stream it models (n ≥ 0 allocates n bytes, the allocations numbered in order; −k − 1 frees k).

torch 2.13's ``FSDPParamGroup.unshard`` (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py) calls
``foreach_all_gather`` (_fsdp_collectives.py), which allocates the unit's flat ``all_gather_output``
(``all_gather_comm.allocate``: ``torch.empty``) under ``all_gather_copy_in_stream`` and returns it in an
``AllGatherResult``; the group keeps that result in ``_all_gather_result``, then in
``comm_ctx.all_gather_state`` (the forward's kept buffer), and drops it where the model says
(``analytic.fsdp.buffers``' docstring). ``all_gather_outputs`` wraps the name the group module calls and
hangs a ``weakref.finalize`` on each output tensor: its callback runs when the last reference goes, the
moment the caching allocator would get the block back. On CPU there are no streams: what is recorded is
the order of the outputs' allocations and frees and their sizes, which is what the model replays.
"""

from __future__ import annotations

import importlib
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def all_gather_outputs() -> Iterator[list[int]]:
    """While open, every FSDP2 ``all_gather_output`` allocated and freed, coded (module docstring) into
    the list it yields, in the order they happen."""
    # the module whose ``unshard`` calls it by this name (untyped: a private module of torch's)
    group: Any = importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_param_group")
    original = group.foreach_all_gather
    out: list[int] = []
    made = [0]

    def recorded(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if result is not None:
            buffer = result.all_gather_output
            out.append(buffer.numel() * buffer.element_size())
            weakref.finalize(buffer, out.append, -made[0] - 1)
            made[0] += 1
        return result

    group.foreach_all_gather = recorded
    try:
        yield out
    finally:
        group.foreach_all_gather = original


@contextmanager
def reduce_scatter_outputs() -> Iterator[list[int]]:
    """While open, the bytes of every FSDP2 reduce-scatter output, in the order they are allocated.

    torch 2.13's ``foreach_reduce`` (_fsdp_collectives.py) allocates two buffers per unit through
    ``reduce_scatter_comm.allocate``: first the flat reduce-scatter input (on the default stream), then,
    under ``device_handle.stream(reduce_scatter_stream)``, the output of 1/W of its elements — the unit's
    sharded gradient in the reduce dtype. ``DefaultReduceScatter.allocate`` is wrapped and every second
    call's tensor kept as the output (``analytic.fsdp.buffers.reduce_scatter_outputs`` models them)."""
    collectives: Any = importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_collectives")
    cls = collectives.DefaultReduceScatter
    original = cls.allocate
    out: list[int] = []
    calls = [0]

    def recorded(self: Any, *args: Any, **kwargs: Any) -> Any:
        buffer = original(self, *args, **kwargs)
        if calls[0] % 2 == 1:  # the output, after its input
            out.append(buffer.numel() * buffer.element_size())
        calls[0] += 1
        return buffer

    cls.allocate = recorded
    try:
        yield out
    finally:
        cls.allocate = original
