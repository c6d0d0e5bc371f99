"""transformers' ``modeling_cohere.py`` (Command R): Llama's attention and SwiGLU MLP in a parallel layer
with one norm, ``residual + self_attn(ln(x)) + mlp(ln(x))`` (``CohereDecoderLayer.forward``:
``ModelConfig.parallel_residual`` and ``shared_norm``), a bias-free LayerNorm written in Python
(``CohereLayerNorm``: ``norm_bias`` false, ``Profile.layernorm_python``), interleaved rotary
(``rotate_half`` on even/odd dims and ``repeat_interleave``d tables: the same saves as Llama's, the
products in fp32 after ``q.float()``), and ``logits * self.logit_scale`` (a Python float: nothing kept).

Checked to the byte per layer and in total, FLOPs per phase equal (tests/hf/test_cohere.py). Known
limitations:
- ``use_qk_norm`` (Command R+): a ``CohereLayerNorm`` with a [heads, d] weight on the [b, s, heads, d]
  views of q and k (``qk_norm``, ``qk_norm_whole``; ``norm.qk_norm_rules``).
- NB: the peak's backward transients (``analytic.peak``) follow Llama's RMSNorm, not the Python
  LayerNorm's fp32 buffers.
"""

from __future__ import annotations

from dataclasses import replace

from memplan.blocks.hf.llama import profile as llama_profile
from memplan.blocks.profile import Profile
from memplan.config import Setup


def profile(setup: Setup) -> Profile:
    """Cohere: Llama's code facts and ``CohereLayerNorm``'s Python ops."""
    m = setup.model
    if not (m.parallel_residual and m.shared_norm and not m.norm_bias):
        raise ValueError(
            "shared_norm: Cohere's code has one bias-free LayerNorm per parallel layer; set "
            "parallel_residual and shared_norm true, norm_bias false (norm = 'layernorm')"
        )
    return replace(llama_profile(setup), layernorm_python=True)
