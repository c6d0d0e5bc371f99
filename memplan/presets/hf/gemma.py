"""The Gemma family: Gemma, Gemma-2 and Gemma-3's text model (``gemma3_text``, or a multimodal
``gemma3`` config's ``text_config``).

Known limitations:
- Gemma's MLP is GeGLU: swiglu's three h×ffn matrices with ``gate_act`` gelu_tanh; its embedding is scaled
  by √h (``embed_scale``).
- Gemma-2 / Gemma-3 import post norms, softcaps, the query scalar, sliding layers with every n-th full
  (other ``layer_types`` refused), Gemma-3's q/k norms and local rotary base; NB rope_scaling is ignored;
  NB a multimodal config's vision tower is not counted.
"""

from __future__ import annotations

from memplan.config import GateActivation, MlpType, NormType, PositionType
from memplan.presets.hf.family import Family, Fields, llama_biases
from memplan.presets.hf.keys import Cfg, integer, nullable, number

_GEGLU = ("gelu", "gelu_pytorch_tanh")
"""Gemma's GeGLU gates: ``GemmaConfig`` turns the legacy "gelu" into "gelu_pytorch_tanh" (Gemma-2/3's
configs name ``hidden_activation`` only)."""


def _gemma(cfg: Cfg, fields: Fields) -> Fields:
    """GeGLU's tanh-GELU gate and the √h-scaled embedding (every Gemma)."""
    return {"gate_act": GateActivation.GELU_TANH, "embed_scale": True}


def _gemma2_fields(gemma3: bool, cfg: Cfg, layers: int) -> Fields:
    """Gemma-2's and Gemma-3's structure, defaults as ``Gemma2Config`` / ``Gemma3TextConfig``: post norms,
    the query scalar, the softcaps (Gemma-3: none), sliding-window layers with every n-th one full
    (``layer_types``; Gemma-2 every 2nd, Gemma-3 ``sliding_window_pattern``, 6); Gemma-3's q/k norms and
    its sliding layers' rotary base."""
    every = integer(cfg, "sliding_window_pattern", default=6) if gemma3 else 2
    assert every is not None  # a default is given
    pattern = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    if cfg.get("layer_types") not in (None, pattern):
        raise ValueError(f"layer_types: only every {every}th layer full is modelled; drop layer_types")
    window = integer(cfg, "sliding_window", default=4096)
    fields = {
        "post_norms": True,
        "query_pre_attn_scalar": integer(cfg, "query_pre_attn_scalar", default=256),
        "attn_softcap": nullable(cfg, "attn_logit_softcapping", None if gemma3 else 50.0),
        "final_softcap": nullable(cfg, "final_logit_softcapping", None if gemma3 else 30.0),
        "sliding_window": window,
        "sliding_window_pattern": every if window else None,
    }
    if gemma3:
        fields |= {
            "qk_norm": True,
            "rope_theta": number(cfg, "rope_theta", default=1_000_000.0),
            "rope_local_theta": number(cfg, "rope_local_base_freq", default=10_000.0),
        }
    return fields


def _gemma2(cfg: Cfg, fields: Fields) -> Fields:
    return {**_gemma(cfg, fields), **_gemma2_fields(False, cfg, fields["num_layers"])}


def _gemma3(cfg: Cfg, fields: Fields) -> Fields:
    return {**_gemma(cfg, fields), **_gemma2_fields(True, cfg, fields["num_layers"])}


_RMS, _SWIGLU, _ROPE = NormType.RMSNORM, MlpType.SWIGLU, PositionType.ROPE
_LATER = "post norms, softcapping and alternating sliding-window layers: --impl hf only"
FAMILIES = {
    "gemma": Family(
        _RMS,
        _SWIGLU,
        _ROPE,
        tied=True,
        eps=1e-6,
        max_pos=8192,
        biases=llama_biases,
        extra=_gemma,
        gates=_GEGLU,
        note="GeGLU MLP (swiglu's matrices, tanh-GELU gate) and a √h-scaled embedding",
    ),
    "gemma2": Family(
        _RMS, _SWIGLU, _ROPE, tied=True, eps=1e-6, max_pos=8192, extra=_gemma2, gates=_GEGLU[1:], note=_LATER
    ),
    "gemma3_text": Family(
        _RMS,
        _SWIGLU,
        _ROPE,
        tied=True,
        eps=1e-6,
        max_pos=131072,
        extra=_gemma3,
        gates=_GEGLU[1:],
        note=_LATER,
    ),
}
"""The Gemma family's readers, by ``model_type``."""
