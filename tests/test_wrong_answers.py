"""Issue #20, "wrong answers": inputs that used to print inf or crash with a traceback now give one line
naming the field, exit 2 (QLoRA's optimizer step: tests/test_optimizer_shapes.py; the overflowing term:
tests/plan/test_reserve.py; fit's layouts: tests/plan/test_fit.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.cli.app import app

runner = CliRunner(env={"COLUMNS": "120", "NO_COLOR": "1"})
H100 = Path(__file__).resolve().parents[1] / "presets" / "gpus" / "h100-sxm.toml"


def _gpu_file(tmp_path: Path, line: str, value: str) -> Path:
    """h100-sxm.toml with ``line``'s value replaced by ``value`` (and a name of its own)."""
    text = H100.read_text().replace('name = "h100-sxm"', 'name = "custom"')
    out = [
        f"{line.split('=')[0].strip()} = {value}" if row.startswith(line) else row
        for row in text.splitlines()
    ]
    path = tmp_path / "custom.toml"
    path.write_text("\n".join(out) + "\n")
    return path


@pytest.mark.parametrize(("line", "field"), [("bf16 = ", "peak_tflops.bf16"), ("hbm_bandwidth_gbps", "hbm")])
@pytest.mark.parametrize("value", ["inf", "nan"])
def test_a_gpu_file_with_inf_or_nan_is_refused(tmp_path: Path, line: str, field: str, value: str) -> None:
    path = _gpu_file(tmp_path, line, value)
    for extra in ([], ["--json"]):
        r = runner.invoke(app, ["estimate", "-m", "gpt2", "--gpu", str(path), *extra])
        assert r.exit_code == 2, r.output
        lines = r.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: gpu file") and field in lines[0]


@pytest.mark.parametrize("mfu", ["1e-320", "5e-7", "0"])
def test_an_mfu_that_would_overflow_the_step_time_is_refused(mfu: str) -> None:
    r = runner.invoke(
        app, ["estimate", "-m", "7b", "--gpu", "h100", "--mfu", mfu, "--tokens", "1e12", "--json"]
    )
    assert (
        r.exit_code == 2
        and r.output.strip() == f"error: mfu: must be in [1e-06, 1], got {float(mfu)}; e.g. --mfu 0.4"
    )


def test_the_smallest_mfu_gives_finite_json() -> None:
    """At --mfu 1e-6 the step is 10⁶ × the FLOPs at peak: finite, and the JSON has no Infinity."""
    r = runner.invoke(
        app, ["estimate", "-m", "7b", "--gpu", "h100", "--mfu", "1e-6", "--tokens", "1e12", "--json"]
    )
    assert r.exit_code == 0
    t = json.loads(r.output, parse_constant=lambda c: pytest.fail(f"{c} in the JSON"))["time"]
    # step = model FLOPs / (1 device · 989.5e12 FLOP/s · 1e-6) with no recompute and no pipeline
    assert t["step_time_s"] == pytest.approx(t["model_flops_per_step"] / (989.5e12 * 1e-6), rel=1e-12)
    assert t["training_days"] == pytest.approx(1e12 / t["tokens_per_s"] / 86_400, rel=1e-12)


def test_fit_with_more_devices_than_any_layout_takes() -> None:
    r = runner.invoke(app, ["fit", "-m", "7b", "--gpu", "h100", "--gpus", str(1 << 40)])
    assert r.exit_code == 2
    assert r.output.strip().splitlines() == [
        "error: gpus: 1,099,511,627,776 devices need a data-parallel degree above 1,048,576 in every layout "
        "fit searches (tp ≤ 8, pp up to the 32 layers, cp ≤ 16); use at most --gpus 4,294,967,296"
    ]


@pytest.mark.parametrize(
    ("model", "setting"),
    [
        ("gemma-2-2b", ["--checkpointing", "selective"]),
        ("deepseek-v2-lite", ["--tp", "2", "--gpus", "2"]),
        ("gemma-2-2b", ["--fp8", "tensorwise"]),
        ("gemma-2-2b", ["--precision", "fsdp2-mixed", "--zero", "3", "--gpus", "2"]),
    ],
)
def test_a_refusal_offers_no_impl_that_cannot_run_the_model(model: str, setting: list[str]) -> None:
    """transformers' code refuses the setting; for a model whose structure only that code has, the other
    implementations refuse the model itself, so the fix is to drop the setting (before: "use --impl
    reference … or --impl megatron", which then failed too)."""
    r = runner.invoke(app, ["estimate", "-m", model, *setting])
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert "transformers' code" in lines[0] or "does not run FSDP2: use --precision bf16-mixed" in lines[0]
    assert "use --impl" not in lines[0] and "or torchtitan" not in lines[0]
    other = runner.invoke(app, ["estimate", "-m", model, "--impl", "reference"])
    assert other.exit_code == 2 and "transformers' code only" in other.output
