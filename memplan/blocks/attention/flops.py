"""Attention's FLOPs as FlopCounterMode counts them: the projections 2·T·h·(a·d) + 2·2·T·h·(kv·d) +
2·T·(a·d)·h forward; the core's QKᵀ and P·V, 2·d per score cell each (causal not halved; ring attention's
steps under context parallelism); its backward (eager and math: two bmms, each 2×; flash: five s×s
products, one the kernel's own re-computation of S)."""

from __future__ import annotations

from memplan.blocks import mm
from memplan.blocks.attention.core import Core, core_of
from memplan.blocks.inventory import Dims
from memplan.config import Setup


def projection_flops(dims: Dims) -> int:
    """Forward FLOPs of W_Q, W_K, W_V and W_O."""
    t, h = dims.tokens, dims.h
    qd, kvd = dims.a * dims.d, dims.kv * dims.d
    return mm(t, h, qd) + 2 * mm(t, h, kvd) + mm(t, qd, h)


def score_cells(dims: Dims) -> int:
    """(query, key) cells of S = QKᵀ the kernels compute per (batch, head), as FlopCounterMode counts them
    (causal not halved): s² on one device.

    Ring attention over c = ``dims.ring`` ranks, s = one rank's s/c tokens (torch's
    ``_templated_ring_attention`` with its default load balancing: the sequence cut into 2c chunks, rank r
    holding chunks r and 2c−1−r): step 0 runs the causal kernel on the rank's own q, k, v (s² cells);
    each of the c−1 later steps runs a non-causal kernel on half of them — all of q against the first half
    of the received K/V when the source rank is lower, else the second half of q against all of it
    (s·s/2 cells): s² + (c−1)·s²/2 = s²·(c+1)/2 in all (s even: c divides s/2).
    """
    s, c = dims.s, dims.ring
    return s * s + (c - 1) * (s * (s // 2))


def attention_core_flops(dims: Dims) -> int:
    """Forward QKᵀ [s, d]·[d, s] and P·V [s, s]·[s, d] per (batch, head): 2·d FLOPs per score cell each
    (``score_cells``: causal not halved; ring attention's steps under context parallelism); MLA's QKᵀ
    over d_n + d_r and P·V over d_v (``Dims.qk_dim``, ``Dims.v_dim``)."""
    return 2 * dims.b * dims.a * (dims.qk_dim + dims.v_dim) * score_cells(dims)


def attention_backward_flops(setup: Setup, dims: Dims) -> int:
    per_bmm = attention_core_flops(dims) // 2
    # eager and math: two bmms, each 2× in backward; flash: five s×s products (S recomputed, dP, dV, dQ,
    # dK).
    return (5 if core_of(setup) is Core.FLASH else 4) * per_bmm


def kernel_recompute_flops(setup: Setup, dims: Dims) -> int:
    """One layer's flash backward re-computing S = QKᵀ [s, d]·[d, s] per (batch, head): one of its five
    s×s products (``attention_backward_flops``); eager attention's backward re-computes nothing."""
    if core_of(setup) is not Core.FLASH:
        return 0
    return attention_core_flops(dims) // 2
