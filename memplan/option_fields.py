"""How ``memplan.options.Options`` declares a field: its help text, metavar, extra flags and help panel, in
one place (``cli.common`` derives every command's typer options from what these record)."""

from __future__ import annotations

from typing import Any

from pydantic import Field
from pydantic.config import JsonDict


def option(
    description: str,
    panel: str,
    *,
    default: Any = None,
    metavar: str | None = None,
    flags: tuple[str, ...] = (),
    show_default: bool = True,
    **constraints: Any,
) -> Any:
    """An ``Options`` field and how the command line spells it: help text, metavar, extra flags (``-s``),
    help panel; ``cli.common`` derives every command's typer options from these."""
    extra: JsonDict = {"panel": panel, "metavar": metavar, "flags": list(flags), "show_default": show_default}
    return Field(default=default, description=description, json_schema_extra=extra, **constraints)


MODEL, TRAINING, STRATEGY, PARALLEL, GPU = "Model", "Training", "Strategy", "Parallelism", "GPU and time"
FINETUNE = "Fine-tuning"


def tune(description: str, metavar: str | None = None) -> Any:
    """A fine-tuning option without a shown default (None: the setting's default, or not given)."""
    return option(description, FINETUNE, metavar=metavar, show_default=False)
