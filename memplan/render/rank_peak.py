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


def moments_table(peak: dict[str, Any], what: str) -> Fitted:
    """Each moment estimated and measured, and the two peaks, with their differences."""
    cols = (Col("moment", "left"), Col("estimated"), Col("measured"), Col("Δ", priority=1))
    t = Fitted(cols, title=f"{what}, without the optimizer's states ({BYTE_UNITS})")
    for m in peak["moments"]:
        measured = "—" if m["measured"] is None else fmt_bytes(m["measured"])
        t.add(m["moment"], fmt_bytes(m["estimated"]), measured, _signed(m["delta"]))
    t.add(
        f"peak (estimated: {peak['estimated_phase']})",
        fmt_bytes(peak["estimated"]),
        fmt_bytes(peak["measured"]),
        _signed(peak["delta"]),
    )
    return t


def rank_peak_report(peak: dict[str, Any]) -> RenderableType:
    """Each moment estimated (without the optimizer's states) and measured (the curve's highest point in
    its stretch); the peaks; the measured peak's parts and its largest temporaries by op."""
    t = moments_table(peak, "Rank peak of forward and backward")
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
    t = moments_table(peak, "Peak of transformers' step, forward and backward")
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
