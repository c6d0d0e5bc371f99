"""Peak memory of one training step on one device: states + activations + the largest transient.

The step is modelled as three moments; the peak is the largest (T = b·s tokens, A activation bytes):

1. ``loss backward`` — the forward is done, every saved activation is alive, and the loss backward makes
   two fp32 [T, v] buffers at once: nll_loss's gradient and log_softmax's input gradient (8·T·v bytes)
   beside the saved fp32 log-probs. (The forward's own loss transient, the fp32 logits, 4·T·v, is smaller.)
2. ``layer backward`` — the top layer's backward: the head's saved tensors are freed, the lm head and final
   norm gradients exist, the layer's working set is alive (re-run for checkpointed or reversible layers)
   and its gradient temporaries peak: the largest of three [T, f] MLP gradients, two [b, a, s, s] eager
   softmax gradients, or the five q/k/v/out-sized flash-backward buffers, plus the incoming [T, h] gradient.
3. ``optimizer step`` — all gradients and states, plus the step's temporaries for the largest tensor: its
   fp32 gradient copy (mixed recipes) and Adam's denominator √v + ε (memplan's reference optimizer updates
   one tensor at a time; fused or foreach implementations keep larger temporaries).

Gradients: with gradient accumulation (``grad_accum > 1``) they are alive in every micro-batch after the
first, so moments 1 and 2 include them; otherwise they are made during the backward.
ZeRO-3 adds the largest gathered (unsharded) weight unit to moments 1 and 2.

NB: allocator fragmentation, CUDA context (~0.3–1 GiB) and communication buckets are not counted.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from memplan.analytic import activations as act
from memplan.analytic.inventory import Dims, Kept
from memplan.analytic.params import ParamCount
from memplan.analytic.states import ModelStates
from memplan.config import Attention, MlpType, Precision, Setup, ZeroStage


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


def layer_backward_transient(setup: Setup, dims: Dims) -> int:
    """Largest set of gradient buffers alive inside one layer's backward, plus the incoming [T, h]."""
    a_bytes = dims.act.bytes
    t = dims.tokens
    mlp = (3 if setup.model.mlp is MlpType.SWIGLU else 2) * t * dims.f * a_bytes
    if setup.strategy.attention is Attention.EAGER:
        attention = 2 * dims.b * dims.a * dims.s * dims.s * a_bytes
    else:
        attention = (2 * t * dims.a * dims.d + 2 * t * dims.kv * dims.d + t * dims.a * dims.d) * a_bytes
    return max(mlp, attention) + t * dims.h * a_bytes


def optimizer_transient(setup: Setup, largest: int) -> int:
    """Temporaries of the reference optimizer for the largest parameter tensor."""
    precision = setup.training.precision
    fp32_grad_copy = 4 if precision in (Precision.BF16_MIXED, Precision.FP16_MIXED) else 0
    denominator = precision.state_bytes if setup.training.optimizer.name.startswith("ADAMW") else 0
    return largest * (fp32_grad_copy + denominator)


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
    """Activations a re-run segment (k layers) or a reversible layer rebuilds in backward."""
    layers = setup.strategy.segment or (1 if setup.strategy.reversible else 0)
    # A reversible layer also holds the rebuilt inputs x1, x2 beside the stack outputs.
    extra = 2 * Dims.of(setup).tokens * setup.model.hidden_size * setup.training.precision.activation_dtype.bytes
    working = act.total_bytes(act.layer_working_set(setup)) * layers
    return working + (extra if setup.strategy.reversible else 0)


def peak(setup: Setup, states: ModelStates, kept: list[Kept], params: ParamCount, gradient_bytes_head: int) -> Peak:
    dims = Dims.of(setup)
    activations = act.total_bytes(kept)
    head = sum(k.total_bytes for k in kept if k.name.startswith(HEAD_NAMES))
    resident = states.weights + states.optimizer
    grads_before = states.gradients if setup.training.grad_accum > 1 else 0
    gather = zero3_gather(params, setup)
    loss_bwd = resident + grads_before + activations + loss_backward_transient(dims) + gather
    layer_bwd = (
        resident
        + max(grads_before, gradient_bytes_head)
        + activations
        - head
        + recompute_working_set(setup)
        + layer_backward_transient(setup, dims)
        + gather
    )
    step = resident + states.gradients + optimizer_transient(setup, largest_tensor(params, setup))
    return Peak(phases={"loss backward": loss_bwd, "layer backward": layer_bwd, "optimizer step": step})
