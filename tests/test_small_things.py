"""Issue #13 item 6: ``--version``, the benchmarks do not rewrite tracked docs unless asked."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from typer.testing import CliRunner

from memplan import __version__
from memplan.cli.app import app

ROOT = Path(__file__).resolve().parents[1]


def test_version() -> None:
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.strip() == f"memplan {__version__}"


def test_run_all_writes_only_with_write() -> None:
    text = (ROOT / "benchmarks" / "run_all.py").read_text(encoding="utf-8")
    assert '"--write"' in text and "if not args.write or args.no_write:" in text
    help_text = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run_all.py"), "--help"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    assert "--write" in help_text


def test_numpy_is_in_the_torch_extras() -> None:
    """Every extra that installs torch installs numpy too (torch warns "Failed to initialize NumPy")."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    with_torch = {
        n: deps for n, deps in extras["optional-dependencies"].items() if any("torch>" in d for d in deps)
    }
    assert {"profile", "test", "hf"} <= set(with_torch)
    assert all("numpy" in deps for deps in with_torch.values())
