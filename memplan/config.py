"""Configuration models: what the model is, how it is trained, and with which strategy.

Pydantic v2, ``frozen=True, extra="forbid"``. Derived defaults (kv heads, head dim, ffn size) are filled in
validators; a user mistake raises ``ValueError`` naming the field and the fix (pydantic turns it into a
``ValidationError``; the CLI prints one line of it and exits 2).

Enums that order strategies are ``IntEnum`` so that rules read ``if zero >= ZeroStage.GRADIENTS``.
"""

from __future__ import annotations

from enum import IntEnum, StrEnum
from typing import Self

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# ----------------------------------------------------------------------------------------------------
# Architecture
# ----------------------------------------------------------------------------------------------------
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


class PositionType(StrEnum):
    ROPE = "rope"
    """Rotary embeddings applied to q and k; no parameters."""
    LEARNED = "learned"
    """A learned [max_positions, hidden] table added to the token embedding."""


class ModelConfig(_Frozen):
    """A decoder-only transformer, pre-norm, as GPT-2/3 and Llama lay it out."""

    name: str = "custom"
    hidden_size: int = Field(gt=0, description="model width h")
    num_layers: int = Field(gt=0, description="transformer layers L")
    num_heads: int = Field(gt=0, description="query heads a")
    num_kv_heads: int | None = Field(default=None, gt=0, description="key/value heads (GQA/MQA); = heads")
    head_dim: int | None = Field(default=None, gt=0, description="per-head width d; = hidden / heads")
    ffn_size: int | None = Field(default=None, gt=0, description="MLP width; 4h for gelu, none for swiglu")
    vocab_size: int = Field(gt=0, description="vocabulary v")
    tied_embeddings: bool = False
    norm: NormType = NormType.RMSNORM
    norm_eps: float = Field(default=1e-5, gt=0)
    mlp: MlpType = MlpType.SWIGLU
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    position: PositionType = PositionType.ROPE
    max_positions: int = Field(default=4096, gt=0)
    rope_theta: float = Field(default=10000.0, gt=0)
    attn_dropout: float = Field(default=0.0, ge=0, lt=1, description="dropout on attention probabilities")
    resid_dropout: float = Field(default=0.0, ge=0, lt=1, description="dropout after attention and MLP")
    embd_dropout: float = Field(default=0.0, ge=0, lt=1, description="dropout after the embedding")

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
        if self.position is PositionType.ROPE and self.dim % 2:
            raise ValueError(f"head_dim: rotary embeddings need an even head_dim, got {self.dim}")
        return self

    # Typed accessors for the derived fields (never None after validation).
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


# ----------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------
class DType(StrEnum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    INT8 = "int8"
    BOOL = "bool"
    INT64 = "int64"

    @property
    def bytes(self) -> int:
        return _DTYPE_BYTES[self]


_DTYPE_BYTES = {
    DType.FP32: 4,
    DType.BF16: 2,
    DType.FP16: 2,
    DType.INT8: 1,
    DType.BOOL: 1,
    DType.INT64: 8,
}


class Precision(StrEnum):
    """Precision recipe: the dtype of weights, gradients, master copy, optimizer states and activations."""

    FP32 = "fp32"
    """Everything fp32: weights 4, gradients 4, optimizer states fp32, activations fp32."""
    BF16_MIXED = "bf16-mixed"
    """bf16 weights, gradients and activations; fp32 master weights and optimizer states
    (DeepSpeed / ZeRO mixed precision, Megatron without the fp32 grad buffer): 16 bytes/param with AdamW."""
    FP16_MIXED = "fp16-mixed"
    """As bf16-mixed with fp16 (plus a loss scale, which costs no per-parameter memory)."""
    BF16 = "bf16"
    """Pure bf16: weights, gradients, optimizer states and activations in bf16, no master copy."""

    @property
    def activation_dtype(self) -> DType:
        return {
            Precision.FP32: DType.FP32,
            Precision.BF16_MIXED: DType.BF16,
            Precision.FP16_MIXED: DType.FP16,
            Precision.BF16: DType.BF16,
        }[self]

    @property
    def weight_bytes(self) -> int:
        return self.activation_dtype.bytes

    @property
    def grad_bytes(self) -> int:
        return self.activation_dtype.bytes

    @property
    def master_bytes(self) -> int:
        """fp32 master copy kept by the mixed recipes only."""
        return 4 if self in (Precision.BF16_MIXED, Precision.FP16_MIXED) else 0

    @property
    def state_bytes(self) -> int:
        """Bytes of one full-precision optimizer state element (fp32, or bf16 for pure bf16)."""
        return 2 if self is Precision.BF16 else 4


class Optimizer(StrEnum):
    ADAMW = "adamw"
    """Two states (m, v) per parameter."""
    ADAMW_8BIT = "adamw-8bit"
    """bitsandbytes 8-bit AdamW: m and v at 1 byte each (block-wise absmax statistics not counted)."""
    SGD = "sgd"
    """No state."""
    SGD_MOMENTUM = "sgd-momentum"
    """One momentum buffer per parameter."""
    LION = "lion"
    """One momentum buffer per parameter (Chen et al. 2023)."""

    def state_bytes(self, precision: Precision) -> int:
        """Bytes of optimizer state per parameter (the master copy excluded)."""
        if self is Optimizer.ADAMW_8BIT:
            return 2
        n = {Optimizer.ADAMW: 2, Optimizer.SGD: 0, Optimizer.SGD_MOMENTUM: 1, Optimizer.LION: 1}[self]
        return n * precision.state_bytes


class TrainingConfig(_Frozen):
    micro_batch: int = Field(default=1, gt=0, le=1 << 20, description="sequences per micro-batch b")
    seq_len: int = Field(default=2048, gt=0, le=1 << 24, description="tokens per sequence s")
    precision: Precision = Precision.BF16_MIXED
    optimizer: Optimizer = Optimizer.ADAMW
    grad_accum: int = Field(default=1, gt=0, le=1 << 20, description="micro-batches per optimizer step")


# ----------------------------------------------------------------------------------------------------
# Strategy
# ----------------------------------------------------------------------------------------------------
class Checkpointing(IntEnum):
    """Activation checkpointing, ordered by how much of each layer's forward is re-run in backward:
    nothing, the attention core, whole layers. (every-k keeps ⌈L/k⌉ layer inputs, fewer than full's L,
    and re-runs whole segments; torch's early stop skips one matmul per segment, so it re-runs a little
    more than full.)"""

    NONE = 0
    """Keep every activation autograd saves."""
    SELECTIVE = 1
    """Recompute the attention core only (QKᵀ, mask, softmax, dropout, ·V), Korthikanti et al. 2022."""
    EVERY_K = 2
    """Keep the input of every k-th layer; re-run each segment of k layers in backward (Chen et al. 2016)."""
    FULL = 3
    """Keep each layer's input; re-run the whole layer in backward (every-k with k = 1)."""


class Attention(IntEnum):
    """Attention kernel, ordered by memory saved."""

    EAGER = 0
    """Explicit QKᵀ, causal mask, softmax, dropout and ·V: keeps the s×s probabilities per head."""
    FLASH = 1
    """``scaled_dot_product_attention`` on its flash kernel: keeps q, k, v, out and the fp32 logsumexp."""


class ZeroStage(IntEnum):
    """ZeRO data-parallel sharding (Rajbhandari et al. 2019); PyTorch FSDP names in brackets."""

    NONE = 0
    """Plain data parallel: every device holds everything (DDP, NO_SHARD)."""
    OPTIMIZER = 1
    """P_os: optimizer states and master weights sharded over dp."""
    GRADIENTS = 2
    """P_os+g: gradients sharded too (SHARD_GRAD_OP)."""
    PARAMETERS = 3
    """P_os+g+p: 16-bit weights sharded too (FULL_SHARD)."""


class Device(StrEnum):
    """Which kernels the reference model runs on; a handful of saved tensors differ between them."""

    CUDA = "cuda"
    CPU = "cpu"


class StrategyConfig(_Frozen):
    checkpointing: Checkpointing = Checkpointing.NONE
    checkpoint_every: int = Field(default=1, gt=0, description="k of every-k checkpointing")
    attention: Attention = Attention.FLASH
    reversible: bool = False
    zero: ZeroStage = ZeroStage.NONE
    dp: int = Field(default=1, gt=0, le=1 << 20, description="data-parallel degree")

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.reversible and self.checkpointing is not Checkpointing.NONE:
            raise ValueError(
                "reversible: reversible layers already rebuild every layer in backward; "
                "use --checkpointing none with --reversible"
            )
        if self.checkpointing is not Checkpointing.EVERY_K and self.checkpoint_every != 1:
            raise ValueError(
                "checkpoint_every: only every-k checkpointing takes k; use --checkpointing every-K"
            )
        return self

    @property
    def segment(self) -> int:
        """Layers per checkpointed segment: 1 for full, k for every-k (0: not segment-checkpointed)."""
        if self.checkpointing is Checkpointing.FULL:
            return 1
        if self.checkpointing is Checkpointing.EVERY_K:
            return self.checkpoint_every
        return 0


class Setup(_Frozen):
    """Everything one estimate depends on."""

    model: ModelConfig
    training: TrainingConfig = TrainingConfig()
    strategy: StrategyConfig = StrategyConfig()
    device: Device = Device.CUDA

    @model_validator(mode="after")
    def _check(self) -> Self:
        m, t, s = self.model, self.training, self.strategy
        if m.position is PositionType.LEARNED and t.seq_len > m.max_positions:
            raise ValueError(
                f"seq_len: {t.seq_len} exceeds the {m.max_positions} learned positions of {m.name}; "
                f"use --seq {m.max_positions} or less"
            )
        if s.checkpointing is Checkpointing.EVERY_K and s.checkpoint_every > m.num_layers:
            raise ValueError(
                f"checkpointing: every-{s.checkpoint_every} exceeds the {m.num_layers} layers; "
                f"choose k between 1 and {m.num_layers}"
            )
        return self


def parse_checkpointing(text: str) -> tuple[Checkpointing, int]:
    """Parse ``none|full|selective|every-K`` into the enum and k. Raises ValueError with the fix."""
    t = text.strip().lower()
    if t.startswith("every-"):
        k = t.removeprefix("every-")
        if not k.isdigit() or int(k) < 1:
            raise ValueError(f"checkpointing: '{text}' needs a whole k ≥ 1, e.g. every-4")
        return Checkpointing.EVERY_K, int(k)
    names = {c.name.lower(): c for c in Checkpointing if c is not Checkpointing.EVERY_K}
    if t not in names:
        raise ValueError(
            f"checkpointing: unknown '{text}'; choose none, selective, full or every-K (e.g. every-4)"
        )
    return names[t], 1


def checkpointing_label(s: StrategyConfig) -> str:
    if s.checkpointing is Checkpointing.EVERY_K:
        return f"every-{s.checkpoint_every}"
    return s.checkpointing.name.lower()
