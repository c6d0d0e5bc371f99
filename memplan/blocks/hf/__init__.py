"""transformers' modeling code (5.x) as profiles: one module per family group, each a function
``Setup → Profile`` registered in ``FAMILIES`` under the ``model_type``s it covers.

Every fact cites the line of ``modeling_<model_type>.py`` that causes it and is checked by running that
code under fake tensors (``memplan.measure.frameworks.hf``, tests/hf/).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from memplan.blocks.hf import (
    cohere,
    deepseek,
    falcon,
    gemma,
    gpt2,
    gpt_neox,
    gpt_oss,
    llama,
    llama4,
    moe,
    olmo2,
    phi3,
)
from memplan.blocks.profile import Profile
from memplan.config import Family, Setup

FAMILIES: dict[Family, Callable[[Setup], Profile]] = {
    Family.LLAMA: llama.profile,
    Family.GPT2: gpt2.profile,
    Family.GPT_NEOX: gpt_neox.profile,
    Family.MIXTRAL: moe.mixtral,
    Family.QWEN2_MOE: moe.qwen2_moe,
    Family.QWEN3_MOE: moe.qwen3_moe,
    Family.PHIMOE: moe.phimoe,
    Family.GPT_OSS: gpt_oss.profile,
    Family.DEEPSEEK_V2: deepseek.profile,
    Family.DEEPSEEK_V3: deepseek.profile,
    Family.LLAMA4: llama4.profile,
    Family.MISTRAL: llama.windowed,
    Family.QWEN2: llama.windowed,
    Family.QWEN3: llama.windowed,
    Family.GEMMA: gemma.profile,
    Family.GEMMA2: gemma.profile,
    Family.GEMMA3: gemma.profile3,
    Family.PHI3: phi3.profile,
    Family.OLMO2: olmo2.profile,
    Family.GRANITE: llama.granite,
    Family.STARCODER2: llama.starcoder2,
    Family.COHERE: cohere.profile,
    Family.STABLELM: llama.stablelm,
    Family.GLM: llama.glm,
    Family.FALCON: falcon.profile,
}


def hf_profile(setup: Setup) -> Profile:
    """The profile of the model's family (``ModelConfig.code_family``); families without a module of
    their own yet share transformers' common facts (``llama.common``)."""
    family = setup.model.code_family
    profile = FAMILIES.get(family, llama.common)(setup)
    return flash_attention_2(profile) if setup.impl.flash_attn else profile


def flash_attention_2(profile: Profile) -> Profile:
    """``attn_implementation="flash_attention_2"`` (integrations/flash_attention.py →
    ``flash_attn_func``): flash-attn's own kernel, not torch's SDPA dispatcher. Its ``FlashAttnFunc``
    saves q, k, v as given (GQA unrepeated, the [b, s, a, d] views of the transposed states: no copy),
    the output, the fp32 logsumexp and a [2] int64 ``rng_state`` (``flash_rng_int64``, 16 B where torch's
    kernel keeps 24); it takes dropout on the GPU (no math fallback: ``sdpa_dispatch`` off) and the
    sliding window as ``window_size`` (no mask: ``window_mask`` off); its output is laid out
    [b, s, a, d], so W_O's input is a view of it (no head-major copy: ``fused_qkv`` off).
    NB: derived from flash-attn's and transformers' sources; not measured here (CUDA only)."""
    return replace(profile, flash_rng_int64=True, sdpa_dispatch=False, window_mask=False, fused_qkv=False)
