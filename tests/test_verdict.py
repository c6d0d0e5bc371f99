"""``memplan estimate`` leads with the answer: the verdict panel (``--summary`` alone) and ``--json``'s
``verdict``. Every figure is checked against a hand derivation or against the estimate of the very command
the panel suggests, run through the CLI."""

from __future__ import annotations

import json
import shlex
import tomllib
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # (no stubs installed)
from typer.testing import CliRunner

from memplan.cli.app import app
from memplan.schema import estimate_schema

ENV = {"COLUMNS": "100", "NO_COLOR": "1"}
runner = CliRunner(env=ENV)
GPUS = Path(__file__).parents[1] / "presets" / "gpus"
GIB = 2**30
RESERVE = GIB  # --reserve's default, 1 GiB
N_70B = 70_553_706_496  # llama-3-70b's parameters (its preset's published count, and `presets show 70b`)


def _memory(gpu: str) -> int:
    """A GPU preset's memory_bytes, read from its file (not through memplan)."""
    return int(tomllib.loads((GPUS / f"{gpu}.toml").read_text())["memory_bytes"])


def _json(*args: str) -> dict[str, Any]:
    result = runner.invoke(app, ["estimate", *args, "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert isinstance(doc, dict)
    return doc


def _text(*args: str) -> str:
    result = runner.invoke(app, ["estimate", *args])
    assert result.exit_code == 0, result.output
    return " ".join(result.stdout.replace("│", " ").split())  # the panel's lines joined, borders dropped


def _gib(n: int) -> str:
    return f"{n / GIB:,.2f} GiB"


def test_70b_leads_with_the_verdict_against_the_largest_gpu_preset() -> None:
    doc = _json("--model", "70b", "--seq", "8192")
    v = doc["verdict"]
    jsonschema.validate(doc, estimate_schema())
    # The largest preset by memory, from the files: MI300X's 192 GiB (B200: 180 GiB, H200: 141 GiB).
    largest = max((p.stem for p in GPUS.glob("*.toml")), key=_memory)
    assert largest == "mi300x" and v["gpu"] == "mi300x" and not v["gpu_given"]
    assert v["usable_bytes"] == _memory("mi300x") - RESERVE == 191 * GIB
    assert v["peak"] == doc["memory"]["peak"] and not v["fits"]
    assert v["headroom"] == v["usable_bytes"] - doc["memory"]["peak"]
    # The three largest terms of the peak (loss backward: nothing freed yet): optimizer = fp32 master + m + v
    # = 12 B per parameter; activations = every saved tensor; weights = bf16, 2 B per parameter.
    assert v["terms"] == {
        "optimizer": 12 * N_70B,
        "activations": doc["memory"]["activations"],
        "weights": 2 * N_70B,
    }
    text = _text("--model", "70b", "--seq", "8192", "--summary")
    assert text.startswith("╭─ verdict")
    assert "does NOT fit on one mi300x" in text and f"peak {_gib(doc['memory']['peak'])}" in text
    assert f"optimizer {_gib(12 * N_70B)} (67%)" in text  # 846.6e9 / 1,261.5e9 = 0.671
    assert "Activations kept for backward" not in text  # --summary: the panel alone


def test_gpu_count_is_the_fewest_data_parallel_gpus_under_zero_3() -> None:
    v = _json("--model", "70b", "--seq", "8192")["verdict"]
    count = v["counts"][0]
    # By hand: ZeRO-3 shards 16 B per parameter (bf16 weights and gradients, 12 B of fp32 master and Adam
    # states) over dp; at dp 5 that is 70.55e9 × 16 / 5 = 225.8e9 B = 210.3 GiB > 191 GiB usable, so at
    # least 6 MI300X; 6 leave 191 − 175.2 = 15.8 GiB for the rest, which full checkpointing's saves
    # (80 layer inputs of 8192 × 8192 × 2 B = 10 GiB) need: its estimate fits.
    assert 16 * N_70B / 5 > 191 * GIB > 16 * N_70B / 6
    assert count["devices"] == count["dp"] == 6
    assert count["args"] == ["--zero", "3", "--dp", "6", "--checkpointing", "full"]
    six = _json("-m", "70b", "--seq", "8192", "--gpu", "mi300x", *count["args"])
    assert six["fit"]["fits"] and six["memory"]["peak"] == count["peak"]
    text = _text("--model", "70b", "--seq", "8192", "--summary")
    assert "needs 6 × mi300x with --zero 3 --dp 6 --checkpointing full" in text


def test_gpu_count_under_gpu_h100_and_the_largest_preset() -> None:
    v = _json("--model", "70b", "--seq", "8192", "--gpu", "h100")["verdict"]
    assert v["gpu"] == "h100-sxm" and v["gpu_given"] and v["usable_bytes"] == 79 * GIB
    h100, largest = v["counts"]
    assert largest["gpu"] == "mi300x" and largest["devices"] == 6
    # By hand, the sharded states alone: 70.55e9 × 16 / 79 GiB = 13.3 → at least 14 H100s; the estimate's
    # answer (17, with 10 GiB of checkpoints, the gathered layer and the loss) must fit, 16 must not.
    assert h100["dp"] >= 14 and h100["dp"] == 17
    base = ("-m", "70b", "--seq", "8192", "--gpu", "h100", "--checkpointing", "full", "--zero", "3")
    assert _json(*base, "--dp", "17")["fit"]["fits"]
    assert not _json(*base, "--dp", "16")["fit"]["fits"]


def test_every_suggestion_is_estimated_lowers_the_peak_and_its_command_says_so() -> None:
    doc = _json("--model", "70b", "--seq", "8192", "--gpu", "h100")
    found = doc["verdict"]["suggestions"]
    kinds = [s["args"][:2] for s in found]
    assert ["--zero", "3"] in kinds and ["--finetune", "lora"] in kinds
    assert ["--optimizer", "adamw-8bit"] in kinds and ["--checkpointing", "full"] in kinds
    assert found[-1]["command"][:2] == ["memplan", "fit"]
    for s in found:
        assert s["peak"] < doc["memory"]["peak"]  # never one that does not help
        if s["command"][1] != "estimate":
            continue
        ran = _json(*s["command"][2:])  # the printed command, run: its own estimate
        assert ran["memory"]["peak"] == s["peak"]
        assert ran["fit"]["fits"] is s["fits"]
    text = _text("--model", "70b", "--seq", "8192", "--gpu", "h100", "--summary")
    lora = next(s for s in found if s["args"] == ["--finetune", "lora"])
    assert f"no {_gib(lora['peak'])} {shlex.join(lora['command'])}" in text


def test_the_fit_suggestion_holds_a_layout_that_fits() -> None:
    found = _json("--model", "70b", "--seq", "8192", "--gpu", "h100")["verdict"]["suggestions"]
    fit = found[-1]
    gpus = int(fit["command"][fit["command"].index("--gpus") + 1])
    assert gpus == 32  # the power of two ≥ 17
    result = runner.invoke(app, [*fit["command"][1:], "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["configs"]  # the search finds at least one layout that fits


def test_suggestions_leave_out_what_is_already_set() -> None:
    found = _json("-m", "70b", "--seq", "8192", "--checkpointing", "full", "--optimizer", "sgd")["verdict"]
    kinds = [s["args"][:2] for s in found["suggestions"]]
    assert ["--checkpointing", "full"] not in kinds and ["--optimizer", "adamw-8bit"] not in kinds


def test_a_step_that_fits_names_the_smallest_preset_and_its_free_memory() -> None:
    doc = _json("--model", "gpt2")
    v = doc["verdict"]
    smallest = min((p.stem for p in GPUS.glob("*.toml")), key=_memory)
    assert smallest == "rtx-4090" and v["gpu"] == smallest and v["fits"]
    free = _memory("rtx-4090") - RESERVE - doc["memory"]["peak"]  # 24 GiB − 1 GiB − the peak
    assert v["headroom"] == free and v["counts"] == [] and v["suggestions"] == []
    text = _text("--model", "gpt2", "--summary")
    assert f"fits on one rtx-4090 with {_gib(free)} free" in text


def test_fits_under_gpu_says_so_without_suggestions() -> None:
    doc = _json("-m", "8b", "--gpu", "h100", "--finetune", "lora")
    v = doc["verdict"]
    assert v["fits"] and v["gpu"] == "h100-sxm" and v["suggestions"] == []
    assert v["headroom"] == 79 * GIB - doc["memory"]["peak"]


def test_summary_refuses_json() -> None:
    result = runner.invoke(app, ["estimate", "-m", "gpt2", "--summary", "--json"])
    assert result.exit_code == 2 and result.stderr.startswith("error: summary:")
