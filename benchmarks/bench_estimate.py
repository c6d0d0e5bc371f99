"""Start-up cost of ``memplan estimate``: the whole command, as a user runs it, against the floor.

The floor is ``python -c "import typer, rich, pydantic"``: the libraries memplan's CLI stands on. A command
that only parses, computes in pure Python and renders should cost little more than importing them; the
goal is a ratio ≤ 1.5 (issue #13 item 7; `memplan estimate` never loads torch, ≈ 2 s of import).

All are timed as fresh subprocesses (wall clock, ``time.perf_counter``), interleaved, after warm-up rounds
that fill the OS file cache and the bytecode cache; the figure is the median of N runs.

    python benchmarks/bench_estimate.py [--runs 21] [--warmup 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

GOAL_RATIO = 1.5
ESTIMATE_ARGS = ["estimate", "--model", "70b", "--seq", "8192"]
FLOOR = [sys.executable, "-c", "import typer, rich, pydantic"]
TORCH_PROBE = (
    "import sys; from typer.testing import CliRunner; from memplan.cli.app import app; "
    "r = CliRunner().invoke(app, ['estimate', '--model', '70b', '--seq', '8192', '--json']); "
    "assert r.exit_code == 0, r.output; print('torch' in sys.modules)"
)


def memplan_command() -> list[str]:
    """The installed console script beside this interpreter (not a pyenv/asdf shim, which is a shell
    script adding its own start-up), else ``python -m memplan``."""
    script = Path(sys.executable).with_name("memplan")
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    found = shutil.which("memplan")
    if found and "shims" not in Path(found).parts:
        return [found]
    return [sys.executable, "-m", "memplan"]


def bench_env() -> dict[str, str]:
    """The environment of the timed runs: bytecode caching on (as after ``pip install``; a sandbox's
    PYTHONDONTWRITEBYTECODE would make every run recompile memplan's sources), a fixed terminal width."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "COLUMNS": "100"}


def wall_times(cmds: list[list[str]], runs: int, warmup: int) -> list[list[float]]:
    """Seconds of each run of each command, interleaved (A B C A B C …) so that drifting machine load
    falls on all of them alike; ``warmup`` untimed rounds first. Fails if a command fails."""
    env = bench_env()
    times: list[list[float]] = [[] for _ in cmds]
    for i in range(warmup + runs):
        for cmd, out in zip(cmds, times, strict=True):
            start = time.perf_counter()
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
            if i >= warmup:
                out.append(time.perf_counter() - start)
    return times


def torch_loaded() -> bool:
    out = subprocess.run([sys.executable, "-c", TORCH_PROBE], check=True, capture_output=True, text=True)
    return out.stdout.strip() == "True"


def import_breakdown(top: int = 8) -> dict[str, list[tuple[str, float]]]:
    """Where ``memplan``'s import time goes (``python -X importtime``, ms): the modules ``memplan.cli.app``
    imports directly, by cumulative time, and the modules with the largest self time anywhere."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "from memplan.cli.app import main"],
        check=True,
        capture_output=True,
        text=True,
        env=bench_env(),
    ).stderr
    rows: list[tuple[str, int, float, float]] = []  # name, depth, self ms, cumulative ms
    for line in out.splitlines():
        if not line.startswith("import time:") or "|" not in line or "self [us]" in line:
            continue
        self_us, cum_us, name = line.removeprefix("import time:").split("|")
        depth = (len(name) - len(name.lstrip()) - 1) // 2  # ' name' at the top, two spaces a level
        rows.append((name.strip(), depth, int(self_us) / 1000, int(cum_us) / 1000))
    # importtime prints children before their parent: memplan.cli.app's direct imports are the depth-1
    # rows printed after the previous top-level row and before memplan.cli.app's own.
    direct: list[tuple[str, float]] = []
    for name, depth, _self, cum in reversed(rows):
        if depth == 0 and name == "memplan.cli.app":
            continue
        if depth == 0:
            break
        if depth == 1:
            direct.append((name, cum))
    cli_total = next((cum for name, _d, _s, cum in rows if name == "memplan.cli.app"), 0.0)
    return {
        "memplan.cli": [("total", cli_total)],
        "direct_imports": sorted(direct, key=lambda r: -r[1])[:top],
        "largest_self": sorted(((n, s) for n, _d, s, _c in rows), key=lambda r: -r[1])[:top],
    }


def bench(runs: int = 21, warmup: int = 3) -> dict[str, Any]:
    estimate_cmd = memplan_command() + ESTIMATE_ARGS
    est, est_json, floor = wall_times([estimate_cmd, [*estimate_cmd, "--json"], FLOOR], runs, warmup)
    median = statistics.median
    return {
        "command": " ".join(["memplan", *ESTIMATE_ARGS]),
        "runner": " ".join(estimate_cmd[: len(estimate_cmd) - len(ESTIMATE_ARGS)]),
        "floor": 'python -c "import typer, rich, pydantic"',
        "runs": runs,
        "estimate_s": median(est),
        "estimate_json_s": median(est_json),
        "floor_s": median(floor),
        "ratio": median(est) / median(floor),
        "ratio_json": median(est_json) / median(floor),
        "goal_ratio": GOAL_RATIO,
        "estimate_min_max_s": [min(est), max(est)],
        "floor_min_max_s": [min(floor), max(floor)],
        "torch_imported": torch_loaded(),
        "import_ms": import_breakdown(),
    }


def render(r: dict[str, Any]) -> str:
    verdict = "meets" if r["ratio"] <= r["goal_ratio"] else "MISSES"
    torch = "yes" if r["torch_imported"] else "no"
    cli_ms = r["import_ms"]["memplan.cli"][0][1]
    return "\n".join(
        [
            f"{r['command']}  (median of {r['runs']} runs, via {r['runner']})",
            f"  estimate (rich table)  {r['estimate_s'] * 1000:8.1f} ms   ratio {r['ratio']:.2f}",
            f"  estimate --json        {r['estimate_json_s'] * 1000:8.1f} ms   ratio {r['ratio_json']:.2f}",
            f"  floor: {r['floor']}  {r['floor_s'] * 1000:8.1f} ms",
            f"  goal ≤ {r['goal_ratio']}×: {verdict}; torch imported: {torch}",
            f"  import memplan.cli.app: {cli_ms:.1f} ms (python -X importtime, one run)",
            "    its direct imports (cumulative): "
            + ", ".join(f"{n} {ms:.1f}" for n, ms in r["import_ms"]["direct_imports"]),
            "    largest self times: "
            + ", ".join(f"{n} {ms:.1f}" for n, ms in r["import_ms"]["largest_self"]),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    result = bench(args.runs, args.warmup)
    print(json.dumps(result, indent=2) if args.json else render(result))


if __name__ == "__main__":
    main()
