"""Mixtures of experts read into ``ModelConfig.moe``, with ``ffn_size`` the width of one routed expert:
Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss and PhiMoE (Llama 4: llama4.py; DeepSeek: deepseek.py). Their
routers' auxiliary loss (``output_router_logits``) is refused (``Family.moe``).

Known limitations (none changes the parameter count):
- NB: Qwen2-MoE / Qwen3-MoE / gpt-oss configs with ``decoder_sparse_step`` ≠ 1 or ``mlp_only_layers``
  (dense layers between MoE ones) are refused, not modelled.
- Qwen3-MoE: Qwen2-MoE's experts without the shared one, Qwen3's q/k norms; its sliding window, with
  ``use_sliding_window``, covers every layer (``Qwen3MoeConfig``: no ``max_window_layers``).
- gpt-oss: attention sinks, a biased router, clamped SwiGLU experts with biases, sliding layers
  alternating with full ones (``layer_types``, another pattern refused); NB ``swiglu_limit`` /
  ``swiglu_alpha`` change values only; NB its YaRN ``rope_scaling`` is ignored (no bytes).
- PhiMoE: LayerNorms with bias (its ``rms_norm_eps`` their eps), ``attention_bias`` on q/k/v/o,
  ``lm_head_bias`` (``head_bias``), ``input_jitter_noise`` (``moe.input_jitter``); ``router_jitter_noise``
  is sparsemixer's threshold, values only; ``num_experts_per_tok`` ≠ 2 is refused (sparsemixer routes to
  two experts whatever it says); its longrope ``rope_scaling`` is read into ``ModelConfig.rope_scaling``.
"""

from __future__ import annotations

from memplan.config import GateActivation, MlpType, NormType, PositionType
from memplan.presets.hf.family import Family, Fields, attention_biases, llama_biases, qwen2_biases
from memplan.presets.hf.keys import Cfg, flag, integer, number, rope_kind
from memplan.presets.hf.windows import config_window, sliding_window


def _mixtral_moe(cfg: Cfg) -> Fields:
    """``MixtralConfig``'s defaults."""
    moe = {
        "experts": integer(cfg, "num_local_experts", default=8),
        "top_k": integer(cfg, "num_experts_per_tok", default=2),
        "norm_topk_prob": True,  # MixtralSparseMoeBlock always divides by the top-k sum
    }
    return {"ffn_size": integer(cfg, "intermediate_size", default=14336), "moe": moe}


def _phimoe_moe(cfg: Cfg) -> Fields:
    """PhimoeConfig's defaults; sparsemixer picks 2 experts and never renormalises."""
    top_k = integer(cfg, "num_experts_per_tok", default=2)
    if top_k != 2:
        raise ValueError(
            f"num_experts_per_tok: {top_k}, but PhiMoE's sparsemixer always routes to 2 experts; set it to 2"
        )
    moe = {
        "experts": integer(cfg, "num_local_experts", default=16),
        "top_k": 2,
        "norm_topk_prob": False,
        "input_jitter": number(cfg, "input_jitter_noise", default=0.0),
    }
    return {"ffn_size": integer(cfg, "intermediate_size", default=6400), "moe": moe}


def _every_layer_sparse(cfg: Cfg) -> None:
    """Dense layers between MoE layers (``decoder_sparse_step`` ≠ 1, ``mlp_only_layers``) are refused."""
    if integer(cfg, "decoder_sparse_step", default=1) != 1 or cfg.get("mlp_only_layers"):
        raise ValueError(
            "decoder_sparse_step: dense layers between MoE layers are not modelled; "
            "use a config with decoder_sparse_step 1 and no mlp_only_layers"
        )


def _gpt_oss_moe(cfg: Cfg) -> Fields:
    """GptOssConfig's defaults: biased router and experts, softmax over the top-k."""
    _every_layer_sparse(cfg)
    moe = {
        "experts": integer(cfg, "num_local_experts", default=128),
        "top_k": integer(cfg, "num_experts_per_tok", default=4),
        "norm_topk_prob": False,  # the top-k logits' softmax sums to 1 by itself
        "router_bias": True,
        "expert_bias": True,
    }
    return {"ffn_size": integer(cfg, "intermediate_size", default=2880), "moe": moe}


def _qwen3_moe_moe(cfg: Cfg) -> Fields:
    """Qwen3MoeConfig's defaults; no shared expert."""
    _every_layer_sparse(cfg)
    moe = {
        "experts": integer(cfg, "num_experts", default=128),
        "top_k": integer(cfg, "num_experts_per_tok", default=8),
        "norm_topk_prob": flag(cfg, "norm_topk_prob", False),
    }
    return {"ffn_size": integer(cfg, "moe_intermediate_size", default=768), "moe": moe}


def _qwen2_moe_moe(cfg: Cfg) -> Fields:
    """Qwen2MoeConfig's defaults: one gated shared expert unless its width is 0."""
    _every_layer_sparse(cfg)
    shared = integer(cfg, "shared_expert_intermediate_size", default=5632)
    moe = {
        "experts": integer(cfg, "num_experts", default=60),
        "top_k": integer(cfg, "num_experts_per_tok", default=4),
        "shared_experts": 1 if shared else 0,
        "shared_ffn": shared or None,
        "shared_gate": bool(shared),
        "norm_topk_prob": flag(cfg, "norm_topk_prob", False),  # Qwen2MoeConfig's default
    }
    return {"ffn_size": integer(cfg, "moe_intermediate_size", default=1408), "moe": moe}


def _qwen3_moe(cfg: Cfg, fields: Fields) -> Fields:
    """Its sliding window (every layer's, with ``use_sliding_window``) and Qwen3MoeAttention's q/k norms."""
    return {"sliding_window": sliding_window("qwen3_moe", cfg, fields["num_layers"]), "qk_norm": True}


def _gpt_oss(cfg: Cfg, fields: Fields) -> Fields:
    """gpt-oss (``GptOssConfig``): attention sinks, the clamped SwiGLU experts (``swiglu_limit`` and
    ``swiglu_alpha`` change values, not what is kept), sliding-window layers alternating with full ones
    (``layer_types``: layer i slides when (i + 1) % 2, the default; another pattern refused)."""
    pattern = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(fields["num_layers"])]
    if cfg.get("layer_types") not in (None, pattern):
        raise ValueError("layer_types: only every 2nd layer full is modelled for gpt_oss; drop layer_types")
    window = integer(cfg, "sliding_window", default=128)
    return {
        "attn_sinks": True,
        "gate_act": GateActivation.CLAMPED,
        "sliding_window": window,
        "sliding_window_pattern": 2 if window else None,
        "rope_theta": number(cfg, "rope_theta", default=150000.0),
    }


def _phimoe(cfg: Cfg, fields: Fields) -> Fields:
    """PhimoeForCausalLM: nn.Linear(h, v, bias=config.lm_head_bias); its rope_scaling's kind; its window."""
    return {
        "head_bias": flag(cfg, "lm_head_bias", False),
        "rope_scaling": rope_kind(cfg),
        **config_window(cfg, fields),
    }


_RMS, _SWIGLU, _ROPE = NormType.RMSNORM, MlpType.SWIGLU, PositionType.ROPE
FAMILIES = {
    "mixtral": Family(
        _RMS,
        _SWIGLU,
        _ROPE,
        tied=False,
        eps=1e-5,
        max_pos=4096 * 32,
        moe=_mixtral_moe,
        extra=config_window,
        own_code=False,
    ),
    "qwen2_moe": Family(
        _RMS, _SWIGLU, _ROPE, tied=False, eps=1e-6, max_pos=8192, biases=qwen2_biases, moe=_qwen2_moe_moe
    ),
    "qwen3_moe": Family(
        _RMS,
        _SWIGLU,
        _ROPE,
        tied=False,
        eps=1e-6,
        max_pos=32768,
        biases=llama_biases,
        moe=_qwen3_moe_moe,
        extra=_qwen3_moe,
    ),
    "gpt_oss": Family(
        _RMS,
        _SWIGLU,
        _ROPE,
        tied=False,
        eps=1e-5,
        max_pos=131072,
        biases=attention_biases(True),  # GptOssConfig.attention_bias defaults to true: q, k, v and o
        moe=_gpt_oss_moe,
        extra=_gpt_oss,
        note="attention sinks, clamped SwiGLU experts with biases: --impl hf, eager attention only",
    ),
    "phimoe": Family(
        NormType.LAYERNORM,
        _SWIGLU,
        _ROPE,
        tied=False,
        eps=1e-5,
        max_pos=4096 * 32,
        biases=llama_biases,
        moe=_phimoe_moe,
        extra=_phimoe,
        note="sparsemixer router (two sampled experts), LayerNorms, lm head bias: --impl hf only",
        longrope=True,
    ),
}
"""The mixtures of experts' readers, by ``model_type`` (the order of ``MOE_MODEL_TYPES``)."""
