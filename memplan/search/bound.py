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

NB: the bound holds while no kernel class runs above max(MATMUL, ATTENTION) × the precision's peak
(``time.compute``); with an assumed ``--mfu`` nothing is pruned.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from memplan.config import Attention, Checkpointing, Parallel, Setup
from memplan.engine import estimate
from memplan.presets import GpuPreset
from memplan.search.methods import valid
from memplan.time import efficiency
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
