"""``memplan calibrate`` on CPU (small sizes): it measures, writes a GPU file that loads, and
``estimate --gpu FILE`` predicts with it."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from memplan.cli.app import app
from memplan.presets import load_gpu

runner = CliRunner(env={"COLUMNS": "120", "NO_COLOR": "1"})


def test_calibrate_on_cpu_writes_a_gpu_file_the_estimate_takes(tmp_path: Path) -> None:
    out = tmp_path / "mine.toml"
    r = runner.invoke(app, ["calibrate", "--gpu", "h100-sxm", "--out", str(out), "--small", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    gpu = load_gpu(str(out))
    assert gpu.name == "h100-sxm-calibrated"
    assert gpu.calibrated is not None
    assert gpu.calibrated.model_dump() == report["calibrated"]
    assert gpu.calibrated.device == "cpu"
    e = runner.invoke(app, ["estimate", "-m", "tiny", "--gpu", str(out), "--json"])
    assert e.exit_code == 0, e.output
    assert json.loads(e.stdout)["time"]["step_time_s"] > 0


def test_a_folder_is_refused_in_one_line(tmp_path: Path) -> None:
    r = runner.invoke(app, ["calibrate", "--gpu", "h100-sxm", "--out", str(tmp_path)])
    assert r.exit_code == 2
    assert (
        r.stderr.strip()
        == f"error: out: {tmp_path} is a folder; give a file name, e.g. --out {tmp_path / 'gpu.toml'}"
    )
