"""The LayerNorm decoders: GPT-2, GPT-NeoX, StarCoder2, Cohere, StableLM and Falcon — biases and dropouts
of their own, and most with a parallel layer (attention and MLP from one input).

Known limitations (none changes the parameter count):
- GPT-NeoX's partial rotary (``rotary_pct``, or ``rope_parameters.partial_rotary_factor``; transformers'
  default 0.25) and parallel residual (``use_parallel_residual``, default true) are read; they are modelled
  for ``--impl hf`` (the reference model refuses them). Its one ``hidden_dropout`` is also the embedding's.
- Cohere imports its parallel layer with one bias-free LayerNorm (``parallel_residual``, ``shared_norm``,
  ``norm_bias`` false; --impl hf only), its optional q/k LayerNorms (``use_qk_norm``) and names
  ``logit_scale`` in the notes.
- StableLM imports its partial rotary and optional parallel layer with one LayerNorm (--impl hf only);
  its ``hidden_dropout`` is after the MLP only; ``qk_layernorm``'s per-head LayerNorms are read.
- Falcon imports multi-query / the new decoder architecture's kv heads and its parallel layer (one norm
  or ``ln_attn`` / ``ln_mlp``); NB ALiBi and ``parallel_attn`` false are refused.
"""

from __future__ import annotations

from memplan.config import MlpType, NormType, PositionType
from memplan.presets.hf.family import Biases, Family, Fields, attention_biases, qkv_biases
from memplan.presets.hf.keys import Cfg, flag, integer, number, partial_rotary, required
from memplan.presets.hf.windows import config_window


def _every_bias(key: str, default: bool) -> Biases:
    """``key`` (default ``default``) on every linear but the lm head (StarCoder2's ``use_bias``, Falcon's
    ``bias``)."""

    def read(cfg: Cfg) -> dict[str, bool]:
        every = flag(cfg, key, default)
        return {"qkv_bias": every, "out_bias": every, "mlp_bias": every}

    return read


def _gpt2_biases(cfg: Cfg) -> dict[str, bool]:
    return {"qkv_bias": True, "out_bias": True, "mlp_bias": True}


def _neox_biases(cfg: Cfg) -> dict[str, bool]:
    """Biases on every linear (``attention_bias`` gates the attention ones)."""
    attn = flag(cfg, "attention_bias", True)
    return {"qkv_bias": attn, "out_bias": attn, "mlp_bias": True}


def _gpt2_dropouts(cfg: Cfg) -> dict[str, float]:
    return {
        "attn_dropout": number(cfg, "attn_pdrop", default=0.1),
        "resid_dropout": number(cfg, "resid_pdrop", default=0.1),
        "embd_dropout": number(cfg, "embd_pdrop", default=0.1),
    }


def _neox_dropouts(cfg: Cfg) -> dict[str, float]:
    """GPTNeoXModel.emb_dropout = nn.Dropout(config.hidden_dropout)."""
    hidden = number(cfg, "hidden_dropout", default=0.0)
    attn = number(cfg, "attention_dropout", default=0.0)
    return {"attn_dropout": attn, "resid_dropout": hidden, "embd_dropout": hidden}


def _once_per_layer_dropouts(cfg: Cfg) -> dict[str, float]:
    """``hidden_dropout`` once per layer, none on the embedding: Falcon's ``dropout_add(mlp_output,
    residual, hidden_dropout)``, StableLM's after the MLP (blocks.hf.llama.stablelm)."""
    return {
        "attn_dropout": number(cfg, "attention_dropout", default=0.0),
        "resid_dropout": number(cfg, "hidden_dropout", default=0.0),
        "embd_dropout": 0.0,
    }


def _starcoder2_dropouts(cfg: Cfg) -> dict[str, float]:
    """Starcoder2Config: residual_dropout after W_O and c_proj, embedding_dropout."""
    return {
        "attn_dropout": number(cfg, "attention_dropout", default=0.0),
        "resid_dropout": number(cfg, "residual_dropout", default=0.0),
        "embd_dropout": number(cfg, "embedding_dropout", default=0.0),
    }


def _neox(cfg: Cfg, fields: Fields) -> Fields:
    """GPT-NeoX's partial rotary and parallel residual (``GPTNeoXConfig``: ``rotary_pct`` → ``rope_parameters
    ["partial_rotary_factor"]``, default 0.25; ``use_parallel_residual``, default true)."""
    return {
        "rotary_pct": partial_rotary(cfg, "rotary_pct", "partial_rotary_factor", default=0.25),
        "parallel_residual": flag(cfg, "use_parallel_residual", True),
    }


def _cohere(cfg: Cfg, fields: Fields) -> Fields:
    """Cohere's parallel layer with one bias-free LayerNorm (``CohereDecoderLayer``) and, with
    ``use_qk_norm`` (Command R+), q/k LayerNorms with [heads, d] weights."""
    qk = flag(cfg, "use_qk_norm", False)
    return {
        "parallel_residual": True,
        "shared_norm": True,
        "norm_bias": False,
        "qk_norm": qk,
        "qk_norm_whole": qk,
    }


def _cohere_note(cfg: Cfg) -> str:
    scale = number(cfg, "logit_scale", default=0.0625)
    return f"parallel layer with one bias-free LayerNorm: --impl hf only; logits ×{scale:g} keep nothing"


def _stablelm(cfg: Cfg, fields: Fields) -> Fields:
    """StableLM's partial rotary (``partial_rotary_factor``, StableLmConfig's default 0.25, or in
    ``rope_parameters``) and optional parallel layer with one norm (``use_parallel_residual``, default
    false) and per-head q/k LayerNorms (``qk_layernorm``, StableLM-2-12B)."""
    qk = flag(cfg, "qk_layernorm", False)
    parallel = flag(cfg, "use_parallel_residual", False)
    return {
        "rotary_pct": partial_rotary(cfg, "partial_rotary_factor", default=0.25),
        "parallel_residual": parallel,
        "shared_norm": parallel,
        "qk_norm": qk,
        "qk_norm_whole": qk,
    }


def _falcon(cfg: Cfg, fields: Fields) -> Fields:
    """Falcon's attention layout and parallel layer as ``FalconConfig`` reads them: kv heads 1 with
    ``multi_query`` (default true) unless ``new_decoder_architecture`` (then ``num_kv_heads``, default the
    heads); the new architecture's two norms (``num_ln_in_parallel_attn`` default 2) or one; the MLP width
    ``ffn_hidden_size`` (default 4h) and ``activation``. ALiBi and the sequential layer are refused."""
    if flag(cfg, "alibi", False):
        raise ValueError(
            "alibi: Falcon's ALiBi position bias is not modelled; use a rotary Falcon (alibi false)"
        )
    new = flag(cfg, "new_decoder_architecture", False)
    if not new and not flag(cfg, "parallel_attn", True):
        raise ValueError(
            "parallel_attn: Falcon's sequential layer is not modelled; use a config with parallel_attn true"
        )
    heads = required(cfg, "num_attention_heads", "n_head")
    kv = integer(cfg, "num_kv_heads", default=heads) if new or not flag(cfg, "multi_query", True) else 1
    norms = integer(cfg, "num_ln_in_parallel_attn", default=2 if new else 1)
    extra: Fields = {"num_kv_heads": kv, "parallel_residual": True, "shared_norm": norms == 1}
    ffn = integer(cfg, "ffn_hidden_size")
    if ffn is not None:
        extra["ffn_size"] = ffn
    return extra


_LN, _GELU, _SWIGLU, _ROPE = NormType.LAYERNORM, MlpType.GELU, MlpType.SWIGLU, PositionType.ROPE
FAMILIES = {
    "gpt2": Family(
        _LN,
        _GELU,
        PositionType.LEARNED,
        tied=True,
        eps=1e-5,
        max_pos=1024,
        biases=_gpt2_biases,
        dropouts=_gpt2_dropouts,
        own_code=False,
        gelu="gelu_new",
    ),
    "gpt_neox": Family(
        _LN,
        _GELU,
        _ROPE,
        tied=False,
        eps=1e-5,
        max_pos=2048,
        biases=_neox_biases,
        dropouts=_neox_dropouts,
        extra=_neox,
        own_code=False,
        note="partial rotary and parallel residual: modelled for --impl hf only",
    ),
    "starcoder2": Family(
        _LN,
        _GELU,
        _ROPE,
        tied=True,
        eps=1e-5,
        max_pos=4096,
        biases=_every_bias("use_bias", True),
        dropouts=_starcoder2_dropouts,
        extra=config_window,
        gelu="gelu_pytorch_tanh",
    ),
    "cohere": Family(
        _LN,
        _SWIGLU,
        _ROPE,
        tied=True,
        eps=1e-5,
        max_pos=8192,
        biases=attention_biases(False),  # CohereAttention: q, k, v and o; CohereMLP: none
        extra=_cohere,
        note=_cohere_note,
    ),
    "stablelm": Family(
        _LN,
        _SWIGLU,
        _ROPE,
        tied=False,
        eps=1e-5,
        max_pos=4096,
        biases=qkv_biases("use_qkv_bias", False),  # q, k, v; o_proj and the MLP none
        dropouts=_once_per_layer_dropouts,
        extra=_stablelm,
        note="partial rotary (and the parallel layer): --impl hf only",
    ),
    "falcon": Family(
        _LN,
        _GELU,
        _ROPE,
        tied=True,
        eps=1e-5,
        max_pos=2048,
        biases=_every_bias("bias", False),
        dropouts=_once_per_layer_dropouts,
        extra=_falcon,
        note="fused query_key_value and the parallel layer: --impl hf only (same parameter count)",
    ),
}
"""The LayerNorm decoders' readers, by ``model_type``."""
