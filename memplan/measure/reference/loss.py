"""The reference model's lm head and loss, in the four variants of ``config.LossKind`` (blocks/head.py
describes what each keeps), as plain torch code equivalent to the libraries they follow:

- ``standard_loss``: fp32 logits, ``log_softmax`` + ``nll_loss`` (what ``F.cross_entropy`` runs), mean.
- ``chunked_loss``: torchtune — ``TransformerDecoder.chunked_output`` (``hidden.chunk(N, dim=1)``, the lm
  head per chunk) and ``CEWithChunkedOutputLoss`` (labels chunked and ``reshape(-1)``'d, each chunk's logits
  ``.float()``'d and ``cross_entropy(reduction="sum")``'d, the sum divided by the count of labels that are
  not ``ignore_index``).
- ``xentropy_loss``: flash_attn's fused cross-entropy kernel (``FlashCrossEntropy``) over the lm head's
  logits as they come (16-bit under mixed precision), mean over the labels that are not ``ignore_index``.
- ``FusedLinearCrossEntropy``: Liger's ``LigerFusedLinearCrossEntropyFunction`` without triton — per chunk
  of rows (Liger's chunk size) the logits, their fp32 softmax gradient (p − onehot)/n, ``grad_input[chunk] =
  dlogits·W`` and ``grad_weight += dlogitsᵀ·X`` (``torch.addmm(..., out=grad_weight)`` as Liger writes it);
  ``ctx`` keeps grad_input and grad_weight; backward scales them by the incoming gradient in place.

Known limitations: Liger's kernel computes the softmax in fp32 registers over the chunk's logits in place;
this one makes an fp32 copy of the chunk (a forward transient, not a kept tensor). The fused loss takes every
label as valid (the reference batch has no ``ignore_index``): Liger's ``.item()`` count of them would stop
a fake-tensor run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from memplan.blocks.head import liger_chunk_rows
from memplan.config import LossKind, Setup
from memplan.measure.instruments.record import label

IGNORE = -100


def head_loss(
    setup: Setup,
    y: Tensor,
    weight: Tensor,
    labels: Tensor,
    head: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """The mean cross-entropy of the lm head over the final norm's output ``y`` [b, s, h]; ``head`` makes
    the standard loss's logits from y (default ``F.linear(y, weight)``; the reference model's hooks it for
    ``profile``'s curve and a vocabulary-parallel rank)."""
    if setup.loss is LossKind.FUSED:
        h = y.shape[-1]
        out = FusedLinearCrossEntropy.apply(y.reshape(-1, h), weight, labels.reshape(-1))
        return out
    if setup.loss is LossKind.CHUNKED:
        return chunked_loss(y, weight, labels, setup.loss_chunks)
    y = label(y, "lm_head.input")
    if setup.loss is LossKind.XENTROPY:
        return xentropy_loss(F.linear(y, weight) if head is None else head(y), labels)
    return standard_loss(F.linear(y, weight) if head is None else head(y), labels)


def standard_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Cross-entropy over fp32 logits, spelled out so log-probs and nll_loss's total weight are named."""
    v = logits.shape[-1]
    log_probs = label(torch.log_softmax(logits.float().view(-1, v), dim=-1), "loss.log_probs")
    # reduction 1 = mean, ignore_index -100, as F.cross_entropy's defaults.
    loss, total_weight = torch.ops.aten.nll_loss_forward(
        log_probs, label(labels, "loss.labels").view(-1), None, 1, IGNORE
    )
    label(total_weight, "loss.total_weight")
    return loss


def chunked_loss(y: Tensor, weight: Tensor, labels: Tensor, chunks: int) -> Tensor:
    """torchtune's chunked output and ``CEWithChunkedOutputLoss`` (module docstring)."""
    label(y, "lm_head.input")
    label(labels, "loss.labels")
    # F.linear(chunk, weight) on a [b, c, h] chunk folds it to [b·c, h] with reshape (aten matmul's
    # _matmul_impl), a copy when b > 1 (the chunk is not contiguous): spelled out to name that copy.
    h = y.shape[-1]
    logits = [
        F.linear(label(chunk.reshape(-1, h), "lm_head.input"), weight) for chunk in y.chunk(chunks, dim=1)
    ]
    targets = [label(t.reshape(-1), "loss.labels") for t in labels.chunk(chunks, dim=1)]
    total = label((labels != IGNORE).sum(), "loss.count")
    loss: Tensor = sum(  # type: ignore[assignment]
        (_chunk_cross_entropy(c, t) for c, t in zip(logits, targets, strict=True)), 0.0
    )
    return loss / total


def _chunk_cross_entropy(logits: Tensor, target: Tensor) -> Tensor:
    """``F.cross_entropy(logits.float().reshape(-1, v), target, reduction="sum")``, its saves named."""
    v = logits.shape[-1]
    log_probs = label(torch.log_softmax(logits.float().reshape(-1, v), dim=-1), "loss.log_probs")
    loss, total_weight = torch.ops.aten.nll_loss_forward(log_probs, target, None, 2, IGNORE)
    label(total_weight, "loss.total_weight")
    return loss


XENTROPY_ROWS = 256
"""Rows per step of the reference's flash_attn cross-entropy (its fp32 working chunk; the kernel works in
registers, one row per program)."""


def xentropy_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """flash_attn's ``CrossEntropyLoss`` (reduction ``mean``): the kernel's per-token losses, summed and
    divided by the count of labels that are not ``ignore_index`` (an int64 scalar the division keeps)."""
    v = logits.shape[-1]
    losses = FlashCrossEntropy.apply(logits.view(-1, v), labels.view(-1))
    count = label((labels != IGNORE).sum(), "loss.count")
    return losses.sum() / count


class FlashCrossEntropy(torch.autograd.Function):
    """flash_attn's fused cross-entropy (``flash_attn/ops/triton/cross_entropy.py``, ``CrossEntropyLoss``)
    in plain torch: forward the fp32 logsumexp and losses of the logits as given (16-bit under mixed
    precision), ``ctx.save_for_backward(logits, lse, labels)``; backward
    ``dlogits = torch.empty_like(logits)`` filled with (softmax − onehot)·dloss, ignored rows zero. NB: the
    kernel computes each row in fp32 registers; this one makes an fp32 copy of ``XENTROPY_ROWS`` rows at a
    time (a transient, not kept)."""

    @staticmethod
    def forward(ctx: Any, logits: Tensor, labels: Tensor) -> Tensor:
        rows = logits.shape[0]
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
        losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
        valid = labels != IGNORE
        safe = labels.clamp_min(0)
        for start in range(0, rows, XENTROPY_ROWS):
            part = slice(start, start + XENTROPY_ROWS)
            chunk = logits[part].float()
            lse[part] = torch.logsumexp(chunk, dim=-1)
            picked = chunk.gather(1, safe[part, None]).squeeze(1)
            losses[part] = (lse[part] - picked) * valid[part]
        ctx.save_for_backward(
            label(logits, "loss.logits"), label(lse, "loss.lse"), label(labels, "loss.labels")
        )
        return losses

    @staticmethod
    def backward(ctx: Any, grad_losses: Tensor) -> tuple[Tensor, None]:
        logits, lse, labels = ctx.saved_tensors
        dlogits = torch.empty_like(logits)
        valid = labels != IGNORE
        safe = labels.clamp_min(0)
        for start in range(0, logits.shape[0], XENTROPY_ROWS):
            part = slice(start, start + XENTROPY_ROWS)
            probs = (logits[part].float() - lse[part, None]).exp_()
            probs.scatter_add_(1, safe[part, None], -valid[part, None].to(probs.dtype))
            dlogits[part] = probs.mul_((grad_losses[part] * valid[part])[:, None])
        return dlogits, None


class FusedLinearCrossEntropy(torch.autograd.Function):
    """Liger's fused linear cross-entropy, mean reduction (module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, target: Tensor) -> Tensor:
        rows, h = x.shape
        chunk = liger_chunk_rows(rows, h, weight.shape[0])
        # Liger: grad_input always allocated, written where the input needs a gradient; grad_weight only
        # where the weight needs one (a frozen head under LoRA: None, nothing kept, no dW product)
        # (Liger reads ``_input.requires_grad`` and ``weight.requires_grad``: ctx.needs_input_grad here)
        needs_x, needs_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_input = torch.zeros_like(x)
        grad_weight = torch.zeros_like(weight) if needs_x and needs_w else None
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        n = rows  # every label valid (module docstring)
        for start in range(0, rows, chunk):
            xc, tc = x[start : start + chunk], target[start : start + chunk]
            logits = (xc @ weight.t()).float()  # [c, v]
            lse = torch.logsumexp(logits, dim=-1)
            loss = loss + (lse - logits.gather(1, tc[:, None]).squeeze(1)).sum() / n
            grad = logits.sub_(lse[:, None]).exp_()  # softmax, over the logits
            grad.scatter_add_(1, tc[:, None], torch.full_like(grad[:, :1], -1.0)).div_(n)
            dlogits = grad.to(x.dtype)
            if needs_x:
                grad_input[start : start + chunk] = dlogits @ weight
            if grad_weight is not None:
                torch.addmm(grad_weight, dlogits.t(), xc, out=grad_weight)
        kept = None if grad_weight is None else label(grad_weight, "loss.grad_weight")
        ctx.save_for_backward(label(grad_input, "loss.grad_input"), kept)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor, Tensor | None, None]:
        grad_input, grad_weight = ctx.saved_tensors
        # Liger skips the scaling when grad_output is 1.0 (a data-dependent test); in place either way.
        grad_input.mul_(grad_output.to(grad_input.dtype))
        if grad_weight is not None:
            grad_weight.mul_(grad_output.to(grad_weight.dtype))
        return grad_input, grad_weight, None
