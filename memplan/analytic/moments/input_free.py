"""The layer backward's last moments where the layer's input needs no gradient: layer 0 under ``--freeze
embeddings``, or the lowest layer that trains above frozen ones (``analytic.trainable_grads.as_top``). Its
attention norm makes its weight's gradient alone, so the norm's input-gradient chain never runs, and the
layer tops at W_Q's backward (``no_input_gradient_moments``); ``layer_backward.layer_backward_transient``
puts these in place of the attention norm's moments where ``input_needs_no_gradient`` says so."""

from __future__ import annotations

from memplan.analytic.moments.layer_saves import norm_saves, norm_saves_at_peak
from memplan.analytic.moments.qkv_backward import q_input_gradient, w_qkv_dx
from memplan.blocks.inventory import Block, Dims
from memplan.blocks.norm import norm_backward_transient
from memplan.blocks.profiles import profile_of
from memplan.config import Checkpointing, Setup
from memplan.config.trainable import base_trains, layer_input_grad


def input_needs_no_gradient(setup: Setup, dims: Dims) -> bool:
    """The top layer trains but its input needs no gradient (``config.trainable.layer_input_grad``): the
    layer the backward moments speak of stands for layer 0 under ``--freeze embeddings`` (or the lowest
    layer that trains above frozen ones, ``analytic.trainable_grads.as_top``), where that layer's backward
    is the step's top (its gradients outweigh the saves). Modelled where measured: pre-norm layers with
    the op-by-op RMSNorm (``norm_backward_transient``'s five fp32 [T, h]) feeding separate q, k and v
    projections, whose weights train, on one rank without checkpointing: transformers' Llama family
    (exact); Qwen3 (its q/k norms' moments, ``analytic.moments.qk_norms``), Gemma (its fp32 ``(1 + w)``
    norm, whose weight-only backward runs in fp32) and Phi-3's fused ``qkv_proj`` (W_QKV's dX matmul
    in place of W_Q's, ``qkv_backward.w_qkv_dx``), exact; memplan's reference model, whose projections'
    backward runs in another order, 512 B and 8,192 B over at small widths (L5 at s 8, WIDE at s 16, the
    embedding frozen; 6,784 B and 206,848 B over before)."""
    m, prof = setup.model, profile_of(setup)
    top = m.num_layers - 1
    separate = not (prof.qkv_views or prof.q_input_gradient_top)  # q, k, v as three or one fused linear
    # the op-by-op chain, and the norm keeping one [T, h] in the activations' dtype for its weight's
    # gradient (Llama's ``weight * hidden.to(input_dtype)``; Gemma's fp32 ``(1 + weight)`` product not)
    t_h = dims.tokens * dims.h
    explicit = norm_backward_transient(setup, dims) == 5 * 4 * t_h
    # Gemma's fp32 (1 + w) product keeps its normalised x in fp32 (``Profile.norm_fp32_affine``)
    own_saves = norm_saves(setup, Block.ATTN_NORM) == t_h * dims.act.bytes or prof.norm_fp32_affine
    explicit = explicit and own_saves
    plain = m.pre_norms and not (m.post_norms or m.parallel_residual or setup.strategy.reversible)
    # Llama 4's q/k L2 norms (their own chains) and MoE layers: not measured here; Qwen3's per-head norms
    # measured, their chains' moments read less the residual gradient (``analytic.moments.qk_norms``)
    plain = plain and not m.qk_l2_norm and m.moe is None
    alone = setup.parallel.tp == 1 and setup.parallel.cp == 1
    unsaved = setup.strategy.checkpointing is Checkpointing.NONE
    own = base_trains(setup, top) and not layer_input_grad(setup, top)
    return own and separate and explicit and plain and alone and unsaved


def no_input_gradient_moments(
    setup: Setup, dims: Dims, attn_norm: int, norm_grad: int, residual: int
) -> list[int]:
    """The attention side's last moments where the layer's input needs no gradient
    (``input_needs_no_gradient``), from the attention norm's moment (``attn_norm``: its dx chain, the
    residual gradient beside it and the norm's saves it still holds at that chain's peak):

    - W_Q's backward, the layer's top: the norm's dx chain never runs (``norm_backward_transient``), its
      weight's gradient (``norm_grad``) is not made yet, and no residual gradient (``residual``,
      ``layer_backward.residual_gradient``) waits for the input's (nothing sums into it); the norm's
      saves are all held (it has not run: ``norm_saves`` less ``norm_saves_at_peak``), and W_Q's node
      holds what ``qkv_backward.q_input_gradient`` counts in place of the chain and the norm's gradient —
      q's output gradient (the rotary backward's ``clone``), W_Q's dX, the sum of W_K's and W_V's dX,
      W_Q's saved input;
    - the norm's own backward, its weight's alone: ``weight * normed``'s product dY·normed [T, h] before
      its sum, beside the summed dY [T, h] and the saved normed (the same chain and residual gone); Gemma's
      ``(1 + w)`` product in fp32: dY upcast and dY·normed fp32 [T, h], and the fp32 [h] sum made before
      the product is freed, the weight's gradient its cast after (Gemma 2B three layers at s 128: the
      layer's top, 2,617,344 B over before as the trained input's chain).

    Measured on transformers' Llama 3 8B (two layers at its widths, s 512, ``--freeze embeddings``, no
    checkpointing), layer 0's backward, the step's top: ``mm`` [512, 4096] (W_Q's dX) after W_Q's
    [4096, 4096] weight gradient, 8.0 [T, h] (bf16) below the dx chain's peak that the trained embedding's
    layer 0 reaches (whose norm keeps its fp32 input there); before, the estimate charged that chain:
    25,436,160 B over (tests/hf/test_hf_peak.py ``FROZEN``)."""
    t_h_e = dims.tokens * dims.h * dims.act.bytes
    chain = norm_backward_transient(setup, dims) + residual
    held = norm_saves(setup, Block.ATTN_NORM) - norm_saves_at_peak(setup, Block.ATTN_NORM)
    unrun = attn_norm - chain + held
    # one fused W_QKV (Phi-3's ``qkv_proj``): its dX matmul, the cat of dq, dk, dv beside it
    fused = profile_of(setup).fused_qkv
    w_q_node = w_qkv_dx(setup, dims, norm_grad) if fused else q_input_gradient(setup, dims, norm_grad)
    w_q = attn_norm - residual + held + w_q_node
    weight_only = unrun + 2 * t_h_e  # dY and dY·normed; the weight's gradient a sum of it, after
    if profile_of(setup).norm_fp32_affine:
        # Gemma: dY upcast and dY·normed in fp32, and the fp32 [h] sum made before the product is freed;
        # the weight's gradient (``norm_grad``) is its cast, after
        weight_only = unrun + 2 * 4 * dims.tokens * dims.h + 4 * dims.h - norm_grad
    return [w_q, weight_only]
