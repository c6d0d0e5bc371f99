"""Tables that fit the terminal: columns chosen by priority for the width the console gives.

Every table of memplan is described once — its columns (a header, a priority, whether the cells are prose
that may wrap) and its rows of plain cells — and laid out when rich renders it, for the width it is given
(``Console().width``: 80 for a pipe, ``COLUMNS`` when set). The rules, the same for every table:

- a key or number cell is never cut and never wrapped: its column is exactly as wide as its widest cell
  (or header line), ``no_wrap``; a column that does not fit is left out whole, lowest priority first;
- priority 0 columns (the keys: names, the layout) are always shown; prose among them (a compare row's
  error) narrows down to ``NARROWEST`` columns before a key would be cut. NB: a terminal narrower than
  the keys themselves (≈ 40 columns for compare) still cuts them: rich crops what passes the width, and a
  last line says so ("cut at N columns");
- a column whose cells are all empty (``""``, ``"–"``, ``"-"``) is left out; with ``same=True`` a column
  whose cells are all equal is left out and its value said under the table (``ep 1 in every row``);
- prose (``wrap=True``) is shown only when ``min_width`` columns are left for it, and then folds onto more
  lines; a ``below=True`` column that does not fit is drawn under the table, one line per row, after the
  row's key cells (the compare bars);
- the title above and the caption under the table are prose at the console's width; a last line names
  what was left out and the width that shows everything.

Pure: no computing beyond measuring text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.table import Table
from rich.text import Text

EMPTY = frozenset({"", "–", "-"})
EDGE = 1  # the table's left border; each column adds its padding (2) and its right border (1)
PER_COLUMN = 3
NARROWEST = 8


@dataclass(frozen=True)
class Col:
    """One column: its header (may hold a line break: ``"peak\\nGiB"``) and how it gives way."""

    header: str
    justify: str = "right"
    priority: int = 0
    """0: always shown (a key); larger numbers are left out first when the width runs short."""
    wrap: bool = False
    """Prose: folds onto more lines; shown only with at least ``min_width`` columns for it."""
    min_width: int = 20
    words: bool = False
    """Prose whose words are names (aliases): never narrower than its longest word, so none is split."""
    same: bool = False
    """Left out when every row holds the same value, which is then said under the table."""
    below: bool = False
    """When it does not fit, drawn under the table, one line per row, instead of left out."""
    style: str = ""


@dataclass(frozen=True)
class Line:
    """One row: one cell per column, a row style, and whether a section rule follows it."""

    cells: tuple[Text, ...]
    style: str = ""
    end_section: bool = False
    data: bool = True
    """A data row (counted for ``same`` and ``below``), not a heading, total or note row."""


@dataclass
class Fitted:
    """A table laid out for the width it is rendered at (a rich renderable)."""

    cols: Sequence[Col]
    title: str | None = None
    caption: str | None = None
    show_header: bool = True
    lines: list[Line] = field(default_factory=list)

    def add(self, *cells: str | Text, style: str = "", end_section: bool = False, data: bool = True) -> None:
        """A row of cells; strings are plain text (``[b, s, h]`` is data, never rich markup)."""
        if len(cells) != len(self.cols):
            raise ValueError(f"row: {len(cells)} cells for {len(self.cols)} columns")
        texts = tuple(c if isinstance(c, Text) else Text(c) for c in cells)
        self.lines.append(Line(texts, style, end_section, data))

    def section(self) -> None:
        """A rule under the last row."""
        if self.lines:
            last = self.lines[-1]
            self.lines[-1] = Line(last.cells, last.style, True, last.data)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield from self.renderables(options.max_width)

    def renderables(self, width: int) -> list[Table | Text]:
        chosen, dropped, same = layout(self.cols, self.lines, width)
        out: list[Table | Text] = []
        if self.title:
            out.append(Text(self.title, style="italic"))
        out.append(self._table(chosen, width))
        out += self._below([i for i in dropped if self.cols[i].below], chosen)
        if self.caption:
            out.append(Text(self.caption, style="dim"))
        notes = []
        if same:
            shared = " · ".join(f"{self.cols[i].header.replace(chr(10), ' ')} {v}" for i, v in same)
            notes.append(f"same in every row: {shared}")
        left_out = [i for i in dropped if not self.cols[i].below]
        if left_out:
            need = EDGE + sum(_need(self.cols[i], self.lines, i) for i in chosen + dropped)
            names = ", ".join(self.cols[i].header.replace("\n", " ") for i in left_out)
            notes.append(f"not shown at {width} columns: {names} (a terminal of ≥ {need} columns shows them)")
        keys = EDGE + sum(_least(self.cols[i], self.lines, i) for i in chosen)
        if keys > width:  # the keys alone pass the width: rich crops their right end
            names = ", ".join(self.cols[i].header.replace("\n", " ") for i in chosen)
            notes.append(f"cut at {width} columns: {names} (a terminal of ≥ {keys} columns shows them whole)")
        if notes:
            out.append(Text("; ".join(notes), style="dim"))
        return out

    def _table(self, chosen: list[int], width: int) -> Table:
        table = Table(show_header=self.show_header)
        widths = column_widths(self.cols, self.lines, chosen, width)
        for i in chosen:
            c = self.cols[i]
            table.add_column(
                Text(c.header),
                justify=c.justify,  # type: ignore[arg-type]
                style=c.style,
                width=widths[i],
                no_wrap=not c.wrap,
                overflow="fold",
            )
        for line in self.lines:
            table.add_row(*(line.cells[i] for i in chosen), style=line.style, end_section=line.end_section)
        return table

    def _below(self, below: list[int], chosen: list[int]) -> list[Text]:
        keys = [i for i in chosen if self.cols[i].priority == 0 and not self.cols[i].wrap]
        rows = [line for line in self.lines if line.data]
        out: list[Text] = []
        for i in below:
            out.append(Text(self.cols[i].header, style="bold"))
            widths = {k: max(cell_len(r.cells[k].plain) for r in rows) for k in keys}
            for r in rows:
                label = "  ".join(r.cells[k].plain.ljust(widths[k]) for k in keys)
                out.append(Text(label + "  ").append_text(r.cells[i]))
        return out


def text_width(text: str) -> int:
    """The widest line of ``text`` in terminal cells."""
    return max((cell_len(part) for part in text.split("\n")), default=0)


def _natural(col: Col, lines: Sequence[Line], i: int) -> int:
    return max([text_width(col.header)] + [text_width(line.cells[i].plain) for line in lines])


def _need(col: Col, lines: Sequence[Line], i: int) -> int:
    """The columns one column takes: its widest cell, or its minimum for prose; plus padding and rule."""
    natural = _natural(col, lines, i)
    if not col.wrap:
        return natural + PER_COLUMN
    least = col.min_width
    if col.words:
        least = max([least] + [cell_len(w) for line in lines for w in line.cells[i].plain.split()])
    return min(natural, least) + PER_COLUMN


def _least(col: Col, lines: Sequence[Line], i: int) -> int:
    """The fewest columns a shown column can take without a cut: prose narrows to ``NARROWEST``."""
    natural = _natural(col, lines, i)
    return (min(natural, NARROWEST) if col.wrap else natural) + PER_COLUMN


def layout(
    cols: Sequence[Col], lines: Sequence[Line], width: int
) -> tuple[list[int], list[int], list[tuple[int, str]]]:
    """Which columns to show at ``width``: (shown, left out for width, [(column, value) equal in every
    row]); empty columns are neither shown nor reported."""
    data = [line for line in lines if line.data]
    candidates: list[int] = []
    same: list[tuple[int, str]] = []
    for i, c in enumerate(cols):
        values = {line.cells[i].plain for line in data}
        if c.priority > 0 and values <= EMPTY:
            continue
        if c.same and len(values) == 1 and len(data) > 1:
            same.append((i, values.pop()))
            continue
        candidates.append(i)
    used = EDGE + sum(_need(cols[i], lines, i) for i in candidates if cols[i].priority == 0)
    chosen = {i for i in candidates if cols[i].priority == 0}
    dropped = []
    for i in sorted(candidates, key=lambda i: cols[i].priority):
        if i in chosen:
            continue
        need = _need(cols[i], lines, i)
        if used + need <= width:
            chosen.add(i)
            used += need
        else:
            dropped.append(i)
    return sorted(chosen), sorted(dropped), same


def column_widths(
    cols: Sequence[Col], lines: Sequence[Line], chosen: list[int], width: int
) -> dict[int, int]:
    """Each shown column's width: its widest cell; prose columns share what is left, up to their widest."""
    widths = {i: _need(cols[i], lines, i) - PER_COLUMN for i in chosen}
    spare = width - EDGE - sum(w + PER_COLUMN for w in widths.values())
    for i in (i for i in chosen if cols[i].wrap and spare < 0):  # the keys alone pass the width
        give = min(-spare, widths[i] - NARROWEST)
        widths[i] -= max(0, give)
        spare += max(0, give)
    for i in (i for i in chosen if cols[i].wrap):
        grow = max(0, min(spare, _natural(cols[i], lines, i) - widths[i]))
        widths[i] += grow
        spare -= grow
    return widths
