"""Fine-tuning's gradient flow (LoRA, QLoRA, frozen parts): which tensors of each layer require grad, and
which weights train — what the saves (``strategies.lora``) and the FLOPs (``strategies.lora_flops``) of
fine-tuning both follow.

PyTorch saves a tensor for backward only when a gradient that needs it will be computed, and a linear runs
dX only when its input needs a gradient; so the first layers before any trainable parameter keep nothing
and run no backward, and the first trainable layer's input needs no gradient.

A layer's flow is one ``Flow``: a Llama / GPT layer (attention, then MLP; OLMo-2's post norms alike) or
a parallel one (both on the layer's input: ``Flow.parallel``; GPT-NeoX, Falcon, Cohere, StableLM's
``use_parallel_residual``)."""

from __future__ import annotations

from dataclasses import dataclass

from memplan.config import MlpType, Setup
from memplan.config.finetune import Target
from memplan.config.trainable import adapted, base_trains, embedding_trains, fp32_adapters, input_grads_hooked

T = Target


@dataclass(frozen=True, slots=True)
class Flow:
    """Which tensors of one layer require grad (``g_*``) and which weights train."""

    g_in: bool
    trains: bool
    """The layer's own weights train (full fine-tuning of an unfrozen layer)."""
    adapters: frozenset[Target]
    dropout: bool
    """LoRA dropout on the adapters' inputs."""
    cast: bool
    """Each adapter casts its input to its own (fp32) dtype first (``fp32_adapters``): A keeps that copy,
    not the linear's shared input."""
    swiglu: bool
    """SwiGLU MLP (gate, up, down); else GELU (up = fc1, down = fc2)."""
    parallel: bool = False
    """A parallel layer, x + attn(ln(x)) + mlp(ln₂(x)) (``ModelConfig.parallel_residual``; one shared norm
    under ``shared_norm``): the MLP reads the layer's input, not the residual after attention."""

    def lin(self, t: Target, g_x: bool) -> bool:
        """A linear's output requires grad: its input does, its weight trains, or it has an adapter."""
        return g_x or self.trains or t in self.adapters

    def keeps_input(self, *targets: Target) -> bool:
        """The linears' shared input is kept: a trainable weight's dW, or an adapter's A without dropout (and
        without a cast to the adapters' dtype)."""
        uncast = not self.dropout and not self.cast
        return self.trains or (uncast and any(t in self.adapters for t in targets))

    @property
    def g_y(self) -> bool:
        """The attention norm's output (its weight trains, or its input needs a gradient)."""
        return self.g_in or self.trains

    @property
    def g_q(self) -> bool:
        return self.lin(T.Q, self.g_y)

    @property
    def g_k(self) -> bool:
        return self.lin(T.K, self.g_y)

    @property
    def g_v(self) -> bool:
        return self.lin(T.V, self.g_y)

    @property
    def g_qk(self) -> bool:
        return self.g_q or self.g_k

    @property
    def g_core(self) -> bool:
        return self.g_qk or self.g_v

    @property
    def g_mid(self) -> bool:
        """The residual stream between attention and MLP."""
        return self.g_in or self.lin(T.O, self.g_core)

    @property
    def g_mlp_in(self) -> bool:
        """The MLP norm's input: the layer's input in a parallel layer, else the residual after attention."""
        return self.g_in if self.parallel else self.g_mid

    @property
    def g_y2(self) -> bool:
        return self.g_mlp_in or self.trains

    @property
    def g_gate(self) -> bool:
        return self.lin(T.GATE, self.g_y2)

    @property
    def g_up(self) -> bool:
        return self.lin(T.UP, self.g_y2)

    @property
    def g_act(self) -> bool:
        """The MLP's product (or GELU output), the down projection's input."""
        return (self.g_gate or self.g_up) if self.swiglu else self.g_up

    @property
    def g_down(self) -> bool:
        return self.lin(T.DOWN, self.g_act)

    @property
    def g_out(self) -> bool:
        return self.g_mid or self.g_down

    def g_input(self, t: Target) -> bool:
        """Linear ``t``'s input requires grad (its backward runs dX = dY·W; an adapter's mask is kept)."""
        inputs = {
            T.Q: self.g_y,
            T.K: self.g_y,
            T.V: self.g_y,
            T.O: self.g_core,
            T.GATE: self.g_y2,
            T.UP: self.g_y2,
            T.DOWN: self.g_act,
        }
        return inputs[t]


def flows(setup: Setup) -> tuple[Flow, ...]:
    """Each layer's gradient flow, first to last: the embedding's output needs a gradient when it trains
    (or transformers' checkpointing hooks it: ``input_grads_hooked``); each layer's output is the next
    one's input."""
    g = embedding_trains(setup) or input_grads_hooked(setup)
    dropout, swiglu = setup.finetune.dropout > 0, setup.model.mlp is MlpType.SWIGLU
    parallel = setup.model.parallel_residual
    cast = fp32_adapters(setup)
    out = []
    for i in range(setup.model.num_layers):
        f = Flow(g, base_trains(setup, i), adapted(setup, i), dropout, cast, swiglu, parallel)
        out.append(f)
        g = f.g_out
    return tuple(out)
