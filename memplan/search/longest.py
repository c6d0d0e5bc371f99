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
the allocator only adds to it (reserved ≥ allocated ≥ requested). So the search is in three parts: a
binary search for the longest sequence whose tensors fit (no replay: every longer one fails); under it, a
binary search on the allocator's judgement for a boundary — a sequence that fits beside a longer one that
does not; then, above that boundary, every sequence up to ``WINDOW`` steps, again from each longer one
that fits, until a window holds none: the answer fits and the ``WINDOW`` steps above it do not.
NB: a sequence that fits more than ``WINDOW`` steps above a run of sequences that do not is not found.
The runs that the allocator's rounding and splitting make are a few steps long (GPT-2's above, within 40
tokens); the gap between the tensors' bound and the allocator's answer can be thousands of steps (Llama 3
70B on 8 H100s: 8,156 sequences judged one by one, 49 s, before the binary search).
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


WINDOW = 64
"""Steps above the binary search's boundary judged one by one (module docstring)."""


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


def longest_sequence(
    best: Config, memory: int, cap: int = 1 << 20, gpu: GpuPreset | None = None, expandable: bool = False
) -> int:
    """The longest sequence ``best`` fits at micro-batch 1 in ``memory`` bytes, judged on what the
    allocator reserves with ``gpu`` (``expandable``: under ``expandable_segments:True``; module
    docstring); 0 when none does."""
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
    if lo == 0 or fits(at(lo * step), memory, gpu, expandable):
        return lo * step
    a, b = 0, lo  # the allocator fits at a (0: no sequence), not at b
    while b - a > 1:
        mid = (a + b) // 2
        a, b = (mid, b) if fits(at(mid * step), memory, gpu, expandable) else (a, mid)
    while True:  # a longer one that fits within ``WINDOW`` steps above, until a window holds none
        top = min(a + WINDOW, lo - 1)
        found = next((k for k in range(top, a, -1) if fits(at(k * step), memory, gpu, expandable)), a)
        if found == a:
            return a * step
        a = found
