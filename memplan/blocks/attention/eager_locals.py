"""Eager attention's forward beyond its saves: the locals alive while the core runs (the reference model's
and Megatron-core's eager cores), for the forward's peak (``analytic.peak``).

NB: transformers' eager core (a [b, 1, s, s] additive mask alive through the forward, the fp32 softmax) is
not measured by ``measure_hf`` (it counts saves, not the peak) and these follow the reference's.
"""

from __future__ import annotations

from memplan.blocks.attention.core import qkv_view_rules
from memplan.blocks.inventory import Dims
from memplan.blocks.profiles import profile_of
from memplan.config import Attention, Setup


def eager_core_copies(setup: Setup) -> bool:
    return setup.strategy.attention is Attention.EAGER


def eager_forward_extra(setup: Setup, dims: Dims) -> int:
    """Eager attention's forward beyond its saves: q and k (after RoPE) and v before their contiguous
    copies, the scaled scores (a local until the core returns), and either the masked scores at the
    softmax or P·V's output before its [b, s, a·d] copy; with attention dropout the masked scores are
    gone before the dropout's mask and output (among the saves) exist."""
    if setup.strategy.attention is not Attention.EAGER:
        return 0
    a_bytes, t = dims.act.bytes, dims.tokens
    locals_ = t * (dims.a + 2 * dims.kv) * dims.d * a_bytes
    scores = dims.b * dims.a * dims.s * dims.s * a_bytes
    ctx = t * dims.a * dims.d * a_bytes
    if profile_of(setup).qkv_views:
        return megatron_forward_extra(setup, dims, scores, ctx)
    return locals_ + scores + (ctx if setup.model.attn_dropout > 0 else max(scores, ctx))


def megatron_forward_extra(setup: Setup, dims: Dims, scores: int, ctx: int) -> int:
    """Megatron-core's eager core (``DotProductAttention.forward``) beyond its saves: W_QKV's output where
    no saved view holds it (GQA: q is a copy, k and v repeated, the split views are locals); ``baddbmm``'s
    scores (``matmul_result``, a local until the core returns); P·V's output while its [s, b, a·d] copy is
    made. NB: the torch softmax fallback's fp32 copies (s > 4096) are not counted."""
    saved = any(r.name == "attn.qkv" for r in qkv_view_rules(setup, dims, eager_core=True))
    buffer = 0 if saved else dims.tokens * (dims.a + 2 * dims.kv) * dims.d * dims.act.bytes
    return buffer + scores + ctx
