"""DeepSeek-V2 and DeepSeek-V3 ``config.json`` files (``model_type`` deepseek_v2 / deepseek_v3) as a
``ModelConfig``: multi-head latent attention (``[model.mla]``), fine-grained routed experts with shared
ones, the first ``first_k_dense_replace`` layers dense, and DeepSeek's routers. Defaults for absent keys
are transformers' ``DeepseekV2Config`` / ``DeepseekV3Config`` (5.x).

Known limitations (none changes the parameter count):
- NB ``routed_scaling_factor``, YaRN's ``rope_scaling`` (and its softmax ``mscale``) and V3's
  ``e_score_correction_bias`` (a buffer, not a parameter) change values only; named in the notes;
- NB DeepSeek-V3's multi-token-prediction module (``num_nextn_predict_layers``) is not part of
  transformers' ``DeepseekV3ForCausalLM``: neither counted nor estimated (the notes say so);
- DeepSeek-V2's ``norm_topk_prob`` is read but its transformers code never renormalises: imported false;
- a V2 ``topk_method`` other than greedy / group_limited_greedy, an ``output_router_logits`` (the
  auxiliary loss), V2's ``mlp_bias`` (biases on the dense and shared MLPs, not the experts) and kv heads
  other than the heads are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from memplan.presets.hf.keys import first, flag, integer, number, required

_DEFAULTS = {
    # DeepseekV2Config / DeepseekV3Config class defaults (configuration_deepseek_v{2,3}.py)
    "deepseek_v2": {"heads": 32, "experts": 64, "shared": 2, "dense": 0, "moe_ffn": 1407, "ffn": 11008},
    "deepseek_v3": {"heads": 128, "experts": 256, "shared": 1, "dense": 3, "moe_ffn": 2048, "ffn": 18432},
}


def deepseek_fields(cfg: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The ``ModelConfig`` fields of a DeepSeek config.json (module docstring)."""
    kind = str(cfg["model_type"])
    v3, d = kind == "deepseek_v3", _DEFAULTS[kind]
    _refuse(kind, cfg)
    heads = integer(cfg, "num_attention_heads", default=d["heads"])
    assert heads is not None
    kv = integer(cfg, "num_key_value_heads", default=heads)
    if kv != heads:
        raise ValueError(f"num_key_value_heads: MLA expands its latent to every head; set it to {heads}")
    rope = integer(cfg, "qk_rope_head_dim", default=64)
    bias = flag(cfg, "attention_bias", False)
    _, theta = first(cfg, ("rope_theta",))
    params = cfg.get("rope_parameters")
    if theta is None and isinstance(params, Mapping):
        theta = params.get("rope_theta")
    return {
        "name": name,
        "family": kind,
        "hidden_size": required(cfg, "hidden_size"),
        "num_layers": required(cfg, "num_hidden_layers"),
        "num_heads": heads,
        "num_kv_heads": heads,
        "head_dim": rope,
        "ffn_size": integer(cfg, "moe_intermediate_size", default=d["moe_ffn"]),
        "vocab_size": required(cfg, "vocab_size"),
        "tied_embeddings": flag(cfg, "tie_word_embeddings", False),
        "norm_eps": number(cfg, "rms_norm_eps", default=1e-6),
        "qkv_bias": bias,
        "out_bias": bias,
        "max_positions": integer(cfg, "max_position_embeddings", default=4096 if v3 else 2048),
        "rope_theta": float(theta) if isinstance(theta, int | float) else 10000.0,
        "attn_dropout": number(cfg, "attention_dropout", default=0.0),
        "mla": {
            "q_lora_rank": integer(cfg, "q_lora_rank", default=None) if "q_lora_rank" in cfg else 1536,
            "kv_lora_rank": integer(cfg, "kv_lora_rank", default=512),
            "qk_nope_head_dim": integer(cfg, "qk_nope_head_dim", default=128),
            "qk_rope_head_dim": rope,
            "v_head_dim": integer(cfg, "v_head_dim", default=128),
        },
        "moe": _moe(kind, cfg),
    }


def _moe(kind: str, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The routed and shared experts, the dense first layers and the router (module docstring)."""
    v3, d = kind == "deepseek_v3", _DEFAULTS[kind]
    dense = integer(cfg, "first_k_dense_replace", default=d["dense"]) or 0
    moe: dict[str, Any] = {
        "experts": integer(cfg, "n_routed_experts", default=d["experts"]),
        "top_k": integer(cfg, "num_experts_per_tok", default=8 if v3 else None),
        "shared_experts": integer(cfg, "n_shared_experts", default=d["shared"]),
        "dense_layers": dense,
        # V2's router never divides by the sum (DeepseekV2TopkRouter.forward); V3's when norm_topk_prob.
        "norm_topk_prob": flag(cfg, "norm_topk_prob", True) if v3 else False,
    }
    if moe["top_k"] is None:
        raise ValueError("num_experts_per_tok: missing; add it to config.json (DeepseekV2Config has none)")
    if dense:
        moe["dense_ffn"] = integer(cfg, "intermediate_size", default=d["ffn"])
    if v3:
        moe |= {"scoring": "sigmoid", "groups": integer(cfg, "n_group", default=8)}
        moe["topk_groups"] = integer(cfg, "topk_group", default=4)
    elif cfg.get("topk_method", "greedy") == "group_limited_greedy":
        moe |= {"groups": required(cfg, "n_group"), "topk_groups": required(cfg, "topk_group")}
    return moe


def _refuse(kind: str, cfg: Mapping[str, Any]) -> None:
    """What DeepSeek's transformers code has that memplan does not model: one line each."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act: {act!r} is not modelled for model_type {kind}; use silu")
    if flag(cfg, "output_router_logits", False):
        raise ValueError("output_router_logits: the router's auxiliary loss is not modelled; set it false")
    if flag(cfg, "mlp_bias", False):  # DeepseekV2MLP's biases, not its experts': not modelled
        raise ValueError("mlp_bias: biases on the dense and shared MLPs only are not modelled; set it false")
    method = cfg.get("topk_method")
    if kind == "deepseek_v2" and method not in (None, "greedy", "group_limited_greedy"):
        raise ValueError(
            f"topk_method: {method!r} is not in transformers' DeepseekV2TopkRouter; use greedy or "
            "group_limited_greedy"
        )


def deepseek_notes(cfg: Mapping[str, Any]) -> list[str]:
    """The caveats of a DeepSeek import, for ``ModelPreset.notes``."""
    notes = ["multi-head latent attention, fine-grained + shared experts, dense first layers: --impl hf only"]
    if cfg.get("model_type") == "deepseek_v3":
        mtp = integer(cfg, "num_nextn_predict_layers", default=0)
        notes.append("sigmoid router with group-limited top-k (e_score_correction_bias: a buffer)")
        if mtp:
            notes.append(
                f"its {mtp} MTP layer(s) (num_nextn_predict_layers) are not in transformers' model: "
                "not counted"
            )
    notes.append(f"routed_scaling_factor {number(cfg, 'routed_scaling_factor', default=1.0):g} keeps nothing")
    if cfg.get("rope_scaling"):
        notes.append("YaRN rope_scaling changes values only")
    return notes


class DeepSeek:
    """DeepSeek's reader: MLA and dense first layers read whole, not through ``Family``'s shared keys."""

    def fields(self, kind: str, cfg: Mapping[str, Any], name: str) -> dict[str, Any]:
        return deepseek_fields(cfg, name)

    def notes(self, kind: str, cfg: Mapping[str, Any]) -> list[str]:
        return deepseek_notes(cfg)


READERS = {"deepseek_v2": DeepSeek(), "deepseek_v3": DeepSeek()}
"""DeepSeek-V2's and -V3's readers, by ``model_type``."""
