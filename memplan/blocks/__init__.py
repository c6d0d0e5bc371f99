"""The building blocks of a decoder-only transformer, one module each, every fact of a block in one place:
its parameters, the tensors it keeps for backward (typed ``save`` rules), its FLOPs per phase and its
backward's transient buffers.

- ``embedding``: token (and learned position) embedding, its dropout;
- ``norm``: the pre-norms (RMSNorm as Llama's reference code, LayerNorm as ``native_layer_norm``);
- ``attention``: W_Q/W_K/W_V/W_O, RoPE, the eager or flash core, its per-forward constants;
- ``mlp``: SwiGLU or GELU;
- ``moe``: the mixture-of-experts MLP (router, experts, shared experts), swapped in for ``mlp``;
- ``head``: the lm head and the loss.

``analytic`` composes them into a layer and a model (``activations.layer_rules``, ``params.count_params``,
``flops.flops``, ``peak``). Shapes: b micro-batch, s sequence, h hidden, a heads, kv key/value heads, d
head dim, f ffn width, v vocabulary, T = b·s tokens; A the activation dtype of the precision recipe.
"""

from __future__ import annotations

from memplan.blocks.inventory import Block, Role, Rule, save
from memplan.config import DType


def mm(m: int, k: int, n: int) -> int:
    """[m, k] @ [k, n]: m·n dot products of length k, a multiply-add each (×2)."""
    return 2 * m * k * n


def linear_params(fan_in: int, fan_out: int, bias: bool) -> int:
    return fan_in * fan_out + (fan_out if bias else 0)


def dropout_rule(
    block: Block, part: str, p: float, shape: tuple[int, ...], keeps: DType = DType.BOOL
) -> list[Rule]:
    """``native_dropout``'s bool mask (when p > 0): dX = dY·mask/(1−p); or the noise ``keeps`` names
    (``blocks.profiles.dropout_keeps``)."""
    why = "dropout mask: dX = dY·mask/(1−p)" if keeps is DType.BOOL else "dropout noise: dX = dY·noise"
    return [save(block, part, shape, keeps, Role.DROPOUT_MASK, why)] if p > 0 else []
