"""``memplan profile --nproc N``: the distributed check (memplan/measure/distributed/nproc.py), as the CLI
runs it.

torch is imported inside ``profile_distributed`` only. Under ``torchrun`` every process runs the command
and rank 0 prints the result; otherwise this process spawns the N ranks itself.
"""

from __future__ import annotations

import json
import signal
from typing import Any

import typer

from memplan.api import setup_of
from memplan.cli.common import console, options_of
from memplan.cli.progress import Bar
from memplan.config import Device
from memplan.engine import Result, at_stage, estimate

LAYOUT_OPTIONS = ("tp", "sp", "pp", "zero")
"""The options ``profile`` takes for a layout; dp follows from --nproc / (tp · pp)."""


def check_single(options: dict[str, Any]) -> None:
    """One process holds the whole model: a layout needs ``--nproc``."""
    if options.get("tp", 1) > 1 or options.get("sp") or options.get("pp", 1) > 1:
        raise ValueError(
            "nproc: tensor, sequence or pipeline parallelism needs ranks; add --nproc N (tp · pp · dp)"
        )


def check_memory(peak: int, phase: str, dev: str, available: int, where: str) -> None:
    """Refuse, before allocating anything, a run whose estimated peak exceeds what ``dev`` has free (the
    run would be killed or raise out of memory part-way, on CPU after swapping)."""
    from memplan.render.estimate import fmt_bytes

    if peak > available:
        raise ValueError(
            f"memory: the estimate peaks at {fmt_bytes(peak)} ({phase}) but {dev} has {fmt_bytes(available)} "
            f"({where}); use a smaller --seq or --batch, --checkpointing full, or a smaller model"
        )


def rank_peaks(est: Result, nproc: int) -> list[int]:
    """The estimated peak of every rank: its pipeline stage's (the same on every rank without pp)."""
    pp = est.setup.parallel.pp
    if pp == 1:
        return [est.peak.bytes] * nproc
    return [at_stage(est, i).peak.bytes for i in range(pp)] * (nproc // pp)


def check_ranks_memory(est: Result, nproc: int, dev: str) -> None:
    """Refuse a launch whose ranks would not fit, before any rank allocates: on CPU the ranks share the
    host, so their peaks add up; on CUDA each rank has its own GPU, checked at the largest rank's peak
    (``profile.available_memory``: free memory of the first GPU, available host memory)."""
    from memplan.measure.runs import profile as prof_mod

    peaks = rank_peaks(est, nproc)
    available, where = prof_mod.available_memory(dev)
    if dev.startswith("cuda"):
        check_memory(max(peaks), "the largest rank's", dev, available, where)
    else:
        check_memory(sum(peaks), f"the sum of {nproc} ranks' peaks on one host", dev, available, where)


def profile_distributed(nproc: int, dev: str, as_json: bool, options: dict[str, Any]) -> None:
    """Run the layout in ``nproc`` processes and set every rank beside the estimate (exit 1 when a rank
    differs beyond the documented differences). Raises ValueError for what cannot run."""
    from memplan.measure.compare.ranks import comparison
    from memplan.measure.distributed import nproc as dist_mod
    from memplan.measure.distributed.launch import spawn
    from memplan.measure.distributed.parallelize import check_distributed
    from memplan.measure.instruments.sizes import check_sizes
    from memplan.measure.reference.model import check_runnable

    kernels = Device.CUDA if dev.startswith("cuda") else Device.CPU
    replica = options.get("tp", 1) * options.get("pp", 1)
    if nproc % replica:
        raise ValueError(
            f"nproc: {nproc} processes do not split into replicas of tp · pp = {replica}; "
            f"use --nproc {replica}, {2 * replica} or another multiple of {replica}"
        )
    setup = setup_of(options_of({**options, "device": kernels, "gpus": nproc}))
    check_distributed(setup)
    # What the single-process run refuses, refused here too, before any rank starts (importing torch in
    # every rank takes seconds, and a rank's refusal reaches the parent only as its last error line).
    check_runnable(setup, dev)
    est = estimate(setup)
    check_sizes(est.tensors)
    check_ranks_memory(est, nproc, dev)
    launcher = "torchrun" if dist_mod.under_torchrun() else "spawn"
    try:
        # A spinner with the elapsed time on stderr (a terminal, past a second): the ranks report only at
        # the end. Under torchrun every rank runs this: no bar there.
        with Bar("profiling", enabled=launcher == "spawn" and not as_json) as bar:
            bar.advance(0, f"{nproc} ranks ({setup.parallel.label()}, dp {setup.strategy.dp})")
            reports = dist_mod.launch(setup, nproc, cuda=kernels is Device.CUDA)
    except (TimeoutError, RuntimeError, OSError) as e:  # a rank failed or hung: its error, one line
        last = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        typer.echo(f"error: nproc: the distributed run failed: {last}; every rank was stopped", err=True)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:  # Ctrl-C: the ranks are stopped (measure.distributed.launch.spawn.spawn_ranks)
        typer.echo("error: nproc: interrupted (SIGINT); every rank was stopped", err=True)
        raise typer.Exit(128 + signal.SIGINT) from None
    except spawn.Interrupted as e:
        typer.echo(f"error: nproc: interrupted ({e}); every rank was stopped", err=True)
        raise typer.Exit(128 + e.signum) from None
    if not reports:  # a torchrun rank other than 0: rank 0 prints
        return
    result = comparison(reports, est, launcher)
    if as_json:
        typer.echo(json.dumps(result, allow_nan=False))
    else:
        from memplan.render.distributed import distributed_report

        console().print(distributed_report(result))
    if not result["equal"]:
        raise typer.Exit(1)
