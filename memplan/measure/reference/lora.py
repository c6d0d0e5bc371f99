"""Fine-tuning in the reference model: LoRA adapters as peft's ``lora.Linear`` computes them, and frozen
parameters (``requires_grad`` False) where ``strategies.lora`` says they do not train.

An adapted linear computes ``base(x) + B(A(drop(x)))·α/r`` (peft: ``lora_B(lora_A(dropout(x))) * scaling``
added to the base layer's output); the dropout is ``native_dropout`` (a bool mask, as everywhere in the
reference model) and is skipped at p = 0 (peft's ``nn.Identity``). A's output is named
``<block>.<target>_lora_mid``, the dropped input ``<block>.<target>_lora_input`` and its mask
``<block>.<target>_lora_mask``, the names of the estimate's saves.

QLoRA: every layer's linear weight is replaced by bitsandbytes' storage (``FourBitWeight``: packed uint8
codes, the absmax per 64 weights — with double quantisation uint8 codes of it, an offset, a fp32 absmax per
256 and the 8-bit code book — and the 16-level code book) and ``dequant_linear`` runs as bitsandbytes'
``MatMul4Bit`` does: dequantise, matmul, free; backward dequantises again for dX and keeps no tensor for
autograd (tests/test_finetune_libraries.py checks MatMul4Bit keeps none). The values are random (the
reference model measures sizes, not accuracy); under fake tensors nothing is allocated.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from memplan.config import Setup
from memplan.config.finetune import ATTN_TARGETS, QUANT_BLOCK, QUANT_BLOCK2, Method, Target, linear_shapes
from memplan.config.trainable import (
    adapted,
    base_trains,
    embedding_trains,
    final_norm_trains,
    head_trains,
)
from memplan.measure.instruments.record import label

if TYPE_CHECKING:
    from memplan.measure.reference.model import Reference


class FourBitWeight(nn.Module):
    """A linear weight [out, in] as bitsandbytes' ``Params4bit`` + ``QuantState`` store it (buffers)."""

    def __init__(self, out_features: int, in_features: int, double_quant: bool, device: torch.device) -> None:
        super().__init__()
        n = out_features * in_features
        blocks = -(-n // QUANT_BLOCK)
        self.shape = (out_features, in_features)
        u8, f32 = torch.uint8, torch.float32
        self.packed = nn.Buffer(torch.randint(0, 256, ((n + 1) // 2, 1), dtype=u8, device=device))
        self.code = nn.Buffer(torch.linspace(-1.0, 1.0, 16, dtype=f32, device=device))
        self.double_quant = double_quant
        if double_quant:
            self.absmax = nn.Buffer(torch.randint(0, 256, (blocks,), dtype=u8, device=device))
            self.offset = nn.Buffer(torch.zeros((), dtype=f32, device=device))
            self.absmax2 = nn.Buffer(torch.rand(-(-blocks // QUANT_BLOCK2), dtype=f32, device=device))
            self.code2 = nn.Buffer(torch.linspace(-1.0, 1.0, 256, dtype=f32, device=device))
        else:
            self.absmax = nn.Buffer(torch.rand(blocks, dtype=f32, device=device))

    def storage_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def dequantize(self, dtype: torch.dtype) -> Tensor:
        """code[nibble] · absmax of its block, [out, in] in ``dtype`` (bitsandbytes' dequantize_4bit)."""
        codes = torch.stack((self.packed >> 4, self.packed & 15), dim=-1).view(-1).long()
        absmax: Tensor = self.absmax
        if self.double_quant:  # absmax = code2[u8] · its block's fp32 absmax + offset
            second = self.absmax2.repeat_interleave(QUANT_BLOCK2)[: absmax.numel()]
            absmax = self.code2[absmax.long()] * second + self.offset
        scale = absmax.repeat_interleave(QUANT_BLOCK)
        n = self.shape[0] * self.shape[1]
        return (self.code[codes][:n] * scale[:n]).view(self.shape).to(dtype)


class _DequantMatmul(torch.autograd.Function):
    """y = x·dequant(W)ᵀ (+ b): the weight stays on ctx (not saved for autograd), dequantised again in
    backward for dX = dY·W; no dW (the base is frozen)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: FourBitWeight, bias: Tensor | None) -> Tensor:
        ctx.weight = weight
        return F.linear(x, weight.dequantize(x.dtype), bias)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return grad @ ctx.weight.dequantize(grad.dtype), None, None


class Linear4bit(nn.Module):
    """A frozen base linear in 4-bit storage, its bias (frozen) in the compute dtype."""

    def __init__(self, base: nn.Linear, setup: Setup) -> None:
        super().__init__()
        w = base.weight
        self.weight4 = FourBitWeight(w.shape[0], w.shape[1], setup.finetune.double_quant, w.device)
        self.bias = base.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        out = _DequantMatmul.apply(x, self.weight4, self.bias)
        assert isinstance(out, Tensor)
        return out


class LoraLinear(nn.Module):
    """A frozen (or trainable) base linear with a LoRA adapter: A [r, in], B [out, r], no biases."""

    def __init__(self, base: nn.Module, setup: Setup, name: str, dtype: torch.dtype) -> None:
        super().__init__()
        ft = setup.finetune
        if isinstance(base, Linear4bit):
            (out_features, in_features), device = base.weight4.shape, base.weight4.packed.device
        else:
            assert isinstance(base, nn.Linear)
            (out_features, in_features), device = base.weight.shape, base.weight.device
        self.base, self.name, self.p, self.scale = base, name, ft.dropout, ft.alpha / ft.rank
        self.lora_A = nn.Parameter(torch.empty(ft.rank, in_features, dtype=dtype, device=device))
        self.lora_B = nn.Parameter(torch.zeros(out_features, ft.rank, dtype=dtype, device=device))
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
    linears = linear_shapes(setup.model).keys()  # the layer's linears: a GELU MLP has no gate
    for i, layer in enumerate(model.layers):
        for p in layer.parameters():
            p.requires_grad_(base_trains(setup, i))
        if setup.finetune.method is Method.QLORA:
            for t in Target:
                if t not in linears:
                    continue
                owner, attr = _owner(layer, t)
                setattr(owner, attr, Linear4bit(getattr(owner, attr), setup))
        # all-linear on a GELU MLP: every linear it has
        for t in sorted(adapted(setup, i) & linears, key=list(Target).index):
            owner, attr = _owner(layer, t)
            block = "attn" if t in ATTN_TARGETS else "mlp"
            lora = LoraLinear(getattr(owner, attr), setup, f"{block}.{t.value}", model.dtype)
            setattr(owner, attr, lora)
    model.embed.requires_grad_(embedding_trains(setup))
    if model.pos is not None:
        model.pos.requires_grad_(embedding_trains(setup))
    if model.head is not None:
        model.head.requires_grad_(head_trains(setup))
    for p in model.final_norm.parameters():
        p.requires_grad_(final_norm_trains(setup))
