"""Multi-head latent attention (DeepSeek-V2 §2.1, arXiv:2405.04434; transformers' ``DeepseekV2Attention`` /
``DeepseekV3Attention``): queries through a low-rank bottleneck, keys and values from one compressed latent
shared by every head, and a rotary part of the key shared across heads.

Per layer, with a heads, r_q = ``q_lora_rank``, r_kv = ``kv_lora_rank``, d_n = ``qk_nope_head_dim``,
d_r = ``qk_rope_head_dim`` (the model's ``head_dim``: what RoPE rotates), d_v = ``v_head_dim``:
- q: ``q_a_proj`` h→r_q, ``q_a_layernorm`` (RMSNorm r_q), ``q_b_proj`` r_q→a·(d_n + d_r); or, with
  ``q_lora_rank`` none (DeepSeek-V2-Lite), one ``q_proj`` h→a·(d_n + d_r);
- k, v: ``kv_a_proj_with_mqa`` h→r_kv + d_r (the latent and the shared rotary key), ``kv_a_layernorm``
  (RMSNorm r_kv), ``kv_b_proj`` r_kv→a·(d_n + d_v);
- o: ``o_proj`` a·d_v→h.
Known limitations: NB the softmax scale (YaRN's mscale) changes values only.
"""

from __future__ import annotations

from pydantic import Field

from memplan.config._base import Frozen


class MLAConfig(Frozen):
    """The widths of multi-head latent attention (``[model.mla]`` in a preset file)."""

    q_lora_rank: int | None = Field(
        strict=True, default=None, gt=0, description="query bottleneck r_q; none: one q_proj h→a·(d_n + d_r)"
    )
    kv_lora_rank: int = Field(strict=True, gt=0, description="compressed key/value latent r_kv")
    qk_nope_head_dim: int = Field(strict=True, gt=0, description="per-head query/key width without RoPE d_n")
    qk_rope_head_dim: int = Field(strict=True, gt=0, description="per-head rotary width d_r (= head_dim)")
    v_head_dim: int = Field(strict=True, gt=0, description="per-head value width d_v")

    @property
    def qk_head_dim(self) -> int:
        """Width of each head's query and key, d_n + d_r."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim
