"""``memplan schema``: print the JSON Schema of a command's ``--json`` output (memplan/schema/:
estimate.py for ``estimate``, commands.py for ``compare``, ``fit``, ``trace`` and ``profile``).

Pure Python, no torch: it answers as fast as ``--help``.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from memplan.cli.common import handle_user_errors


def register(app: typer.Typer) -> None:
    """Add ``memplan schema`` to ``app``."""

    @app.command("schema")
    @handle_user_errors
    def schema(
        command: Annotated[
            str,
            typer.Option(
                "--command",
                "-c",
                metavar="estimate|compare|fit|trace|profile",
                help="Whose --json output: estimate (also `plan`), compare, fit, trace or profile "
                "(profile's schema covers --nproc's output too). Each schema holds the estimate's "
                "object under $defs.estimate.",
            ),
        ] = "estimate",
        compact: bool = typer.Option(False, "--compact", help="One line instead of indented JSON."),
        keys: bool = typer.Option(
            False,
            "--keys",
            help="List the dotted keys the estimate's contract requires, one a line, instead.",
        ),
    ) -> None:
        """Print the JSON Schema (draft 2020-12) that a command's `--json` output validates against
        (`memplan estimate --json` by default; --command names another)."""
        from memplan.schema import command_schema, contract_keys  # here: not loaded by other commands

        document = command_schema(command)
        if keys:
            typer.echo("\n".join(contract_keys()))
            return
        typer.echo(json.dumps(document, indent=None if compact else 2, ensure_ascii=False, allow_nan=False))
