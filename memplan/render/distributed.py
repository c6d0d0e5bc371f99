"""Rendering of ``memplan profile --nproc``: every rank beside the estimate, and the collectives counted."""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.text import Text

from memplan.render.estimate import BYTE_UNITS, fmt_bytes, fmt_int
from memplan.render.fitted import Col, Fitted

_MEMORY = ("weights", "gradients", "optimizer", "activations", "peak")


def _cell(est: int, meas: int) -> Text:
    if est == meas:
        return Text(fmt_bytes(meas), style="green")
    return Text(f"{fmt_bytes(meas)} ({meas / est - 1:+.1%})" if est else fmt_bytes(meas), style="yellow")


def rank_table(result: dict[str, Any]) -> Fitted:
    """One row per rank: its coordinates and each memory figure (green when equal to the estimate of what
    the rank holds: its pipeline stage's with pp)."""
    whole = result["estimated"]["memory"]
    stages = [s["memory"] for s in result["estimated"].get("stages", [])] or [whole]
    cols = (Col("rank", "left"), Col("dp·pp·tp", priority=2), *(Col(k) for k in _MEMORY))
    t = Fitted(cols, title=f"Per rank: measured vs estimated ({BYTE_UNITS})")
    for i, est in enumerate(stages):
        name = f"estimate, stage {i}" if len(stages) > 1 else "estimate"
        last = i == len(stages) - 1
        t.add(name, "", *(fmt_bytes(est[k]) for k in _MEMORY), style="bold", end_section=last)
    for r in result["ranks"]:
        meas, c = r["measured"]["memory"], r["coords"]
        est = stages[c.get("pp", 0)]
        coords = f"{c['dp']}·{c.get('pp', 0)}·{c['tp']}"
        t.add(str(r["rank"]), coords, *(_cell(est[k], meas[k]) for k in _MEMORY))
    return t


def difference_table(rank: dict[str, Any]) -> Fitted | None:
    """Rank 0's saved tensors that differ from the estimate (explained: a documented PyTorch difference)."""
    rows = rank["diff"]["tensors"]
    if not rows:
        return None
    cols = (
        Col("tensor", "left"),
        Col("est.\ncount", priority=2),
        Col("meas.\ncount", priority=2),
        Col("est. bytes"),
        Col("meas. bytes"),
        Col("why", "left", priority=1),
    )
    t = Fitted(cols, title=f"Rank {rank['rank']}: saved tensors that differ ({BYTE_UNITS})")
    for r in sorted(rows, key=lambda r: r["name"]):
        why = (
            Text("DTensor (docs/distributed.md)", style="yellow")
            if r["explained"]
            else Text("?", style="red")
        )
        t.add(
            r["name"],
            fmt_int(r["est_count"]),
            fmt_int(r["meas_count"]),
            fmt_bytes(r["est_bytes"]),
            fmt_bytes(r["meas_bytes"]),
            why,
        )
    return t


def collective_table(rank: dict[str, Any]) -> Fitted:
    """Rank 0's collectives: dimension, collective, phase, calls and the bytes it contributed."""
    cols = (
        Col("dimension", "left"),
        Col("collective", "left"),
        Col("phase", "left"),
        Col("count"),
        Col("bytes"),
    )
    t = Fitted(
        cols,
        title=f"Rank {rank['rank']}: collectives (CommDebugMode; pp: the stage's sends and receives; "
        "bytes this rank sends in, or receives)",
    )
    for c in rank["collectives"]:
        t.add(c["dimension"], c["collective"], c["phase"], fmt_int(c["count"]), fmt_bytes(c["bytes"]))
    return t


def distributed_report(result: dict[str, Any]) -> RenderableType:
    lay = result["layout"]
    head = (
        f"{result['model']} on {result['nproc']} processes ({result['launcher']}): tp {lay['tp']}"
        f"{' + sp' if lay['sp'] else ''} × pp {lay['pp']} × dp {lay['dp']}, ZeRO-{lay['zero']}"
    )
    rank0 = result["ranks"][0]
    parts: list[RenderableType] = [Text(head, style="bold"), rank_table(result)]
    diff = difference_table(rank0)
    if diff is not None:
        parts.append(diff)
    parts.append(collective_table(rank0))
    if result["equal"]:
        parts.append(
            Text(
                "✓ every rank: model states = estimate; saved tensors = estimate (with the documented "
                "DTensor differences); peak: see the % beside each",
                style="bold green",
            )
        )
    else:
        parts.append(
            Text("✗ a rank differs from the estimate beyond the documented differences", style="bold red")
        )
    return Group(*parts)
