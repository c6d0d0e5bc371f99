"""``memplan trace`` and ``memplan profile``: the estimate set beside PyTorch's own accounting.

torch is imported inside the commands only, so ``memplan estimate`` never loads it.
"""

from __future__ import annotations

import importlib.util
import json
import time
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from memplan.api import setup_of
from memplan.cli.common import check_writable, fail, options_of, user_errors, with_options
from memplan.config import Device, Setup
from memplan.engine import estimate
from memplan.render.estimate import BYTE_UNITS, fmt_bytes, fmt_flops

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


def _torch_or_fail() -> None:
    if not torch_available():
        fail(INSTALL)


# The options the reference model runs with on one process (trace: also the ZeRO sharding of the states).
_RUN_OPTIONS = (
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
)


_FINETUNE_OPTIONS = (
    "finetune",
    "lora_rank",
    "lora_alpha",
    "lora_dropout",
    "lora_targets",
    "freeze",
    "quant",
    "double_quant",
)
"""trace only: the reference model runs LoRA adapters and frozen parameters (QLoRA's base as a frozen
linear in the compute dtype: bitsandbytes' MatMul4Bit keeps and computes what it does)."""


@with_options(*_RUN_OPTIONS, "zero", "dp", *_FINETUNE_OPTIONS)
def trace(as_json: JsonOpt = False, **options: Any) -> None:
    """Run the reference model's forward and backward under fake tensors on CPU and compare with the estimate.

    Any size runs (no memory is allocated, no GPU is needed): every saved tensor is counted per name and
    per layer, and FLOPs per phase with FlopCounterMode's formulas. Exit code 1 when they differ.

    Example: memplan trace --model 70b --seq 8192
    """
    with user_errors():
        setup = setup_of(options_of({**options, "device": Device.CPU}))
        _torch_or_fail()
        from memplan.measure.compare import comparison_json
        from memplan.measure.model import check_runnable, check_sizes
        from memplan.measure.run import measure

        check_runnable(setup, "cpu")  # before the progress bar starts drawing
        est = estimate(setup)
        check_sizes(est.tensors)
        start = time.perf_counter()
        with _progress(as_json, setup) as progress:
            meas = measure(setup, fake=True, on_layer=progress)
        seconds = time.perf_counter() - start
        result = comparison_json(est, meas)
    result["seconds"] = round(seconds, 3)
    if as_json:
        typer.echo(json.dumps(result, allow_nan=False))
    else:
        from memplan.render.measure import trace_report

        Console().print(trace_report(result, seconds))
    if not result["diff"]["equal"]:
        raise typer.Exit(1)


class _progress:
    """A rich progress bar over forward and backward layers (silent with --json)."""

    def __init__(self, quiet: bool, setup: Setup) -> None:
        self.quiet, self.total = quiet, 2 * setup.model.num_layers
        self.bar = Progress(
            TextColumn("[bold]tracing[/bold] {task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} layer passes"),
            TimeElapsedColumn(),
            transient=True,
        )

    def __enter__(self) -> Any:
        if self.quiet:
            return None
        self.bar.start()
        self.task = self.bar.add_task("forward", total=self.total)
        return self

    def __call__(self, phase: str, layer: int) -> None:
        self.bar.update(self.task, advance=1, description=f"{phase} layer {layer}")

    def __exit__(self, *exc: object) -> None:
        if not self.quiet:
            self.bar.stop()


DeviceRunOpt = Annotated[
    str | None,
    typer.Option("--device", help="Where to run: cuda (when available) or cpu [default: cuda if available]"),
]


@with_options(*_RUN_OPTIONS)
def profile(
    device: DeviceRunOpt = None,
    steps: Annotated[int, typer.Option("--steps", min=1, max=1000, help="Measured steps")] = 2,
    warmup: Annotated[int, typer.Option("--warmup", min=0, max=1000, help="Warm-up steps")] = 1,
    torch_trace: Annotated[str | None, typer.Option("--torch-trace", help="Write a Chrome trace")] = None,
    memory_snapshot: Annotated[
        str | None, typer.Option("--memory-snapshot", help="Write a CUDA memory snapshot (CUDA only)")
    ] = None,
    as_json: JsonOpt = False,
    **options: Any,
) -> None:
    """Run real training steps of the reference model and set peak memory, saved bytes, FLOPs and time
    beside the estimate. Peak on CUDA from the caching allocator, on CPU from a live-storage tracker.
    One process holds every model state, so ZeRO and dp are not options here.

    Example: memplan profile --model tiny --device cpu --seq 256
    """
    with user_errors():
        _torch_or_fail()
        from memplan.measure import profile as prof_mod

        dev = prof_mod.resolve_device(device)
        if memory_snapshot and not dev.startswith("cuda"):
            raise ValueError("memory-snapshot: CUDA memory snapshots need --device cuda")
        for option, path in (("torch-trace", torch_trace), ("memory-snapshot", memory_snapshot)):
            if path is not None:
                check_writable(option, path)
        kernels = Device.CUDA if dev.startswith("cuda") else Device.CPU
        setup = setup_of(options_of({**options, "device": kernels}))
        from memplan.measure.compare import comparison_json
        from memplan.measure.model import check_sizes

        est = estimate(setup)
        check_sizes(est.tensors)
        _check_memory(est.peak.bytes, est.peak.phase, dev, *prof_mod.available_memory(dev))
        try:
            with prof_mod.cuda_memory_snapshot(memory_snapshot):
                prof = prof_mod.profile(
                    setup, device=dev, warmup=warmup, steps=steps, torch_trace=torch_trace
                )
        except prof_mod.OUT_OF_MEMORY:
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
    if as_json:
        typer.echo(json.dumps(result, allow_nan=False))
    else:
        _print_profile(result, est.peak.bytes, est.peak.phase, prof.peak, peak_error, flops_step, dev)
    if not result["diff"]["equal"]:
        raise typer.Exit(1)


def _check_memory(peak: int, phase: str, dev: str, available: int, where: str) -> None:
    """Refuse, before allocating anything, a run whose estimated peak exceeds what ``dev`` has free (the
    run would be killed or raise out of memory part-way, on CPU after swapping)."""
    if peak > available:
        raise ValueError(
            f"memory: the estimate peaks at {fmt_bytes(peak)} ({phase}) but {dev} has {fmt_bytes(available)} "
            f"({where}); use a smaller --seq or --batch, --checkpointing full, or a smaller model"
        )


def _print_profile(
    result: dict[str, Any], est_peak: int, phase: str, peak: int, err: float, flops: int, dev: str
) -> None:
    from memplan.render.measure import flop_table, profile_table, tensor_table, verdict

    t = result["time"]
    rows = [
        ("peak memory", f"{fmt_bytes(est_peak)} ({phase})", f"{fmt_bytes(peak)} ({err:+.2%})"),
        (
            "saved activations",
            fmt_bytes(result["estimated"]["memory"]["activations"]),
            fmt_bytes(result["measured"]["memory"]["activations"]),
        ),
        ("FLOPs per step", fmt_flops(flops), f"{t['achieved_tflops']:.3f} TFLOP/s achieved"),
        ("step time (median)", "", f"{t['median_step_seconds'] * 1e3:.1f} ms on {dev}"),
    ]
    console = Console()
    console.print(profile_table(rows))
    console.print(tensor_table(result["diff"]))
    console.print(flop_table(result["diff"]))
    note = "" if dev.startswith("cuda") else " (CPU timings say little about a GPU)"
    console.print(Text(f"{BYTE_UNITS}{note}"))
    console.print(verdict(bool(result["diff"]["equal"]), "profile"))


def register(app: typer.Typer) -> None:
    """Add ``trace`` and ``profile`` to ``app``."""
    app.command()(trace)
    app.command()(profile)
