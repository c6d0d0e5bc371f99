"""Spawned ranks under faults (``spawn_ranks``, what ``nproc.launch`` and ``calibrate`` start): a failed,
hung or stopped rank, and SIGINT / SIGTERM / SIGHUP to the parent, end with every rank killed with SIGKILL
and reaped; the ranks ignore SIGINT (a terminal's Ctrl-C stops them through the parent) and die with the
parent. A spawned run's rendezvous listens on 127.0.0.1 only (``local_store``).

The ranks are forked by multiprocessing's fork server (``START_METHOD``), started once per process with
torch and memplan's distributed measurement imported (``PRELOAD``): each rank is a fork of that clean
interpreter (no CUDA context, none of the caller's threads), where ``spawn`` started a new interpreter that
imported torch again — 3 s a rank on an idle 2-core machine, more under load; ``profile --nproc 4`` and a
process that launches many runs (the test suite) paid it every rank, every launch. The rank is given the
caller's environment as it is at the launch (``_rank_main``), as a spawned one inherited it. Where the
server's socket path would be too long for AF_UNIX (a deep ``$TMPDIR``), the ranks are spawned as before
(``_start_method``).

Known limitations (NB): a rank's own child processes are not tracked (the ranks start none: gloo and NCCL
use threads); a SIGINT while the ranks are being started is ignored (SIGINT is ignored then, so that they
inherit it): until the last rank has read its pickled arguments from its pipe, which it does once it has
imported what they need (torch, seconds; longer on a loaded machine). The fork server imported torch
with the caller's environment as it was at the server's start: a variable torch reads on import and the
caller set later (none of memplan's) reaches a rank's ``os.environ``, not its torch's import.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp
from torch._C._distributed_c10d import TCPStore
from torch.multiprocessing.spawn import ProcessException

TIMEOUT_S = 120
"""Seconds a collective (and the whole launch, per process) may wait before the run is abandoned."""


def free_port() -> int:
    """A localhost TCP port nobody listens on now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    """Linux: SIGKILL this rank when its starter dies, even by SIGKILL (``prctl(PR_SET_PDEATHSIG)``;
    torch's own spawn wrapper asks for SIGINT, which the ranks ignore: see ``spawn_ranks``). The starter
    is the fork server (``START_METHOD``), which dies with ``parent`` (``server_guard``)."""
    starter = os.getppid()
    if sys.platform.startswith("linux"):
        with suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    if os.getppid() != starter or not _alive(parent):  # the server or the parent died before the prctl
        os._exit(1)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's (a reused pid)
        return True
    return True


def _rank_main(rank: int, fn: Callable[..., None], parent: int, env: dict[str, str], *args: Any) -> None:
    _die_with_parent(parent)
    os.environ.clear()
    os.environ.update(env)  # the caller's at the launch (the fork server's is the one of its start)
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


START_METHOD = "forkserver"
"""How ranks are started (module docstring): forks of one server per process."""
PRELOAD = ("memplan.measure.distributed.launch.server_guard", "memplan.measure.distributed.nproc")
"""What the fork server imports before it forks any rank, in order: its guard (it dies with its starter,
``server_guard``), then torch, torch.distributed, DTensor, pipelining and memplan's distributed measurement
(``nproc``'s own imports); and the module of the first function launched."""


SOCKET_PATH_MAX = 103
"""The longest filesystem path an AF_UNIX socket may bind to, in bytes: ``sun_path`` holds 108 on Linux and
104 on macOS, the terminating NUL included (unix(7); macOS <sys/un.h>)."""


def _server_socket_fits() -> bool:
    """Whether the fork server's socket path fits ``SOCKET_PATH_MAX``: multiprocessing binds it at
    ``listener-`` and 8 random characters in its own temporary folder (multiprocessing/connection.py
    ``arbitrary_address``), made in ``$TMPDIR``; a deep ``$TMPDIR`` (a job scheduler's, pytest's) is
    refused by ``bind`` ("AF_UNIX path too long")."""
    from multiprocessing import util

    return len(os.path.join(util.get_temp_dir(), "listener-xxxxxxxx").encode()) <= SOCKET_PATH_MAX


def _start_method(fn: Callable[..., None]) -> str:
    """``START_METHOD`` with this process's fork server running (``_fork_server``), or ``"spawn"`` where
    the server's socket path would not fit (``_server_socket_fits``): every rank then starts a new
    interpreter, as before the fork server, slower but the same run."""
    main = threading.current_thread() is threading.main_thread()
    with _sigint_ignored() if main else nullcontext():
        if not _server_socket_fits():
            return "spawn"
        _fork_server(fn, main)
    return START_METHOD


def _fork_server(fn: Callable[..., None], main: bool) -> None:
    """Start this process's fork server, if it is not running, with ``PRELOAD`` and ``fn``'s module.

    Started with SIGINT ignored (``_start_method``'s ``_sigint_ignored``): the server inherits that
    across ``exec``, and its forks take it back from the server (multiprocessing/forkserver.py
    ``_serve_one`` restores the handlers the server started with), so every rank ignores SIGINT as a
    spawned one did. Started before ``spawn_ranks`` points ``tempfile`` at the caller's folder: the
    server's socket lives in multiprocessing's own temporary folder (``util.get_temp_dir``, removed at
    this process's exit), which must outlast the run's folder, since the server serves later launches
    too. From the main thread the server is told its starter (``server_guard.STARTER``) and dies with
    this process; the kernel ties that to the starting thread, so a server started from another thread
    is not (it then lives until its last rank is gone, as multiprocessing's own)."""
    from multiprocessing import forkserver

    from memplan.measure.distributed.launch.server_guard import STARTER

    own = [fn.__module__] if fn.__module__ != "__main__" else []
    forkserver.set_forkserver_preload([*PRELOAD, *own])
    if main:
        os.environ[STARTER] = str(os.getpid())
    try:
        forkserver.ensure_running()
    finally:
        os.environ.pop(STARTER, None)


def spawn_ranks(
    fn: Callable[..., None], args: tuple[Any, ...], nproc: int, timeout_s: float, tmp: str | None = None
) -> None:
    """Run ``fn(rank, *args)`` in ``nproc`` processes (forks of the fork server) and wait for all of them.

    Every way out stops every rank: a rank that raised or died (RuntimeError with its last error line), a
    run past ``timeout_s`` (TimeoutError: a hung collective, a rank stopped by SIGSTOP), SIGINT in the
    parent (KeyboardInterrupt), SIGTERM or SIGHUP (``Interrupted``; held while the ranks start,
    ``_stops_deferred``). The ranks still alive are then killed with SIGKILL, which also ends a stopped
    process (SIGTERM would wait until it is continued), and reaped, so that nothing is left running and
    the parent's exit does not wait on them. torch's per-rank error files go to ``tmp`` (removed by the
    caller) rather than ``$TMPDIR``. Main thread only (signal handlers)."""
    main = threading.current_thread() is threading.main_thread()
    method = _start_method(fn)
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
                    args=(fn, os.getpid(), dict(os.environ), *args),
                    nprocs=nproc,
                    join=False,
                    start_method=method,
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
