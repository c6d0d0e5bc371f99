"""What one rank's ring attention holds beyond its inputs while its backward runs: torch's
``_templated_ring_attention_backward`` (torch 2.13, ``torch/distributed/tensor/experimental/
_context_parallel/_attention.py``, default options: ``convert_to_f32``, load balancing, the K/V rotated by
``allgather`` or ``alltoall``, dK/dV always by ``alltoall``), replayed line by line on a ledger of its
tensors: each allocation when the op that makes it runs, each free when the last name holding it is
rebound (Python frees a tensor then).

One rank r of c holds Q = b·a·(s/c)·d query and K = b·kv·(s/c)·d key (and value) elements, e bytes each.
In order (``backward_peak``):

- fp32 accumulators ``zeros_like`` for dQ, dK, dV (``grad_query`` / ``grad_key`` / ``grad_value``); k and v
  ``contiguous()`` copies when they arrive as [b, kv, s, d] views of [b, s, kv, d] projections (every
  model memplan runs), held by the loop's ``k``, ``v`` until block 1 rebinds them;
- before every block but the last, ``torch.cat`` of the K/V in flight (2·K·e, the previous one freed when
  the name is rebound after it); ``allgather`` gathers every rank's once (c·2·K·e), ``alltoall`` passes one
  buffer (2·K·e) on per block, the previous freed once the next block's names drop it;
- each block's kernel backward: dq, dk, dv of the block's shapes (block 0 whole; blocks i ≤ r half the keys;
  blocks i > r half the queries, with the logsumexp half ``contiguous()``), the previous block's three
  freed only when these are bound; on CUDA plus the kernel's own workspace (``cuda_extra``);
- dK/dV: block 0 adds into the accumulators; later blocks receive the fp32 dK/dV (the previous block's
  ``permute_tensor`` output), add into half of it through ``_partial_update`` (blocks i ≤ r: ``torch.cat``,
  a new pair) or in place; then ``torch.cat`` of the two (block 0's non-contiguous accumulators are copied
  by ``flatten`` first) and ``permute_tensor`` to the next rank (2·K·4 each); the ``cat`` stays named until
  the next block receives;
- dQ: blocks i > r add into its second half by ``_partial_update`` (a new fp32 dQ, the old freed);
- at the end dQ cast to e, the received dK/dV cast to e (2·K·e), the fp32 ones freed.

Exact against memplan's tracker on CPU (every allocation of the reference's ``RingFlash`` backward, torch's
own ring functions with the CPU flash kernel: tests/measure/test_ring_memory.py, 14 ranks and layouts)
and against the H200's allocator (benchmarks/data/h200-ring-memory.jsonl: cp 2, 4, 8, ranks 0 and c − 1,
32 heads of 128, 8 K/V heads, 32,768 tokens a rank; with that run's q, k, v laid out [b, a, s, d], whose
``out`` and ``grad_out`` ``_flash_attention_backward`` copies).

Known limitations (NB): the forward's merge temporaries are not a moment of the peak (``analytic.peak``'s
NB: the forward is not modelled); ``--cp-rotate kv-gather`` (Transformer Engine's, not run) keeps the
plain flash backward's buffers; the per-block kernel is FlashAttention-2's (``workspace.
flash_backward_workspace``: cuDNN's and FlashAttention-3's workspaces are not modelled).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import NamedTuple

from memplan.blocks.attention.workspace import fa2_backward_workspace
from memplan.blocks.inventory import Dims
from memplan.config import CpRotate, Device, DType, Impl, Setup

FULL, KEY_HALF, QUERY_HALF = "full", "key half", "query half"
"""A block's shape: block 0 (all local queries and keys), i ≤ r (half the keys), i > r (half the queries)."""


class RingSizes(NamedTuple):
    """One rank's elements: queries Q = b·a·s·d, keys K = b·kv·s·d (values too), logsumexp b·a·s; e bytes."""

    q: int
    k: int
    lse: int
    e: int


class _Ledger:
    """Live bytes of named tensors and their highest point."""

    def __init__(self) -> None:
        self.held: dict[str, int] = {}
        self.live = 0
        self.peak = 0

    def alloc(self, name: str, n: int) -> None:
        self.held[name] = n
        self.live += n
        self.peak = max(self.peak, self.live)

    def free(self, *names: str) -> None:
        for name in names:
            self.live -= self.held.pop(name, 0)

    def inside(self, n: int) -> None:
        """Bytes an op holds only while it runs (a kernel's workspace, copies it frees)."""
        self.peak = max(self.peak, self.live + n)


def backward_peak(
    c: int,
    r: int,
    size: RingSizes,
    rotate: CpRotate = CpRotate.ALLGATHER,
    views: bool = True,
    cuda_extra: Callable[[str], int] | None = None,
) -> int:
    """The highest bytes rank ``r`` of ``c`` holds in its ring backward above what it held before (the
    module docstring, step by step). ``views``: k and v arrive as non-contiguous views (their
    ``contiguous()`` copies, and block 0's ``flatten`` copies of the accumulators ``zeros_like`` made
    alike). ``cuda_extra(shape)``: what one block's kernel backward holds inside the op."""
    extra = cuda_extra or (lambda _: 0)
    qa, ka, q32, k32, half_lse = size.q * size.e, size.k * size.e, size.q * 4, size.k * 4, size.lse * 2
    g = _Ledger()
    for name, n in (("dq", q32), ("dk", k32), ("dv", k32)):
        g.alloc(name, n)
    if views:
        g.alloc("k copy", ka)
        g.alloc("v copy", ka)
    dkv_views = ""  # the received dK/dV buffer the accumulators are views of (blocks i > r)
    for i in range(c):
        if i > 0 and rotate is not CpRotate.ALLGATHER:
            g.free(f"kv in {i - 2}")  # the loop's ``buffer`` rebound by next_buffer()
        if i != c - 1:
            g.alloc(f"kv cat {i}", 2 * ka)
            g.free(f"kv cat {i - 1}")
            if rotate is CpRotate.ALLGATHER:
                if i == 0:
                    g.alloc("kv gathered", c * 2 * ka)
            else:
                g.alloc(f"kv in {i}", 2 * ka)
        if i == 0:
            shape, outs = FULL, (qa, ka, ka)
        elif i <= r:
            shape, outs = KEY_HALF, (qa, ka // 2, ka // 2)
        else:
            shape, outs = QUERY_HALF, (qa // 2, ka, ka)
            g.alloc(f"lse half {i}", half_lse)
            g.free(f"lse half {i - 1}")
        if i > 0:
            g.free("k copy", "v copy")  # the loop's k, v rebound by block 1's tuple
        for j, n in enumerate(outs):
            g.alloc(f"block {i} grad {j}", n)
        g.inside(extra(shape))
        g.free(*(f"block {i - 1} grad {j}" for j in range(3)))
        if i > 0:
            g.free(f"dkv cat {i - 1}")  # next_grad_kv rebound to the received buffer
            g.free("dk", "dv", "dk cat", "dv cat")  # the accumulators rebound to its views
            if dkv_views and dkv_views != f"dkv in {i - 1}":
                g.free(dkv_views)
            dkv_views = f"dkv in {i - 1}"
            if i <= r:  # _partial_update: chunks[0] += new, then torch.cat
                g.alloc("dk cat", k32)
                g.alloc("dv cat", k32)
                dkv_views = ""
        if i == 0 and views:
            g.inside(4 * k32)  # flatten's two copies, then the cat, before the copies die
        g.alloc(f"dkv cat {i}", 2 * k32)
        g.alloc(f"dkv in {i}", 2 * k32)
        if i > 0 and dkv_views != f"dkv in {i - 1}":
            g.free(f"dkv in {i - 1}")
        if i > r:  # _partial_update of dQ's second half: a new fp32 dQ
            g.alloc(f"dq {i}", q32)
            g.free("dq" if i == r + 1 else f"dq {i - 1}")
    g.alloc("dq out", qa)
    g.free("dq", *(f"dq {i}" for i in range(c)))
    g.alloc("dkv out", 2 * ka)
    g.free(f"dkv cat {c - 1}")
    return g.peak


def _block_extra(dims: Dims, head_major_out: bool) -> Callable[[str], int]:
    """What one block's CUDA kernel backward holds inside the op: FlashAttention-2's workspace for the
    block's shape, and ``_flash_attention_backward``'s ``out.contiguous()`` copy where the merged output
    is head-major (``torch.cat`` of ``_partial_update`` made it [b, a, s, d]-contiguous)."""
    b, a, kv, s, e = dims.b, dims.a, dims.kv, dims.s, dims.act.bytes

    def extra(shape: str) -> int:
        sq = s // 2 if shape == QUERY_HALF else s
        sk = s // 2 if shape == KEY_HALF else s
        copy = b * a * sq * dims.v_dim * e if head_major_out else 0
        return fa2_backward_workspace(b, a, kv, sq, sk, dims.qk_dim, dims.v_dim, e) + copy

    return extra


@lru_cache(maxsize=4096)
def _rank_peak(c: int, r: int, size: RingSizes, rotate: CpRotate, dims: Dims | None) -> int:
    """``backward_peak`` of rank r (on CUDA, ``dims`` given: with each block's kernel workspace; every rank
    but the last merges into a head-major output)."""
    return backward_peak(c, r, size, rotate, True, None if dims is None else _block_extra(dims, r < c - 1))


def ring_backward_transient(setup: Setup, dims: Dims) -> int:
    """The ring's backward on the rank ``--cp-rank`` names or else the one that holds the most, above what it
    held before it (the module docstring); 0 without context parallelism and for ``--cp-rotate kv-gather``
    (Transformer Engine's, not run: the plain kernel's buffers stand for it). Without ``--cp-rank`` the
    estimate's saves are those of ranks 0 … c − 2 (``attention.flash_rules``' merged output) and the ring
    the largest of all c: an upper bound where the last rank's ring is the largest (cp 2). The
    reference's ``RingFlash`` (an ``autograd.Function`` with the logsumexp as a second output) also gets
    its zero-filled gradient, [b, a, s] fp32, from the autograd engine (``materialize_grads``)."""
    c = setup.parallel.cp
    if c == 1 or setup.parallel.cp_rotate is CpRotate.KV_GATHER:
        return 0
    size = RingSizes(
        q=dims.b * dims.a * dims.s * dims.qk_dim,
        k=dims.b * dims.kv * dims.s * dims.qk_dim,
        lse=dims.b * dims.a * dims.s,
        e=dims.act.bytes,
    )
    cuda = dims if setup.device is Device.CUDA else None
    lse_grad = dims.b * dims.a * dims.s * DType.FP32.bytes if setup.impl.impl is Impl.REFERENCE else 0
    rotate, rank = setup.parallel.cp_rotate, setup.parallel.cp_rank
    ranks = range(c) if rank is None else (rank,)
    return max(_rank_peak(c, r, size, rotate, cuda) for r in ranks) + lse_grad
