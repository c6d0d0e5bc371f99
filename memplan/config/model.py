"""The model: a decoder-only transformer (pre-norm, as GPT-2/3 and Llama lay it out), dense or a mixture
of experts. A dense model is one with ``moe`` None; with ``moe`` set (``MoEConfig``, config/moe.py),
``ffn_size`` is the width of ONE routed expert and every layer's MLP becomes a router, E routed experts
and optional shared experts (Jiang et al. 2024, Mixtral; Qwen1.5-MoE); with ``mla`` (config/mla.py) the
attention is DeepSeek's multi-head latent attention.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Self

from pydantic import Field, model_validator

from memplan.config._base import Frozen
from memplan.config.impl import Family
from memplan.config.mla import MLAConfig
from memplan.config.moe import MoEConfig


class NormType(StrEnum):
    RMSNORM = "rmsnorm"
    """RMSNorm as Llama's reference code: upcast to fp32, x·rsqrt(mean(x²)+eps), cast back, × weight."""
    LAYERNORM = "layernorm"
    """torch.nn.LayerNorm (``aten.native_layer_norm``): weight and bias, saves input, mean and rstd."""


class MlpType(StrEnum):
    SWIGLU = "swiglu"
    """down(silu(gate(x)) · up(x)): three matrices h×ffn (Llama, Mistral, Qwen)."""
    GELU = "gelu"
    """fc2(gelu(fc1(x))): two matrices h×ffn (GPT-2, GPT-3, GPT-NeoX)."""


class Gelu(StrEnum):
    """Which GELU a gelu MLP applies: a Hugging Face ``activation_function`` / ``hidden_act``. The values
    differ in what transformers' code keeps (``blocks.mlp``), not in parameters or FLOPs; memplan's
    reference model applies ``F.gelu`` (one saved input) whichever it is."""

    GELU = "gelu"
    """Exact (erf) GELU, ``F.gelu`` (transformers' ``GELUActivation``)."""
    GELU_NEW = "gelu_new"
    """tanh approximation written in Python (transformers' ``NewGELUActivation``, GPT-2)."""
    GELU_PYTORCH_TANH = "gelu_pytorch_tanh"
    """tanh approximation in one kernel, ``F.gelu(approximate="tanh")`` (transformers' ``GELUTanh``)."""


class GateActivation(StrEnum):
    """The activation on the gate of a gated (``swiglu``) MLP: down(act(gate(x))·up(x))."""

    SILU = "silu"
    """SwiGLU (Llama, Mistral, Qwen, Phi-3)."""
    GELU_TANH = "gelu_tanh"
    """GeGLU with the tanh approximation, ``gelu(x, approximate="tanh")`` (Gemma's gelu_pytorch_tanh)."""
    CLAMPED = "clamped_swiglu"
    """gpt-oss's experts (``GptOssExperts._apply_gate``): g = min(gate, limit), u = clamp(up, ±limit),
    (u + 1) · g · σ(α·g) on interleaved gate/up columns; SwiGLU's matrices, its own saves (--impl hf)."""


class PositionType(StrEnum):
    ROPE = "rope"
    """Rotary embeddings applied to q and k; no parameters."""
    LEARNED = "learned"
    """A learned [max_positions, hidden] table added to the token embedding."""


class ModelConfig(Frozen):
    """A decoder-only transformer, pre-norm, as GPT-2/3 and Llama lay it out."""

    name: str = "custom"
    hidden_size: int = Field(strict=True, gt=0, description="model width h")
    num_layers: int = Field(strict=True, gt=0, description="transformer layers L")
    num_heads: int = Field(strict=True, gt=0, description="query heads a")
    num_kv_heads: int | None = Field(
        strict=True, default=None, gt=0, description="key/value heads (GQA/MQA); = heads"
    )
    head_dim: int | None = Field(
        strict=True, default=None, gt=0, description="per-head width d; = hidden / heads"
    )
    ffn_size: int | None = Field(
        strict=True, default=None, gt=0, description="MLP width; 4h for gelu, none for swiglu"
    )
    vocab_size: int = Field(strict=True, gt=0, description="vocabulary v")
    tied_embeddings: bool = False
    norm: NormType = NormType.RMSNORM
    norm_eps: float = Field(default=1e-5, gt=0)
    mlp: MlpType = MlpType.SWIGLU
    gate_act: GateActivation = Field(
        default=GateActivation.SILU,
        description="activation on the gate of a swiglu MLP (gelu_tanh: GeGLU, Gemma); its saves and "
        "parameters are SwiGLU's",
    )
    embed_scale: bool = Field(
        default=False, description="the token embedding is multiplied by √hidden_size (Gemma)"
    )
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    position: PositionType = PositionType.ROPE
    max_positions: int = Field(strict=True, default=4096, gt=0)
    rope_theta: float = Field(default=10000.0, gt=0)
    sliding_window_pattern: int | None = Field(
        strict=True,
        default=None,
        ge=2,
        description="every n-th layer attends to all keys, the others through sliding_window (Gemma-2: "
        "2); none: every layer slides",
    )
    full_layers: int | None = Field(
        strict=True,
        default=None,
        ge=1,
        description="the first N layers attend to all keys, the later ones through sliding_window (Qwen2's "
        "and Qwen3's max_window_layers); none: every layer slides (or sliding_window_pattern)",
    )
    rope_local_theta: float | None = Field(
        default=None, gt=0, description="rotary base of the sliding-window layers (Gemma-3); none: rope_theta"
    )
    post_norms: bool = Field(
        default=False, description="RMSNorms after attention and after the MLP too: 4 per layer (Gemma-2)"
    )
    pre_norms: bool = Field(
        default=True,
        description="norms before attention and the MLP; false with post_norms: OLMo-2's layout, "
        "x + norm(attn(x)), the sublayers reading the residual itself",
    )
    query_pre_attn_scalar: int | None = Field(
        strict=True,
        default=None,
        gt=0,
        description="scores scaled by scalar^-½, not head_dim^-½ (Gemma-2; no bytes)",
    )
    attn_softcap: float | None = Field(
        default=None, gt=0, description="scores → c·tanh(scores/c) before the softmax (Gemma-2)"
    )
    final_softcap: float | None = Field(
        default=None, gt=0, description="logits → c·tanh(logits/c) before the loss (Gemma-2)"
    )
    attn_dropout: float = Field(default=0.0, ge=0, lt=1, description="dropout on attention probabilities")
    resid_dropout: float = Field(default=0.0, ge=0, lt=1, description="dropout after attention and MLP")
    embd_dropout: float = Field(default=0.0, ge=0, lt=1, description="dropout after the embedding")
    sliding_window: int | None = Field(
        strict=True,
        default=None,
        gt=0,
        description="sliding-window attention: each token attends to the last W positions (itself "
        "included); none: full causal. --impl hf: at s ≥ W transformers passes SDPA an explicit mask "
        "(what it keeps changes); the FLOPs do not (the kernels compute all s² cells), and the reference "
        "model ignores it",
    )
    attn_sinks: bool = Field(
        default=False,
        description="a learned logit per head joins every softmax row and is dropped after it (gpt-oss's "
        "sinks): a parameters per layer; --impl hf, eager attention",
    )
    qk_norm: bool = Field(
        default=False,
        description="RMSNorm over head_dim on q and k before RoPE (Qwen3's q_norm / k_norm, Gemma-3's): "
        "2·d parameters per layer",
    )
    qk_norm_whole: bool = Field(
        default=False,
        description="qk_norm over the whole projection outputs, a·d and kv·d wide (OLMo-2's q_norm / "
        "k_norm on q_proj's and k_proj's outputs): (a + kv)·d parameters per layer",
    )
    gelu: Gelu = Field(default=Gelu.GELU, description="which GELU a gelu MLP applies (activation_function)")
    rotary_pct: float = Field(
        default=1.0, gt=0, le=1, description="fraction of each head's width rotated (GPT-NeoX rotary_pct)"
    )
    parallel_residual: bool = Field(
        default=False,
        description="attention and MLP both read the layer input: x + attn(ln1(x)) + mlp(ln2(x)) (GPT-NeoX)",
    )
    shared_norm: bool = Field(
        default=False,
        description="with parallel_residual: one norm feeds both branches, x + attn(ln(x)) + mlp(ln(x)) "
        "(Cohere)",
    )
    norm_bias: bool = Field(
        default=True, description="a LayerNorm's bias [h]; false: Cohere's bias-free LayerNorm"
    )
    rope_scaling: str | None = Field(
        default=None,
        description="the config's rope_scaling type (PhiMoE's longrope): it changes the rotary tables' "
        "values, not their shapes; named in the estimate's notes",
    )
    head_bias: bool = Field(
        default=False, description="the lm head has a bias [vocab_size] (PhiMoE's lm_head_bias)"
    )
    moe: MoEConfig | None = Field(default=None, description="mixture of experts; none: a dense MLP per layer")
    mla: MLAConfig | None = Field(
        default=None, description="multi-head latent attention (DeepSeek-V2/V3); none: W_Q/W_K/W_V per head"
    )
    moe_every: int | None = Field(
        strict=True,
        default=None,
        ge=2,
        description="with moe: layer i is an MoE when (i + 1) % n == 0, the others dense MLPs of "
        "dense_ffn_size (Llama 4's interleave_moe_layer_step); none: every layer an MoE",
    )
    dense_ffn_size: int | None = Field(
        strict=True,
        default=None,
        gt=0,
        description="MLP width of the dense layers between MoE layers (Llama 4's intermediate_size_mlp)",
    )
    nope_every: int | None = Field(
        strict=True,
        default=None,
        ge=1,
        description="layer i has no rotary embedding when (i + 1) % n == 0 (Llama 4's NoPE layers, "
        "no_rope_layer_interval 4); none: every layer rotates",
    )
    attn_chunk: int | None = Field(
        strict=True,
        default=None,
        gt=0,
        description="chunked local attention on the rotary layers: a token attends within its chunk of "
        "C positions (Llama 4's attention_chunk_size); none: full causal",
    )
    qk_l2_norm: bool = Field(
        default=False,
        description="weightless RMSNorm of q and k after RoPE on the rotary layers (Llama 4's use_qk_norm): "
        "no parameters",
    )
    attn_temperature: bool = Field(
        default=False,
        description="q scaled by log1p(floor((pos + 1) / floor_scale))·attn_scale + 1 on the NoPE layers "
        "(Llama 4's attn_temperature_tuning)",
    )
    family: Family | None = Field(
        default=None,
        description="Hugging Face model_type whose modeling code --impl hf follows; none: from the "
        "layout (llama for RMSNorm, gpt2 for LayerNorm with learned positions, gpt_neox with rotary; "
        "mixtral for MoE)",
    )

    @model_validator(mode="after")
    def _derive(self) -> Self:
        h, a = self.hidden_size, self.num_heads
        if self.head_dim is None:
            if h % a:
                raise ValueError(
                    f"num_heads: {a} does not divide hidden_size {h}; choose heads that divide it "
                    "or set head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", h // a)
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", a)
        kv = self.kv_heads
        if kv > a or a % kv:
            raise ValueError(f"num_kv_heads: {kv} must divide num_heads {a} (1 = MQA, {a} = MHA)")
        if self.ffn_size is None:
            if self.mlp is MlpType.SWIGLU:
                raise ValueError("ffn_size: required for swiglu MLPs (e.g. 11008 for Llama-2-7B)")
            object.__setattr__(self, "ffn_size", 4 * h)
        if self.gate_act is not GateActivation.SILU and self.mlp is not MlpType.SWIGLU:
            raise ValueError(f"gate_act: {self.gate_act} gates a swiglu MLP; set mlp = 'swiglu' or drop it")
        if self.shared_norm and not self.parallel_residual:
            raise ValueError("shared_norm: one norm for both branches needs parallel_residual; set it true")
        if not self.norm_bias and self.norm is not NormType.LAYERNORM:
            raise ValueError(
                "norm_bias: only a LayerNorm has a bias; set norm = 'layernorm' or drop norm_bias"
            )
        if self.qk_norm_whole and not self.qk_norm:
            raise ValueError("qk_norm_whole: widens qk_norm; set qk_norm true or drop qk_norm_whole")
        if not self.pre_norms and not self.post_norms:
            raise ValueError("pre_norms: a layer without pre-norms needs post_norms; set post_norms true")
        if self.sliding_window_pattern is not None and self.sliding_window is None:
            raise ValueError("sliding_window_pattern: needs a sliding_window; set one or drop the pattern")
        if self.full_layers is not None:
            if self.sliding_window is None or self.sliding_window_pattern is not None:
                raise ValueError(
                    "full_layers: needs a sliding_window and no sliding_window_pattern; set one or drop it"
                )
            if self.full_layers >= self.num_layers:
                raise ValueError(
                    f"full_layers: {self.full_layers} ≥ num_layers {self.num_layers} leaves no layer "
                    "sliding; drop sliding_window instead"
                )
        self._check_mla()
        if self.moe_every is not None and self.moe is not None and self.moe.dense_layers:
            raise ValueError(
                "moe_every: dense layers between MoE layers and dense first layers (moe.dense_layers) "
                "together are not modelled; keep one of them"
            )
        if (self.moe_every is None) != (self.dense_ffn_size is None) or (self.moe_every and not self.moe):
            raise ValueError(
                "moe_every: dense layers between MoE layers need moe, moe_every and dense_ffn_size together; "
                "set all three or drop moe_every and dense_ffn_size"
            )
        if self.position is PositionType.ROPE and self.dim % 2:
            raise ValueError(f"head_dim: rotary embeddings need an even head_dim, got {self.dim}")
        if self.position is PositionType.ROPE and (self.rotary_dims % 2 or not self.rotary_dims):
            raise ValueError(
                f"rotary_pct: {self.rotary_pct:g} rotates {self.rotary_dims} of {self.dim} dims per head, "
                "which must be even (> 0); choose a fraction giving an even width"
            )
        return self

    def _check_mla(self) -> None:
        """MLA's rotary width is the model's head_dim (transformers' DeepseekV3Config sets it so); every
        head has its own key (kv heads = heads); dense first layers leave at least one MoE layer."""
        if self.mla is not None:
            if self.dim != self.mla.qk_rope_head_dim:
                raise ValueError(
                    f"head_dim: MLA rotates qk_rope_head_dim {self.mla.qk_rope_head_dim} dims; "
                    "set head_dim to it"
                )
            if self.kv_heads != self.num_heads:
                raise ValueError("num_kv_heads: MLA expands its latent to every head; set it to num_heads")
        if self.moe is not None and self.moe.dense_layers >= self.num_layers:
            raise ValueError(
                f"moe.dense_layers: {self.moe.dense_layers} ≥ num_layers {self.num_layers} leaves no MoE "
                "layer; drop moe or lower dense_layers"
            )

    # Typed accessors for the derived fields (never None after validation).
    @property
    def code_family(self) -> Family:
        """The family whose transformers code runs this model (``family``, else read off the layout)."""
        if self.family is not None:
            return self.family
        if self.moe is not None:  # a sigmoid-gated shared expert is Qwen2-MoE's layout
            return Family.QWEN2_MOE if self.moe.shared_gate else Family.MIXTRAL
        if self.norm is NormType.RMSNORM:
            return Family.LLAMA
        return Family.GPT2 if self.position is PositionType.LEARNED else Family.GPT_NEOX

    @property
    def rotary_dims(self) -> int:
        """Rotated width per head, int(d·rotary_pct) (transformers' ``GPTNeoXAttention.rotary_ndims``)."""
        return int(self.dim * self.rotary_pct)

    @property
    def hf_only(self) -> dict[str, bool]:
        """Structure only ``--impl hf`` models (transformers' Gemma-2 and OLMo-2 code), by field."""
        return {
            "post_norms": self.post_norms,
            "attn_softcap": self.attn_softcap is not None,
            "final_softcap": self.final_softcap is not None,
            "sliding_window_pattern": self.sliding_window_pattern is not None,
            "rope_local_theta": self.rope_local_theta is not None,
            "attn_sinks": self.attn_sinks,
            "gate_act": self.gate_act is GateActivation.CLAMPED,
            "moe.router_bias": self.moe is not None and self.moe.router_bias,
            "moe.expert_bias": self.moe is not None and self.moe.expert_bias,
            "moe.input_jitter": self.moe is not None and self.moe.input_jitter > 0,
            "mla": self.mla is not None,
            "moe.dense_layers": self.moe is not None and self.moe.dense_layers > 0,
            "moe.scoring": self.moe is not None and self.moe.sigmoid,
            "moe.groups": self.moe is not None and self.moe.groups is not None,
            "moe.router_sigmoid": self.moe is not None and self.moe.router_sigmoid,
            "moe_every": self.moe_every is not None,
            "nope_every": self.nope_every is not None,
            "attn_chunk": self.attn_chunk is not None,
            "qk_l2_norm": self.qk_l2_norm,
            "attn_temperature": self.attn_temperature,
            "pre_norms": not self.pre_norms,
            "qk_norm_whole": self.qk_norm_whole,
            "shared_norm": self.shared_norm,
            "norm_bias": not self.norm_bias,
            "head_bias": self.head_bias,
        }

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer i is a mixture of experts: not one of DeepSeek's first ``moe.dense_layers``, and
        with ``moe_every`` (i + 1) % n == 0 (Llama 4's ``moe_layers`` default ``range(n - 1, L, n)``)."""
        return (
            self.moe is not None
            and layer >= self.moe.dense_layers  # DeepSeek's first_k_dense_replace
            and (self.moe_every is None or (layer + 1) % self.moe_every == 0)
        )

    def is_nope_layer(self, layer: int) -> bool:
        """Whether layer i has no rotary embedding (``nope_every``: Llama 4's ``no_rope_layers`` default,
        ``int((i + 1) % interval != 0)`` the rotary ones)."""
        return self.nope_every is not None and (layer + 1) % self.nope_every == 0

    @property
    def kv_heads(self) -> int:
        assert self.num_kv_heads is not None  # filled by _derive
        return self.num_kv_heads

    @property
    def dim(self) -> int:
        assert self.head_dim is not None  # filled by _derive
        return self.head_dim

    @property
    def ffn(self) -> int:
        assert self.ffn_size is not None  # filled by _derive
        return self.ffn_size

    @property
    def q_width(self) -> int:
        """Width of the query projection output, a·d (= h unless head_dim is set apart)."""
        return self.num_heads * self.dim

    @property
    def kv_width(self) -> int:
        """Width of each of the key and value projection outputs, kv·d."""
        return self.kv_heads * self.dim
