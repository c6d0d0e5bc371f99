"""How fast ``memplan fit`` searches: configurations per second, in-process, and what its shortcuts save.

For the searches of issue #21 — Llama 3 8B at 8,192 tokens on 64 H100s (the default global batch) and
Llama 3.1 405B at 8,192 tokens on 16,384 H100s with Llama 3's global batch of 2,048 — it times
``memplan.search.fit.fit`` (the whole search, ranking included, without the longest-sequence probe) and
reports the configurations of the space per second (families × micro-batch sizes that divide the global
batch: ``searched``), median of ``--runs`` runs, each "cold" (the per-rank pieces and the allocator
replays forgotten first: what one ``memplan fit`` command costs, less the imports). Wall time and the
process's CPU time are both kept: on a shared machine the CPU time is the figure that does not depend on
the other processes' load.

The in-process searches run the allocator replays compiled when numba is installed (``pip install
'.[jit]'``: ``analytic.allocator.jit``, loaded before the first timed run: ``MEMPLAN_JIT=1``); ``--no-jit``:
in Python, the same answers; the report says which.

``--commands N``: what a user's ``memplan fit`` costs instead — each case's command in a fresh process
(imports, the longest-sequence probe, numba's load where it happens), CPU seconds (user + sys) of the
child, median of N, under each ``MEMPLAN_JIT`` policy: ``auto`` (the default: Python replays until they
have spent ``reserved.JIT_LOAD_SECONDS``, then compiled), ``1`` (compiled from the first replay) and ``0``
(Python). ``--load``: that load alone, in a fresh process (numba's import and the first call of each
compiled function), median of 5: what ``JIT_LOAD_SECONDS`` is.

The fast/slow ratio: the same search with ``shortcuts=False`` (``search.families``: every estimated
configuration judged for memory before it is timed) against the default, CPU time, median of
``--slow-runs``; the two give the same rows (tests/plan/test_fit_shortcuts.py).

    python benchmarks/bench_fit.py [--runs 5] [--slow-runs 1] [--json] [--quick] [--no-jit]
                                   [--commands 3] [--load]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

from memplan.api import build_setup
from memplan.config import Parallel
from memplan.engine import clear_caches, estimate
from memplan.presets import load_gpu
from memplan.reserved import clear_replays, compiled_replay
from memplan.search.fit import FitResult, fit
from memplan.search.space import virtual_layers
from memplan.time.timing import timing

Case = tuple[str, int, str, int, int | None, float | None]

CASES: tuple[Case, ...] = (
    ("llama-3-8b", 8192, "h100-sxm", 64, None, None),
    ("llama-3.1-405b", 8192, "h100-sxm", 16384, 2048, None),  # issue #21: Llama 3's cluster and batch
    ("llama-3-70b", 4096, "h100-sxm", 256, None, 0.4),  # at an assumed MFU (``search.mfu_bound``)
)
"""(model, sequence, GPU, GPUs, global batch or None for the default ≈ 4M tokens, ``--mfu`` or None for
the predicted step)."""

TARGET = 20_000
"""Configurations of the space per second the search should reach (issue #21), cold, on 2 cores."""


def published_405b_step() -> float:
    """memplan's step time of Llama 3 405B's published layout on 16,384 H100s (Dubey et al. 2024 §3.3.2:
    TP 8 + SP, PP 16 interleaved over 8 virtual stages with the first and last holding the embedding and
    the head alone, ZeRO-2; 2,048 sequences of 8,192 tokens): what issue #21 asks ``fit`` to match."""
    par = Parallel(tp=8, sp=True, pp=16, vpp=8, pp_layers=virtual_layers(126, 16, 8))
    dp = 16384 // (8 * 16)
    setup = build_setup("llama-3.1-405b", seq=8192, zero=2, dp=dp, parallel=par, grad_accum=2048 // dp)
    return timing(estimate(setup), load_gpu("h100-sxm")).step_time_s


def command(case: Case) -> list[str]:
    """The ``memplan fit`` command of a case."""
    name, seq, gpu, gpus, batch, mfu = case
    out = ["memplan", "fit", "-m", name, "--seq", str(seq), "--gpu", gpu, "--gpus", str(gpus)]
    return out + (["--global-batch", str(batch)] if batch else []) + (["--mfu", str(mfu)] if mfu else [])


def child_cpu(argv: list[str], env: dict[str, str]) -> float:
    """CPU seconds (user + sys) of one child process running ``argv``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


POLICIES = ("auto", "1", "0")
"""``MEMPLAN_JIT``'s policies, as ``--commands`` runs them (alternately)."""


def commands(runs: int) -> list[dict[str, Any]]:
    """Each case's command under each policy, alternately, ``runs`` times: median child CPU seconds."""
    out = []
    for case in CASES:
        argv = command(case)
        seconds: dict[str, list[float]] = {p: [] for p in POLICIES}
        for _ in range(runs):
            for policy in POLICIES:
                seconds[policy].append(child_cpu(argv, {**os.environ, "MEMPLAN_JIT": policy}))
        out.append({"command": " ".join(argv), **{p: statistics.median(v) for p, v in seconds.items()}})
    return out


LOAD = """
import time
start = time.process_time()
import numpy as np
from memplan.analytic.allocator import jit as allocator_jit
allocator_jit.replay_jit([], None, False)
allocator_jit._coded_stream(type("I", (), dict(points=((0, 0, 0, 0, 0),), per_tensor=(0,), states=(0, 0, 0),
    layer=(), state_parts=(), pieces=(), split=0, saves=()))(), 0, 1)
print(time.process_time() - start)
"""
"""The compiled replay's load in a fresh process: numba's import, the first call of the replay and of the
coding (each loads its cached machine code)."""


def jit_load(runs: int = 5) -> float:
    """Median CPU seconds of ``LOAD`` in a fresh process that has imported what ``memplan fit`` imports
    before its first replay (numpy not among them: only numba imports it)."""
    pre = "import memplan.search.fit, memplan.cli.app\n"
    times = []
    for _ in range(runs):
        done = subprocess.run([sys.executable, "-c", pre + LOAD], check=True, capture_output=True, text=True)
        times.append(float(done.stdout.split()[-1]))
    return statistics.median(times)


def search(
    name: str, seq: int, gpu: str, gpus: int, batch: int | None, mfu: float | None, shortcuts: bool = True
) -> FitResult:
    setup, device = build_setup(name, seq=seq), load_gpu(gpu)
    return fit(setup, device, gpus, global_batch=batch, mfu=mfu, max_seq=False, shortcuts=shortcuts)


def timed(case: Case, shortcuts: bool) -> tuple[FitResult, float, float]:
    """One cold search: its result, wall seconds and CPU seconds."""
    clear_caches()
    clear_replays()
    wall, cpu = time.perf_counter(), time.process_time()
    result = search(*case, shortcuts=shortcuts)
    return result, time.perf_counter() - wall, time.process_time() - cpu


def bench(case: Case, runs: int, slow_runs: int) -> dict[str, Any]:
    name, seq, gpu, gpus, _, mfu = case
    search(*case)  # imports, presets and bytecode out of the way
    fast = [timed(case, True) for _ in range(runs)]
    result = fast[-1][0]
    wall = statistics.median(t for _, t, _ in fast)
    cpu = statistics.median(c for _, _, c in fast)
    out: dict[str, Any] = {
        "case": f"{name} seq {seq} on {gpus} × {gpu}" + (f" at --mfu {mfu}" if mfu else ""),
        "configs": result.searched,
        "evaluated": result.evaluated,
        "peaks": result.peaks,
        "pruned": result.pruned,
        "states_only": result.states_only,
        "fitting": len(result.fitting),
        "rejected_families": len(result.rejected),
        "wall_seconds": wall,
        "cpu_seconds": cpu,
        "configs_per_wall_s": result.searched / wall,
        "configs_per_cpu_s": result.searched / cpu,
        "meets_target": result.searched / cpu >= TARGET,
        "compiled_replay": compiled_replay(),
        "best_step_time_s": result.best.timing.step_time_s if result.best else None,
    }
    if name == "llama-3.1-405b" and gpus == 16384:
        out["published_step_time_s"] = published_405b_step()
    if slow_runs:
        slow = [timed(case, False) for _ in range(slow_runs)]
        reference = slow[-1][0]
        same = json.dumps(reference.to_json(top=10)["configs"]) == json.dumps(
            result.to_json(top=10)["configs"]
        )
        out["slow_cpu_seconds"] = statistics.median(c for _, _, c in slow)
        out["slow_over_fast"] = out["slow_cpu_seconds"] / cpu
        out["same_rows"] = same
    return out


def verdict(per_s: float) -> str:
    """Against ``TARGET``: met, or how many times short."""
    return "meets the target" if per_s >= TARGET else f"{TARGET / per_s:.1f}× short of the target"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="timed runs per case (the median is kept)")
    parser.add_argument("--slow-runs", type=int, default=1, help="runs without the shortcuts (0: none)")
    parser.add_argument("--quick", action="store_true", help="one run each (checks the script)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--no-jit", action="store_true", help="replay in Python even with numba installed")
    parser.add_argument(
        "--commands", type=int, default=0, help="also run each case's command N times per MEMPLAN_JIT policy"
    )
    parser.add_argument("--load", action="store_true", help="also time the compiled replay's load alone")
    args = parser.parse_args()
    # read on the first replay (memplan.reserved): compiled from the first one, or never
    os.environ["MEMPLAN_JIT"] = "0" if args.no_jit else "1"
    runs, slow_runs = (1, 0) if args.quick else (args.runs, args.slow_runs)
    rows = [bench(case, runs, slow_runs) for case in CASES]
    doc: dict[str, Any] = {"runs": runs, "slow_runs": slow_runs, "cases": rows}
    if args.commands:
        doc["commands"] = commands(args.commands)
    if args.load:
        doc["jit_load_cpu_s"] = jit_load()
    if args.json:
        print(json.dumps(doc))
        return
    replays = "compiled (numba)" if rows[0]["compiled_replay"] else "in Python"
    print(
        f"memplan fit, cold, median of {runs} runs, allocator replays {replays} "
        f"(configurations of the space per CPU second; target {TARGET:,}/s)"
    )
    for r in rows:
        slow = (
            f"; without shortcuts {r['slow_cpu_seconds']:.1f} s CPU = {r['slow_over_fast']:.1f}× "
            f"(same rows: {r['same_rows']})"
            if "slow_cpu_seconds" in r
            else ""
        )
        print(
            f"  {r['case']:<42} {r['configs']:>6,} configs ({r['evaluated']:,} evaluated, "
            f"{r['peaks']:,} peaks, "
            f"{r['pruned']:,} pruned): {r['cpu_seconds']:.2f} s CPU = {r['configs_per_cpu_s']:,.0f}/s "
            f"(wall {r['wall_seconds']:.2f} s; {verdict(r['configs_per_cpu_s'])}){slow}"
        )
        if "published_step_time_s" in r:
            print(
                f"    best listed {r['best_step_time_s']:.2f} s/step; the published layout by memplan's own "
                f"model {r['published_step_time_s']:.2f} s/step"
            )
    for c in doc.get("commands", []):
        print(
            f"  `{c['command']}`, one process, CPU s (median of {args.commands}): MEMPLAN_JIT=auto "
            f"{c['auto']:.2f}, =1 {c['1']:.2f}, =0 {c['0']:.2f}"
        )
    if "jit_load_cpu_s" in doc:
        load = doc["jit_load_cpu_s"]
        print(f"  the compiled replay's load in a fresh process: {load:.2f} CPU s (median of 5)")


if __name__ == "__main__":
    main()
