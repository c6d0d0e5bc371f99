"""The llama-likes: decoders with Llama's layout (RMSNorm, SwiGLU, RoPE) and their variations —
Llama, Mistral, Qwen2, Qwen3, Phi-3, Granite, GLM-4 (``glm``) and OLMo-2.

Known limitations (none changes the parameter count):
- NB: ``rope_scaling`` (Llama 3.1, YaRN, …) is not modelled (values only; named in the notes).
- Qwen2/Qwen3 configs whose sliding window covers only the layers from ``max_window_layers`` on
  (``use_sliding_window``) import the first ones as ``full_layers``; another ``layer_types`` is refused.
- NB: Phi-3 fuses qkv and gate/up into single matrices; the parameter count equals the separate layout's
  (what is kept: ``--impl hf``'s profile, blocks/hf/phi3.py); a partially rotated Phi-3 (Phi-4-mini's
  ``partial_rotary_factor`` < 1) is refused.
- Granite's multipliers (``embedding_multiplier``, ``attention_multiplier``, ``residual_multiplier``,
  ``logits_scaling``) are read into the notes: scalar multiplies that change no byte and no FLOP.
- GLM-4 (``glm``) imports its partial rotary (``partial_rotary_factor``, default 0.5); its fused
  gate_up is counted as separate matrices (same parameter count).
- OLMo-2 imports its post-norm-only layout and whole-width q/k norms (``pre_norms`` false,
  ``qk_norm_whole``): modelled for ``--impl hf`` only.
"""

from __future__ import annotations

from memplan.config import MlpType, NormType, PositionType
from memplan.presets.hf.family import Family, Fields, attention_biases, llama_biases, qkv_biases, qwen2_biases
from memplan.presets.hf.keys import Cfg, integer, number, partial_rotary
from memplan.presets.hf.windows import config_window, sliding_window

_RMS, _SWIGLU, _ROPE = NormType.RMSNORM, MlpType.SWIGLU, PositionType.ROPE


def _mistral(cfg: Cfg, fields: Fields) -> Fields:
    """Mistral's sliding window (``windows.sliding_window``: default 4096, null for none)."""
    return {"sliding_window": sliding_window("mistral", cfg, fields["num_layers"])}


def _qwen2_layer_types(kind: str, cfg: Cfg, fields: Fields) -> Fields:
    """Qwen2's / Qwen3's sliding window and their full layers below ``max_window_layers``
    (``full_layers``: layer i slides when i ≥ max_window_layers, ``Qwen2Config.layer_types``); an explicit
    ``layer_types`` of another pattern is refused."""
    layers = fields["num_layers"]
    window = sliding_window(kind, cfg, layers)
    first = integer(cfg, "max_window_layers", default=28) or 0
    kinds = [
        "sliding_attention" if window is not None and i >= first else "full_attention" for i in range(layers)
    ]
    if cfg.get("layer_types") not in (None, kinds):
        raise ValueError(
            "layer_types: only the layers from max_window_layers on sliding is modelled; drop layer_types"
        )
    full = {"full_layers": first} if window is not None and 0 < first < layers else {}
    return {"sliding_window": window, **full}


def _qwen2(cfg: Cfg, fields: Fields) -> Fields:
    return _qwen2_layer_types("qwen2", cfg, fields)


def _qwen3(cfg: Cfg, fields: Fields) -> Fields:
    """Qwen2's windows and ``Qwen3Attention``'s q_norm / k_norm."""
    return {**_qwen2_layer_types("qwen3", cfg, fields), "qk_norm": True}


def _phi3_check(cfg: Cfg) -> None:
    """Phi-3's partial rotary (``partial_rotary_factor`` < 1, Phi-4-mini: ``Phi3Attention`` rotates a slice
    of each head and concatenates the rest) is refused, not silently dropped."""
    factor = partial_rotary(cfg, "partial_rotary_factor", default=1.0)
    if factor != 1.0:
        raise ValueError(
            f"partial_rotary_factor: {factor:g} (a partially rotated Phi-3) is not modelled for "
            "model_type phi3; use a config with partial_rotary_factor 1"
        )


def _glm(cfg: Cfg, fields: Fields) -> Fields:
    """GlmConfig: partial_rotary_factor 0.5 by default, head_dim 128, 2 kv heads."""
    return {
        "rotary_pct": partial_rotary(cfg, "partial_rotary_factor", default=0.5),
        "head_dim": integer(cfg, "head_dim", default=128),
        "num_kv_heads": integer(cfg, "num_key_value_heads", default=2),
    }


def _olmo2(cfg: Cfg, fields: Fields) -> Fields:
    """Olmo2DecoderLayer: post norms only; Olmo2Attention: q/k norms over a·d, kv·d."""
    return {"post_norms": True, "pre_norms": False, "qk_norm": True, "qk_norm_whole": True}


_GRANITE_MULTIPLIERS = {
    "embedding_multiplier": "embedding ×",
    "attention_multiplier": "attention scale ",
    "residual_multiplier": "residual branches ×",
    "logits_scaling": "logits ÷",
}
"""GraniteConfig's multipliers (default 1.0 each), read and named in the notes."""


def _granite_note(cfg: Cfg) -> str:
    """Granite's multipliers as read: Python-float multiplies that keep nothing and count no FLOPs
    (``blocks.hf.llama.granite``)."""
    values = [f"{what}{number(cfg, key, default=1.0):g}" for key, what in _GRANITE_MULTIPLIERS.items()]
    return f"multipliers ({', '.join(values)}) keep no tensor and add no counted FLOPs"


FAMILIES = {
    "llama": Family(
        _RMS, _SWIGLU, _ROPE, tied=False, eps=1e-6, max_pos=2048, biases=llama_biases, own_code=False
    ),
    "mistral": Family(_RMS, _SWIGLU, _ROPE, tied=False, eps=1e-6, max_pos=4096 * 32, extra=_mistral),
    "qwen2": Family(
        _RMS, _SWIGLU, _ROPE, tied=False, eps=1e-6, max_pos=32768, biases=qwen2_biases, extra=_qwen2
    ),
    "qwen3": Family(
        _RMS, _SWIGLU, _ROPE, tied=False, eps=1e-6, max_pos=32768, biases=llama_biases, extra=_qwen3
    ),
    "phi3": Family(
        _RMS,
        _SWIGLU,
        _ROPE,
        tied=False,
        eps=1e-5,
        max_pos=4096,
        check=_phi3_check,
        extra=config_window,
        note="fused qkv and gate_up projections counted as separate (same parameter count)",
    ),
    "granite": Family(
        _RMS, _SWIGLU, _ROPE, tied=False, eps=1e-6, max_pos=2048, biases=llama_biases, note=_granite_note
    ),
    "glm": Family(
        _RMS,
        _SWIGLU,
        _ROPE,
        tied=False,
        eps=1.5625e-7,
        max_pos=131072,
        biases=qkv_biases("attention_bias", True),  # GlmAttention: q, k, v; o_proj and the MLP none
        extra=_glm,
        note="partial interleaved rotary and fused gate_up: --impl hf only (same parameter count)",
    ),
    "olmo2": Family(
        _RMS,
        _SWIGLU,
        _ROPE,
        tied=False,
        eps=1e-5,
        max_pos=2048,
        biases=attention_biases(False),  # Olmo2Attention: q, k, v and o; Olmo2MLP: none
        extra=_olmo2,
        note="post norms only and q/k norms over the whole projections: --impl hf only",
    ),
}
"""The llama-likes' readers, by ``model_type``."""
