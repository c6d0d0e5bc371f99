"""``trace --impl torchtitan`` over ranks: the rank's peak of forward and backward, measured beside the
estimate's moments, and what the measured peak held (``measure.distributed.titan_peak``'s ``peak``)."""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.text import Text

from memplan.render.estimate import BYTE_UNITS, fmt_bytes
from memplan.render.fitted import Col, Fitted


def _signed(d: int | None) -> Text:
    if d is None:
        return Text("")
    if d == 0:
        return Text("0", style="green")
    return Text(f"{'+' if d > 0 else '−'}{fmt_bytes(abs(d))}", style="bold red")


def rank_peak_report(peak: dict[str, Any]) -> RenderableType:
    """Each moment estimated (without the optimizer's states) and measured (the curve's highest point in
    its stretch); the peaks; the measured peak's parts and its largest temporaries by op."""
    cols = (Col("moment", "left"), Col("estimated"), Col("measured"), Col("Δ", priority=1))
    title = f"Rank peak of forward and backward, without the optimizer's states ({BYTE_UNITS})"
    t = Fitted(cols, title=title)
    for m in peak["moments"]:
        measured = "—" if m["measured"] is None else fmt_bytes(m["measured"])
        t.add(m["moment"], fmt_bytes(m["estimated"]), measured, _signed(m["delta"]))
    t.add(
        f"peak (estimated: {peak['estimated_phase']})",
        fmt_bytes(peak["estimated"]),
        fmt_bytes(peak["measured"]),
        _signed(peak["delta"]),
    )
    parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in peak["measured_parts"].items())
    ops = ", ".join(f"{op} {fmt_bytes(v)}" for op, v in list(peak["measured_transient"].items())[:6])
    judged = (
        "the peaks are equal"
        if peak["equal"]
        else "the peak is shown, not judged: measure/distributed/titan_peak.py's NBs name the moments not "
        "modelled exactly"
    )
    return Group(
        t,
        Text(f"measured peak in the {peak['measured_phase']}, at {peak['measured_op']}: {parts}"),
        Text(f"its temporaries by op: {ops or 'none'}"),
        Text(judged),
    )


def step_peak_report(peak: dict[str, Any]) -> RenderableType:
    """``trace --impl hf``: each moment of transformers' step estimated (without the optimizer's states)
    and measured (the curve's highest point in its stretch, less the model's buffers)."""
    cols = (Col("moment", "left"), Col("estimated"), Col("measured"), Col("Δ", priority=1))
    title = f"Peak of transformers' step, forward and backward, without the optimizer's states ({BYTE_UNITS})"
    t = Fitted(cols, title=title)
    for m in peak["moments"]:
        measured = "—" if m["measured"] is None else fmt_bytes(m["measured"])
        t.add(m["moment"], fmt_bytes(m["estimated"]), measured, _signed(m["delta"]))
    t.add(
        f"peak (estimated: {peak['estimated_phase']})",
        fmt_bytes(peak["estimated"]),
        fmt_bytes(peak["measured"]),
        _signed(peak["delta"]),
    )
    judged = (
        "the peaks are equal"
        if peak["equal"]
        else "the peak is shown, not judged: measure/frameworks/hf_peak.py's NBs name what is not modelled"
    )
    return Group(
        t,
        Text(
            f"the model's buffers ({fmt_bytes(peak['buffers'])}: the rotary tables' frequencies), which the "
            "estimate does not count, are taken off the measured curve; " + judged
        ),
    )
