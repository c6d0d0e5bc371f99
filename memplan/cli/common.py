"""Options and error handling shared by every memplan command.

Each option is declared once, as a typer ``Annotated`` alias (``ModelOpt``, ``SeqOpt``, …) in ``OPTIONS``,
keyed by its ``api.Options`` field, whose default it takes; ``@with_options(...)`` gives a command those
options and ``options_of`` turns their values into ``api.Options`` (``api.build`` does the rest).

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
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Annotated, Any, NoReturn, ParamSpec, TypeVar

import typer
from pydantic import ValidationError
from typer.core import TyperGroup

try:  # recent typer ships its own copy of click (typer.BadParameter is one of its exceptions)
    from typer._click.core import Context, Parameter
    from typer._click.exceptions import BadParameter, ClickException, MissingParameter
except ImportError:  # older typer runs on click itself
    from click import BadParameter, ClickException, Context, MissingParameter, Parameter  # type: ignore

from memplan.api import DEFAULT_SEQ, Options
from memplan.config import AttentionChoice, Device, Optimizer, Precision
from memplan.errors import describe_validation_error
from memplan.time.defaults import DEFAULT_MFU

EXIT_USAGE = 2
"""Exit code of every user mistake (click's own code for usage errors)."""

_LISTS = "(`memplan presets` lists them)"


# ----------------------------------------------------------------------------------------------------
# Options (defined once; reuse them as `model: ModelOpt = None`, `batch: BatchOpt = 1`, ...)
# ----------------------------------------------------------------------------------------------------
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
DeviceOpt = Annotated[
    Device,
    typer.Option(
        "--device",
        case_sensitive=False,
        help="Kernels the step runs on (a few saved tensors differ between cuda and cpu)",
        rich_help_panel=_STRATEGY_PANEL,
    ),
]


_PARALLEL = "Parallelism"
_GPU = "GPU and time"
_OUTPUT = "Output"

TpOpt = Annotated[
    int, typer.Option("--tp", metavar="N", help="Tensor-parallel degree t", rich_help_panel=_PARALLEL)
]
SpOpt = Annotated[
    bool,
    typer.Option(
        "--sp/--no-sp", help="Sequence parallelism over the tensor-parallel ranks", rich_help_panel=_PARALLEL
    ),
]
PpOpt = Annotated[
    int, typer.Option("--pp", metavar="N", help="Pipeline stages p (1F1B)", rich_help_panel=_PARALLEL)
]
VppOpt = Annotated[
    int,
    typer.Option(
        "--vpp",
        metavar="M",
        help="Virtual stages per pipeline rank (interleaved 1F1B)",
        rich_help_panel=_PARALLEL,
    ),
]
EpOpt = Annotated[
    int,
    typer.Option(
        "--ep", metavar="N", help="Expert-parallel degree (MoE; ranks from dp)", rich_help_panel=_PARALLEL
    ),
]
DpOpt = Annotated[
    int | None,
    typer.Option(
        "--dp",
        metavar="N",
        help="Data-parallel degree [default: --gpus / (tp·pp), else 1]",
        show_default=False,
        rich_help_panel=_PARALLEL,
    ),
]
GpusOpt = Annotated[
    int | None,
    typer.Option(
        "--gpus",
        metavar="N",
        help="Devices in all: tp · pp · dp",
        show_default=False,
        rich_help_panel=_PARALLEL,
    ),
]
GlobalBatchOpt = Annotated[
    int | None,
    typer.Option(
        "--global-batch",
        metavar="B",
        help="Sequences per optimizer step; micro-batches per step = B / (batch · dp)",
        show_default=False,
        rich_help_panel=_PARALLEL,
    ),
]
GradAccumOpt = Annotated[
    int | None,
    typer.Option(
        "--grad-accum",
        metavar="N",
        help="Micro-batches per step (the pipeline's, or gradient accumulation) [default: 1]",
        show_default=False,
        rich_help_panel=_PARALLEL,
    ),
]
GpuOpt = Annotated[
    str | None,
    typer.Option(
        "--gpu",
        metavar="NAME",
        help="GPU preset: marks fit / not fit, gives the time (`memplan gpus`)",
        show_default=False,
        rich_help_panel=_GPU,
    ),
]
MfuOpt = Annotated[
    float | None,
    typer.Option(
        "--mfu",
        metavar="F",
        help=f"Assumed model FLOPs utilisation for the step time [default: {DEFAULT_MFU}]",
        show_default=False,
        rich_help_panel=_GPU,
    ),
]
StepTimeOpt = Annotated[
    float | None,
    typer.Option(
        "--step-time",
        metavar="S",
        help="Measured seconds per step: gives the achieved MFU and HFU instead",
        show_default=False,
        rich_help_panel=_GPU,
    ),
]
TokensOpt = Annotated[
    float | None,
    typer.Option(
        "--tokens",
        metavar="T",
        help="Training tokens (e.g. 300e9): gives the training days",
        show_default=False,
        rich_help_panel=_GPU,
    ),
]
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print one JSON object and nothing else", rich_help_panel=_OUTPUT)
]


# Every ``api.Options`` field's option, by field name: the one declaration each command's options come from.
OPTIONS: dict[str, Any] = {
    "model": ModelOpt,
    "seq": SeqOpt,
    "batch": BatchOpt,
    "precision": PrecisionOpt,
    "optimizer": OptimizerOpt,
    "grad_accum": GradAccumOpt,
    "global_batch": GlobalBatchOpt,
    "checkpointing": CheckpointingOpt,
    "attention": AttentionOpt,
    "reversible": ReversibleOpt,
    "zero": ZeroOpt,
    "dp": DpOpt,
    "gpus": GpusOpt,
    "tp": TpOpt,
    "sp": SpOpt,
    "pp": PpOpt,
    "vpp": VppOpt,
    "ep": EpOpt,
    "dropout": DropoutOpt,
    "device": DeviceOpt,
    "gpu": GpuOpt,
    "mfu": MfuOpt,
    "step_time": StepTimeOpt,
    "tokens": TokensOpt,
}


def option_default(name: str) -> Any:
    """The default of option ``name``: ``api.Options``'s (``--model`` has none: None, then required)."""
    field = Options.model_fields[name]
    return None if field.is_required() else field.default


def with_options(*names: str) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Give a command the options ``names`` (fields of ``api.Options``; all of them when none are named)
    before its own parameters, declared once in ``OPTIONS`` with ``api.Options``'s defaults.

    The command receives them as keyword arguments: ``def cmd(as_json: JsonOpt = False, **options)``.
    """
    chosen = names or tuple(OPTIONS)

    def wrap(fn: Callable[..., R]) -> Callable[..., R]:
        own = [
            p for p in inspect.signature(fn, eval_str=True).parameters.values() if p.kind is not p.VAR_KEYWORD
        ]
        params = [
            inspect.Parameter(
                n, inspect.Parameter.KEYWORD_ONLY, default=option_default(n), annotation=OPTIONS[n]
            )
            for n in chosen
        ]
        params += [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]

        @functools.wraps(fn)
        def command(**kwargs: Any) -> R:
            return fn(**kwargs)

        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return wrap


def options_of(values: dict[str, Any]) -> Options:
    """``api.Options`` from a command's option values (``--tokens`` read as a float: 300e9 works)."""
    fields = {k: v for k, v in values.items() if k in OPTIONS}
    if fields.get("model") is None:
        raise ValueError(f"model: required; pass --model NAME (e.g. --model 70b) or a file path {_LISTS}")
    if fields.get("tokens") is not None:
        from memplan.time.timing import check_time_inputs

        check_time_inputs(None, None, fields["tokens"])
        fields["tokens"] = int(fields["tokens"])
    return Options(**fields)


# ----------------------------------------------------------------------------------------------------
# One-line errors
# ----------------------------------------------------------------------------------------------------
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
