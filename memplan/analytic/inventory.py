"""The inventory's vocabulary: one logical tensor autograd keeps for the backward pass, and a lookup of sizes.

A `Kept` entry names a tensor by the layer's data flow (``attn_norm.input``, ``attn.q``, ``loss.log_probs``),
gives its shape, dtype and the bytes of the storage that stays alive (views share a storage and are counted
once), how many such tensors the model keeps (``count``: one per layer for layer entries) and why backward
needs it.
"""

from __future__ import annotations

import math
from enum import StrEnum

from pydantic import BaseModel, ConfigDict

from memplan.config import DType, Setup


class Scope(StrEnum):
    LAYER = "layer"
    """One per transformer layer (count = layers held on the device)."""
    MODEL = "model"
    """Once per model: embeddings, shared constants, final norm, lm head, loss."""


class Kept(BaseModel):
    """One logical tensor autograd keeps for backward."""

    model_config = ConfigDict(frozen=True)
    name: str
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

    @classmethod
    def of(cls, setup: Setup) -> Dims:
        m, t = setup.model, setup.training
        return cls(
            b=t.micro_batch,
            s=t.seq_len,
            h=m.hidden_size,
            a=m.num_heads,
            kv=m.kv_heads,
            d=m.dim,
            f=m.ffn,
            v=m.vocab_size,
            layers=m.num_layers,
            act=t.precision.activation_dtype,
        )

    @property
    def tokens(self) -> int:
        return self.b * self.s
