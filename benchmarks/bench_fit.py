"""How fast ``memplan fit`` searches: configurations per second, in-process.

For a few searches (dense and MoE, one node to hundreds of GPUs) it times ``memplan.search.fit.fit`` — the
whole search, ranking included, without the longest-sequence probe — and reports the configurations of
the space per second (families × micro-batch sizes that divide the global batch), median of ``--runs``
runs. "warm" runs reuse the per-rank pieces cached by the previous run (what a second search in the same
process costs); "cold" runs clear them first (what one ``memplan fit`` command costs, less the imports).

    python benchmarks/bench_fit.py [--runs 7] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from memplan.api import build_setup
from memplan.engine import clear_caches
from memplan.presets import load_gpu
from memplan.search.fit import FitResult, fit

CASES = (
    ("llama-3-8b", 8192, "a100-80gb", 8, None),
    ("llama-3-70b", 4096, "h100-sxm", 64, None),
    ("llama-3.1-405b", 8192, "h100-sxm", 512, None),
    ("mixtral-8x7b", 4096, "h100-sxm", 32, None),
    ("llama-3.1-405b", 8192, "h100-sxm", 16384, 2048),  # issue #21: Llama 3's cluster and batch
)
"""(model, sequence, GPU, GPUs, global batch or None for the default ≈ 4M tokens)."""

TARGET = 20_000
"""Configurations of the space per second the search should reach (issue #21), cold, on 2 cores."""


def search(name: str, seq: int, gpu: str, gpus: int, batch: int | None) -> FitResult:
    return fit(build_setup(name, seq=seq), load_gpu(gpu), gpus, global_batch=batch, max_seq=False)


def bench(name: str, seq: int, gpu: str, gpus: int, batch: int | None, runs: int) -> dict[str, Any]:
    timings: dict[str, list[float]] = {"cold": [], "warm": []}
    result = search(name, seq, gpu, gpus, batch)  # imports, presets and bytecode out of the way
    for _ in range(runs):
        clear_caches()
        start = time.perf_counter()
        search(name, seq, gpu, gpus, batch)
        timings["cold"].append(time.perf_counter() - start)
        start = time.perf_counter()
        result = search(name, seq, gpu, gpus, batch)
        timings["warm"].append(time.perf_counter() - start)
    out: dict[str, Any] = {
        "case": f"{name} seq {seq} on {gpus} × {gpu}",
        "configs": result.searched,
        "evaluated": result.evaluated,
        "peaks": result.peaks,
        "pruned": result.pruned,
        "fitting": len(result.fitting),
        "rejected_families": len(result.rejected),
    }
    for kind, seconds in timings.items():
        median = statistics.median(seconds)
        out[f"{kind}_seconds"] = median
        out[f"{kind}_configs_per_s"] = result.searched / median
    out["meets_target"] = out["cold_configs_per_s"] >= TARGET
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="timed runs per case (the median is kept)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    rows = [bench(*case, runs=args.runs) for case in CASES]
    if args.json:
        print(json.dumps({"runs": args.runs, "cases": rows}))
        return
    print(
        f"memplan fit, median of {args.runs} runs (configurations of the space per second; target "
        f"{TARGET:,}/s cold)"
    )
    for r in rows:
        print(
            f"  {r['case']:<42} {r['configs']:>6,} configs "
            f"({r['evaluated']:,} evaluated, {r['peaks']:,} peaks, {r['pruned']:,} pruned): "
            f"cold {r['cold_seconds'] * 1000:7.0f} ms = {r['cold_configs_per_s']:8,.0f}/s   "
            f"warm {r['warm_seconds'] * 1000:7.0f} ms = {r['warm_configs_per_s']:8,.0f}/s"
        )


if __name__ == "__main__":
    main()
