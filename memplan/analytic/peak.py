"""Peak memory of one training step on one device: states + activations + the largest transient.

The step is modelled as four moments; the peak is the largest (T = b·s tokens, A activation bytes):

1. ``loss backward`` — the forward is done, every saved activation is alive, and the loss backward makes
   two fp32 [T, v] buffers at once: nll_loss's gradient and log_softmax's input gradient (8·T·v bytes)
   beside the saved fp32 log-probs. (The forward's own loss transient, the fp32 logits, 4·T·v, is smaller.)
2. ``layer backward`` — a layer's backward, at the top layer (most activations alive) or the bottom one
   (most gradients made), whichever is larger: the head's saves are freed, the lm head and final norm
   gradients exist, the layer's working set is alive (re-run for checkpointed or reversible layers) and
   the largest of four moments inside it adds its temporaries: the MLP's three [T, f] gradients, its
   norm's fp32 gradient pieces, the attention's two [b, a, s, s] softmax gradients (eager) or dq/dk/dv
   (flash), the attention norm's.
3. ``embedding backward`` — the last gradient: every gradient exists, and the embedding's [v, h] gradient
   is summed into the one the tied lm head (or an earlier micro-batch) left: the new one and the sum.
4. ``optimizer step`` — all gradients and states, plus the step's temporaries for the largest tensor: its
   fp32 gradient copy (mixed recipes) and Adam's denominator √v + ε (memplan's reference optimizer updates
   one tensor at a time; fused or foreach implementations keep larger temporaries).

Gradients: with gradient accumulation (``grad_accum > 1``) they are alive in every micro-batch after the
first, so moments 1 and 2 include them; otherwise they are made during the backward.
ZeRO-3 adds the largest gathered (unsharded) weight unit to moments 1 and 2.

Accuracy, measured on CPU against every live storage (``memplan profile``; benchmarks/bench_peak_accuracy.py,
docs/peak-accuracy.md; tests/measure/test_peak.py): moments 1, 3 and 4 are exact to the byte; moment 2 is
an approximation of the backward's op-by-op live set (it does not replay the autograd engine's order, the
layout copies of view backward, or the re-run forward's Python locals but for reversible attention):
over 40 setups where it is the peak, the measured peak is within −7.5 % … +5.4 % of it (median −3.7 %).
NB: allocator fragmentation, CUDA context (~0.3–1 GiB) and communication buckets are not counted.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict

from memplan.analytic import activations as act
from memplan.analytic.inventory import Dims, Kept, Scope
from memplan.analytic.params import ParamCount
from memplan.analytic.states import ModelStates
from memplan.config import (
    Attention,
    Checkpointing,
    DType,
    MlpType,
    NormType,
    Optimizer,
    Precision,
    Setup,
    ZeroStage,
)


class Peak(BaseModel):
    model_config = ConfigDict(frozen=True)
    phases: dict[str, int]
    """Bytes alive at each modelled moment."""

    @property
    def bytes(self) -> int:
        return max(self.phases.values())

    @property
    def phase(self) -> str:
        return max(self.phases, key=lambda k: self.phases[k])


HEAD_NAMES = ("final_norm.", "lm_head.", "loss.")


def loss_backward_transient(dims: Dims) -> int:
    """nll_loss's gradient and log_softmax's input gradient, both fp32 [T, v]."""
    return 2 * 4 * dims.tokens * dims.v


def mlp_backward_transient(setup: Setup, dims: Dims, params: ParamCount) -> int:
    """MLP backward at the product's gradient: dY [T, h] coming in, d(down input) and the two operand
    gradients [T, f] (SwiGLU; GELU: one fewer), and the down projection's weight gradient, already made."""
    a_bytes = dims.act.bytes
    t = dims.tokens
    f_buffers = (3 if setup.model.mlp is MlpType.SWIGLU else 2) * t * dims.f * a_bytes
    down = (dims.f * dims.h + (dims.h if setup.model.mlp_bias else 0)) * setup.training.precision.grad_bytes
    return t * dims.h * a_bytes + f_buffers + down


def norm_backward_transient(setup: Setup, dims: Dims) -> int:
    """A pre-norm's backward, above what its saves hold: dY [T, h] coming in, plus for Llama's explicit
    RMSNorm the fp32 gradient pieces of x·rstd, mean(x²) and x² (pow's backward materialises x.pow(1), ×2
    and ×grad: three fp32 [T, h] at once) and, in 16-bit recipes, the fp32 upcast of the incoming gradient;
    for ``native_layer_norm`` its [T, h] input gradient."""
    t, h, a_bytes = dims.tokens, dims.h, dims.act.bytes
    if setup.model.norm is NormType.LAYERNORM:
        return 2 * t * h * a_bytes
    upcast = 4 * t * h if dims.act is not DType.FP32 else 0
    return t * h * a_bytes + 3 * 4 * t * h + upcast


def attention_backward_transient(setup: Setup, dims: Dims, params: ParamCount, kept: list[Kept]) -> int:
    """Attention backward, after the MLP's: its saved tensors are freed, the MLP and W_O gradients exist;
    two [b, a, s, s] softmax gradients (eager) or dq, dk, dv and dO (flash), plus the incoming dY [T, h]."""
    a_bytes = dims.act.bytes
    t = dims.tokens
    if setup.strategy.attention is Attention.EAGER:
        buffers = 2 * dims.b * dims.a * dims.s * dims.s * a_bytes
    else:
        buffers = (2 * t * dims.a * dims.d + 2 * t * dims.kv * dims.d) * a_bytes
    return t * dims.h * a_bytes + buffers + _mlp_done(setup, dims, params)


def _mlp_done(setup: Setup, dims: Dims, params: ParamCount) -> int:
    """Once the MLP's backward has run: its gradients are made and its saved tensors freed (a negative
    change of the live set, plus the gradients)."""
    layer = params.layer
    grads = (layer.mlp + layer.mlp_norm + layer.o_proj) * setup.training.precision.grad_bytes
    freed = sum(k.bytes for k in act.layer_working_set(setup) if k.name.startswith(("mlp.", "mlp_norm.")))
    return grads - freed


def layer_backward_transient(setup: Setup, dims: Dims, params: ParamCount, kept: list[Kept]) -> int:
    """The largest rise above the layer's live set among its backward's moments: the MLP, the MLP's
    norm (MLP saves freed), the attention core and the attention norm (the whole layer's gradients made,
    the attention's saves freed but for its norm's)."""
    layer_grads = params.layer.total * setup.training.precision.grad_bytes
    attn_saved = sum(
        k.bytes
        for k in act.layer_working_set(setup)
        if k.name.startswith("attn.") or "resid_dropout" in k.name
    )
    mlp_norm_saved = sum(k.bytes for k in act.layer_working_set(setup) if k.name.startswith("mlp_norm."))
    norm = norm_backward_transient(setup, dims)
    # A reversible layer re-runs G (the MLP) and runs its backward before it re-runs F (the attention):
    # during the MLP's backward the attention's saves are not there yet.
    not_yet = attn_saved + attn_norm_saved(setup) if setup.strategy.reversible else 0
    return max(
        mlp_backward_transient(setup, dims, params) - not_yet,
        norm + _mlp_done(setup, dims, params) + mlp_norm_saved - not_yet,
        attention_backward_transient(setup, dims, params, kept),
        attention_rerun_transient(setup, dims, params),
        norm + _mlp_done(setup, dims, params) + mlp_norm_saved + layer_grads - attn_saved,
    )


def attention_rerun_transient(setup: Setup, dims: Dims, params: ParamCount) -> int:
    """A reversible layer re-running its attention forward in backward (the MLP's backward done): the
    gradients dy1 and dy2 [T, h] and, for eager attention, the forward's locals: q and k after RoPE and
    v before their contiguous copies, and the scaled and masked scores beside the probabilities."""
    if not setup.strategy.reversible:
        return 0
    a_bytes, t = dims.act.bytes, dims.tokens
    rerun = 2 * t * dims.h * a_bytes + _mlp_done(setup, dims, params)
    if setup.strategy.attention is Attention.EAGER:
        locals_ = t * (dims.a + 2 * dims.kv) * dims.d * a_bytes
        rerun += locals_ + 2 * dims.b * dims.a * dims.s * dims.s * a_bytes
    return rerun


def attn_norm_saved(setup: Setup) -> int:
    return sum(k.bytes for k in act.layer_working_set(setup) if k.name.startswith("attn_norm."))


def optimizer_transient(setup: Setup, largest: int) -> int:
    """Temporaries of the reference optimizer (measure/optim.py) for the largest parameter tensor.

    The gradient is upcast to fp32 (4 bytes/element) by the mixed recipes and by 8-bit Adam unless it is
    fp32 already; then Adam's denominator √v̂ + ε and Lion's update (state dtype), or for 8-bit Adam the
    dequantised fp32 m and v and the fp32 denominator (12 bytes/element). SGD updates in place.
    """
    precision, opt = setup.training.precision, setup.training.optimizer
    upcast = opt is Optimizer.ADAMW_8BIT or precision.master_bytes > 0
    per_element = 4 if upcast and precision is not Precision.FP32 else 0
    per_element += {
        Optimizer.ADAMW: precision.state_bytes,
        Optimizer.ADAMW_8BIT: 12,
        Optimizer.LION: precision.state_bytes,
    }.get(opt, 0)
    return largest * per_element


def largest_tensor(p: ParamCount, setup: Setup) -> int:
    """Elements of the largest single parameter tensor (embedding, head or an MLP matrix)."""
    m = setup.model
    return max(p.embedding, p.lm_head, m.hidden_size * m.ffn, m.hidden_size * m.q_width)


def zero3_gather(p: ParamCount, setup: Setup) -> int:
    """Weights of the largest unit ZeRO-3 gathers at once (a layer, or the embedding / head)."""
    s = setup.strategy
    if s.zero < ZeroStage.PARAMETERS or s.dp == 1:
        return 0
    return max(p.layer.total, p.embedding, p.lm_head) * setup.training.precision.weight_bytes


def recompute_working_set(setup: Setup) -> int:
    """Activations a re-run segment (k layers), a reversible layer or a selective attention core rebuilds
    in backward, alive while that layer's backward runs."""
    dims = Dims.of(setup)
    if setup.strategy.checkpointing is Checkpointing.SELECTIVE:
        # The core's own saves (eager: q, k, v copies and the probabilities; flash: lse) come back.
        plain = setup.model_copy(
            update={"strategy": setup.strategy.model_copy(update={"checkpointing": Checkpointing.NONE})}
        )
        core = act.projection_rules(plain, dims) + act.attention_core_rules(plain, dims)
        kept = act.projection_rules(setup, dims)
        return sum(_rule_bytes(r) for r in core) - sum(_rule_bytes(r) for r in kept)
    layers = setup.strategy.segment or (1 if setup.strategy.reversible else 0)
    working = act.total_bytes(act.layer_working_set(setup)) * layers
    if setup.strategy.reversible:
        # The rebuilt inputs x1, x2 beside the stack outputs.
        return working + 2 * dims.tokens * dims.h * dims.act.bytes
    # The segment's first norm saves the kept input itself when it needs no upcast (LayerNorm, or fp32
    # activations): that storage is the checkpoint's, not a new one.
    shared = setup.model.norm is NormType.LAYERNORM or dims.act is DType.FP32
    return working - (dims.tokens * dims.h * dims.act.bytes if shared and layers else 0)


def saved_layers_up_to(setup: Setup, kept: list[Kept], i: int) -> int:
    """Layer-scope saves still alive when layer i's backward runs (those of layers 0..i)."""
    one = sum(k.bytes for k in kept if k.scope is Scope.LAYER)
    k = setup.strategy.segment
    if k:  # one kept input per segment of k layers, up to layer i's segment
        return (i // k + 1) * one
    return (i + 1) * one


def _rule_bytes(rule: act.Rule) -> int:
    return math.prod(rule[1]) * rule[2].bytes


def peak(
    setup: Setup, states: ModelStates, kept: list[Kept], params: ParamCount, gradient_bytes_head: int
) -> Peak:
    dims = Dims.of(setup)
    activations = act.total_bytes(kept)
    head = sum(k.total_bytes for k in kept if k.name.startswith(HEAD_NAMES))
    resident = states.weights + states.optimizer
    grads_before = states.gradients if setup.training.grad_accum > 1 else 0
    gather = zero3_gather(params, setup)
    # + 4: the fp32 loss scalar (nll_loss's backward has consumed the seed gradient by then).
    loss_bwd = resident + grads_before + activations + loss_backward_transient(dims) + gather + 4
    transient = layer_backward_transient(setup, dims, params, kept)
    layer_saved = sum(k.total_bytes for k in kept if k.scope is Scope.LAYER)
    before_layers = resident + activations - head - layer_saved + recompute_working_set(setup) + gather

    def layer_moment(i: int) -> int:
        """Layer i's backward: the layers above are done (their saves freed, their gradients made)."""
        if grads_before:
            grads = grads_before
        else:
            # Gradients of the head and of the layers above, as many bytes per parameter as the device
            # keeps (ZeRO-2/3 reduce-scatter them into shards as the backward goes; the current layer's
            # full-size gradients are in its transient).
            full = params.total * setup.training.precision.grad_bytes
            head = gradient_bytes_head * states.gradients // full if full else 0
            grads = head + params.layer.total * (dims.layers - 1 - i) * states.gradients // params.total
        return before_layers + grads + saved_layers_up_to(setup, kept, i) + transient

    # Linear in i: the peak is at the top layer (activations dominate) or the bottom (gradients do).
    layer_bwd = max(layer_moment(dims.layers - 1), layer_moment(0))
    inputs = 2 * 8 * dims.tokens  # the int64 ids and labels the training loop still holds
    # The embedding's gradient [v, h] arrives last; tied to the lm head (or accumulating over
    # micro-batches) it is summed into the gradient already there: the new [v, h] and (tied) the sum.
    copies = 2 if setup.model.tied_embeddings else (1 if setup.training.grad_accum > 1 else 0)
    embedding = params.embedding * setup.training.precision.grad_bytes * copies
    # + 8: the fp32 loss scalar and the backward's seed gradient (held until the backward ends).
    embedding_bwd = resident + states.gradients + inputs + embedding + 8
    step = resident + states.gradients + inputs + optimizer_transient(setup, largest_tensor(params, setup))
    return Peak(
        phases={
            "loss backward": loss_bwd,
            "layer backward": layer_bwd,
            "embedding backward": embedding_bwd,
            "optimizer step": step,
        }
    )
