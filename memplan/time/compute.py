"""Compute time of one micro-batch on one device of the busiest stage, per kernel class.

Three classes, each at its achievable fraction (``efficiency``):
- matrix products: the layers' linears (and an MoE's experts) and the lm head, at ``MATMUL`` × peak ×
  their shapes' wave efficiency (``gemm``: wave and tile quantization on the GPU's SMs);
- the attention core's products (QKᵀ, P·V, their gradients, the flash backward's recompute of S), at
  ``ATTENTION`` × peak;
- element-wise, memory-bound kernels, by bytes moved (``elementwise_bytes``) at ``MEMORY`` × HBM bandwidth.

FLOPs are ``analytic.flops``'s (whole model, one micro-batch), cut to the stage: a layer's FLOPs × its
layers, the head's on the last stage, ÷ tp · cp (every matmul is split over the tensor-parallel ranks; a
context-parallel rank runs 1/cp of the tokens — the whole-model FLOPs are cp × one rank's).
Checkpoint recompute re-runs the attention core (selective: attention class) or whole layers (its FLOPs
split as the layer forward's, linear : attention).

Element-wise bytes of one layer's forward on one rank (each op reads its inputs and writes its output;
T = b·s/cp tokens, Tr = T/t with sequence parallelism else T — norms, residual adds and dropouts run
on the rank's tokens —, e the activation bytes):
    two norms 2·(2·Tr·h·e); two residual adds 2·(3·Tr·h·e); two residual dropouts (when p > 0)
    2·(2·Tr·h·e + Tr·h) (a 1-byte mask); rotary on q and k 2·T·(a + kv)·d/t·e; the MLP's activation
    (SwiGLU reads gate and up, writes one: 3·T·F/t·e; GELU 2·T·F/t·e; F the routed and shared width an
    MoE token passes through); eager attention's fused scale-mask-softmax 2·b·(a/t)·s²·e and its dropout
    2·b·(a/t)·s²·e + b·(a/t)·s² (the flash kernel does these inside, no traffic).
The backward moves twice the forward's bytes (each op reads the incoming gradient and what it saved, and
writes a gradient); a re-run forward moves its bytes again.

The optimizer step (``optimizer_step_bytes``) is memory-bound too: once per step, on the parameters the
device owns.

Known limitations (NB): under fine-tuning the backward's FLOPs are the fine-tuned ones (a frozen weight
skips dW: ``Flops.layer_linear_backward``), but the backward class's wave efficiency (``gemm``) still
weighs every linear's dW shape; fused kernels (bias-GELU, fused norm-residual) move fewer bytes than counted;
the lm head's softmax is not counted; compute is charged per class,
never overlapped with another class.
"""

from __future__ import annotations

from dataclasses import dataclass

from memplan.config import Attention, Checkpointing, MlpType, PositionType, Setup, ZeroStage
from memplan.presets import GpuPreset
from memplan.time import efficiency, gemm
from memplan.time.comm import Critical


@dataclass(frozen=True)
class KernelTime:
    """Seconds of one micro-batch's forward or backward (with recompute) on one device, per class."""

    matmul_s: float
    attention_s: float
    elementwise_s: float
    matmul_flops: float
    """The matrix products' FLOPs (``matmul_s`` at ``MATMUL`` × peak × their wave efficiency)."""

    @property
    def total_s(self) -> float:
        return self.matmul_s + self.attention_s + self.elementwise_s


@dataclass(frozen=True)
class StageFlops:
    """FLOPs of one micro-batch on one device of the stage, forward and backward (recompute included)."""

    linear_forward: float
    head_forward: float
    attention_forward: float
    linear_backward: float
    """dX and dW of the layers' linears: 2× their forward (less where a frozen weight skips dW)."""
    rerun_linear: float
    """The linears' share of the checkpoint recompute (forward shapes)."""
    head_backward: float
    attention_backward: float

    @property
    def matmul_forward(self) -> float:
        return self.linear_forward + self.head_forward

    @property
    def matmul_backward(self) -> float:
        return self.linear_backward + self.rerun_linear + self.head_backward


def stage_flops(c: Critical) -> StageFlops:
    """The stage's share of the whole model's FLOPs on one tensor-parallel rank (module docstring)."""
    f, s = c.result.flops, c.setup
    ranks = s.parallel.tp * s.parallel.cp  # the whole model's work over the tp × cp ranks of a stage
    cut = c.layers / s.model.num_layers / ranks
    head = f.lm_head / ranks if c.last else 0.0
    # The lm head's backward products (dX, dW: 2× its forward) run in backward, except under the fused loss,
    # which makes both in the forward phase: its ``lm_head`` already holds all three and ``backward`` none
    # (blocks/head.py::head_flops). Under fine-tuning a frozen weight skips dW (strategies/lora.py): the
    # linears' and the head's backward are the FLOPs' own breakdown, never 2× the forward assumed.
    linear, attention = f.layer_linear * cut, f.layer_attention * cut
    attention_back = (f.backward - f.layer_linear_backward - f.lm_head_backward) * cut
    recompute = f.recompute * cut
    if s.strategy.checkpointing is Checkpointing.SELECTIVE:
        rerun_attention = recompute
    else:
        rerun_attention = recompute * attention / (linear + attention) if linear + attention else 0.0
    return StageFlops(
        linear_forward=linear,
        head_forward=head,
        attention_forward=attention,
        linear_backward=f.layer_linear_backward * cut,
        rerun_linear=recompute - rerun_attention,
        head_backward=f.lm_head_backward / ranks if c.last else 0.0,
        attention_backward=attention_back + rerun_attention,
    )


def elementwise_bytes(s: Setup) -> int:
    """Bytes one layer's forward moves through element-wise kernels on one rank (module docstring)."""
    m, t, par = s.model, s.training, s.parallel
    e = t.precision.activation_dtype.bytes
    tokens = t.micro_batch * t.seq_len // par.cp  # a context-parallel rank's share of the sequence
    rank_tokens = tokens // par.tp if par.sp else tokens
    hidden = rank_tokens * m.hidden_size
    out = 2 * 2 * hidden * e + 2 * 3 * hidden * e
    if m.resid_dropout > 0:
        out += 2 * (2 * hidden * e + hidden)
    if m.position is PositionType.ROPE:
        out += 2 * tokens * (m.num_heads + m.kv_heads) * m.dim // par.tp * e
    width = m.ffn * m.moe.top_k + m.moe.shared_width(m) if m.moe else m.ffn
    out += (3 if m.mlp is MlpType.SWIGLU else 2) * tokens * width // par.tp * e
    if s.strategy.attention is Attention.EAGER:
        probs = t.micro_batch * (m.num_heads // par.tp) * t.seq_len * t.seq_len
        out += 2 * probs * e + (2 * probs * e + probs if m.attn_dropout > 0 else 0)
    return out


def matmul_seconds(f: StageFlops, e: gemm.Efficiencies, mm: float) -> tuple[float, float]:
    """Forward and backward seconds of the matrix products at ``mm`` FLOP/s (``MATMUL`` × peak) × each
    class's wave efficiency (``gemm``); a re-run layer's linears have the forward's shapes."""
    forward = f.linear_forward / e.layer_forward + f.head_forward / e.head_forward
    backward = (
        f.linear_backward / e.layer_backward
        + f.rerun_linear / e.layer_forward
        + f.head_backward / e.head_backward
    )
    return forward / mm, backward / mm


def kernel_times(c: Critical, gpu: GpuPreset, peak: float) -> tuple[KernelTime, KernelTime]:
    """Forward and backward (recompute included) of one micro-batch on one device of the stage."""
    f = stage_flops(c)
    layer = elementwise_bytes(c.setup) * c.layers
    rerun = c.rerun_layers * elementwise_bytes(c.setup)
    if c.setup.strategy.checkpointing is Checkpointing.SELECTIVE:
        rerun = _attention_bytes(c.setup) * c.layers
    hbm = gpu.hbm_bandwidth_gbps * 1e9 * efficiency.MEMORY
    at = peak * efficiency.ATTENTION
    mm_f, mm_b = matmul_seconds(f, gemm.efficiencies(c.setup, gpu.sms), peak * efficiency.MATMUL)
    forward = KernelTime(mm_f, f.attention_forward / at, layer / hbm, f.matmul_forward)
    backward = KernelTime(mm_b, f.attention_backward / at, (2 * layer + rerun) / hbm, f.matmul_backward)
    return forward, backward


def optimizer_step_bytes(c: Critical) -> int:
    """Bytes the optimizer step moves on one device of the stage, once per step: it reads and writes the
    master weights and optimizer states of the parameters it owns (ZeRO ≥ 1: 1/dp of the stage's), reads
    their gradients and writes their working copy — an element-wise, memory-bound kernel (Megatron-LM's
    README: its FLOP/s are "measured for end-to-end training, i.e., includes all operations including data
    loading, optimization, and even logging").
    NB: gradient clipping's norm and fp16's inf check (one more read of the gradients each) are not
    counted."""
    s, t = c.setup.strategy, c.setup.training
    p = t.precision
    owned = -(-c.params.total // s.dp) if s.zero >= ZeroStage.OPTIMIZER else c.params.total
    return owned * (2 * (p.master_bytes + t.optimizer.state_bytes(p)) + p.grad_bytes + p.weight_bytes)


def optimizer_seconds(c: Critical, gpu: GpuPreset) -> float:
    """``optimizer_step_bytes`` at ``MEMORY`` × the HBM bandwidth."""
    return optimizer_step_bytes(c) / (gpu.hbm_bandwidth_gbps * 1e9 * efficiency.MEMORY)


def _attention_bytes(s: Setup) -> int:
    """The eager attention core's element-wise bytes (what selective recompute re-runs); 0 for flash."""
    eager = s.model_copy(update={"strategy": s.strategy.model_copy(update={"attention": Attention.FLASH})})
    return elementwise_bytes(s) - elementwise_bytes(eager)
