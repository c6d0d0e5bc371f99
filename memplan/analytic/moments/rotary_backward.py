"""A layer backward's moment in its rotary embedding's backward where the code rotates in fp32 with an
interleaved ``rotate_half`` (``Profile.rope_fp32_interleaved``: transformers' Cohere), which
``analytic.moments.layer_backward``'s moments read beside the attention core's.

``apply_rotary_pos_emb`` returns ``q_embed.to(dtype)`` and ``k_embed.to(dtype)`` of products computed on
``q.float()`` and ``k.float()``, k's after q's: autograd runs k's cast back first, then q's, then k's
rotation (``k·cos + rotate_half(k)·sin``), whose ``rotate_half`` backward (``stack`` and ``flatten`` of
the negated odd and the even slices) makes one full-width ``slice_backward`` per half and their sum. Then
q's rotation, whose ``rotate_half`` backward does the same over [T, a·d]. At either top, beside the
attention core's moment: the fp32 gradients of ``fp32_rotary_moment``; gone: the kernel's dq and dk and
W_O's dX (dO), and the attention core's saves (q, k, v, its output, the log-sum-exp), freed with its
backward. dv stays, for W_V's.
"""

from __future__ import annotations

from memplan.analytic.moments.layer_saves import layer_saves
from memplan.blocks.attention.core import Core, core_of, sdpa_kv_heads
from memplan.blocks.inventory import Block, Dims, Role
from memplan.blocks.profiles import profile_of
from memplan.config import Setup


def fp32_rotary_moment(setup: Setup, dims: Dims, core: int, freed: int = 0) -> int | None:
    """The rotary backward's top, from the attention core's moment (``core``:
    ``layer_backward.attention_backward_transient``); None where the code rotates otherwise. ``freed``:
    the rotary tables layer 0's rotary backward releases (``constants.tables_freed_by_layer0``, cos and
    sin), 0 at the other layers. Two candidates, the larger the top:

    - k's ``rotate_half`` backward's sum (k's rotation runs first): q's and k's gradients upcast, k's two
      slice gradients and their sum, fp32 [T, a·d] + 4 × fp32 [T, kv·d];
    - q's second ``slice_backward``: q's upcast gradient, dq·sin and the two slice gradients, beside k's
      finished fp32 gradient, 4 × fp32 [T, a·d] + fp32 [T, kv·d]; by then the backward of q's
      ``rotate_half(q)·sin`` has released its saved sin, at layer 0 the table's last holder (half of
      ``freed``).

    Under multi-head attention they are equal (k's first, no table released yet); under grouped-query
    attention q's tops. Modelled where measured: SDPA's flash kernel on one rank. Measured at Command R's
    widths (multi-head, two layers, s 1,024 to 4,096, without and with full checkpointing): 1.5 fp32
    [T, a·d] less the log-sum-exp above the core's, the layer's top from s 4,096 (69,173,248 B under
    before); at Command R+'s (96 heads, 8 kv heads, s 4,096: 207,142,912 B under before, q's candidate
    then unmodelled), without checkpointing one bf16 [s, d] table below the unreleased tables' figure
    (tests/hf/test_cohere_peak.py)."""
    if not profile_of(setup).rope_fp32_interleaved or core_of(setup) is not Core.FLASH:
        return None
    if setup.parallel.tp > 1 or setup.parallel.cp > 1:
        return None
    t, e, d = dims.tokens, dims.act.bytes, dims.d
    q_width, k_width = dims.a * d, dims.kv * d
    k_top = 4 * t * (q_width + 4 * k_width)
    q_top = 4 * t * (4 * q_width + k_width) - freed // 2  # the sin table of cos and sin
    kernel = t * (2 * q_width + sdpa_kv_heads(setup, dims) * d) * e  # dO, dq and dk
    saves = layer_saves(setup, {Block.ATTN}, {Role.ATTN_QKV, Role.ATTN_OUT, Role.ATTN_LSE, Role.RNG_STATE})
    return core + max(k_top, q_top) - kernel - saves
