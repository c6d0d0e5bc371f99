"""The step's memory over time (``memplan.timeline``): a terminal chart, one stacked bar per point, and a
plot file (matplotlib, the optional ``plot`` extra) with each term as a band. GiB = 2³⁰ bytes."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Group
from rich.text import Text

from memplan.analytic.peak import TERMS
from memplan.render.estimate import BYTE_UNITS, SEGMENTS, fmt_bytes
from memplan.timeline import Point


def _look(term: str) -> tuple[str, str]:
    """(style, glyph) of a term, as the estimate's memory bar draws it."""
    for label, style, glyph in SEGMENTS:
        if label.endswith(term):
            return style, glyph
    raise ValueError(f"term: {term!r} has no look in render.estimate.SEGMENTS")


def timeline_chart(points: Sequence[Point], width: int) -> Group:
    """One line per point: its label, a bar of its terms stacked in ``TERMS`` order (scaled to the largest
    point), its total. The largest is marked ◀ peak."""
    label_w = max(len(p.label) for p in points)
    total_w = max(len(fmt_bytes(p.bytes)) for p in points)
    bar_w = max(10, width - label_w - total_w - 12)  # 2 + bar + 2 + total + " ◀ peak"
    scale = max(p.bytes for p in points) or 1
    top = max(range(len(points)), key=lambda i: points[i].bytes)
    lines = [Text(f"Memory of the most loaded device over the step ({BYTE_UNITS})", style="bold")]
    for i, p in enumerate(points):
        line = Text(p.label.ljust(label_w) + "  ")
        done, cum = 0, 0
        for term in TERMS:
            cum += p.terms[term]
            end = round(cum * bar_w / scale)
            style, glyph = _look(term)
            line.append(glyph * (end - done), style=style)
            done = end
        line.append(" " * (bar_w - done) + "  " + fmt_bytes(p.bytes).rjust(total_w))
        if i == top:
            line.append(" ◀ peak", style="bold")
        lines.append(line)
    legend = Text("")
    for term in TERMS:
        style, glyph = _look(term)
        legend.append(glyph * 2, style=style).append(f" {term}   ")
    lines.append(legend)
    return Group(*lines)


def write_plot(points: Sequence[Point], path: str, title: str) -> None:
    """A stacked area plot of the points (x: the step's points in order; y: GiB by term) to ``path`` (the
    format from its suffix: .svg, .png, .pdf). Raises a one-line ``ValueError`` without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("plot: matplotlib is not installed; pip install 'memplan[plot]'") from None
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
    fig.savefig(path)
    plt.close(fig)
