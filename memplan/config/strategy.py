"""Memory-saving strategies of one replica: activation checkpointing, the attention kernel, reversible
layers, ZeRO over data parallelism, and which device's kernels run.

Enums that order strategies are ``IntEnum`` so that rules read ``if zero >= ZeroStage.GRADIENTS``.
"""

from __future__ import annotations

from enum import IntEnum, StrEnum
from typing import Self

from pydantic import Field, model_validator

from memplan.config._base import Frozen


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


class AttentionChoice(StrEnum):
    """The ``--attention`` values; ``Attention`` is an ordered IntEnum, this is its spelling in options."""

    EAGER = "eager"
    FLASH = "flash"

    @property
    def attention(self) -> Attention:
        return Attention[self.name]


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


MAX_DP = 1 << 20
"""The largest data-parallel degree a setup takes (2²⁰ ranks; the largest published jobs use 2¹⁴ GPUs)."""


class StrategyConfig(Frozen):
    checkpointing: Checkpointing = Checkpointing.NONE
    checkpoint_every: int = Field(default=1, gt=0, description="k of every-k checkpointing")
    attention: Attention = Attention.FLASH
    reversible: bool = False
    zero: ZeroStage = ZeroStage.NONE
    dp: int = Field(default=1, gt=0, le=MAX_DP, description="data-parallel degree")

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
