"""transformers' ``modeling_gpt_oss.py`` (5.x): a mixture of experts with attention sinks, eager only
(``GptOssPreTrainedModel._supports_sdpa = False``; ``config.hf_rules.check_hf_only`` refuses SDPA).

Its facts beyond Mixtral's code (``moe.experts``: grouped_mm experts, gate and up one buffer):
- ``GptOssRMSNorm``: ``(self.weight * hidden_states).to(input_dtype)`` multiplies in fp32, so the
  normalised x is kept in fp32 (``Profile.rms_norm_fp32_product``);
- ``GptOssRotaryEmbedding``: cos and sin [s, d/2] (``Profile.rope_half_table``);
- the sinks (``ModelConfig.attn_sinks``): ``attention.sink_rules``;
- ``GptOssTopKRouter``: a biased router, top-k of the logits then a softmax over k
  (``Profile.router_topk_softmax``);
- ``GptOssExperts``: biases gathered per slot (``blocks.moe.dispatch_rules``) and the clamped SwiGLU
  (``blocks.moe.clamped_rules``);
- sliding-window layers alternating with full ones (``layer_types``), as Gemma-2's: the masks are the
  forward's constants under eager attention.

Checked to the byte per layer and in total, FLOPs equal (tests/hf/test_gpt_oss.py). Known limitations:
NB the router's auxiliary loss (``output_router_logits``) is refused at import; NB flash / flex attention
with sinks (kernels) is not modelled.
"""

from __future__ import annotations

from dataclasses import replace

from memplan.blocks.hf import moe
from memplan.blocks.profile import Profile
from memplan.config import Setup


def profile(setup: Setup) -> Profile:
    """gpt-oss: Mixtral-like experts (router weights in the activation dtype) with its own facts."""
    moe.check(setup, shared=False)
    return replace(
        moe.experts(setup), rms_norm_fp32_product=True, rope_half_table=True, router_topk_softmax=True
    )
