"""Rendering of ``trace --impl torchtitan --pp``: each pipeline rank traced, estimated beside measured."""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.text import Text

from memplan.render.estimate import fmt_bytes
from memplan.render.measure import layer_table, tensor_table

FSDP2_HELD = {
    "unsharded_weights": "units gathered at once",
    "unsharded_gradients": "unsharded gradients to the reduction",
    "gradients": "sharded gradients after it",
}


def stage_trace_report(result: dict[str, Any], seconds: float) -> RenderableType:
    """Per rank: its saves and holds by kind, its layers; then one verdict over every rank traced."""
    parts: list[RenderableType] = []
    for r in result["stages"]:
        st, diff = r["stage"], r["diff"]
        chunks = ", ".join(map(str, st["virtual_stages"]))
        title = f"Pipeline rank {st['index']} of {st['pp']} (virtual stages {chunks})"
        parts += [tensor_table(diff, title), layer_table(diff)]
        w = diff["weights"]
        parts.append(
            Text(
                f"rank {st['index']}: {fmt_bytes(diff['total']['measured'])} measured, "
                f"{fmt_bytes(diff['total']['estimated'])} estimated; parameters {fmt_bytes(w['measured'])} "
                f"measured, {fmt_bytes(w['estimated'])} estimated"
            )
        )
        if "fsdp2" in diff:  # torchtitan's FSDP2 through the schedule (compare.stage.fsdp2_held_json)
            held = [
                f"{label} {fmt_bytes(diff['fsdp2'][key]['measured'])} measured, "
                f"{fmt_bytes(diff['fsdp2'][key]['estimated'])} estimated"
                for key, label in FSDP2_HELD.items()
            ]
            parts.append(Text(f"rank {st['index']}, FSDP2: " + "; ".join(held)))
    ranks = len(result["stages"])
    parts.append(Text(f"{ranks} rank(s) traced in {seconds:.1f} s on fake tensors (CPU)"))
    if result["diff"]["equal"]:
        parts.append(Text("✓ every rank traced: estimate = measurement, byte for byte", style="bold green"))
    else:
        parts.append(
            Text("✗ a rank's estimate and measurement differ (a bug in one of them)", style="bold red")
        )
    return Group(*parts)
