"""FLOPs of one micro-batch, counted as torch.utils.flop_counter counts them; each block's own FLOPs are in
its module (``memplan.blocks``), composed here.

Convention (FlopCounterMode): only matrix products count — mm, addmm, bmm and the SDPA kernels; a
multiply-add is 2 FLOPs; bias adds, norms, softmax and element-wise ops count 0; causal masking is not
halved. T = b·s tokens.

Forward, per layer:  Q: 2·T·h·(a·d)   K, V: 2·T·h·(kv·d) each   O: 2·T·(a·d)·h
                     attention: QKᵀ 2·b·a·s²·d + P·V 2·b·a·s²·d (eager bmm or flash, the same)
                     MLP: 2·T·h·f per matrix (3 for SwiGLU, 2 for GELU)
Model:               lm head 2·T·h·v (the embedding lookup is a gather: 0)
Backward: every linear needs dX = dY·Wᵀ and dW = Xᵀ·dY, 2× its forward; eager attention's bmms likewise
2×; the flash backward (torch's ``sdpa_backward_flop_count``) counts five s×s products — it recomputes
S = QKᵀ, then dP, dV, dQ, dK — 10·b·a·s²·d, 2.5× its forward.
Recompute (hardware FLOPs only): full / every-k checkpointing and reversible layers re-run every layer's
forward once in backward; selective recompute re-runs the attention core (4·b·a·s²·d per layer); less
what torch's early-stopping checkpoint never re-runs (``strategies.checkpointing``,
``strategies.reversible``).

Model FLOPs — the one definition, used by ``flops.model`` in the JSON, the estimate and plan reports and
timing's MFU (plan/timing.py): forward + backward without any re-computation, i.e.
    model = forward + backward − kernel_recompute (+ cp_skipped)
where ``kernel_recompute`` is the flash kernel's own re-computation of S = QKᵀ inside its backward
(2·b·a·s²·d per layer; 0 for eager attention). Checkpoint recompute (``recompute``) is apart already.
They are the model's, not the layout's: under context parallelism the ranks together run fewer attention
FLOPs than one device counts (a load-balanced rank skips the blocks its causal split masks wholly), and
``cp_skipped`` adds them back, so the model FLOPs — and an MFU, or the step at an assumed one — are the
same at every cp (PaLM's count reads the sequence, not its split).
This is the MFU convention of PaLM (App. B) and Korthikanti et al. 2022 (App. A): for full training every
matmul's backward is 2× its forward, so model = 3 × forward — an identity of today's terms, not the
definition (frozen weights, which skip dW, break it). ``total`` (hardware FLOPs, for HFU) is what
FlopCounterMode counts: forward + backward + recompute, the kernel's recompute included.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from memplan.blocks import llama4, moe
from memplan.blocks.attention.flops import (
    attention_backward_flops,
    attention_core_flops,
    kernel_recompute_flops,
    projection_flops,
)
from memplan.blocks.attention.mla import mla_projection_flops
from memplan.blocks.head import head_flops
from memplan.blocks.inventory import Dims
from memplan.blocks.mlp import mlp_flops
from memplan.config import Setup


class Flops(BaseModel):
    """FLOPs of one micro-batch for the whole model (one data-parallel replica)."""

    model_config = ConfigDict(frozen=True)
    forward: int
    backward: int
    """Everything FlopCounterMode counts in backward, ``kernel_recompute`` included."""
    recompute: int
    kernel_recompute: int
    """The flash kernel's re-computation of S = QKᵀ inside its backward (part of ``backward``)."""
    # Breakdown of the forward pass.
    layer_linear: int
    layer_attention: int
    lm_head: int
    # Breakdown of the backward pass (the rest of ``backward`` is the attention core's).
    layer_linear_backward: int
    """The layers' linears: dX and dW, 2 × ``layer_linear`` in full training; a frozen linear's dX only
    (none when its input needs no gradient) and the adapters' products under fine-tuning."""
    lm_head_backward: int
    """The lm head's dX and dW in backward (0 under the fused loss, which runs them in its forward)."""
    cp_skipped: int = 0
    """The attention core's model FLOPs (forward and backward, the kernel's recompute aside) that no
    context-parallel rank runs: the whole sequence's, as one device counts them (causal not halved), less
    the cp ranks' — a load-balanced rank skips the blocks its causal split masks wholly
    (``strategies.context_parallel.whole_model``). In ``model``, not in ``total``; 0 at cp 1."""

    @property
    def total(self) -> int:
        """Everything that runs: what FlopCounterMode counts (hardware FLOPs, for HFU)."""
        return self.forward + self.backward + self.recompute

    @property
    def model(self) -> int:
        """Model FLOPs, for MFU (module docstring): forward + backward without any re-computation, of the
        model whole — the same at any context parallelism (``cp_skipped``)."""
        return self.forward + self.backward - self.kernel_recompute + self.cp_skipped


def layer_linear_flops(setup: Setup, dims: Dims) -> int:
    """Forward FLOPs of one layer's projections and MLP matrices (an MoE's router, experts and shared
    experts)."""
    if llama4.applies(setup) and llama4.is_uniform(setup.model):
        return projection_flops(dims) + llama4.layer_linear_flops(setup, dims)
    mlp = moe.mlp_flops(setup, dims) if setup.model.moe else mlp_flops(setup, dims)
    m = setup.model
    return (mla_projection_flops(m, dims) if m.mla else projection_flops(dims)) + mlp


def layers_linear_flops(setup: Setup, dims: Dims) -> int:
    """Forward FLOPs of every layer's projections and MLP: L × one layer's, or each kind's for layers of
    several: Llama 4's (``blocks.llama4.layer_kinds``), DeepSeek's first ``moe.dense_layers`` running a
    dense MLP (``blocks.moe.dense_layer_setup``) and the others the MoE."""
    if llama4.applies(setup):
        kinds = llama4.layer_kinds(setup)
        return sum(n * (projection_flops(dims) + llama4.layer_linear_flops(k, Dims.of(k))) for k, n in kinds)
    dense = moe.dense_layer_setup(setup)
    if dense is None:
        return dims.layers * layer_linear_flops(setup, dims)
    k = moe.dense_mlp_layers(setup)
    return (dims.layers - k) * layer_linear_flops(setup, dims) + k * layer_linear_flops(dense, Dims.of(dense))


def flops(setup: Setup, recompute: int = 0) -> Flops:
    """FLOPs of one micro-batch; ``recompute``: the forward work the strategies re-run in backward
    (``memplan.strategies``: checkpointing, reversible layers), which the engine adds up."""
    dims = Dims.of(setup)
    linear = layers_linear_flops(setup, dims)
    attention = dims.layers * attention_core_flops(dims)
    head, head_backward = head_flops(setup, dims)
    backward = 2 * linear + head_backward + dims.layers * attention_backward_flops(setup, dims)
    return Flops(
        forward=linear + attention + head,
        backward=backward,
        recompute=recompute,
        kernel_recompute=dims.layers * kernel_recompute_flops(setup, dims),
        layer_linear=linear,
        layer_attention=attention,
        lm_head=head,  # a fused loss's gradient products included (blocks/head.py)
        layer_linear_backward=2 * linear,
        lm_head_backward=head_backward,
    )
