"""Every command's ``--help`` as written. typer's rich mode keeps each later paragraph's source line breaks
(re-wrapped at the terminal's width, every source line a ragged line of its own) and reads ``[...]`` as
rich markup, dropping it; ``cli.common.help_text`` joins each paragraph's lines (examples kept on their
own) and ``cli.common.plain`` escapes the brackets — for every command (``cli.common.unwrap_helps``) and
every option."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import typer.main
from typer.testing import CliRunner

from memplan.cli.app import app
from memplan.cli.common import help_text, unwrap_helps

WIDE = {"COLUMNS": "4000", "NO_COLOR": "1"}  # no paragraph wraps
BRACKETS = re.compile(r"\[[^\[\]]*\]")


def _commands(group: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every command under ``group`` (typer's own click), by the words that invoke it."""
    if hasattr(group, "commands"):
        for name, cmd in group.commands.items():
            yield from _commands(cmd, (*path, name))
    if path:
        yield path, group


COMMANDS = dict(_commands(typer.main.get_command(app)))


def _shown(text: str) -> str:
    """A help text as rich shows it: its escapes undone."""
    return text.replace("\\[", "[")


@pytest.mark.parametrize("path", sorted(COMMANDS), ids=" ".join)
def test_each_paragraph_is_one_line_and_its_brackets_are_shown(path: tuple[str, ...]) -> None:
    cmd = COMMANDS[path]
    result = CliRunner().invoke(app, [*path, "--help"], env=WIDE)
    assert result.exit_code == 0, result.output
    lines = [" ".join(line.replace("│", " ").split()) for line in result.stdout.splitlines()]
    for paragraph in _shown(cmd.help or "").split("\n\n"):
        rows = paragraph.splitlines()
        if any(row[:1].isspace() for row in rows):  # examples: each on its own line
            continue
        joined = " ".join(paragraph.split())
        assert joined in lines, joined  # the whole paragraph on one line of a wide terminal
        # two examples in one unindented paragraph run together into one line ("Example: … Example: …")
        assert joined.count("Example:") <= 1, joined
    flat = " ".join(" ".join(lines).split())
    for param in cmd.params:
        for bracketed in BRACKETS.findall(_shown(getattr(param, "help", None) or "")):
            assert " ".join(bracketed.split()) in flat, (param.name, bracketed)


def test_help_text_joins_paragraphs_and_keeps_examples() -> None:
    source = """First line
    of the summary.

    A paragraph wrapped
    at the source's width, [default: 8].

    Examples:

      memplan fit -m 70b
      memplan fit -m 8b
    """
    assert help_text(source) == (
        "First line of the summary.\n\n"
        "A paragraph wrapped at the source's width, \\[default: 8].\n\n"
        "Examples:\n\n"
        "  memplan fit -m 70b\n  memplan fit -m 8b"
    )


def test_unwrapping_twice_changes_nothing() -> None:
    before = {path: cmd.help for path, cmd in COMMANDS.items()}
    unwrap_helps(app)
    again = dict(_commands(typer.main.get_command(app)))
    assert {path: cmd.help for path, cmd in again.items()} == before
