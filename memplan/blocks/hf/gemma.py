"""transformers' ``modeling_gemma.py`` and ``modeling_gemma2.py``: Llama's code (``llama.windowed``) with
GeGLU (``ModelConfig.gate_act``), an embedding scaled by √h and an RMSNorm that applies (1 + w) in fp32.
Gemma-2 adds structure, not code facts: ``post_norms``, ``attn_softcap`` / ``final_softcap`` (the
blocks' rules) and alternating sliding-window layers (``sliding_window_pattern``); Gemma-3 (text) the
per-head ``qk_norm`` and a second rotary base.

Checked to the byte per layer and in total, FLOPs per phase equal (tests/hf/test_gemma*.py), except:
- NB: under fake tensors transformers cannot skip SDPA's causal mask, and a checkpoint keeps a bool
  [b, 1, s, s] per mask kind that the real run (``is_causal``) has not: not counted (1.0002–1.0005× in
  total at the tests' sizes; ``constants.checkpointed_mask_rule``).
- The post norms' backward (``analytic.moments.post_norms``), the final norm's fp32 (1 + w) freed before its
peak
  and a layer kind's mask and rotary tables freed below its lowest layer (``constants.released_below``):
  the moments exact at Gemma 7B's, Gemma-2 2B's and Gemma-3 1B's widths (tests/hf/test_post_norms_peak.py)
  but for the bf16 ``embed_scale`` buffer (−2 B: the estimate's normaliser save, a buffer measured apart).
  NB: the per-head q/k norms' and the softcaps' tanh backward are not moments of their own.
- SDPA with a window ≤ seq on alternating layers: only the sliding layers keep SDPA's mask and k, v
  repeated; the saves differ by layer kind (``attention.full_layer_setup``, tests/hf/test_gemma3_windows.py).
"""

from __future__ import annotations

from dataclasses import replace

from memplan.blocks.hf.llama import windowed
from memplan.blocks.profile import Profile
from memplan.config import Setup


def profile(setup: Setup) -> Profile:
    """Gemma: ``GemmaRMSNorm.forward`` (``output * (1.0 + self.weight.float())``) and
    ``GemmaModel.forward`` (``hidden_states * normalizer``, a 0-dim tensor)."""
    return replace(windowed(setup), norm_fp32_affine=True, embed_scale_tensor=True)


def profile3(setup: Setup) -> Profile:
    """Gemma-3 (``modeling_gemma3.py``, text): Gemma's facts (``Gemma3TextScaledWordEmbedding`` multiplies
    by ``embed_scale.to(dtype)``, a 0-dim tensor) and a rotary table pair per layer type."""
    return replace(profile(setup), rope_per_layer_type=True)
