"""Rendering: rich panels and tables of an estimate and of the presets. Unit formatting lives here only.

Units, said explicitly wherever they are shown: bytes in binary units (KiB = 2¹⁰, MiB = 2²⁰, GiB = 2³⁰
bytes; figures ≥ 1 GiB stay in GiB), FLOPs in decimal units (GFLOP = 10⁹, TFLOP = 10¹², PFLOP = 10¹⁵),
parameters in decimal (M = 10⁶, B = 10⁹). Every function here is pure: it takes computed results
(``Result``, presets, ``ParamCount``) and returns rich renderables; nothing is computed beyond the
formatting (shares of a bar, a ratio).
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.columns import Columns
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from memplan.analytic.optimizer_step import optimizer_impl
from memplan.blocks.inventory import Scope
from memplan.config import (
    CpRotate,
    LossKind,
    Method,
    Offload,
    OptimizerImpl,
    checkpointing_label,
    loss_label,
    offload_label,
)
from memplan.engine import Result
from memplan.render.fitted import Col, Fitted

BYTE_UNITS = "GiB = 2³⁰ bytes, MiB = 2²⁰ bytes"
FLOP_UNITS = "PFLOP = 10¹⁵ FLOP, TFLOP = 10¹² FLOP, a multiply-add = 2 FLOP"
BINARY = ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))
DECIMAL_FLOPS = ((10**15, "PFLOP"), (10**12, "TFLOP"), (10**9, "GFLOP"), (10**6, "MFLOP"))
DECIMAL_COUNT = ((10**9, "B"), (10**6, "M"), (10**3, "K"))

# Memory components: (label, style, glyph) in bar order; the glyphs tell them apart without colour.
SEGMENTS = (
    ("weights", "blue", "█"),
    ("gradients", "magenta", "▓"),
    ("optimizer", "yellow", "▒"),
    ("activations", "green", "░"),
    ("peak transient", "red", "▞"),
)
BAR_WIDTH = 64


# ----------------------------------------------------------------------------------------------------
# Units
# ----------------------------------------------------------------------------------------------------
def _scaled(n: int, units: tuple[tuple[int, str], ...], plain: str, digits: int = 2) -> str:
    for size, unit in units:
        if abs(n) >= size:
            return f"{n / size:,.{digits}f} {unit}"
    return f"{n:,}{plain}"


def fmt_bytes(n: int) -> str:
    """Bytes in binary units: ``1,174.83 GiB`` (GiB = 2³⁰ bytes), ``64.00 MiB``, ``512 B``."""
    return _scaled(n, BINARY, " B")


def fmt_flops(n: int) -> str:
    """FLOPs in decimal units: ``4.03 PFLOP`` (10¹⁵), ``812.50 TFLOP`` (10¹²), ``1.20 GFLOP`` (10⁹)."""
    return _scaled(n, DECIMAL_FLOPS, " FLOP")


def fmt_rate(flops_per_s: float) -> str:
    """FLOP/s in the decimal unit that keeps it readable: ``312.5 TFLOP/s``, ``3.29 GFLOP/s``,
    ``850.00 MFLOP/s`` (never ``0.000 TFLOP/s``)."""
    for size, unit in DECIMAL_FLOPS:
        if abs(flops_per_s) >= size:
            return f"{flops_per_s / size:,.2f} {unit}/s"
    return f"{flops_per_s:,.0f} FLOP/s"


def fmt_count(n: int) -> str:
    """A parameter count in decimal units: ``70.55 B``, ``124.44 M``, ``106.82 K``."""
    return _scaled(n, DECIMAL_COUNT, "")


def unit_of(values: Sequence[int | None], units: tuple[tuple[int, str], ...] = BINARY) -> tuple[int, str]:
    """The one unit a column of figures is shown in (said in its header): the largest unit its largest
    figure reaches, e.g. ``(2**30, "GiB")``; ``(1, "")`` below the smallest."""
    top = max((abs(v) for v in values if v is not None), default=0)
    for size, unit in units:
        if top >= size:
            return size, unit
    return 1, ""


def fmt_in(n: int, size: int, digits: int = 2) -> str:
    """``n`` in a column's unit (``unit_of``), without the unit: ``1,059.16``."""
    return f"{n / size:,.{digits}f}" if size > 1 else f"{n:,}"


def fmt_int(n: int) -> str:
    return f"{n:,}"


def plural(n: int, word: str, many: str | None = None) -> str:
    """``1 device``, ``8 devices``: a count and its noun, in the number's grammar (``many``: the plural
    when it is not the word + s, ``micro-batches``)."""
    return f"{n:,} {word if n == 1 else many or word + 's'}"


def fmt_shape(shape: Sequence[int]) -> str:
    return "scalar" if not shape else "[" + ", ".join(str(d) for d in shape) + "]"


def row(table: Table, *cells: str, style: str = "") -> None:
    """Add a row of plain text: data such as ``[b, s, h]`` in a reason is never read as rich markup."""
    table.add_row(*(Text(c) for c in cells), style=style)


# ----------------------------------------------------------------------------------------------------
# Summary
# ----------------------------------------------------------------------------------------------------
def setup_line(e: Result) -> str:
    s = e.setup
    t, st = s.training, s.strategy
    rev = " · reversible" if st.reversible else ""
    par = s.parallel
    cp = f" × cp {par.cp}" if par.cp > 1 else ""
    cp += f" ({par.cp_rotate.value})" if par.cp > 1 and par.cp_rotate is not CpRotate.ALLGATHER else ""
    tokens = plural(t.micro_batch * t.seq_len, "token")
    return (
        f"micro-batch {t.micro_batch} × seq {fmt_int(t.seq_len)} = {tokens}"
        f" · {t.precision.value} · {t.optimizer.value} · grad-accum {t.grad_accum}"
        f" · checkpointing {checkpointing_label(st)} · {st.attention.name.lower()} attention{rev}"
        f" · ZeRO-{int(st.zero)} over dp {st.dp}{cp} · {s.device.value} kernels{_savers(e)}"
    )


def _savers(e: Result) -> str:
    """`` · offload optimizer · loss fused`` when they differ from the defaults."""
    s = e.setup
    off = f" · offload {offload_label(s.offload)}" if s.offload is not Offload.NONE else ""
    loss = f" · loss {loss_label(s.loss, s.loss_chunks)}" if s.loss is not LossKind.STANDARD else ""
    return off + loss


def host_line(e: Result) -> Text | None:
    """The most loaded device's offloaded tensors in host memory (None without offload)."""
    if e.setup.offload is Offload.NONE:
        return None
    h = e.device.host
    parts = [
        f"{name} {fmt_bytes(value)}"
        for name, value in (
            ("weights", h.weights),
            ("gradients", h.gradients),
            ("optimizer", h.optimizer),
            ("activations", h.activations),
        )
        if value
    ]
    return Text(f"Host memory for this device: {fmt_bytes(h.total)} ({' · '.join(parts) or 'nothing'})")


def _components(e: Result) -> list[tuple[str, str, str, int]]:
    """(label, style, glyph, bytes) of the bar: model states, activations, what the peak adds on top."""
    st = e.states
    values = [st.weights, st.gradients, st.optimizer, e.activations]
    values.append(max(0, e.peak.bytes - sum(values)))
    return [(*segment, v) for segment, v in zip(SEGMENTS, values, strict=True)]


def memory_bar(e: Result, width: int = BAR_WIDTH) -> RenderableType:
    """A stacked bar of one device's memory, its legend, and where the peak falls."""
    parts = _components(e)
    scale = max(sum(v for *_, v in parts), e.peak.bytes, 1)
    bar, done, cum = Text(), 0, 0
    for _, style, glyph, value in parts:
        cum += value
        end = round(cum * width / scale)
        bar.append(glyph * (end - done), style=style)
        done = end
    at = max(0, round(e.peak.bytes * width / scale) - 1)
    words = f"peak {fmt_bytes(e.peak.bytes)} ({e.peak.phase})"
    if at + 2 + len(words) <= width:
        marker = " " * at + "▲ " + words
    else:  # no room to the right: the words end at the arrow
        marker = " " * max(0, at - 1 - len(words)) + words + " ▲"
    legend = [
        Text(glyph * 2, style=style).append(f" {label} {fmt_bytes(value)}", style="")
        for label, style, glyph, value in parts
        if value or label != "peak transient"
    ]
    return Group(bar, Text(marker, style="bold"), Columns(legend, padding=(0, 3)))


def _phases_line(e: Result) -> Text:
    text = Text("moments of the step (the peak is the largest):")
    for name, value in e.peak.phases.items():
        style = "bold" if name == e.peak.phase else ""
        text.append(f"\n  {name} {fmt_bytes(value)}", style=style)
        impl = optimizer_impl(e.setup)
        if name == "optimizer step" and impl is not OptimizerImpl.REFERENCE:
            step = e.peak.moments[name]["transient"]
            text.append(f" ({impl.value}: step temporaries {fmt_bytes(step)})")
    return text


def _bar_note(e: Result) -> str:
    transient = _components(e)[-1][-1]
    what = (
        "the peak transient is what the peak moment holds beyond all of these (loss or backward buffers)"
        if transient
        else "the bar's parts are not all alive at once (gradients are made during backward, "
        "activations are freed before the optimizer step)"
    )
    return (
        f"The peak is the largest of the modelled moments; {what}. "
        "NB: CUDA context, allocator fragmentation and communication buckets are not counted."
    )


def finetune_line(e: Result) -> str:
    """What trains and what is frozen, and where the model states come from under fine-tuning."""
    ft = e.setup.finetune
    what = "full fine-tuning"
    if ft.lora:
        targets = ",".join(t.value for t in ft.targets)
        name = "QLoRA" if ft.method is Method.QLORA else "LoRA"
        what = f"{name} r={ft.rank} on {targets} (α {ft.alpha:g}, dropout {ft.dropout:g})"
    if ft.method is Method.QLORA:
        what += f" · base {ft.quant.value}{' + double quant' if ft.double_quant else ''} 4-bit"
    frozen = [n for n, f in (("embeddings", ft.freeze_embeddings), ("lm head", ft.freeze_lm_head)) if f]
    if ft.freeze_layers:
        frozen.append(f"layers {ft.freeze_layers[0]}-{ft.freeze_layers[1]}")
    parts = f" · frozen: {', '.join(frozen)}" if frozen else ""
    return (
        f"{what}{parts} · trainable {fmt_count(e.params_trainable)} ({fmt_int(e.params_trainable)}), "
        f"frozen {fmt_count(e.params_frozen)}: gradients, master weights and optimizer states for the "
        "trainable ones only"
    )


def summary_panel(e: Result) -> Panel:
    """Model, parameters, the setup, and one device's memory: states, activations and the peak."""
    p = e.params
    st = e.setup.strategy
    head = Text()
    head.append(e.setup.model.name, style="bold cyan")
    head.append(f"   {fmt_count(p.total)} parameters ({fmt_int(p.total)}), {fmt_count(p.active)} active")
    body = Group(
        head,
        Text(setup_line(e), style="dim"),
        *([Text(finetune_line(e), style="dim")] if not e.setup.finetune.trains_everything else []),
        Text(""),
        Text(f"Memory on one device (ZeRO-{int(st.zero)}, dp {st.dp}); {BYTE_UNITS}", style="bold"),
        memory_bar(e),
        _phases_line(e),
        *([line] if (line := host_line(e)) else []),
        Text(_bar_note(e), style="dim"),
    )
    return Panel(body, title="memplan estimate", title_align="left")


# ----------------------------------------------------------------------------------------------------
# Activations
# ----------------------------------------------------------------------------------------------------
ACTIVATION_COLUMNS = (
    Col("tensor", "left"),
    Col("shape", "left", priority=1),
    Col("dtype", "left", priority=3),
    Col("bytes each", priority=5),
    Col("count", priority=2),
    Col("total"),
    Col("why kept", "left", priority=4, wrap=True, min_width=22),
)


def activation_table(e: Result) -> Fitted:
    """Every tensor autograd keeps for backward: model-level entries, then the per-layer ones; totals."""
    layers = e.setup.model.num_layers
    table = Fitted(
        ACTIVATION_COLUMNS,
        title=f"Activations kept for backward (one micro-batch, one device{_where(e)}; {BYTE_UNITS})",
    )
    groups = (
        (Scope.MODEL, "model-level"),
        (Scope.LAYER, f"per layer ({layers} layers)"),
    )
    for scope, title in groups:
        kept = [k for k in e.tensors if k.scope is scope]
        if not kept:
            continue
        table.add(Text(title, style="bold italic"), "", "", "", "", "", "", data=False)
        for k in kept:
            table.add(
                k.name,
                fmt_shape(k.shape),
                k.dtype.value,
                fmt_bytes(k.bytes),
                fmt_int(k.count),
                fmt_bytes(k.total_bytes),
                k.reason,
            )
        table.section()
    per_layer = "per-layer entries / layers"
    table.add("one layer", "", "", "", "", fmt_bytes(e.per_layer), per_layer, style="bold", data=False)
    every = sum(k.total_bytes for k in e.tensors)  # = e.activations unless they are offloaded
    table.add("total", "", "", "", "", fmt_bytes(every), f"{fmt_int(every)} bytes", style="bold", data=False)
    return table


def _where(e: Result) -> str:
    return ", copied to the host: --offload activations" if Offload.ACTIVATIONS in e.setup.offload else ""


# ----------------------------------------------------------------------------------------------------
# FLOPs
# ----------------------------------------------------------------------------------------------------
FLOPS_COLUMNS = (
    Col("", "left"),
    Col("FLOPs"),
    Col("exact", priority=2),
    Col("what it counts", "left", priority=1, wrap=True, min_width=24),
)


def _head_why(e: Result) -> str:
    if e.setup.loss is LossKind.FUSED:
        return "logits [tokens, vocab], and the fused loss's dX and dW products (backward work, run here)"
    return "logits [tokens, vocab]"


def flops_table(e: Result) -> Fitted:
    """Forward, backward, recompute; hardware and model FLOPs; the 6N·tokens view; per optimizer step."""
    f, g = e.flops, e.setup.training.grad_accum
    table = Fitted(FLOPS_COLUMNS, title=f"FLOPs of one micro-batch, whole model; {FLOP_UNITS}")

    def add(name: str, value: int, why: str, style: str = "") -> None:
        table.add(name, fmt_flops(value), fmt_int(value), why, style=style)

    rows: list[tuple[str, int, str]] = [
        ("forward", f.forward, "matmuls only, as torch's FlopCounterMode counts (≈ 2N·tokens + attention)"),
        ("  linear layers", f.layer_linear, "projections and MLP matrices of every layer"),
        ("  attention core", f.layer_attention, "QKᵀ and P·V (causal not halved)"),
        ("  lm head", f.lm_head, _head_why(e)),
        ("backward", f.backward, "dX and dW for every matmul (≈ 2× forward; flash attention 2.5×)"),
        ("  flash S recompute", f.kernel_recompute, "the flash backward re-computing QKᵀ (not model FLOPs)"),
        ("recompute", f.recompute, "forward work re-run in backward (checkpointing, reversible)"),
    ]
    for name, value, why in rows:
        add(name, value, why, style="dim" if name[0] == " " else "")
    table.section()
    add("total (hardware)", f.total, "all that runs, for HFU", style="bold")
    skipped = " + the blocks cp skips" if f.cp_skipped else ""
    add(
        "model",
        f.model,
        f"forward + backward without any recompute (flash's S neither){skipped}, for MFU",
        "bold",
    )
    if f.cp_skipped:
        why = "attention blocks the cp ranks' causal split masks wholly: not run, one device counts them"
        add("  cp causal skip", f.cp_skipped, why, style="dim")
    table.section()
    two_n = e.six_n // 3
    views = (
        ("2N·tokens", two_n, f.forward, "forward"),
        ("4N·tokens", 2 * two_n, f.backward, "backward"),
        ("6N·tokens", e.six_n, f.model, "model"),
    )
    for name, rule, exact, what in views:
        ratio = f"exact {what} = {exact / rule:.3f}× this" if rule else ""
        add(name, rule, f"rule of thumb (N active params); {ratio}")
    table.section()
    add(f"per step (× {g})", f.total * g, f"hardware FLOPs × grad-accum {g}")
    add("", f.model * g, f"model FLOPs × grad-accum {g}")
    return table


def estimate_report(e: Result) -> Group:
    """The whole ``memplan estimate`` output: summary, activation inventory, FLOPs."""
    return Group(summary_panel(e), activation_table(e), flops_table(e))
