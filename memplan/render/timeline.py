"""The step's memory over time (``memplan.timeline``): a terminal chart, one stacked bar per point, and a
plot file (matplotlib, the optional ``plot`` extra) with each term as a band. ``profile --timeline`` marks
the measured curve on each bar; ``profile --plot`` draws the measured curve and the estimate as two lines.
GiB = 2³⁰ bytes. A plot file is written whole or not at all (``memplan.files``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Group
from rich.text import Text

from memplan.analytic.peak import TERMS
from memplan.files import write_with
from memplan.render.estimate import BYTE_UNITS, SEGMENTS, fmt_bytes
from memplan.timeline import Point


def _look(term: str) -> tuple[str, str]:
    """(style, glyph) of a term, as the estimate's memory bar draws it."""
    for label, style, glyph in SEGMENTS:
        if label.endswith(term):
            return style, glyph
    raise ValueError(f"term: {term!r} has no look in render.estimate.SEGMENTS")


def timeline_chart(
    points: Sequence[Point], width: int, measured: Sequence[int | None] | None = None
) -> Group:
    """One line per point: its label, a bar of its terms stacked in ``TERMS`` order (scaled to the largest
    point), its total. The largest is marked ◀ peak. With ``measured`` (``profile --timeline``: the measured
    curve read at each point, None where it has no reading) a ┃ marks the measured bytes on the bar and
    the measured total follows the estimated one."""
    label_w = max(len(p.label) for p in points)
    total_w = max(len(fmt_bytes(p.bytes)) for p in points)
    meas = [None if m is None else fmt_bytes(m) for m in measured] if measured is not None else None
    meas_w = 0 if meas is None else max(len("measured"), *(len(m or "–") for m in meas)) + 2
    bar_w = max(10, width - label_w - total_w - meas_w - 12)  # 2 + bar + 2 + total (+ measured) + " ◀ peak"
    scale = max([p.bytes for p in points] + [m for m in measured or () if m is not None]) or 1
    top = max(range(len(points)), key=lambda i: points[i].bytes)
    lines = [Text(f"Memory of the most loaded device over the step ({BYTE_UNITS})", style="bold")]
    if meas is not None:
        lines.append(
            Text(" " * (label_w + bar_w + 4) + "estimated".rjust(total_w) + "measured".rjust(meas_w))
        )
    for i, p in enumerate(points):
        line = Text(p.label.ljust(label_w) + "  ")
        line.append_text(_bar(p, bar_w, scale, None if measured is None else measured[i]))
        line.append("  " + fmt_bytes(p.bytes).rjust(total_w))
        if meas is not None:
            line.append((meas[i] or "–").rjust(meas_w))
        if i == top:
            line.append(" ◀ peak", style="bold")
        lines.append(line)
    legend = Text("")
    for term in TERMS:
        style, glyph = _look(term)
        legend.append(glyph * 2, style=style).append(f" {term}   ")
    if measured is not None:
        legend.append(MEASURED, style=MEASURED_STYLE).append(" measured")
    lines.append(legend)
    return Group(*lines)


MEASURED, MEASURED_STYLE = "┃", "bold red"
"""The measured curve's mark on a point's bar."""


def _bar(p: Point, bar_w: int, scale: int, measured: int | None) -> Text:
    """The point's terms stacked over ``bar_w`` columns (``scale`` bytes fill it), padded to the width;
    the measured bytes, if any, marked at their column."""
    bar = Text("")
    done, cum = 0, 0
    for term in TERMS:
        cum += p.terms[term]
        end = round(cum * bar_w / scale)
        style, glyph = _look(term)
        bar.append(glyph * (end - done), style=style)
        done = end
    bar.append(" " * (bar_w - done))
    if measured is None:
        return bar
    col = min(bar_w - 1, max(0, round(measured * bar_w / scale) - 1))
    return Text.assemble(bar[:col], (MEASURED, MEASURED_STYLE), bar[col + 1 :])


def write_plot(points: Sequence[Point], path: str, title: str) -> None:
    """A stacked area plot of the points (x: the step's points in order; y: GiB by term) to ``path`` (the
    format from its suffix: .svg, .png, .pdf). Raises a one-line ``ValueError`` without matplotlib."""
    plt = pyplot()
    xs = list(range(len(points)))
    bands = [[p.terms[t] / 2**30 for p in points] for t in TERMS]
    colors = {"blue": "tab:blue", "magenta": "tab:purple", "yellow": "tab:olive", "green": "tab:green"}
    fig, ax = plt.subplots(figsize=(11, 5))
    ax.stackplot(xs, bands, labels=list(TERMS), colors=[colors.get(_look(t)[0], "tab:red") for t in TERMS])
    ax.set_xticks(xs, [p.label for p in points], rotation=40, ha="right", fontsize=8)
    ax.set_ylabel("GiB (2³⁰ bytes) on the most loaded device")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    try:
        write_with(path, "plot", fig.savefig)  # whole or not at all (memplan/files.py)
    finally:
        plt.close(fig)


def write_profile_plot(
    points: Sequence[Point], samples: Sequence[int], at: Sequence[int | None], path: str, title: str
) -> None:
    """Two lines over the measured step (x: the measured curve's samples, one per op on CPU, one per
    allocator event on CUDA; y: GiB): the measured live bytes, and the estimate's points placed where the
    curve was read for them (``at``; points without a reading are left out)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(11, 5))
    ax.plot(range(len(samples)), [b / 2**30 for b in samples], label="measured", color="tab:red", lw=1)
    placed = [(x, p) for x, p in zip(at, points, strict=True) if x is not None]
    ax.plot(
        [x for x, _ in placed],
        [p.bytes / 2**30 for _, p in placed],
        label="estimated",
        color="tab:blue",
        marker="o",
        lw=1,
    )
    for x, p in placed:
        ax.annotate(
            p.label, (x, p.bytes / 2**30), fontsize=7, rotation=30, xytext=(3, 4), textcoords="offset points"
        )
    ax.set_xlabel("measured step (samples: one per op on CPU, one per allocator event on CUDA)")
    ax.set_ylabel("GiB (2³⁰ bytes) on the device")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    try:
        write_with(path, "plot", fig.savefig)  # whole or not at all (memplan/files.py)
    finally:
        plt.close(fig)


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend; a one-line ``ValueError`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("plot: matplotlib is not installed; pip install 'memplan[plot]'") from None
    return plt
