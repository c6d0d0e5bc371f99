"""The verdict panel ``memplan estimate`` leads with (and ``--summary`` prints alone).

Renders ``memplan.advice.Advice``: fits or not on which GPU, how many GPUs of a size it needs, the three
largest terms of the peak, and each suggested command with its estimated reserved peak. Units as in
``memplan.render.estimate`` (GiB = 2³⁰ bytes). Pure: computed advice in, a rich panel out.
"""

from __future__ import annotations

import shlex

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from memplan.advice import Advice, GpuCount, Suggestion
from memplan.render.estimate import fmt_bytes, plural

HELD = {
    "cuda_context": "the CUDA context",
    "nccl": "NCCL's buffers",
    "fsdp_all_gather_stream": "FSDP2's all-gather stream",
    "ddp_buckets": "DDP's gradient buckets",
    "userbuffers": "Transformer Engine's userbuffers",
    "symm_mem": "the symmetric-memory workspace",
    "reserve": "--reserve",
}
"""How the headline names each of ``Advice.held``'s keys (``search.budget.Verdict.held``)."""


def _headline(a: Advice) -> Text:
    """Fits or not, on which GPU and why that one: the allocator's reserved peak against the memory left to
    it (what is judged: free = usable − reserved), then the tensors' peak and its moment."""
    judged = (
        f"reserved {fmt_bytes(a.reserved)}, {fmt_bytes(a.usable_bytes)} usable of {fmt_bytes(a.memory_bytes)}"
    )
    largest = next(iter(a.held.items()), None)
    if largest and a.usable_bytes < a.memory_bytes // 2:  # say what takes the device's memory first
        judged += f" (held before it: {HELD[largest[0]]}, {fmt_bytes(largest[1])})"
    devices = "one" if a.devices == 1 else f"each of {a.devices:,}"
    peak = f"tensors' peak {fmt_bytes(a.peak)} ({a.phase})"
    if a.fits:
        chosen = "" if a.gpu_given else " (the smallest GPU preset that holds it)"
        return Text(
            f"fits on {devices} {a.gpu} with {fmt_bytes(a.headroom)} free{chosen}: {judged}; {peak}",
            style="bold green",
        )
    chosen = "" if a.gpu_given else " (the largest GPU preset; --gpu NAME or --gpu-memory GiB to choose)"
    return Text(f"does NOT fit on {devices} {a.gpu}{chosen}: {judged}; {peak}", style="bold red")


def _count_line(c: GpuCount) -> Text:
    if c.devices is None and c.refused:
        why = f"no data-parallel count on {c.gpu}: --zero 3 is refused with these options ({c.refused})"
        return Text(why, style="yellow")
    if c.devices is None and c.hsdp:
        return Text(
            f"no data-parallel count fits on {c.gpu}: under --hsdp {c.hsdp} ZeRO-3 shards the model states "
            f"over {c.hsdp} ranks only, so more replicas leave the peak at {fmt_bytes(c.peak)}; a larger "
            "--hsdp, or split the model or the sequence (--tp, --pp, --cp: memplan fit)",
            style="yellow",
        )
    if c.devices is None:
        return Text(
            f"no data-parallel count fits on {c.gpu}: under ZeRO-3 the peak stays {fmt_bytes(c.peak)} "
            "(activations and transients do not shard over dp); split the model or the sequence "
            "(--tp, --pp, --cp: memplan fit)",
            style="yellow",
        )
    how = f" ({' '.join(c.args)})" if c.args else ""
    if c.devices == 1:
        usable = fmt_bytes(c.usable_bytes)
        return Text(f"fits on one {c.gpu}{how}: reserved {fmt_bytes(c.reserved)} ({usable} usable)")
    return Text(
        f"needs {c.devices:,} × {c.gpu}{how}: reserved {fmt_bytes(c.reserved)} on the most loaded, "
        f"{fmt_bytes(c.usable_bytes)} usable",
        style="bold",
    )


def _terms_line(a: Advice) -> Text:
    parts = [f"{name} {fmt_bytes(value)} ({value / a.peak:.0%})" for name, value in a.terms.items()]
    return Text("largest terms of the tensors' peak: " + " · ".join(parts))


def _suggestions(found: list[Suggestion]) -> Table:
    table = Table.grid(padding=(0, 1))
    table.add_column(no_wrap=True)
    table.add_column(justify="right", no_wrap=True)
    table.add_column(overflow="fold")
    for s in found:
        mark = Text("fits", style="green") if s.fits else Text("no", style="red")
        gpus = f" ({plural(s.devices, 'GPU')})" if s.devices > 1 else ""
        table.add_row(mark, fmt_bytes(s.reserved), Text(f"{shlex.join(s.command)}{gpus}: {s.why}"))
    return table


def verdict_panel(a: Advice) -> Panel:
    """The answer first: the verdict, what fills the peak, and the commands that make it fit."""
    lines: list[RenderableType] = [_headline(a), *(_count_line(c) for c in a.counts), _terms_line(a)]
    if a.suggestions:
        lines.append(
            Text(
                f"to make it fit on {a.gpu}, each estimated (the allocator's reserved peak on the most "
                "loaded device; GiB = 2³⁰ bytes):",
                style="bold",
            )
        )
        lines.append(_suggestions(a.suggestions))
    lines += [Text(f"NB: {note}", style="yellow") for note in a.notes]
    return Panel(Group(*lines), title="verdict", title_align="left")
