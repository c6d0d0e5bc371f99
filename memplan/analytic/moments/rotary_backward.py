"""A layer backward's moment in its rotary embedding's backward where the code rotates in fp32 with an
interleaved ``rotate_half`` (``Profile.rope_fp32_interleaved``: transformers' Cohere), which
``analytic.moments.layer_backward``'s moments read beside the attention core's.

``apply_rotary_pos_emb`` returns ``q_embed.to(dtype)`` and ``k_embed.to(dtype)`` of products computed on
``q.float()`` and ``k.float()``, k's after q's: autograd runs k's cast back first, then q's, then k's
rotation (``k·cos + rotate_half(k)·sin``), whose ``rotate_half`` backward (``stack`` and ``flatten`` of
the negated odd and the even slices) makes one full-width ``slice_backward`` per half and their sum. At
that sum, beside the attention core's moment: q's and k's gradients in fp32, the two slice gradients and
their sum (fp32 [T, kv·d] each); gone: the kernel's dq and dk and W_O's dX (dO), and the attention core's
saves (q, k, v, its output, the log-sum-exp), freed with its backward. dv stays, for W_V's.
"""

from __future__ import annotations

from memplan.analytic.moments.layer_saves import layer_saves
from memplan.blocks.attention.core import Core, core_of, sdpa_kv_heads
from memplan.blocks.inventory import Block, Dims, Role
from memplan.blocks.profiles import profile_of
from memplan.config import Setup


def fp32_rotary_moment(setup: Setup, dims: Dims, core: int) -> int | None:
    """The moment at k's ``rotate_half`` backward's sum, from the attention core's (``core``:
    ``layer_backward.attention_backward_transient``); None where the code rotates otherwise. Modelled
    where measured: SDPA's flash kernel on one rank, multi-head attention (kv = a; GQA's repeat backward
    runs between, not measured). Measured at Command R's widths (two layers, s 1,024 to 4,096, without
    and with full checkpointing): 1.5 fp32 [T, a·d] less the log-sum-exp above the core's, the layer's top
    from s 4,096 (69,173,248 B under before) (tests/hf/test_cohere_peak.py)."""
    if not profile_of(setup).rope_fp32_interleaved or core_of(setup) is not Core.FLASH:
        return None
    if dims.kv != dims.a or setup.parallel.tp > 1 or setup.parallel.cp > 1:
        return None
    t, e, d = dims.tokens, dims.act.bytes, dims.d
    q_width, k_width = dims.a * d, dims.kv * d
    fp32 = 4 * t * (q_width + 4 * k_width)  # q's and k's gradients upcast; the two slices' and their sum
    kernel = t * (2 * q_width + sdpa_kv_heads(setup, dims) * d) * e  # dO, dq and dk
    saves = layer_saves(setup, {Block.ATTN}, {Role.ATTN_QKV, Role.ATTN_OUT, Role.ATTN_LSE, Role.RNG_STATE})
    return core + fp32 - kernel - saves
