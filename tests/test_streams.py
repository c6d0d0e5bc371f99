"""The process around a command (issue #20, "Data loss, hangs, leftovers"): the terminal's environment,
stdout closed, full or ASCII-only, configs nested or sized beyond reason, and a quiet exit.

The stream cases run ``python -m memplan`` in a subprocess (the console script's ``main``, with real file
descriptors: ``>&-``, ``/dev/full``); the config cases in-process.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.cli.app import app

ROOT = Path(__file__).resolve().parents[1]
ESTIMATE = ["estimate", "-m", "tiny", "--seq", "64"]


def memplan(
    *args: str, env: dict[str, str] | None = None, shell_redirect: str = ""
) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "PYTHONIOENCODING")}
    full_env = {**base, "PYTHONPATH": str(ROOT), "NO_COLOR": "1", **(env or {})}
    cmd = [sys.executable, "-m", "memplan", *args]
    if shell_redirect:  # a redirection only a shell makes (>&-: fd 1 closed)
        quoted = " ".join(f"'{c}'" for c in cmd)
        return subprocess.run(
            ["sh", "-c", f"{quoted} {shell_redirect}"],
            env=full_env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=60)


def one_error_line(stderr: str, start: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(start), stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize("columns", ["0", "-3", "wide"])
def test_an_invalid_terminal_width_is_unset(columns: str) -> None:
    done = memplan(*ESTIMATE, env={"COLUMNS": columns})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    # Unset and no terminal (stdout is a pipe here): rich's default of 80 columns, the panels filling them
    # (the verdict first, then the estimate's).
    assert lines[0].startswith("╭─ verdict") and max(len(line) for line in lines) == 80
    assert any(line.startswith("╭─ memplan estimate") for line in lines)


def test_stdout_closed_is_an_error_on_stderr() -> None:
    done = memplan(*ESTIMATE, shell_redirect=">&-")
    assert done.returncode == 2
    one_error_line(done.stderr, "error: stdout: it is closed")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("args", [ESTIMATE, [*ESTIMATE, "--json"], ["--help"]])
def test_stdout_on_a_full_disk_names_stdout(args: list[str]) -> None:
    done = memplan(*args, shell_redirect="> /dev/full")
    assert done.returncode == 2
    one_error_line(done.stderr, "error: stdout: cannot write the output: No space left on device;")


@pytest.mark.parametrize(
    ("args", "shown"),
    [
        (["--help"], "Usage: memplan"),
        (ESTIMATE, "memplan estimate"),
        (["estimate", "--help"], "Usage: memplan estimate"),
        (["gpus"], "GPU presets"),
    ],
)
def test_an_ascii_only_stdout_gets_ascii_output(args: list[str], shown: str) -> None:
    done = memplan(*args, env={"PYTHONIOENCODING": "ascii"})
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and done.stdout.isascii()
    assert shown in done.stdout


# ---------------------------------------------------------------------------------------------------
# Configs beyond reason: one line naming the file (and the key), exit 2
# ---------------------------------------------------------------------------------------------------
runner = CliRunner()


@pytest.mark.parametrize(
    ("name", "text", "kind"),
    [
        ("deep.json", "[" * 10_000 + "]" * 10_000, "JSON"),
        ("deep.toml", "a = " + "[" * 10_000 + "]" * 10_000 + "\n", "TOML"),
        # Parsed just under Python's recursion limit: the walk over its numbers must not fail either.
        ("deep990.json", '{"a":' * 985 + "1" + "}" * 985, "JSON"),
    ],
    ids=["json", "toml", "json-just-parsed"],
)
def test_a_config_nested_10000_deep(tmp_path: Path, name: str, text: str, kind: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    result = runner.invoke(app, ["estimate", "-m", str(path), "--seq", "64"])
    assert result.exit_code == 2
    one_error_line(result.stderr, f"error: model file {path}: invalid {kind}: nested deeper")


LLAMA = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "num_hidden_layers": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
}


@pytest.mark.parametrize("value", [10**400, -(2**63) - 1, 2**63], ids=["10**400", "-2**63-1", "2**63"])
def test_a_size_beyond_64_bits(tmp_path: Path, value: int) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA, "hidden_size": value}))
    result = runner.invoke(app, ["estimate", "-m", str(path), "--seq", "64"])
    assert result.exit_code == 2
    digits = len(str(abs(value)))  # 10**400: 401 digits; 2**63 = 9223372036854775808: 19
    one_error_line(result.stderr, f"error: model file {path}: hidden_size: a {digits}-digit number, outside")


def test_the_largest_64_bit_size_is_not_refused_by_the_check(tmp_path: Path) -> None:
    """2**63 − 1 is inside the range: whatever follows, it is not the range's error."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA, "hidden_size": 2**63 - 1}))
    result = runner.invoke(app, ["estimate", "-m", str(path), "--seq", "64"])
    assert "outside the 64-bit integers" not in result.output


# ---------------------------------------------------------------------------------------------------
# A quiet exit: objects of an extension imported before the CLI's gc.freeze() are collected at exit
# ---------------------------------------------------------------------------------------------------
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (nanobind bindings)")
def test_no_nanobind_leak_report_at_exit() -> None:
    # The test suite's order: triton (through peft, bitsandbytes) first, then memplan's CLI.
    done = subprocess.run(
        [sys.executable, "-c", "import triton; import memplan.cli"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "nanobind" not in done.stderr, done.stderr[:500]
