"""A layer backward's moments at its per-head q and k norms (``ModelConfig.qk_norm``: Qwen3's
``q_norm(q_proj(x).view(·, d))`` and ``k_norm(·)``, an RMSNorm over each head's d), which
``analytic.moments.layer_backward``'s moments read beside the attention norm's.

Their backward runs after the attention core's and the rotary backward, between the projections':
v_proj's, k_norm's, k_proj's, q_norm's, q_proj's (autograd runs the later node first), then the attention
norm's. Each norm's input-gradient chain is the op-by-op RMSNorm's (``blocks.norm.norm_backward_transient``:
five fp32 tensors of its input's width) over [T, a·d] or [T, kv·d]: where q is wide against h (Qwen3-0.6B:
a·d = 2h) or the sequence long against the weights (Qwen3 8B at s 1,024), q_norm's chain tops the layer
above the attention norm's, which the moments had read as the last — 6,210,048 B and 5,472,768 B under
transformers' step (tests/hf/test_hf_peak.py).

Both moments are read from the attention norm's (``attn_norm``: the layer's gradients made, its
attention's saves freed, the norm's chain over [T, h] beside the residual gradient) by what differs; OLMo-2's
whole-width q/k norms, with no pre-norm, replace that moment instead (``post_norms.whole_qk_norm_moments``).
"""

from __future__ import annotations

from memplan.analytic.moments.layer_saves import named_saves, norm_saves, norm_saves_at_peak
from memplan.analytic.params import ParamCount
from memplan.blocks.inventory import Block, Dims
from memplan.blocks.norm import norm_backward_transient
from memplan.blocks.profiles import top_layer_grads
from memplan.config import Setup


def per_head_norms_apply(setup: Setup, dims: Dims) -> bool:
    """Per-head q/k norms after pre-norm layers, with the op-by-op RMSNorm whose chain and saves
    (``norm_backward_transient``'s five fp32 [T, h]; the fp32 input, rstd and the normalised x in the
    activations' dtype) these moments were measured on: transformers' Qwen3, dense and MoE. Not Gemma-3's
    fp32 ``(1 + w)`` norm beside post norms (not measured), nor OLMo-2's whole-width norms."""
    m = setup.model
    if not m.qk_norm or m.qk_norm_whole or not m.pre_norms or m.post_norms:
        return False
    t_h = dims.tokens * dims.h
    return norm_backward_transient(setup, dims) == 5 * 4 * t_h


def per_head_qk_norm_moments(setup: Setup, dims: Dims, params: ParamCount, attn_norm: int) -> list[int]:
    """q_norm's and k_norm's chain peaks, from the attention norm's moment ``attn_norm``:

    - q_norm's: its chain over [T, a·d] in place of the attention norm's over [T, h]; W_Q's and the
      attention norm's weight gradients not made yet; the attention norm's saves all held (it has not run:
      ``norm_saves`` less ``norm_saves_at_peak``), W_Q's saved input ``attn.input`` and q_norm's own fp32
      input (held at its peak); the sum of W_K's and W_V's dX [T, h] waiting for W_Q's;
    - k_norm's (before it): its chain over [T, kv·d] in place of q_norm's; W_K's and q_norm's weight
      gradients not made either; q_norm's other saves (rstd, the normalised x) and q's gradient [T, a·d]
      waiting for it, k_norm's fp32 input held; W_V's dX alone in the sum, the same [T, h].

    Derived on transformers' Qwen3 (two layers, s 512 and 1,024, no checkpointing) at Qwen3-0.6B's widths
    (a·d = 2h, kv·d = h) and Qwen3 8B's (a·d = h): every chain peak exact against the attention norm's;
    then the layer moment exact, not used to derive it, at Qwen3 1.7B and 4B, s 2,048, full checkpointing,
    a frozen embedding or layer, and Qwen3-MoE's layout at 32 heads on narrow widths (h 512 and 1,024:
    18,735,616 and 20,308,480 B under before) (tests/hf/test_hf_peak.py)."""
    t, e = dims.tokens, dims.act.bytes
    a_d, kv_d = dims.a * dims.d, dims.kv * dims.d

    def chain(width: int) -> int:  # the op-by-op norm's transient over [T, width]
        return norm_backward_transient(setup, dims.model_copy(update={"h": width}))

    layer = params.layer
    held = norm_saves(setup, Block.ATTN_NORM) - norm_saves_at_peak(setup, Block.ATTN_NORM)
    unmade = top_layer_grads(setup, layer.q_proj) + top_layer_grads(setup, layer.attn_norm)
    q_norm = (
        attn_norm
        - norm_backward_transient(setup, dims)
        + chain(a_d)
        - unmade
        + held
        + named_saves(setup, "attn.input", "attn.q_norm.input")
        + t * dims.h * e  # W_K's and W_V's dX, summed, waiting for W_Q's
    )
    k_norm = (
        q_norm
        - chain(a_d)
        + chain(kv_d)
        - top_layer_grads(setup, layer.k_proj)
        - top_layer_grads(setup, dims.d)  # q_norm's weight [d]
        + named_saves(setup, "attn.q_norm.rstd", "attn.q_norm.normed", "attn.k_norm.input")
        + t * a_d * e  # q's gradient, waiting for q_norm's backward
    )
    return [q_norm, k_norm]
