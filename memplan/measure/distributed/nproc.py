"""``memplan profile --nproc N``: the reference model run by N processes with torch.distributed, per rank.

Launch: under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` set) every process
runs ``run_rank`` itself and rank 0 gets every rank's report; otherwise ``launch`` spawns N processes with
``torch.multiprocessing`` on a free localhost port, and each rank writes its report to a file the parent
reads. Backend gloo on CPU, NCCL on CUDA (one GPU per process, ``LOCAL_RANK``). The mesh is
``(dp, pp, tp)``, tp the innermost (adjacent ranks), as Megatron and torchtitan place it
(time/comm/rows.py's ``ORDER``).

One rank's step (``parallelize.build``: TP/SP with DTensor, ZeRO-2/3 with FSDP2, ZeRO-1 with
``zero1.Zero1Optimizer``; with pp the rank's stage run by ``Schedule1F1B`` over grad_accum micro-batches,
its saves those alive at once at their maximum and its sends and receives counted: pipeline.py):
1. forward under ``RankRecorder`` (what autograd saves, local shards), backward, the gradient collectives
   of ``parallelize.sync_gradients`` and the optimizer step, all under ``CollectiveCounter``;
2. model states: the local storages of the parameters, of their gradients (before they are dropped) and of
   the reference optimizer's master copies and states;
3. a second step under ``RankMemoryTracker``: the peak of every storage alive (module docstring of
   dist_instruments.py says where it over-counts).

Spawned ranks run under ``spawn.spawn_ranks``, which stops every one of them on any fault (a failed, hung
or stopped rank, SIGINT / SIGTERM / SIGHUP to the parent) and keeps the rendezvous on 127.0.0.1.

Known limitations (NB): a mixture of experts without tp (its experts whole on each rank, no ep), reversible
layers without FSDP2 or pp, pipeline parallelism with 1F1B only (``parallelize.check_distributed``); on
CUDA the peak is the caching allocator's. A rank's own child processes are not tracked (the ranks start
none: gloo and NCCL use threads); SIGKILL of the parent leaves its temporary folder (the ranks die with it,
on Linux).
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import Schedule1F1B
from torch.distributed.tensor.parallel import loss_parallel

from memplan.config import Setup, ZeroStage
from memplan.measure.distributed.instruments import CollectiveCounter, RankMemoryTracker, RankRecorder, local
from memplan.measure.distributed.launch.spawn import (
    LOOPBACK,
    TIMEOUT_S,
    free_port,
    local_interfaces,
    local_store,
    spawn_ranks,
)
from memplan.measure.distributed.launch.torchrun import torchrun_world
from memplan.measure.distributed.parallelize import build, shard_dp, sync_gradients
from memplan.measure.distributed.pipeline import (
    InFlightRecorder,
    StageModule,
    make_schedule,
    make_stage,
    run_step,
    stage_batches,
)
from memplan.measure.distributed.zero1 import Zero1Optimizer
from memplan.measure.instruments.record import storage_ref, totals_by_name
from memplan.measure.instruments.tracker import cuda_peak
from memplan.measure.reference.optim import ReferenceOptimizer
from memplan.measure.runs.run import make_batch


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or another launcher setting its environment)."""
    return torchrun_world() is not None


def _device(cuda: bool) -> str:
    return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if cuda else "cpu"


def _mesh(setup: Setup, cuda: bool) -> DeviceMesh:
    """(dp, pp, tp), tp the innermost: time/comm/rows.py's ORDER (Llama 3's tp, cp, pp, dp)."""
    dp, pp, tp = setup.strategy.dp, setup.parallel.pp, setup.parallel.tp
    return init_device_mesh("cuda" if cuda else "cpu", (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))


def _groups(mesh: DeviceMesh) -> dict[str, str]:
    """Process group name → the dimension it spans (tp, pp, dp; the whole world when one spans it)."""
    world = dist.group.WORLD
    out: dict[str, str] = {str(world.group_name): "world"} if world is not None else {}
    for dim in ("dp", "pp", "tp"):
        if mesh[dim].size() > 1:
            out[str(mesh[dim].get_group().group_name)] = dim
    return out


def _states(model: torch.nn.Module, opt: ReferenceOptimizer) -> dict[str, int]:
    """Bytes of the rank's own storages: parameters, gradients, master copies, optimizer states."""

    def total(tensors: Any) -> int:
        # By storage: FSDP2's sharded gradients of one group are views of one reduce-scatter output.
        storages = {storage_ref(local(t)).cdata: local(t).untyped_storage().nbytes() for t in tensors}
        return sum(storages.values())

    params = list(model.parameters())
    return {
        "weights": total(params),
        "gradients": total(p.grad for p in params if p.grad is not None),
        "master_weights": total(opt.master),
        "optimizer_states": total(s for states in opt.states for s in states),
    }


def _step(
    model: Any,
    opt: ReferenceOptimizer,
    batches: list[Any],
    setup: Setup,
    mesh: DeviceMesh,
    counter: CollectiveCounter | None = None,
    recorder: RankRecorder | None = None,
    schedule: Schedule1F1B | None = None,
) -> None:
    """zero_grad, forward (saves recorded when ``recorder`` is given), backward, the gradient collectives;
    ``counter.phase`` marks forward, backward and step. The vocabulary-parallel loss runs under
    ``loss_parallel`` (log-softmax and NLL on [T, v/t] shards). With a pipeline ``schedule`` its 1F1B
    step over the micro-batches ``batches`` (the stage sets the phase: pipeline.CountedStage)."""
    opt.zero_grad()
    with loss_parallel() if setup.parallel.tp > 1 else nullcontext():
        if schedule is not None:
            run_step(schedule, batches)
        else:
            loss = model(*batches[0])
            if counter is not None:
                counter.phase = "backward"
            with recorder.pause() if recorder is not None else nullcontext():
                loss.backward()
            del loss
    if counter is not None:
        counter.phase = "step"
    sync_gradients(model, setup, mesh)


def run_rank(setup: Setup, cuda: bool = False) -> dict[str, Any]:
    """This rank's measurement (the process group is initialised already)."""
    # CommDebugMode's module tracker registers full backward hooks on modules whose inputs need no grad.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    device = _device(cuda)
    mesh = _mesh(setup, cuda)
    model: Any = build(setup, mesh, device)
    pp, pp_rank = setup.parallel.pp, mesh.get_local_rank("pp")
    counter = CollectiveCounter(_groups(mesh), modules=pp == 1)
    schedule = stage = None
    if pp > 1:
        model = StageModule(model, pp_rank, pp)
        shard_dp(model, model.ref.layers, setup, mesh)
        stage = make_stage(model, setup, mesh["pp"].get_group(), device, counter.set_phase)
        schedule = make_schedule(stage, setup)
    opt = _optimizer(model, setup, mesh)
    dp_rank = mesh.get_local_rank("dp")
    torch.manual_seed(1 + dp_rank)  # tp and pp ranks of one replica read the same tokens
    # One micro-batch; with a pipeline the step's grad_accum, each its own tensors (as a loader yields them)
    batches: list[Any] = [
        make_batch(setup, device) for _ in range(setup.training.grad_accum if pp > 1 else 1)
    ]
    if isinstance(model, StageModule):
        batches = stage_batches(batches, model)

    recorder = InFlightRecorder(model) if pp > 1 else RankRecorder(model)
    with counter:
        with recorder:
            _step(model, opt, batches, setup, mesh, counter, recorder, schedule)
        states = _states(model, opt)
        opt.step()
    p2p = stage.collectives() if stage is not None else []  # the first step's (the peak's step counts on)
    peak = _peak(model, opt, batches, setup, mesh, cuda, schedule)
    records = recorder.records
    return {
        "rank": dist.get_rank(),
        "coords": {"dp": dp_rank, "pp": pp_rank, "tp": mesh.get_local_rank("tp")},
        "tensors": {n: {"count": t.count, "bytes": t.bytes} for n, t in totals_by_name(records).items()},
        "unlabelled": [
            {"shape": list(r.shape), "dtype": r.dtype, "bytes": r.bytes, "layer": r.layer}
            for r in records
            if r.name == "unlabelled"
        ],
        "memory": {**states, "activations": sum(r.bytes for r in records), "peak": peak},
        "collectives": [c.to_json() for c in [*counter.collectives(), *p2p]],
    }


def _optimizer(model: torch.nn.Module, setup: Setup, mesh: DeviceMesh) -> ReferenceOptimizer:
    """The reference optimizer; under ZeRO-1 over dp > 1 its sharded form (``zero1.Zero1Optimizer``)."""
    params: list[torch.Tensor] = list(model.parameters())
    t, s = setup.training, setup.strategy
    if s.zero is ZeroStage.OPTIMIZER and s.dp > 1:
        return Zero1Optimizer(params, t.precision, t.optimizer, mesh["dp"].get_group())
    return ReferenceOptimizer(params, t.precision, t.optimizer)


def _peak(
    model: Any,
    opt: ReferenceOptimizer,
    batches: list[Any],
    setup: Setup,
    mesh: DeviceMesh,
    cuda: bool,
    schedule: Schedule1F1B | None,
) -> int:
    """The peak of a second whole step: every storage alive on CPU (with a pipeline also the stage's
    receive buffers, allocated at its first step), the allocator's peak on CUDA."""
    if cuda:
        with cuda_peak() as cp:
            _step(model, opt, batches, setup, mesh, schedule=schedule)
            opt.step()
        return cp.peak
    opt.zero_grad()
    tracker = RankMemoryTracker()
    held = schedule._stage.buffers() if schedule is not None else []  # type: ignore[attr-defined]
    with tracker:
        tracker.track(
            [*model.parameters(), *opt.tensors(), *(t for b in batches for t in b if t is not None), *held]
        )
        _step(model, opt, batches, setup, mesh, schedule=schedule)
        opt.step()
    return tracker.peak


def _init(rank: int, world: int, cuda: bool, store: Store | None = None) -> None:
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=TIMEOUT_S),
        store=store,
    )


def _spawned(rank: int, world: int, port: int, setup: Setup, cuda: bool, out: str) -> None:
    """A process of ``launch``: environment as torchrun would set it, run, write this rank's report."""
    os.environ.update(
        MASTER_ADDR=LOOPBACK,
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    local_interfaces()
    torch.set_num_threads(1)
    _init(rank, world, cuda, store=local_store(port, rank, world))
    try:
        report = run_rank(setup, cuda)
        Path(out, f"rank{rank}.json").write_text(json.dumps(report), encoding="utf-8")
    finally:
        dist.destroy_process_group()


def launch(
    setup: Setup, nproc: int, cuda: bool = False, timeout_s: float = TIMEOUT_S
) -> list[dict[str, Any]]:
    """Run ``setup`` in ``nproc`` processes and return every rank's report, rank order. Under torchrun
    this process is one of them: rank 0 returns all the reports, the others an empty list."""
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != nproc:
            raise ValueError(
                f"nproc: torchrun started {world} processes, not --nproc {nproc}; make them agree"
            )
        _init(int(os.environ["RANK"]), world, cuda)
        try:
            report = run_rank(setup, cuda)
            gathered: list[Any] = [None] * world if dist.get_rank() == 0 else []
            dist.gather_object(report, gathered if dist.get_rank() == 0 else None, dst=0)
        finally:
            dist.destroy_process_group()
        return gathered
    with tempfile.TemporaryDirectory(prefix="memplan-nproc-") as out:
        spawn_ranks(_spawned, (nproc, free_port(), setup, cuda, out), nproc, timeout_s, out)
        return [json.loads(Path(out, f"rank{r}.json").read_text(encoding="utf-8")) for r in range(nproc)]
