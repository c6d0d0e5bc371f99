"""``--fp8-param-gather``: Megatron's float8 primary weights (blocks/te_fp8.py ``primary_elements``) — the
layers' linears keep their float8 copies only, and the distributed optimizer (or Megatron FSDP, which
shards them) all-gathers them in float8 — by hand, with its refusals."""

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
        (
            "--impl megatron --zero 1 --dp 2",
            "it is Megatron's, with Transformer Engine's per-tensor or MXFP8",
        ),
        (
            "--fp8 tensorwise --zero 1 --dp 2",
            "it is Megatron's, with Transformer Engine's per-tensor or MXFP8",
        ),
        (
            "--impl megatron --fp8 mxfp8 --gpu b200 --zero 3 --dp 2",
            "with --fp8 mxfp8 it is modelled with the",
        ),
        (
            "--impl megatron --fp8 tensorwise --zero 2 --dp 2",
            "distributed optimizer (--zero 1) or Megatron FSDP",
        ),
        (
            "--impl megatron --fp8 delayed --dp 2",
            "distributed optimizer (--zero 1) or Megatron FSDP (--zero 3)",
        ),
    ],
)
def test_refused_where_not_modelled_in_one_line(flags: str, why: str) -> None:
    r = runner.invoke(app, ["estimate", "-m", "llama-3-8b", "--fp8-param-gather", *flags.split()])
    assert r.exit_code == 2
    line = r.stderr.strip()
    assert line.startswith("error: fp8_param_gather: --fp8-param-gather (float8 primary weights): ")
    assert why in line and "\n" not in line


# Megatron FSDP (--zero 3): Llama 3 8B over 8 GPUs, no tp: 32 layers of 4096·(4096 + 2·1024) + 4096·4096 +
# 4096·2·14336 + 14336·4096 linear elements; Ψ = 8,030,261,248 parameters
FSDP = (
    "estimate -m llama-3-8b --seq 8192 --batch 1 --global-batch 128 --gpus 8 --impl megatron "
    "--fp8 tensorwise --zero 3 --overlap-grad-reduce --overlap-param-gather --reduce-dtype bf16 --clip-grad "
    "--json --gpu "
)
LAYER_8B, PSI_8B = 218_103_808, 8_030_261_248


def _fsdp(gpu: str, extra: str = "") -> dict:  # type: ignore[type-arg]
    r = runner.invoke(app, (FSDP + gpu + extra).split())
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def test_megatron_fsdp_shards_the_float8_weights_and_caches_none() -> None:
    """Under Megatron FSDP the float8 data is the parameter, sharded with the rest: ⌈Ψ/8⌉ bf16 elements
    less ⌈Λ/8⌉ bytes (the linears' 1 byte, not 2), and per layer only the four modules' ``_scale_inv``
    (4 B each) and current scaling's quantizers (4 modules × 5 × (scale + amax), 160 B); without the flag
    TE caches every layer's rowwise and columnwise float8 weights (2 B an element) for the run."""
    linears = 32 * LAYER_8B
    assert linears + 2 * 128_256 * 4096 + 65 * 4096 == PSI_8B
    sharded = -(-PSI_8B // 8) * 2
    primary, plain = _fsdp("h100-sxm", " --fp8-param-gather"), _fsdp("h100-sxm")
    assert primary["memory"]["weights"] == sharded - -(-linears // 8) + 32 * (4 * 4 + 160)
    assert plain["memory"]["weights"] == sharded + 32 * (2 * LAYER_8B + 4 * 4 + 160)
    for key in ("gradients", "optimizer", "activations"):
        assert plain["memory"][key] == primary["memory"][key], key


def test_megatron_fsdp_gathers_float8_and_transposes_it_on_hopper() -> None:
    """Every forward and backward all-gather moves the linears' 1 byte an element (the 16 micro-batches'
    rows 1 byte less an element than without the flag); after each backward gather TE transposes the
    gathered float8 data on Hopper (1 byte read, 1 written an element: 2·Λ·16 bytes a step at 0.80 of
    HBM) — not on Blackwell, whose float8 GEMMs read it as it is."""
    linears = 32 * LAYER_8B
    for gpu in ("h100-sxm", "b200"):
        plain, primary = _fsdp(gpu), _fsdp(gpu, " --fp8-param-gather")
        rows = [
            {(r["collective"], r["phase"]): r for r in d["time"]["communication"]} for d in (plain, primary)
        ]
        for key, row in rows[0].items():
            less = linears if key[0] == "all-gather" else 0
            assert row["bytes"] - rows[1][key]["bytes"] == less and row["count"] == 16, key
    h100 = _fsdp("h100-sxm", " --fp8-param-gather")["time"]["predicted"]["dp_copies_s"]
    assert h100 == pytest.approx(2 * linears * 16 / (0.80 * 3350e9), rel=1e-12)
    assert _fsdp("b200", " --fp8-param-gather")["time"]["predicted"]["dp_copies_s"] == 0


def test_a_gathered_layer_holds_its_float8_copies() -> None:
    """The gathered layer (ZeRO-3's unit) holds its linears as float8 data and, on Hopper, the transpose
    made from it: 2 bytes an element, as the bf16 copy would (no saving); 1 byte on Blackwell."""
    from memplan.api import build_setup
    from memplan.blocks import te_fp8
    from memplan.config import ImplConfig

    base = build_setup("llama-3-8b", zero=3, dp=8)
    for any_layout, saving in ((False, 0), (True, LAYER_8B)):
        impl = ImplConfig(impl="megatron", fp8="tensorwise", fp8_param_gather=True, fp8_any_layout=any_layout)
        setup = base.replaced(impl=impl)
        assert te_fp8.fsdp_primary(setup) and te_fp8.gathered_saving(setup, setup.model) == saving


def test_mxfp8_primary_weights_keep_no_16_bit_linears_and_gather_in_16_bit() -> None:
    """MXFP8 under the distributed optimizer (Megatron's --reuse-grad-buf-for-mxfp8-param-ag, Bridge's
    MXFP8 recipe): the linears' parameters are the MXFP8 copies TE would cache, their 16-bit values live in
    the gradient buffer only while they are gathered — 2 B a linear element less over the 32 layers — and
    the all-gather moves 16-bit data, cast to MXFP8 on the copy out: its bytes and the step unchanged."""
    argv = (
        "estimate -m llama-3-8b --seq 8192 --batch 2 --global-batch 128 --gpus 8 --gpu b200 --impl megatron "
        "--fp8 mxfp8 --zero 1 --overlap-grad-reduce --overlap-param-gather --reduce-dtype bf16 --json"
    )
    runs = [runner.invoke(app, (argv + extra).split()) for extra in ("", " --fp8-param-gather")]
    plain, primary = (json.loads(r.stdout) for r in runs)
    assert plain["memory"]["weights"] - primary["memory"]["weights"] == 2 * 32 * LAYER_8B
    assert plain["time"]["communication"] == primary["time"]["communication"]
    assert plain["time"]["step_time_s"] == primary["time"]["step_time_s"]


def test_fit_searches_it_under_the_distributed_optimizer_and_its_rows_reproduce() -> None:
    """``fit --fp8-param-gather``: every row at ZeRO 1 or 3 (where it runs), its command carrying the flag
    and reproducing the row's step time."""
    argv = (
        "fit -m llama-3-8b --gpus 8 --gpu h100-sxm --impl megatron --fp8 tensorwise --fp8-param-gather "
        "--top 3 --json"
    )
    r = runner.invoke(app, argv.split())
    assert r.exit_code == 0, r.stderr
    configs = json.loads(r.stdout)["configs"]
    assert configs and all(
        c["settings"]["zero"] in (1, 3) and "--fp8-param-gather" in c["command"] for c in configs
    )
    again = runner.invoke(app, [*configs[0]["command"].removeprefix("memplan ").split(), "--json"])
    assert json.loads(again.stdout)["time"]["step_time_s"] == configs[0]["time"]["step_time_s"]
