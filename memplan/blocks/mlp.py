"""The MLP: SwiGLU down(silu(gate(x))·up(x)) with three h×f matrices, or GELU fc2(gelu(fc1(x))) with two."""

from __future__ import annotations

from memplan.analytic.inventory import Block, Dims, Role, Rule, save
from memplan.blocks import linear_params, mm
from memplan.blocks.profiles import profile_of
from memplan.config import DType, MlpType, ModelConfig, Setup

B, R = Block, Role


def mlp_params(m: ModelConfig) -> int:
    h, f, b = m.hidden_size, m.ffn, m.mlp_bias
    up = linear_params(h, f, b)
    down = linear_params(f, h, b)
    return (2 * up if m.mlp is MlpType.SWIGLU else up) + down


def mlp_inner_rules(setup: Setup, block: Block, part: str, shape: tuple[int, ...], act: DType) -> list[Rule]:
    """What an MLP keeps between its first matrices and its last, each of ``shape`` ([·, f]): SwiGLU's
    gate, act, up and down input, GELU's fc1 output and fc2 input. ``part`` prefixes the names."""

    def inner(name: str, why: str) -> Rule:
        return save(block, part + name, shape, act, R.MLP_INNER, why)

    if setup.model.mlp is MlpType.SWIGLU and profile_of(setup).fused_gate_up:
        fused = (*shape[:-1], 2 * shape[-1])
        return [
            save(block, part + "gate_up", fused, act, R.MLP_INNER, "fused gate|up output: act and · read it"),
            inner("act", "act(g) for the product act(g)·u: du needs it"),
            inner("down_input", "input of W_down: dW = Xᵀ·dY"),
        ]
    if setup.model.mlp is MlpType.SWIGLU:
        return [
            inner("gate", "gate projection: silu'(g) needs g"),
            inner("act", "silu(g) for the product silu(g)·u: du needs it"),
            inner("up", "up projection for the product: d silu(g) needs u"),
            inner("down_input", "input of W_down: dW = Xᵀ·dY"),
        ]
    return [
        inner("up", "fc1 output: gelu'(x) needs x"),
        inner("down_input", "gelu output, input of fc2: dW = Xᵀ·dY"),
    ]


def mlp_rules(setup: Setup, dims: Dims) -> list[Rule]:
    b, s, h, f, act = dims.b, dims.s, dims.h, dims.f, dims.act
    return [
        save(B.MLP, "input", (b, s, h), act, R.LINEAR_INPUT, "input of the MLP's first matrices: dW = Xᵀ·dY"),
        *mlp_inner_rules(setup, B.MLP, "", (b, s, f), act),
    ]


def mlp_flops(setup: Setup, dims: Dims) -> int:
    """Forward FLOPs of the MLP's matrices: 2·T·h·f each (3 for SwiGLU, 2 for GELU)."""
    mats = 3 if setup.model.mlp is MlpType.SWIGLU else 2
    return mats * mm(dims.tokens, dims.h, dims.f)


def early_stop_skip(setup: Setup, dims: Dims) -> int:
    """The forward FLOPs a checkpointed segment ending in this MLP never re-runs: its last save is W_down's
    input, saved before W_down runs, so the early-stopping re-run skips W_down, [T, f]·[f, h]."""
    return mm(dims.tokens, dims.f, dims.h)


def mlp_backward_transient(setup: Setup, dims: Dims) -> int:
    """MLP backward at the product's gradient: dY [T, h] coming in, d(down input) and the two operand
    gradients [T, f] (SwiGLU; GELU: one fewer), and the down projection's weight gradient, already made;
    the down projection's saved input is released once its backward has run (a [T, f] fewer).
    Or earlier, whichever is larger: ``down_backward_transient``."""
    a_bytes = dims.act.bytes
    t = dims.tokens
    f_buffers = (3 if setup.model.mlp is MlpType.SWIGLU else 2) * t * dims.f * a_bytes
    down = (dims.f * dims.h + (dims.h if setup.model.mlp_bias else 0)) * setup.training.precision.grad_bytes
    later = t * dims.h * a_bytes + f_buffers + down - t * dims.f * a_bytes
    return max(later, down_backward_transient(setup, dims))


def down_backward_transient(setup: Setup, dims: Dims) -> int:
    """The down projection's own backward, its saved input still alive: dY [T, h], with residual dropout
    also the dropout's input gradient [T, h] (its bool mask freed), then d(down input) [T, f], the weight
    gradient and the bias gradient. A checkpoint's re-run input is released right after its last use, the
    weight gradient's matmul, before the bias gradient is made: the peak is at that matmul then."""
    a_bytes, t, h = dims.act.bytes, dims.tokens, dims.h
    dropout = 0
    if setup.model.resid_dropout > 0:
        mask = t * h * DType.BOOL.bytes  # the bool mask of the dropout after W_down
        dropout = t * h * a_bytes - mask
    bias = h if setup.model.mlp_bias and not setup.strategy.segment else 0
    grads = (dims.f * h + bias) * setup.training.precision.grad_bytes
    return t * h * a_bytes + dropout + t * dims.f * a_bytes + grads
