"""A lower bound of a configuration's predicted step time from its FLOPs and element-wise bytes alone, and
the cut-off it is compared with: what lets ``fit`` skip configurations that cannot be among the fastest it
lists.

The predicted step (``time.predict``) is at least its busy time stretched by the bubble,
busy · (1 + (p − 1)/(m·n)), and busy is at least the busiest stage's kernels, n·(forward + backward)
(``time.compute.kernel_times``: matrix products, attention, element-wise work, launch gaps and QLoRA's
dequantisation, added; communication only adds). Two of its terms are bounded from one reference
sequence (b = 1, no tensor or pipeline parallelism, the layout's cp):

- FLOPs: every FLOP the engine counts (``flops.total``: matrix products, attention, recompute) runs no
  faster than ``fastest_rate`` (the best of the matmul fraction × the linears' peak — the FP8 peak under
  ``--fp8`` — and every attention kernel's fraction × the dense peak; wave quantization only slows a GEMM),
  and the busiest device runs at least the average device's share of the step's FLOPs (it is the stage
  with the most forward FLOPs, ``comm.rows.critical_stage``);
- element-wise bytes (``time.layer_elementwise.streamed_bytes``, forward, backward and the checkpoint's
  re-run, as ``kernel_times`` charges them at ``MEMORY`` × HBM): a layer's are linear in the micro-batch's
  sequences, and a tensor-parallel rank moves at least 1/t of one rank's (sequence parallelism splits the
  norms and residual adds, tensor parallelism the rest; without sp they repeat); the busiest stage holds
  at least the fewest layers of any stage. With e seconds for one sequence through one layer on one rank
  of tp 1 (its cp ranks' together) and n·b = B/dp sequences per data-parallel rank, a device moves at least
  (B/dp)·L·e/(t·cp) = B·p·L·e/N. Context parallelism's ring copies, the fp8 casts (per weight, not per
  token), launch gaps and dequantisation are left out (never negative).

So, for B sequences of h FLOPs and e element-wise seconds a layer each on N devices, L the fewest layers of
a stage:

    step ≥ (B·h / (N · fastest_rate) + B·p·L·e / N) · (1 + (p − 1)/(m·n))

tests/plan/test_fit_search.py checks the bound against the prediction over a sample of layouts, and the
two claims on the element-wise bytes (linear in b, ≥ 1/t under tp) over the presets.

``Cutoff`` keeps the ``keep`` fastest step times found so far (per method and saver level): a
configuration whose bound exceeds the slowest of them cannot enter the list.

``stages_bound`` is a second, tighter bound, for one configuration and every ZeRO stage of it at once:
the terms of ``time.predict``'s step that do not depend on the ZeRO stage. Only the data-parallel
collectives (``comm.dp.dp_rows``), FSDP2's copy kernels of their gathers and reductions
(``time.dp_copies``: ZeRO-3), gradient clipping and the optimizer step (``compute.owned_params``) read
it; the busiest
stage, its kernels, the tensor-, context-, pipeline- and expert-parallel collectives and their overlap
windows do not. With every stage-dependent term (and the offload copies, never negative) left out,

    step ≥ busy + busy·(p − 1)/(m·n) + exposed(pp),   busy = n·(forward + backward) + exposed(tp, cp, ep)

computed with ``predict``'s own operations in its order: IEEE addition and multiplication of
non-negative numbers are monotonic, so the bound is ≤ the predicted step of every stage bit for bit.
tests/plan/test_fit_search.py checks it against the prediction of every ZeRO stage over a sample.

NB: the bound holds while no kernel class runs above ``fastest_rate`` (``time.compute``: a new kernel class
with a rate of its own enters there); with an assumed ``--mfu`` nothing is pruned.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from memplan.config import Attention, Checkpointing, Parallel, Setup
from memplan.engine import Result, estimate
from memplan.presets import GpuPreset
from memplan.search.methods import valid
from memplan.strategies.checkpointing import op_selective
from memplan.strategies.pipeline_parallel import stage_layers
from memplan.time import efficiency, fp8
from memplan.time.calibration import calibrated_topology
from memplan.time.comm.collectives import cp_rows, ep_rows, pp_rows, tp_rows
from memplan.time.comm.rows import Row, critical_stage
from memplan.time.compute import hbm_bytes_per_s, kernel_times
from memplan.time.layer_elementwise import attention_bytes, streamed_bytes
from memplan.time.predict import IN_STAGE, exposed, windows
from memplan.time.timing import peak_flops


def fastest_rate(setup: Setup, gpu: GpuPreset) -> float:
    """FLOP/s no kernel of ``setup`` on ``gpu`` exceeds (module docstring): the matmul fraction (``MATMUL``
    or the calibrated one) × the linears' peak (the FP8 peak under ``--fp8``), or the fastest attention
    fraction memplan knows × the dense peak (``ATTENTION``, FlashAttention-3's, cuDNN's curve, a calibrated
    rate or curve)."""
    peak = peak_flops(gpu, setup.training.precision)
    linears = fp8.peak(setup, gpu) if fp8.enabled(setup) else peak
    cal = gpu.calibrated
    curves = [efficiency.CUDNN_HOPPER, efficiency.CUDNN_HOPPER_NONCAUSAL]
    curves += [cal.attention_curve] if cal is not None and cal.attention_curve else []
    fractions = [
        efficiency.ATTENTION,
        efficiency.FA3_SPEEDUP * max(efficiency.FA2_HOPPER, efficiency.FA2_HOPPER_BACKWARD),
        *(max(f, b) for curve in curves for _, f, b in curve),
        *([cal.attention] if cal is not None and cal.attention else []),
    ]
    return max(efficiency.matmul(gpu) * linears, max(fractions) * peak)


@dataclass(frozen=True)
class Sequence:
    """One reference sequence's work (module docstring): h FLOPs through the whole model, at most ``rate``
    FLOP/s (``fastest_rate``), and e element-wise seconds through one layer (forward, backward, the
    checkpoint's re-run) on one rank of tp 1."""

    flops: float
    rate: float
    layer_seconds: float


NOTHING = Sequence(0.0, 1.0, 0.0)
"""Where the reference cannot be built: nothing is pruned."""


def layer_stream_seconds(setup: Setup, gpu: GpuPreset) -> float:
    """One layer's element-wise seconds of ``setup``'s micro-batch on one of its ranks, forward, backward and
    the checkpoint's re-run as ``time.compute.kernel_times`` charges them (no ring copies, no fp8 casts)."""
    one = streamed_bytes(setup, gpu=gpu)
    ckpt = setup.strategy.checkpointing
    if op_selective(setup) or ckpt >= Checkpointing.EVERY_K or setup.strategy.reversible:
        rerun = one  # the whole layer's forward again
    elif ckpt is Checkpointing.SELECTIVE:
        rerun = attention_bytes(setup, gpu)
    else:
        rerun = 0.0
    return (one + streamed_bytes(setup, backward=True, gpu=gpu) + rerun) / hbm_bytes_per_s(gpu)


@dataclass
class Bound:
    """Lower bounds of step times for the search of ``global_batch`` sequences on ``gpus`` × ``gpu``."""

    gpu: GpuPreset
    gpus: int
    global_batch: int
    _sequences: dict[tuple[object, ...], Sequence] = field(default_factory=dict)

    def sequence(self, base: Setup, ckpt: Checkpointing, attention: Attention, cp: int) -> Sequence:
        """The reference sequence for this checkpointing, attention and cp (``NOTHING`` when it cannot be
        built)."""
        key = (base.finetune, base.offload, base.loss, ckpt, attention, cp)
        if key not in self._sequences:
            setup = base.model_copy(
                update={
                    "parallel": Parallel(cp=cp),
                    "training": base.training.model_copy(update={"micro_batch": 1, "grad_accum": 1}),
                    "strategy": base.strategy.model_copy(
                        update={"checkpointing": ckpt, "checkpoint_every": 1, "attention": attention}
                    ),
                }
            )
            try:
                if valid(setup):
                    flops = float(estimate(setup).flops.total)
                    layer = cp * layer_stream_seconds(setup, self.gpu)
                    self._sequences[key] = Sequence(flops, fastest_rate(setup, self.gpu), layer)
                else:
                    self._sequences[key] = NOTHING
            except ValueError:
                self._sequences[key] = NOTHING
        return self._sequences[key]

    def seconds(self, base: Setup, ckpt: Checkpointing, attention: Attention, par: Parallel, n: int) -> float:
        """The bound for layout ``par`` with ``n`` micro-batches per step (module docstring)."""
        one = self.sequence(base, ckpt, attention, par.cp)
        fewest = min(stage_layers(base.model.num_layers, par))
        flops = self.global_batch * one.flops / (self.gpus * one.rate)
        elementwise = self.global_batch * par.pp * fewest * one.layer_seconds / self.gpus
        return (flops + elementwise) * (1 + (par.pp - 1) / (par.vpp * n))


def stages_bound(p: Result, gpu: GpuPreset) -> float:
    """A lower bound of ``timing(q, gpu).step_time_s`` for ``p`` and every ``q`` that differs from it
    only in the ZeRO stage (module docstring): ``predict``'s step without the data-parallel collectives,
    the optimizer step and the offload copies."""
    peak = peak_flops(gpu, p.setup.training.precision)
    c = critical_stage(p)
    topo = calibrated_topology(gpu)
    forward, backward = kernel_times(c, gpu, peak)
    n, par = p.micro_batches, p.parallel
    rows: list[Row] = [
        row for dimension in (tp_rows, cp_rows, pp_rows, ep_rows) for row in dimension(c, topo)
    ]
    hidden = exposed(rows, windows(forward, backward, n, par.cp))
    in_stage = sum(v for k, v in hidden.items() if k in IN_STAGE)
    compute = n * (forward.total_s + backward.total_s)
    busy = compute + in_stage
    bubble = busy * (par.pp - 1) / (par.vpp * n)
    return busy + bubble + hidden.get("pp", 0.0)


@dataclass
class Cutoff:
    """The ``keep`` fastest step times so far (0: keep everything, prune nothing)."""

    keep: int
    _heap: list[float] = field(default_factory=list)
    """The negated times, a max-heap of the kept ones."""

    def add(self, seconds: float) -> None:
        if not self.keep:
            return
        if len(self._heap) < self.keep:
            heapq.heappush(self._heap, -seconds)
        elif seconds < -self._heap[0]:
            heapq.heapreplace(self._heap, -seconds)

    @property
    def seconds(self) -> float:
        """A configuration slower than this cannot be among the ``keep`` fastest (inf until that many)."""
        if not self.keep or len(self._heap) < self.keep:
            return float("inf")
        return -self._heap[0]
