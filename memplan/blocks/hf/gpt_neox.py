"""transformers' ``modeling_gpt_neox.py`` (GPT-NeoX, Pythia): GPT-2's facts (``gpt2.gpt_common``) and an
fp32 eager softmax. Partial rotary and the parallel residual are the model's (``ModelConfig.rotary_pct``,
``parallel_residual``), read by the blocks."""

from __future__ import annotations

from dataclasses import replace

from memplan.blocks.hf.gpt2 import gpt_common
from memplan.blocks.profile import Profile
from memplan.config import Setup


def profile(setup: Setup) -> Profile:
    """GPT-NeoX: ``eager_attention_forward`` takes ``softmax(attn_weights, dim=-1, dtype=torch.float32)
    .to(query.dtype)``; ``apply_rotary_pos_emb`` cats the rotated and passed dims (``rotary_cat``)."""
    return replace(gpt_common(setup), eager_fp32_softmax=True, rotary_cat=True)
