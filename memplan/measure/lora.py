"""Fine-tuning in the reference model: LoRA adapters as peft's ``lora.Linear`` computes them, and frozen
parameters (``requires_grad`` False) where ``strategies.lora`` says they do not train.

An adapted linear computes ``base(x) + B(A(drop(x)))·α/r`` (peft: ``lora_B(lora_A(dropout(x))) * scaling``
added to the base layer's output); the dropout is ``native_dropout`` (a bool mask, as everywhere in the
reference model) and is skipped at p = 0 (peft's ``nn.Identity``). A's output is named
``<block>.<target>_lora_mid``, the dropped input ``<block>.<target>_lora_input`` and its mask
``<block>.<target>_lora_mask``, the names of the estimate's saves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memplan.config import Setup
from memplan.config.finetune import Target
from memplan.measure.instruments import label
from memplan.strategies.lora import (
    ATTN_TARGETS,
    adapted,
    base_trains,
    embedding_trains,
    final_norm_trains,
    head_trains,
)

if TYPE_CHECKING:
    from memplan.measure.model import Reference


class LoraLinear(nn.Module):
    """A frozen (or trainable) base linear with a LoRA adapter: A [r, in], B [out, r], no biases."""

    def __init__(self, base: nn.Linear, setup: Setup, name: str) -> None:
        super().__init__()
        ft = setup.finetune
        w = base.weight
        self.base, self.name, self.p, self.scale = base, name, ft.dropout, ft.alpha / ft.rank
        self.lora_A = nn.Parameter(torch.empty(ft.rank, w.shape[1], dtype=w.dtype, device=w.device))
        self.lora_B = nn.Parameter(torch.zeros(w.shape[0], ft.rank, dtype=w.dtype, device=w.device))
        with torch.no_grad():
            self.lora_A.normal_(0.0, 0.02)

    def forward(self, x: Tensor) -> Tensor:
        y = self.base(x)
        if self.p > 0:
            x, mask = torch.native_dropout(x, self.p, True)
            label(mask, f"{self.name}_lora_mask")
            label(x, f"{self.name}_lora_input")
        mid = label(F.linear(x, self.lora_A), f"{self.name}_lora_mid")
        return y + F.linear(mid, self.lora_B) * self.scale


def _owner(layer: nn.Module, t: Target) -> tuple[nn.Module, str]:
    """The module holding target ``t``'s linear and its attribute name."""
    attr = {Target.Q: "q", Target.K: "k", Target.V: "v", Target.O: "o"}.get(t)
    if attr is not None:
        return layer, attr
    return cast(nn.Module, layer.mlp), t.value


def apply_finetune(model: Reference) -> None:
    """Freeze what does not train and wrap each adapted linear (a no-op under plain full training)."""
    setup = model.setup
    if setup.finetune.trains_everything:
        return
    for i, layer in enumerate(model.layers):
        for p in layer.parameters():
            p.requires_grad_(base_trains(setup, i))
        for t in sorted(adapted(setup, i), key=list(Target).index):
            owner, attr = _owner(layer, t)
            block = "attn" if t in ATTN_TARGETS else "mlp"
            setattr(owner, attr, LoraLinear(getattr(owner, attr), setup, f"{block}.{t.value}"))
    model.embed.requires_grad_(embedding_trains(setup))
    if model.pos is not None:
        model.pos.requires_grad_(embedding_trains(setup))
    if model.head is not None:
        model.head.requires_grad_(head_trains(setup))
    for p in model.final_norm.parameters():
        p.requires_grad_(final_norm_trains(setup))
