"""The ``memplan`` command line: a thin typer app that parses, calls and renders.

Commands: ``estimate`` (memory and FLOPs of one training step), ``presets`` / ``presets show NAME`` and
``gpus``; the measurement and planning commands are registered by ``memplan.cli_measure`` and
``memplan.cli_plan``. Options shared by commands live in ``memplan.cli_common``; rendering in
``memplan.report``. torch is never imported here.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console

from memplan import report
from memplan.analytic.params import count_params
from memplan.cli_common import (
    AttentionChoice,
    AttentionOpt,
    BatchOpt,
    CheckpointingOpt,
    DeviceOpt,
    DpOpt,
    DropoutOpt,
    GradAccumOpt,
    ModelOpt,
    OptimizerOpt,
    PrecisionOpt,
    ReversibleOpt,
    SeqOpt,
    ZeroOpt,
    build_setup,
    handle_user_errors,
    load_model,
    new_app,
)
from memplan.config import Device, Optimizer, Precision
from memplan.estimate import estimate as run_estimate
from memplan.presets import gpu_names, load_gpu, load_model_preset, model_names

app = new_app(
    name="memplan",
    help="Estimate the GPU memory and FLOPs of one transformer training step, per tensor, "
    "and prove it against PyTorch.\n\n"
    "Start with: memplan estimate --model 70b --seq 8192",
)
presets_app = new_app(name="presets", invoke_without_command=True, no_args_is_help=False)
app.add_typer(presets_app, name="presets", help="Model presets: list them, or `presets show NAME`.")

ESTIMATE_HELP = """\
Memory and FLOPs of one training step on one device, per tensor, without torch.

Memory: weights, gradients, optimizer states (master copy included), every activation autograd keeps for
backward, and the peak, in bytes on ONE device (shown as GiB = 2³⁰ bytes). FLOPs: one micro-batch, whole
model, forward / backward / recompute (shown as TFLOP = 10¹², PFLOP = 10¹⁵ FLOP).

Examples:

  memplan estimate --model 70b --seq 8192

  memplan estimate -m llama-3-8b --seq 4096 --batch 4 --checkpointing full --zero 3 --dp 64

  memplan estimate -m gpt2 --seq 1024 --attention eager --dropout 0.1 --precision fp32

  memplan estimate -m ./config.json --seq 2048 --json | jq .memory.peak
"""


def _console() -> Console:
    """A console on the current stdout (created per command so redirected output is honoured)."""
    return Console()


@app.command("estimate", help=ESTIMATE_HELP)
@handle_user_errors
def estimate_command(
    model: ModelOpt = None,
    seq: SeqOpt = None,
    batch: BatchOpt = 1,
    precision: PrecisionOpt = Precision.BF16_MIXED,
    optimizer: OptimizerOpt = Optimizer.ADAMW,
    grad_accum: GradAccumOpt = 1,
    checkpointing: CheckpointingOpt = "none",
    attention: AttentionOpt = AttentionChoice.FLASH,
    reversible: ReversibleOpt = False,
    zero: ZeroOpt = 0,
    dp: DpOpt = 1,
    dropout: DropoutOpt = None,
    device: DeviceOpt = Device.CUDA,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print one JSON object (bytes and FLOPs as integers) and nothing else on stdout",
        ),
    ] = False,
) -> None:
    setup = build_setup(
        model,
        seq=seq,
        batch=batch,
        precision=precision,
        optimizer=optimizer,
        grad_accum=grad_accum,
        checkpointing=checkpointing,
        attention=attention,
        reversible=reversible,
        zero=zero,
        dp=dp,
        dropout=dropout,
        device=device,
    )
    result = run_estimate(setup)
    if as_json:
        typer.echo(json.dumps(result.to_json()))
        return
    _console().print(report.estimate_report(result))


@presets_app.callback()
def presets_command(ctx: typer.Context) -> None:
    """List the model presets: name, aliases, published parameter count, layers, width, heads, source."""
    if ctx.invoked_subcommand is not None:
        return
    with_errors = handle_user_errors(lambda: [load_model_preset(name) for name in model_names()])
    _console().print(report.presets_table(with_errors()))
    from memplan.plan.presets import load_plan_model, moe_names

    moe = [load_plan_model(name).preset for name in moe_names()]
    title = "Mixture-of-experts presets (total parameters; `memplan plan`, `compare` and `fit` read them)"
    _console().print(report.presets_table(moe, title=title))


@presets_app.command("show")
@handle_user_errors
def presets_show(
    name: Annotated[str, typer.Argument(help="Preset name or alias, a preset .toml or a config.json")],
) -> None:
    """One preset's fields and its computed parameter breakdown."""
    preset = load_model(name)
    _console().print(report.preset_detail(preset, count_params(preset.model)))


@app.command("gpus")
@handle_user_errors
def gpus_command() -> None:
    """List the GPU presets: memory (GiB = 2³⁰ bytes), dense peak TFLOP/s, bandwidths, source."""
    _console().print(report.gpus_table([load_gpu(name) for name in gpu_names()]))


def main() -> None:
    """Console-script entry point (``memplan``)."""
    app(prog_name="memplan")


# Sub-command modules add their commands last (they import cli_common, never this module's app).
from memplan import cli_measure, cli_plan, cli_schema  # noqa: E402

cli_measure.register(app)
cli_plan.register(app)
cli_schema.register(app)

if __name__ == "__main__":
    main()
