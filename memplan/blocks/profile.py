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
    kv_cache: bool = False
    """The forward fills a ``DynamicCache`` (``use_cache``, not under gradient checkpointing, where the
    layers get none): ``DynamicLayer.update`` cats k and v onto an empty cache, so the attention reads
    contiguous copies [b, kv, s, d], never views of the projection output."""
    fused_qkv: bool = False
    """q, k and v are views of one projection output [b, s, (a + 2·kv)·d] (GPT-2's ``c_attn(x).split``,
    GPT-NeoX's ``query_key_value(x).view(...).chunk(3)``): a save of one that is still a view keeps the
    whole buffer."""
    dropout_noise: bool = False
    """``nn.Dropout`` → ``at::dropout``: on CPU ``_dropout_impl`` multiplies by a noise tensor in the
    input's dtype (``input * noise``: Mul keeps the noise); on CUDA the fused ``native_dropout`` keeps a
    bool mask (``is_fused_kernel_acceptable``)."""
    sdpa_math_dropout: bool = False
    """``F.scaled_dot_product_attention`` with dropout on CPU: no fused CPU kernel takes dropout, so torch
    runs ``_scaled_dot_product_attention_math``, which upcasts 16-bit q, k, v to fp32, scales q and kᵀ by
    √scale (new tensors), and keeps the fp32 softmax, the dropout noise and the dropped probabilities."""
    eager_softmax_fp32: bool = False
    """Eager attention's ``softmax(..., dtype=torch.float32).to(q.dtype)``: the fp32 probabilities
    (softmax's output) and their A-dtype copy (the P·V matmul's operand) are both kept."""
    eager_additive_mask: bool = False
    """Eager attention adds the causal mask (``attn_weights + attention_mask``): nothing is kept for it,
    where the reference's ``masked_fill`` keeps a bool [s, s]."""
    gelu_python: bool = False
    """``gelu_new`` is ``NewGELUActivation``, written in Python (activations.py):
    ``0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`` keeps x (pow), tanh's output, 0.5·x and 1 + tanh
    (the last product): four [T, f] where ``F.gelu`` keeps x alone."""


REFERENCE = Profile()
