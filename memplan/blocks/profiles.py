"""Which profile a setup's code has (``profile_of``): the reference model, or one framework's, per family."""

from __future__ import annotations

from memplan.blocks import megatron
from memplan.blocks.hf import hf_profile
from memplan.blocks.profile import REFERENCE, Profile
from memplan.config import Device, DType, Impl, Setup


def profile_of(setup: Setup) -> Profile:
    """The profile of ``setup.impl`` for the model's family."""
    if setup.impl.impl is Impl.HF:
        return hf_profile(setup)
    if setup.impl.impl is Impl.MEGATRON:
        return megatron.profile(setup)
    return REFERENCE


def dropout_keeps(setup: Setup, dtype: DType) -> DType:
    """What a dropout of a ``dtype`` input keeps: ``native_dropout``'s bool mask, or the noise in the
    input's dtype where the code calls ``nn.Dropout`` on CPU (``Profile.dropout_noise``)."""
    noise = setup.device is Device.CPU and profile_of(setup).dropout_noise
    return dtype if noise else DType.BOOL
