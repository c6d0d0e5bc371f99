"""Measured vs estimated peak memory of real training steps on a GPU (issue: GPU evidence).

The one prepared script to run when a task is lent a GPU machine: it profiles a 1–8B preset at a few
sequence lengths and strategies with ``memplan.measure.runs.profile`` (the CUDA caching allocator's
``max_memory_allocated`` over a whole step, optimizer included) beside ``memplan estimate --device cuda``,
and the allocator's reserved peak (``torch.cuda.memory_stats()["reserved_bytes.all.peak"]``, what the
profile reports as ``phase_peaks.reserved``) beside the estimate's replay of the step through the caching
allocator model (``memory.reserved_peak`` of ``estimate --gpu``, issue #22), and writes the table into
docs/gpu-profile.md (between its markers). Each case runs in a process of its own, so that one
out-of-memory or kernel failure does not stop the others and the allocator starts clean.

    python benchmarks/gpu_profile.py --gpu h200      # on the GPU machine (≈ 5–8 minutes on one H200)
    python benchmarks/gpu_profile.py --device cpu --model tiny --seqs 64,128 --no-write   # a dry run here
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: the repository root on the path, for benchmarks.*
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.sections import replace_section

DOC = Path(__file__).resolve().parent.parent / "docs" / "gpu-profile.md"
START, END = "<!-- gpu_profile:start -->", "<!-- gpu_profile:end -->"
"""The table's section of docs/gpu-profile.md (the rest of the page is written by hand)."""
# Llama-2-7B is multi-head (no GQA): the CUDA flash kernel takes it as it is. bf16-mixed AdamW needs
# 16 bytes/param (108 GB for 6.7B) before activations: it fits one 139 GiB H200 up to a few thousand tokens.
CASES = (
    ("none", "flash"),
    ("full", "flash"),
    ("selective", "eager"),
)
# The CUDA-only saves on a GPU (checked on CPU by `trace --device cuda`, the meta device's kernels): GPT-2 has
# LayerNorm (fp32 statistics on CUDA) and dropout 0.1 (the flash kernel's [2] + [] uint64 RNG state; bool
# masks), so one short run confirms every CUDA rule per tensor ("saved tensors equal", else the names).
# Llama 3.2 1B: grouped-query attention (8 K/V heads for 32) through the CUDA flash kernel, fully
# checkpointed (torch before 2.13 refused its FLOP count: memplan.measure.instruments.record.formula_flops).
RULE_CASES = (("gpt2", 1024, "none", "flash"), ("llama-3.2-1b", 2048, "full", "flash"))


def estimated_allocator(model: str, seq: int, ckpt: str, attention: str, gpu: str | None) -> dict[str, Any]:
    """``estimate --json``'s replay of the step through the caching allocator model (with ``gpu``: its
    cuBLAS workspace), or the error's last line."""
    cmd = [
        sys.executable, "-m", "memplan", "estimate", "--model", model, "--seq", str(seq),
        "--checkpointing", ckpt, "--attention", attention, "--device", "cuda", "--json",
        *(["--gpu", gpu] if gpu else []),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
    data = json.loads(proc.stdout)
    memory, timing = data["memory"], data["time"]
    out = {"allocated_peak": memory["allocated_peak"], "reserved_peak": memory["reserved_peak"]}
    if timing and timing.get("step_time_s") is not None:  # with --gpu: the step-time model's prediction
        out["step_seconds"] = timing["step_time_s"]
        out["parts"] = (timing.get("predicted") or {}).get("parts", {})
    return out


def run_case(
    model: str, seq: int, ckpt: str, attention: str, device: str, gpu: str | None = None
) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "memplan", "profile", "--model", model, "--seq", str(seq),
        "--checkpointing", ckpt, "--attention", attention, "--device", device,
        "--steps", "2", "--warmup", "1", "--json",
    ]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    row: dict[str, Any] = {"model": model, "seq": seq, "checkpointing": ckpt, "attention": attention}
    row["seconds"] = round(time.perf_counter() - start, 1)
    if proc.returncode not in (0, 1) or not proc.stdout.strip():
        row["error"] = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return row
    data = json.loads(proc.stdout)
    est, meas = data["estimated"]["memory"], data["measured"]["memory"]
    diff = data["diff"]["tensors"]
    row["differing"] = [
        t["name"] for t in diff if t["delta_bytes"] or t["estimated_count"] != t["measured_count"]
    ]
    row.update(
        estimated_peak=est["peak"],
        estimated_phase=est["peak_phase"],
        measured_peak=meas["peak"],
        error=meas["peak"] / est["peak"] - 1,
        saved_equal=data["diff"]["equal"],
        step_seconds=data["time"]["median_step_seconds"],
        phase_seconds=data["time"].get("phase_seconds", {}),
        tflops=data["time"]["achieved_tflops"],
    )
    row["measured_reserved"] = meas.get("phase_peaks", {}).get("reserved")  # CUDA: reserved_bytes.all.peak
    row["device_name"] = data["time"].get("device_name") or _device_name(device)
    return with_estimates(row, gpu)


def with_estimates(row: dict[str, Any], gpu: str | None) -> dict[str, Any]:
    """``row`` (a measured run) with the estimate's allocator replay and step time beside it, computed
    here: a recorded row (``--from-rows``) is set beside the current model."""
    model, seq, ckpt, attention = row["model"], row["seq"], row["checkpointing"], row["attention"]
    reserved = row.get("measured_reserved")
    alloc = estimated_allocator(model, seq, ckpt, attention, gpu)
    if "step_seconds" in alloc:
        row.update(estimated_step_seconds=alloc["step_seconds"], estimated_parts=alloc["parts"])
    if "allocated_peak" in alloc:  # the replay's: the tensors' peak + the cuBLAS workspaces + rounding
        row.update(
            estimated_allocated=alloc["allocated_peak"],
            allocated_error=row["measured_peak"] / alloc["allocated_peak"] - 1,
        )
    if reserved and "reserved_peak" in alloc:
        row.update(
            estimated_reserved=alloc["reserved_peak"],
            measured_reserved=reserved,
            reserved_error=reserved / alloc["reserved_peak"] - 1,
        )
    return row


def render(rows: list[dict[str, Any]], device: str, name: str | None = None) -> str:
    gib = 1 << 30
    lines = [
        f"`python benchmarks/gpu_profile.py` on {device} ({name or _device_name(device)}). Measured peak: "
        "the CUDA caching allocator's `max_memory_allocated` over a whole step (forward, backward, "
        "optimizer) after one warm-up step; estimated: `memplan estimate --device cuda` (GiB = 2³⁰ bytes). "
        'Reserved: the allocator\'s `memory_stats()["reserved_bytes.all.peak"]` over the step, and the '
        "estimate's replay of two steps through memplan's model of the caching allocator (`--gpu`).",
        "",
        "| model | seq | checkpointing | attention | estimated peak (moment) | measured peak | measured / "
        "estimated − 1 | estimated allocated (`--gpu`) | measured / estimated − 1 | saved tensors equal | "
        "step s | TFLOP/s | estimated reserved | measured reserved | measured / estimated − 1 | "
        "estimated step s (`--gpu`) |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        head = f"| {r['model']} | {r['seq']} | {r['checkpointing']} | {r['attention']} |"
        if "estimated_peak" not in r:
            lines.append(f"{head} – | – | – | – | – | – | – | {r.get('error', '')} |")
            continue
        lines.append(
            f"{head} {int(r['estimated_peak']) / gib:.2f} GiB ({r['estimated_phase']}) | "
            f"{int(r['measured_peak']) / gib:.2f} GiB | {float(r['error']):+.2%} | {_allocated(r)} "
            f"{r['saved_equal'] or ', '.join(r['differing'])} | "
            f"{float(r['step_seconds']):.3f} | {float(r['tflops']):.1f} | {_reserved(r)} {_step(r)}"
        )
    return "\n".join([*lines, ""])


def _device_name(device: str) -> str:
    """The GPU's name and torch's version, read where the script ran."""
    try:
        import torch

        name = torch.cuda.get_device_name(0) if device.startswith("cuda") else platform.processor() or "CPU"
        return f"{name}, torch {torch.__version__}, Python {platform.python_version()}"
    except (ImportError, RuntimeError, AssertionError):
        return "device unknown"


def _allocated(r: dict[str, Any]) -> str:
    """The replay's allocated peak beside ``max_memory_allocated``, to the byte when they differ little."""
    if "estimated_allocated" not in r:
        return "– | – |"
    delta = int(r["measured_peak"]) - int(r["estimated_allocated"])
    est = int(r["estimated_allocated"]) / (1 << 30)
    return f"{est:.2f} GiB | {float(r['allocated_error']):+.3%} ({delta:+,} B) |"


def _step(r: dict[str, Any]) -> str:
    """The step-time model's prediction for the run (``estimate --gpu``), or a dash."""
    if "estimated_step_seconds" not in r:
        return "– |"
    return f"{float(r['estimated_step_seconds']):.3f} |"


def _reserved(r: dict[str, Any]) -> str:
    """The reserved columns: the estimate's replay, the allocator's ``reserved_bytes.all.peak``."""
    if "estimated_reserved" not in r:
        return "– | – | – |"
    gib = 1 << 30
    return (
        f"{int(r['estimated_reserved']) / gib:.2f} GiB | {int(r['measured_reserved']) / gib:.2f} GiB | "
        f"{float(r['reserved_error']):+.2%} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-2-7b")
    parser.add_argument("--seqs", default="512,2048", help="comma-separated sequence lengths")
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--gpu", default=None, help="the GPU preset of the machine (cuBLAS workspace), e.g. h200"
    )
    parser.add_argument("--no-write", action="store_true", help=f"print instead of writing {DOC}")
    parser.add_argument("--rows", default=None, help="also append each row as a JSON line to this file")
    parser.add_argument(
        "--from-rows",
        default=None,
        help="render the runs recorded in this file (--rows) with today's estimates",
    )
    args = parser.parse_args()
    if args.from_rows:  # no GPU needed: the measured side is the file's
        with open(args.from_rows, encoding="utf-8") as f:
            recorded = [json.loads(line) for line in f if line.strip()]
        rows = [with_estimates(r, args.gpu) if "measured_peak" in r else r for r in recorded]
        names = {r.get("device_name") for r in rows if r.get("device_name")}
        text = render(rows, args.device, names.pop() if len(names) == 1 else None)
        print(text)
        if not args.no_write:
            replace_section(DOC, START, END, text)
        return
    rows = []
    cases = [(args.model, int(s), *case) for s in args.seqs.split(",") for case in CASES]
    rules = list(RULE_CASES) if args.device.startswith("cuda") else []  # CPU flash has no dropout
    for model, seq, ckpt, attention in [*cases, *rules]:
        row = run_case(model, seq, ckpt, attention, args.device, args.gpu)
        print(json.dumps(row), flush=True)
        rows.append(row)
        if args.rows:
            with open(args.rows, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
    text = render(rows, args.device)
    print(text)
    if not args.no_write:
        replace_section(DOC, START, END, text)


if __name__ == "__main__":
    main()
