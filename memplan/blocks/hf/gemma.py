"""transformers' ``modeling_gemma.py`` and ``modeling_gemma2.py``: Llama's layout with GeGLU
(``ModelConfig.gate_act``), an embedding scaled by √h and an RMSNorm that applies (1 + w) in fp32.
Gemma-2 adds structure, not code facts: ``post_norms``, ``attn_softcap`` / ``final_softcap`` (the
blocks' rules) and alternating sliding-window layers (``sliding_window_pattern``); Gemma-3 (text) the
per-head ``qk_norm`` and a second rotary base."""

from __future__ import annotations

from dataclasses import replace

from memplan.blocks.hf.llama import common
from memplan.blocks.profile import Profile
from memplan.config import Setup


def profile(setup: Setup) -> Profile:
    """Gemma: ``GemmaRMSNorm.forward`` (``output * (1.0 + self.weight.float())``) and
    ``GemmaModel.forward`` (``hidden_states * normalizer``, a 0-dim tensor)."""
    return replace(common(setup), norm_fp32_affine=True, embed_scale_tensor=True)


def profile3(setup: Setup) -> Profile:
    """Gemma-3 (``modeling_gemma3.py``, text): Gemma's facts (``Gemma3TextScaledWordEmbedding`` multiplies
    by ``embed_scale.to(dtype)``, a 0-dim tensor) and a rotary table pair per layer type."""
    return replace(profile(setup), rope_per_layer_type=True)
