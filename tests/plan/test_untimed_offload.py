"""Offload on a GPU whose preset states no host link (GB200, GB300: NVLink-C2C to the Grace, no per-GPU
figure in a vendor source): ``estimate`` and ``compare`` give the memory and the verdict without a time,
saying why, and ``fit`` leaves offload's saver levels out with the reason — where each refused the whole
command (``fit -m 405b --gpus 8 --gpu gb200`` searched, then failed). ``time.offload.untimed`` is exactly
when ``timing`` refuses."""

from __future__ import annotations

import json
import shlex

import pytest
from typer.testing import CliRunner

from memplan.api import build_setup
from memplan.cli.app import app
from memplan.config import Offload
from memplan.engine import estimate
from memplan.presets import gpu_names, load_gpu
from memplan.time.offload import untimed
from memplan.time.timing import timing

runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})
REASON = (
    "gb200 states no host_link_gbps, which times --offload; add host_link_gbps = GB/s to the GPU file "
    "(docs/step-time.md)"
)


def _run(command: str) -> tuple[int, str]:
    out = runner.invoke(app, shlex.split(command))
    return out.exit_code, out.stdout + out.stderr


@pytest.mark.parametrize(
    "offload", [Offload.OPTIMIZER, Offload.PARAMS, Offload.ACTIVATIONS, Offload.OPTIMIZER | Offload.PARAMS]
)
def test_untimed_is_exactly_when_timing_refuses(offload: Offload) -> None:
    zero = 3 if Offload.PARAMS in offload else 0
    setup = build_setup("tiny", seq=64, zero=zero)
    p = estimate(setup.model_copy(update={"offload": offload}))
    for name in gpu_names():
        gpu = load_gpu(name)
        expected = untimed(offload, gpu)
        if expected is None:
            assert timing(p, gpu).step_time_s > 0
        else:
            with pytest.raises(ValueError) as refused:
                timing(p, gpu)
            assert str(refused.value) == expected
    assert untimed(offload, load_gpu("gb200")) == f"gpu: {REASON}"
    assert untimed(Offload.NONE, load_gpu("gb200")) is None


def test_estimate_gives_the_memory_and_verdict_without_a_time() -> None:
    common = "estimate -m 8b --seq 4096 --offload optimizer --json"
    code, out = _run(f"{common} --gpu gb200")
    assert code == 0, out
    doc = json.loads(out)
    assert doc["time"] is None and doc["fit"]["fits"]
    assert f"not timed: {REASON}" in doc["verdict"]["notes"]
    timed = json.loads(_run(f"{common} --gpu h100-sxm")[1])  # a GPU with a host link: the same memory
    assert timed["time"]["step_time_s"] > 0
    assert doc["memory"]["peak"] == timed["memory"]["peak"]
    code, out = _run("estimate -m 8b --seq 4096 --offload optimizer --gpu gb200")
    assert code == 0 and "NB: not timed: gb200 states no host_link_gbps" in " ".join(out.split())
    # a time asked for is refused, in one line, as before
    code, out = _run("estimate -m 8b --seq 4096 --offload optimizer --gpu gb200 --mfu 0.4")
    assert code == 2 and out.strip() == f"error: gpu: {REASON}"


def test_compare_says_why_a_row_has_no_time() -> None:
    code, out = _run("compare -m 8b --seq 4096 --gpu gb200 --vary offload=none,optimizer")
    assert code == 0, out
    text = " ".join(out.split())
    assert f"– under step s: not timed, {REASON}" in text


def test_fit_leaves_offload_out_with_the_reason() -> None:
    """70B on one GB200: full training fits nowhere without offload, which the GPU cannot time, so its
    offload levels are not searched (said) and LoRA is searched next."""
    code, out = _run("fit -m 70b --seq 4096 --gpus 1 --gpu gb200 --json")
    assert code == 0, out
    full, lora = json.loads(out)["methods"]
    assert (full["method"], full["fits"], full["offload_not_searched"]) == ("full", False, REASON)
    assert full["savers_searched"] == ["none", "fused loss"]
    assert (lora["method"], lora["fits"], lora["offload_not_searched"]) == ("lora", True, None)
    code, out = _run("fit -m 70b --seq 4096 --gpus 1 --gpu gb200")
    text = " ".join(out.replace("│", " ").split())
    assert code == 0 and f"does not fit, with fused loss ({REASON})" in text
