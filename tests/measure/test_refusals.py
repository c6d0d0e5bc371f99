"""Issue #13: trace and profile refuse what cannot run, in one line, before allocating anything."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from typer.testing import CliRunner

from memplan.cli.app import app
from memplan.measure.runs import profile as prof_mod


def one_line_error(*args: str) -> str:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "100", "NO_COLOR": "1"})
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_available_memory_on_cpu_is_positive() -> None:
    free, where = prof_mod.available_memory("cpu")
    assert free > 0 and where


def test_profile_refuses_a_peak_above_the_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prof_mod, "available_memory", lambda dev: (2**20, "available host memory"))
    line = one_line_error("profile", "-m", "tiny", "--device", "cpu", "--seq", "64", "--steps", "1")
    assert line.startswith("error: memory: the estimate peaks at ")
    assert "but cpu has 1.00 MiB (available host memory)" in line and "--checkpointing full" in line


def test_profile_nproc_refuses_ranks_that_do_not_fit_the_host_together(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CPU the ranks share the host: their estimated peaks (each pipeline stage's own) add up, and the
    launch is refused before any rank starts when the sum exceeds what is available."""
    from memplan.api import Options, build
    from memplan.engine import at_stage
    from memplan.render.estimate import fmt_bytes

    monkeypatch.setattr(prof_mod, "available_memory", lambda dev: (2**20, "available host memory"))
    flags = ("-m", "tiny", "--device", "cpu", "--seq", "32", "--nproc", "4", "--pp", "2", "--grad-accum", "4")
    line = one_line_error("profile", *flags)
    est = build(Options(model="tiny", seq=32, pp=2, grad_accum=4, gpus=4, device="cpu")).result  # type: ignore[arg-type]
    total = 2 * (at_stage(est, 0).peak.bytes + at_stage(est, 1).peak.bytes)  # dp 2 replicas of 2 stages
    assert line.startswith(f"error: memory: the estimate peaks at {fmt_bytes(total)} (the sum of 4 ranks' ")
    assert "but cpu has 1.00 MiB (available host memory)" in line


def test_trace_refuses_a_shape_beyond_int64() -> None:
    line = one_line_error(
        "trace", "--model", "405b", "--seq", "16777216", "--batch", "1048576", "--attention", "eager"
    )
    assert line.startswith("error: seq: attn.probs would be 1048576 × 128 × 16777216 × 16777216")
    assert "--attention flash" in line


def test_trace_flash_dropout_on_cpu_names_what_to_add() -> None:
    line = one_line_error("trace", "--model", "gpt2", "--seq", "8")
    assert "add --attention eager or --dropout 0" in line
