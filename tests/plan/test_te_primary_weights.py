"""``--fp8-param-gather``: Megatron's float8 primary weights (blocks/te_fp8.py ``primary_elements``) — the
layers' linears keep their float8 copies only, and the distributed optimizer all-gathers them in float8 —
by hand, with its refusals."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memplan.cli.app import app

runner = CliRunner()

# Llama 3 70B on a rank of tp 4: h 8192, q = 64·128/4, kv = 8·128/4, f = 28672/4
H, Q, KV, F = 8192, 2048, 256, 7168
ELEMENTS = H * (Q + 2 * KV) + Q * H + H * 2 * F + F * H  # one layer's four linears on the rank
LAYERS = 10  # 80 layers over pp 8 × vpp 5 = 40 virtual stages of 2: five chunks of 2 on a rank
ARGV = (
    "estimate -m llama-3-70b --seq 8192 --batch 1 --global-batch 128 --gpus 64 --gpu h100-sxm "
    "--impl megatron --fp8 tensorwise --zero 1 --overlap-grad-reduce --overlap-param-gather "
    "--reduce-dtype bf16 --tp 4 --sp --pp 8 --vpp 5 --json"
)


def _run(extra: str = "") -> dict:  # type: ignore[type-arg]
    r = runner.invoke(app, (ARGV + extra).split())
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def test_the_layers_keep_no_16_bit_linear_weights() -> None:
    """213,909,504 linear elements a layer on the rank; without their bf16 copies the weights fall by 2 B
    each over the rank's ten layers; the float8 copies (the cache, now the parameters) stay."""
    assert ELEMENTS == 213_909_504
    plain, primary = _run(), _run(" --fp8-param-gather")
    assert plain["memory"]["weights"] - primary["memory"]["weights"] == 2 * ELEMENTS * LAYERS
    # nothing else moves: the gradients, the optimizer's fp32 main parameters and states, the activations
    for key in ("gradients", "optimizer", "activations"):
        assert plain["memory"][key] == primary["memory"][key], key


def test_the_distributed_optimizer_gathers_float8() -> None:
    """The once-a-step all-gather of the updated weights moves 1 byte, not 2, of each linear element; the
    gradients' reduce-scatter is unchanged."""
    rows = {
        extra: {r["collective"]: r["bytes"] for r in run["time"]["communication"] if r["dimension"] == "dp"}
        for extra, run in (("", _run()), ("fp8", _run(" --fp8-param-gather")))
    }
    assert rows[""]["all-gather"] - rows["fp8"]["all-gather"] == ELEMENTS * LAYERS
    assert rows[""]["reduce-scatter"] == rows["fp8"]["reduce-scatter"]


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        ("--impl megatron --zero 1 --dp 2", "it is Megatron's, with Transformer Engine's per-tensor float8"),
        ("--fp8 tensorwise --zero 1 --dp 2", "it is Megatron's, with Transformer Engine's per-tensor float8"),
        ("--impl megatron --fp8 mxfp8 --gpu b200 --zero 1 --dp 2", "per-tensor float8"),
        ("--impl megatron --fp8 tensorwise --zero 3 --dp 2", "with the distributed optimizer, --zero 1"),
        ("--impl megatron --fp8 delayed --dp 2", "with the distributed optimizer, --zero 1"),
    ],
)
def test_refused_where_not_modelled_in_one_line(flags: str, why: str) -> None:
    r = runner.invoke(app, ["estimate", "-m", "llama-3-8b", "--fp8-param-gather", *flags.split()])
    assert r.exit_code == 2
    line = r.stderr.strip()
    assert line.startswith("error: fp8_param_gather: --fp8-param-gather (float8 primary weights): ")
    assert why in line and "\n" not in line


def test_fit_searches_it_under_the_distributed_optimizer_and_its_rows_reproduce() -> None:
    """``fit --fp8-param-gather``: every row at ZeRO 1 (where it runs), its command carrying the flag and
    reproducing the row's step time."""
    argv = (
        "fit -m llama-3-8b --gpus 8 --gpu h100-sxm --impl megatron --fp8 tensorwise --fp8-param-gather "
        "--top 3 --json"
    )
    r = runner.invoke(app, argv.split())
    assert r.exit_code == 0, r.stderr
    configs = json.loads(r.stdout)["configs"]
    assert configs and all(
        c["settings"]["zero"] == 1 and "--fp8-param-gather" in c["command"] for c in configs
    )
    again = runner.invoke(app, [*configs[0]["command"].removeprefix("memplan ").split(), "--json"])
    assert json.loads(again.stdout)["time"]["step_time_s"] == configs[0]["time"]["step_time_s"]
