"""Run every memplan benchmark once and print the figures, with the machine they ran on, as the
Markdown of docs/benchmarks.md; ``--write`` replaces that tracked file with them.

    python benchmarks/run_all.py            # all benchmarks, print the report only
    python benchmarks/run_all.py --write    # all benchmarks, then rewrite docs/benchmarks.md
    python benchmarks/run_all.py --quick    # fewer runs (a smoke test of the scripts themselves)

1. bench_estimate: wall time of ``memplan estimate --model 70b --seq 8192`` against
   ``python -c "import typer, rich, pydantic"`` (median of N fresh processes; goal ≤ 1.5×).
2. bench_throughput: estimates per second, in-process, over a grid of setups.
3. The full-size fake-tensor trace: ``memplan trace --model 70b --seq 8192 --json`` (the Llama-3-70B
   reference model under FakeTensorMode on CPU), its wall time and the peak RSS of its process
   (``os.wait4``), and whether estimate and measurement agree. Needs torch.
4. Every other ``benchmarks/bench_*.py`` (e.g. bench_fit.py), run as ``python FILE --json``: its JSON
   is written down as it comes (a table when it has a ``cases`` list).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DOCS = ROOT / "docs" / "benchmarks.md"
sys.path.insert(0, str(HERE))

import bench_estimate  # noqa: E402
import bench_throughput  # noqa: E402

TRACE_ARGS = ["trace", "--model", "70b", "--seq", "8192", "--json"]
# Used only where this memplan has no `trace` command: the same measurement, called directly.
TRACE_FALLBACK = (
    "import json, time; from memplan.config import Setup, TrainingConfig; "
    "from memplan.presets import load_model_preset; from memplan.measure.runs.run import measure; "
    "from memplan.engine import estimate; "
    "setup = Setup(model=load_model_preset('70b').model, training=TrainingConfig(seq_len=8192), "
    "device='cpu'); "
    "t = time.perf_counter(); m = measure(setup, fake=True); s = time.perf_counter() - t; "
    "e = estimate(setup); "
    "print(json.dumps({'seconds': s, 'diff': {'equal': m.activations == e.activations and "
    "all(m.flops[p] == getattr(e.flops, p) for p in ('forward', 'backward', 'recompute'))}, "
    "'measured': {'memory': {'activations': m.activations}}}))"
)


# ----------------------------------------------------------------------------------------------------
# The machine
# ----------------------------------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _git_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True
    )
    return (
        out.stdout.strip() + ("+local changes" if dirty.stdout.strip() else "")
        if out.returncode == 0
        else "?"
    )


def machine() -> dict[str, Any]:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "date_utc": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M"),
        "nproc": usable,
        "cpu_model": _cpu_model(),
        "ram_bytes": _ram_bytes(),
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "versions": {p: _version(p) for p in ("torch", "pydantic", "typer", "rich")},
        "commit": _git_commit(),
    }


# ----------------------------------------------------------------------------------------------------
# The 70B fake-tensor trace
# ----------------------------------------------------------------------------------------------------
def _has_trace_command() -> bool:
    probe = (
        "import typer; from memplan.cli.app import app; "
        "print('trace' in typer.main.get_command(app).commands)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    return out.stdout.strip() == "True"


def trace_70b() -> dict[str, Any]:
    """Wall time and peak RSS of the full-size trace in a process of its own."""
    if _version("torch") == "not installed":
        return {"skipped": "torch is not installed (pip install -e '.[profile]')"}
    via_cli = _has_trace_command()
    cmd = (
        [*bench_estimate.memplan_command(), *TRACE_ARGS]
        if via_cli
        else [sys.executable, "-c", TRACE_FALLBACK]
    )
    with tempfile.TemporaryFile() as out:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.DEVNULL, env=bench_estimate.bench_env())
        _pid, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        out.seek(0)
        text = out.read().decode()
    code = os.waitstatus_to_exitcode(status)
    result: dict[str, Any] = {
        "command": "memplan " + " ".join(TRACE_ARGS)
        if via_cli
        else "memplan.measure.runs.run.measure(setup, fake=True)",
        "exit_code": code,
        "wall_s": wall,
        # ru_maxrss: kilobytes on Linux, bytes on macOS.
        "peak_rss_bytes": usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024),
    }
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        result["error"] = text[-500:]
        return result
    result["trace_s"] = doc.get("seconds")
    result["equal"] = doc.get("diff", {}).get("equal")
    result["activations_bytes"] = doc.get("measured", {}).get("memory", {}).get("activations")
    return result


# ----------------------------------------------------------------------------------------------------
# Other benchmark scripts
# ----------------------------------------------------------------------------------------------------
OWN = {"bench_estimate.py", "bench_throughput.py"}


def extra_benchmarks() -> dict[str, Any]:
    """``python FILE --json`` for every other benchmarks/bench_*.py: its JSON, or the error it gave."""
    results: dict[str, Any] = {}
    for path in sorted(HERE.glob("bench_*.py")):
        if path.name in OWN:
            continue
        run = subprocess.run(
            [sys.executable, str(path), "--json"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env=bench_estimate.bench_env(),
        )
        try:
            results[path.name] = json.loads(run.stdout)
        except json.JSONDecodeError:
            results[path.name] = {"error": f"exit {run.returncode}: {(run.stderr or run.stdout)[-300:]}"}
    return results


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"
    return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)


def _rows(rows: Any) -> bool:
    """Whether ``rows`` is a non-empty list of dicts: a table."""
    return isinstance(rows, list) and bool(rows) and all(isinstance(c, dict) for c in rows)


def _table(rows: list[dict[str, Any]]) -> list[str]:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    return lines + ["| " + " | ".join(_cell(c.get(k)) for k in keys) + " |" for c in rows]


def _extra_markdown(name: str, doc: Any) -> list[str]:
    """A ``--json`` document as Markdown: its ``cases`` as a table, every other list of dicts as a table
    under its key, the scalars on one line."""
    lines = [f"## `benchmarks/{name}`", ""]
    cases = doc.get("cases") if isinstance(doc, dict) else None
    if _rows(cases):
        lines += _table(cases)
        tables = {k: v for k, v in doc.items() if k != "cases" and _rows(v)}
        for key, rows in tables.items():
            lines += ["", f"{key}:", "", *_table(rows)]
        rest = {k: v for k, v in doc.items() if k != "cases" and k not in tables}
        if rest:
            lines += ["", ", ".join(f"{k}: {v}" for k, v in rest.items())]
    else:
        lines += ["```json", json.dumps(doc, indent=2)[:4000], "```"]
    return [*lines, ""]


# ----------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------
def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.1f} GiB"


def _startup_row(est: dict[str, Any], key: str, label: str) -> str:
    wall, cpu = est["wall_s"], est["cpu_s"]
    return (
        f"| {label} | {wall[key] * 1000:.0f} ms | {wall[key] / wall['floor']:.2f}× "
        f"| {cpu[key] * 1000:.0f} ms | {est['cpu_ratio'][key]:.2f}× |"
    )


def startup_markdown(est: dict[str, Any]) -> list[str]:
    """The start-up section of docs/benchmarks.md, from ``bench_estimate.bench()``'s figures."""
    verdict = "meets" if est["ratio"] <= est["goal_ratio"] else "**misses**"
    imports = est["import_ms"]
    return [
        "## Start-up: `memplan estimate --model 70b --seq 8192`",
        "",
        f"Median of {est['runs']} fresh processes each, interleaved (console script {est['runner']}); "
        "wall clock, and the process's CPU time (user + system, `os.wait4`), steadier on a shared machine.",
        "",
        "| command | wall | ratio | CPU | CPU ratio |",
        "|---|---:|---:|---:|---:|",
        *(
            _startup_row(est, key, label)
            for key, label in [
                ("estimate", "`memplan estimate --model 70b --seq 8192` (rich table)"),
                ("estimate_json", "`memplan estimate --model 70b --seq 8192 --json`"),
                ("floor", f"floor: `{est['floor']}`"),
                *((k, f"floor {k}") for k in est["cpu_s"] if k.startswith("+")),
            ]
        ),
        "",
        f"Goal ≤ {est['goal_ratio']}× (wall): {verdict}. torch imported by `memplan estimate`: "
        f"{'**yes**' if est['torch_imported'] else 'no'}. The two `floor +` rows are what any program on",
        "these libraries pays beyond the floor: defining and validating one pydantic model with one",
        "constrained field, then also printing a rich panel and table (benchmarks/bench_estimate.py).",
        "",
        "One run step by step (in-process CPU ms, `time.process_time`, median):",
        "",
        "| step | CPU ms |",
        "|---|---:|",
        *(f"| {name} | {ms:.1f} |" for name, ms in est["phases_cpu_ms"].items()),
        "",
        f"Where the import time goes (`python -X importtime`, one run): `import memplan.cli.app` "
        f"{imports['memplan.cli'][0][1]:.0f} ms; its direct imports (cumulative) "
        + ", ".join(f"`{n}` {ms:.0f} ms" for n, ms in imports["direct_imports"][:6])
        + "; largest self times "
        + ", ".join(f"`{n}` {ms:.1f} ms" for n, ms in imports["largest_self"][:6])
        + ". NB: the floor imports `pydantic` lazily (no `pydantic_core`, no model is built), so any",
        "program that defines a pydantic model pays more than the floor.",
        "",
    ]


def markdown(
    m: dict[str, Any], est: dict[str, Any], thr: dict[str, Any], trace: dict[str, Any], extra: dict[str, Any]
) -> str:
    lines = [
        "# Benchmarks",
        "",
        "Written by `python benchmarks/run_all.py --write` (see benchmarks/README.md); the latest run",
        "replaces this file. Times are wall clock; GiB = 2³⁰ bytes.",
        "",
        "## Machine",
        "",
        f"- date (UTC): {m['date_utc']}; commit {m['commit']}",
        f"- CPU: {m['cpu_model']}, {m['nproc']} usable cores (nproc); RAM {_gib(m['ram_bytes'])}",
        f"- {m['os']}; Python {m['python']}; " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()),
        f"- 1-minute load average when the run started: {m['load_average_1m']:.2f}"
        if m["load_average_1m"] is not None
        else "- load average: unknown",
        "",
        *startup_markdown(est),
        "## Throughput: estimates per second (in-process)",
        "",
        f"Grid of {thr['grid']['setups']} setups: {thr['grid']['models']} model presets × seq "
        f"{thr['grid']['seq']} × batch {thr['grid']['batch']} × checkpointing "
        f"{', '.join(thr['grid']['checkpointing'])} × attention eager/flash × ZeRO/dp "
        f"{', '.join(thr['grid']['zero_dp'])} × precision {', '.join(thr['grid']['precision'])}.",
        "",
        "| step | per second | each |",
        "|---|---:|---:|",
    ]
    for name, rate in thr["per_second"].items():
        lines.append(f"| `{name}` | {rate:,.0f} | {thr['microseconds_each'][name]:.0f} µs |")
    lines += ["", "## Full-size fake-tensor trace: Llama-3-70B, seq 8192", ""]
    if "skipped" in trace:
        lines.append(f"Skipped: {trace['skipped']}.")
    else:
        lines += [
            f"`{trace['command']}` in a process of its own (exit code {trace['exit_code']}):",
            "",
            f"- wall time {trace['wall_s']:.1f} s (of which the trace itself "
            + (f"{trace['trace_s']:.1f} s" if trace.get("trace_s") is not None else "?")
            + ", the rest is importing torch and building the estimate)",
            f"- peak RSS {_gib(trace['peak_rss_bytes'])} ({trace['peak_rss_bytes'] / 2**20:.0f} MiB)",
            f"- estimate equals measurement: {trace.get('equal')}; activations measured "
            f"{_gib(trace.get('activations_bytes'))}",
        ]
        if "error" in trace:
            lines.append(f"- output was not JSON: `{trace['error']}`")
    lines.append("")
    for name, doc in extra.items():
        lines += _extra_markdown(name, doc)
    return "\n".join(lines).rstrip("\n") + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--write", action="store_true", help="rewrite docs/benchmarks.md (default: print)")
    parser.add_argument(
        "--no-write", action="store_true", help="print only (the default; kept for old scripts)"
    )
    parser.add_argument("--quick", action="store_true", help="few runs: check the scripts, not the figures")
    args = parser.parse_args()
    m = machine()
    print(f"machine: {m['cpu_model']}, {m['nproc']} cores, {_gib(m['ram_bytes'])}", flush=True)
    runs, warmup, seconds = (3, 1, 0.5) if args.quick else (21, 3, 3.0)
    est = bench_estimate.bench(runs, warmup)
    print(bench_estimate.render(est), flush=True)
    thr = bench_throughput.bench(seconds)
    print(bench_throughput.render(thr), flush=True)
    trace = trace_70b()
    print("70B fake trace:", json.dumps(trace), flush=True)
    extra = extra_benchmarks()
    for name, doc in extra.items():
        print(f"{name}:", json.dumps(doc)[:1000], flush=True)
    text = markdown(m, est, thr, trace, extra)
    if not args.write or args.no_write:
        print(text)
    else:
        DOCS.parent.mkdir(parents=True, exist_ok=True)
        DOCS.write_text(text, encoding="utf-8")
        print(f"wrote {DOCS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
