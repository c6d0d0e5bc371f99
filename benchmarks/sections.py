"""The generated sections of the docs: a script's table between its start and end markers."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path


def replace_section(doc: Path, start: str, end: str, table: str) -> None:
    """Replace what lies between the line ``start`` and ``end`` in ``doc`` by ``table`` (which ends with a
    newline); the rest of the file is kept as it is."""
    text = doc.read_text(encoding="utf-8")
    before, rest = text.split(start + "\n", 1)
    after = rest.split(end, 1)[1]
    doc.write_text(before + start + "\n" + table + end + after, encoding="utf-8")


def section_main(
    argv: list[str] | None, doc_line: str, doc: Path, start: str, end: str, table: Callable[[], str]
) -> int:
    """A table script's command line: print ``table()``; with ``--write`` also put it in ``doc``'s section."""
    ap = argparse.ArgumentParser(description=doc_line)
    ap.add_argument("--write", action="store_true", help=f"replace the generated table in {doc.name}")
    args = ap.parse_args(argv)
    text = table()
    sys.stdout.write(text)
    if args.write:
        replace_section(doc, start, end, text)
    return 0
