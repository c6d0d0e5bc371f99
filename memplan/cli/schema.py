"""``memplan schema``: print the JSON Schema of ``memplan estimate --json`` (memplan/schema.py).

Pure Python, no torch: it answers as fast as ``--help``.
"""

from __future__ import annotations

import json

import typer


def register(app: typer.Typer) -> None:
    """Add ``memplan schema`` to ``app``."""

    @app.command("schema")
    def schema(
        compact: bool = typer.Option(False, "--compact", help="One line instead of indented JSON."),
        keys: bool = typer.Option(
            False, "--keys", help="List the dotted keys the contract requires, one a line, instead."
        ),
    ) -> None:
        """Print the JSON Schema (draft 2020-12) that `memplan estimate --json` output validates against."""
        from memplan.schema import contract_keys, estimate_schema  # here: not loaded by other commands

        if keys:
            typer.echo("\n".join(contract_keys()))
            return
        typer.echo(
            json.dumps(estimate_schema(), indent=None if compact else 2, ensure_ascii=False, allow_nan=False)
        )
