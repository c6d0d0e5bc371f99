"""Reversible layers in the reference model: RevNet coupling y1 = x1 + F(x2), y2 = x2 + G(y1) (Gomez et al.
2017; Reformer, Kitaev et al. 2020) in an ``autograd.Function`` that keeps only the stack's last outputs and
rebuilds every layer's inputs in backward, re-running dropout with the forward's RNG state; its gradients
equal autograd's (tests/measure/test_reversible.py)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from memplan.measure.instruments.record import layer_scope, relabel

if TYPE_CHECKING:  # the model calls this module; these only name its types
    from memplan.measure.reference.model import Consts, Layer, Reference


@contextmanager
def rng_restored(state: tuple[Tensor, Tensor | None] | None, device: torch.device) -> Iterator[None]:
    """Re-run dropout with the RNG state the forward used (nothing to do without dropout)."""
    if state is None:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state(state[1], device)
        yield


def rng_state(model: Reference, device: torch.device) -> tuple[Tensor, Tensor | None] | None:
    m = model.setup.model
    if m.attn_dropout == 0 and m.resid_dropout == 0:
        return None
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


class _RevStack(torch.autograd.Function):
    """y1 = x1 + F(x2), y2 = x2 + G(y1) over all layers; keeps only the last (y1, y2).

    Backward walks the layers down: x2 = y2 − G(y1), x1 = y1 − F(x2), re-running F and G with grad enabled
    to get their input and parameter gradients (the recompute: one extra forward per layer).
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, model: Reference, consts: Consts, *params: Tensor) -> Tensor:
        ctx.model, ctx.consts = model, consts
        ctx.rng = []
        x1, x2 = x, x
        for i, module in enumerate(model.layers):
            layer = cast("Layer", module)
            with layer_scope(i):
                rng_f = rng_state(model, x.device)
                y1 = x1 + model.attention(layer, x2, consts)
                rng_g = rng_state(model, x.device)
                y2 = x2 + model.mlp(layer, y1)
            ctx.rng.append((rng_f, rng_g))
            x1, x2 = y1, y2
        with layer_scope(None):
            relabel(x1, "rev.y1")
            relabel(x2, "rev.y2")
        ctx.save_for_backward(x1, x2, *consts.tensors())
        return (x1 + x2) * 0.5

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        model: Reference = ctx.model
        y1, y2 = ctx.saved_tensors[:2]
        c: Consts = ctx.consts
        dy1 = dy2 = grad * 0.5
        grads: list[Tensor | None] = []
        for i in reversed(range(len(model.layers))):
            layer = cast("Layer", model.layers[i])
            y1, y2, dy1, dy2, g = _rev_layer_backward(model, layer, c, ctx.rng[i], y1, y2, dy1, dy2)
            grads = g + grads
        return (dy1 + dy2, None, None, *grads)


def _rev_layer_backward(
    model: Reference,
    layer: Layer,
    c: Consts,
    rng: tuple[Any, Any],
    y1: Tensor,
    y2: Tensor,
    dy1: Tensor,
    dy2: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, list[Tensor | None]]:
    params = list(layer.parameters())
    attn_params = [
        p
        for n, p in layer.named_parameters()
        if n.split(".")[0] in ("attn_norm", "q", "k", "v", "o", "q_norm", "k_norm")
    ]
    mlp_params = [p for p in params if all(p is not q for q in attn_params)]
    with torch.enable_grad():
        y1 = y1.detach().requires_grad_()
        with model.recompute_phase(), rng_restored(rng[1], y1.device):
            g = model.mlp(layer, y1)
        d_y1, *d_mlp = torch.autograd.grad(g, [y1, *mlp_params], dy2)
        x2 = (y2 - g).detach().requires_grad_()
        dy1 = dy1 + d_y1
        with model.recompute_phase(), rng_restored(rng[0], x2.device):
            f = model.attention(layer, x2, c)
        d_x2, *d_attn = torch.autograd.grad(f, [x2, *attn_params], dy1)
        x1 = (y1 - f).detach()
    by_id = {id(p): gr for p, gr in zip([*attn_params, *mlp_params], [*d_attn, *d_mlp], strict=True)}
    return x1, x2.detach(), dy1, dy2 + d_x2, [by_id[id(p)] for p in params]


def reversible_stack(model: Reference, x: Tensor, c: Consts) -> Tensor:
    params: Sequence[Tensor] = [p for layer in model.layers for p in layer.parameters()]
    out = _RevStack.apply(x, model, c, *params)
    assert isinstance(out, Tensor)
    return out
