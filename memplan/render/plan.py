"""Rendering of ``memplan plan``, ``compare`` and ``fit``: rich panels and tables, CSV and Markdown.

Units as in ``memplan.render.estimate`` (whose formatters and estimate panels are reused): bytes in binary
units (GiB = 2³⁰ bytes), FLOPs in decimal (TFLOP = 10¹², PFLOP = 10¹⁵), parameters in decimal (B = 10⁹). Pure:
every function takes computed results and returns text or renderables.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from typing import Any

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.text import Text

from memplan.api import Built
from memplan.compare import NUMBERS, Row
from memplan.config import CpRotate
from memplan.engine import Result
from memplan.render import estimate as report
from memplan.render.estimate import (
    BYTE_UNITS,
    DECIMAL_COUNT,
    DECIMAL_FLOPS,
    FLOP_UNITS,
    fmt_bytes,
    fmt_count,
    fmt_flops,
    fmt_in,
    fmt_int,
    plural,
    unit_of,
)
from memplan.render.fitted import Col, Fitted
from memplan.render.time import comm_table, fp8_mfu_note, time_table
from memplan.reserved import Reserved
from memplan.search.budget import HostVerdict, Verdict

# The memory bar's parts as memplan.render.estimate draws them: (label, style, glyph).
SEGMENTS = report.SEGMENTS  # one bar style for every command
COMPARE_BAR = 24


# ----------------------------------------------------------------------------------------------------
# memplan plan
# ----------------------------------------------------------------------------------------------------
def layout_line(p: Result) -> str:
    par, dp = p.parallel, p.setup.strategy.dp
    schedule = f"interleaved ×{par.vpp}" if par.vpp > 1 else "1F1B"
    parts = [f"tp {par.tp}" + (" + sequence parallel" if par.sp else "")]
    if par.cp > 1:
        kind = "K/V all-gathered, no ring" if par.cp_rotate is CpRotate.KV_GATHER else "ring attention"
        parts.append(f"cp {par.cp} ({kind}, {fmt_int(p.setup.training.seq_len // par.cp)} tokens each)")
    parts.append(f"pp {par.pp} ({schedule})" if par.pp > 1 else "pp 1")
    if par.ep > 1 or par.fold > 1:
        folded = f" across tp × dp (etp {par.expert_tp}: whole experts)" if par.fold > 1 else ""
        parts.append(f"ep {par.ep}{folded}")
    parts.append(f"dp {dp} = {plural(p.devices, 'device')}")
    tokens = p.global_batch * p.setup.training.seq_len
    parts.append(
        f"{plural(p.micro_batches, 'micro-batch', 'micro-batches')} per step, global batch "
        f"{plural(p.global_batch, 'sequence')} = {plural(tokens, 'token')}"
    )
    return " · ".join(parts)


def verdict_text(v: Verdict) -> Text:
    """Fits or not: the allocator's reserved peak against the memory left to it (the driver's, less the
    CUDA context, NCCL's buffers, FSDP2's all-gather stream and DDP's buckets where the layout has them,
    and ``--reserve``); when the two print the same, the byte difference says which way."""
    stream, ddp = v.fsdp_all_gather_stream, v.ddp_buckets
    comm = f", FSDP2 all-gather stream {fmt_bytes(stream)}" if stream else ""
    comm += f", DDP buckets {fmt_bytes(ddp)}" if ddp else ""
    comm += f", TE userbuffers {fmt_bytes(v.userbuffers)}" if v.userbuffers else ""
    comm += f", symmetric memory {fmt_bytes(v.symm_mem)}" if v.symm_mem else ""
    memory = (
        f"{v.gpu} ({fmt_bytes(v.usable_bytes)} for the allocator of {fmt_bytes(v.device_bytes)} "
        f"the driver reports: CUDA context {fmt_bytes(v.cuda_context)}, NCCL buffers {fmt_bytes(v.nccl)}"
        f"{comm}, --reserve {fmt_bytes(v.reserve)})"
    )
    judged = v.reserved_peak if v.reserved_peak is not None else v.peak
    close = fmt_bytes(judged) == fmt_bytes(v.usable_bytes)
    gap = f" ({fmt_int(abs(v.headroom))} bytes {'under' if v.headroom >= 0 else 'over'})" if close else ""
    what = f"reserved {fmt_bytes(judged)}" if v.reserved_peak is not None else f"peak {fmt_bytes(v.peak)}"
    what += " (cached segments released to fit)" if v.capped else ""
    if v.fits:
        return Text(f"fits on {memory}: {what}{gap}, headroom {fmt_bytes(v.headroom)}", "green")
    if not v.exact:
        what = f"peak at least {fmt_bytes(v.peak)}"
    else:
        what += f", peak {fmt_bytes(v.peak)} ({v.phase})"
    return Text(
        f"does NOT fit on {memory}: {what}{gap}; {v.overflow} overflow on stage {v.stage}",
        style="bold red",
    )


def allocator_text(r: Reserved) -> Text:
    """The step as torch's caching allocator would report it (``memplan.reserved``)."""
    extra = f" + cuBLAS workspaces {fmt_bytes(r.cublas_workspace)}" if r.cublas_workspace else ""
    outside = ""
    if r.cuda_context or r.nccl:  # with a GPU: what the driver holds beside the allocator's segments
        outside = (
            f"; outside it: CUDA context {fmt_bytes(r.cuda_context)} + NCCL buffers {fmt_bytes(r.nccl)} "
            + (f"+ TE userbuffers {fmt_bytes(r.userbuffers)} " if r.userbuffers else "")
            + (f"+ symmetric memory {fmt_bytes(r.symm_mem)} " if r.symm_mem else "")
            + f"= device {fmt_bytes(r.device_peak)}"
        )
    return Text(
        f"allocator (replayed, memory unlimited): allocated peak {fmt_bytes(r.allocated_peak)} · "
        f"reserved peak {fmt_bytes(r.reserved_peak)} in {fmt_int(r.segments)} segments{extra}{outside}"
    )


def summary_panel(b: Built) -> Panel:
    p = b.result
    head = Text()
    head.append(p.setup.model.name, style="bold cyan")
    head.append(f"   {fmt_count(p.params_total)} parameters ({fmt_int(p.params_total)})")
    head.append(f", {fmt_count(p.params_active)} active" + (f": {p.moe.label()}" if p.moe else ""))
    dev = p.device
    where = f" (pipeline stage {dev.stage.index} of {p.parallel.pp})" if p.parallel.pp > 1 else ""
    rank = p.setup.parallel.cp_rank
    device = "the most loaded device" if rank is None else f"context-parallel rank {rank} of {p.parallel.cp}"
    lines: list[RenderableType] = [
        head,
        Text(report.setup_line(p), style="dim"),
        Text(layout_line(p), style="dim"),
        *([Text(report.finetune_line(p), style="dim")] if not p.setup.finetune.trains_everything else []),
        Text(""),
        Text(f"Memory on {device}{where}; {BYTE_UNITS}", style="bold"),
        report.memory_bar(p),
        Text("moments: " + " · ".join(f"{k} {fmt_bytes(v)}" for k, v in dev.peak.phases.items())),
    ]
    if p.micro_batches < p.parallel.pp:
        lines.append(
            Text(
                f"NB: {plural(p.micro_batches, 'micro-batch', 'micro-batches')} per step for {p.parallel.pp} "
                "stages: the pipeline is "
                "mostly bubble; set --global-batch (or --grad-accum) to at least pp micro-batches",
                style="yellow",
            )
        )
    if (host := report.host_line(p)) is not None:
        lines.append(host)
    if b.reserved is not None:
        lines.append(allocator_text(b.reserved))
    if b.fsdp_all_gather:  # FSDP2's all-gather stream: its own pool (memplan.analytic.fsdp.buffers)
        lines.append(
            Text(
                f"FSDP2 all-gather stream (its own pool, beside the replay; judged): reserved "
                f"{fmt_bytes(b.fsdp_all_gather)}",
                style="dim",
            )
        )
    if b.fsdp_reduce_scatter:  # FSDP2's reduce-scatter stream: the sharded gradients' pool
        lines.append(
            Text(
                f"FSDP2 reduce-scatter stream (its own pool: the sharded gradients, in the peak; wholly "
                f"free without them, so not kept back): reserved {fmt_bytes(b.fsdp_reduce_scatter)}",
                style="dim",
            )
        )
    if b.ddp_buckets:  # torch DDP's gradient buckets (memplan.time.comm.buffers)
        lines.append(
            Text(
                f"DDP gradient buckets (gradient_as_bucket_view=False: a second copy of the gradients; "
                f"judged): {fmt_bytes(b.ddp_buckets)}",
                style="dim",
            )
        )
    if b.verdict is not None:
        lines.append(verdict_text(b.verdict))
    if b.host is not None:
        lines.append(host_verdict_text(b.host))
    return Panel(Group(*lines), title="memplan estimate", title_align="left")


def host_verdict_text(v: HostVerdict) -> Text:
    """Whether one node's host memory holds its devices' offloaded tensors."""
    need = f"{plural(v.devices, 'device')} × {fmt_bytes(v.per_device)} = {fmt_bytes(v.need)}"
    if v.fits:
        return Text(f"host fits: {need} of {fmt_bytes(v.host_memory_bytes)} per node", "green")
    return Text(f"host does NOT fit: {need} > {fmt_bytes(v.host_memory_bytes)} per node", style="bold red")


def stages_table(p: Result) -> Fitted:
    byte_keys = ("weights", "gradients", "optimizer", "activations", "peak")
    figures = {
        "weights": [sp.states.weights for sp in p.stages],
        "gradients": [sp.states.gradients for sp in p.stages],
        "optimizer": [sp.states.optimizer for sp in p.stages],
        "activations": [sp.activations for sp in p.stages],
        "peak": [sp.peak.bytes for sp in p.stages],
    }
    units = {k: unit_of(figures[k]) for k in byte_keys}
    priority = {"weights": 4, "gradients": 4, "optimizer": 3, "activations": 2, "peak": 0}
    cols = [
        Col("stage"),
        Col("layers"),
        Col("in flight\nlayer-sets", priority=2),
        Col("params", priority=3),
        *(Col(f"{k}\n{units[k][1]}", priority=priority[k]) for k in byte_keys),
        Col("moment", "left", priority=1),
    ]
    table = Fitted(cols, title=f"Pipeline stages on one device each ({BYTE_UNITS})")
    for n, sp in enumerate(p.stages):
        st = sp.stage
        table.add(
            str(st.index),
            str(st.layers),
            fmt_int(st.in_flight_layers),
            fmt_count(sp.params.total),
            *(fmt_in(figures[k][n], units[k][0]) for k in byte_keys),
            sp.peak.phase,
        )
    table.caption = (
        "in flight: layers × micro-batches (× chunks) whose activations are alive at the end of the "
        "warm-up; middle stages hold less than stage 0"
    )
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
        if b.timing.prediction.communication:
            parts.append(comm_table(b.timing))
    return Group(*parts)


# ----------------------------------------------------------------------------------------------------
# memplan compare
# ----------------------------------------------------------------------------------------------------
HEADERS = dict(NUMBERS)
BYTE_KEYS = ("weights", "gradients", "optimizer_memory", "activations", "peak", "reserved", "transient")
# Which numbers give way first when the terminal is narrow (0: never; the settings are keys, always shown).
PRIORITY = {
    "peak": 1,
    "reserved": 1,
    "fits": 1,
    "step_time": 2,
    "tokens_per_s": 3,
    "step_mfu": 3,
    "params": 4,
    "activations": 5,
    "optimizer_memory": 5,
    "flops": 6,
    "weights": 7,
    "gradients": 7,
}
BAR_LEGEND = (
    "bar: █ weights ▓ gradients ▒ optimizer ░ activations ▞ peak transient, │ the memory the allocator may "
    "use (the GPU's less the CUDA context, NCCL's and FSDP's buffers and --reserve)"
)


def fmt_value(key: str, value: Any) -> str:
    """One cell of a compare row, in the units of memplan.render.estimate (each cell says its unit)."""
    if value is None:
        return "–"
    if key in BYTE_KEYS:
        return fmt_bytes(int(value))
    if key == "flops":
        return fmt_flops(int(value))
    if key == "params":
        return fmt_count(int(value))
    return _plain(key, value)


def _plain(key: str, value: Any) -> str:
    if value is None:
        return "–"
    if key == "step_time":
        return f"{value:,.2f}"
    if key == "tokens_per_s":
        return f"{value:,.0f}"
    if key == "step_mfu":
        return f"{value:.1%}"
    if key == "fits":
        return "yes" if value else "NO"
    return str(value)


def column_units(values: Sequence[dict[str, Any]]) -> dict[str, tuple[int, str]]:
    """The unit each figure column is shown in (its header says it): its largest figure's."""
    units = {k: unit_of([v.get(k) for v in values]) for k in BYTE_KEYS}
    units["params"] = unit_of([v.get("params") for v in values], DECIMAL_COUNT)
    units["flops"] = unit_of([v.get("flops") for v in values], DECIMAL_FLOPS)
    return units


def _cell(key: str, value: Any, units: dict[str, tuple[int, str]]) -> str:
    if key in units and value is not None:
        return fmt_in(int(value), units[key][0])
    return _plain(key, value)


def memory_cell(values: dict[str, Any], scale: int, memory: int | None, width: int = COMPARE_BAR) -> Text:
    """A one-line stacked bar (weights, gradients, optimizer, activations, transient) on a shared scale;
    ``│`` marks the memory the allocator may use (``Verdict.usable_bytes``)."""
    bar = Text()
    done = cum = 0
    parts = ("weights", "gradients", "optimizer_memory", "activations", "transient")
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


def _compare_columns(keys: Sequence[str], units: dict[str, tuple[int, str]]) -> list[Col]:
    cols: list[Col] = []
    for key in keys:
        if key in HEADERS:
            unit = units.get(key, (1, ""))[1]
            header = f"{HEADERS[key]}\n{unit}" if unit else HEADERS[key]
            cols.append(Col(header, priority=PRIORITY[key]))
        else:  # a setting: a key; "global-batch" on two lines, its values are short
            cols.append(Col(key.replace("-", "-\n"), "left"))
        if key == "reserved":  # the bar after the two peaks it draws and is judged by
            cols.append(Col("memory", "left", priority=8, below=True))
    return cols


def unsharded(r: Result) -> bool:
    """A ZeRO stage above 0 over a single shard (one data-parallel rank, no cp): the same as stage 0."""
    return r.setup.strategy.zero > 0 and r.setup.state_shards == 1


def compare_table(rows: Sequence[Row], keys: Sequence[str], same: dict[str, str] | None = None) -> Fitted:
    """One row per combination: the settings that tell the rows apart (keys), then the figures, each
    column in one unit said in its header; ``same``: the settings every row shares, said once above."""
    values = [r.values() for r in rows]
    units = column_units(values)
    memory = [r.built.verdict.usable_bytes if r.built.verdict else 0 for r in rows]
    scale = max([v["peak"] or 0 for v in values] + [v["reserved"] or 0 for v in values] + memory + [1])
    shared = " · ".join(f"{k} {v}" for k, v in (same or {}).items() if v != "–")
    notes = [fp8_mfu_note([r.built.timing for r in rows])]
    untimed = next((r.built.untimed for r in rows if r.built.untimed), None)
    if untimed:  # offload on a GPU that states no host link: those rows have no time
        notes.append(f"– under step s: not timed, {untimed.removeprefix('gpu: ')}")
    if "zero" in keys and any(unsharded(r.built.result) for r in rows):
        notes.append("zero: over one data-parallel rank (and no cp) ZeRO shards nothing; give --gpus or --dp")
    said = "".join(f" {n}." for n in notes if n)
    table = Fitted(
        _compare_columns(keys, units),
        title="memplan compare" + (f": {shared}" if shared else ""),
        caption=(
            "peak: the most loaded device's tensors; reserved: its caching allocator's reserved peak, what "
            "fits is judged on; FLOPs/step: all that runs, whole job; step time predicted (or at "
            f"--mfu).{said} {BAR_LEGEND}. {BYTE_UNITS}; {FLOP_UNITS}"
        ),
    )
    for vals, mem in zip(values, memory, strict=True):
        cells: list[Text] = []
        for key in keys:
            style = "red" if vals.get(key) is False else ""
            cells.append(Text(_cell(key, vals.get(key), units), style=style))
            if key == "reserved":
                cells.append(memory_cell(vals, scale, mem or None))
        table.add(*cells)
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
