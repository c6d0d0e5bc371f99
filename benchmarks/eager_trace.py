"""Group one traced training step's GPU kernels by phase, class and aten op (docs/step-time.md, "Eager
PyTorch on a measured H200").

Reads a Chrome trace of ``torch.profiler`` with ``record_shapes=True`` (``memplan profile --torch-trace``):
each kernel's launch (``cuda_runtime`` / ``cuda_driver`` event, by correlation id) names its thread and
time, its ``External id`` the aten op that launched it. Phases: launches from autograd's thread are the
backward; those from the main thread before the backward began the forward, after it the optimizer.
Classes: ``aten::mm``/``addmm``/``bmm`` GEMMs, kernels named ``flash`` the attention, the rest
element-wise. An element-wise op's bytes come from its input shapes and dtypes: ``copy_`` reads its
source and writes its destination, ``fill_``/``zero_`` write theirs, an in-place op reads its inputs and
writes its first, a reduction reads its inputs (its output is small), any other op reads its inputs and
writes one tensor of the largest input's elements in the widest dtype among them. NB: a broadcast or
expanded input is counted at its shape (an over-count where the kernel reads it from cache), a tensor
passed twice twice, and a list input (``cat``) not at all.

    python benchmarks/eager_trace.py trace.json.gz
"""

from __future__ import annotations

import gzip
import json
import math
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

SIZE = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4, "bool": 1, "double": 8}
REDUCTIONS = frozenset({"aten::sum", "aten::mean", "aten::max", "aten::amax", "aten::norm"})
GEMMS = frozenset({"aten::mm", "aten::addmm", "aten::bmm"})
Row = tuple[str, str, str]


def tensors(args: dict[str, Any]) -> list[tuple[int, int]]:
    """(elements, bytes per element) of each tensor input of a ``cpu_op``."""
    out = []
    for dims, dtype in zip(args.get("Input Dims", []), args.get("Input type", []), strict=False):
        if dtype in SIZE and isinstance(dims, list) and not (dims and isinstance(dims[0], list)):
            out.append((math.prod(dims) if dims else 1, SIZE[dtype]))
    return out


def op_bytes(name: str, args: dict[str, Any]) -> int:
    """Bytes an element-wise aten op moves by its input shapes (module docstring)."""
    ts = tensors(args)
    if not ts:
        return 0
    first = ts[0][0] * ts[0][1]
    if name in ("aten::fill_", "aten::zero_"):
        return first
    if name == "aten::copy_":
        return first + (ts[1][0] * ts[1][1] if len(ts) > 1 else 0)
    read = sum(n * s for n, s in ts)
    if name.endswith("_"):
        return read + first
    if name in REDUCTIONS:
        return read
    n = max(n for n, _ in ts)
    return read + n * max(s for m, s in ts if m == n)


def group(events: list[dict[str, Any]]) -> dict[Row, list[float]]:
    """(phase, class, aten op) → [kernels, bytes, microseconds]."""
    ops = {e["args"]["External id"]: e for e in events if e.get("cat") == "cpu_op"}
    autograd = [e for e in events if e.get("cat") == "cpu_op" and e["tid"] != e["pid"]]
    backward_start = min((e["ts"] for e in autograd), default=math.inf)
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    out: dict[Row, list[float]] = defaultdict(lambda: [0, 0, 0.0])
    for k in (e for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")):
        launch = launches.get(k["args"].get("correlation"))
        op = ops.get(k["args"].get("External id"))
        if launch is not None and launch["tid"] != launch["pid"]:
            phase = "backward"
        else:
            phase = "forward" if (launch or k)["ts"] < backward_start else "optimizer"
        name = op["name"] if op else k["cat"]
        kind = "gemm" if name in GEMMS else "flash" if "flash" in k["name"] else "elementwise"
        row = out[(phase, kind, name)]
        row[0] += 1
        row[1] += op_bytes(name, op["args"]) if op and kind == "elementwise" else 0
        row[2] += k["dur"]
    return out


def table(groups: dict[Row, list[float]]) -> str:
    """One line per (phase, class, op), then the totals per phase and class; GB = 1e9 bytes."""
    lines, totals = [], defaultdict(lambda: [0.0, 0.0, 0.0])
    for (phase, kind, name), (n, b, us) in sorted(groups.items(), key=lambda kv: (kv[0][:2], -kv[1][2])):
        t = totals[(phase, kind)]
        t[0], t[1], t[2] = t[0] + n, t[1] + b, t[2] + us
        lines.append(f"{phase:9} {kind:11} {name:36} {int(n):6d} {b / 1e9:9.3f} GB {us / 1e3:8.2f} ms")
    for (phase, kind), (n, b, us) in sorted(totals.items()):
        lines.append(f"{phase:9} {kind:11} {'total':36} {int(n):6d} {b / 1e9:9.3f} GB {us / 1e3:8.2f} ms")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.stderr.write("usage: python benchmarks/eager_trace.py TRACE(.json|.json.gz)\n")
        return 2
    path = Path(args[0])
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        events = json.load(f)["traceEvents"]
    sys.stdout.write(table(group(events)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
