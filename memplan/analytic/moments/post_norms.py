"""A layer backward's moments around the norms after its sublayers (``ModelConfig.post_norms``: Gemma-2's
and Gemma-3's beside their pre-norms, OLMo-2's alone) and OLMo-2's whole-width q/k norms, which
``analytic.moments.layer_backward``'s moments read.

With post norms a layer's output is ``h + post_mlp_norm(mlp(·))`` and ``h = x + post_attn_norm(attn(·))``:
the post-MLP norm's backward is the layer's first, before the MLP's, and the post-attention norm's runs
after the MLP (and its pre-norm) and before W_O's. Each frees its saves and makes its weight's gradient
(``post_norm_done``); before, every later moment held them (a Gemma-2 2B layer's MLP norm 9,443,840 B over
transformers' step at s 512, a Gemma-3 1B layer's MLP 4,722,944 B, OLMo-2 7B's two post norms'
33,542,144 B).

OLMo-2 has no pre-norms (``pre_norms`` false): no norm runs at the attention's input, and its last norms
are ``q_norm(q_proj(x))`` and ``k_norm(k_proj(x))`` over the projections' whole outputs
(``qk_norm_whole``), whose backward runs between the projections': v_proj's, k_norm's, k_proj's,
q_norm's, q_proj's (autograd runs the later node first). Their moments (``whole_qk_norm_moments``) replace
the attention norm's.
"""

from __future__ import annotations

from memplan.analytic.moments.layer_saves import named_saves, norm_saves, norm_saves_at_peak
from memplan.analytic.params import ParamCount
from memplan.blocks.inventory import Block, Dims
from memplan.blocks.norm import norm_backward_transient, norm_params
from memplan.blocks.profiles import top_layer_grads
from memplan.config import Setup


def post_norm_done(setup: Setup, norm: Block) -> int:
    """Once a post norm's backward has run (``Block.POST_MLP_NORM`` or ``Block.POST_ATTN_NORM``): its
    weight's gradient [h] made, its saves freed (x32, rstd, the normalised x and Gemma's fp32 1 + w); 0
    without post norms."""
    if not setup.model.post_norms:
        return 0
    return top_layer_grads(setup, norm_params(setup.model)) - norm_saves(setup, norm)


def at_norm_peak(setup: Setup, norm: Block) -> int:
    """A post norm's change of the live set at its backward's peak: its weight's gradient made, its saves
    but those still held then (``norm_saves_at_peak``: RMSNorm's fp32 input) freed."""
    return post_norm_done(setup, norm) + norm_saves_at_peak(setup, norm)


def post_mlp_norm_moment(setup: Setup, dims: Dims, residual: int) -> int | None:
    """The layer's first backward, the post-MLP norm's: its transient (``norm_backward_transient``) beside
    the layer's output gradient, which waits as the residual's (``residual``). Measured at OLMo-2 7B's
    widths (s 512): 37,754,880 B above the layer's saves, below its later moments. None without post
    norms."""
    if not setup.model.post_norms:
        return None
    return residual + norm_backward_transient(setup, dims) + at_norm_peak(setup, Block.POST_MLP_NORM)


def whole_qk_norm_moments(setup: Setup, dims: Dims, params: ParamCount, attn_norm: int) -> list[int]:
    """OLMo-2's k_norm and q_norm backward peaks, from ``attn_norm`` (the whole layer's gradients made and
    its attention's saves freed, the norm transient over [T, h] beside the residual gradient: the
    attention norm's moment of a pre-norm layer, which OLMo-2 has not).

    - q_norm's (the last): q_proj's gradient not made yet, its input ``attn.input`` (the layer's input:
      no pre-norm) still saved, q_norm's fp32 input held at its peak, its transient over [T, a·d];
    - k_norm's: k_proj's and q_norm's weight gradients not made either, q_norm's saves all held and q's
      gradient waiting for it (the [b, s, a, d] contiguous copy of the head transpose's backward, in A),
      k_norm's fp32 input held, its transient over [T, kv·d] — above q_norm's where s·(5·a·d·4 + …) outgrows
      the k_proj gradient (MHA at long s).

    Measured at OLMo-2 7B's widths (s 512): q_norm's the layer's top, 292,511,744 B above its saves, and
    k_norm's 279,922,688 B; before, the attention norm's moment was read 55,037,952 B over.
    """
    a_d, kv_d = dims.a * dims.d, dims.kv * dims.d
    norm_h = norm_backward_transient(setup, dims)

    def norm_over(width: int) -> int:  # the norm's transient over [T, width]
        return norm_backward_transient(setup, dims.model_copy(update={"h": width}))

    base = attn_norm - norm_h - top_layer_grads(setup, params.layer.q_proj) + named_saves(setup, "attn.input")
    q_norm = base + norm_over(a_d) + named_saves(setup, "attn.q_norm.input")
    held = named_saves(
        setup, "attn.q_norm.input", "attn.q_norm.rstd", "attn.q_norm.normed", "attn.k_norm.input"
    )
    q_grad = dims.tokens * a_d * dims.act.bytes
    k_grads = top_layer_grads(setup, params.layer.k_proj) + top_layer_grads(setup, a_d)
    k_norm = base + norm_over(kv_d) + held + q_grad - k_grads
    return [q_norm, k_norm]
