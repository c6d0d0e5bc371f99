"""Options and error handling shared by every memplan command.

Each option is declared once, as an ``api.Options`` field (help text, metavar, panel with it); ``OPTIONS``
derives its typer option, ``@with_options(...)`` gives a command those options with ``api.Options``'s
defaults, and ``options_of`` turns their values back into ``api.Options`` (``api.build`` does the rest).

Every user mistake ends as ONE line on stderr, ``error: <field>: <what is wrong>; <fix>``, and exit code 2,
never a traceback:

- inside a command, wrap the body in ``with user_errors():`` (or decorate it with ``@handle_user_errors``):
  ``ValueError`` (pydantic's ``ValidationError`` included), click/typer ``BadParameter`` and file errors;
- click's own usage errors (a bad int, an unknown choice, an unknown option) are caught by ``MemplanGroup``,
  the group class of memplan's typer apps (``new_app()``), which prints them on one line too.

Pure Python: no torch here (``memplan estimate`` must not load it).
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, ParamSpec, TypeVar, cast

import typer
import typer.main
from pydantic import ValidationError
from pydantic.fields import FieldInfo
from typer.core import TyperGroup

try:  # recent typer ships its own copy of click (typer.BadParameter is one of its exceptions)
    from typer._click.core import Context, Parameter
    from typer._click.exceptions import BadParameter, ClickException, MissingParameter
except ImportError:  # older typer runs on click itself
    from click import BadParameter, ClickException, Context, MissingParameter, Parameter  # type: ignore

from memplan.api import Options
from memplan.cli.streams import stream_message
from memplan.config import FINETUNE_OPTIONS
from memplan.errors import describe_validation_error

if TYPE_CHECKING:
    from rich.console import Console


FINETUNE_FLAGS = ("finetune", *FINETUNE_OPTIONS, "double_quant")
"""The fine-tuning options (``--finetune``, the LoRA and QLoRA settings) as ``with_options`` names them."""

EXIT_USAGE = 2
"""Exit code of every user mistake (click's own code for usage errors)."""

_LISTS = "(`memplan presets` lists them)"


# ----------------------------------------------------------------------------------------------------
# Options: derived from api.Options, where each one is declared once
# ----------------------------------------------------------------------------------------------------
_MARKUP_TAG = re.compile(r"(\\*)(\[[a-z#/@][^[]*?])")


def plain(text: str) -> str:
    """Help text shown as written: typer renders help as rich markup, which takes ``[default: 2048]`` or
    ``memplan[plot]`` for a style tag and drops it; a backslash before the bracket keeps it (the rule of
    ``rich.markup.escape``, here without importing rich at start-up)."""
    return _MARKUP_TAG.sub(lambda m: f"{m.group(1)}{m.group(1)}\\{m.group(2)}", text)


def help_text(text: str) -> str:
    """A command's help as typer's rich mode should get it. typer (0.29) joins the lines of the first
    paragraph only and keeps every later line break (``rich_utils._fix_linebreaks``), so a paragraph wrapped
    at the source's width came out wrapped again at the terminal's, each source line a ragged line of its
    own. Here each paragraph's lines are joined, an indented line (an example) kept on its own, and the
    text is ``plain`` (its brackets shown, not read as rich markup)."""
    paragraphs: list[str] = []
    for para in inspect.cleandoc(text).split("\n\n"):
        lines: list[str] = []
        for line in para.split("\n"):
            if lines and line and not line[0].isspace() and not lines[-1][:1].isspace():
                lines[-1] = f"{lines[-1].rstrip()} {line.strip()}"
            else:
                lines.append(line)
        paragraphs.append("\n".join(lines))
    return plain("\n\n".join(paragraphs))


def unwrap_helps(app: typer.Typer) -> None:
    """``help_text`` for every command of ``app`` and of its sub-apps, from its ``help=`` or its
    docstring (what typer would show), once every command is registered. Idempotent: the source is kept
    beside the help (``plain`` escapes again what it escaped before)."""
    for info in app.registered_commands:
        source = getattr(info, "help_source", None)
        if source is None:
            source = info.help if info.help is not None else inspect.getdoc(info.callback)
            info.help_source = source  # type: ignore[attr-defined]
        if source:
            info.help = help_text(source)
    for group in app.registered_groups:
        if group.typer_instance is not None:
            unwrap_helps(group.typer_instance)


def _typer_option(name: str, field: FieldInfo) -> Any:
    """``Annotated[type, typer.Option(...)]`` for an ``api.Options`` field: ``--name`` (``_`` → ``-``) and
    its extra flags, a ``--x/--no-x`` pair for a switch, choices case-insensitive, its help and panel."""
    extra = cast(dict[str, Any], field.json_schema_extra)
    flag = "--" + name.replace("_", "-")
    annotation: Any = field.annotation
    switch = f"{flag}/--no-{flag.removeprefix('--')}"
    # a switch, or a tri-state one (None when neither is given: the setting's own default)
    flags = [switch] if annotation in (bool, bool | None) else [flag, *extra["flags"]]
    if field.is_required():  # --model: None when absent, then a one-line "required" error
        annotation = annotation | None
    option = typer.Option(
        *flags,
        help=plain(field.description or ""),
        metavar=extra["metavar"],
        show_default=extra["show_default"],
        case_sensitive=False,
        rich_help_panel=extra["panel"],
    )
    return Annotated[annotation, option]


OPTIONS: dict[str, Any] = {name: _typer_option(name, f) for name, f in Options.model_fields.items()}
"""Every ``api.Options`` field's typer option, by field name."""

_OUTPUT = "Output"
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print one JSON object and nothing else", rich_help_panel=_OUTPUT)
]
TimelineOpt = Annotated[
    bool,
    typer.Option(
        "--timeline",
        help="Also draw the most loaded device's memory over the step: the forward layer by layer, then "
        "each modelled moment, term by term (profile: with the measured curve over each point)",
        rich_help_panel=_OUTPUT,
    ),
]
PlotOpt = Annotated[
    str | None,
    typer.Option(
        "--plot",
        metavar="FILE",
        help=plain(
            "Write that picture as a plot file (.svg, .png or .pdf; needs pip install 'memplan[plot]'; "
            "profile: the measured and the estimated curve as two lines)"
        ),
        show_default=False,
        rich_help_panel=_OUTPUT,
    ),
]


def option_default(name: str) -> Any:
    """The default of option ``name``: ``api.Options``'s (``--model`` has none: None, then required)."""
    field = Options.model_fields[name]
    return None if field.is_required() else field.default


def with_options(*names: str, **defaults: Any) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Give a command the options ``names`` (fields of ``api.Options``; all of them when none are named)
    before its own parameters, declared once in ``OPTIONS`` with ``api.Options``'s defaults (or the
    command's own, ``defaults``: ``trace`` runs the cpu kernels unless ``--device cuda``).

    The command receives them as keyword arguments: ``def cmd(as_json: JsonOpt = False, **options)``.
    """
    chosen = names or tuple(OPTIONS)

    def wrap(fn: Callable[..., R]) -> Callable[..., R]:
        own = [
            p for p in inspect.signature(fn, eval_str=True).parameters.values() if p.kind is not p.VAR_KEYWORD
        ]
        params = [
            inspect.Parameter(
                n,
                inspect.Parameter.KEYWORD_ONLY,
                default=defaults.get(n, option_default(n)),
                annotation=OPTIONS[n],
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
    """``api.Options`` from a command's option values (those it has; the rest keep their defaults)."""
    fields = {k: v for k, v in values.items() if k in OPTIONS}
    if fields.get("model") is None:
        raise ValueError(f"model: required; pass --model NAME (e.g. --model 70b) or a file path {_LISTS}")
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
        if exc.filename == "stdout":  # cli.streams names stdout's own write errors
            fail(stream_message(exc))
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


def _names(app: typer.Typer) -> dict[str, tuple[list[Any], list[Any]]]:
    """Each command or sub-app of ``app`` by the name it is invoked as: (its commands, its sub-apps)."""
    out: dict[str, tuple[list[Any], list[Any]]] = {}
    for c in app.registered_commands:
        name = c.name or typer.main.get_command_name(getattr(c.callback, "__name__", ""))  # typer's rule
        out.setdefault(name, ([], []))[0].append(c)
    for g in app.registered_groups:
        group = g.name or (g.typer_instance.info.name if g.typer_instance else None)
        out.setdefault(group or "", ([], []))[1].append(g)
    return out


def only_invoked(app: typer.Typer, args: Sequence[str]) -> typer.Typer:
    """``app`` with only the command ``args`` invoke, when they start with one (``estimate …``).

    On every run typer turns each registered command into a click command, parsing its signature and
    building each of its options (memplan's commands have dozens); the command run needs only its own.
    The app itself (its callback, settings, the command's help and errors) is unchanged; anything else
    (``--help``, ``--version``, no command, an unknown one) gets the whole app, so listings and "did you
    mean" suggestions name every command."""
    found = _names(app).get(args[0]) if args else None
    if found is None:
        return app
    narrow = copy.copy(app)
    narrow.registered_commands, narrow.registered_groups = found
    return narrow


def console() -> Console:
    """A rich console on the current stdout (created per command, so redirected output is honoured).

    rich's console and tables are imported here, on first use, not with the CLI: ``--json`` and the
    commands that print no table never load them (start-up, see docs/benchmarks.md)."""
    from rich.console import Console

    return Console()


PLOT_SUFFIXES = (".svg", ".png", ".pdf")
"""The plot files ``--plot`` writes (matplotlib's savefig picks the format from the suffix)."""


def check_writable(option: str, path: str) -> None:
    """Fail before the run, not after it, when the output file cannot be written."""
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise ValueError(f"{option}: {path} is a directory; give a file name, e.g. --{option} trace.json")
    if not folder.is_dir() or not os.access(folder, os.W_OK):
        raise ValueError(f"{option}: cannot write to {folder}; give a path in an existing, writable folder")


def check_plot(path: str) -> None:
    """``check_writable`` for ``--plot``, and a suffix that names the format: matplotlib picks it from the
    suffix (and writes PNG bytes under any name without one)."""
    check_writable("plot", path)
    if Path(path).suffix.lower() not in PLOT_SUFFIXES:
        raise ValueError(
            f"plot: {path} does not end in {', '.join(PLOT_SUFFIXES)}; name the format, e.g. --plot step.svg"
        )
