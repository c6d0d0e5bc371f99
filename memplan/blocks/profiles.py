"""Which profile a setup's code has (``profile_of``): the reference model, or one framework's, per family."""

from __future__ import annotations

from memplan.blocks import torchtitan
from memplan.blocks.hf import hf_profile
from memplan.blocks.profile import REFERENCE, Profile
from memplan.config import Impl, Setup


def profile_of(setup: Setup) -> Profile:
    """The profile of ``setup.impl`` for the model's family."""
    if setup.impl.impl is Impl.HF:
        return hf_profile(setup)
    if setup.impl.impl is Impl.TORCHTITAN:
        return torchtitan.profile(setup)
    return REFERENCE
