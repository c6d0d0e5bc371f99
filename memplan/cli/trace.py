"""``memplan trace``: the reference model's (or ``--impl hf|torchtitan``'s own) forward and backward under
fake tensors, every saved tensor and FLOP set beside the estimate; one rank of a parallel layout on torch's
fake process group (torchtitan), each pipeline rank (``--pp``), or torch.compile's saved set.

torch is imported inside the command only, so ``memplan estimate`` never loads it.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

import typer

from memplan.api import setup_of
from memplan.cli.common import FINETUNE_FLAGS, options_of, plain, user_errors, with_options
from memplan.cli.measure import RUN_OPTIONS, JsonOpt, torch_or_fail
from memplan.cli.progress import Bar
from memplan.config import Checkpointing, Device, Impl, Setup
from memplan.engine import estimate
from memplan.presets import hf_document

_FINETUNE_OPTIONS = FINETUNE_FLAGS
"""trace only: the reference model runs LoRA adapters and frozen parameters (QLoRA's base as a frozen
linear in the compute dtype: bitsandbytes' MatMul4Bit keeps and computes what it does)."""


StageOpt = Annotated[
    int | None,
    typer.Option(
        "--stage",
        min=0,
        metavar="I",
        help=plain("trace --impl torchtitan --pp: trace pipeline rank I only [default: every rank]"),
        show_default=False,
    ),
]


@with_options(
    *RUN_OPTIONS,
    "zero",
    "dp",
    "cp",
    "cp_rank",
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
    "fp8_all_gather",
    "fp8_tp",
    "fsdp_wrap",
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
    process group of tp·dp ranks (FSDP2 under --zero 2/3; --fsdp-wrap root: torchtitan's 2024 wrapping).
    With --cp it runs rank --cp-rank (default 0) of the ring (torch's own ring attention over a fake
    process group; --device cuda: its CUDA entry points on the meta device); FLOPs × cp. With --pp P (and
    --vpp M: torchtitan's Interleaved1F1B) it runs pipeline rank I (--stage I, or each in turn) of
    torchtitan's split model under torch's schedule on a fake process group of P·dp ranks (FSDP2 on each
    stage under --zero 2/3), its saves per layer, the schedule's holds and its parameters against the
    estimate of that rank. With --compile each block's saves are what torch.compile's partitioner
    (AOTAutograd's min-cut) returns from the compiled forward, traced without compiling kernels (on a
    torchtitan rank or stage over --tp: its DTensor blocks).

    Examples:

      memplan trace --model 70b --seq 8192 --device cuda

      memplan trace -m llama-3-8b --seq 1024 --impl torchtitan --tp 2 --sp --compile
    """
    with user_errors():
        setup = setup_of(options_of(options))
        torch_or_fail()
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
        if setup.parallel.pp > 1:  # the whole model in one process is no pipeline rank's estimate
            raise ValueError(
                "pp: trace runs the reference model in one process; --pp is traced per stage with --impl "
                "torchtitan (--stage I), or run the reference's stages over ranks with profile --nproc"
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
                cp_rank=setup.parallel.cp_rank or 0,
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
    if setup.impl.impl is Impl.HF and setup.device is Device.CUDA:
        from memplan.blocks.attention.core import core_of

        if core_of(setup.model_copy(update={"device": Device.CPU})) is not core_of(setup):
            # transformers' model runs on CPU kernels here: SDPA's CPU dispatcher picks its math kernel for
            # attention dropout or MLA's unequal head widths, where CUDA's does not
            raise ValueError(
                "device: trace --impl hf runs transformers' model on CPU kernels, where this model's "
                "attention runs SDPA's math kernel (attention dropout or MLA's head widths) and CUDA's does "
                "not; compare like with like: trace --device cpu"
            )
    if setup.impl.impl is Impl.TORCHTITAN:
        from memplan.measure.distributed.titan import compiles, needs_ranks

        if needs_ranks(setup):
            full = setup.strategy.checkpointing is Checkpointing.FULL
            if setup.impl.compile and not (full or compiles(setup)):
                # a rank's blocks go through the partitioner where compile_modelled says (titan.compiles);
                # a FullAC block keeps its input alone, compiled or not
                raise ValueError(
                    "compile: trace --impl torchtitan --compile over --tp or --dp traces the partitioner's "
                    "saves without checkpointing (or under --checkpointing full), with --fp8 over dp alone "
                    "and without --fp8-all-gather; drop --compile to trace the rank's eager blocks"
                )
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
    if setup.impl.impl is Impl.HF:  # the step's own peak, a second pass (shown, not judged)
        from memplan.measure.frameworks.hf_peak import measure_hf_peak, step_peak_json
        from memplan.measure.instruments.moments import estimated_moments

        with Bar("tracing") as bar:
            bar.advance(0, f"the peak of transformers' {setup.model.name} step under fake tensors")
            moments, buffers = measure_hf_peak(setup, document=document)
        seconds = time.perf_counter() - start
        result["step_peak"] = step_peak_json(estimated_moments(est), moments, buffers)
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
            run = measure_titan_pipeline(setup, i, cp_rank=setup.parallel.cp_rank or 0)
            results.append(stage_comparison_json(est, i, run))
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
    if note is not None and setup.strategy.checkpointing is not Checkpointing.FULL:  # FullAC: the input alone
        raise ValueError(note.replace("compile:", "compile: trace --compile needs a modelled setup;", 1))
    if setup.device is not Device.CPU:
        raise ValueError("device: trace --compile runs the CPU kernels; use --device cpu")
    est = estimate(setup)
    start = time.perf_counter()
    meas = measure_titan_compiled(setup) if setup.impl.impl is Impl.TORCHTITAN else measure_compiled(setup)
    seconds = time.perf_counter() - start
    result = compiled_comparison_json(est, meas)
    _print_impl_trace(result, seconds, as_json)


def register(app: typer.Typer) -> None:
    """Add ``trace`` to ``app``."""
    app.command()(trace)
