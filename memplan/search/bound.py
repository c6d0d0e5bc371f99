"""A lower bound of a configuration's predicted step time from its FLOPs alone, and the cut-off it is
compared with: what lets ``fit`` skip configurations that cannot be among the fastest it lists.

The predicted step (``time.predict``) is at least its busy time stretched by the bubble,
busy · (1 + (p − 1)/(m·n)), and busy is at least the busiest stage's compute, n·(forward + backward). Every
FLOP the engine counts (``flops.total``: matrix products, attention, recompute) runs no faster than
max(``MATMUL``, ``ATTENTION``) × peak (wave quantization only slows a GEMM, element-wise work and
communication only add), and the busiest device runs at least the average device's share of the step's
FLOPs. So, for B sequences of h FLOPs each on N devices:

    step ≥ B·h / (N · peak · max(MATMUL, ATTENTION)) · (1 + (p − 1)/(m·n))

h is the engine's own per-sequence count for the same checkpointing, attention, context-parallel degree
and method, on one tensor- and pipeline-parallel rank (tensor parallelism only pads the vocabulary, so
never counts fewer; context parallelism counts its causal split, so it has its own). tests/plan/
test_fit_search.py checks the bound against the prediction over a sample of layouts.

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

NB: the bound holds while no kernel class runs above max(MATMUL, ATTENTION) × the precision's peak
(``time.compute``); with an assumed ``--mfu`` nothing is pruned.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from memplan.config import Attention, Checkpointing, Parallel, Setup
from memplan.engine import Result, estimate
from memplan.presets import GpuPreset
from memplan.search.methods import valid
from memplan.time import efficiency
from memplan.time.calibration import calibrated_topology
from memplan.time.comm.collectives import cp_rows, ep_rows, pp_rows, tp_rows
from memplan.time.comm.rows import Row, critical_stage
from memplan.time.compute import kernel_times
from memplan.time.predict import IN_STAGE, exposed, windows
from memplan.time.timing import peak_flops


@dataclass
class Bound:
    """Lower bounds of step times for the search of ``global_batch`` sequences on ``gpus`` × ``gpu``."""

    gpu: GpuPreset
    gpus: int
    global_batch: int
    _flops: dict[tuple[object, ...], float] = field(default_factory=dict)

    def sequence_flops(self, base: Setup, ckpt: Checkpointing, attention: Attention, cp: int) -> float:
        """h: the engine's FLOPs of one sequence (whole model) for this checkpointing, attention and cp
        (0 when the reference cannot be built: nothing is then pruned)."""
        key = (base.finetune, base.offload, base.loss, ckpt, attention, cp)
        if key not in self._flops:
            try:
                setup = base.model_copy(
                    update={
                        "parallel": Parallel(cp=cp),
                        "training": base.training.model_copy(update={"micro_batch": 1, "grad_accum": 1}),
                        "strategy": base.strategy.model_copy(
                            update={"checkpointing": ckpt, "checkpoint_every": 1, "attention": attention}
                        ),
                    }
                )
                self._flops[key] = float(estimate(setup).flops.total) if valid(setup) else 0.0
            except ValueError:
                self._flops[key] = 0.0
        return self._flops[key]

    def seconds(self, base: Setup, ckpt: Checkpointing, attention: Attention, par: Parallel, n: int) -> float:
        """The bound for layout ``par`` with ``n`` micro-batches per step (module docstring)."""
        rate = peak_flops(self.gpu, base.training.precision) * max(efficiency.MATMUL, efficiency.ATTENTION)
        h = self.sequence_flops(base, ckpt, attention, par.cp)
        return self.global_batch * h / (self.gpus * rate) * (1 + (par.pp - 1) / (par.vpp * n))


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
