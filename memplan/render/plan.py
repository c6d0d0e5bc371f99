"""Rendering of ``memplan plan``, ``compare`` and ``fit``: rich panels and tables, CSV and Markdown.

Units as in ``memplan.render.estimate`` (whose formatters and estimate panels are reused): bytes in binary
units (GiB = 2³⁰ bytes), FLOPs in decimal (TFLOP = 10¹², PFLOP = 10¹⁵), parameters in decimal (B = 10⁹). Pure:
every function takes computed results and returns text or renderables.
"""

from __future__ import annotations

import csv
import io
from collections import Counter
from collections.abc import Sequence
from typing import Any

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from memplan.api import Built
from memplan.compare import NUMBERS, Row
from memplan.engine import Result
from memplan.render import estimate as report
from memplan.render.estimate import BYTE_UNITS, FLOP_UNITS, fmt_bytes, fmt_count, fmt_flops, fmt_int
from memplan.search.budget import Verdict
from memplan.search.fit import Family, FitResult
from memplan.time.timing import Timing

# The memory bar's parts as memplan.render.estimate draws them: (label, style, glyph).
SEGMENTS = report.SEGMENTS  # one bar style for every command
COMPARE_BAR = 24


def _text(*cells: str) -> list[Text]:
    return [Text(c) for c in cells]


# ----------------------------------------------------------------------------------------------------
# memplan plan
# ----------------------------------------------------------------------------------------------------
def layout_line(p: Result) -> str:
    par, dp = p.parallel, p.setup.strategy.dp
    schedule = f"interleaved ×{par.vpp}" if par.vpp > 1 else "1F1B"
    parts = [f"tp {par.tp}" + (" + sequence parallel" if par.sp else "")]
    parts.append(f"pp {par.pp} ({schedule})" if par.pp > 1 else "pp 1")
    if par.ep > 1:
        parts.append(f"ep {par.ep}")
    parts.append(f"dp {dp} = {fmt_int(p.devices)} devices")
    tokens = p.global_batch * p.setup.training.seq_len
    parts.append(
        f"{p.micro_batches} micro-batches per step, global batch {fmt_int(p.global_batch)} "
        f"sequences = {fmt_int(tokens)} tokens"
    )
    return " · ".join(parts)


def verdict_text(v: Verdict) -> Text:
    memory = f"{v.gpu} ({fmt_bytes(v.memory_bytes)})"
    if v.fits:
        return Text(f"fits on {memory}: peak {fmt_bytes(v.peak)}, headroom {fmt_bytes(v.headroom)}", "green")
    peak = f"at least {fmt_bytes(v.peak)}" if not v.exact else f"{fmt_bytes(v.peak)} ({v.phase})"
    return Text(
        f"does NOT fit on {memory}: peak {peak}; {v.overflow} overflow on stage {v.stage}", style="bold red"
    )


def summary_panel(b: Built) -> Panel:
    p = b.result
    head = Text()
    head.append(p.setup.model.name, style="bold cyan")
    head.append(f"   {fmt_count(p.params_total)} parameters ({fmt_int(p.params_total)})")
    head.append(f", {fmt_count(p.params_active)} active" + (f": {p.moe.label()}" if p.moe else ""))
    dev = p.device
    where = f" (pipeline stage {dev.stage.index} of {p.parallel.pp})" if p.parallel.pp > 1 else ""
    lines: list[RenderableType] = [
        head,
        Text(report.setup_line(p), style="dim"),
        Text(layout_line(p), style="dim"),
        Text(""),
        Text(f"Memory on the most loaded device{where}; {BYTE_UNITS}", style="bold"),
        report.memory_bar(p),
        Text("moments: " + " · ".join(f"{k} {fmt_bytes(v)}" for k, v in dev.peak.phases.items())),
    ]
    if p.micro_batches < p.parallel.pp:
        lines.append(
            Text(
                f"NB: {p.micro_batches} micro-batches per step for {p.parallel.pp} stages: the pipeline is "
                "mostly bubble; set --global-batch (or --grad-accum) to at least pp micro-batches",
                style="yellow",
            )
        )
    if b.verdict is not None:
        lines.append(verdict_text(b.verdict))
    return Panel(Group(*lines), title="memplan plan", title_align="left")


def stages_table(p: Result) -> Table:
    table = Table(title=f"Pipeline stages on one device each ({BYTE_UNITS})", title_justify="left")
    for name in ("stage", "layers", "in flight", "params", "weights", "gradients", "optimizer"):
        table.add_column(name, justify="right", no_wrap=True)
    for name in ("activations", "peak", "moment"):
        table.add_column(name, justify="right", no_wrap=True)
    for sp in p.stages:
        st = sp.stage
        table.add_row(
            *_text(
                str(st.index),
                str(st.layers),
                f"{st.chunks * st.chunk_layers} layer-sets",
                fmt_count(sp.params.total),
                fmt_bytes(sp.states.weights),
                fmt_bytes(sp.states.gradients),
                fmt_bytes(sp.states.optimizer),
                fmt_bytes(sp.activations),
                fmt_bytes(sp.peak.bytes),
                sp.peak.phase,
            )
        )
    table.caption = (
        "in flight: layers × micro-batches (× chunks) whose activations are alive at the end of the "
        "warm-up; middle stages hold less than stage 0"
    )
    return table


def time_table(t: Timing) -> Table:
    table = Table(title=f"Time of one step ({FLOP_UNITS})", title_justify="left", show_header=False)
    table.add_column("", no_wrap=True)
    table.add_column("", justify="right", no_wrap=True)
    table.add_column("", ratio=1)
    basis = (
        f"at an assumed MFU of {t.assumed_mfu:.0%} (--mfu)"
        if t.assumed_mfu is not None
        else "measured (--step-time)"
    )
    rows = [
        ("step time", f"{t.step_time_s:,.3f} s", basis),
        ("tokens/s", f"{t.tokens_per_s:,.0f}", f"{fmt_int(t.tokens_per_step)} tokens per step"),
        ("MFU", f"{t.mfu:.1%}", "model FLOPs (no recompute) / (time × devices × peak)"),
        ("HFU", f"{t.hfu:.1%}", "all FLOPs that run (recompute included) / the same"),
        ("pipeline bubble", f"{t.bubble:.1%}", "(p − 1)/(m·n) of the busy time"),
        ("model FLOPs", fmt_flops(t.model_flops_per_step), "per step"),
        ("hardware FLOPs", fmt_flops(t.hardware_flops_per_step), "per step"),
        (
            "peak per device",
            f"{t.peak_flops_per_device / 1e12:,.1f} TFLOP/s",
            f"× {fmt_int(t.devices)} devices",
        ),
    ]
    if t.training_days is not None and t.training_tokens is not None:
        rows.append(("training", f"{t.training_days:,.1f} days", f"{fmt_count(t.training_tokens)} tokens"))
    for cells in rows:
        table.add_row(*_text(*cells))
    return table


def step_report(b: Built) -> Group:
    """What ``memplan estimate`` prints: one device without a GPU as the estimate's report (summary,
    activation inventory, FLOPs); a parallel layout or a GPU adds the layout, stages, verdict and time."""
    p = b.result
    if p.devices == 1 and b.gpu is None:
        return report.estimate_report(p)
    return plan_report(b)


def plan_report(b: Built) -> Group:
    p = b.result
    parts: list[RenderableType] = [summary_panel(b)]
    if p.parallel.pp > 1:
        parts.append(stages_table(p))
    parts += [report.activation_table(p), report.flops_table(p)]
    if b.timing is not None:
        parts.append(time_table(b.timing))
    return Group(*parts)


# ----------------------------------------------------------------------------------------------------
# memplan compare
# ----------------------------------------------------------------------------------------------------
HEADERS = dict(NUMBERS)


def fmt_value(key: str, value: Any) -> str:
    """One cell of a compare row, in the units of memplan.render.estimate."""
    if value is None:
        return "–"
    if key in ("weights", "gradients", "optimizer", "activations", "peak", "transient"):
        return fmt_bytes(int(value))
    if key == "flops":
        return fmt_flops(int(value))
    if key == "params":
        return fmt_count(int(value))
    if key == "step_time":
        return f"{value:,.2f}"
    if key == "tokens_per_s":
        return f"{value:,.0f}"
    if key == "mfu":
        return f"{value:.1%}"
    if key == "fits":
        return "yes" if value else "NO"
    return str(value)


def memory_cell(values: dict[str, Any], scale: int, memory: int | None, width: int = COMPARE_BAR) -> Text:
    """A one-line stacked bar (weights, gradients, optimizer, activations, transient) on a shared scale;
    ``│`` marks the GPU's memory."""
    bar = Text()
    done = cum = 0
    parts = ("weights", "gradients", "optimizer", "activations", "transient")
    for key, (_, style, glyph) in zip(parts, SEGMENTS, strict=True):
        cum += values[key] or 0
        end = round(cum * width / scale)
        bar.append(glyph * (end - done), style=style)
        done = end
    bar.append(" " * (width - done))
    if memory is not None:
        at = min(width - 1, round(memory * width / scale))
        bar = bar[:at] + Text("│", style="bold") + bar[at + 1 :]
    return bar


def compare_table(rows: Sequence[Row], keys: Sequence[str]) -> Table:
    table = Table(title=f"memplan compare ({BYTE_UNITS}; {FLOP_UNITS})", title_justify="left")
    numbers = set(HEADERS)
    values = [r.values() for r in rows]
    memory = [r.built.gpu.memory_bytes if r.built and r.built.gpu else 0 for r in rows]
    scale = max([v["peak"] or 0 for v in values] + memory + [1])
    for key in keys:
        table.add_column(
            HEADERS.get(key, key), justify="right" if key in numbers else "left", no_wrap=key != "error"
        )
        if key == "peak":
            table.add_column("memory (█ w ▓ g ▒ opt ░ act ▞ peak, │ GPU)", no_wrap=True)
    for row, vals, mem in zip(rows, values, memory, strict=True):
        cells: list[Text] = []
        for key in keys:
            cells.append(Text(fmt_value(key, vals.get(key)), style="red" if vals.get(key) is False else ""))
            if key == "peak":
                cells.append(memory_cell(vals, scale, mem or None) if row.built else Text("–"))
        table.add_row(*cells)
    table.caption = "peak: most loaded device; FLOPs/step: all that runs, whole job; step time at --mfu"
    return table


def to_csv(rows: Sequence[Row], keys: Sequence[str]) -> str:
    """Raw values (bytes, FLOPs as integers; seconds; fractions), one header line."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(keys)
    for r in rows:
        vals = r.values()
        writer.writerow(["" if vals.get(k) is None else vals.get(k) for k in keys])
    return out.getvalue()


def to_markdown(rows: Sequence[Row], keys: Sequence[str]) -> str:
    """A GitHub table with formatted values."""
    head = [HEADERS.get(k, k) for k in keys]
    lines = [
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---:" if k in HEADERS else "---" for k in keys) + "|",
    ]
    for r in rows:
        vals = r.values()
        cells = [fmt_value(k, vals.get(k)).replace("|", "\\|") for k in keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------
# memplan fit
# ----------------------------------------------------------------------------------------------------
def _family_cells(f: Family) -> list[str]:
    par = f.layout.parallel
    return [
        f.checkpointing.name.lower(),
        f.attention.name.lower(),
        str(int(f.zero)),
        f"{par.tp}" + ("+sp" if par.sp else ""),
        str(par.pp),
        str(par.ep),
        str(f.layout.dp),
    ]


def fit_report(r: FitResult, top: int) -> Group:
    s = r.setup
    head = Text()
    head.append(s.model.name, style="bold cyan")
    head.append(
        f" on {r.gpus} × {r.gpu.name} ({fmt_bytes(r.gpu.memory_bytes)} each), "
        f"seq {fmt_int(s.training.seq_len)}, global batch {fmt_int(r.global_batch)} sequences, "
        f"{s.training.precision.value}, {s.training.optimizer.value}"
    )
    speed = r.searched / r.seconds if r.seconds else 0.0
    lines: list[RenderableType] = [
        head,
        Text(
            f"searched {fmt_int(r.searched)} configurations in {r.seconds * 1000:,.0f} ms ({speed:,.0f}/s): "
            f"{fmt_int(r.evaluated)} evaluated, {fmt_int(r.peaks)} needed their peak; "
            f"{len(r.fitting)} fit, {len(r.rejected)} families rejected",
            style="dim",
        ),
    ]
    if r.best is not None and r.max_seq is not None:
        lines.append(
            Text(f"longest sequence for the best configuration (micro-batch 1): {fmt_int(r.max_seq)}")
        )
    if r.best is None:
        lines.append(Text("nothing fits: see the rejected families below", style="bold red"))
    parts: list[RenderableType] = [Panel(Group(*lines), title="memplan fit", title_align="left")]
    if r.fitting:
        parts.append(_fitting_table(r, top))
    if r.rejected:
        parts.append(_rejected_table(r, top))
    return Group(*parts)


def _fitting_table(r: FitResult, top: int) -> Table:
    shown = r.fitting[:top] if top else r.fitting
    table = Table(
        title=f"Configurations that fit, fastest first ({len(shown)} of {len(r.fitting)}; {BYTE_UNITS})",
        title_justify="left",
    )
    for name in ("#", "ckpt", "attention", "ZeRO", "tp", "pp", "ep", "dp", "micro-batch", "peak", "headroom"):
        table.add_column(name, justify="right" if name not in ("ckpt", "attention") else "left", no_wrap=True)
    for name in ("step s", "tokens/s", "MFU"):
        table.add_column(name, justify="right", no_wrap=True)
    for i, c in enumerate(shown, 1):
        t, v = c.timing, c.verdict
        table.add_row(
            *_text(
                str(i),
                *_family_cells(c.family),
                f"{c.micro_batch} × {c.result.micro_batches}",
                fmt_bytes(v.peak),
                fmt_bytes(v.headroom),
                f"{t.step_time_s:,.2f}",
                f"{t.tokens_per_s:,.0f}",
                f"{t.mfu:.1%}",
            )
        )
    table.caption = (
        "micro-batch: size × micro-batches per step; higher ZeRO stages of a listed configuration fit too "
        "(not listed: no faster, communication not modelled)"
    )
    return table


def _rejected_table(r: FitResult, top: int) -> Table:
    closest = sorted(r.rejected, key=lambda x: x.verdict.peak)
    shown = closest[:top] if top else closest
    reasons = Counter(x.verdict.overflow for x in r.rejected)
    summary = ", ".join(f"{n} {term}" for term, n in reasons.most_common())
    table = Table(
        title=f"Rejected families, closest first ({len(shown)} of {len(r.rejected)}: {summary})",
        title_justify="left",
    )
    for name in ("ckpt", "attention", "ZeRO", "tp", "pp", "ep", "dp", "peak", "overflows"):
        table.add_column(name, justify="right" if name not in ("ckpt", "attention", "overflows") else "left")
    for x in shown:
        v = x.verdict
        peak = fmt_bytes(v.peak) if v.exact else f"≥ {fmt_bytes(v.peak)}"
        table.add_row(*_text(*_family_cells(x.family), peak, f"{v.overflow} (stage {v.stage})"))
    table.caption = (
        "at micro-batch 1; overflows: the first of weights, optimizer, gradients, activations, transient "
        "whose running sum passes the memory"
    )
    return table
