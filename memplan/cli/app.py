"""The ``memplan`` command line: a thin typer app that parses, calls and renders.

Commands: ``estimate`` (alias ``plan``: memory and FLOPs of one training step on any layout),
``presets`` / ``presets show NAME`` and ``gpus``; the measurement and search commands are registered by
``memplan.cli.measure`` and ``memplan.cli.search``. Options are declared once in ``memplan.cli.common``;
computing goes through ``memplan.api``, rendering lives in ``memplan.render``. torch is never imported
here.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer

from memplan.api import build, load_model, to_json
from memplan.cli import streams
from memplan.cli.common import (
    JsonOpt,
    PlotOpt,
    TimelineOpt,
    check_plot,
    console,
    handle_user_errors,
    new_app,
    only_invoked,
    options_of,
    unwrap_helps,
    with_options,
)
from memplan.presets import gpu_names, load_gpu, load_model_preset, model_names

if TYPE_CHECKING:
    from memplan.timeline import Point

# NB: rich, memplan.render and memplan.timeline are imported where they are used, so that `estimate
# --json` never loads rich's tables and `estimate` only what it shows (start-up, docs/benchmarks.md).

app = new_app(
    name="memplan",
    help="Estimate the GPU memory and FLOPs of one transformer training step, per tensor, "
    "and prove it against PyTorch.\n\n"
    "Start with: memplan estimate --model 70b --seq 8192",
)
presets_app = new_app(name="presets", invoke_without_command=True, no_args_is_help=False)
app.add_typer(presets_app, name="presets", help="Model presets: list them, or `presets show NAME`.")

ESTIMATE_HELP = """\
Memory and FLOPs of one training step, per tensor, per device, without torch.

Memory: weights, gradients, optimizer states (master copy included), every activation autograd keeps for
backward, and the peak, in bytes on the most loaded device (shown as GiB = 2³⁰ bytes). FLOPs: one
micro-batch, whole model, forward / backward / recompute (shown as TFLOP = 10¹², PFLOP = 10¹⁵ FLOP).

One device is the default layout; tensor (--tp), sequence (--sp), pipeline (--pp, --vpp), expert (--ep)
and data parallelism (--dp or --gpus, with --zero) split it (the first pipeline stage holds pp micro-batches
in flight). Dense and mixture-of-experts models alike (mixtral-8x7b, qwen1.5-moe-a2.7b, qwen3-30b-a3b, or
a mixtral / qwen2_moe / qwen3_moe config.json). With --gpu: whether it fits and how long a step takes.
`memplan plan` is the same command.

Examples:

  memplan estimate --model 70b --seq 8192

  memplan estimate -m llama-3-8b --seq 4096 --batch 4 --checkpointing full --zero 3 --dp 64

  memplan estimate -m mixtral-8x7b --seq 4096

  memplan estimate -m gpt3-175b --seq 2048 --tp 8 --sp --pp 8 --gpus 1024 --global-batch 1536 --gpu a100

  memplan estimate -m ./config.json --seq 2048 --json | jq .memory.peak
"""


def _version(value: bool) -> None:
    if value:
        from memplan import __version__

        typer.echo(f"memplan {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    version: Annotated[
        bool | None,
        typer.Option("--version", callback=_version, is_eager=True, help="Print memplan's version and exit"),
    ] = None,
) -> None:
    """Estimate the GPU memory and FLOPs of one transformer training step, per tensor, and prove it against
    PyTorch."""


SummaryOpt = Annotated[
    bool,
    typer.Option(
        "--summary",
        help="Print the verdict panel alone: fits or not, the GPUs it needs, the peak's largest terms and "
        "the commands that make it fit",
        rich_help_panel="Output",
    ),
]


@app.command("estimate", help=ESTIMATE_HELP)
@handle_user_errors
@with_options()
def estimate_command(
    as_json: JsonOpt = False,
    summary: SummaryOpt = False,
    timeline: TimelineOpt = False,
    plot: PlotOpt = None,
    **options: Any,
) -> None:
    if plot is not None:
        check_plot(plot)  # before any work: nothing half-written
    if summary and (as_json or timeline):
        raise ValueError("summary: prints the verdict panel alone; drop --json or --timeline (or --summary)")
    from memplan.advice import advise

    built = build(options_of(options))
    advice = advise(built)
    points: list[Point] = []
    if timeline or plot:
        from memplan.timeline import timeline as timeline_points

        points = timeline_points(built.result)
    if plot is not None:
        from memplan.render.timeline import write_plot

        write_plot(points, plot, f"{built.result.setup.model.name}: one training step")
    if as_json:
        out = to_json(built)
        out["verdict"] = advice.to_json()
        out["notes"] = advice.notes
        if timeline:
            out["timeline"] = [{"label": p.label, "bytes": p.bytes, **p.terms} for p in points]
        typer.echo(json.dumps(out, allow_nan=False))
        return
    from memplan.render.plan import step_report
    from memplan.render.verdict import verdict_panel

    screen = console()
    screen.print(verdict_panel(advice))
    if summary:
        return
    screen.print(step_report(built))
    if timeline:
        from memplan.render.timeline import timeline_chart

        screen.print(timeline_chart(points, screen.width))


app.command("plan", help="Same as `memplan estimate` (its former name for parallel layouts).")(
    estimate_command
)


@presets_app.callback()
def presets_command(ctx: typer.Context) -> None:
    """List the model presets: name, aliases, published parameter count, layers, width, heads, source."""
    if ctx.invoked_subcommand is not None:
        return
    from memplan.render.presets import presets_table

    with_errors = handle_user_errors(lambda: [load_model_preset(name) for name in model_names()])
    console().print(presets_table(with_errors()))


@presets_app.command("show")
@handle_user_errors
def presets_show(
    name: Annotated[str, typer.Argument(help="Preset name or alias, a preset .toml or a config.json")],
) -> None:
    """One preset's fields and its computed parameter breakdown."""
    from memplan.analytic.params import count_params
    from memplan.render.presets import preset_detail

    preset = load_model(name)
    console().print(preset_detail(preset, count_params(preset.model)))


@app.command("gpus")
@handle_user_errors
def gpus_command() -> None:
    """List the GPU presets: memory (GiB = 2³⁰ bytes), dense peak TFLOP/s, bandwidths, source."""
    from memplan.render.presets import gpus_table

    console().print(gpus_table([load_gpu(name) for name in gpu_names()]))


def main() -> None:
    """Console-script entry point (``memplan``): the app narrowed to the command invoked (see
    ``cli.common.only_invoked``: typer would otherwise build every command's options on each run), with
    the terminal's environment and stdout made safe first and stdout's last flush checked
    (``cli.streams``)."""
    streams.prepare()
    code: Any = 0
    try:
        only_invoked(app, sys.argv[1:])(prog_name="memplan")
    except SystemExit as exc:
        code = exc.code
    except OSError as exc:  # stdout failed outside a command's own error handling (--help > /dev/full)
        if exc.filename != "stdout":
            raise
        print(f"error: {streams.stream_message(exc)}", file=sys.stderr)
        code = streams.EXIT_STREAM
    sys.exit(streams.finish(code))


# Sub-command modules add their commands last (they import cli.common, never this module's app).
from memplan.cli import calibrate, measure, schema, search, trace  # noqa: E402

trace.register(app)
measure.register(app)
calibrate.register(app)
search.register(app)
schema.register(app)
unwrap_helps(app)  # every command's help as one line a paragraph (cli.common.help_text)

if __name__ == "__main__":
    main()
