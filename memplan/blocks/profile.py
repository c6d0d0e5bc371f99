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
    softmax_fp32: bool = False
    """Eager attention's ``softmax(scores, dtype=float32).to(query.dtype)`` (``eager_attention_forward``):
    softmax keeps its fp32 output [b, a, s, s] and P·V the cast copy (one storage when A is fp32)."""
    mask_added: bool = False
    """Eager attention adds a float mask (``attn_weights + attention_mask``): an add keeps nothing, where
    the reference's ``masked_fill`` keeps a bool [s, s]."""
    sdpa_mask_converted: bool = False
    """transformers passes SDPA a bool [b, 1, s, s] mask only when ``is_causal`` cannot do (a sliding window
    that does not cover the sequence: ``masking_utils._ignore_causal_mask_sdpa``, kv_length ≥ window);
    torch converts it to a float mask in the query dtype per call, which the CPU flash kernel keeps."""
    repeat_kv_view: bool = False
    """``repeat_kv`` is ``expand`` + ``reshape``: a view of the kv-head k and v when kv = 1 (MQA: the merged
    dimension has size 1), a copy to a heads otherwise; the eager matmuls keep what it returns."""
    norm_fp32_affine: bool = False
    """Gemma's RMSNorm: ``(x32·rstd) * (1.0 + weight.float())`` then ``type_as(x)``: the product keeps the
    normalised x in fp32 [b, s, h] (not the 16-bit cast) and the fp32 (1 + w) [h] of each norm."""
    embed_scale_tensor: bool = False
    """Gemma's ``hidden_states * torch.tensor(hidden_size**0.5, dtype=hidden_states.dtype)``: the mul keeps
    the 0-dim normaliser (A bytes) once per forward (the code scales: ``ModelConfig.embed_scale`` is what
    the reference model does)."""
    rope_per_layer_type: bool = False
    """Gemma-3's ``Gemma3TextModel.forward``: one rotary table pair per layer type present (``for
    layer_type in set(layer_types)``: full and sliding layers, each with its base), every pair kept."""
    fused_qkv: bool = False
    """Phi-3's ``qkv_proj``: q, k, v are slices of one [b, s, (a + 2·kv)·d] output. A slice is not dense, so
    RoPE's output is laid out head-major [b, a, s, d] and SDPA's output follows the query's layout:
    ``attn_output.reshape(...).contiguous()`` copies it, and the kernel's output and W_O's input are two
    [b, s, a·d] storages (eager's P·V output is a local, copied either way)."""
    fused_gate_up: bool = False
    """Phi-3's ``gate_up_proj``: gate and up are the two ``chunk``s of one [b, s, 2f] output; the
    activation's input and the product's operand are views of it, kept as one storage."""


REFERENCE = Profile()
