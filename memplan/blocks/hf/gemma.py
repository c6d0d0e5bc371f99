"""transformers' ``modeling_gemma.py`` and ``modeling_gemma2.py``: Llama's layout with GeGLU
(``ModelConfig.gate_act``), an embedding scaled by √h and an RMSNorm that applies (1 + w) in fp32.
Gemma-2 adds structure, not code facts: ``post_norms``, ``attn_softcap`` / ``final_softcap`` (the
blocks' rules) and alternating sliding-window layers (``sliding_window_pattern``)."""

from __future__ import annotations

from dataclasses import replace

from memplan.blocks.hf.llama import common
from memplan.blocks.profile import Profile
from memplan.config import Setup


def profile(setup: Setup) -> Profile:
    """Gemma: ``GemmaRMSNorm.forward`` (``output * (1.0 + self.weight.float())``) and
    ``GemmaModel.forward`` (``hidden_states * normalizer``, a 0-dim tensor)."""
    return replace(common(setup), norm_fp32_affine=True, embed_scale_tensor=True)
