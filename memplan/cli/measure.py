"""``memplan profile``: the estimate set beside a real step's own accounting (``memplan trace``, the
fake-tensor twin: ``cli.trace``), and what both take: the run options, torch's presence.

torch is imported inside the commands only, so ``memplan estimate`` never loads it.
"""

from __future__ import annotations

import importlib.util
import json
from typing import TYPE_CHECKING, Annotated, Any

import typer

from memplan.api import setup_of
from memplan.cli.common import (
    PlotOpt,
    TimelineOpt,
    check_plot,
    check_writable,
    console,
    fail,
    options_of,
    plain,
    user_errors,
    with_options,
)
from memplan.cli.nproc import LAYOUT_OPTIONS, check_memory
from memplan.cli.progress import Bar
from memplan.config import Device, Setup
from memplan.engine import estimate

if TYPE_CHECKING:
    from memplan.engine import Result
    from memplan.measure.instruments.tracker import Curve

# NB: rich, memplan.render and memplan.measure are imported inside the commands: `memplan estimate`
# imports this module (to register trace and profile) and must not pay for their progress bars and
# tables (start-up).

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object (estimated, measured, diff)")]
INSTALL = (
    "torch is not installed: pip install 'memplan[profile]' (or pip install torch==2.13.0 for the CPU build)"
)


def torch_available() -> bool:
    """Whether torch can be imported, without importing it (``memplan estimate`` never loads it)."""
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):  # ValueError: sys.modules["torch"] is None or has no spec
        return False


def torch_or_fail() -> None:
    if not torch_available():
        fail(INSTALL)


# The options the reference model runs with on one process (trace: also the ZeRO sharding of the states).
RUN_OPTIONS = (
    "model",
    "seq",
    "batch",
    "precision",
    "optimizer",
    "grad_accum",
    "checkpointing",
    "attention",
    "reversible",
    "dropout",
    "loss",
    "fp8",
)


DeviceRunOpt = Annotated[
    str | None,
    typer.Option(
        "--device", help=plain("Where to run: cuda (when available) or cpu [default: cuda if available]")
    ),
]


@with_options(*RUN_OPTIONS, *LAYOUT_OPTIONS, "cp", "cp_rotate", "cp_rank")
def profile(
    device: DeviceRunOpt = None,
    nproc: Annotated[
        int | None,
        typer.Option(
            "--nproc",
            min=1,
            max=64,
            help="Run the layout (--tp, --sp, --pp with 1F1B over --grad-accum micro-batches, --zero; "
            "dp = N / (tp · pp)) in N processes with torch.distributed (gloo on CPU, NCCL on CUDA; or under "
            "torchrun) and compare every rank with the estimate of its stage; with --checkpointing, --fp8, "
            "--precision fsdp2-mixed (FSDP2's mixed precision) and mixtures of experts (no --tp) too",
        ),
    ] = None,
    steps: Annotated[int, typer.Option("--steps", min=1, max=1000, help="Measured steps")] = 2,
    warmup: Annotated[int, typer.Option("--warmup", min=0, max=1000, help="Warm-up steps")] = 1,
    torch_trace: Annotated[str | None, typer.Option("--torch-trace", help="Write a Chrome trace")] = None,
    memory_snapshot: Annotated[
        str | None, typer.Option("--memory-snapshot", help="Write a CUDA memory snapshot (CUDA only)")
    ] = None,
    as_json: JsonOpt = False,
    timeline: TimelineOpt = False,
    plot: PlotOpt = None,
    **options: Any,
) -> None:
    """Run real training steps of the reference model and set peak memory, saved bytes, FLOPs and time
    beside the estimate. Peak on CUDA from the caching allocator, on CPU from a live-storage tracker.
    With --nproc N: N ranks of a tensor/sequence/pipeline-parallel and ZeRO layout (docs/distributed.md).

    With --cp C: one context-parallel rank (--cp-rank, default 0) in this process (torch's ring over a fake
    process group, on CPU or a GPU), against the estimate of that rank.

    Examples:

      memplan profile --model tiny --device cpu --seq 256 --timeline

      memplan profile --model tiny --device cpu --seq 32 --nproc 4 --tp 2 --zero 3

      memplan profile --model tiny --device cpu --seq 32 --nproc 2 --zero 3 --precision fsdp2-mixed

      memplan profile --model tiny --device cpu --seq 512 --cp 4 --cp-rank 3
    """
    with user_errors():
        torch_or_fail()
        from memplan.cli.nproc import check_single, profile_distributed
        from memplan.measure.distributed.launch.torchrun import torchrun_world
        from memplan.measure.runs import profile as prof_mod

        dev = prof_mod.resolve_device(device)
        nproc = nproc or torchrun_world()
        if options.get("precision") == "fsdp2-mixed" and nproc is None:  # FSDP2 shards over ranks
            raise ValueError(
                "precision: fsdp2-mixed is FSDP2's mixed precision, which runs in ranks: add --nproc N "
                "--zero 3 (or 2), or use --precision bf16-mixed for one process"
            )
        cp = options.get("cp", 1)
        if cp > 1 and nproc is not None:
            raise ValueError("cp: profile --cp runs one context-parallel rank in this process; drop --nproc")
        if nproc is not None:
            for flag, value in (
                ("torch-trace", torch_trace),
                ("memory-snapshot", memory_snapshot),
                ("timeline", timeline),
                ("plot", plot),
            ):
                if value:  # the one-process records: refused, not silently left out
                    raise ValueError(
                        f"{flag}: recorded by the one-process run only; drop --{flag} or run without --nproc"
                    )
            profile_distributed(nproc, dev, as_json, options)
            return
        check_single(options)
        if memory_snapshot and not dev.startswith("cuda"):
            raise ValueError("memory-snapshot: CUDA memory snapshots need --device cuda")
        if memory_snapshot and (timeline or plot):
            raise ValueError(
                "memory-snapshot: the measured curve records the allocator's history itself; "
                "drop --memory-snapshot or --timeline/--plot"
            )
        for option, path in (("torch-trace", torch_trace), ("memory-snapshot", memory_snapshot)):
            if path is not None:
                check_writable(option, path)
        if plot is not None:
            check_plot(plot)
            from memplan.render.timeline import pyplot

            pyplot()  # before any work: without matplotlib, one line and nothing run
        kernels = Device.CUDA if dev.startswith("cuda") else Device.CPU
        if cp > 1 and options.get("cp_rank") is None:  # the rank run is 0: the estimate is that rank's
            options = {**options, "cp_rank": 0}
        setup = setup_of(options_of({**options, "device": kernels}))
        from memplan.measure.compare.tensors import comparison_json
        from memplan.measure.instruments.sizes import check_sizes

        est = estimate(setup)
        check_sizes(est.tensors)
        check_memory(est.peak.bytes, est.peak.phase, dev, *prof_mod.available_memory(dev))
        if not dev.startswith("cuda"):
            _cpu_bf16_note(setup, est.flops.total * setup.training.grad_accum * (1 + warmup + steps))
        try:
            with (
                prof_mod.cuda_memory_snapshot(memory_snapshot),
                Bar("profiling", total=1 + warmup + steps, unit="passes") as bar,
            ):
                prof = prof_mod.profile(
                    setup,
                    dev,
                    warmup,
                    steps,
                    torch_trace,
                    curve=bool(timeline or plot),
                    on_step=lambda what: bar.advance(description=what),
                    cp_rank=setup.parallel.cp_rank or 0,
                )
        except prof_mod.OUT_OF_MEMORY:
            from memplan.render.estimate import fmt_bytes

            typer.echo(
                f"error: out of memory on {dev}; the estimate needs {fmt_bytes(est.peak.bytes)} at its peak "
                f"({est.peak.phase}) — try --checkpointing full, a smaller --batch or --seq",
                err=True,
            )
            raise typer.Exit(1) from None
        result = comparison_json(est, prof.measured)
    result["measured"]["memory"]["peak"] = prof.peak
    result["measured"]["memory"]["phase_peaks"] = prof.phase_peaks
    flops_step = est.flops.total * setup.training.grad_accum
    result["time"] = {
        "device": dev,
        "step_seconds": prof.step_seconds,
        "median_step_seconds": prof.median_step,
        "phase_seconds": prof.phase_seconds,
        "achieved_tflops": flops_step / prof.median_step / 1e12,
    }
    peak_error = prof.peak / est.peak.bytes - 1
    result["diff"]["peak_relative_error"] = peak_error
    curve = _measured_timeline(est, prof.curve, timeline, plot)
    if curve is not None and timeline:
        result["timeline"] = curve
    if as_json:
        typer.echo(json.dumps(result, allow_nan=False))
    else:
        _print_profile(result, est.peak.bytes, est.peak.phase, prof.peak, peak_error, flops_step, dev)
        if curve is not None and timeline:
            from memplan.render.timeline import timeline_chart
            from memplan.timeline import timeline as timeline_points

            out = console()
            points = timeline_points(est)
            out.print(timeline_chart(points, out.width, [row["measured"] for row in curve]))
    if not result["diff"]["equal"]:
        raise typer.Exit(1)


def _measured_timeline(
    est: Result, curve: Curve | None, timeline: bool, plot: str | None
) -> list[dict[str, Any]] | None:
    """The estimate's timeline points with the measured curve read at each (``measure.moments``), for
    --timeline (JSON rows: label, estimated bytes and terms, measured bytes or None, sample index); with
    --plot the two curves are written to the file. None when neither was asked or no curve was recorded."""
    if curve is None or not (timeline or plot):
        return None
    from memplan.measure.instruments.moments import read_points
    from memplan.timeline import timeline as timeline_points

    points = timeline_points(est)
    readings = read_points(curve, [p.label for p in points])
    if plot is not None:
        from memplan.render.timeline import write_profile_plot

        at = [None if r is None else r[0] for r in readings]
        title = f"{est.setup.model.name}: one training step, measured vs estimated"
        write_profile_plot(points, curve.samples, at, plot, title)
    return [
        {
            "label": p.label,
            "bytes": p.bytes,
            **p.terms,
            "measured": None if r is None else r[1],
            "measured_sample": None if r is None else r[0],
        }
        for p, r in zip(points, readings, strict=True)
    ]


def _print_profile(
    result: dict[str, Any], est_peak: int, phase: str, peak: int, err: float, flops: int, dev: str
) -> None:
    from rich.console import Console
    from rich.text import Text

    from memplan.render.estimate import BYTE_UNITS, fmt_bytes, fmt_flops, fmt_rate
    from memplan.render.measure import flop_table, profile_table, tensor_table, verdict

    t = result["time"]
    rows = [
        ("peak memory", f"{fmt_bytes(est_peak)} ({phase})", f"{fmt_bytes(peak)} ({err:+.2%})"),
        (
            "saved activations",
            fmt_bytes(result["estimated"]["memory"]["activations"]),
            fmt_bytes(result["measured"]["memory"]["activations"]),
        ),
        ("FLOPs per step", fmt_flops(flops), f"{fmt_rate(t['achieved_tflops'] * 1e12)} achieved"),
        ("step time (median)", "", f"{t['median_step_seconds'] * 1e3:,.1f} ms on {dev}"),
    ]
    console = Console()
    console.print(profile_table(rows))
    console.print(tensor_table(result["diff"]))
    console.print(flop_table(result["diff"]))
    note = "" if dev.startswith("cuda") else " (CPU timings say little about a GPU)"
    console.print(Text(f"{BYTE_UNITS}{note}"))
    console.print(verdict(bool(result["diff"]["equal"]), "profile"))


SLOW_BF16 = 2.0
"""bf16 is called slow when its matmul runs at less than 1/SLOW_BF16 of fp32's (both measured now)."""


def bf16_note(bf16: float, fp32: float, flops: int) -> str | None:
    """What to tell the user before a CPU profile in bf16 whose matmuls run slower than fp32's (rates in
    FLOP/s, measured on this CPU; ``flops``: the whole run's): None when bf16 is not slow."""
    from memplan.render.estimate import fmt_flops, fmt_rate

    if bf16 * SLOW_BF16 > fp32:
        return None
    return (
        f"note: bf16 matmuls run at {fmt_rate(bf16)} on this CPU against {fmt_rate(fp32)} in fp32 (a 256³ "
        "matmul, measured now): this CPU has no fast bf16 matmul kernel in this torch build (no AVX512-BF16 "
        f"or AMX path), so this run's {fmt_flops(flops)} take ≈ {flops / bf16:,.0f} s or more at that rate; "
        "--precision fp32 runs faster (its saved bytes differ from bf16's)"
    )


def _cpu_bf16_note(setup: Setup, flops: int) -> None:
    """On CPU with bf16 activations: measure bf16's and fp32's matmul rates, say so on stderr when slow."""
    from memplan.config import DType

    if setup.training.precision.activation_dtype is not DType.BF16:
        return
    from memplan.measure.runs.profile import bf16_and_fp32_rates

    note = bf16_note(*bf16_and_fp32_rates(), flops)
    if note is not None:
        typer.echo(note, err=True)


def register(app: typer.Typer) -> None:
    """Add ``profile`` to ``app``."""
    app.command()(profile)
