"""``memplan profile --nproc N``: the reference model run by N processes with torch.distributed, per rank.

Launch: under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` set) every process
runs ``run_rank`` itself and rank 0 gets every rank's report; otherwise ``launch`` spawns N processes with
``torch.multiprocessing`` on a free localhost port, and each rank writes its report to a file the parent
reads. Backend gloo on CPU, NCCL on CUDA (one GPU per process, ``LOCAL_RANK``). The mesh is
``(dp, pp, tp)``, tp the innermost (adjacent ranks), as Megatron and torchtitan place it
(time/comm/collectives.py's ``ORDER``).

One rank's step (``parallelize.build``: TP/SP with DTensor, ZeRO-2/3 with FSDP2, ZeRO-1 with
``zero1.Zero1Optimizer``; with pp the rank's stage run by ``Schedule1F1B`` over grad_accum micro-batches,
its saves those alive at once at their maximum and its sends and receives counted: pipeline.py):
1. forward under ``RankRecorder`` (what autograd saves, local shards), backward, the gradient collectives
   of ``parallelize.sync_gradients`` and the optimizer step, all under ``CollectiveCounter``;
2. model states: the local storages of the parameters, of their gradients (before they are dropped) and of
   the reference optimizer's master copies and states;
3. a second step under ``RankMemoryTracker``: the peak of every storage alive (module docstring of
   dist_instruments.py says where it over-counts).

Under faults (``spawn_ranks``): a failed, hung or stopped rank, and SIGINT / SIGTERM / SIGHUP to the
parent, end with every rank killed with SIGKILL and reaped, and the run's temporary folder removed; the
ranks ignore SIGINT (a terminal's Ctrl-C stops them through the parent) and die with the parent. A
spawned run's rendezvous listens on 127.0.0.1 only (``local_store``).

Known limitations (NB): dense models, no checkpointing, pipeline parallelism with 1F1B only and without
sequence parallelism (``parallelize.check_distributed``); on CUDA the peak is the caching allocator's. A
rank's own child processes are not tracked (the ranks start none: gloo and NCCL use threads); SIGKILL of
the parent leaves its temporary folder (the ranks die with it, on Linux); a SIGINT in the moment the
ranks are being started is ignored (SIGINT is ignored then, so that they inherit it).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch._C._distributed_c10d import Store, TCPStore
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import Schedule1F1B
from torch.distributed.tensor.parallel import loss_parallel
from torch.multiprocessing.spawn import ProcessException

from memplan.config import Setup, ZeroStage
from memplan.measure.distributed.instruments import CollectiveCounter, RankMemoryTracker, RankRecorder, local
from memplan.measure.distributed.parallelize import build, shard_dp, sync_gradients
from memplan.measure.distributed.pipeline import (
    InFlightRecorder,
    StageModule,
    make_schedule,
    make_stage,
    run_step,
    stage_batches,
)
from memplan.measure.distributed.torchrun import torchrun_world
from memplan.measure.distributed.zero1 import Zero1Optimizer
from memplan.measure.instruments.record import storage_ref, totals_by_name
from memplan.measure.instruments.tracker import cuda_peak
from memplan.measure.reference.optim import ReferenceOptimizer
from memplan.measure.runs.run import make_batch

TIMEOUT_S = 120
"""Seconds a collective (and the whole launch, per process) may wait before the run is abandoned."""


def free_port() -> int:
    """A localhost TCP port nobody listens on now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or another launcher setting its environment)."""
    return torchrun_world() is not None


def _device(cuda: bool) -> str:
    return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if cuda else "cpu"


def _mesh(setup: Setup, cuda: bool) -> DeviceMesh:
    """(dp, pp, tp), tp the innermost: time/comm/collectives.py's ORDER (Llama 3's tp, cp, pp, dp)."""
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


# ----------------------------------------------------------------------------------------------------
# Spawned ranks under faults: a hung or stopped rank, SIGINT / SIGTERM / SIGHUP to the parent
# ----------------------------------------------------------------------------------------------------
LOOPBACK = "127.0.0.1"
"""Where a spawned run's rendezvous listens: every rank is on this host, nothing else need reach it."""


class Interrupted(BaseException):
    """SIGTERM or SIGHUP reached the parent while its ranks ran (raised in the main thread, like
    KeyboardInterrupt for SIGINT); ``signum`` gives the conventional exit code, 128 + signum."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _interrupted(signum: int, _frame: object) -> None:
    raise Interrupted(signum)


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def local_store(port: int, rank: int, world: int) -> TCPStore:
    """The rendezvous store of a spawned run, listening on the loopback interface only.

    ``init_process_group``'s own store (``env://``) binds its server to every interface (``::`` /
    ``0.0.0.0``), whatever ``MASTER_ADDR`` says: anyone who can reach the host could join or feed the
    rendezvous. Rank 0 binds the listening socket itself to 127.0.0.1 and hands it to ``TCPStore``
    (``master_listen_fd``: "the underlying TCPServer will listen on this file descriptor, which must be a
    socket already bound to port", torch/csrc/distributed/c10d/init.cpp)."""
    timeout = timedelta(seconds=TIMEOUT_S)
    if rank != 0:
        return TCPStore(LOOPBACK, port, world, False, timeout=timeout)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, port))
    sock.listen(world)
    # detach: the descriptor is the store's from now on (the socket object, collected, would close it)
    return TCPStore(LOOPBACK, port, world, True, timeout=timeout, master_listen_fd=sock.detach())


def local_interfaces() -> None:
    """Gloo's and NCCL's own connections between the ranks on the loopback interface too (unless the user
    chose one): ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` (Linux's ``lo``, when there is one)."""
    names = {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    if "lo" in names:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")


def _die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this rank when the parent dies, even by SIGKILL (``prctl(PR_SET_PDEATHSIG)``;
    torch's own spawn wrapper asks for SIGINT, which the ranks ignore: see ``spawn_ranks``)."""
    if sys.platform.startswith("linux"):
        with suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    if os.getppid() != parent:  # the parent died before the prctl
        os._exit(1)


def _rank_main(rank: int, fn: Callable[..., None], parent: int, *args: Any) -> None:
    _die_with_parent(parent)
    fn(rank, *args)


@contextmanager
def _sigint_ignored() -> Iterator[None]:
    """SIGINT ignored while the ranks are started: a child inherits an ignored signal across ``exec``, and
    Python leaves it ignored, so the terminal's Ctrl-C (sent to the whole foreground process group)
    reaches the parent only, which stops the ranks; no rank prints its own KeyboardInterrupt."""
    prior = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, prior)


@contextmanager
def _stops_deferred() -> Iterator[None]:
    """SIGTERM and SIGHUP held while the ranks are started, then raised (``Interrupted``) once every rank
    has what it was started with. Raised inside ``start_processes``, the exception cut the parent's write
    of a rank's pickled arguments to its pipe, and the rank, already running, printed an ``EOFError``
    traceback (multiprocessing's ``spawn_main``) before the clean-up killed it (seen under load in
    tests/measure/test_rank_faults.py). The recording handler is Python's: a rank's ``exec`` resets it to
    the default."""
    caught: list[int] = []
    prior = {s: signal.signal(s, lambda signum, _frame: caught.append(signum)) for s in _STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in prior.items():
            signal.signal(s, h)
    if caught:
        raise Interrupted(caught[0])


def spawn_ranks(
    fn: Callable[..., None], args: tuple[Any, ...], nproc: int, timeout_s: float, tmp: str | None = None
) -> None:
    """Run ``fn(rank, *args)`` in ``nproc`` spawned processes and wait for all of them.

    Every way out stops every rank: a rank that raised or died (RuntimeError with its last error line), a
    run past ``timeout_s`` (TimeoutError: a hung collective, a rank stopped by SIGSTOP), SIGINT in the
    parent (KeyboardInterrupt), SIGTERM or SIGHUP (``Interrupted``; held while the ranks start,
    ``_stops_deferred``). The ranks still alive are then killed with SIGKILL, which also ends a stopped
    process (SIGTERM would wait until it is continued), and reaped, so that nothing is left running and
    the parent's exit does not wait on them. torch's per-rank error files go to ``tmp`` (removed by the
    caller) rather than ``$TMPDIR``. Main thread only (signal handlers)."""
    main = threading.current_thread() is threading.main_thread()
    handlers = {s: signal.signal(s, _interrupted) for s in _STOP_SIGNALS} if main else {}
    before = set(mp.active_children())
    ctx: Any = None
    saved_tmp = tempfile.tempdir
    try:
        with _sigint_ignored() if main else nullcontext(), _stops_deferred() if main else nullcontext():
            tempfile.tempdir = tmp or saved_tmp
            try:
                ctx = mp.start_processes(  # type: ignore[attr-defined]
                    _rank_main,
                    args=(fn, os.getpid(), *args),
                    nprocs=nproc,
                    join=False,
                    start_method="spawn",
                )
            finally:
                tempfile.tempdir = saved_tmp
        _join(ctx, timeout_s)
    finally:
        # A second signal must not cut the clean-up short: ignored until every rank is reaped.
        during = (
            {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, *_STOP_SIGNALS)} if main else {}
        )
        ranks = [*ctx.processes] if ctx is not None else []
        _kill([*ranks, *(p for p in set(mp.active_children()) - before if p not in ranks)])
        for s, h in {**during, **handlers}.items():
            signal.signal(s, h)


def _kill(processes: list[Any]) -> None:
    """SIGKILL every process still alive, then reap them all."""
    for p in processes:
        if p.is_alive() and p.pid is not None:
            with suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
    for p in processes:
        p.join(10)


def _join(ctx: Any, timeout_s: float) -> None:
    """Wait for every process. A rank that raised or died, or a run past ``timeout_s`` (a hung collective),
    raises RuntimeError or TimeoutError with the rank's last error line."""
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {len(ctx.processes)} processes ran past {timeout_s:.0f} s")
    except ProcessException as e:
        lines = [line for line in str(e).strip().splitlines() if line.strip()]
        raise RuntimeError(f"rank {e.error_index}: {lines[-1] if lines else 'exited'}") from None
