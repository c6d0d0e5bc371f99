"""A lower bound of a configuration's predicted step time from one reference sequence's kernels, and the
cut-off it is compared with: what lets ``fit`` skip configurations that cannot be among the fastest it
lists.

The predicted step (``time.predict``) is at least its busy time stretched by the bubble,
busy · (1 + (p − 1)/(m·n)), and busy is at least the busiest stage's kernels, n·(forward + backward)
(``time.compute.kernel_times`` of ``comm.rows.critical_stage``: matrix products, attention, element-wise
work, launch gaps and QLoRA's dequantisation, added; communication only adds). The busiest stage's
kernels are bounded from one reference sequence (b = 1, no tensor or pipeline parallelism, the layout's
cp and its rotation), each class at the fastest rate any micro-batch size or tensor-parallel degree gives
it at that length, and the layout's own tensor-parallel collectives:

- the linears (forward, backward, re-run) at the matmul fraction × the linears' peak (the FP8 peak under
  ``--fp8``; ``linear_rate``): wave and tile quantization and the roofline only slow a GEMM, and a
  tensor-parallel rank runs 1/t of them (only the head's vocabulary is padded);
- the attention core at its kernel's fraction on a full grid (``time.attention.flash_fraction``: its
  grid factors, the only terms that read b or tp, are at most 1), eager attention's GEMMs at the matmul
  fraction × their roofline (a batched GEMM's intensity reads its shape, not its count b·a/t);
- the element-wise bytes (``time.layer_elementwise.streamed_bytes``, forward, backward and the
  checkpoint's re-run, at ``MEMORY`` × HBM as ``kernel_times`` charges them): linear in the micro-batch's
  sequences, and a tensor-parallel rank moves at least 1/t of one rank's (sequence parallelism splits the
  norms and residual adds, tensor parallelism the rest; without sp they repeat);
- context parallelism's own copies (``strategies.context_parallel.elementwise_bytes``: the ring's merges
  and accumulators or the K/V all-gather's reorders, of the rank's 1/t of the heads; linear in b);
- under sequence parallelism, the tensor-parallel collectives of a layer that no compute hides
  (``tp_layer_seconds``: six, ten with full checkpointing's re-run; their bandwidth terms, linear in b);
  and, after the bubble as ``predict`` adds them, the pipeline's sends (``pp_step_seconds``).

Left out (never negative): the fp8 casts (per weight, not per token),
launch gaps, dequantisation, every other collective. Each term is linear in the sequences, so with e
seconds of a layer and x of the head for one sequence (its t·cp ranks together) and n·b = B/dp sequences
per data-parallel rank, a device of a stage with L layers runs at least (B/dp)·L·e/(t·cp) = B·p·L·e/N
seconds (plus B·p·x/N on the last stage). The stage ``critical_stage`` picks has the most forward FLOPs,
ties to the later one: either it is the last stage, or it holds more than the last's layers plus the
head's forward FLOPs in layers (``Sequence.busiest``); and it holds at least the fewest layers. So

    step ≥ B·p/N · busiest · (1 + (p − 1)/(m·n)) + sends

tests/plan/test_fit_search.py checks the bound against every ZeRO stage's prediction over a sample of
layouts, the claims on the element-wise bytes (linear in b, ≥ 1/t under tp) and the attention fraction
(the full grid's is the largest) over presets, the collectives against ``tp_rows`` by hand, and end to
end the rows against a search that prunes nothing.

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

NB: the bound holds while ``reference_sequence`` charges each class no more than ``time.compute`` does (a
new kernel class, or a new dependence of a rate on b or tp, enters there); with an assumed ``--mfu``
nothing is pruned.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass, field

from memplan.config import Attention, Checkpointing, Parallel, Setup
from memplan.engine import Result, estimate
from memplan.presets import GpuPreset
from memplan.search.methods import valid
from memplan.strategies import context_parallel
from memplan.strategies.pipeline_parallel import stage_layers
from memplan.time import efficiency, fp8
from memplan.time.calibration import calibrated_topology
from memplan.time.comm.collectives import cp_rows, ep_rows, pp_rows, tp_rows
from memplan.time.comm.fabric import link, ring_bandwidth, send_rate
from memplan.time.comm.rows import Critical, Row, critical_stage, hidden_bytes
from memplan.time.compute import (
    attention_seconds,
    hbm_bytes_per_s,
    kernel_times,
    rerun_bytes,
    stage_flops,
)
from memplan.time.layer_elementwise import streamed_bytes
from memplan.time.predict import IN_STAGE, exposed, windows
from memplan.time.timing import peak_flops


def linear_rate(setup: Setup, gpu: GpuPreset) -> float:
    """FLOP/s no matrix product of ``setup`` on ``gpu`` exceeds (module docstring): the matmul fraction
    (``MATMUL`` or the calibrated one) × the FP8 peak under ``--fp8`` (its layers' GEMMs), else × the
    precision's dense peak; wave and tile quantization and the roofline only slow a GEMM."""
    peak = peak_flops(gpu, setup.training.precision)
    return efficiency.matmul(gpu) * (max(peak, fp8.peak(setup, gpu)) if fp8.enabled(setup) else peak)


def layer_stream_seconds(c: Critical, gpu: GpuPreset) -> float:
    """One layer's element-wise seconds of stage ``c``'s micro-batch on one of its ranks, forward, backward
    and the checkpoint's re-run as ``time.compute.kernel_times`` charges them (no ring copies, no fp8
    casts)."""
    one = streamed_bytes(c.setup, gpu=gpu)
    rerun = rerun_bytes(c.setup, gpu, one, whole=c.rerun_layers > 0)
    return (one + streamed_bytes(c.setup, backward=True, gpu=gpu) + rerun) / hbm_bytes_per_s(gpu)


def tp_layer_seconds(
    x: int, par: Parallel, gpu: GpuPreset, ckpt: Checkpointing = Checkpointing.NONE
) -> float:
    """The sequence-parallel collectives of one layer that no compute hides, in ``Sequence``'s units (one
    sequence, its t · cp ranks together): ``comm.collectives.tp_rows``' two all-gathers of the linears'
    inputs and two reduce-scatters of their outputs in forward and two all-gathers of the output gradients
    in backward, six calls of X = b·x bytes a micro-batch (``Overlap.NONE``; x = (s/cp)·h·e, one
    sequence's, ``Sequence.hidden_bytes``), and a re-run
    layer's (full checkpointing) all-gathers and reduce-scatters, four more; each at least its ring's
    (t − 1)/t · X / bandwidth (``comm.fabric.collective_seconds`` less its latency); the head's calls left
    out. 0 without sequence parallelism (``fit`` searches tp > 1 with sp only)."""
    t = par.tp
    if t == 1 or not par.sp:
        return 0.0
    on = link(calibrated_topology(gpu), 1, t)  # tp innermost: stride 1 (``comm.rows.ORDER``)
    calls = 6 + (4 if ckpt >= Checkpointing.EVERY_K else 0)  # a re-run layer's all-gathers, reduce-scatters
    return t * par.cp * calls * (t - 1) / t * x / ring_bandwidth(on)


def pp_step_seconds(x: int, par: Parallel, gpu: GpuPreset, gpus: int, global_batch: int) -> float:
    """The pipeline's sends that no compute hides, per device and step: ``comm.collectives.pp_rows``' one
    send of X/t each way for every micro-batch and chunk (``Overlap.NONE``; ``predict`` adds them after the
    bubble), X = b·x bytes (x one sequence's, ``Sequence.hidden_bytes``), each at least its bytes over the
    sender's rate (``comm.fabric.send_rate``; ``collective_seconds`` less its latency): 2·m·(B/dp)·⌊x/t⌋ /
    rate. 0 without a pipeline."""
    if par.pp == 1:
        return 0.0
    on = link(calibrated_topology(gpu), par.tp * par.cp, 2)  # two neighbouring stages, tp·cp apart
    sequences = global_batch / (gpus // (par.tp * par.cp * par.pp))  # n·b a data-parallel rank
    return 2 * par.vpp * sequences * (x // par.tp) / send_rate(on)


@dataclass(frozen=True)
class Sequence:
    """One reference sequence's seconds (module docstring), its cp ranks' together on tp 1: through one
    layer (its linears, its attention core, its element-wise bytes; forward, backward and the checkpoint's
    re-run) and through the lm head; and ``head_layers``, the head's forward FLOPs in layers' (what
    ``time.comm.rows.critical_stage`` weighs the last stage's head by)."""

    layer_seconds: float
    head_seconds: float
    head_layers: float
    hidden_bytes: int
    """x = (s/cp)·h·e: one sequence's hidden states on a context-parallel rank (``comm.rows.hidden_bytes``
    at b = 1), what a tensor- or pipeline-parallel collective moves per sequence."""

    def busiest(self, counts: tuple[int, ...]) -> float:
        """A lower bound of the seconds of the stage ``critical_stage`` picks, over stages of ``counts``
        layers (the last one with the head): it has the most forward FLOPs, ties to the later stage. Either
        it is the last, or a stage with more than ``head_layers`` layers beyond the last's (its forward
        FLOPs above the last's; the head's padded vocabulary under tp only raises that); and it holds at
        least the fewest layers."""
        layer, last = self.layer_seconds, counts[-1]
        if len(counts) == 1:
            return last * layer + self.head_seconds
        either = min(last * layer + self.head_seconds, (last + self.head_layers) * layer)
        return max(min(counts) * layer, either)


NOTHING = Sequence(0.0, 0.0, 0.0, 0)
"""Where the reference cannot be built: nothing is pruned."""


def reference_sequence(setup: Setup, gpu: GpuPreset) -> Sequence:
    """``Sequence`` of ``setup`` (b = 1, no tensor or pipeline parallelism: one stage holds every layer)."""
    c = critical_stage(estimate(setup))
    f, layers, cp = stage_flops(c), c.layers, setup.parallel.cp
    linears = (f.linear_forward + f.linear_backward + f.rerun_linear) / linear_rate(setup, gpu)
    core = sum(attention_seconds(setup, f, gpu, peak_flops(gpu, setup.training.precision), full_grid=True))
    per_layer = (linears + core) / layers + layer_stream_seconds(c, gpu)
    # context parallelism's own copies, as ``kernel_times`` adds them: a layer's forward and backward, the
    # forward's again where the layer or its attention re-runs (the rank's heads: 1/t of them under tp)
    ring_f, ring_b = context_parallel.elementwise_bytes(c.result.pieces.setup, setup.parallel.cp_rotate)
    again = ring_f if c.rerun_layers or f.rerun_attention else 0
    per_layer += (ring_f + ring_b + again) / hbm_bytes_per_s(gpu)
    head = (f.head_forward + f.head_backward) / linear_rate(setup, gpu)
    layer_forward = (f.linear_forward + f.attention_forward) / layers
    head_layers = f.head_forward / layer_forward if layer_forward else 0.0
    return Sequence(cp * per_layer, cp * head, head_layers, hidden_bytes(setup))


@dataclass
class Bound:
    """Lower bounds of step times for the search of ``global_batch`` sequences on ``gpus`` × ``gpu``."""

    gpu: GpuPreset
    gpus: int
    global_batch: int
    _sequences: dict[tuple[object, ...], Sequence] = field(default_factory=dict)

    def sequence(self, base: Setup, ckpt: Checkpointing, attention: Attention, par: Parallel) -> Sequence:
        """The reference sequence for this checkpointing, attention and ``par``'s context parallelism (its
        degree and rotation: the attention kernels' lengths) (``NOTHING`` when it cannot be built)."""
        key = (base.finetune, base.offload, base.loss, ckpt, attention, par.cp, par.cp_rotate)
        if key not in self._sequences:
            setup = base.model_copy(
                update={
                    "parallel": Parallel(cp=par.cp, cp_rotate=par.cp_rotate),
                    "training": base.training.model_copy(update={"micro_batch": 1, "grad_accum": 1}),
                    "strategy": base.strategy.model_copy(
                        update={"checkpointing": ckpt, "checkpoint_every": 1, "attention": attention}
                    ),
                }
            )
            try:
                one = reference_sequence(setup, self.gpu) if valid(setup) else NOTHING
            except ValueError:
                one = NOTHING
            self._sequences[key] = one
        return self._sequences[key]

    def seconds(self, base: Setup, ckpt: Checkpointing, attention: Attention, par: Parallel, n: int) -> float:
        """The bound for layout ``par`` with ``n`` micro-batches per step (module docstring)."""
        one = self.sequence(base, ckpt, attention, par)
        comm = tp_layer_seconds(one.hidden_bytes, par, self.gpu, ckpt)
        if comm:
            one = dataclasses.replace(one, layer_seconds=one.layer_seconds + comm)
        busy = self.global_batch * par.pp * one.busiest(stage_layers(base.model.num_layers, par)) / self.gpus
        sends = pp_step_seconds(one.hidden_bytes, par, self.gpu, self.gpus, self.global_batch)
        # less a billionth: the prediction adds the same terms in another order (rounding)
        return (busy * (1 + (par.pp - 1) / (par.vpp * n)) + sends) * (1 - 1e-9)


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
