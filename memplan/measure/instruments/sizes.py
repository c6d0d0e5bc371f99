"""Sizes a measured run can build: torch indexes tensors with int64, even fake ones."""

from __future__ import annotations

import math
from collections.abc import Iterable

from memplan.blocks.inventory import Kept, Role

INT64_MAX = (1 << 63) - 1
WIDEST = 4
"""Bytes per element of the widest tensor a run builds from a saved one (an fp32 upcast, fp32 log-probs)."""


def check_sizes(tensors: Iterable[Kept]) -> None:
    """Raise ValueError (seq and batch, the fix) when a tensor of the run would be too large for torch to
    index: its elements, or its bytes at the widest dtype, above int64's range (torch's sizes and storage
    offsets are int64; a larger shape overflows in ``torch.empty`` even under fake tensors)."""
    big = max(tensors, key=lambda k: math.prod(k.shape), default=None)
    if big is None or math.prod(big.shape) * WIDEST <= INT64_MAX:
        return
    shape = " × ".join(map(str, big.shape))
    flash = " or --attention flash (no s×s tensor)" if big.role in (Role.ATTN_PROBS, Role.CAUSAL_MASK) else ""
    raise ValueError(
        f"seq: {big.name} would be {shape} = {math.prod(big.shape):.3g} elements, beyond the int64 sizes "
        f"torch can allocate even as a fake tensor; use a smaller --seq or --batch{flash}"
    )
