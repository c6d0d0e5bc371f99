"""transformers' ``modeling_olmo2.py`` (OLMo-2): Llama's code (``llama.profile``) with the norms moved.
``Olmo2DecoderLayer.forward`` has no pre-norms: attention and the MLP read the residual, and their outputs
are normalised before the add (``post_attention_layernorm``, ``post_feedforward_layernorm``:
``ModelConfig.post_norms`` without ``pre_norms``); ``Olmo2Attention`` normalises q_proj's and k_proj's
whole outputs before the heads' view (``q_norm`` [a·d], ``k_norm`` [kv·d]: ``qk_norm_whole``).

Checked to the byte per layer and in total, FLOPs per phase equal (tests/hf/test_olmo2.py). Known
limitations:
- The layer backward's moments around the post norms and the whole-width q/k norms:
``analytic.moments.post_norms``
  (exact at 7B's widths but for the fp32 rotary tables layer 0's rotary backward frees:
  tests/hf/test_post_norms_peak.py).
"""

from __future__ import annotations

from dataclasses import replace

from memplan.blocks.hf.llama import profile as llama_profile
from memplan.blocks.profile import Profile
from memplan.config import Setup


def profile(setup: Setup) -> Profile:
    """OLMo-2: ``Olmo2RMSNorm.forward`` returns ``(self.weight * hidden_states).to(input_dtype)``: the
    weight multiplies the fp32 normalised x, so the product keeps it in fp32 (``rms_norm_fp32_product``)
    — every norm: the q/k norms, the post norms and the final norm. ``Olmo2RotaryEmbedding`` keeps its
    tables in fp32 (``rope_fp32_tables``)."""
    return replace(llama_profile(setup), rms_norm_fp32_product=True, rope_fp32_tables=True)
