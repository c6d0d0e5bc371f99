"""One ``model_type``'s reader: the keys every transformers decoder config shares, read once, and the
family's own (``Family``: its fixed layout, defaults and hooks). The family groups (llama.py, gemma.py,
moe.py, layernorm.py, llama4.py, deepseek.py) each register their model types' readers; the package's
``READERS`` joins them.

Known limitations: a reader reads numbers only; what a key changes in values alone (a multiplier, a
scaling) is at most named in the notes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from memplan.config import Gelu, MlpType, NormType, PositionType
from memplan.presets.hf.keys import Cfg, first, flag, integer, nested, number, required

Fields = dict[str, Any]
"""``ModelConfig``'s keyword arguments, as read."""
Biases = Callable[[Cfg], dict[str, bool]]
"""A family's ``qkv_bias`` / ``out_bias`` / ``mlp_bias``."""


class Reader(Protocol):
    """What the package asks of one ``model_type``: the ``ModelConfig`` fields and the preset's notes."""

    def fields(self, kind: str, cfg: Cfg, name: str) -> Fields:
        """``ModelConfig``'s keyword arguments read from ``cfg`` (a ``ValueError`` names a bad key)."""
        ...

    def notes(self, kind: str, cfg: Cfg) -> list[str]:
        """The import's caveats, for ``ModelPreset.notes``."""
        ...


def no_biases(cfg: Cfg) -> dict[str, bool]:
    """No bias on any linear (Mistral, Mixtral, Phi-3, Gemma-2/3)."""
    return {"qkv_bias": False, "out_bias": False, "mlp_bias": False}


def llama_biases(cfg: Cfg) -> dict[str, bool]:
    """``LlamaConfig``'s ``attention_bias`` on q, k, v and o and ``mlp_bias`` on the MLP (default false)."""
    attn = flag(cfg, "attention_bias", False)
    return {"qkv_bias": attn, "out_bias": attn, "mlp_bias": flag(cfg, "mlp_bias", False)}


def qwen2_biases(cfg: Cfg) -> dict[str, bool]:
    """Qwen2's and Qwen2-MoE's: q, k and v carry a bias, o_proj and the MLP do not (whatever the config)."""
    return {"qkv_bias": True, "out_bias": False, "mlp_bias": False}


def attention_biases(default: bool) -> Biases:
    """``attention_bias`` (default ``default``) on q, k, v and o; the MLP has none."""

    def read(cfg: Cfg) -> dict[str, bool]:
        attn = flag(cfg, "attention_bias", default)
        return {"qkv_bias": attn, "out_bias": attn, "mlp_bias": False}

    return read


def qkv_biases(key: str, default: bool) -> Biases:
    """``key`` (default ``default``) on q, k and v only; o_proj and the MLP have none."""

    def read(cfg: Cfg) -> dict[str, bool]:
        return {"qkv_bias": flag(cfg, key, default), "out_bias": False, "mlp_bias": False}

    return read


def usual_dropouts(cfg: Cfg) -> dict[str, float]:
    """The dropouts most configs name (absent: none)."""
    return {
        "attn_dropout": number(cfg, "attention_dropout", "attn_pdrop", default=0.0),
        "resid_dropout": number(cfg, "hidden_dropout", "resid_pdrop", default=0.0),
        "embd_dropout": number(cfg, "embd_pdrop", default=0.0),
    }


_ACTIVATIONS = {MlpType.SWIGLU: ("silu", "swish"), MlpType.GELU: tuple(g.value for g in Gelu)}
"""The ``hidden_act`` values each MLP type models."""


@dataclass(frozen=True)
class Family:
    """The fixed layout of a ``model_type``, the transformers defaults for keys a config may omit, and what
    it reads beyond the shared keys (each hook a function of the config)."""

    norm: NormType
    mlp: MlpType
    position: PositionType
    tied: bool  # tie_word_embeddings default
    eps: float  # rms_norm_eps / layer_norm_eps default
    max_pos: int  # max_position_embeddings default
    biases: Biases = no_biases
    dropouts: Callable[[Cfg], dict[str, float]] = usual_dropouts
    check: Callable[[Cfg], None] | None = None
    """Refuses keys whose effect memplan does not model, before any other key is read."""
    moe: Callable[[Cfg], Fields] | None = None
    """``ffn_size`` (one routed expert's width) and ``moe``; its router's auxiliary loss is refused."""
    extra: Callable[[Cfg, Fields], Fields] | None = None
    """The family's own fields, given those read so far (applied after them, over them)."""
    own_code: bool = True
    """``family`` is set to the model type: its transformers code the layout alone does not name
    (``ModelConfig.code_family`` derives llama, gpt2, gpt_neox and mixtral)."""
    gates: tuple[str, ...] | None = None
    """A GeGLU's gate activations (Gemma), instead of the MLP type's."""
    gelu: str = "gelu"
    """The config class's ``hidden_act`` / ``activation_function`` default, for a GELU MLP."""
    note: str | Callable[[Cfg], str] | None = None
    """The import's caveat for the notes."""
    longrope: bool = False
    """A longrope ``rope_scaling`` is read (its tables' values only) rather than ignored."""

    def fields(self, kind: str, cfg: Cfg, name: str) -> Fields:
        self._check_activation(kind, cfg)
        if self.moe is not None and flag(cfg, "output_router_logits", False):
            raise ValueError(
                "output_router_logits: the router's auxiliary (load-balancing) loss is not modelled; "
                "set it false in config.json"
            )
        if self.check is not None:
            self.check(cfg)
        fields = self._common(cfg, name)
        if self.moe is not None:
            fields.update(self.moe(cfg))
        if self.extra is not None:
            fields.update(self.extra(cfg, fields))
        if self.own_code:
            fields["family"] = kind
        return fields

    def _common(self, cfg: Cfg, name: str) -> Fields:
        """The keys every decoder config shares, with this family's defaults."""
        fields: Fields = {
            "name": name,
            "hidden_size": required(cfg, "hidden_size", "n_embd"),
            "num_layers": required(cfg, "num_hidden_layers", "n_layer"),
            "num_heads": required(cfg, "num_attention_heads", "n_head"),
            "num_kv_heads": integer(cfg, "num_key_value_heads"),  # absent → heads (MHA)
            "head_dim": integer(cfg, "head_dim"),
            "vocab_size": required(cfg, "vocab_size"),
            "tied_embeddings": flag(cfg, "tie_word_embeddings", self.tied),
            "norm": self.norm,
            "norm_eps": number(
                cfg, "rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "norm_epsilon", default=self.eps
            ),
            "mlp": self.mlp,
            "position": self.position,
            "max_positions": integer(cfg, "max_position_embeddings", "n_positions", default=self.max_pos),
            **self.biases(cfg),
            **self.dropouts(cfg),
        }
        ffn = integer(cfg, "intermediate_size", "n_inner")  # gpt2's n_inner null → 4h (ModelConfig's default)
        if ffn is not None:
            fields["ffn_size"] = ffn
        if self.position is PositionType.ROPE:
            fields["rope_theta"] = number(cfg, "rope_theta", "rotary_emb_base", default=10000.0)
        if self.mlp is MlpType.GELU:
            _, act = first(cfg, ("activation_function", "hidden_act", "activation"))
            fields["gelu"] = act or self.gelu
        return fields

    def _check_activation(self, kind: str, cfg: Cfg) -> None:
        """A ``hidden_act`` memplan does not model is an error, not silently SiLU or GELU."""
        key, act = first(cfg, ("hidden_activation", "hidden_act", "activation_function", "activation"))
        if act is None:
            return
        allowed = self.gates or _ACTIVATIONS[self.mlp]
        if str(act) not in allowed:
            raise ValueError(
                f"{key}: {act!r} is not modelled for model_type {kind} "
                f"(memplan models {', '.join(allowed)}); use a config with one of those"
            )

    def notes(self, kind: str, cfg: Cfg) -> list[str]:
        notes = [self.note if isinstance(self.note, str) else self.note(cfg)] if self.note else []
        rope = cfg.get("rope_scaling") or {}
        kinds = (nested(cfg, "rope_scaling").get(k) for k in ("rope_type", "type")) if self.longrope else ()
        if "longrope" in kinds:
            # PhimoeRotaryEmbedding: cos/sin of the same [s, d] shape, scaled by short/long_mscale, no grad
            notes.append("longrope rope_scaling: the rotary tables' values only (no bytes, no FLOPs)")
        elif rope:
            notes.append("rope_scaling ignored")
        if self.moe is not None:
            moe = self.moe(cfg)["moe"]
            shared = f" + {moe['shared_experts']} shared" if moe.get("shared_experts") else ""
            notes.append(f"{moe['experts']} experts top-{moe['top_k']}{shared}")
        return notes
