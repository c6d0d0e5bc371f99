"""``profile --nproc`` under faults (issue #20, "Data loss, hangs, leftovers"), with real processes and
real signals, each bounded in time:

- a rank stopped by SIGSTOP: after the timeout every rank is killed (SIGKILL ends a stopped process, the
  SIGTERM sent before the fix waited for a SIGCONT that never came, and the parent's exit then waited on it);
- SIGTERM to the parent while its ranks start, SIGINT to the whole foreground process group (a terminal's
  Ctrl-C) while they run: every rank killed, ``$TMPDIR/memplan-nproc-*`` and torch's error files removed,
  no traceback from any process, exit code 128 + the signal (143, 130) and one error line;
- a refusal of the one-process run (gpt2's attention dropout under the CPU flash kernel) comes before any
  rank is spawned;
- the rendezvous store listens on 127.0.0.1 only.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
from memplan.measure.distributed.launch import spawn
from memplan.measure.distributed.launch.spawn import free_port, local_store, spawn_ranks
from tests.measure import rank_targets

ROOT = Path(__file__).resolve().parents[2]


def gone(pid: int) -> bool:
    """The process has exited (absent, or a zombie waiting for a reaper that is not its parent)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state == "Z"


def _children(pid: int) -> list[tuple[int, bytes]]:
    """The child processes of ``pid`` with their command lines."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            cmd = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(text.rsplit(")", 1)[1].split()[1]) == pid:
            found.append((int(stat.parent.name), cmd))
    return found


def children(pid: int) -> list[int]:
    """The ranks ``pid`` started: the children of its fork server (``spawn.START_METHOD``: a child of
    ``pid`` running multiprocessing's forkserver main, whose forks carry its command line), or, where the
    server's socket path would not fit (``spawn._start_method``: a deep ``$TMPDIR``, as some tests give),
    its own children running multiprocessing's spawn main."""
    found = _children(pid)
    servers = [c for c, cmd in found if b"multiprocessing.forkserver" in cmd]
    spawned = [c for c, cmd in found if b"spawn_main" in cmd]
    return spawned + [r for server in servers for r, _ in _children(server)]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_stopped_rank_is_killed_after_the_timeout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's clock starts once rank 0 has seen rank 1 stopped (``rank_targets.stop_rank_1`` writes
    ``stopped``): ``spawn_ranks``'s own wait (``_join``) is entered then, not as the ranks start. Before, one
    15 s timeout from the start had to outlast two spawned interpreters importing torch (a few seconds idle,
    over 12 s at a load of 9 on 2 cores, measured) and the test then idled for the rest of it. The timeout,
    the TimeoutError, the SIGKILL of a stopped rank and the reaping are ``spawn_ranks``'s own, unchanged."""
    join = spawn._join
    entered: list[float] = []

    def join_once_stopped(ctx: Any, timeout_s: float) -> None:
        deadline = time.monotonic() + 120  # the ranks' start, however loaded the machine
        while not (tmp_path / "stopped").exists():
            assert time.monotonic() < deadline, "rank 1 did not stop"
            assert all(p.exitcode is None for p in ctx.processes), "a rank exited"
            time.sleep(0.02)
        entered.append(time.monotonic())
        join(ctx, timeout_s)

    monkeypatch.setattr(spawn, "_join", join_once_stopped)
    with pytest.raises(TimeoutError, match="ran past 2 s"):
        spawn_ranks(rank_targets.stop_rank_1, (str(tmp_path),), 2, timeout_s=2)
    # the kill and the reap do not wait on the stopped rank (SIGTERM waited for a SIGCONT that never came)
    assert time.monotonic() - entered[0] < 2 + 20
    pids = [int((tmp_path / f"rank{r}.pid").read_text()) for r in range(2)]  # both ranks had started
    assert all(gone(pid) for pid in pids), pids


def listeners(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp{,6} write them) of the sockets listening on ``port``."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():
            continue
        for row in Path(table).read_text().splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port:  # 0A: TCP_LISTEN
                out.append(local.rsplit(":", 1)[0])
    return out


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads /proc/net/tcp")
def test_the_rendezvous_store_listens_on_loopback_only() -> None:
    port = free_port()
    store = local_store(port, 0, 1)
    store.set("k", "v")
    # 127.0.0.1 in /proc/net/tcp: the address's bytes in host (little-endian) order, 0100007F. The store
    # torch makes itself listens on "::" (tcp6, all zeros) or 0.0.0.0 whatever MASTER_ADDR says.
    assert listeners(port) == ["0100007F"]
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass
    del store


WIDE = """\
name = "wide"
published_params = 31727616
source = "a test model: wide enough that a rank computes for seconds (h 512, 8 layers, SwiGLU 2048)"

[model]
name = "wide"
hidden_size = 512
num_layers = 8
num_heads = 4
num_kv_heads = 2
ffn_size = 2048
vocab_size = 256
tied_embeddings = false
norm = "rmsnorm"
mlp = "swiglu"
position = "rope"
"""


def run_env(tmp: Path, **more: str) -> dict[str, str]:
    """A memplan process's environment with ``tmp`` as its $TMPDIR, torch's own cache beside it.

    torch makes its inductor cache (``torchinductor_$USER``, kept across runs by design) in $TMPDIR when a
    process first imports dynamo, unless ``TORCHINDUCTOR_CACHE_DIR`` names one, which torch then sets in the
    importing process's environment: so it depended on what a worker had run before whether a child made
    it in ``tmp`` (a failure run alone, a pass in the suite). What must be left in $TMPDIR is nothing of
    the run's own."""
    cache = str(tmp.with_name(tmp.name + "-inductor-cache"))
    return {
        **os.environ,
        "TMPDIR": str(tmp),
        "PYTHONPATH": str(ROOT),
        "TORCHINDUCTOR_CACHE_DIR": cache,
        **more,
    }


def memplan_profile(tmp: Path, model: str = "tiny", seq: str = "16") -> subprocess.Popen[str]:
    args = ["profile", "-m", model, "--device", "cpu", "--seq", seq, "--nproc", "2"]
    return subprocess.Popen(
        [sys.executable, "-m", "memplan", *args],
        env=run_env(tmp, COLUMNS="100"),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a shell job: killpg below is the terminal's ^C
        preexec_fn=_terminal_sigint,
    )


def _terminal_sigint() -> None:
    """SIGINT at its default in the child, as a terminal's foreground job has it: a process inherits an
    ignored signal, and a pytest worker may have it ignored; memplan then keeps it ignored (so does every
    program started with it ignored, as a shell's background job is), and the run ignores the ^C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_for_ranks(proc: subprocess.Popen[str], n: int, within: float = 90) -> list[int]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        ranks = children(proc.pid)
        if len(ranks) == n:
            return ranks
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("the ranks did not start")


def check_stopped(proc: subprocess.Popen[str], ranks: list[int], tmp: Path, code: int, name: str) -> None:
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == code, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [f"error: nproc: interrupted ({name}); every rank was stopped"], err
    assert "✓" not in out
    deadline = time.monotonic() + 10
    while not all(gone(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(gone(pid) for pid in ranks)
    assert sorted(p.name for p in tmp.iterdir()) == []  # no memplan-nproc-*, no pytorch-errorfile-*


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_sigterm_while_the_ranks_start(tmp_path: Path) -> None:
    proc = memplan_profile(tmp_path)
    ranks = wait_for_ranks(proc, 2)
    proc.send_signal(signal.SIGTERM)  # the ranks are still importing torch
    check_stopped(proc, ranks, tmp_path, 128 + signal.SIGTERM, "SIGTERM")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_ctrl_c_to_the_process_group_while_the_ranks_run(tmp_path: Path) -> None:
    (tmp_path / "wide.toml").write_text(WIDE)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    # The wide model at 4,096 tokens runs for some 17 s after rank 0's store listens (measured unloaded; the
    # tiny one is done in a moment). At 256 tokens that was 4.6 s, and once a loaded machine's poll saw the
    # store late: the SIGINT came as the parent reaped the finished ranks (ignored then), exit code 0.
    proc = memplan_profile(tmp, str(tmp_path / "wide.toml"), "4096")
    ranks = wait_for_ranks(proc, 2)
    # Running: the rendezvous is up when rank 0's store listens (the ranks have imported torch), and the
    # parent has left ``spawn._sigint_ignored``: it ignores SIGINT until the last rank has read its
    # arguments from the pipe (seconds while that rank imports torch, spawn's NB), and rank 0 can listen
    # before then. Before, the test waited for the store alone: under load the SIGINT came inside that
    # window, and the run went on to its end (exit 0, or past the 30 s wait).
    deadline = time.monotonic() + 90
    while not (_listening(ranks[0]) and not _ignores_sigint(proc.pid)):
        assert proc.poll() is None, ("the run ended before the SIGINT", proc.returncode, proc.communicate())
        assert time.monotonic() < deadline
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGINT)  # the parent and both ranks, as a terminal's Ctrl-C
    check_stopped(proc, ranks, tmp, 128 + signal.SIGINT, "SIGINT")


def _ignores_sigint(pid: int) -> bool:
    """Whether ``pid`` ignores SIGINT (its ``SigIgn`` mask in /proc/PID/status: bit signum − 1)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGINT - 1) & 1)
    return False


def _listening(pid: int) -> bool:
    """Whether ``pid`` holds a listening TCP socket (rank 0's store: the rank is past torch's import)."""
    inodes = set()
    fds = Path(f"/proc/{pid}/fd")
    for fd in fds.iterdir() if fds.exists() else ():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            cols = row.split()
            if cols[3] == "0A" and cols[9] in inodes:
                return True
    return False


def test_one_process_refusals_come_before_any_rank(tmp_path: Path) -> None:
    """gpt2's attention dropout cannot run in the CPU flash kernel: refused by the parent, no rank spawned."""
    env = run_env(tmp_path)
    args = ["profile", "-m", "gpt2", "--device", "cpu", "--seq", "16", "--nproc", "2"]
    with subprocess.Popen(
        [sys.executable, "-m", "memplan", *args], env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True
    ) as p:
        spawned = set()
        while p.poll() is None:
            spawned |= set(children(p.pid))
            time.sleep(0.05)
        err = p.stderr.read() if p.stderr else ""
    assert p.returncode == 2 and not spawned, err
    assert err.startswith("error: dropout: gpt2's attention dropout") and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--torch-trace", "t.json"),
        ("--memory-snapshot", "s.pickle"),
        ("--timeline", None),
        ("--plot", "p.svg"),
    ],
)
def test_the_one_process_records_are_refused_with_nproc(tmp_path: Path, flag: str, value: str | None) -> None:
    """Before: silently left out (the command succeeded without writing the file asked for)."""
    from typer.testing import CliRunner

    from memplan.cli.app import app

    args = ["profile", "-m", "tiny", "--device", "cpu", "--seq", "16", "--nproc", "2", flag]
    result = CliRunner().invoke(app, [*args, *([str(tmp_path / value)] if value else [])])
    assert result.exit_code == 2, result.output
    name = flag.removeprefix("--")
    assert result.stderr == (
        f"error: {name}: recorded by the one-process run only; drop --{name} or run without --nproc\n"
    )
    assert list(tmp_path.iterdir()) == []


def test_a_stop_signal_is_held_while_the_ranks_start() -> None:
    """SIGTERM during ``start_processes`` waits until every rank has its arguments (a rank whose pipe the
    parent stopped writing printed an EOFError traceback), then raises ``Interrupted``; the handler
    before is back."""
    from memplan.measure.distributed.launch.spawn import Interrupted, _stops_deferred

    before = signal.getsignal(signal.SIGTERM)
    reached = False
    with pytest.raises(Interrupted) as stopped, _stops_deferred():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # Python runs the handler between bytecodes: it only records
        reached = True
    assert reached and stopped.value.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the fork server is POSIX's")
def test_ranks_are_forks_of_a_preloaded_server_with_the_callers_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each rank is forked by this process's fork server, which imported torch and memplan's distributed
    measurement once (spawn started a new interpreter per rank, 3 s of imports each); it still sees the
    caller's environment as it is at the launch, set after the server started, and ignores SIGINT."""
    spawn_ranks(rank_targets.describe, (str(tmp_path),), 2, timeout_s=120)  # the server runs from here on
    monkeypatch.setenv("MEMPLAN_RANK_PROBE", "set after the server started")
    spawn_ranks(rank_targets.describe, (str(tmp_path),), 2, timeout_s=120)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for s in seen:
        assert s["probe"] == "set after the server started"
        assert s["torch_preloaded"] and s["modules"] and s["sigint_ignored"]
        assert s["ppid"] != os.getpid()  # the server's fork, not this process's child
    assert seen[0]["ppid"] == seen[1]["ppid"]


KILLED_CALLER = """\
import sys
from memplan.measure.distributed.launch.spawn import spawn_ranks
from tests.measure import rank_targets

if __name__ == "__main__":
    spawn_ranks(rank_targets.stop_rank_1, (sys.argv[1],), 2, timeout_s=600)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_ranks_and_their_server_die_with_a_killed_caller(tmp_path: Path) -> None:
    """SIGKILL to the caller (nothing of it runs after) ends its fork server and both ranks, a stopped one
    too: the server dies with its starter (``server_guard``), each rank with the server. Before the guard,
    the ranks kept the server alive (each holds its "alive" pipe) and ran on, orphaned."""
    script = tmp_path / "caller.py"
    script.write_text(KILLED_CALLER)
    short = Path(tempfile.mkdtemp(prefix="mp-", dir="/tmp"))  # pytest's folders are too deep for its socket
    env = run_env(short)
    with subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env, cwd=ROOT) as p:
        deadline = time.monotonic() + 90
        while not (tmp_path / "stopped").exists():  # rank 0 has seen rank 1 stopped: both run
            assert p.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        servers = [c for c, cmd in _children(p.pid) if b"multiprocessing.forkserver" in cmd]
        pids = [int((tmp_path / f"rank{r}.pid").read_text()) for r in range(2)]
        p.kill()
    deadline = time.monotonic() + 10
    while not all(gone(pid) for pid in [*servers, *pids]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert servers and all(gone(pid) for pid in [*servers, *pids])
    shutil.rmtree(short)  # multiprocessing's folder in it is left by the killed caller
    shutil.rmtree(short.with_name(short.name + "-inductor-cache"), ignore_errors=True)  # run_env's


def test_a_deep_tmpdir_spawns_the_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fork server binds its socket in multiprocessing's folder in $TMPDIR; past AF_UNIX's path
    length ``bind`` fails ("AF_UNIX path too long", seen with pytest's folders), so the ranks are spawned."""
    from multiprocessing import util

    folder = "/tmp/" + "d" * (spawn.SOCKET_PATH_MAX - len("/tmp/") - len("/listener-xxxxxxxx") + 1)
    monkeypatch.setattr(util, "get_temp_dir", lambda: folder)
    assert spawn._start_method(rank_targets.describe) == "spawn"
    monkeypatch.setattr(util, "get_temp_dir", lambda: folder[:-1])
    assert spawn._server_socket_fits()  # one byte less fits
