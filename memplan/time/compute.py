"""Compute time of one micro-batch on one device of the busiest stage, per kernel class.

Three classes, each at its achievable fraction (``efficiency``, or a calibrated GPU file's):
- matrix products: the layers' linears (and an MoE's experts, LoRA's adapters) and the lm head, at
  ``MATMUL`` × peak × their shapes' efficiency (``gemm``: wave and tile quantization on the GPU's SMs, and
  the roofline: a GEMM under the ridge runs at its bytes); ``--fp8``: the layers' at the FP8 peak
  (``fp8``);
- the attention core (QKᵀ, P·V, their gradients, the flash backward's recompute of S): eager attention's
  batched GEMMs as the linears, a flash kernel at its fraction by kernel and GPU generation
  (``attention``);
- element-wise, memory-bound kernels, by bytes moved (``elementwise_bytes``, eager or fused:
  ``elementwise``; ``--fp8``'s casts) at ``MEMORY`` × HBM bandwidth, each chain's bytes weighed by the
  rate it was measured to stream at (``streamed_bytes``, ``efficiency.ELEMENTWISE_STREAM``: eager norms,
  rotary and the eager attention core well below ``MEMORY``), plus ``LAUNCH_GAP_S`` per kernel of eager
  code (``elementwise_kernels``, ``launch_seconds``).

FLOPs are ``analytic.flops``'s (whole model, one micro-batch), cut to the stage: a layer's FLOPs × its
layers, the head's on the last stage, ÷ tp · cp (every matmul is split over the tensor-parallel ranks; a
context-parallel rank runs 1/cp of the tokens — the whole-model FLOPs are cp × one rank's).
Checkpoint recompute re-runs the attention core (selective: attention class) or whole layers (its FLOPs
split as the layer forward's, linear : attention); torchtitan's per-op SelectiveAC re-runs W_O and W3
(linear class; on CPU the attention core too) and every element-wise op of the block.

Element-wise bytes of one layer's forward on one rank (each op reads its inputs and writes its output;
T = b·s/cp tokens, Tr = T/t with sequence parallelism else T — norms, residual adds and dropouts run
on the rank's tokens —, e the activation bytes):
    two norms 2·(2·Tr·h·e); two residual adds 2·(3·Tr·h·e); two residual dropouts (when p > 0)
    2·(2·Tr·h·e + Tr·h) (a 1-byte mask); rotary on q and k 2·T·(a + kv)·d/t·e; the MLP's activation
    (SwiGLU reads gate and up, writes one: 3·T·F/t·e; GELU 2·T·F/t·e; F the routed and shared width an
    MoE token passes through); eager attention's fused scale-mask-softmax 2·b·(a/t)·s²·e (the reference's
    three unfused kernels 6·b·(a/t)·s²·e, ``elementwise.eager_core``) and its dropout 2·b·(a/t)·s²·e +
    b·(a/t)·s² (the flash kernel does these inside, no traffic).
— the fused kernels' bytes; eager PyTorch's RMSNorm, SwiGLU and rotary move more (``elementwise``).
The backward of eager code moves its autograd op lists' bytes (``elementwise_backward_bytes``: RMSNorm's,
SwiGLU's and rotary's nodes, the sums of the gradients of tensors used twice); fused code, LayerNorm,
GELU, dropouts and a fused softmax twice their forward's (each op reads the incoming gradient and what
it saved, and writes a gradient; the reference's eager core 7e a score); a re-run forward moves its bytes
again. Context parallelism adds its own copies per layer (``context_parallel.elementwise_bytes``: torch's
ring's fp32 merges and accumulators, or ``kv-gather``'s reorders), its forward's again where the attention
re-runs.

torchtitan's ``--async-tp`` adds its fused collectives' own kernels (``async_tp.local_bytes``: each fused
all-gather's copy of the rank's shard, each fused reduce-scatter's sum of the partial chunks), per layer
forward and backward, the forward's again in a re-run layer.

QLoRA (``dequant_bytes``): bitsandbytes dequantises each frozen 4-bit linear's weight to the compute
dtype for its forward matmul and again for dX in backward, a memory-bound kernel that reads the 4-bit
storage and writes the weight.

The optimizer step (``optimizer_step_bytes``) is memory-bound too: once per step, on the trainable
parameters the device owns (LoRA's adapters only), its bytes and launches by implementation
(``time.optimizer``); under optimizer offload the CPU runs it (``time.offload``).

The backward's linears are ``Flops.layer_linear_backward`` (a frozen linear runs dX alone), the rest of
the backward the attention core's — never a difference of assumed ratios (LoRA's frozen linears made
that negative).

Known limitations (NB): fused kernels (bias-GELU, fused norm-residual) move fewer bytes than counted;
the lm head's softmax is not counted; compute is charged per class,
never overlapped with another class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

from memplan.blocks.attention.flops import attention_core_flops
from memplan.blocks.inventory import Dims
from memplan.blocks.profiles import op_selective
from memplan.config import Attention, Checkpointing, Device, Offload, Setup, ZeroStage
from memplan.config.finetune import Method, linear_shapes
from memplan.presets import GpuPreset
from memplan.strategies import context_parallel
from memplan.strategies.checkpointing import op_selective_recompute
from memplan.strategies.lora import base_dx_linears
from memplan.strategies.lora_states import quantized_bytes, trainable_params
from memplan.time import async_tp, attention, efficiency, fp8, gemm, optimizer, tp_overlap
from memplan.time.comm.rows import Critical, Overlap
from memplan.time.layer_elementwise import (
    attention_bytes,
    elementwise_backward_kernels,
    elementwise_kernels,
    streamed_bytes,
)


@dataclass(frozen=True)
class KernelTime:
    """Seconds of one micro-batch's forward or backward (with recompute) on one device, per class."""

    matmul_s: float
    attention_s: float
    elementwise_s: float
    matmul_full_s: float
    """``matmul_s`` at full waves: each product's FLOPs at its class's rate alone (``MATMUL`` × the bf16
    peak; ``MATMUL_FP8`` × the FP8 peak for ``--fp8``'s layers), so that ``matmul_full_s / matmul_s`` is the
    products' wave efficiency (``matmul_seconds`` with unit efficiencies)."""
    dequant_s: float = 0.0
    """QLoRA's dequantisation of the frozen 4-bit weights (``dequant_bytes``), memory-bound."""
    launch_s: float = 0.0
    """The per-launch gaps of the eager element-wise kernels (``launch_seconds``)."""

    @property
    def total_s(self) -> float:
        return self.matmul_s + self.attention_s + self.elementwise_s + self.dequant_s + self.launch_s


@dataclass(frozen=True)
class StageFlops:
    """FLOPs of one micro-batch on one device of the stage, forward and backward (recompute included)."""

    linear_forward: float
    head_forward: float
    attention_forward: float
    linear_backward: float
    """dX and dW of the layers' linears (``Flops.layer_linear_backward``: 2× their forward in full
    training)."""
    rerun_linear: float
    """The linears' share of the checkpoint recompute (forward shapes)."""
    head_backward: float
    attention_backward: float
    rerun_attention: float = 0.0
    """The attention core's share of the checkpoint recompute (in ``attention_backward``)."""


def stage_flops(c: Critical) -> StageFlops:
    """The stage's share of the whole model's FLOPs on one tensor-parallel rank (module docstring)."""
    f, s = c.result.flops, c.setup
    ranks = s.parallel.tp * s.parallel.cp  # the whole model's work over the tp × cp ranks of a stage
    cut = c.layers / s.model.num_layers / ranks
    head = f.lm_head / ranks if c.last else 0.0
    # The lm head's backward products (dX, dW: 2× its forward) run in backward, except under the fused loss,
    # which makes both in the forward phase: its ``lm_head`` already holds all three and ``backward`` none
    # (blocks/head.py::head_flops).
    # The backward's linears and head from the FLOP count's own breakdown: 2× the forward in full
    # training, a frozen linear's dX alone under fine-tuning (strategies/lora.py::layer_flops); the fused
    # loss runs the head's products in its forward (``lm_head_backward`` 0). The rest is the core's.
    linear, attention = f.layer_linear * cut, f.layer_attention * cut
    attention_back = (f.backward - f.layer_linear_backward - f.lm_head_backward) * cut
    recompute = f.recompute * cut
    if op_selective(s):
        # torchtitan's SelectiveAC re-runs W_O and W3 (linears), and the attention core only on CPU, where
        # the flash op is not in its save list (strategies.checkpointing.op_selective_recompute)
        d = Dims.of(s)
        core = 0 if s.device is Device.CUDA else attention_core_flops(d)
        rerun_attention = recompute * core / op_selective_recompute(d, cuda=s.device is Device.CUDA)
    elif s.strategy.checkpointing is Checkpointing.SELECTIVE:
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
        rerun_attention=rerun_attention,
    )


def layer_kernels(s: Setup) -> tuple[int, int, int | None]:
    """One layer's eager element-wise kernels on a rank of ``s``: its forward's (``elementwise_kernels``),
    its backward's (``elementwise_backward_kernels``) and, under selective recompute, those of the
    attention core it re-runs (the eager core's softmax and dropout: the forward's less flash's); None
    otherwise (``launch_seconds``)."""
    per_layer = elementwise_kernels(s)
    selective = s.strategy.checkpointing is Checkpointing.SELECTIVE and not op_selective(s)
    core = per_layer - elementwise_kernels(_flash(s)) if selective else None
    return per_layer, elementwise_backward_kernels(s), core


def launch_seconds(
    c: Critical, gpu: GpuPreset, kernels: tuple[int, int, int | None] | None = None
) -> tuple[float, float]:
    """The launch gaps of one micro-batch's eager element-wise kernels, (forward, backward with re-run):
    ``elementwise_kernels`` × the stage's layers × ``efficiency.launch_gap``; the backward launches its
    op lists' kernels (``elementwise_backward_kernels``), a re-run layer its forward's again (selective
    recompute: the eager attention core's softmax and dropout). ``kernels``: ``layer_kernels(c.setup)``,
    when made."""
    s = c.setup
    per_layer, backward, core = kernels or layer_kernels(s)
    rerun = c.rerun_layers * per_layer
    if op_selective(s):  # SelectiveAC caches matmul and SDPA outputs only: every element-wise op re-runs
        rerun = c.layers * per_layer
    elif core is not None:
        rerun = c.layers * core
    gap = efficiency.launch_gap(gpu)
    return c.layers * per_layer * gap, (c.layers * backward + rerun) * gap


def matmul_seconds(
    f: StageFlops, e: gemm.Efficiencies, mm: float, layer: tuple[gemm.Efficiencies, float] | None = None
) -> tuple[float, float]:
    """Forward and backward seconds of the matrix products at ``mm`` FLOP/s (``MATMUL`` × peak) × each
    class's wave efficiency (``gemm``); a re-run layer's linears have the forward's shapes. ``layer``: the
    layers' linears at other efficiencies and rate (``--fp8``: the FP8 peak), the head at ``mm``."""
    le, lmm = layer if layer is not None else (e, mm)
    forward = f.linear_forward / le.layer_forward / lmm + f.head_forward / e.head_forward / mm
    backward = (f.linear_backward / le.layer_backward + f.rerun_linear / le.layer_forward) / lmm
    return forward, backward + f.head_backward / e.head_backward / mm


@dataclass(frozen=True)
class LayerRates:
    """What ``kernel_times`` charges one layer of a rank by, from fields none of which is the pipeline's,
    the ZeRO stage, dp or the micro-batches per step (``pieces.pieces_key``'s: ``layer_rates``)."""

    stream: tuple[float, float, float]
    """``layer_stream_bytes``: the forward's, the backward's, the checkpoint's re-run's."""
    efficiencies: gemm.Efficiencies
    fp8: tuple[gemm.Efficiencies, float] | None
    """``fp8_layers``."""
    attention: tuple[float, float]
    """``attention_rates``: the core's FLOP/s, forward and backward."""
    kernels: tuple[int, int, int | None]
    """``layer_kernels``."""


def layer_rates(c: Critical, gpu: GpuPreset, peak: float) -> LayerRates:
    """``LayerRates`` of the stage's setup on ``gpu`` at ``peak``, memoised on its pieces (``Pieces.rates``:
    the same for every stage, pipeline layout, ZeRO stage, dp and number of micro-batches of those pieces
    — none of the functions reads ``pieces._PER_STEP`` or the pipeline's degrees; ``fp8.cast_bytes``,
    which does, is not among them; tests/plan/test_layer_rates.py compares the kernel times with those
    of fresh rates)."""
    s, whole = c.setup, c.rerun_layers > 0
    # keyed on the GPU object itself (a calibrated preset holds dicts: not hashable), kept beside its
    # rates: while the entry lives, no other object can take its id
    memo, key = c.result.pieces.rates, ("layer", id(gpu), peak, whole)
    found = cast(tuple[GpuPreset, LayerRates] | None, memo.get(key))
    if found is None or found[0] is not gpu:
        rates = LayerRates(
            layer_stream_bytes(s, gpu, whole=whole),
            gemm.efficiencies(s, gpu.sms, roofline(s, gpu, peak)),
            fp8_layers(s, gpu),
            attention_rates(s, gpu, peak),
            layer_kernels(s),
        )
        found = memo[key] = (gpu, rates)
    return found[1]


def kernel_times(c: Critical, gpu: GpuPreset, peak: float) -> tuple[KernelTime, KernelTime]:
    """Forward and backward (recompute included) of one micro-batch on one device of the stage."""
    f = stage_flops(c)
    rates = layer_rates(c, gpu, peak)
    one, back, again = rates.stream
    layer = one * c.layers
    rerun = c.layers * again
    hbm = hbm_bytes_per_s(gpu)
    mm = peak * efficiency.matmul(gpu)
    mm_f, mm_b = matmul_seconds(f, rates.efficiencies, mm, rates.fp8)
    full_f, full_b = matmul_seconds(f, gemm.FULL, mm, (gemm.FULL, rates.fp8[1]) if rates.fp8 else None)
    at_f, at_b = f.attention_forward / rates.attention[0], f.attention_backward / rates.attention[1]
    dq_f, dq_b = dequant_bytes(c)
    cast_f, cast_b = fp8.cast_bytes(c.setup)  # --fp8's casts: the backward's, and a re-run forward's
    # --async-tp's own kernels: its fused all-gathers' shard copies and reduce-scatters' sums
    sym_f, sym_b = async_tp.local_bytes(c.setup)
    forward_bytes = layer + c.layers * (cast_f + sym_f)
    layer_back = back * c.layers
    backward_bytes = layer_back + rerun + c.layers * (cast_b + sym_b) + c.rerun_layers * (cast_f + sym_f)
    # context parallelism's own copies (torch's ring: its merges and accumulators; kv-gather: its
    # reorders), of the rank's heads (a/t, kv/t); the forward's again in every layer whose attention re-runs
    ring_f, ring_b = context_parallel.elementwise_bytes(c.result.pieces.setup, c.setup.parallel.cp_rotate)
    ring_reruns = c.layers if ring_rerun(c, f) else 0
    forward_bytes += c.layers * ring_f
    backward_bytes += c.layers * ring_b + ring_reruns * ring_f
    gap_f, gap_b = launch_seconds(c, gpu, rates.kernels)
    forward = KernelTime(mm_f, at_f, forward_bytes / hbm, full_f, dq_f / hbm, gap_f)
    backward = KernelTime(mm_b, at_b, backward_bytes / hbm, full_b, dq_b / hbm, gap_b)
    return forward, backward


def userbuffer_windows(c: Critical, gpu: GpuPreset, peak: float) -> dict[Overlap, float]:
    """What ``--tp-comm-overlap``'s (or ``--async-tp``'s) collectives hide behind over the step's
    micro-batches (``tp_overlap.windows``): the layers' linears of one micro-batch forward, their forward
    FLOPs at the backward's efficiency (the row-parallel input gradients have their forward's shapes
    transposed) and the re-run's, each at the layers' rate (``--fp8``'s where it applies); {} without it."""
    if not tp_overlap.applies(c.setup):
        return {}
    f, rates = stage_flops(c), layer_rates(c, gpu, peak)
    le, lmm = rates.fp8 if rates.fp8 is not None else (rates.efficiencies, peak * efficiency.matmul(gpu))
    forward = f.linear_forward / le.layer_forward / lmm
    dgrad = f.linear_forward / le.layer_backward / lmm
    rerun = f.rerun_linear / le.layer_forward / lmm
    return tp_overlap.windows(c, forward, dgrad, rerun, c.result.micro_batches)


def layer_stream_bytes(s: Setup, gpu: GpuPreset, whole: bool) -> tuple[float, float, float]:
    """One layer's element-wise bytes as ``MEMORY`` streams them: its forward, its backward and its
    checkpoint's re-run (``rerun_bytes``; ``whole``: the whole layer re-runs)."""
    one = streamed_bytes(s, gpu=gpu)
    return one, streamed_bytes(s, backward=True, gpu=gpu), rerun_bytes(s, gpu, one, whole)


def ring_rerun(c: Critical, f: StageFlops) -> bool:
    """Context parallelism's forward copies run again in backward: the layer (full checkpointing,
    reversible) or its attention core (selective) re-runs."""
    return bool(c.rerun_layers or f.rerun_attention)


def rerun_bytes(s: Setup, gpu: GpuPreset, one: float, whole: bool) -> float:
    """One layer's element-wise bytes its checkpoint re-runs in backward, as ``MEMORY`` streams them, of a
    layer whose forward streams ``one``: torchtitan's per-op SelectiveAC every element-wise op of the
    block (``launch_seconds``), selective checkpointing the eager attention core's (``attention_bytes``),
    a whole re-run layer (``whole``: full / every-k, reversible) its forward's; else none."""
    if op_selective(s):
        return one
    if s.strategy.checkpointing is Checkpointing.SELECTIVE:
        return attention_bytes(s, gpu)
    return one if whole else 0.0


def fp8_layers(s: Setup, gpu: GpuPreset) -> tuple[gemm.Efficiencies, float] | None:
    """Under ``--fp8``: the layers' GEMMs' efficiencies with 1-byte operands against the FP8 ridge, and
    their rate ``MATMUL_FP8`` × the FP8 peak (``time.fp8``); None otherwise."""
    if not fp8.enabled(s):
        return None
    rate = fp8.peak(s, gpu) * efficiency.MATMUL_FP8  # calibrate times 16-bit GEMMs only
    return gemm.efficiencies(s, gpu.sms, gemm.Roofline(rate / hbm_bytes_per_s(gpu), 1)), rate


def roofline(s: Setup, gpu: GpuPreset, peak: float) -> gemm.Roofline:
    """The GEMMs' ridge on ``gpu``: (``MATMUL`` · peak) / (``MEMORY`` · HBM) FLOPs per byte, operands in
    the activation dtype."""
    ridge = peak * efficiency.matmul(gpu) / hbm_bytes_per_s(gpu)
    return gemm.Roofline(ridge, s.training.precision.activation_dtype.bytes)


def attention_seconds(s: Setup, f: StageFlops, gpu: GpuPreset, peak: float) -> tuple[float, float]:
    """Forward and backward (with re-run) seconds of the attention core (``time.attention``): ``f``'s
    attention FLOPs at ``attention_rates`` (linear in them: ``search.bound`` charges a reference rank's at a
    layout's rates)."""
    forward, backward = attention_rates(s, gpu, peak)
    return f.attention_forward / forward, f.attention_backward / backward


def attention_rates(s: Setup, gpu: GpuPreset, peak: float) -> tuple[float, float]:
    """FLOP/s of the attention core, forward and backward (with re-run): eager's batched GEMMs at
    ``MATMUL`` × their wave and roofline efficiency, a flash kernel at its fraction."""
    if attention.is_eager(s):
        roof, shapes = roofline(s, gpu, peak), gemm.attention_core_gemms(s)
        mm = peak * efficiency.matmul(gpu)
        forward = gemm.class_efficiency(shapes, gpu.sms, roof)
        backward = gemm.class_efficiency(gemm.backward_all(shapes), gpu.sms, roof)
        return mm * forward, mm * backward
    work = attention.causal_work(s)
    forward = peak * attention.flash_fraction(s, gpu) / work
    return forward, peak * attention.flash_fraction(s, gpu, backward=True) / work


def hbm_bytes_per_s(gpu: GpuPreset) -> float:
    """What memory-bound kernels stream: ``MEMORY`` (or the calibrated fraction) × the HBM bandwidth."""
    return gpu.hbm_bandwidth_gbps * 1e9 * efficiency.memory(gpu)


def dequant_call_bytes(s: Setup, elements: int) -> int:
    """Bytes one ``dequantize_4bit`` of a weight of ``elements`` moves: it reads the 4-bit storage (packed
    codes, absmax, code books: ``lora_states.quantized_bytes``) and writes the weight in the compute
    dtype."""
    ft = s.finetune
    return quantized_bytes(elements, ft.double_quant) + elements * ft.compute_dtype.bytes


def dequant_bytes(c: Critical) -> tuple[int, int]:
    """QLoRA's dequantisation traffic of one micro-batch, (forward, backward with re-run): bitsandbytes'
    ``MatMul4Bit`` dequantises each frozen 4-bit linear's weight for its forward matmul, and again in
    backward for dX = dY·W where the linear's input needs a gradient (``lora.base_dx_linears``); a re-run
    layer dequantises its forward's again. 0 without QLoRA."""
    s = c.setup
    if s.finetune.method is not Method.QLORA:
        return 0, 0
    shapes = linear_shapes(s.model)
    per_layer = sum(dequant_call_bytes(s, i * o) for i, o in shapes.values())
    backward = sum(
        n * dequant_call_bytes(s, shapes[t][0] * shapes[t][1]) for t, n in base_dx_linears(s).items()
    )
    return c.layers * per_layer, backward + c.rerun_layers * per_layer


def owned_params(c: Critical) -> int:
    """Parameters the optimizer steps on one device of the stage: the trainable ones (all in full
    training; peft's adapters under LoRA/QLoRA, ``lora_states.trainable_params``), 1/dp of them under
    ZeRO ≥ 1."""
    s = c.setup.strategy
    trainable = trainable_params(c.setup, c.params)
    return -(-trainable // s.dp) if s.zero >= ZeroStage.OPTIMIZER else trainable


def optimizer_step_bytes(c: Critical) -> int:
    """Bytes the optimizer step moves on one device of the stage, once per step: ``time.optimizer``'s
    bytes per parameter of the implementation that steps (each of its kernels reads and writes whole
    tensors) and Megatron's passes around it (``framework_ops``), on the parameters the device owns
    (``owned_params``), and Megatron's gradient-buffer zeroing (``megatron_zero_bytes``) — memory-bound
    (Megatron-LM's README: its FLOP/s are "measured for end-to-end training, i.e., includes all operations
    including data loading, optimization, and even logging")."""
    per_owned = optimizer.bytes_per_param(c.setup) + sum(optimizer.framework_ops(c.setup))
    return owned_params(c) * per_owned + optimizer.megatron_zero_bytes(c.setup, c.params.total)


def optimizer_seconds(c: Critical, gpu: GpuPreset) -> float:
    """``optimizer_step_bytes`` at ``MEMORY`` × the HBM bandwidth, plus ``efficiency.launch_gap`` per kernel
    an implementation launches tensor by tensor (``optimizer.launch_kernels``); 0 when the optimizer is
    offloaded (the CPU runs it: ``time.offload``)."""
    if Offload.OPTIMIZER in c.setup.offload:
        return 0.0
    gaps = optimizer.launch_kernels(c.setup, c.layers) * efficiency.launch_gap(gpu)
    return optimizer_step_bytes(c) / hbm_bytes_per_s(gpu) + gaps


def clip_seconds(c: Critical, gpu: GpuPreset) -> float:
    """Gradient clipping before the step (``optimizer.clip_ops``) on the gradients of the parameters the
    device owns (``owned_params``), at ``MEMORY`` × the HBM bandwidth; 0 without clipping or when the
    optimizer is offloaded (module NB of ``time.optimizer``)."""
    if Offload.OPTIMIZER in c.setup.offload:
        return 0.0
    return owned_params(c) * sum(optimizer.clip_ops(c.setup)) / hbm_bytes_per_s(gpu)


def _flash(s: Setup) -> Setup:
    return s.model_copy(update={"strategy": s.strategy.model_copy(update={"attention": Attention.FLASH})})
