"""The ranks' placement by implementation (``time.comm.rows.order``): memplan's reference and Llama 3 place
the pipeline inside data parallelism ([TP, CP, PP, DP]); Megatron-core (``order="tp-cp-ep-dp-pp"``) and
torchtitan (mesh ``["pp", "dp_replicate", "dp_shard", "cp", "tp"]``) put it outermost. Which groups stay
inside an 8-GPU node follows, by hand."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memplan.api import build_setup
from memplan.cli.app import app
from memplan.config import Impl, Parallel
from memplan.time.comm.rows import stride

runner = CliRunner()


@pytest.mark.parametrize(
    ("impl", "tp", "cp", "pp", "dp"),
    [("reference", 4, 1, 8, 2), ("megatron", 4, 1, 8, 2), ("torchtitan", 2, 2, 4, 2), ("hf", 1, 1, 1, 8)],
)
def test_strides_by_hand(impl: str, tp: int, cp: int, pp: int, dp: int) -> None:
    setup = build_setup("llama-3-8b", parallel=Parallel(tp=tp, sp=tp > 1, cp=cp, pp=pp), dp=dp)
    setup = setup.replaced(impl=setup.impl.replaced(impl=Impl(impl)))
    outermost_pp = impl in ("megatron", "torchtitan")
    assert (stride(setup, "tp"), stride(setup, "cp")) == (1, tp)
    assert stride(setup, "pp") == (tp * cp * dp if outermost_pp else tp * cp)
    assert stride(setup, "dp") == (tp * cp if outermost_pp else tp * cp * pp)


def test_megatron_keeps_dp_in_the_node_and_sends_across() -> None:
    """Llama 3 70B at TP 4, PP 8 (VP 5), dp 2 on 64 H100s (Megatron-Bridge's layout): under Megatron's order
    the two data-parallel ranks are 4 apart, one node (tp·dp = 8), and the stages 8 apart, a node each;
    under the reference's the dp pair is 32 apart (two nodes) and the stages 4 apart (two to a node)."""
    argv = (
        "estimate -m llama-3-70b --seq 8192 --batch 1 --global-batch 128 --gpus 64 --gpu h100-sxm "
        "--tp 4 --sp --pp 8 --vpp 5 --zero 1 --json --impl "
    )
    links = {}
    for impl in ("megatron", "reference"):
        r = runner.invoke(app, (argv + impl).split())
        assert r.exit_code == 0, r.stderr
        rows = json.loads(r.stdout)["time"]["communication"]
        links[impl] = {row["dimension"]: row["link"] for row in rows if row["dimension"] in ("dp", "pp")}
    assert links["megatron"] == {"dp": "intra-node", "pp": "inter-node"}
    assert links["reference"] == {"dp": "inter-node", "pp": "intra-node"}
