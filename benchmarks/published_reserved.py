"""torchtitan's published per-GPU memory (the 2025 Grand Teton tables) against memplan's reserved peak (issue
#22: "reserved peak within ±5 % of published allocator peaks").

    python benchmarks/published_reserved.py            # print the Markdown table and its summary
    python benchmarks/published_reserved.py --write    # and replace docs/published-memory.md's section

Source: pytorch/torchtitan docs/performance.md (eaea6f6), Tables 1-6, the column "Memory(GiB)" (torch
1963fc8, torchao eab345c, torchtitan 9dec370, December 2024). What that figure is, from torchtitan's code
of the time (torchtitan/metrics.py ``DeviceMemoryMonitor.get_peak_stats``; train.py's log line
``memory: {device_mem_stats.max_reserved_gib:5.2f}GiB``): ``torch.cuda.memory_stats()
["reserved_bytes.all.peak"] / 2**30``, the peak of the caching allocator's reserved bytes since the last
``reset_peak_memory_stats()`` (train.py calls it after each log, every ``log_freq`` steps). A reset sets
the peak to the current value, and the reserved bytes of a step stay cached (no ``empty_cache`` in the
loop), so each window's peak is the run's reserved high-water mark — "memory readings are stable across
the whole training process", as the doc says. It is the allocator's segments only: not the CUDA context,
not NCCL's own buffers (NCCL cudaMallocs them itself). It sums every stream's pool: torch's ``DeviceStats``
is one per device, broken down by pool type only (``StatType`` AGGREGATE / SMALL_POOL / LARGE_POOL,
c10/core/Allocator.h; ``reserved_bytes`` in c10/core/CachingDeviceAllocator.h), while blocks are cached
per stream ("Allocations are associated with a stream. Once freed, blocks can be re-allocated on the same
stream", CUDACachingAllocator.cpp). So FSDP2's all-gather stream's and reduce-scatter stream's segments
are in the figure.

memplan's counterpart, per row: the default stream's replayed reserved peak (``memory.allocator.
reserved_peak``, cuBLAS's workspace included: torch takes it from the caching allocator) + FSDP2's
all-gather stream's pool (``memory.fsdp_all_gather_stream``) + its reduce-scatter stream's pool
(``memory.fsdp_reduce_scatter_stream``) + DDP's buckets (``memory.ddp_buckets``, none here). Each pool's
reserved bytes only grow over a run (segments are not released without an OOM retry), so the run's peak of
their sum is the sum of their peaks. Where memplan does not model a pool (``null`` in the JSON: the
all-gather stream under fine-tuning) the cell says so and the total leaves it out.

Each row's typing is the held-out set's (benchmarks/heldout.py ``RUNS``, by name): one source for both
the step time and the memory. The rows the held-out set does not type are listed with the reason.
tests/test_published_reserved.py checks that each typed setup is what its table states and that the doc
holds this output. No error bound is asserted (fitting by test).

NB: torchtitan's float8 rows (tensorwise) are typed by the held-out set as what ran: ``--impl torchtitan
--fp8 tensorwise`` (FSDP2's mixed precision, the run's AC mode), the weights all-gathered in bf16 (the doc
does not state float8 all-gather: heldout.py's notes). ``--compile`` with ``--fp8`` keeps the eager float8
code's saves (``blocks.profiles.compile_note``: the partitioner's float8 weight casts are not modelled).
The compile rows are typed ``--compile --no-compile-loss``: the December-2024 train.py compiled the blocks
only (the loss eager: ``blocks.head.torchtitan_loss_tensors``).
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: the repository root on the path, for benchmarks.heldout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.heldout import ROOT, RUNS, TT25, Run, predict
from benchmarks.sections import section_main

DOC = ROOT / "docs" / "published-memory.md"
START, END = "<!-- published-reserved:start -->", "<!-- published-reserved:end -->"
GIB = 2**30


@dataclass(frozen=True)
class Reading:
    """One row of torchtitan's 2025 tables with its Memory(GiB)."""

    table: str
    """The table's number as performance.md prints it ("T1" … "T6")."""
    row: str
    """The row's label as the table prints it."""
    gib: float
    """Memory(GiB): the logged ``max_reserved_gib``."""
    run: str | None
    """The held-out run (``heldout.RUNS``' name) that types it; None: not typed (``why``)."""
    why: str = ""


_T1, _T3 = "Llama 3.1 8B, 8 × H100, ", "Llama 3.1 8B, 128 × H100, "
_405 = "Llama 3.1 405B, 512 × H100, TP 8 PP 8"
_STACK = "full AC, compile + float8 + AsyncTP"

READINGS: tuple[Reading, ...] = (
    Reading("T1", "FSDP", 82.4, _T1 + "FSDP"),
    Reading("T1", "FSDP + torch.compile", 77.0, _T1 + "+ compile"),
    Reading("T1", "FSDP + torch.compile + Float8", 76.8, _T1 + "+ compile + float8"),
    Reading("T2", "FSDP 8, CP 1, s 32768", 83.9, "Llama 3.1 8B, 8 × H100, CP 1, s 32,768"),
    Reading("T2", "FSDP 4, CP 2, s 65536", 84.2, "Llama 3.1 8B, 8 × H100, CP 2, s 65,536"),
    Reading("T2", "FSDP 2, CP 4, s 131072", 84.0, "Llama 3.1 8B, 8 × H100, CP 4, s 131,072"),
    Reading("T2", "FSDP 1, CP 8, s 262144", 84.5, "Llama 3.1 8B, 8 × H100, CP 8, s 262,144"),
    Reading("T3", "FSDP", 67.0, _T3 + "FSDP"),
    Reading("T3", "FSDP + torch.compile", 62.0, _T3 + "+ compile"),
    Reading("T3", "FSDP + torch.compile + Float8", 61.8, _T3 + "+ compile + float8"),
    Reading("T4", "2D", 71.9, "Llama 3.1 70B, 256 × H100, TP 8, full AC, compile + float8"),
    Reading(
        "T4", "2D + AsyncTP", 67.6, "Llama 3.1 70B, 256 × H100, TP 8, full AC, compile + float8 + AsyncTP"
    ),
    Reading("T5", "1F1B", 82.5, f"{_405} 1F1B, {_STACK}"),
    Reading("T5", "Interleaved 1F1B", 72.7, f"{_405} interleaved 1F1B, {_STACK}"),
    Reading("T6", "FSDP 8, CP 1, s 32768", 75.3, f"{_405}, FSDP 8, s 32,768, {_STACK}"),
    Reading("T6", "FSDP 4, CP 2, s 65536", 75.9, f"{_405}, FSDP 4, CP 2, s 65,536, {_STACK}"),
    Reading("T6", "FSDP 2, CP 4, s 131072", 77.1, f"{_405}, FSDP 2, CP 4, s 131,072, {_STACK}"),
    Reading("T6", "FSDP 1, CP 8, s 262144", 84.9, f"{_405}, FSDP 1, CP 8, s 262,144, {_STACK}"),
)


def held_out(reading: Reading) -> Run:
    """The held-out run that types ``reading`` (it must have one)."""
    (run,) = (r for r in RUNS if r.name == reading.run)
    assert run.source.startswith(TT25), run.name
    return run


@dataclass(frozen=True)
class Pools:
    """memplan's reserved bytes per stream pool of one run (None: the pool is not modelled)."""

    default: int
    all_gather: int | None
    reduce_scatter: int | None
    ddp_buckets: int
    allocated: int

    @property
    def total(self) -> int:
        """What ``reserved_bytes.all.peak`` counts: every modelled pool's reserved bytes."""
        return self.default + (self.all_gather or 0) + (self.reduce_scatter or 0) + self.ddp_buckets


def pools(out: dict[str, Any]) -> Pools:
    """The pools of one ``estimate --json`` output."""
    m = out["memory"]
    return Pools(
        default=int(m["allocator"]["reserved_peak"]),
        all_gather=m["fsdp_all_gather_stream"],
        reduce_scatter=m["fsdp_reduce_scatter_stream"],
        ddp_buckets=int(m["ddp_buckets"] or 0),
        allocated=int(m["allocator"]["allocated_peak"]),
    )


HEADER = (
    "table",
    "row",
    "published GiB",
    "typed (held-out run)",
    "default stream reserved GiB",
    "FSDP2 all-gather stream GiB",
    "FSDP2 reduce-scatter stream GiB",
    "memplan reserved, all streams GiB",
    "Δ",
    "allocated GiB",
)


def _gib(n: int | None) -> str:
    return "not modelled" if n is None else f"{n / GIB:.2f}"


def rows() -> list[tuple[tuple[str, ...], float | None]]:
    """The table's rows and each typed row's error (memplan / published − 1)."""
    out: list[tuple[tuple[str, ...], float | None]] = []
    for rd in READINGS:
        head = (rd.table, rd.row, f"{rd.gib:.1f}")
        if rd.run is None:
            out.append(((*head, f"not typed: {rd.why}", *("–",) * 6), None))
            continue
        run = held_out(rd)
        p = pools(predict(run))
        err = p.total / GIB / rd.gib - 1
        cells = (
            f"{run.name}: `{run.typed}`",
            _gib(p.default),
            _gib(p.all_gather),
            _gib(p.reduce_scatter),
            _gib(p.total),
            f"{err:+.1%}",
            _gib(p.allocated),
        )
        out.append(((*head, *cells), err))
    return out


def summary(errors: list[float], untyped: int) -> str:
    """How many typed rows, their median and worst error, how many within ±5 % (the issue's goal)."""
    n = len(errors)
    worst = max(errors, key=abs)
    median = statistics.median(abs(e) for e in errors)
    inside = sum(abs(e) <= 0.05 for e in errors)
    return (
        f"{n} rows typed ({untyped} not): median |Δ| {median:.1%}, worst {worst:+.1%}; "
        f"{inside}/{n} within ±5 %."
    )


def markdown() -> str:
    """The table and its summary line, as docs/published-memory.md holds them."""
    got = rows()
    lines = ["| " + " | ".join(HEADER) + " |", "|---|---|---:|---|" + "---:|" * 6]
    lines += ["| " + " | ".join(cells) + " |" for cells, _ in got]
    errors = [e for _, e in got if e is not None]
    return "\n".join(lines) + "\n\n" + summary(errors, len(got) - len(errors)) + "\n"


def main(argv: list[str] | None = None) -> int:
    return section_main(argv, (__doc__ or "").splitlines()[0], DOC, START, END, markdown)


if __name__ == "__main__":
    sys.exit(main())
