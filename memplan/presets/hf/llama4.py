"""Llama 4's text model from a Hugging Face config.json (``model_type`` llama4_text, or the multimodal
``llama4`` whose ``text_config`` it is): transformers' ``Llama4TextConfig`` (5.x) read into memplan's fields.

What its keys mean (``configuration_llama4.py``, ``modeling_llama4.py``):
- ``num_local_experts`` routed experts of ``intermediate_size`` and one shared expert as wide
  (``Llama4TextMoe.shared_expert = Llama4TextMLP(config)``); the router h→E without a bias picks
  ``num_experts_per_tok`` and scales each expert's input by the sigmoid of its logit
  (``MoEConfig.router_sigmoid``);
- ``interleave_moe_layer_step`` n: layers n−1, 2n−1, … are MoE (``moe_layers``' default), the others dense
  SwiGLU MLPs ``intermediate_size_mlp`` wide (``ModelConfig.moe_every``, ``dense_ffn_size``);
- ``no_rope_layer_interval`` n: every n-th layer has no RoPE (``no_rope_layers``' default,
  ``ModelConfig.nope_every``); the RoPE layers attend in chunks of ``attention_chunk_size``
  (``layer_types``' default, ``ModelConfig.attn_chunk``) and, with ``use_qk_norm``, normalise q and k
  without a weight (``qk_l2_norm``); with ``attn_temperature_tuning`` the NoPE layers scale q by position
  (``attn_temperature``).

Known limitations (refused in one line, never ignored): explicit ``moe_layers``, ``no_rope_layers`` or
``layer_types`` of another pattern than their defaults; ``output_router_logits`` (the auxiliary loss).
NB ``rope_scaling`` (llama3 type), ``floor_scale`` and ``attn_scale`` change values only, no tensor or
parameter; NB the vision tower of a multimodal config is not counted (text model only).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from memplan.config import MlpType, NormType, PositionType
from memplan.presets.hf.family import Family, Fields
from memplan.presets.hf.keys import flag, integer, number


def llama4_fields(cfg: Mapping[str, Any], layers: int) -> dict[str, Any]:
    """memplan's fields for a ``Llama4TextConfig`` (its defaults for keys the file omits)."""
    if flag(cfg, "output_router_logits", False):
        raise ValueError(
            "output_router_logits: the router's auxiliary (load-balancing) loss is not modelled; "
            "set it false in config.json"
        )
    step = integer(cfg, "interleave_moe_layer_step", default=1) or 1
    nope = integer(cfg, "no_rope_layer_interval", default=4) or 4
    chunk = integer(cfg, "attention_chunk_size", default=8192)
    _check_pattern(cfg, "moe_layers", list(range(step - 1, layers, step)))
    rope = [int((i + 1) % nope != 0) for i in range(layers)]
    _check_pattern(cfg, "no_rope_layers", rope)
    kinds = ["chunked_attention" if r and chunk is not None else "full_attention" for r in rope]
    _check_pattern(cfg, "layer_types", kinds)
    attn = flag(cfg, "attention_bias", False)
    moe = {
        "experts": integer(cfg, "num_local_experts", default=16),
        "top_k": integer(cfg, "num_experts_per_tok", default=1),
        "shared_experts": 1,  # Llama4TextMoe.shared_expert: one Llama4TextMLP of intermediate_size
        "norm_topk_prob": False,  # sigmoid scores, not renormalised
        "router_sigmoid": True,
    }
    fields: dict[str, Any] = {
        "ffn_size": integer(cfg, "intermediate_size", default=8192),
        "moe": moe,
        "qkv_bias": attn,
        "out_bias": attn,
        "mlp_bias": False,
        "rope_theta": number(cfg, "rope_theta", default=500000.0),
        "nope_every": nope if 0 in rope else None,
        "attn_chunk": chunk if any(k == "chunked_attention" for k in kinds) else None,
        "qk_l2_norm": flag(cfg, "use_qk_norm", True),
        # a bool, as Llama4TextConfig (5.x, strict) types it: the 4 of early published files is refused
        "attn_temperature": flag(cfg, "attn_temperature_tuning", True) and 0 in rope,
    }
    if step > 1:
        fields.update(moe_every=step, dense_ffn_size=integer(cfg, "intermediate_size_mlp", default=16384))
    return fields


def _check_pattern(cfg: Mapping[str, Any], key: str, default: list[Any]) -> None:
    """An explicit per-layer list equal to what its interval gives (an empty or absent one is that)."""
    given = cfg.get(key)
    if given and list(given) != default:
        raise ValueError(f"{key}: only the default pattern is modelled for llama4_text; drop {key}")


LLAMA4_NOTE = (
    "sigmoid-scaled experts (every token through every expert in transformers' code), NoPE layers, "
    "chunked attention and weightless q/k norms: --impl hf only"
)
"""The import's caveat for the preset's notes."""


def _llama4(cfg: Mapping[str, Any], fields: Fields) -> Fields:
    return llama4_fields(cfg, fields["num_layers"])


FAMILIES = {
    "llama4_text": Family(
        NormType.RMSNORM,
        MlpType.SWIGLU,
        PositionType.ROPE,
        tied=False,
        eps=1e-5,
        max_pos=4096 * 32,
        extra=_llama4,
        note=LLAMA4_NOTE,
    ),
}
"""Llama 4's reader (Llama4TextConfig's defaults), by ``model_type``."""
