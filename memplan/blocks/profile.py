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
    rms_norm_fp32_product: bool = False
    """torch's ``F.rms_norm`` (``nn.RMSNorm``; ``aten::rms_norm`` is CompositeImplicitAutograd, no fused CPU
    kernel: ``rms_norm_symint`` in aten/src/ATen/native/layer_norm.cpp) multiplies x32·rstd by the weight
    in fp32 and casts the product back (``type_as``): the mul with the weight keeps the normalised x in
    fp32, not in the activation dtype (2·b·s·h B more per norm in bf16)."""
    rope_cache_per_layer: bool = False
    """torchtitan's ``ComplexRoPE`` (models/common/rope.py): every attention builds its own complex64 cache
    [max_seq_len, d/2] (a buffer, ``torch.polar``) and ``apply_rotary_emb`` multiplies the complex q and k
    by a view of it: the mul keeps the cache, one per layer, and no shared cos/sin tables exist."""
    loss_over_token_count: bool = False
    """torchtitan's ``CrossEntropyLoss`` (components/loss.py) sums the loss and divides it by the trainer's
    ``global_valid_tokens``, an int64 scalar tensor: the division keeps it (8 B)."""
    checkpoint_early_stop: bool = True
    """The activation checkpoint stops its re-run once the last saved tensor is rebuilt (torch's default,
    ``set_checkpoint_early_stop``). torchtitan's ``FullAC`` (distributed/activation_checkpoint.py) wraps
    each block with ``checkpoint_wrapper(..., early_stop=False)``: the re-run reaches the block's end, the
    MLP's down projection included."""


REFERENCE = Profile()
