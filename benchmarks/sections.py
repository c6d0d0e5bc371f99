"""The generated sections of the docs: a script's table between its start and end markers."""

from __future__ import annotations

from pathlib import Path


def replace_section(doc: Path, start: str, end: str, table: str) -> None:
    """Replace what lies between the line ``start`` and ``end`` in ``doc`` by ``table`` (which ends with a
    newline); the rest of the file is kept as it is."""
    text = doc.read_text(encoding="utf-8")
    before, rest = text.split(start + "\n", 1)
    after = rest.split(end, 1)[1]
    doc.write_text(before + start + "\n" + table + end + after, encoding="utf-8")
