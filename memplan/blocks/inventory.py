"""The inventory's vocabulary: one logical tensor autograd keeps for the backward pass, and a lookup of sizes.

A `Kept` entry names a tensor by the layer's data flow (``attn_norm.input``, ``attn.q``, ``loss.log_probs``),
gives its shape, dtype and the bytes of the storage that stays alive (views share a storage and are counted
once), how many such tensors the model keeps (``count``: one per layer for layer entries) and why backward
needs it. Names are for people (and for matching the measurement, which labels the same names); code keys
on two typed tags every entry carries:

- ``block``: where in the model it is kept (the embedding, a layer's attention norm, the attention, …, the
  loss): pipeline placement and the peak's moments (what is freed when) key on it;
- ``role``: what the tensor is (a norm's input, its statistics, the attention probabilities, a dropout
  mask, …): the split under tensor, sequence and expert parallelism keys on it
  (``strategies.sequence_parallel.SPLITS``, one rule per role; a role without a rule is an error).
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict

from memplan.config import DType, Setup, unvalidated


class Scope(StrEnum):
    LAYER = "layer"
    """One per transformer layer (count = layers held on the device)."""
    MODEL = "model"
    """Once per model: embeddings, shared constants, final norm, lm head, loss."""


class Block(StrEnum):
    """Where a kept tensor lives; the value is its name's prefix."""

    EMBED = "embed"
    """The token (and position) embedding and its dropout."""
    ROPE = "rope"
    """Rotary tables made once per forward, read by every layer."""
    CONST = "const"
    """Other per-forward constants every layer reads (the causal mask)."""
    REVERSIBLE = "rev"
    """A reversible stack's last outputs, from which backward rebuilds every layer's input."""
    CHECKPOINT = "layer"
    """A checkpointed segment's input."""
    ATTN_NORM = "attn_norm"
    ATTN = "attn"
    MLP_NORM = "mlp_norm"
    MLP = "mlp"
    POST_ATTN_NORM = "post_attn_norm"
    """The norm on the attention's output before the residual add (Gemma-2's ``post_norms``)."""
    POST_MLP_NORM = "post_mlp_norm"
    """The norm on the MLP's output before the residual add (Gemma-2's ``post_norms``)."""
    MOE = "moe"
    """A mixture-of-experts MLP's saves beyond its input (router, dispatch, experts, shared experts)."""
    FINAL_NORM = "final_norm"
    LM_HEAD = "lm_head"
    LOSS = "loss"
    PIPELINE = "pp"
    """A pipeline stage's boundary: the output its schedule keeps for the backward, its receive buffers."""

    @property
    def in_layer(self) -> bool:
        """Part of a transformer layer's own saves (what a re-run layer rebuilds)."""
        return self in _LAYER_BLOCKS

    @property
    def in_head(self) -> bool:
        """Part of the head: the final norm, the lm head and the loss."""
        return self in (Block.FINAL_NORM, Block.LM_HEAD, Block.LOSS)


_LAYER_BLOCKS = frozenset(
    {
        Block.ATTN_NORM,
        Block.ATTN,
        Block.MLP_NORM,
        Block.MLP,
        Block.MOE,
        Block.POST_ATTN_NORM,
        Block.POST_MLP_NORM,
    }
)


class Role(StrEnum):
    """What a kept tensor is, whatever block keeps it."""

    TOKEN_IDS = "token ids"
    """Token or position ids (int64)."""
    RESIDUAL = "residual"
    """The residual stream between layers: a checkpoint's input, a reversible stack's output."""
    NORM_INPUT = "norm input"
    NORM_STATS = "norm statistics"
    """mean / rstd over the hidden dimension, [b, s, 1]."""
    NORM_OUTPUT = "norm output"
    LINEAR_INPUT = "linear input"
    """Input of a column-parallel linear (W_Q/W_K/W_V, the MLP's first matrices, the lm head)."""
    ROPE_TABLE = "rope table"
    CAUSAL_MASK = "causal mask"
    ATTN_QKV = "attention q/k/v"
    """q, k or v as the attention core reads them (heads-major, or v's [b, s, kv·d] projection output)."""
    ATTN_PROBS = "attention probabilities"
    ATTN_DROPOUT_MASK = "attention dropout mask"
    ATTN_LSE = "attention logsumexp"
    RNG_STATE = "rng state"
    """The CUDA flash kernel's RNG state ([2] uint64: philox seed and offset) and its unused [] uint64."""
    ATTN_OUT = "attention output"
    """Input of the row-parallel W_O."""
    DROPOUT_MASK = "dropout mask"
    """A dropout mask on the residual stream (after W_O, the MLP or the embedding)."""
    MLP_INNER = "mlp inner"
    """Between an MLP's column- and row-parallel matrices: gate, act, up, down input (f wide)."""
    LOG_PROBS = "log-probs"
    LABELS = "labels"
    LOSS_SCALAR = "loss scalar"
    CHUNK_SCALAR = "chunk loss scalar"
    """torchtune's chunked loss: a chunk's nll_loss normaliser and the count the sum is divided by — freed
    by the loss's backward, before the final norm's (the standard loss's normaliser and a trainer's count
    outlive it)."""
    CHUNK_LABELS = "chunk labels copy"
    """torchtune's chunked loss at b > 1: a chunk's labels copy, freed with its nll_loss node (the loop's
    labels outlive it)."""
    HEAD_INPUT_GRAD = "head input gradient"
    """dL/dX of the lm head's input [T, h], made in forward by a fused linear cross-entropy."""
    HEAD_WEIGHT_GRAD = "head weight gradient"
    """dL/dW of the lm head's weight [v, h], made in forward by a fused linear cross-entropy."""
    ROUTER = "router"
    """Router probabilities and top-k selections, per token."""
    DISPATCH_INDEX = "dispatch index"
    """Which token or top-k slot fills each expert slot."""
    EXPERT_TOKENS = "expert tokens"
    """Tokens dispatched to the experts, their outputs and routing weights ([S, ·] slots)."""
    SHARED_GATE = "shared-expert gate"
    """The shared experts' sigmoid gate and gated output, per token."""
    PARAM_DERIVED = "parameter-derived"
    """Made from a weight or a constant, not from the tokens (Gemma's fp32 1 + w, its √h normaliser)."""
    LORA_RANK = "lora rank"
    """A LoRA adapter's A·x [·, r]: the input of B, dB = (A·x)ᵀ·dY needs it."""
    STAGE_OUTPUT = "stage output"
    """What a pipeline stage sent forward, kept by its schedule until that micro-batch's backward."""
    RECV_BUFFER = "receive buffer"
    """A pipeline stage's buffer for a received activation or gradient."""


class Kept(BaseModel):
    """One logical tensor autograd keeps for backward."""

    model_config = ConfigDict(frozen=True)
    name: str
    block: Block
    role: Role
    shape: tuple[int, ...]
    dtype: DType
    scope: Scope
    count: int
    reason: str

    @property
    def bytes(self) -> int:
        """Bytes of one instance: elements × element size."""
        return math.prod(self.shape) * self.dtype.bytes

    @property
    def total_bytes(self) -> int:
        return self.bytes * self.count


class Dims(BaseModel):
    """The sizes every activation formula speaks in (one micro-batch on one device)."""

    model_config = ConfigDict(frozen=True)
    b: int
    s: int
    h: int
    a: int
    kv: int
    d: int
    f: int
    v: int
    layers: int
    act: DType
    ring: int = 1
    """Context-parallel ranks the attention's keys span (ring attention): s is one rank's s/cp tokens."""
    dqk: int = 0
    """Per-head query/key width where it differs from d (MLA: d_n + d_r); 0: d."""
    dv: int = 0
    """Per-head value width where it differs from d (MLA's v_head_dim); 0: d."""

    @classmethod
    def of(cls, setup: Setup) -> Dims:
        """The sizes one device speaks in: with context parallelism its s/cp tokens (the check of the
        layout ensures cp divides s), the keys of all cp ranks in the ring."""
        m, t, cp = setup.model, setup.training, setup.parallel.cp
        # unvalidated (``fit`` makes ≈ 10⁴): every field from a validated Setup, in declaration order
        return unvalidated(
            cls,
            b=t.micro_batch,
            s=t.seq_len // cp,
            h=m.hidden_size,
            a=m.num_heads,
            kv=m.kv_heads,
            d=m.dim,
            f=m.ffn,
            v=m.vocab_size,
            layers=m.num_layers,
            act=t.precision.activation_dtype,
            ring=cp,
            dqk=m.mla.qk_head_dim if m.mla else 0,
            dv=m.mla.v_head_dim if m.mla else 0,
        )

    @property
    def tokens(self) -> int:
        return self.b * self.s

    @property
    def qk_dim(self) -> int:
        """Each head's query/key width (MLA's d_n + d_r, else d)."""
        return self.dqk or self.d

    @property
    def v_dim(self) -> int:
        """Each head's value width (MLA's v_head_dim, else d): the attention output is a·v_dim wide."""
        return self.dv or self.d


class Rule(NamedTuple):
    """One save of one op before its scope and count are attached: ``block.part`` names it."""

    name: str
    shape: tuple[int, ...]
    dtype: DType
    reason: str
    block: Block
    role: Role

    @property
    def bytes(self) -> int:
        return math.prod(self.shape) * self.dtype.bytes


def save(block: Block, part: str, shape: tuple[int, ...], dtype: DType, role: Role, reason: str) -> Rule:
    """The save ``<block>.<part>`` (e.g. ``attn.q``) with its tags."""
    return Rule(f"{block.value}.{part}", shape, dtype, reason, block, role)
