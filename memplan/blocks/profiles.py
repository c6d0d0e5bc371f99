"""Which profile a setup's code has (``profile_of``): the reference model, or one framework's, per family."""

from __future__ import annotations

from memplan.blocks import megatron, torchtitan
from memplan.blocks.hf import hf_profile
from memplan.blocks.profile import REFERENCE, Profile
from memplan.config import Checkpointing, Device, DType, Impl, Setup


def checkpoints_alone(setup: Setup) -> bool:
    """Every-K checkpointing of single layers (``Profile.checkpoints_alone``): ⌈L/K⌉ layers checkpointed,
    each alone; the others keep their saves."""
    every_k = setup.strategy.checkpointing is Checkpointing.EVERY_K
    return every_k and profile_of(setup).checkpoints_alone


def hidden_dropouts(setup: Setup) -> tuple[float, float]:
    """(residual, embedding) dropout probabilities the code applies (``Profile.hidden_dropout``)."""
    m, prof = setup.model, profile_of(setup)
    if prof.mlp_dropout_only:
        return m.resid_dropout, 0.0
    return (m.resid_dropout, m.embd_dropout) if prof.hidden_dropout else (0.0, 0.0)


def profile_of(setup: Setup) -> Profile:
    """The profile of ``setup.impl`` for the model's family."""
    if setup.impl.impl is Impl.HF:
        return hf_profile(setup)
    if setup.impl.impl is Impl.MEGATRON:
        return megatron.profile(setup)
    if setup.impl.impl is Impl.TORCHTITAN:
        return torchtitan.profile(setup)
    return REFERENCE


def dropout_keeps(setup: Setup, dtype: DType) -> DType:
    """What a dropout of a ``dtype`` input keeps: ``native_dropout``'s bool mask, or the noise in the
    input's dtype where the code calls ``nn.Dropout`` on CPU (``Profile.cpu_dropout_noise``)."""
    noise = setup.device is Device.CPU and profile_of(setup).cpu_dropout_noise
    return dtype if noise else DType.BOOL
