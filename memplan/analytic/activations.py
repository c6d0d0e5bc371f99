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
from collections.abc import Iterable

from memplan.analytic.inventory import Dims, Kept, Scope
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

# (name, shape, dtype, reason) before scope and count are attached.
Rule = tuple[str, tuple[int, ...], DType, str]

FP32, BOOL, INT64 = DType.FP32, DType.BOOL, DType.INT64


# ----------------------------------------------------------------------------------------------------
# Building blocks
# ----------------------------------------------------------------------------------------------------
def norm_rules(setup: Setup, prefix: str, dims: Dims) -> list[Rule]:
    """Saves of one pre-norm over [b, s, h]."""
    b, s, h, act = dims.b, dims.s, dims.h, dims.act
    if setup.model.norm is NormType.RMSNORM:
        # Llama's RMSNorm: x32 = x.float(); rstd = rsqrt(mean(x32²) + eps); n = (x32·rstd).to(A); w·n.
        # pow and x32·rstd save x32 (the layer input itself when A is fp32); rsqrt saves rstd; w·n saves n.
        return [
            (f"{prefix}.input", (b, s, h), FP32, "x upcast to fp32: d(x²)/dx and d(x·rstd)/drstd need it"),
            (f"{prefix}.rstd", (b, s, 1), FP32, "rsqrt output: its derivative is -½·rstd³"),
            (f"{prefix}.normed", (b, s, h), act, "normalised x: dW = Σ grad·n needs it"),
        ]
    # native_layer_norm keeps mean and rstd in fp32 on CUDA but in the input dtype on CPU.
    stats = FP32 if setup.device is Device.CUDA else act
    return [
        (f"{prefix}.input", (b, s, h), act, "layer_norm backward recomputes x̂ from x"),
        (f"{prefix}.mean", (b, s, 1), stats, "layer_norm statistics for backward"),
        (f"{prefix}.rstd", (b, s, 1), stats, "layer_norm statistics for backward"),
    ]


def projection_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """Input of W_Q/W_K/W_V and the post-RoPE q, k and v the attention core reads."""
    b, s, h, a, kv, d, act = dims.b, dims.s, dims.h, dims.a, dims.kv, dims.d, dims.act
    rules: list[Rule] = [("attn.input", (b, s, h), act, "input of W_Q/W_K/W_V: dW = Xᵀ·dY needs X")]
    eager = setup.strategy.attention is Attention.EAGER
    core_recomputed = setup.strategy.checkpointing is Checkpointing.SELECTIVE
    if eager and not core_recomputed:
        # The matmuls read contiguous [b, a, s, d] copies; GQA repeats k and v to a heads (repeat_kv).
        return [
            *rules,
            ("attn.q", (b, a, s, d), act, "Q for QKᵀ: dK = dSᵀ·Q"),
            ("attn.k", (b, a, s, d), act, "K (repeated to a heads) for QKᵀ: dQ = dS·K"),
            ("attn.v", (b, a, s, d), act, "V (repeated to a heads) for P·V: dP = dO·Vᵀ"),
        ]
    # Flash kernel, or the inputs the selective checkpoint keeps: q and k after RoPE (a new tensor) or
    # the projection output itself; v is always the projection output [b, s, kv·d].
    why = "input of the recomputed attention core" if core_recomputed else "flash backward recomputes S = QKᵀ"
    return [
        *rules,
        ("attn.q", (b, a, s, d), act, why),
        ("attn.k", (b, kv, s, d), act, why),
        ("attn.v", (b, s, kv * d), act, why),
    ]


def attention_core_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """Saves inside the attention core (absent under selective recompute)."""
    b, s, a, act = dims.b, dims.s, dims.a, dims.act
    if setup.strategy.checkpointing is Checkpointing.SELECTIVE:
        return []
    p = setup.model.attn_dropout
    if setup.strategy.attention is Attention.FLASH:
        rules: list[Rule] = [("attn.lse", (b, a, s), FP32, "row logsumexp: backward rebuilds P from S")]
        if setup.device is Device.CUDA:
            rules += [
                ("attn.philox_seed", (), INT64, "RNG seed the CUDA flash backward regenerates dropout from"),
                (
                    "attn.philox_offset",
                    (),
                    INT64,
                    "RNG offset the CUDA flash backward regenerates dropout from",
                ),
            ]
        return rules
    rules = [("attn.probs", (b, a, s, s), act, "softmax output: dS = P·(dP − Σ dP·P)")]
    if p > 0:
        rules += [
            ("attn.dropout_mask", (b, a, s, s), BOOL, "dropout mask on the probabilities"),
            ("attn.probs_dropped", (b, a, s, s), act, "dropped probabilities for P·V: dV = Pᵀ·dO"),
        ]
    return rules


def mlp_rules(setup: Setup, dims: Dims) -> list[Rule]:
    b, s, h, f, act = dims.b, dims.s, dims.h, dims.f, dims.act
    rules: list[Rule] = [("mlp.input", (b, s, h), act, "input of the MLP's first matrices: dW = Xᵀ·dY")]
    if setup.model.mlp is MlpType.SWIGLU:
        return [
            *rules,
            ("mlp.gate", (b, s, f), act, "gate projection: silu'(g) needs g"),
            ("mlp.act", (b, s, f), act, "silu(g) for the product silu(g)·u: du needs it"),
            ("mlp.up", (b, s, f), act, "up projection for the product: d silu(g) needs u"),
            ("mlp.down_input", (b, s, f), act, "input of W_down: dW = Xᵀ·dY"),
        ]
    return [
        *rules,
        ("mlp.up", (b, s, f), act, "fc1 output: gelu'(x) needs x"),
        ("mlp.down_input", (b, s, f), act, "gelu output, input of fc2: dW = Xᵀ·dY"),
    ]


def dropout_rule(name: str, p: float, shape: tuple[int, ...]) -> list[Rule]:
    return [(name, shape, BOOL, "dropout mask: dX = dY·mask/(1−p)")] if p > 0 else []


def layer_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """Everything one transformer layer keeps when it is not checkpointed."""
    b, s, h, act = dims.b, dims.s, dims.h, dims.act
    p = setup.model.resid_dropout
    return [
        *norm_rules(setup, "attn_norm", dims),
        *projection_rules(setup, dims),
        *attention_core_rules(setup, dims),
        ("attn.out", (b, s, dims.a * dims.d), act, "attention output, input of W_O: dW = Xᵀ·dY"),
        *dropout_rule("attn.resid_dropout_mask", p, (b, s, h)),
        *norm_rules(setup, "mlp_norm", dims),
        *mlp_rules(setup, dims),
        *dropout_rule("mlp.resid_dropout_mask", p, (b, s, h)),
    ]


# ----------------------------------------------------------------------------------------------------
# Model level
# ----------------------------------------------------------------------------------------------------
def embedding_rules(setup: Setup, dims: Dims) -> list[Rule]:
    b, s, h = dims.b, dims.s, dims.h
    rules: list[Rule] = [("embed.ids", (b, s), INT64, "token ids: the embedding gradient is a scatter-add")]
    if setup.model.position is PositionType.LEARNED:
        rules.append(("embed.positions", (s,), INT64, "position ids for the position table's scatter-add"))
    return rules + dropout_rule("embed.dropout_mask", setup.model.embd_dropout, (b, s, h))


def constant_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """Tensors made once per forward and shared by every layer (one storage each)."""
    rules: list[Rule] = []
    if setup.model.position is PositionType.ROPE:
        rules += [
            ("rope.cos", (dims.s, dims.d), dims.act, "q·cos and k·cos: dq needs cos"),
            ("rope.sin", (dims.s, dims.d), dims.act, "rotate_half(q)·sin: dq needs sin"),
        ]
    if setup.strategy.attention is Attention.EAGER:
        rules.append(
            ("attn.causal_mask", (dims.s, dims.s), BOOL, "masked_fill's backward zeroes masked cells")
        )
    return rules


def head_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """Final norm, lm head and the loss (logits upcast to fp32 as Megatron and HF do)."""
    b, s, h, v = dims.b, dims.s, dims.h, dims.v
    return [
        *norm_rules(setup, "final_norm", dims),
        ("lm_head.input", (b, s, h), dims.act, "input of the lm head: dW = Xᵀ·dY"),
        ("loss.log_probs", (b * s, v), FP32, "log_softmax output of the fp32 logits: d = p − onehot"),
        ("loss.labels", (b, s), INT64, "targets of nll_loss"),
        ("loss.total_weight", (), FP32, "nll_loss's normaliser (a fp32 scalar)"),
    ]


def kept_layer_inputs(setup: Setup, dims: Dims) -> int:
    """Layer inputs a checkpointed model keeps: one per segment of k layers (ceil(L / k))."""
    k = setup.strategy.segment
    return -(-dims.layers // k) if k else 0


# ----------------------------------------------------------------------------------------------------
# The inventory
# ----------------------------------------------------------------------------------------------------
def _kept(rules: list[Rule], scope: Scope, count: int) -> list[Kept]:
    return [Kept(name=n, shape=sh, dtype=dt, scope=scope, count=count, reason=r) for n, sh, dt, r in rules]


def inventory(setup: Setup) -> list[Kept]:
    """Every tensor autograd holds when the forward pass of one micro-batch ends (one device)."""
    dims = Dims.of(setup)
    b, s, h, act = dims.b, dims.s, dims.h, dims.act
    model: list[Rule] = embedding_rules(setup, dims) + constant_rules(setup, dims)
    if setup.strategy.reversible:
        # RevNet coupling y1 = x1 + F(x2), y2 = x2 + G(y1): only the last layer's outputs are kept.
        model += [
            ("rev.y1", (b, s, h), act, "reversible stack output: backward rebuilds every layer's input"),
            ("rev.y2", (b, s, h), act, "reversible stack output: backward rebuilds every layer's input"),
        ]
        layers: list[Kept] = []
    elif setup.strategy.segment:
        n = kept_layer_inputs(setup, dims)
        layers = _kept(
            [("layer.input", (b, s, h), act, "checkpoint input: the segment is re-run")], Scope.LAYER, n
        )
    else:
        layers = _kept(layer_rules(setup, dims), Scope.LAYER, dims.layers)
    return _kept(model, Scope.MODEL, 1) + layers + _kept(head_rules(setup, dims), Scope.MODEL, 1)


@functools.lru_cache(maxsize=1024)
def layer_working_set(setup: Setup) -> tuple[Kept, ...]:
    """What one un-checkpointed layer keeps: the working set of a recomputed layer in backward.

    Memoised (the peak model asks for it several times per estimate; ``memplan fit`` per configuration).
    """
    dims = Dims.of(setup)
    return tuple(_kept(layer_rules(setup, dims), Scope.LAYER, 1))


def total_bytes(kept: Iterable[Kept]) -> int:
    return sum(k.total_bytes for k in kept)


def per_layer_bytes(kept: list[Kept], layers: int) -> int:
    """Bytes of one layer's entries (layer-scope totals spread over the layers)."""
    return sum(k.total_bytes for k in kept if k.scope is Scope.LAYER) // layers
