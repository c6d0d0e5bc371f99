"""Start-up cost of ``memplan estimate``: the whole command, as a user runs it, against the floor.

The floor is ``python -c "import typer, rich, pydantic"``: the libraries memplan's CLI stands on. A command
that only parses, computes in pure Python and renders should cost little more than importing them; the
goal is a ratio ≤ 1.5 (issue #13 item 7; `memplan estimate` never loads torch, ≈ 2 s of import).

All are timed as fresh subprocesses (wall clock, ``time.perf_counter``, and the child's CPU time, user +
system, from ``os.wait4``: steadier than wall time on a shared machine), interleaved, after warm-up rounds
that fill the OS file cache and the bytecode cache; the figure is the median of N runs.

Two more programs are timed beside them, to show what any CLI on these libraries pays beyond the floor
(the floor imports ``pydantic`` lazily: no ``pydantic_core``, no model): ``+ one pydantic model`` defines
and validates one model with one constrained field (pydantic.main, its fields and types, the plugin
loader's ``importlib.metadata``), ``+ a rich table`` also prints a rich panel and table.

``phases`` breaks one run down, in-process (``time.process_time``, CPU ms, median of the runs): each
import in the order the CLI makes it, then the command's steps (typer's command, the preset, the
estimate, the report, printing it).

``--instructions`` also counts the instructions each program executes (valgrind's callgrind, ``Ir``): on
a shared, loaded machine wall and CPU medians move by ±10 % from run to run, instruction counts by less
than 0.1 %, so a change of a few per cent is seen in one run (a count is not a time: a cache miss costs
more than an add, but at start-up both follow the same work).

    python benchmarks/bench_estimate.py [--runs 21] [--warmup 3] [--instructions] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GOAL_RATIO = 1.5
ESTIMATE_ARGS = ["estimate", "--model", "70b", "--seq", "8192"]
FLOOR = [sys.executable, "-c", "import typer, rich, pydantic"]
MODEL_FLOOR = (
    "import typer, rich, pydantic\n"
    "from pydantic import BaseModel, Field\n"
    "class A(BaseModel):\n"
    "    x: int = Field(default=1, gt=0)\n"
    "A()\n"
)
TABLE_FLOOR = (
    MODEL_FLOOR
    + "from rich.console import Console\nfrom rich.panel import Panel\nfrom rich.table import Table\n"
    "t = Table('a', 'b'); t.add_row('1', '2'); c = Console(); c.print(Panel('x')); c.print(t)\n"
)
REFERENCES = {
    "+ one pydantic model": [sys.executable, "-c", MODEL_FLOOR],
    "+ a rich panel and table printed": [sys.executable, "-c", TABLE_FLOOR],
}
# One run broken down in-process: CPU milliseconds per step, in the order `memplan estimate` takes them.
PHASES_PROBE = """
import io, json, sys, time
T = {}
t = time.process_time()
def lap(name):
    global t
    now = time.process_time(); T[name] = (now - t) * 1000; t = now
import typer, rich, pydantic; lap("floor: import typer, rich, pydantic")
from pydantic import BaseModel, Field; lap("pydantic.main, fields, types")
class _A(BaseModel):
    x: int = Field(default=1, gt=0)
_A(); lap("first pydantic validator (plugin loader: importlib.metadata)")
import memplan.config; lap("memplan.config (models, enums)")
import memplan.engine; lap("memplan.engine (analytic, blocks, strategies)")
import memplan.api; lap("memplan.api (presets, search.budget, time, contract)")
import memplan.cli.app as cli; lap("memplan.cli (app, common, commands)")
import typer.main
from memplan.cli.common import only_invoked
args = ["estimate", "--model", "70b", "--seq", "8192"]
command = typer.main.get_command(only_invoked(cli.app, args)); lap("typer: the estimate command built")
ctx = command.make_context("memplan", list(args)); lap("typer: arguments parsed")
from memplan.presets import load_model_preset; load_model_preset("70b"); lap("preset 70b loaded")
from memplan.api import Options, build
built = build(Options(model="70b", seq=8192)); lap("estimate computed (Options, Setup, engine)")
from rich.console import Console; lap("rich.console imported")
from memplan.render.plan import step_report; lap("memplan.render imported (rich table, panel)")
report = step_report(built); lap("report laid out")
Console(file=io.StringIO(), width=100).print(report); lap("report printed (rich renders)")
print(json.dumps(T))
"""
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


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the child: user + system) of one run; fails if it fails."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    _pid, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise subprocess.CalledProcessError(os.waitstatus_to_exitcode(status), cmd)
    return wall, usage.ru_utime + usage.ru_stime


def wall_times(cmds: list[list[str]], runs: int, warmup: int) -> tuple[list[list[float]], list[list[float]]]:
    """Wall and CPU seconds of each run of each command, interleaved (A B C A B C …) so that drifting
    machine load falls on all of them alike; ``warmup`` untimed rounds first. Fails if a command fails."""
    env = bench_env()
    walls: list[list[float]] = [[] for _ in cmds]
    cpus: list[list[float]] = [[] for _ in cmds]
    for i in range(warmup + runs):
        for cmd, wall, cpu in zip(cmds, walls, cpus, strict=True):
            w, c = timed(cmd, env)
            if i >= warmup:
                wall.append(w)
                cpu.append(c)
    return walls, cpus


def phases(runs: int) -> dict[str, float]:
    """CPU ms of each step of one ``memplan estimate`` (``PHASES_PROBE``), median over ``runs`` processes."""
    samples: dict[str, list[float]] = {}
    for _ in range(runs):
        out = subprocess.run(
            [sys.executable, "-c", PHASES_PROBE], check=True, capture_output=True, text=True, env=bench_env()
        )
        for name, ms in json.loads(out.stdout.strip().splitlines()[-1]).items():
            samples.setdefault(name, []).append(ms)
    return {name: statistics.median(v) for name, v in samples.items()}


def instructions(cmd: list[str]) -> int | None:
    """Instructions one run of ``cmd`` executes (callgrind's ``Ir`` total), None without valgrind. The
    interpreter must be the real binary (a pyenv shim would be measured instead of Python)."""
    if shutil.which("valgrind") is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/cg.out", *cmd],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=bench_env(),
            check=True,
        ).stderr
    total = re.search(r"Collected : (\d+)", out)
    return int(total.group(1)) if total else None


def instruction_counts() -> dict[str, int | None]:
    """Instructions of ``estimate``, ``estimate --json`` and the floor, each run once under callgrind."""
    python = str(Path(os.path.realpath(sys.executable)))
    estimate = [python, "-m", "memplan", *ESTIMATE_ARGS]
    return {
        "estimate": instructions(estimate),
        "estimate_json": instructions([*estimate, "--json"]),
        "floor": instructions([python, *FLOOR[1:]]),
    }


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


def bench(runs: int = 21, warmup: int = 3, count: bool = False) -> dict[str, Any]:
    estimate_cmd = memplan_command() + ESTIMATE_ARGS
    cmds = [estimate_cmd, [*estimate_cmd, "--json"], FLOOR, *REFERENCES.values()]
    walls, cpus = wall_times(cmds, runs, warmup)
    est, est_json, floor = walls[:3]
    median = statistics.median
    names = ["estimate", "estimate_json", "floor", *REFERENCES]
    cpu = {name: median(c) for name, c in zip(names, cpus, strict=True)}
    wall = {name: median(w) for name, w in zip(names, walls, strict=True)}
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
        "wall_s": wall,
        "cpu_s": cpu,
        "cpu_ratio": {name: c / cpu["floor"] for name, c in cpu.items()},
        "phases_cpu_ms": phases(max(5, runs // 2)),
        "instructions": instruction_counts() if count else {},
    }


def render(r: dict[str, Any]) -> str:
    verdict = "meets" if r["ratio"] <= r["goal_ratio"] else "MISSES"
    torch = "yes" if r["torch_imported"] else "no"
    cli_ms = r["import_ms"]["memplan.cli"][0][1]
    ins = r.get("instructions") or {}
    counted = (
        [
            "  instructions (callgrind Ir, one run each), ratio to the floor's:",
            *(f"    {name:34s} {n:>14,}  {n / ins['floor']:.2f}" for name, n in ins.items()),
        ]
        if ins.get("floor")
        else []
    )
    return "\n".join(
        [
            f"{r['command']}  (median of {r['runs']} runs, via {r['runner']})",
            f"  estimate (rich table)  {r['estimate_s'] * 1000:8.1f} ms   ratio {r['ratio']:.2f}",
            f"  estimate --json        {r['estimate_json_s'] * 1000:8.1f} ms   ratio {r['ratio_json']:.2f}",
            f"  floor: {r['floor']}  {r['floor_s'] * 1000:8.1f} ms",
            f"  goal ≤ {r['goal_ratio']}×: {verdict}; torch imported: {torch}",
            "  wall / CPU (user + system) medians, ratio of CPU to the floor's:",
            *(
                f"    {name:34s} {r['wall_s'][name] * 1000:7.1f} ms  {r['cpu_s'][name] * 1000:7.1f} ms  "
                f"{r['cpu_ratio'][name]:.2f}"
                for name in r["cpu_s"]
            ),
            "  one run, in-process CPU ms per step (median):",
            *(f"    {ms:6.1f}  {name}" for name, ms in r["phases_cpu_ms"].items()),
            f"  import memplan.cli.app: {cli_ms:.1f} ms (python -X importtime, one run)",
            "    its direct imports (cumulative): "
            + ", ".join(f"{n} {ms:.1f}" for n, ms in r["import_ms"]["direct_imports"]),
            "    largest self times: "
            + ", ".join(f"{n} {ms:.1f}" for n, ms in r["import_ms"]["largest_self"]),
            *counted,
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument(
        "--instructions", action="store_true", help="also count instructions with valgrind (≈ 1 min)"
    )
    args = parser.parse_args()
    result = bench(args.runs, args.warmup, args.instructions)
    print(json.dumps(result, indent=2) if args.json else render(result))


if __name__ == "__main__":
    main()
