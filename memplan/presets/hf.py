"""Import a Hugging Face ``config.json`` (already parsed to a dict) as a ``ModelConfig``.

Only the numbers are read; no model code is ever imported or executed (no ``trust_remote_code``).
Defaults for absent keys follow the ``transformers`` config class of each ``model_type``.

Mixtures of experts (``mixtral``, ``qwen2_moe``, ``qwen3_moe``) are read into ``ModelConfig.moe``, with
``ffn_size`` the width of one routed expert.

A ``hidden_act`` (``activation_function``, ``hidden_activation``) outside what the family's MLP models is
refused (``_check_activation``): a ReLU llama is an error, not silently SiLU.

Known limitations (none changes the parameter count):
- NB: ``rope_scaling`` (Llama 3.1, YaRN, …) is not modelled (values only); PhiMoE's is read into
  ``ModelConfig.rope_scaling`` and named in the estimate's notes, the other families' only in the preset's
  notes. The sliding window is read for Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE, Phi-3, PhiMoE,
  StarCoder2 and Gemma-2/3.
- PhiMoE: LayerNorms with bias (its ``rms_norm_eps`` their eps), ``attention_bias`` on q/k/v/o,
  ``lm_head_bias`` (``head_bias``), ``input_jitter_noise`` (``moe.input_jitter``); ``router_jitter_noise``
  is sparsemixer's threshold, values only; ``num_experts_per_tok`` ≠ 2 is refused (sparsemixer routes to
  two experts whatever it says).
- Qwen2/Qwen3 configs whose sliding window covers only the layers from ``max_window_layers`` on
  (``use_sliding_window``) import the first ones as ``full_layers``.
- Gemma's MLP is GeGLU: swiglu's three h×ffn matrices with ``gate_act`` gelu_tanh; its embedding is scaled
  by √h (``embed_scale``).
- Gemma-2 / Gemma-3 (``gemma3_text``, or a ``gemma3`` config's ``text_config``: NB the vision tower is
  not counted) import post norms, softcaps, the query scalar, sliding layers with every n-th full (other
  ``layer_types`` refused), Gemma-3's q/k norms and local rotary base; NB rope_scaling is ignored.
- NB: Phi-3 fuses qkv and gate/up into single matrices; the parameter count equals the separate layout's
  (what is kept: ``--impl hf``'s profile, blocks/hf/phi3.py).
- GPT-NeoX's partial rotary (``rotary_pct``, or ``rope_parameters.partial_rotary_factor``; transformers'
  default 0.25) and parallel residual (``use_parallel_residual``, default true) are read; they are modelled
  for ``--impl hf`` (the reference model refuses them). Its one ``hidden_dropout`` is also the embedding's.
- Granite's multipliers (``embedding_multiplier``, ``attention_multiplier``, ``residual_multiplier``,
  ``logits_scaling``) are read into the notes: scalar multiplies that change no byte and no FLOP.
- Cohere imports its parallel layer with one bias-free LayerNorm (``parallel_residual``, ``shared_norm``,
  ``norm_bias`` false; --impl hf only), its optional q/k LayerNorms (``use_qk_norm``) and names
  ``logit_scale`` in the notes.
- StableLM imports its partial rotary and optional parallel layer with one LayerNorm (--impl hf only);
  its ``hidden_dropout`` is after the MLP only; ``qk_layernorm``'s per-head LayerNorms are read.
- GLM-4 (``glm``) imports its partial rotary (``partial_rotary_factor``, default 0.5); its fused
  gate_up is counted as separate matrices (same parameter count).
- Falcon imports multi-query / the new decoder architecture's kv heads and its parallel layer (one norm
  or ``ln_attn`` / ``ln_mlp``); NB ALiBi and ``parallel_attn`` false are refused.
- OLMo-2 imports its post-norm-only layout and whole-width q/k norms (``pre_norms`` false,
  ``qk_norm_whole``): modelled for ``--impl hf`` only.
- NB: Qwen2-MoE / Qwen3-MoE configs with ``decoder_sparse_step`` ≠ 1 or ``mlp_only_layers`` (dense layers
  between MoE ones) are refused, not modelled.
- gpt-oss: attention sinks, a biased router, clamped SwiGLU experts with biases, sliding layers
  alternating with full ones (``layer_types``, another pattern refused); NB ``swiglu_limit`` /
  ``swiglu_alpha`` change values only; NB its YaRN ``rope_scaling`` is ignored (no bytes).
- Qwen3-MoE: Qwen2-MoE's experts without the shared one, Qwen3's q/k norms; its sliding window, with
  ``use_sliding_window``, covers every layer (``Qwen3MoeConfig``: no ``max_window_layers``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from memplan.config import GateActivation, Gelu, MlpType, ModelConfig, NormType, PositionType
from memplan.errors import one_line_validation_error


@dataclass(frozen=True)
class _Family:
    """The fixed layout of a ``model_type`` and the transformers defaults for keys a config may omit."""

    norm: NormType
    mlp: MlpType
    position: PositionType
    tied: bool  # tie_word_embeddings default
    eps: float  # rms_norm_eps / layer_norm_eps default
    max_pos: int  # max_position_embeddings default


_RMS, _LN, _SWIGLU, _GELU = NormType.RMSNORM, NormType.LAYERNORM, MlpType.SWIGLU, MlpType.GELU
_FAMILY = {
    "llama": _Family(_RMS, _SWIGLU, PositionType.ROPE, tied=False, eps=1e-6, max_pos=2048),
    "mistral": _Family(_RMS, _SWIGLU, PositionType.ROPE, tied=False, eps=1e-6, max_pos=4096 * 32),
    "qwen2": _Family(_RMS, _SWIGLU, PositionType.ROPE, tied=False, eps=1e-6, max_pos=32768),
    "qwen3": _Family(_RMS, _SWIGLU, PositionType.ROPE, tied=False, eps=1e-6, max_pos=32768),
    "gemma": _Family(_RMS, _SWIGLU, PositionType.ROPE, tied=True, eps=1e-6, max_pos=8192),
    "gemma2": _Family(_RMS, _SWIGLU, PositionType.ROPE, tied=True, eps=1e-6, max_pos=8192),
    "gemma3_text": _Family(_RMS, _SWIGLU, PositionType.ROPE, tied=True, eps=1e-6, max_pos=131072),
    "phi3": _Family(_RMS, _SWIGLU, PositionType.ROPE, tied=False, eps=1e-5, max_pos=4096),
    "granite": _Family(_RMS, _SWIGLU, PositionType.ROPE, tied=False, eps=1e-6, max_pos=2048),
    "starcoder2": _Family(_LN, _GELU, PositionType.ROPE, tied=True, eps=1e-5, max_pos=4096),
    "cohere": _Family(_LN, _SWIGLU, PositionType.ROPE, tied=True, eps=1e-5, max_pos=8192),
    "stablelm": _Family(_LN, _SWIGLU, PositionType.ROPE, tied=False, eps=1e-5, max_pos=4096),
    "glm": _Family(_RMS, _SWIGLU, PositionType.ROPE, tied=False, eps=1.5625e-7, max_pos=131072),
    "falcon": _Family(_LN, _GELU, PositionType.ROPE, tied=True, eps=1e-5, max_pos=2048),
    "olmo2": _Family(_RMS, _SWIGLU, PositionType.ROPE, tied=False, eps=1e-5, max_pos=2048),
    "gpt_neox": _Family(_LN, _GELU, PositionType.ROPE, tied=False, eps=1e-5, max_pos=2048),
    "gpt2": _Family(_LN, _GELU, PositionType.LEARNED, tied=True, eps=1e-5, max_pos=1024),
    "mixtral": _Family(_RMS, _SWIGLU, PositionType.ROPE, tied=False, eps=1e-5, max_pos=4096 * 32),
    "qwen2_moe": _Family(_RMS, _SWIGLU, PositionType.ROPE, tied=False, eps=1e-6, max_pos=8192),
    "qwen3_moe": _Family(_RMS, _SWIGLU, PositionType.ROPE, tied=False, eps=1e-6, max_pos=32768),
    "gpt_oss": _Family(_RMS, _SWIGLU, PositionType.ROPE, tied=False, eps=1e-5, max_pos=131072),
    "llama4_text": _Family(_RMS, _SWIGLU, PositionType.ROPE, tied=False, eps=1e-5, max_pos=4096 * 32),
    "phimoe": _Family(_LN, _SWIGLU, PositionType.ROPE, tied=False, eps=1e-5, max_pos=4096 * 32),
}
SUPPORTED_MODEL_TYPES = tuple(sorted((*_FAMILY, "deepseek_v2", "deepseek_v3")))  # hf_deepseek.MODEL_TYPES
MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "phimoe")


def _get(cfg: Mapping[str, Any], keys: tuple[str, ...]) -> tuple[str, Any]:
    """The first of ``keys`` present with a non-null value, as (key, value); ('', None) if none is."""
    for key in keys:
        if cfg.get(key) is not None:
            return key, cfg[key]
    return "", None


def _int(cfg: Mapping[str, Any], *keys: str, default: int | None = None) -> int | None:
    key, value = _get(cfg, keys)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key}: expected a whole number, got {value!r}; fix config.json")
    return value


def _req_int(cfg: Mapping[str, Any], *keys: str) -> int:
    value = _int(cfg, *keys)
    if value is None:
        raise ValueError(f"{keys[0]}: missing; add it to config.json (required for the count)")
    return value


def _float(cfg: Mapping[str, Any], *keys: str, default: float) -> float:
    key, value = _get(cfg, keys)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key}: expected a number, got {value!r}; fix config.json")
    return float(value)


def _bool(cfg: Mapping[str, Any], key: str, default: bool) -> bool:
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{key}: expected true or false, got {value!r}; fix config.json")
    return value


def model_type_of(cfg: Mapping[str, Any]) -> str:
    """The config's ``model_type``, checked against the supported families."""
    kind = cfg.get("model_type")
    supported = ", ".join(SUPPORTED_MODEL_TYPES)
    if kind is None:
        raise ValueError(f"model_type: missing; add one of {supported}")
    if not isinstance(kind, str) or kind not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type: {kind!r} is not supported; supported: {supported} "
            "(write a preset .toml for other architectures)"
        )
    return str(kind)


def _biases(kind: str, cfg: Mapping[str, Any]) -> dict[str, bool]:
    """qkv / out / mlp biases per family."""
    if kind == "gpt2":
        return {"qkv_bias": True, "out_bias": True, "mlp_bias": True}
    if kind == "gpt_neox":  # biases on every linear (attention_bias gates the attention ones)
        attn = _bool(cfg, "attention_bias", True)
        return {"qkv_bias": attn, "out_bias": attn, "mlp_bias": True}
    if kind in ("qwen2", "qwen2_moe"):  # q/k/v carry a bias, o_proj and the MLP do not
        return {"qkv_bias": True, "out_bias": False, "mlp_bias": False}
    if kind == "gpt_oss":  # GptOssConfig.attention_bias defaults to true: q, k, v and o
        attn = _bool(cfg, "attention_bias", True)
        return {"qkv_bias": attn, "out_bias": attn, "mlp_bias": False}
    if kind == "starcoder2":  # use_bias on every linear but the lm head
        every = _bool(cfg, "use_bias", True)
        return {"qkv_bias": every, "out_bias": every, "mlp_bias": every}
    if kind == "olmo2":  # Olmo2Attention: attention_bias on q, k, v and o; Olmo2MLP: none
        attn = _bool(cfg, "attention_bias", False)
        return {"qkv_bias": attn, "out_bias": attn, "mlp_bias": False}
    if kind == "falcon":  # FalconConfig.bias on every linear but the lm head
        every = _bool(cfg, "bias", False)
        return {"qkv_bias": every, "out_bias": every, "mlp_bias": every}
    if kind == "glm":  # GlmAttention: attention_bias (default true) on q, k, v; o_proj and the MLP none
        return {"qkv_bias": _bool(cfg, "attention_bias", True), "out_bias": False, "mlp_bias": False}
    if kind == "stablelm":  # use_qkv_bias on q, k, v; o_proj and the MLP none
        return {"qkv_bias": _bool(cfg, "use_qkv_bias", False), "out_bias": False, "mlp_bias": False}
    if kind == "cohere":  # CohereAttention: attention_bias on q, k, v and o; CohereMLP: none
        attn = _bool(cfg, "attention_bias", False)
        return {"qkv_bias": attn, "out_bias": attn, "mlp_bias": False}
    if kind in ("llama", "gemma", "qwen3", "qwen3_moe", "granite", "phimoe"):  # attention_bias: q, k, v, o
        attn = _bool(cfg, "attention_bias", False)
        return {"qkv_bias": attn, "out_bias": attn, "mlp_bias": _bool(cfg, "mlp_bias", False)}
    return {"qkv_bias": False, "out_bias": False, "mlp_bias": False}  # mistral, mixtral, phi3


def _dropouts(kind: str, cfg: Mapping[str, Any]) -> dict[str, float]:
    if kind == "gpt_neox":  # GPTNeoXModel.emb_dropout = nn.Dropout(config.hidden_dropout)
        hidden = _float(cfg, "hidden_dropout", default=0.0)
        attn = _float(cfg, "attention_dropout", default=0.0)
        return {"attn_dropout": attn, "resid_dropout": hidden, "embd_dropout": hidden}
    if kind == "falcon":  # dropout_add(mlp_output, residual, hidden_dropout): once per layer
        return {
            "attn_dropout": _float(cfg, "attention_dropout", default=0.0),
            "resid_dropout": _float(cfg, "hidden_dropout", default=0.0),
            "embd_dropout": 0.0,
        }
    if kind == "stablelm":  # StableLmConfig: hidden_dropout after the MLP only (blocks.hf.llama.stablelm)
        return {
            "attn_dropout": _float(cfg, "attention_dropout", default=0.0),
            "resid_dropout": _float(cfg, "hidden_dropout", default=0.0),
            "embd_dropout": 0.0,
        }
    if kind == "starcoder2":  # Starcoder2Config: residual_dropout after W_O and c_proj, embedding_dropout
        return {
            "attn_dropout": _float(cfg, "attention_dropout", default=0.0),
            "resid_dropout": _float(cfg, "residual_dropout", default=0.0),
            "embd_dropout": _float(cfg, "embedding_dropout", default=0.0),
        }
    if kind == "gpt2":
        return {
            "attn_dropout": _float(cfg, "attn_pdrop", default=0.1),
            "resid_dropout": _float(cfg, "resid_pdrop", default=0.1),
            "embd_dropout": _float(cfg, "embd_pdrop", default=0.1),
        }
    return {
        "attn_dropout": _float(cfg, "attention_dropout", "attn_pdrop", default=0.0),
        "resid_dropout": _float(cfg, "hidden_dropout", "resid_pdrop", default=0.0),
        "embd_dropout": _float(cfg, "embd_pdrop", default=0.0),
    }


_ACTIVATIONS = {MlpType.SWIGLU: ("silu", "swish"), MlpType.GELU: tuple(g.value for g in Gelu)}
"""The ``hidden_act`` values each MLP type models."""
_GEGLU = ("gelu", "gelu_pytorch_tanh")
"""Gemma's GeGLU gates: ``GemmaConfig`` turns the legacy "gelu" into "gelu_pytorch_tanh"."""
_GEGLUS = {"gemma": _GEGLU, "gemma2": _GEGLU[1:], "gemma3_text": _GEGLU[1:]}
"""The GeGLU gates of each Gemma (Gemma-2/3's configs name ``hidden_activation`` only)."""


def _check_activation(kind: str, cfg: Mapping[str, Any]) -> None:
    """A ``hidden_act`` memplan does not model is an error, not silently SiLU or GELU."""
    key, act = _get(cfg, ("hidden_activation", "hidden_act", "activation_function", "activation"))
    if act is None:
        return
    allowed = _GEGLUS.get(kind, _ACTIVATIONS[_FAMILY[kind].mlp])
    if str(act) not in allowed:
        raise ValueError(
            f"{key}: {act!r} is not modelled for model_type {kind} (memplan models {', '.join(allowed)}); "
            "use a config with one of those"
        )


def _neox_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """GPT-NeoX's partial rotary and parallel residual (``GPTNeoXConfig``: ``rotary_pct`` → ``rope_parameters
    ["partial_rotary_factor"]``, default 0.25; ``use_parallel_residual``, default true)."""
    rope = cfg.get("rope_parameters") or {}
    pct = _float(cfg, "rotary_pct", "partial_rotary_factor", default=0.25)
    return {
        "rotary_pct": _float(rope, "partial_rotary_factor", default=pct),
        "parallel_residual": _bool(cfg, "use_parallel_residual", True),
    }


def _check_unmodelled(kind: str, cfg: Mapping[str, Any]) -> None:
    """Keys whose effect memplan does not model are refused, not silently dropped: the MoE router's
    auxiliary loss (``output_router_logits``: every layer's router logits kept for the load-balancing
    loss) and Phi-3's partial rotary (``partial_rotary_factor`` < 1, Phi-4-mini: ``Phi3Attention`` rotates
    a slice of each head and concatenates the rest)."""
    if kind in MOE_MODEL_TYPES and _bool(cfg, "output_router_logits", False):
        raise ValueError(
            "output_router_logits: the router's auxiliary (load-balancing) loss is not modelled; "
            "set it false in config.json"
        )
    if kind == "phi3":
        rope = cfg.get("rope_parameters") or {}
        factor = _float(
            rope, "partial_rotary_factor", default=_float(cfg, "partial_rotary_factor", default=1.0)
        )
        if factor != 1.0:
            raise ValueError(
                f"partial_rotary_factor: {factor:g} (a partially rotated Phi-3) is not modelled for "
                "model_type phi3; use a config with partial_rotary_factor 1"
            )


def _fields(kind: str, cfg: Mapping[str, Any], name: str) -> dict[str, Any]:
    fam = _FAMILY[kind]
    _check_activation(kind, cfg)
    _check_unmodelled(kind, cfg)
    fields: dict[str, Any] = {
        "name": name,
        "hidden_size": _req_int(cfg, "hidden_size", "n_embd"),
        "num_layers": _req_int(cfg, "num_hidden_layers", "n_layer"),
        "num_heads": _req_int(cfg, "num_attention_heads", "n_head"),
        "num_kv_heads": _int(cfg, "num_key_value_heads"),  # absent → heads (MHA)
        "head_dim": _int(cfg, "head_dim"),
        "vocab_size": _req_int(cfg, "vocab_size"),
        "tied_embeddings": _bool(cfg, "tie_word_embeddings", fam.tied),
        "norm": fam.norm,
        "norm_eps": _float(
            cfg, "rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "norm_epsilon", default=fam.eps
        ),
        "mlp": fam.mlp,
        "position": fam.position,
        "max_positions": _int(cfg, "max_position_embeddings", "n_positions", default=fam.max_pos),
        **_biases(kind, cfg),
        **_dropouts(kind, cfg),
    }
    ffn = _int(cfg, "intermediate_size", "n_inner")  # gpt2's n_inner null → 4h (ModelConfig's default)
    if ffn is not None:
        fields["ffn_size"] = ffn
    if fam.position is PositionType.ROPE:
        fields["rope_theta"] = _float(cfg, "rope_theta", "rotary_emb_base", default=10000.0)
    if fam.mlp is MlpType.GELU:
        _, act = _get(cfg, ("activation_function", "hidden_act", "activation"))
        fields["gelu"] = act or _GELU_DEFAULT.get(kind, "gelu")  # the configs' defaults
    if kind == "gpt_neox":
        fields.update(_neox_fields(cfg))
    if kind in MOE_MODEL_TYPES:
        fields.update(_moe_fields(kind, cfg))
    if kind in _WINDOWED:
        fields["sliding_window"] = _sliding_window(kind, cfg, fields["num_layers"])
        fields.update(_qwen2_layer_types(kind, cfg, fields["num_layers"], fields["sliding_window"]))
    if kind in ("qwen3", "qwen3_moe"):
        fields["qk_norm"] = True  # Qwen3Attention's / Qwen3MoeAttention's q_norm / k_norm
    if kind == "cohere":
        fields.update(_cohere_fields(cfg))
    if kind == "stablelm":
        fields.update(_stablelm_fields(cfg))
    if kind == "falcon":
        fields.update(_falcon_fields(cfg))
    if kind == "glm":  # GlmConfig: partial_rotary_factor 0.5 by default, head_dim 128, 2 kv heads
        rope = cfg.get("rope_parameters") or {}
        pct = _float(cfg, "partial_rotary_factor", default=0.5)
        fields["rotary_pct"] = _float(rope, "partial_rotary_factor", default=pct)
        fields["head_dim"] = _int(cfg, "head_dim", default=128)
        fields["num_kv_heads"] = _int(cfg, "num_key_value_heads", default=2)
    if kind == "olmo2":  # Olmo2DecoderLayer: post norms only; Olmo2Attention: q/k norms over a·d, kv·d
        fields.update(post_norms=True, pre_norms=False, qk_norm=True, qk_norm_whole=True)
    if kind in _OWN_CODE:
        fields["family"] = kind
    if kind in ("gemma", "gemma2", "gemma3_text"):
        fields.update(gate_act=GateActivation.GELU_TANH, embed_scale=True)
    if kind == "gpt_oss":
        fields.update(_gpt_oss_fields(cfg, fields["num_layers"]))
    if kind in ("gemma2", "gemma3_text"):
        fields.update(_gemma2_fields(kind, cfg, fields["num_layers"]))
    if kind == "phimoe":  # PhimoeForCausalLM: nn.Linear(h, v, bias=config.lm_head_bias)
        fields["head_bias"] = _bool(cfg, "lm_head_bias", False)
        fields["rope_scaling"] = _rope_kind(cfg)
    if kind in ("phi3", "mixtral", "starcoder2", "phimoe"):
        fields["sliding_window"] = _int(cfg, "sliding_window")  # the config classes' default: none
    if kind == "llama4_text":
        from memplan.presets.hf_llama4 import llama4_fields

        fields.update(llama4_fields(cfg, fields["num_layers"]))
    return fields


_GELU_DEFAULT = {"gpt2": "gelu_new", "starcoder2": "gelu_pytorch_tanh"}
"""The config classes' ``hidden_act`` / ``activation_function`` defaults where not "gelu"."""

_OWN_CODE = (
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi3",
    "qwen2_moe",
    "qwen3_moe",
    "gpt_oss",
    "olmo2",
    "granite",
    "starcoder2",
    "cohere",
    "stablelm",
    "glm",
    "falcon",
    "llama4_text",
    "phimoe",
)
"""The model_types whose transformers code the layout alone does not name (``ModelConfig.code_family``
derives llama, gpt2, gpt_neox and mixtral): their ``family`` is set."""

_WINDOWED = ("mistral", "qwen2", "qwen3", "qwen3_moe")


def _rope_kind(cfg: Mapping[str, Any]) -> str | None:
    """The ``rope_scaling`` (or transformers 5's ``rope_parameters``) type other than "default", or None."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = (rope.get("rope_type") or rope.get("type")) if isinstance(rope, Mapping) else None
    return None if kind in (None, "default") else str(kind)


def _sliding_window(kind: str, cfg: Mapping[str, Any], layers: int) -> int | None:
    """The sliding window as transformers reads it: MistralConfig's ``sliding_window`` (default 4096,
    null: full causal); Qwen2Config / Qwen3Config's only with ``use_sliding_window`` (default false), on
    layers i ≥ ``max_window_layers`` (default 28; configuration_qwen2.py ``layer_types``)."""
    if kind == "mistral":
        if "sliding_window" in cfg and cfg["sliding_window"] is None:
            return None  # an explicit null: full causal
        return _int(cfg, "sliding_window", default=4096)
    if not _bool(cfg, "use_sliding_window", False):
        return None
    if kind == "qwen3_moe":  # Qwen3MoeConfig: every layer slides (no max_window_layers)
        return _int(cfg, "sliding_window", default=4096)
    first = _int(cfg, "max_window_layers", default=28)
    assert first is not None
    if first >= layers:
        return None  # no layer slides
    return _int(cfg, "sliding_window", default=4096)


def _qwen2_layer_types(kind: str, cfg: Mapping[str, Any], layers: int, window: int | None) -> dict[str, Any]:
    """Qwen2's / Qwen3's full layers below ``max_window_layers`` (``full_layers``: layer i slides when
    i ≥ max_window_layers, ``Qwen2Config.layer_types``); an explicit ``layer_types`` of another pattern is
    refused."""
    if kind not in ("qwen2", "qwen3"):
        return {}
    first = _int(cfg, "max_window_layers", default=28) or 0
    kinds = [
        "sliding_attention" if window is not None and i >= first else "full_attention" for i in range(layers)
    ]
    if cfg.get("layer_types") not in (None, kinds):
        raise ValueError(
            "layer_types: only the layers from max_window_layers on sliding is modelled; drop layer_types"
        )
    return {"full_layers": first} if window is not None and 0 < first < layers else {}


def _gpt_oss_fields(cfg: Mapping[str, Any], layers: int) -> dict[str, Any]:
    """gpt-oss (``GptOssConfig``): attention sinks, the clamped SwiGLU experts (``swiglu_limit`` and
    ``swiglu_alpha`` change values, not what is kept), sliding-window layers alternating with full ones
    (``layer_types``: layer i slides when (i + 1) % 2, the default; another pattern refused)."""
    pattern = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if cfg.get("layer_types") not in (None, pattern):
        raise ValueError("layer_types: only every 2nd layer full is modelled for gpt_oss; drop layer_types")
    window = _int(cfg, "sliding_window", default=128)
    return {
        "attn_sinks": True,
        "gate_act": GateActivation.CLAMPED,
        "sliding_window": window,
        "sliding_window_pattern": 2 if window else None,
        "rope_theta": _float(cfg, "rope_theta", default=150000.0),
    }


def _optional(cfg: Mapping[str, Any], key: str, default: float | None) -> float | None:
    """A number whose explicit null turns the feature off (Gemma-2's softcaps), absent → the default."""
    if cfg.get(key) is None:
        return None if key in cfg else default
    return _float(cfg, key, default=0.0)


def _gemma2_fields(kind: str, cfg: Mapping[str, Any], layers: int) -> dict[str, Any]:
    """Gemma-2's and Gemma-3's structure, defaults as ``Gemma2Config`` / ``Gemma3TextConfig``: post norms,
    the query scalar, the softcaps (Gemma-3: none), sliding-window layers with every n-th one full
    (``layer_types``; Gemma-2 every 2nd, Gemma-3 ``sliding_window_pattern``, 6); Gemma-3's q/k norms and
    its sliding layers' rotary base."""
    gemma3 = kind == "gemma3_text"
    every = _int(cfg, "sliding_window_pattern", default=6) if gemma3 else 2
    assert every is not None  # a default is given
    pattern = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    if cfg.get("layer_types") not in (None, pattern):
        raise ValueError(f"layer_types: only every {every}th layer full is modelled; drop layer_types")
    window = _int(cfg, "sliding_window", default=4096)
    fields = {
        "post_norms": True,
        "query_pre_attn_scalar": _int(cfg, "query_pre_attn_scalar", default=256),
        "attn_softcap": _optional(cfg, "attn_logit_softcapping", None if gemma3 else 50.0),
        "final_softcap": _optional(cfg, "final_logit_softcapping", None if gemma3 else 30.0),
        "sliding_window": window,
        "sliding_window_pattern": every if window else None,
    }
    if gemma3:
        fields |= {
            "qk_norm": True,
            "rope_theta": _float(cfg, "rope_theta", default=1_000_000.0),
            "rope_local_theta": _float(cfg, "rope_local_base_freq", default=10_000.0),
        }
    return fields


def text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """A multimodal Gemma-3 config (``model_type`` gemma3) as its text model's (``text_config``, a
    ``gemma3_text``); NB: the vision tower's parameters are not counted."""
    text = cfg.get("text_config")
    if cfg.get("model_type") in ("gemma3", "llama4") and isinstance(text, Mapping):
        return {**text, "model_type": f"{cfg['model_type']}_text"}
    return cfg


def _moe_fields(kind: str, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``ffn_size`` (one routed expert's width) and ``moe`` of a mixtral / qwen2_moe / qwen3_moe config;
    defaults for absent keys follow transformers' ``MixtralConfig``, ``Qwen2MoeConfig`` and
    ``Qwen3MoeConfig``."""
    if kind == "phimoe":  # PhimoeConfig's defaults; sparsemixer picks 2 experts and never renormalises
        top_k = _int(cfg, "num_experts_per_tok", default=2)
        if top_k != 2:
            raise ValueError(
                f"num_experts_per_tok: {top_k}, but PhiMoE's sparsemixer always routes to 2 experts; "
                "set it to 2"
            )
        moe = {
            "experts": _int(cfg, "num_local_experts", default=16),
            "top_k": 2,
            "norm_topk_prob": False,
            "input_jitter": _float(cfg, "input_jitter_noise", default=0.0),
        }
        return {"ffn_size": _int(cfg, "intermediate_size", default=6400), "moe": moe}
    if kind == "mixtral":
        moe = {
            "experts": _int(cfg, "num_local_experts", default=8),
            "top_k": _int(cfg, "num_experts_per_tok", default=2),
            "norm_topk_prob": True,  # MixtralSparseMoeBlock always divides by the top-k sum
        }
        return {"ffn_size": _int(cfg, "intermediate_size", default=14336), "moe": moe}
    if _int(cfg, "decoder_sparse_step", default=1) != 1 or cfg.get("mlp_only_layers"):
        raise ValueError(
            "decoder_sparse_step: dense layers between MoE layers are not modelled; "
            "use a config with decoder_sparse_step 1 and no mlp_only_layers"
        )
    if kind == "gpt_oss":  # GptOssConfig's defaults: biased router and experts, softmax over the top-k
        moe = {
            "experts": _int(cfg, "num_local_experts", default=128),
            "top_k": _int(cfg, "num_experts_per_tok", default=4),
            "norm_topk_prob": False,  # the top-k logits' softmax sums to 1 by itself
            "router_bias": True,
            "expert_bias": True,
        }
        return {"ffn_size": _int(cfg, "intermediate_size", default=2880), "moe": moe}
    if kind == "qwen3_moe":  # Qwen3MoeConfig's defaults; no shared expert
        moe = {
            "experts": _int(cfg, "num_experts", default=128),
            "top_k": _int(cfg, "num_experts_per_tok", default=8),
            "norm_topk_prob": _bool(cfg, "norm_topk_prob", False),
        }
        return {"ffn_size": _int(cfg, "moe_intermediate_size", default=768), "moe": moe}
    shared = _int(cfg, "shared_expert_intermediate_size", default=5632)
    moe = {
        "experts": _int(cfg, "num_experts", default=60),
        "top_k": _int(cfg, "num_experts_per_tok", default=4),
        "shared_experts": 1 if shared else 0,
        "shared_ffn": shared or None,
        "shared_gate": bool(shared),
        "norm_topk_prob": _bool(cfg, "norm_topk_prob", False),  # Qwen2MoeConfig's default
    }
    return {"ffn_size": _int(cfg, "moe_intermediate_size", default=1408), "moe": moe}


def _cohere_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Cohere's parallel layer with one bias-free LayerNorm (``CohereDecoderLayer``) and, with
    ``use_qk_norm`` (Command R+), q/k LayerNorms with [heads, d] weights."""
    qk = _bool(cfg, "use_qk_norm", False)
    return {
        "parallel_residual": True,
        "shared_norm": True,
        "norm_bias": False,
        "qk_norm": qk,
        "qk_norm_whole": qk,
    }


def _stablelm_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """StableLM's partial rotary (``partial_rotary_factor``, StableLmConfig's default 0.25, or in
    ``rope_parameters``) and optional parallel layer with one norm (``use_parallel_residual``, default
    false) and per-head q/k LayerNorms (``qk_layernorm``, StableLM-2-12B)."""
    qk = _bool(cfg, "qk_layernorm", False)
    rope = cfg.get("rope_parameters") or {}
    pct = _float(cfg, "partial_rotary_factor", default=0.25)
    parallel = _bool(cfg, "use_parallel_residual", False)
    return {
        "rotary_pct": _float(rope, "partial_rotary_factor", default=pct),
        "parallel_residual": parallel,
        "shared_norm": parallel,
        "qk_norm": qk,
        "qk_norm_whole": qk,
    }


def _falcon_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Falcon's attention layout and parallel layer as ``FalconConfig`` reads them: kv heads 1 with
    ``multi_query`` (default true) unless ``new_decoder_architecture`` (then ``num_kv_heads``, default the
    heads); the new architecture's two norms (``num_ln_in_parallel_attn`` default 2) or one; the MLP width
    ``ffn_hidden_size`` (default 4h) and ``activation``. ALiBi and the sequential layer are refused."""
    if _bool(cfg, "alibi", False):
        raise ValueError(
            "alibi: Falcon's ALiBi position bias is not modelled; use a rotary Falcon (alibi false)"
        )
    new = _bool(cfg, "new_decoder_architecture", False)
    if not new and not _bool(cfg, "parallel_attn", True):
        raise ValueError(
            "parallel_attn: Falcon's sequential layer is not modelled; use a config with parallel_attn true"
        )
    heads = _req_int(cfg, "num_attention_heads", "n_head")
    kv = _int(cfg, "num_kv_heads", default=heads) if new or not _bool(cfg, "multi_query", True) else 1
    norms = _int(cfg, "num_ln_in_parallel_attn", default=2 if new else 1)
    fields: dict[str, Any] = {"num_kv_heads": kv, "parallel_residual": True, "shared_norm": norms == 1}
    ffn = _int(cfg, "ffn_hidden_size")
    if ffn is not None:
        fields["ffn_size"] = ffn
    return fields


_GRANITE_MULTIPLIERS = {
    "embedding_multiplier": "embedding ×",
    "attention_multiplier": "attention scale ",
    "residual_multiplier": "residual branches ×",
    "logits_scaling": "logits ÷",
}
"""GraniteConfig's multipliers (default 1.0 each), read and named in the notes."""


def _granite_note(cfg: Mapping[str, Any]) -> str:
    """Granite's multipliers as read: Python-float multiplies that keep nothing and count no FLOPs
    (``blocks.hf.llama.granite``)."""
    values = [f"{what}{_float(cfg, key, default=1.0):g}" for key, what in _GRANITE_MULTIPLIERS.items()]
    return f"multipliers ({', '.join(values)}) keep no tensor and add no counted FLOPs"


def model_from_hf_config(cfg: Mapping[str, Any], name: str, where: str | None = None) -> ModelConfig:
    """Build a ``ModelConfig`` from a parsed Hugging Face ``config.json``.

    Raises ``ValueError`` (one line, starting with ``where``, default ``hf config <name>``, then the
    config key and the fix) for an unsupported ``model_type``, a missing or mistyped key, or an
    architecture ``ModelConfig`` rejects.
    """
    where = where or f"hf config {name}"
    cfg = text_config(cfg)
    try:
        kind = model_type_of(cfg)
        if kind.startswith("deepseek"):  # MLA, dense first layers: their own module
            from memplan.presets.hf_deepseek import deepseek_fields

            fields = deepseek_fields(cfg, name)
        else:
            fields = _fields(kind, cfg, name)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    try:
        return ModelConfig(**fields)
    except ValidationError as exc:
        raise ValueError(one_line_validation_error(exc, f"{where} ({kind})")) from None


def hf_notes(cfg: Mapping[str, Any]) -> str:
    """Where the preset came from and the caveats of the import, for ``ModelPreset.notes``."""
    notes = ["text model only (text_config)"] if text_config(cfg) is not cfg else []
    cfg = text_config(cfg)
    kind = model_type_of(cfg)
    notes.insert(0, f"imported from a Hugging Face config.json (model_type {kind})")
    if kind.startswith("deepseek"):
        from memplan.presets.hf_deepseek import deepseek_notes

        return "; ".join(notes + deepseek_notes(cfg))
    if kind == "gemma":
        notes.append("GeGLU MLP (swiglu's matrices, tanh-GELU gate) and a √h-scaled embedding")
    if kind in ("gemma2", "gemma3_text"):
        notes.append("post norms, softcapping and alternating sliding-window layers: --impl hf only")
    if kind == "gpt_oss":
        notes.append("attention sinks, clamped SwiGLU experts with biases: --impl hf, eager attention only")
    if kind == "phi3":
        notes.append("fused qkv and gate_up projections counted as separate (same parameter count)")
    if kind == "gpt_neox":
        notes.append("partial rotary and parallel residual: modelled for --impl hf only")
    if kind == "granite":
        notes.append(_granite_note(cfg))
    if kind == "cohere":
        scale = _float(cfg, "logit_scale", default=0.0625)
        notes.append(
            f"parallel layer with one bias-free LayerNorm: --impl hf only; logits ×{scale:g} keep nothing"
        )
    if kind == "falcon":
        notes.append("fused query_key_value and the parallel layer: --impl hf only (same parameter count)")
    if kind == "glm":
        notes.append("partial interleaved rotary and fused gate_up: --impl hf only (same parameter count)")
    if kind == "stablelm":
        notes.append("partial rotary (and the parallel layer): --impl hf only")
    if kind == "llama4_text":
        from memplan.presets.hf_llama4 import LLAMA4_NOTE

        notes.append(LLAMA4_NOTE)
    if kind == "phimoe":
        notes.append("sparsemixer router (two sampled experts), LayerNorms, lm head bias: --impl hf only")
    if kind == "olmo2":
        notes.append("post norms only and q/k norms over the whole projections: --impl hf only")
    rope = cfg.get("rope_scaling") or {}
    if kind == "phimoe" and "longrope" in (rope.get("rope_type"), rope.get("type")):
        # PhimoeRotaryEmbedding: cos/sin of the same [s, d] shape, scaled by short/long_mscale, no grad
        notes.append("longrope rope_scaling: the rotary tables' values only (no bytes, no FLOPs)")
    elif rope:
        notes.append("rope_scaling ignored")
    if kind in MOE_MODEL_TYPES:
        moe = _moe_fields(kind, cfg)["moe"]
        shared = f" + {moe['shared_experts']} shared" if moe.get("shared_experts") else ""
        notes.append(f"{moe['experts']} experts top-{moe['top_k']}{shared}")
    return "; ".join(notes)
