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
- The norms' backward moments (``analytic.peak``) are the Python LayerNorm's fp32 pieces where its weight
  trains (``norm.python_layernorm_backward``): the final norm's and the layer's exact at Command R's widths
  (s 512) without and with full checkpointing but for ``hf_peak``'s known NBs (tests/hf/test_cohere_peak.py).
  NB: a frozen norm's (LoRA) is read as native layer_norm's dY and dX: not measured.
- The rotary embedding runs in fp32 (``Profile.rope_fp32_interleaved``): its backward tops the layer at
  long sequences and narrow widths (``analytic.moments.rotary_backward``; exact at Command R's widths,
  s 4,096 and 8,192, and at h 64, s 64: tests/hf/test_cohere_peak.py).
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
    return replace(llama_profile(setup), layernorm_python=True, rope_fp32_interleaved=True)
