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
    # --nproc 2: two gloo ranks time an all-reduce (the one spawn of this file)
    out = tmp_path / "mine.toml"
    args = ["calibrate", "--gpu", "h100-sxm", "--out", str(out), "--small", "--nproc", "2", "--json"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    gpu = load_gpu(str(out))
    assert gpu.name == "h100-sxm-calibrated"
    assert gpu.calibrated is not None
    assert gpu.calibrated.model_dump(mode="json") == report["calibrated"]
    assert gpu.calibrated.device == "cpu"
    # the eager element-wise chains, forward and backward, each a positive fraction of the HBM bandwidth
    chains = gpu.calibrated.elementwise or {}
    assert set(chains) == {"rmsnorm", "layernorm", "rotary", "swiglu", "gelu", "eager_core"}
    assert all(f > 0 and b > 0 for f, b in chains.values())
    # SDPA's causal pick by length (small: s 128, 256, 512), forward and backward fractions of the peak
    curve = gpu.calibrated.attention_curve or ()
    assert [s for s, _, _ in curve] == [128, 256, 512] and all(f > 0 and b > 0 for _, f, b in curve)
    assert gpu.calibrated.network_intra is not None
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


def test_more_ranks_than_the_node_is_refused_before_measuring(tmp_path: Path) -> None:
    out = tmp_path / "x.toml"
    r = runner.invoke(app, ["calibrate", "--gpu", "rtx-4090", "--out", str(out), "--nproc", "8"])
    assert r.exit_code == 2
    assert r.stderr.strip() == (
        "error: nproc: 8 ranks leave rtx-4090's node of 4; calibrate measures one node's link: --nproc ≤ 4"
    )
    assert not out.exists()
