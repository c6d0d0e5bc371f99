"""Implementation profiles: what one framework's code keeps where memplan's reference model keeps something
else, as data the blocks read (``profile_of(setup)``), not a fork of the engine.

A ``Profile`` is a set of switches, each one fact about the code that runs, with the op that causes it. The
reference model is the all-default profile. ``hf`` reads transformers' ``modeling_<model_type>.py`` per
family (``ModelConfig.code_family``); ``torchtitan`` its Llama; ``megatron`` Megatron-core's fused layers.
Each switch is named after what the code does, and the block that owns the tensor applies it.
``blocks.profiles.profile_of(setup)`` picks the profile of a setup.
"""

from __future__ import annotations

from dataclasses import dataclass

from memplan.config import Impl


@dataclass(frozen=True)
class Profile:
    """What the running code keeps, beyond the reference model (every switch off: the reference)."""

    impl: Impl = Impl.REFERENCE
    labels_padded: bool = False
    """transformers' ``ForCausalLMLoss`` pads the labels by one ignore_index (``F.pad(labels, (0, 1))``) and
    shifts them by a view: cross_entropy keeps the [b, s+1] int64 storage (8·b B more)."""
    checkpoints_alone: bool = False
    """``--checkpointing every-K`` is transformers' ``every_n_layers`` (modeling_utils
    ``_set_gradient_checkpointing``: ``layer_index % every_n_layers == 0``): every K-th layer is
    checkpointed alone and the others keep all they save — not K-layer segments re-run whole."""
    hidden_dropout: bool = True
    """The code applies ``resid_dropout`` after attention and the MLP and ``embd_dropout`` after the
    embedding; transformers' Llama-style decoder layers have neither (only ``attention_dropout``), so
    ``--dropout`` reaches the attention probabilities only."""
    eager_fp32_softmax: bool = False
    """The eager core's ``softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)``
    (``eager_attention_forward``): Softmax keeps its fp32 output [b, a, s, s], and P·V the 16-bit copy."""
    additive_mask: bool = False
    """The eager core adds a [b, 1, s, s] mask made once per forward (``masking_utils.eager_mask``: 0 or
    the dtype's min, in the activation dtype) — ``attn_weights + attention_mask`` keeps nothing, where the
    reference's ``masked_fill`` keeps a bool [s, s] mask."""
    cpu_dropout_noise: bool = False
    """``F.dropout`` is the fused ``native_dropout`` (a bool mask) only on CUDA; on CPU ``at::dropout`` runs
    ``_dropout_impl``: ``input · noise`` with noise = bernoulli(1−p)/(1−p) in the input's dtype — the Mul
    keeps the noise, not a mask."""
    sdpa_dispatch: bool = False
    """Attention goes through ``F.scaled_dot_product_attention``'s dispatcher (integrations/
    sdpa_attention.py), with ``dropout_p`` in training. torch's CPU flash kernel takes no dropout
    (sdp_utils_cpp.cpp ``check_for_dropout``): on CPU with p > 0 SDPA runs
    ``_scaled_dot_product_attention_math``, which upcasts 16-bit q, k, v to fp32, repeats k and v to a
    heads (``enable_gqa``), scales q and k by √scale each, and keeps q, k, the fp32 softmax, the dropout's
    noise, the dropped probabilities and v — eager's FLOPs, nothing recomputed."""
    window_mask: bool = False
    """The code honours ``ModelConfig.sliding_window`` with a mask (Mistral, Qwen2, Qwen3:
    ``create_sliding_window_causal_mask``): at s ≥ W ``masking_utils._ignore_causal_mask_sdpa`` cannot
    skip it (``kv_length >= local_attention_size``) and SDPA gets an explicit bool [b, 1, s, s] mask; with
    a mask ``sdpa_attention_forward`` repeats k and v to a heads (``use_gqa_in_sdpa`` needs none), and the
    CPU flash kernel keeps the mask converted to the query's dtype, per layer. NB: on CUDA a masked SDPA
    runs the memory-efficient kernel (its own logsumexp padding and RNG state): estimated as the CPU
    flash kernel's saves, not checked (measure_hf runs CPU kernels)."""
    checkpoint_keeps_mask: bool = False
    """``GradientCheckpointingLayer`` checkpoints ``partial(forward, self, **kwargs)``: the attention mask
    bound in the partial (one storage for every layer) stays alive until backward, with the rotary
    cos/sin the reference keeps anyway."""


REFERENCE = Profile()
