"""Output files under faults (issue #20, "Data loss, hangs, leftovers"): every file memplan writes is whole
or not there, an existing one survives a failed write, no temporary file is left, and the error is one line
naming the option and the file (exit 2).

A real full disk: a 64 KiB tmpfs mounted over a test folder (root only; skipped where mounting is not
permitted, e.g. in CI containers). Where it cannot be mounted, the same guarantees are checked with a
writer that fails with ENOSPC part-way (``files.write_with``'s own tests).
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.cli.app import app
from memplan.cli.streams import exit_on_termination
from memplan.files import replaced, write_with

runner = CliRunner()
OLD = b"the previous plot, 31 bytes...\n"


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs: a file system that really runs out of space."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True, check=False
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        # -l: PyTorch's trace writer keeps its failed file open (a leaked descriptor) until exit
        subprocess.run(["umount", "-l", str(disk)], check=False)


def fill(disk: Path, leave: int = 0) -> None:
    """Fill ``disk`` up to ``leave`` bytes free (a tmpfs counts whole 4 KiB pages)."""
    with open(disk / "filler", "wb") as f:
        try:
            while os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize > leave:
                f.write(b"\0" * 4096)
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


def one_error_line(stderr: str, *names: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: ") and "Traceback" not in stderr
    for name in names:
        assert name in lines[0], lines[0]
    return lines[0]


# ---------------------------------------------------------------------------------------------------
# memplan.files on its own: a writer failing part-way (the mocked ENOSPC that runs everywhere)
# ---------------------------------------------------------------------------------------------------
def test_a_failed_write_keeps_the_old_file_and_leaves_nothing(tmp_path: Path) -> None:
    target = tmp_path / "keep.svg"
    target.write_bytes(OLD)

    def half_then_full(path: str) -> None:
        with open(path, "wb") as f:
            f.write(b"<svg> half of a picture")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(ValueError) as exc:
        write_with(str(target), "plot", half_then_full)
    assert target.read_bytes() == OLD
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.svg"]
    msg = str(exc.value)
    assert msg.startswith(f"plot: cannot write {target}: No space left on device;") and "\n" not in msg


def test_a_complete_write_replaces_the_file_with_open_s_mode(tmp_path: Path) -> None:
    new, old = tmp_path / "new.txt", tmp_path / "old.txt"
    old.write_bytes(OLD)
    old.chmod(0o640)
    write_with(str(new), "plot", lambda p: Path(p).write_text("new"))
    write_with(str(old), "plot", lambda p: Path(p).write_text("replaced"))
    assert (new.read_text(), old.read_text()) == ("new", "replaced")
    umask = os.umask(0)
    os.umask(umask)
    # mkstemp makes 0o600 files; a plain open() gives 0o666 less the umask, a replaced file keeps its mode.
    assert (new.stat().st_mode & 0o777, old.stat().st_mode & 0o777) == (0o666 & ~umask, 0o640)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.txt", "old.txt"]


def test_another_error_of_the_writer_is_raised_as_it_was(tmp_path: Path) -> None:
    target = tmp_path / "keep.svg"
    target.write_bytes(OLD)
    with pytest.raises(KeyError), replaced(str(target), "plot") as tmp:
        Path(tmp).write_text("partial")
        raise KeyError("writer bug")
    assert target.read_bytes() == OLD
    assert [p.name for p in tmp_path.iterdir()] == ["keep.svg"]


def test_sigterm_while_writing_leaves_no_temporary(tmp_path: Path) -> None:
    """The CLI turns SIGTERM into SystemExit(143) (``cli.streams.exit_on_termination``): the write's clean-up
    runs. Python's default would end the process where it stands, the temporary file left behind."""
    target = tmp_path / "keep.svg"
    target.write_bytes(OLD)
    prior = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}

    def terminated_midway(path: str) -> None:
        Path(path).write_bytes(b"<svg> half of a picture")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(10)  # the handler raises during the sleep

    try:
        exit_on_termination()
        with pytest.raises(SystemExit) as exc:
            write_with(str(target), "plot", terminated_midway)
    finally:
        for sig, handler in prior.items():
            signal.signal(sig, handler)
    assert exc.value.code == 128 + signal.SIGTERM  # 143, the shell's code for a SIGTERM
    assert target.read_bytes() == OLD
    assert [p.name for p in tmp_path.iterdir()] == ["keep.svg"]


def test_a_link_is_written_through(tmp_path: Path) -> None:
    real, link = tmp_path / "real.svg", tmp_path / "link.svg"
    real.write_bytes(OLD)
    link.symlink_to(real)
    write_with(str(link), "plot", lambda p: Path(p).write_text("new"))
    assert link.is_symlink() and real.read_text() == "new"


# ---------------------------------------------------------------------------------------------------
# A real full disk (tmpfs)
# ---------------------------------------------------------------------------------------------------
def test_plot_over_an_existing_file_on_a_full_disk(small_disk: Path) -> None:
    pytest.importorskip("matplotlib")
    keep = small_disk / "keep.svg"
    keep.write_bytes(OLD)
    fill(small_disk)  # the stacked plot's SVG is ~50 KB: nothing of it fits
    result = runner.invoke(app, ["estimate", "-m", "tiny", "--seq", "64", "--plot", str(keep), "--json"])
    assert result.exit_code == 2, result.output
    line = one_error_line(result.stderr, "plot:", str(keep), "No space left on device")
    assert "unchanged" in line
    assert keep.read_bytes() == OLD
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler", "keep.svg"]
    assert result.stdout == ""  # nothing printed as if it had worked


def test_plot_that_fits_replaces_the_file(small_disk: Path) -> None:
    pytest.importorskip("matplotlib")
    keep = small_disk / "keep.svg"
    keep.write_bytes(OLD)
    result = runner.invoke(app, ["estimate", "-m", "tiny", "--seq", "64", "--plot", str(keep), "--json"])
    assert result.exit_code == 0, result.output
    assert keep.read_bytes().lstrip().startswith(b"<?xml") and keep.read_bytes().rstrip().endswith(b"</svg>")
    assert sorted(p.name for p in small_disk.iterdir()) == ["keep.svg"]


def test_torch_trace_writer_failing_on_a_full_disk_is_an_error(small_disk: Path) -> None:
    """Kineto's writer logs its failure and returns; its partial ``.tmp`` must not stay, nor pass."""
    torch = pytest.importorskip("torch")
    from memplan.measure.runs.profile import export_chrome_trace

    with torch.profiler.profile() as prof:
        for _ in range(300):  # some 600 events: a trace well over the 64 KiB of the disk
            torch.ones(4) + 1
    trace = small_disk / "t.json"
    with pytest.raises(ValueError) as exc:
        write_with(str(trace), "torch-trace", lambda p: export_chrome_trace(prof, p))
    assert str(exc.value).startswith(f"torch-trace: cannot write {trace}: No space left on device;")
    assert list(small_disk.iterdir()) == []


def test_profile_torch_trace_on_a_full_disk(small_disk: Path) -> None:
    pytest.importorskip("torch")
    trace = small_disk / "trace.json"
    # fp32: no bf16-speed note on stderr (it depends on this CPU, measured at run time)
    args = ["profile", "-m", "tiny", "--device", "cpu", "--seq", "16", "--steps", "1", "--warmup", "0"]
    args += ["--precision", "fp32"]
    result = runner.invoke(app, [*args, "--torch-trace", str(trace)], env={"COLUMNS": "120"})
    assert result.exit_code == 2, result.output
    one_error_line(result.stderr, "torch-trace:", str(trace))
    assert "✓" not in result.stdout and "profile" not in result.stdout
    assert list(small_disk.iterdir()) == []
