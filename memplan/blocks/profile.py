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
    experts_gate_up_fused: bool = False
    """transformers' experts hold gate and up as one ``gate_up_proj``: their product [S, 2f] is one
    storage that ``chunk(2)`` views, so ``act_fn(gate) * up`` keeps the whole buffer (the same bytes as a
    separate gate and up, one tensor)."""
    experts_grouped_mm: bool = False
    """transformers' default experts (``integrations/moe.py::grouped_mm_experts_forward``,
    ``experts_implementation="grouped_mm"``): each grouped_mm keeps its offsets [E] int32
    (``cumsum(histc(...))``), and the slots go back to the tokens by ``weighted_out[inv_perm]`` and a sum
    over k, not ``index_add_``: the inverse permutation [S] int64 is kept, the weighted product is not.
    (The ``eager`` loop keeps what the reference model keeps: per expert its ``torch.where`` [n_e, 2]
    int64, and ``index_add_``'s source.)"""
    routing_weights_fp32: bool = False
    """Mixtral's router (``MixtralTopKRouter.forward``) returns its fp32 top-k weights uncast:
    ``proj_out * sample_weights_g.unsqueeze(-1)`` keeps the slots' weights [S, 1] in fp32."""


REFERENCE = Profile()
