"""Rendering of estimate-vs-measurement comparisons (``memplan trace`` and ``memplan profile``)."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from memplan.report import BYTE_UNITS, FLOP_UNITS, fmt_bytes, fmt_flops, fmt_int


def _delta(d: int, fmt: str = "bytes") -> Text:
    if d == 0:
        return Text("0", style="green")
    sign = "+" if d > 0 else "−"
    body = fmt_bytes(abs(d)) if fmt == "bytes" else fmt_flops(abs(d))
    return Text(f"{sign}{body}", style="bold red")


def tensor_table(diff: dict[str, object]) -> Table:
    rows = diff["tensors"]
    assert isinstance(rows, list)
    t = Table(title=f"Saved tensors: estimated vs measured ({BYTE_UNITS})", title_justify="left")
    for col in ("tensor", "est. count", "meas. count", "est. bytes", "meas. bytes", "Δ"):
        t.add_column(col, justify="left" if col == "tensor" else "right")
    for r in rows:
        t.add_row(
            r["name"],
            fmt_int(r["estimated_count"]),
            fmt_int(r["measured_count"]),
            fmt_bytes(r["estimated_bytes"]),
            fmt_bytes(r["measured_bytes"]),
            _delta(r["delta_bytes"]),
        )
    est = sum(r["estimated_bytes"] for r in rows)
    meas = sum(r["measured_bytes"] for r in rows)
    t.add_section()
    t.add_row("total", "", "", fmt_bytes(est), fmt_bytes(meas), _delta(meas - est), style="bold")
    return t


def flop_table(diff: dict[str, object]) -> Table:
    rows = diff["flops"]
    assert isinstance(rows, list)
    t = Table(title=f"FLOPs: estimated vs FlopCounterMode ({FLOP_UNITS})", title_justify="left")
    for col in ("phase", "estimated", "measured", "exact count", "Δ"):
        t.add_column(col, justify="left" if col == "phase" else "right")
    for r in rows:
        t.add_row(
            r["phase"],
            fmt_flops(r["estimated"]),
            fmt_flops(r["measured"]),
            fmt_int(r["measured"]),
            _delta(r["delta"], "flops"),
        )
    return t


def verdict(equal: bool, what: str) -> Text:
    if equal:
        return Text(f"✓ {what}: estimate = measurement, byte for byte and FLOP for FLOP", style="bold green")
    return Text(f"✗ {what}: estimate and measurement differ (a bug in one of them)", style="bold red")


def trace_report(result: dict[str, object], seconds: float, layers_line: str) -> RenderableType:
    diff = result["diff"]
    assert isinstance(diff, dict)
    return Group(
        tensor_table(diff),
        Text(layers_line),
        flop_table(diff),
        Text(f"traced in {seconds:.1f} s (fake tensors on CPU: no memory, no GPU)"),
        verdict(bool(diff["equal"]), "trace"),
    )


def profile_table(rows: list[tuple[str, str, str]]) -> Table:
    t = Table(title=f"Profile: measured vs estimated ({BYTE_UNITS})", title_justify="left")
    for col in ("quantity", "estimated", "measured"):
        t.add_column(col, justify="left" if col == "quantity" else "right")
    for r in rows:
        t.add_row(*r)
    return t
