"""Per-tensor inventory of what autograd keeps for the backward pass of one micro-batch.

Each rule below mirrors one op of the reference model (memplan/measure/model.py) and what its PyTorch
autograd node saves; the measurement side counts those saves byte for byte (storage-deduplicated,
parameters excluded). Shapes: b micro-batch, s sequence, h hidden, a heads, kv key/value heads, d head
dim, f ffn width, v vocabulary; A the activation dtype of the precision recipe.

What each op saves (torch 2.x derivatives.yaml, checked by tests/measure):
- ``F.linear`` / ``addmm``: its input (and the weight, a parameter: not counted);
- ``x.float()``, ``x.to(A)``, ``x * python_float``, ``+``, ``mean``, ``cat``, views: nothing;
- ``pow``: its input; ``rsqrt``: its output; ``a * b``: each operand the other's gradient needs;
- ``silu`` / ``gelu``: input; ``softmax`` / ``log_softmax``: output; ``native_dropout``: the bool mask;
- ``masked_fill``: the mask; ``matmul``/``bmm``: both operands; ``embedding``: the indices;
- ``native_layer_norm``: input, mean and rstd ([b, s, 1]; fp32 on CUDA, A on CPU);
- the flash SDPA kernel: q, k, v, out and the fp32 logsumexp [b, a, s] (CUDA adds a philox seed and
  offset, 8 bytes each); ``nll_loss``: log-probs, labels and a fp32 scalar total weight.
- ``torch.utils.checkpoint`` (non-reentrant) keeps the checkpointed function's inputs; a reversible stack
  keeps its last outputs.

Known limitations (NB): checkpoint and reversible layers also keep the RNG state (5056 bytes on CPU, 16 on
CUDA) as a Python object, not a saved tensor; it is not counted. Gradients and transient buffers are not
activations: see ``peak.py``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from typing import NamedTuple

from memplan.analytic.inventory import Block, Dims, Kept, Role, Scope
from memplan.config import (
    Attention,
    Checkpointing,
    Device,
    DType,
    MlpType,
    NormType,
    PositionType,
    Setup,
)


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


FP32, BOOL, INT64 = DType.FP32, DType.BOOL, DType.INT64
B, R = Block, Role


# ----------------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------------
def norm_rules(setup: Setup, block: Block, dims: Dims) -> list[Rule]:
    """Saves of one pre-norm over [b, s, h]."""
    b, s, h, act = dims.b, dims.s, dims.h, dims.act
    if setup.model.norm is NormType.RMSNORM:
        # Llama's RMSNorm: x32 = x.float(); rstd = rsqrt(mean(x32²) + eps); n = (x32·rstd).to(A); w·n.
        # pow and x32·rstd save x32 (the layer input itself when A is fp32); rsqrt saves rstd; w·n saves n.
        why_x = "x upcast to fp32: d(x²)/dx and d(x·rstd)/drstd need it"
        return [
            save(block, "input", (b, s, h), FP32, R.NORM_INPUT, why_x),
            save(block, "rstd", (b, s, 1), FP32, R.NORM_STATS, "rsqrt output: its derivative is -½·rstd³"),
            save(block, "normed", (b, s, h), act, R.NORM_OUTPUT, "normalised x: dW = Σ grad·n needs it"),
        ]
    # native_layer_norm keeps mean and rstd in fp32 on CUDA but in the input dtype on CPU.
    stats = FP32 if setup.device is Device.CUDA else act
    return [
        save(block, "input", (b, s, h), act, R.NORM_INPUT, "layer_norm backward recomputes x̂ from x"),
        save(block, "mean", (b, s, 1), stats, R.NORM_STATS, "layer_norm statistics for backward"),
        save(block, "rstd", (b, s, 1), stats, R.NORM_STATS, "layer_norm statistics for backward"),
    ]


def projection_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """Input of W_Q/W_K/W_V and the post-RoPE q, k and v the attention core reads."""
    b, s, h, a, kv, d, act = dims.b, dims.s, dims.h, dims.a, dims.kv, dims.d, dims.act
    rules = [
        save(B.ATTN, "input", (b, s, h), act, R.LINEAR_INPUT, "input of W_Q/W_K/W_V: dW = Xᵀ·dY needs X")
    ]
    eager = setup.strategy.attention is Attention.EAGER
    core_recomputed = setup.strategy.checkpointing is Checkpointing.SELECTIVE
    if eager and not core_recomputed:
        # The matmuls read contiguous [b, a, s, d] copies; GQA repeats k and v to a heads (repeat_kv).
        return [
            *rules,
            save(B.ATTN, "q", (b, a, s, d), act, R.ATTN_QKV, "Q for QKᵀ: dK = dSᵀ·Q"),
            save(B.ATTN, "k", (b, a, s, d), act, R.ATTN_QKV, "K (repeated to a heads) for QKᵀ: dQ = dS·K"),
            save(B.ATTN, "v", (b, a, s, d), act, R.ATTN_QKV, "V (repeated to a heads) for P·V: dP = dO·Vᵀ"),
        ]
    # Flash kernel, or the inputs the selective checkpoint keeps: q and k after RoPE (a new tensor) or
    # the projection output itself; v is always the projection output [b, s, kv·d].
    why = "input of the recomputed attention core" if core_recomputed else "flash backward recomputes S = QKᵀ"
    return [
        *rules,
        save(B.ATTN, "q", (b, a, s, d), act, R.ATTN_QKV, why),
        save(B.ATTN, "k", (b, kv, s, d), act, R.ATTN_QKV, why),
        save(B.ATTN, "v", (b, s, kv * d), act, R.ATTN_QKV, why),
    ]


def attention_core_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """Saves inside the attention core (absent under selective recompute)."""
    b, s, a, act = dims.b, dims.s, dims.a, dims.act
    if setup.strategy.checkpointing is Checkpointing.SELECTIVE:
        return []
    p = setup.model.attn_dropout
    if setup.strategy.attention is Attention.FLASH:
        rules = [
            save(B.ATTN, "lse", (b, a, s), FP32, R.ATTN_LSE, "row logsumexp: backward rebuilds P from S")
        ]
        if setup.device is Device.CUDA:
            why = "the CUDA flash backward regenerates dropout from"
            rules += [
                save(B.ATTN, "philox_seed", (), INT64, R.RNG_STATE, f"RNG seed {why}"),
                save(B.ATTN, "philox_offset", (), INT64, R.RNG_STATE, f"RNG offset {why}"),
            ]
        return rules
    rules = [save(B.ATTN, "probs", (b, a, s, s), act, R.ATTN_PROBS, "softmax output: dS = P·(dP − Σ dP·P)")]
    if p > 0:
        rules += [
            save(
                B.ATTN,
                "dropout_mask",
                (b, a, s, s),
                BOOL,
                R.ATTN_DROPOUT_MASK,
                "dropout mask on the probabilities",
            ),
            save(
                B.ATTN,
                "probs_dropped",
                (b, a, s, s),
                act,
                R.ATTN_PROBS,
                "dropped probabilities for P·V: dV = Pᵀ·dO",
            ),
        ]
    return rules


def mlp_inner_rules(setup: Setup, block: Block, part: str, shape: tuple[int, ...], act: DType) -> list[Rule]:
    """What an MLP keeps between its first matrices and its last, each of ``shape`` ([·, f]): SwiGLU's
    gate, act, up and down input, GELU's fc1 output and fc2 input. ``part`` prefixes the names."""

    def inner(name: str, why: str) -> Rule:
        return save(block, part + name, shape, act, R.MLP_INNER, why)

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


def dropout_rule(block: Block, part: str, p: float, shape: tuple[int, ...]) -> list[Rule]:
    return (
        [save(block, part, shape, BOOL, R.DROPOUT_MASK, "dropout mask: dX = dY·mask/(1−p)")] if p > 0 else []
    )


def layer_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """Everything one transformer layer keeps when it is not checkpointed."""
    b, s, h, act = dims.b, dims.s, dims.h, dims.act
    p = setup.model.resid_dropout
    return [
        *norm_rules(setup, B.ATTN_NORM, dims),
        *projection_rules(setup, dims),
        *attention_core_rules(setup, dims),
        save(
            B.ATTN,
            "out",
            (b, s, dims.a * dims.d),
            act,
            R.ATTN_OUT,
            "attention output, input of W_O: dW = Xᵀ·dY",
        ),
        *dropout_rule(B.ATTN, "resid_dropout_mask", p, (b, s, h)),
        *norm_rules(setup, B.MLP_NORM, dims),
        *mlp_rules(setup, dims),
        *dropout_rule(B.MLP, "resid_dropout_mask", p, (b, s, h)),
    ]


# ----------------------------------------------------------------------------------------------------
# Model level
# ----------------------------------------------------------------------------------------------------
def embedding_rules(setup: Setup, dims: Dims) -> list[Rule]:
    b, s, h = dims.b, dims.s, dims.h
    rules = [
        save(B.EMBED, "ids", (b, s), INT64, R.TOKEN_IDS, "token ids: the embedding gradient is a scatter-add")
    ]
    if setup.model.position is PositionType.LEARNED:
        why = "position ids for the position table's scatter-add"
        rules.append(save(B.EMBED, "positions", (s,), INT64, R.TOKEN_IDS, why))
    return rules + dropout_rule(B.EMBED, "dropout_mask", setup.model.embd_dropout, (b, s, h))


def constant_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """Tensors made once per forward and shared by every layer (one storage each)."""
    rules: list[Rule] = []
    if setup.model.position is PositionType.ROPE:
        rules += [
            save(B.ROPE, "cos", (dims.s, dims.d), dims.act, R.ROPE_TABLE, "q·cos and k·cos: dq needs cos"),
            save(B.ROPE, "sin", (dims.s, dims.d), dims.act, R.ROPE_TABLE, "rotate_half(q)·sin: dq needs sin"),
        ]
    if setup.strategy.attention is Attention.EAGER:
        # Named attn.causal_mask (it belongs to the attention) but made once per forward, not per layer.
        why = "masked_fill's backward zeroes masked cells"
        rules.append(Rule("attn.causal_mask", (dims.s, dims.s), BOOL, why, B.CONST, R.CAUSAL_MASK))
    return rules


def head_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """Final norm, lm head and the loss (logits upcast to fp32 as Megatron and HF do)."""
    b, s, h, v = dims.b, dims.s, dims.h, dims.v
    return [
        *norm_rules(setup, B.FINAL_NORM, dims),
        save(B.LM_HEAD, "input", (b, s, h), dims.act, R.LINEAR_INPUT, "input of the lm head: dW = Xᵀ·dY"),
        save(
            B.LOSS,
            "log_probs",
            (b * s, v),
            FP32,
            R.LOG_PROBS,
            "log_softmax output of the fp32 logits: d = p − onehot",
        ),
        save(B.LOSS, "labels", (b, s), INT64, R.LABELS, "targets of nll_loss"),
        save(B.LOSS, "total_weight", (), FP32, R.LOSS_SCALAR, "nll_loss's normaliser (a fp32 scalar)"),
    ]


# ----------------------------------------------------------------------------------------------------
# The inventory
# ----------------------------------------------------------------------------------------------------
def kept(rules: list[Rule], scope: Scope, count: int) -> list[Kept]:
    """The inventory entries of ``rules``, ``count`` of each."""
    return [
        Kept(
            name=r.name,
            shape=r.shape,
            dtype=r.dtype,
            scope=scope,
            count=count,
            reason=r.reason,
            block=r.block,
            role=r.role,
        )
        for r in rules
    ]


def inventory(setup: Setup) -> list[Kept]:
    """What the blocks keep when the forward pass of one micro-batch ends, every layer whole: the
    embedding and per-forward constants, each layer's saves, the head. The strategies that drop or replace
    layers' saves (checkpointing, reversible layers, memplan.strategies) are applied to it by the engine."""
    dims = Dims.of(setup)
    model = embedding_rules(setup, dims) + constant_rules(setup, dims)
    layers = kept(layer_rules(setup, dims), Scope.LAYER, dims.layers)
    return kept(model, Scope.MODEL, 1) + layers + kept(head_rules(setup, dims), Scope.MODEL, 1)


@functools.lru_cache(maxsize=1024)
def layer_working_set(setup: Setup) -> tuple[Kept, ...]:
    """What one un-checkpointed layer keeps: the working set of a recomputed layer in backward.

    Memoised (the peak model asks for it several times per estimate; ``memplan fit`` per configuration).
    """
    dims = Dims.of(setup)
    return tuple(kept(layer_rules(setup, dims), Scope.LAYER, 1))


def total_bytes(kept: Iterable[Kept]) -> int:
    return sum(k.total_bytes for k in kept)


def per_layer_bytes(kept: list[Kept], layers: int) -> int:
    """Bytes of one layer's entries (layer-scope totals spread over the layers)."""
    return sum(k.total_bytes for k in kept if k.scope is Scope.LAYER) // layers
