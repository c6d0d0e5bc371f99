"""The longest sequence the best configuration of a ``fit`` search fits at micro-batch 1.

Sequences step by tp under sequence parallelism, by 2·cp under context parallelism (cp·lcm(2, tp) with
both); learned positions cap them at ``max_positions``.

Judged on what the allocator reserves (``budget.fits``), "fits" is not monotonic in the sequence: the
stream's tensors change size with it, and with their sizes the allocator's segments (a request ≥ 10 MiB
opens a segment rounded to 2 MiB, a smaller one a 20 MiB segment) and its splits (a cached block is
split only when more than 1 MiB remains; else the whole block is handed out): a longer sequence can
round or split into less reserved memory than a shorter one (tests/plan/test_longest.py shows such a
pair). What is monotonic is the tensors' own judgement — the stages' lower bounds and the requested peak
(the estimate's peak plus cuBLAS's workspaces; each term grows with the sequence) within the memory — and
the allocator only adds to it (reserved ≥ allocated ≥ requested). So the search is in two parts: a
binary search for the longest sequence whose tensors fit (no replay: every longer one fails), then, from
there down, step by step, the first sequence the allocator fits: the longest that fits.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from memplan.config import PositionType
from memplan.engine import Result, estimate
from memplan.presets import GpuPreset
from memplan.reserved import cublas_workspaces
from memplan.search.budget import fits

if TYPE_CHECKING:
    from memplan.search.results import Config


def sequence_step(p: Result) -> int:
    """The step of the sequences searched for ``p``'s layout (module docstring)."""
    par = p.parallel
    step = par.tp if par.sp else 1
    if par.cp > 1:
        step = par.cp * math.lcm(2, step)
    return step


def tensors_fit(p: Result, memory: int, gpu: GpuPreset | None) -> bool:
    """The stages' lower bounds and the requested peak (the peak plus cuBLAS's workspaces on ``gpu``) fit
    ``memory``: necessary for ``budget.fits``, and monotonic in the sequence."""
    requested = p.device.peak.default_stream_bytes + cublas_workspaces(gpu)  # as ``budget.fits``
    return all(sp.lower_bound <= memory for sp in p.stages) and requested <= memory


def longest_sequence(best: Config, memory: int, cap: int = 1 << 20, gpu: GpuPreset | None = None) -> int:
    """The longest sequence ``best`` fits at micro-batch 1 in ``memory`` bytes, judged on what the
    allocator reserves with ``gpu`` (module docstring); 0 when none does."""
    p = best.result
    step = sequence_step(p)
    if p.setup.model.position is PositionType.LEARNED:
        cap = min(cap, p.setup.model.max_positions)
    n = p.micro_batches * p.setup.training.micro_batch

    def at(seq: int) -> Result:
        training = p.setup.training.model_copy(update={"seq_len": seq, "micro_batch": 1, "grad_accum": n})
        return estimate(p.setup.model_copy(update={"training": training}))

    lo, hi = 0, cap // step  # in steps: the tensors fit at lo·step (or lo = 0), not above hi·step
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if tensors_fit(at(mid * step), memory, gpu) else (lo, mid - 1)
    if gpu is None:  # without a GPU, fitting is the tensors' judgement
        return lo * step
    return next((k * step for k in range(lo, 0, -1) if fits(at(k * step), memory, gpu)), 0)
