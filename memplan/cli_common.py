"""Options and error handling shared by every memplan command.

Each common option is defined once, as a typer ``Annotated`` alias (``ModelOpt``, ``SeqOpt``, …) with its
default beside it (``DEFAULT_*``); ``build_setup`` turns their values into a validated ``Setup``.

Every user mistake ends as ONE line on stderr, ``error: <field>: <what is wrong>; <fix>``, and exit code 2,
never a traceback:

- inside a command, wrap the body in ``with user_errors():`` (or decorate it with ``@handle_user_errors``):
  ``ValueError`` (pydantic's ``ValidationError`` included), click/typer ``BadParameter`` and file errors;
- click's own usage errors (a bad int, an unknown choice, an unknown option) are caught by ``MemplanGroup``,
  the group class of memplan's typer apps (``new_app()``), which prints them on one line too.

Pure Python: no torch here (``memplan estimate`` must not load it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import StrEnum
from typing import Annotated, Any, NoReturn, ParamSpec, TypeVar

import typer
from pydantic import ValidationError
from typer.core import TyperGroup

try:  # recent typer ships its own copy of click (typer.BadParameter is one of its exceptions)
    from typer._click.core import Context, Parameter
    from typer._click.exceptions import BadParameter, ClickException, MissingParameter
except ImportError:  # older typer runs on click itself
    from click import BadParameter, ClickException, Context, MissingParameter, Parameter  # type: ignore

from memplan.config import (
    Attention,
    Device,
    ModelConfig,
    Optimizer,
    Precision,
    Setup,
    TrainingConfig,
    parse_checkpointing,
)
from memplan.errors import field_path, one_line_validation_error
from memplan.presets import ModelPreset, load_model_preset

__all__ = [
    "DEFAULT_SEQ",
    "AttentionChoice",
    "AttentionOpt",
    "BatchOpt",
    "CheckpointingOpt",
    "DeviceOpt",
    "DpOpt",
    "DropoutOpt",
    "GradAccumOpt",
    "MemplanGroup",
    "ModelOpt",
    "OptimizerOpt",
    "PrecisionOpt",
    "ReversibleOpt",
    "SeqOpt",
    "ZeroOpt",
    "build_setup",
    "describe_validation_error",
    "fail",
    "handle_user_errors",
    "load_model",
    "new_app",
    "usage_error_line",
    "user_errors",
]

EXIT_USAGE = 2
"""Exit code of every user mistake (click's own code for usage errors)."""

_LISTS = "(`memplan presets` lists them)"


# ----------------------------------------------------------------------------------------------------
# Options (defined once; reuse them as `model: ModelOpt = None`, `batch: BatchOpt = 1`, ...)
# ----------------------------------------------------------------------------------------------------
class AttentionChoice(StrEnum):
    """The ``--attention`` values; ``config.Attention`` is an ordered IntEnum, this is its CLI spelling."""

    EAGER = "eager"
    FLASH = "flash"

    @property
    def attention(self) -> Attention:
        return Attention[self.name]


DEFAULT_SEQ = TrainingConfig().seq_len
"""``--seq`` when not given: 2048 tokens, or the model's context length (max_positions) if shorter."""

_MODEL_PANEL = "Model"
_TRAINING_PANEL = "Training"
_STRATEGY_PANEL = "Strategy"

ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="Model preset name or alias (e.g. 70b, llama-3-8b, gpt2), a preset .toml or a Hugging Face "
        "config.json. Required. `memplan presets` lists them.",
        show_default=False,
        rich_help_panel=_MODEL_PANEL,
    ),
]
DropoutOpt = Annotated[
    float | None,
    typer.Option(
        "--dropout",
        metavar="P",
        help="Dropout probability 0 ≤ P < 1 for attention, residual and embedding dropout "
        "[default: the preset's own]",
        show_default=False,
        rich_help_panel=_MODEL_PANEL,
    ),
]
SeqOpt = Annotated[
    int | None,
    typer.Option(
        "--seq",
        "-s",
        metavar="TOKENS",
        help=f"Tokens per sequence s [default: {DEFAULT_SEQ}, or the model's context length if shorter]",
        show_default=False,
        rich_help_panel=_TRAINING_PANEL,
    ),
]
BatchOpt = Annotated[
    int,
    typer.Option(
        "--batch", "-b", metavar="N", help="Sequences per micro-batch b", rich_help_panel=_TRAINING_PANEL
    ),
]
PrecisionOpt = Annotated[
    Precision,
    typer.Option(
        "--precision",
        case_sensitive=False,
        help="Precision recipe: dtype of weights, gradients, master copy, optimizer states, activations",
        rich_help_panel=_TRAINING_PANEL,
    ),
]
OptimizerOpt = Annotated[
    Optimizer,
    typer.Option("--optimizer", case_sensitive=False, help="Optimizer", rich_help_panel=_TRAINING_PANEL),
]
GradAccumOpt = Annotated[
    int,
    typer.Option(
        "--grad-accum",
        metavar="N",
        help="Micro-batches per optimizer step (gradient accumulation)",
        rich_help_panel=_TRAINING_PANEL,
    ),
]
CheckpointingOpt = Annotated[
    str,
    typer.Option(
        "--checkpointing",
        metavar="none|full|selective|every-K",
        help="Activation checkpointing: none, full (keep each layer's input), selective (recompute the "
        "attention core), every-K (keep one input per K layers)",
        rich_help_panel=_STRATEGY_PANEL,
    ),
]
AttentionOpt = Annotated[
    AttentionChoice,
    typer.Option(
        "--attention",
        case_sensitive=False,
        help="Attention kernel: eager (keeps s×s probabilities) or flash (SDPA flash: q, k, v, out, lse)",
        rich_help_panel=_STRATEGY_PANEL,
    ),
]
ReversibleOpt = Annotated[
    bool,
    typer.Option(
        "--reversible/--no-reversible",
        help="Reversible (RevNet) layers: backward rebuilds each layer's input from its output",
        rich_help_panel=_STRATEGY_PANEL,
    ),
]
ZeroOpt = Annotated[
    int,
    typer.Option(
        "--zero",
        metavar="0-3",
        help="ZeRO stage: 0 none, 1 optimizer states, 2 + gradients, 3 + weights (sharded over --dp)",
        rich_help_panel=_STRATEGY_PANEL,
    ),
]
DpOpt = Annotated[
    int,
    typer.Option("--dp", metavar="N", help="Data-parallel degree (devices)", rich_help_panel=_STRATEGY_PANEL),
]
DeviceOpt = Annotated[
    Device,
    typer.Option(
        "--device",
        case_sensitive=False,
        help="Kernels the step runs on (a few saved tensors differ between cuda and cpu)",
        rich_help_panel=_STRATEGY_PANEL,
    ),
]


# ----------------------------------------------------------------------------------------------------
# Building the Setup
# ----------------------------------------------------------------------------------------------------
def load_model(model: str | None) -> ModelPreset:
    """The preset ``--model`` names; a one-line ``ValueError`` (with suggestions) if missing or unknown."""
    if model is None:
        raise ValueError(f"model: required; pass --model NAME (e.g. --model 70b) or a file path {_LISTS}")
    try:
        return load_model_preset(model)
    except ValueError:
        from memplan.plan.presets import is_moe_preset  # only on this error path

        if is_moe_preset(model):
            raise ValueError(
                f"model: {model} is a mixture-of-experts preset; use `memplan plan --model {model}` "
                "(or compare / fit): estimate, trace and profile describe dense models"
            ) from None
        raise


def build_setup(
    model: str | ModelConfig | None,
    *,
    seq: int | None = None,
    batch: int = 1,
    precision: Precision = Precision.BF16_MIXED,
    optimizer: Optimizer = Optimizer.ADAMW,
    grad_accum: int = 1,
    checkpointing: str = "none",
    attention: AttentionChoice = AttentionChoice.FLASH,
    reversible: bool = False,
    zero: int = 0,
    dp: int = 1,
    dropout: float | None = None,
    device: Device = Device.CUDA,
) -> Setup:
    """A validated ``Setup`` from the common options (the defaults are the options' defaults).

    ``model`` is what ``--model`` names (preset, alias or path) or an already built ``ModelConfig``.
    Raises ``ValueError`` / ``ValidationError``; run it inside ``user_errors()``.
    """
    cfg = model if isinstance(model, ModelConfig) else load_model(model).model
    mode, every = parse_checkpointing(checkpointing)
    model_data: ModelConfig | dict[str, Any] = cfg
    if dropout is not None:
        # Re-validated as a dict so that a bad probability is reported against the model's fields.
        model_data = {
            **cfg.model_dump(),
            "attn_dropout": dropout,
            "resid_dropout": dropout,
            "embd_dropout": dropout,
        }
    return Setup.model_validate(
        {
            "model": model_data,
            "training": {
                "micro_batch": batch,
                "seq_len": seq if seq is not None else min(DEFAULT_SEQ, cfg.max_positions),
                "precision": precision,
                "optimizer": optimizer,
                "grad_accum": grad_accum,
            },
            "strategy": {
                "checkpointing": mode,
                "checkpoint_every": every,
                "attention": attention.attention,
                "reversible": reversible,
                "zero": zero,
                "dp": dp,
            },
            "device": device,
        }
    )


# ----------------------------------------------------------------------------------------------------
# One-line errors
# ----------------------------------------------------------------------------------------------------
# Setup field → (the option's name in messages, how to fix it).
_OPTION_FIXES: dict[str, tuple[str, str]] = {
    "training.seq_len": ("seq", "use --seq N with 1 ≤ N ≤ 16777216, e.g. --seq 4096"),
    "training.micro_batch": ("batch", "use --batch N with 1 ≤ N ≤ 1048576"),
    "training.grad_accum": ("grad-accum", "use --grad-accum N with 1 ≤ N ≤ 1048576"),
    "strategy.zero": ("zero", "use --zero 0, 1, 2 or 3"),
    "strategy.dp": ("dp", "use --dp N with 1 ≤ N ≤ 1048576 data-parallel devices"),
    "strategy.checkpoint_every": ("checkpointing", "use --checkpointing every-K with K ≥ 1"),
    "model.attn_dropout": ("dropout", "use --dropout P with 0 ≤ P < 1"),
    "model.resid_dropout": ("dropout", "use --dropout P with 0 ≤ P < 1"),
    "model.embd_dropout": ("dropout", "use --dropout P with 0 ≤ P < 1"),
}


def _option_error(error: Any) -> str | None:
    """``zero: must be 0, 1, 2 or 3, got 5 (use --zero 0, 1, 2 or 3)`` for a field an option sets."""
    where = _OPTION_FIXES.get(field_path(tuple(error["loc"])))
    if where is None:
        return None
    name, fix = where
    msg = str(error["msg"]).replace("Input should be", "must be")
    return f"{name}: {msg}, got {error.get('input')!r} ({fix})"


def describe_validation_error(exc: ValidationError) -> str:
    """One line for a ``Setup`` validation error, phrased in terms of the CLI options.

    Field errors of a value an option sets name the option and its fix; the config's own checks
    (``value_error``) already read ``field: what; fix``; anything else goes through
    ``errors.one_line_validation_error``.
    """
    errors: list[Any] = list(exc.errors(include_url=False))
    lines: list[str] = []
    for error in errors:
        line = _option_error(error)
        if line is None and error["type"] == "value_error":
            line = str(error["msg"]).removeprefix("Value error, ")
        if line is None:
            return one_line_validation_error(exc, "setup")
        lines.append(line)
    # One message per option: the three dropout fields fail together for one --dropout.
    distinct = list(dict.fromkeys(line.split(":", 1)[0] for line in lines))
    more = f" (+{len(distinct) - 1} more)" if len(distinct) > 1 else ""
    return lines[0] + more


def usage_error_line(exc: ClickException) -> str:
    """click's usage errors on one line: ``precision: 'x' is not one of …; see `memplan estimate --help```."""
    ctx: Context | None = getattr(exc, "ctx", None)
    see = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
    param: Parameter | None = getattr(exc, "param", None)
    if isinstance(exc, BadParameter) and not isinstance(exc, MissingParameter) and param:
        name = (param.name or "value").replace("_", "-")
        # Recent typer converts values with pydantic: drop its "Value error, " and "Input should be".
        msg = exc.message.removeprefix("Value error, ").replace("Input should be", "must be")
        return f"{name}: {msg.rstrip('.')}{see}"
    return f"{exc.format_message().rstrip('.')}{see}"


def fail(message: str) -> NoReturn:
    """Print ``error: <message>`` as one line on stderr and exit with code 2."""
    text = " ".join(message.split())
    typer.echo(text if text.startswith("error: ") else f"error: {text}", err=True)
    raise typer.Exit(EXIT_USAGE)


@contextmanager
def user_errors() -> Iterator[None]:
    """Turn a user mistake raised inside the block into one line on stderr and exit code 2."""
    try:
        yield
    except ValidationError as exc:  # a ValueError: first
        fail(describe_validation_error(exc))
    except ClickException as exc:
        fail(usage_error_line(exc))
    except BrokenPipeError:
        raise
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        fail(f"{where}{exc.strerror or exc}; check the path and permissions")
    except ValueError as exc:
        fail(str(exc) or type(exc).__name__)


P = ParamSpec("P")
R = TypeVar("R")


def handle_user_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorator form of ``user_errors`` for a command function (put it under ``@app.command()``)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with user_errors():
            return fn(*args, **kwargs)
        raise AssertionError("unreachable")  # NB: for mypy; user_errors exits or re-raises

    return wrapper


@contextmanager
def _click_usage_errors() -> Iterator[None]:
    try:
        yield
    except ClickException as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # the help is shown instead: let click do it
            raise
        fail(usage_error_line(exc))


class MemplanGroup(TyperGroup):
    """A typer group whose usage errors (parsing, bad values, unknown commands) print one line, exit 2."""

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: Context | None = None,
        **extra: Any,
    ) -> Context:
        with _click_usage_errors():
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx: Context) -> Any:
        with _click_usage_errors():
            return super().invoke(ctx)


def new_app(**kwargs: Any) -> typer.Typer:
    """A typer app with memplan's conventions: ``MemplanGroup``, no completion install, plain tracebacks."""
    settings: dict[str, Any] = {
        "cls": MemplanGroup,
        "add_completion": False,
        "no_args_is_help": True,
        "pretty_exceptions_enable": False,
        "context_settings": {"help_option_names": ["-h", "--help"]},
    }
    return typer.Typer(**(settings | kwargs))
