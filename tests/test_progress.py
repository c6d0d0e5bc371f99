"""Progress bars on stderr (cli/progress.py), the CPU bf16 note and the achieved rate's unit."""

from __future__ import annotations

import functools
import io
import time

import pytest
from rich.console import Console
from typer.testing import CliRunner

from memplan.cli.app import app
from memplan.cli.measure import bf16_note
from memplan.cli.progress import Bar
from memplan.render.estimate import fmt_rate


def terminal() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=True, width=80, color_system=None), out


def test_a_bar_appears_on_a_terminal_once_the_work_passes_the_delay() -> None:
    console, out = terminal()
    with Bar("tracing", total=4, unit="layer passes", delay=0.0, console=console) as bar:
        for layer in range(3):
            bar.advance(description=f"forward layer {layer}")
        time.sleep(0.3)  # rich refreshes 10 times a second
    text = out.getvalue()
    assert "tracing" in text and "3/4 layer passes" in text and "forward layer 2" in text


def test_quick_work_draws_nothing() -> None:
    console, out = terminal()
    with Bar("tracing", total=4, delay=5.0, console=console) as bar:
        bar.advance()
    assert out.getvalue() == ""


def test_no_bar_unless_stderr_is_a_terminal() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=False)
    with Bar("searching", delay=0.0, console=console) as bar:
        bar.advance(0, "layouts")
        time.sleep(0.2)
    assert out.getvalue() == "" and not bar.on


def test_compare_and_fit_under_a_pipe_write_nothing_to_stderr() -> None:
    runner = CliRunner(env={"COLUMNS": "120", "NO_COLOR": "1"})
    compare = runner.invoke(app, ["compare", "-m", "gpt2", "--vary", "tp=1,2"])
    assert compare.exit_code == 0 and compare.stderr == ""
    fit = runner.invoke(app, ["fit", "-m", "gpt2", "--gpu", "h100", "--gpus", "2", "--json"])
    assert fit.exit_code == 0 and fit.stderr == ""


def test_bf16_note_says_how_slow_and_why() -> None:
    # The run of issue #20: gpt2 at seq 256 in bf16 at ~1 GFLOP/s; 532e9 FLOPs at 1e9 FLOP/s = 532 s.
    note = bf16_note(1e9, 5e9, 532 * 10**9)
    assert note is not None
    assert "1.00 GFLOP/s on this CPU against 5.00 GFLOP/s in fp32" in note
    assert "532.00 GFLOP take ≈ 532 s" in note and "--precision fp32" in note
    assert bf16_note(10e9, 5e9, 10**12) is None  # bf16 as fast as fp32 (AVX512-BF16, AMX): nothing to say
    assert bf16_note(2.6e9, 5e9, 10**12) is None  # within 2×: not called slow


def test_rates_print_in_a_readable_unit() -> None:
    assert fmt_rate(12.52e6) == "12.52 MFLOP/s"  # the tiny model on CPU (was "0.000 TFLOP/s")
    assert fmt_rate(3.2861e9) == "3.29 GFLOP/s"
    assert fmt_rate(989.5e12) == "989.50 TFLOP/s"
    assert fmt_rate(2.5e15) == "2.50 PFLOP/s"
    assert fmt_rate(5.0) == "5 FLOP/s"


def test_profile_nproc_shows_a_spinner_while_its_ranks_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """``profile --nproc``: the ranks report only at the end, so a spinner with the elapsed time runs on
    stderr meanwhile (a terminal, past the delay); the ranks' launch is stood in for by a 0.3 s wait."""
    from memplan.cli import nproc
    from memplan.measure.distributed import nproc as distributed

    console, out = terminal()
    monkeypatch.setattr(nproc, "Bar", functools.partial(Bar, delay=0.0, console=console))

    def launch(*_args: object, **_kw: object) -> list[object]:
        time.sleep(0.3)
        return []  # as a torchrun rank other than 0: nothing to print

    monkeypatch.setattr(distributed, "launch", launch)
    nproc.profile_distributed(2, "cpu", False, {"model": "tiny", "seq": 32})
    assert "profiling" in out.getvalue() and "2 ranks" in out.getvalue()
