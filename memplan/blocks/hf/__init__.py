"""transformers' modeling code (5.x) as profiles: one module per family group, each a function
``Setup → Profile`` registered in ``FAMILIES`` under the ``model_type``s it covers.

Every fact cites the line of ``modeling_<model_type>.py`` that causes it and is checked by running that
code under fake tensors (``memplan.measure.hf``, tests/hf/).
"""

from __future__ import annotations

from collections.abc import Callable

from memplan.blocks.hf import gemma, gpt2, gpt_neox, llama, moe, phi3
from memplan.blocks.profile import Profile
from memplan.config import Family, Setup

FAMILIES: dict[Family, Callable[[Setup], Profile]] = {
    Family.LLAMA: llama.profile,
    Family.GPT2: gpt2.profile,
    Family.GPT_NEOX: gpt_neox.profile,
    Family.MIXTRAL: moe.mixtral,
    Family.QWEN2_MOE: moe.qwen2_moe,
    Family.MISTRAL: llama.windowed,
    Family.QWEN2: llama.windowed,
    Family.QWEN3: llama.windowed,
    Family.GEMMA: gemma.profile,
    Family.GEMMA2: gemma.profile,
    Family.GEMMA3: gemma.profile3,
    Family.PHI3: phi3.profile,
}


def hf_profile(setup: Setup) -> Profile:
    """The profile of the model's family (``ModelConfig.code_family``); families without a module of
    their own yet share transformers' common facts (``llama.common``)."""
    family = setup.model.code_family
    return FAMILIES.get(family, llama.common)(setup)
