"""``memplan trace`` and ``memplan profile``: the estimate set beside PyTorch's own accounting.

torch is imported inside the commands only, so ``memplan estimate`` never loads it.
"""

from __future__ import annotations

import importlib.util
import json
import time
from typing import TYPE_CHECKING, Annotated, Any

import typer

from memplan.api import setup_of
from memplan.cli.common import (
    FINETUNE_FLAGS,
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
from memplan.config import Device, Impl, Setup
from memplan.engine import estimate
from memplan.presets import hf_document

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
    "loss",
    "fp8",
)


_FINETUNE_OPTIONS = FINETUNE_FLAGS
"""trace only: the reference model runs LoRA adapters and frozen parameters (QLoRA's base as a frozen
linear in the compute dtype: bitsandbytes' MatMul4Bit keeps and computes what it does)."""


StageOpt = Annotated[
    int | None,
    typer.Option(
        "--stage",
        min=0,
        metavar="I",
        help="trace --impl torchtitan --pp: trace pipeline rank I only [default: every rank]",
        show_default=False,
    ),
]


@with_options(
    *_RUN_OPTIONS,
    "zero",
    "dp",
    "cp",
    "tp",
    "sp",
    "pp",
    "vpp",
    "pp_layers",
    "device",
    "impl",
    "use_cache",
    "reentrant",
    "experts",
    "compile",
    *_FINETUNE_OPTIONS,
    device=Device.CPU,
)
def trace(as_json: JsonOpt = False, stage: StageOpt = None, **options: Any) -> None:
    """Run the reference model's forward and backward under fake tensors on CPU and compare with the estimate.

    Any size runs (no memory is allocated, no GPU is needed): every saved tensor is counted per name and
    per layer, and FLOPs per phase with FlopCounterMode's formulas. Exit code 1 when they differ.
    --device cuda runs the CUDA code path on the meta device, whose kernels return what CUDA's return
    (the flash kernel's RNG state, fp32 LayerNorm statistics), and compares with the cuda estimate.
    With --impl torchtitan and --tp/--sp or --dp it runs rank 0 of torchtitan's parallelised model on a fake
    process group of tp·dp ranks (FSDP2 under --zero 2/3). With --cp it runs rank 0 of the ring (torch's own
    ring attention over a fake process group; --device cpu); FLOPs × cp. With --pp P (and --vpp M:
    torchtitan's Interleaved1F1B) it runs pipeline rank I (--stage I, or each in turn) of torchtitan's split
    model under torch's schedule on a fake process group of P·dp ranks (FSDP2 on each stage under --zero 2/3),
    its saves per layer, the schedule's holds and its parameters against the estimate of that rank. With
    --compile each block's saves are what torch.compile's partitioner (AOTAutograd's min-cut) returns from the
    compiled forward, traced without compiling kernels.

    Example: memplan trace --model 70b --seq 8192 --device cuda
    """
    with user_errors():
        setup = setup_of(options_of(options))
        _torch_or_fail()
        if stage is not None and not (setup.impl.impl is Impl.TORCHTITAN and setup.parallel.pp > 1):
            raise ValueError("stage: --stage picks a pipeline rank of trace --impl torchtitan --pp; drop it")
        if setup.impl.impl is Impl.TORCHTITAN and setup.parallel.pp > 1:
            return _trace_titan_stages(setup, as_json, stage)
        if setup.impl.impl is not Impl.REFERENCE:
            return _trace_impl(setup, as_json, str(options["model"]))
        if setup.parallel.tp > 1:
            raise ValueError(
                "tp: trace runs the reference model in one process; --tp is traced per rank with --impl "
                "torchtitan, or run the reference over ranks with profile --nproc"
            )
        if setup.impl.compile:
            return _trace_compiled(setup, as_json)
        from memplan.measure.compare.tensors import comparison_json
        from memplan.measure.instruments.sizes import check_sizes
        from memplan.measure.reference.model import check_runnable
        from memplan.measure.runs.run import measure, trace_device

        device = trace_device(setup.device)
        check_runnable(setup, device)  # before the progress bar starts drawing
        est = estimate(setup)
        check_sizes(est.tensors)
        start = time.perf_counter()
        with Bar("tracing", total=2 * setup.model.num_layers, unit="layer passes") as bar:
            meas = measure(
                setup,
                fake=True,
                device=device,
                on_layer=lambda phase, layer: bar.advance(description=f"{phase} layer {layer}"),
            )
        seconds = time.perf_counter() - start
        result = comparison_json(est, meas)
    result["seconds"] = round(seconds, 3)
    result["ran_on"] = device  # cpu: fake tensors, CPU kernels; meta: the CUDA kernels' outputs
    if as_json:
        typer.echo(json.dumps(result, allow_nan=False))
    else:
        from rich.console import Console

        from memplan.render.measure import trace_report

        Console().print(trace_report(result, seconds))
    if not result["diff"]["equal"]:
        raise typer.Exit(1)


def _trace_impl(setup: Setup, as_json: bool, model: str) -> None:
    """``trace --impl hf|torchtitan``: the framework's own model under fake tensors, compared per layer and
    in total (within 1 %) and tensor by tensor (paired by dtype and bytes, named by module path and op).
    With ``--impl hf`` and a config.json (a file or a Hub id), transformers builds the model from that
    file, every key of it (``hf_config_of_file``), not from what memplan read of it."""
    from memplan.measure.compare.impl import impl_comparison_json
    from memplan.measure.frameworks.dispatch import check_traceable
    from memplan.measure.frameworks.hf import measure_hf

    if setup.impl.compile and setup.impl.impl is not Impl.TORCHTITAN:
        raise ValueError(
            f"compile: trace --impl {setup.impl.impl.value} runs the framework's eager code; torch.compile's "
            "saved set is traced for --impl reference and torchtitan; drop --compile"
        )
    measure_impl = check_traceable(setup)
    if setup.impl.impl is Impl.TORCHTITAN:
        from memplan.measure.distributed.titan import needs_ranks

        if needs_ranks(setup):
            return _trace_titan_rank(setup, as_json)
    if setup.impl.compile:
        return _trace_compiled(setup, as_json)
    document = hf_document(model) if setup.impl.impl is Impl.HF else None
    est = estimate(setup)
    start = time.perf_counter()
    with Bar("tracing") as bar:
        bar.advance(0, f"{setup.impl.impl.value}'s {setup.model.name} under fake tensors")
        meas = measure_impl(setup) if document is None else measure_hf(setup, document=document)
    seconds = time.perf_counter() - start
    result = impl_comparison_json(est, meas)
    result["built_from"] = "config.json" if document is not None else "memplan's model"
    _print_impl_trace(result, seconds, as_json)


def _trace_titan_rank(setup: Setup, as_json: bool) -> None:
    """``trace --impl torchtitan`` with tp or dp > 1: rank 0 of torchtitan's parallelised model on torch's
    fake process group (measure/distributed/titan.py), its saves and parameter bytes against the estimate."""
    from memplan.measure.distributed.titan import measure_titan_rank, rank_comparison_json, world_size

    est = estimate(setup)
    start = time.perf_counter()
    with Bar("tracing") as bar:
        bar.advance(0, f"rank 0 of {world_size(setup)}: torchtitan's {setup.model.name} under fake tensors")
        run = measure_titan_rank(setup)
    seconds = time.perf_counter() - start
    result = rank_comparison_json(est, run)
    result["built_from"] = "memplan's model"
    _print_impl_trace(result, seconds, as_json)


def _trace_titan_stages(setup: Setup, as_json: bool, index: int | None) -> None:
    """``trace --impl torchtitan --pp P [--vpp M]``: pipeline rank ``index`` (or each) on torch's fake process
    group under torchtitan's schedule (``titan_vpp``: 1F1B or Interleaved1F1B; each stage FSDP2-sharded
    over dp under --zero 2/3, the rank at data-parallel coordinate 0), against the
    estimate of that rank (``compare.stage``). The top-level comparison is the estimate's most loaded rank
    among those traced; ``stages`` lists each."""
    from memplan.measure.compare.stage import stage_comparison_json
    from memplan.measure.distributed.titan_vpp import measure_titan_pipeline

    p = setup.parallel.pp
    if index is not None and index >= p:
        raise ValueError(f"stage: --stage {index} is not a pipeline rank of --pp {p}; use 0 to {p - 1}")
    if setup.device is not Device.CPU:
        raise ValueError("device: trace --impl torchtitan --pp runs the CPU kernels; use --device cpu")
    est = estimate(setup)
    ranks = range(p) if index is None else (index,)
    start = time.perf_counter()
    results = []
    with Bar("tracing", total=len(ranks), unit="ranks") as bar:
        for i in ranks:
            bar.advance(0, f"pipeline rank {i} of {p}: torchtitan's {setup.model.name} under fake tensors")
            results.append(stage_comparison_json(est, i, measure_titan_pipeline(setup, i)))
            bar.advance(1)
    seconds = time.perf_counter() - start
    most = max(results, key=lambda r: r["estimated"]["memory"]["peak"])
    result = {**most, "diff": {**most["diff"], "equal": all(r["diff"]["equal"] for r in results)}}
    result["stages"] = results
    result["built_from"] = "memplan's model"
    result["seconds"] = round(seconds, 3)
    result["ran_on"] = "cpu"
    if as_json:
        typer.echo(json.dumps(result, allow_nan=False))
    else:
        from rich.console import Console

        from memplan.render.stage_trace import stage_trace_report

        Console().print(stage_trace_report(result, seconds))
    if not result["diff"]["equal"]:
        raise typer.Exit(1)


def _print_impl_trace(result: dict[str, Any], seconds: float, as_json: bool) -> None:
    """Print a ``trace --impl`` / ``--compile`` comparison (CPU fake tensors); exit 1 when it differs."""
    result["seconds"] = round(seconds, 3)
    result["ran_on"] = "cpu"
    if as_json:
        typer.echo(json.dumps(result, allow_nan=False))
    else:
        from rich.console import Console

        from memplan.render.measure import impl_trace_report

        Console().print(impl_trace_report(result, seconds))
    if not result["diff"]["equal"]:
        raise typer.Exit(1)


def _trace_compiled(setup: Setup, as_json: bool) -> None:
    """``trace --compile``: each block's saves from torch.compile's partitioner (measure/runs/compiled.py),
    the model's eager parts as they run; exact per layer, in total and in FLOPs."""
    from memplan.blocks.profiles import compile_note
    from memplan.measure.frameworks.titan import measure_titan_compiled
    from memplan.measure.runs.compiled import compiled_comparison_json, measure_compiled

    note = compile_note(setup)
    if note is not None:
        raise ValueError(note.replace("compile:", "compile: trace --compile needs a modelled setup;", 1))
    if setup.device is not Device.CPU:
        raise ValueError("device: trace --compile runs the CPU kernels; use --device cpu")
    est = estimate(setup)
    start = time.perf_counter()
    meas = measure_titan_compiled(setup) if setup.impl.impl is Impl.TORCHTITAN else measure_compiled(setup)
    seconds = time.perf_counter() - start
    result = compiled_comparison_json(est, meas)
    _print_impl_trace(result, seconds, as_json)


DeviceRunOpt = Annotated[
    str | None,
    typer.Option(
        "--device", help=plain("Where to run: cuda (when available) or cpu [default: cuda if available]")
    ),
]


@with_options(*_RUN_OPTIONS, *LAYOUT_OPTIONS)
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
            "torchrun) and compare every rank with the estimate of its stage",
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

    Example: memplan profile --model tiny --device cpu --seq 256 --timeline
    Example: memplan profile --model tiny --device cpu --seq 32 --nproc 4 --tp 2 --zero 3
    """
    with user_errors():
        _torch_or_fail()
        from memplan.cli.nproc import check_single, profile_distributed
        from memplan.measure.distributed.torchrun import torchrun_world
        from memplan.measure.runs import profile as prof_mod

        dev = prof_mod.resolve_device(device)
        nproc = nproc or torchrun_world()
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
            if options.get("fp8") not in (None, "none"):
                raise ValueError(
                    "fp8: profile --nproc runs bf16 linears (torchao's float8 under DTensor/FSDP2 is not "
                    "modelled); drop --fp8 or run without --nproc"
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
    """Add ``trace`` and ``profile`` to ``app``."""
    app.command()(trace)
    app.command()(profile)
