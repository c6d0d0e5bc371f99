"""One context-parallel rank in one process: torch's own ring attention, over a fake process group.

torch's ``context_parallel`` (``torch.distributed.tensor.experimental``, what torchtitan uses) runs the ring
*inside* the dispatch of one SDPA op: ``_templated_ring_attention`` and ``_templated_ring_attention_backward``
(``_context_parallel/_attention.py``, torch 2.13). Its DTensor handler covers the CUDA flash / efficient /
cuDNN kernels only, so it cannot run on a CPU. This module calls those two functions themselves, with the CPU
flash kernel as the per-step op (on a GPU, and on the meta device that stands for one in ``trace --device
cuda``, torch's CUDA entry points themselves, ``RingCuda``) and torch's fake process group
(``torch.testing._internal.distributed.fake_pg``: ``dist.get_rank`` and the world size are the simulated
rank's, the collectives move nothing): one rank runs exactly torch's op sequence — its two head-tail chunks,
the causal step 0, the c−1 half steps against K/V chunks in ring order, the ``_SDPAMerger`` merge of out/lse —
and ``RingFlash`` saves for backward what autograd saves for the one SDPA op torch dispatches
(derivatives.yaml, ``_scaled_dot_product_flash_attention``: query, key, value, output, logsumexp).

Known limitations (NB): the received K/V and dK/dV are whatever the fake collectives return (the bytes
and FLOPs are exact, the values are not a real run's); ``head_tail_positions`` is torch's default
``_HeadTailLoadBalancer`` order; the CUDA path runs in CI on the meta device (``trace --cp --device cuda``:
its saves and FLOPs) and on a lent GPU with memory (benchmarks/gpu_session.sh ``cpprofile``, not yet run).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor.experimental._context_parallel import _attention as ring

from memplan.config import CpRotate
from memplan.measure.instruments.record import label
from memplan.strategies.context_parallel import KV_GATHER_NOT_RUN

aten = torch.ops.aten
SEQ_DIM = 2
"""[b, heads, s, d]: the dimension torch's ring splits and merges along."""


def head_tail_positions(s: int, cp: int, rank: int, device: torch.device | str = "cpu") -> Tensor:
    """Positions of the tokens rank ``rank`` holds: chunks ``rank`` and ``2·cp−1−rank`` of 2·cp
    (torch's ``_HeadTailLoadBalancer``, the default of ``context_parallel`` for causal attention)."""
    chunk = s // (2 * cp)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, last])


@contextmanager
def rotate_method(method: str) -> Iterator[None]:
    """torch's ``set_rotate_method(method)`` (``allgather`` or ``alltoall``: ``--cp-rotate``) for the
    block, torch's previous option restored afterwards."""
    from torch.distributed.tensor.experimental import _attention as cp_attention

    if method == CpRotate.KV_GATHER:
        raise ValueError(KV_GATHER_NOT_RUN)
    before = cp_attention._cp_options.rotate_method
    cp_attention.set_rotate_method(method)
    try:
        yield
    finally:
        cp_attention._cp_options.rotate_method = before


@contextmanager
def ring_group(cp: int, rank: int) -> Iterator[dist.ProcessGroup]:
    """The default process group as rank ``rank`` of ``cp`` (fake backend), torn down afterwards."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised; the one-rank simulation needs its own")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cp)
    try:
        group = dist.group.WORLD
        assert group is not None
        yield group
    finally:
        dist.destroy_process_group()


class RingFlash(torch.autograd.Function):
    """Causal flash attention of one rank's q [b, a, s/c, d], k and v [b, kv, s/c, d] over the ring."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup) -> tuple[Tensor, Tensor]:
        op = aten._scaled_dot_product_flash_attention_for_cpu
        out, lse = ring._templated_ring_attention(group, SEQ_DIM, op, q, k, v, is_causal=True, dropout_p=0.0)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group = group
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: Tensor, _dlse: Tensor | None) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        op = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
        dq, dk, dv, *_ = ring._templated_ring_attention_backward(
            ctx.group, SEQ_DIM, op, dout, "grad_out", q, k, v, out, lse, True, dropout_p=0.0
        )
        return dq, dk, dv, None


class _Mesh:
    """What torch's ring entry points read of a DeviceMesh: ``get_group()``, the rank's group."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def get_group(self) -> dist.ProcessGroup:
        return self.group


def _cuda_ring_forward(kernel: str, mesh: Any, q: Tensor, k: Tensor, v: Tensor) -> tuple[Any, ...]:
    """torch's CUDA ring entry point of ``kernel``: out, lse, cum_q, cum_k, max_q, max_k, seed, offset, …"""
    if kernel == "cudnn":
        return ring._scaled_dot_product_ring_cudnn_attention(mesh, q, k, v, None, True, 0.0, True)
    return ring._scaled_dot_product_ring_flash_attention(mesh, q, k, v, dropout_p=0.0, is_causal=True)


def _cuda_ring_backward(kernel: str, mesh: Any, dout: Tensor, saved: tuple[Any, ...]) -> tuple[Any, ...]:
    """Its backward entry point, from the forward's saves (q, k, v, out, lse, seed, offset, cum_q, cum_k,
    max_q, max_k): dq, dk, dv first."""
    q, k, v, out, lse, seed, offset, cum_q, cum_k, max_q, max_k = saved
    if kernel == "cudnn":
        no_bias = cast(Tensor, None)
        return ring._scaled_dot_product_ring_cudnn_attention_backward(
            mesh, dout, q, k, v, out, lse, seed, offset, no_bias, cum_q, cum_k, max_q, max_k, 0.0, True
        )
    return ring._scaled_dot_product_ring_flash_attention_backward(
        mesh, dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset
    )


class RingCuda(torch.autograd.Function):
    """The same on a GPU: torch's own CUDA entry points (what ``context_parallel``'s SDPA handler dispatches
    to), ``_scaled_dot_product_ring_flash_attention`` or, as torchtitan's SDPA picks cuDNN on CUDA
    (``blocks.attention.titan_cudnn``), ``_scaled_dot_product_ring_cudnn_attention``, and their backward,
    the kernel per ring step over the fake process group (its collectives return unwritten buffers of the
    right sizes: the bytes are a real rank's). Saves what autograd saves for the SDPA op (derivatives.yaml:
    q, k, v, the output, the logsumexp — [b, a, s, 1] for cuDNN's — and the kernel's philox seed and
    offset)."""

    @staticmethod
    def forward(
        ctx: Any, q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, kernel: str
    ) -> tuple[Tensor, Tensor]:
        mesh: Any = _Mesh(group)  # what the entry points read of a DeviceMesh
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = _cuda_ring_forward(kernel, mesh, q, k, v)
        label(seed, "attn.philox_seed")
        label(offset, "attn.philox_offset")
        ctx.save_for_backward(q, k, v, out, lse, seed, offset)
        ctx.extra = (kernel, mesh, cum_q, cum_k, max_q, max_k)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx: Any, dout: Tensor, _dlse: Tensor | None) -> tuple[Tensor | None, ...]:
        kernel, mesh, *shapes = ctx.extra
        dq, dk, dv, *_ = _cuda_ring_backward(kernel, mesh, dout, (*ctx.saved_tensors, *shapes))
        return dq, dk, dv, None, None


def ring_flash(
    q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, kernel: str | None = None
) -> tuple[Tensor, Tensor]:
    """The merged output [b, a, s/c, d] and fp32 logsumexp [b, a, s/c] of one rank: ``kernel`` ``cpu``
    (``RingFlash``), ``flash`` or ``cudnn`` (torch's CUDA entry points, ``RingCuda``); by default ``flash``
    on a GPU and on the meta device that stands for one, else ``cpu`` (fake CPU tensors standing for CUDA
    ones name the CUDA kernel: its meta kernel runs)."""
    if kernel is None:  # model.CUDA_KERNELS: the meta device runs the CUDA kernels' shapes
        kernel = "flash" if q.device.type in ("cuda", "meta") else "cpu"
    out, lse = RingFlash.apply(q, k, v, group) if kernel == "cpu" else RingCuda.apply(q, k, v, group, kernel)
    return out, lse
