"""``--cp-rotate kv-gather``: Llama 3's context parallelism (Dubey et al. 2024 §3.3.2), Transformer Engine's
``AttnFuncWithCPAndKVAllGather`` — K/V all-gathered, one attention call per local chunk against the
gathered prefix, dK/dV reduce-scattered — by hand from strategies/context_parallel.py's and
time/attention.py's docstrings; and the non-causal grid rows it is rated with."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.api import build_setup
from memplan.cli.app import app
from memplan.config import CpRotate, Parallel
from memplan.presets import load_gpu
from memplan.strategies import context_parallel as cpx
from memplan.time import attention
from memplan.time import efficiency as eff

runner = CliRunner()
DATA = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "h200-ring.jsonl"


def gathered(cp: int = 8, seq: int = 65536, checkpointing: str = "none"):  # type: ignore[no-untyped-def]
    """Llama 3.1 8B (32 heads, 8 kv heads of 128), b 1, one rank of ``cp``."""
    return build_setup(
        "llama-3.1-8b",
        seq=seq,
        checkpointing=checkpointing,
        parallel=Parallel(cp=cp, cp_rotate=CpRotate.KV_GATHER),
    )


def test_gathers_in_forward_and_backward_and_reduce_scatters_the_gradients() -> None:
    setup = gathered()
    shard = 2 * 1 * 8 * (65536 // 8) * 128 * 2  # k and v of the rank, bf16
    assert cpx.kv_exchanges(setup) == [
        cpx.Exchange("forward", "all-gather", shard, 1),
        cpx.Exchange("backward", "all-gather", shard, 1),
        cpx.Exchange("backward", "reduce-scatter", shard, 1),
    ]
    rerun = cpx.kv_exchanges(gathered(checkpointing="full"))
    assert rerun[-1] == cpx.Exchange("recompute", "all-gather", shard, 1)


def test_its_collectives_are_exposed_rows_of_the_gathered_size() -> None:
    """Each row carries cp × the rank's shard (an all-gather's output, a reduce-scatter's input) and
    hides behind nothing; 32 layers, one micro-batch."""
    argv = "estimate -m llama-3.1-8b --seq 65536 --gpus 8 --cp 8 --cp-rotate kv-gather --gpu h100-sxm --json"
    r = runner.invoke(app, argv.split())
    assert r.exit_code == 0, r.stderr
    rows = [c for c in json.loads(r.stdout)["time"]["communication"] if c["dimension"] == "cp"]
    shard = 2 * 8 * 8192 * 128 * 2
    got = [(c["collective"], c["phase"], c["bytes"], c["count"], c["group"], c["overlaps"]) for c in rows]
    assert got == [
        ("all-gather", "forward", 8 * shard, 32, 8, "none"),
        ("all-gather", "backward", 8 * shard, 32, 8, "none"),
        ("reduce-scatter", "backward", 8 * shard, 32, 8, "none"),
    ]


def test_its_own_copies_by_hand() -> None:
    """``gather_bytes``, Q = 8,192 × 32 × 128 query elements, G = 8 × 8,192 × 8 × 128 gathered key
    elements, e = 2: forward the two reorders of k and v (2e a G element each) and the chunks' output copy
    (2e·Q); backward zeroed dK and dV (2e·G), the two reorders again (4e·G), dQ's copy (2e·Q), the chunks'
    dK/dV adds over their prefixes (2 × 3e × 17/16 of G) and dK/dV back in rank order (4e·G)."""
    q, g, e = 8192 * 32 * 128, 8 * 8192 * 8 * 128, 2
    forward = 2 * 2 * e * g + 2 * e * q
    backward = 2 * e * g + 4 * e * g + 2 * e * q + 2 * 3 * e * 17 * g // 16 + 4 * e * g
    assert cpx.gather_bytes(gathered()) == (forward, backward)
    assert cpx.elementwise_bytes(gathered()) == (forward, backward)
    assert cpx.elementwise_bytes(gathered(cp=1)) == (0, 0)


def test_a_chunk_runs_its_diagonal_causally_and_the_rest_at_the_long_row_rate() -> None:
    """cp 8 at s 65,536: each chunk holds s/2c = 4,096 queries, 1/16 of the rank's cells causal (at the
    4,096 row on a grid of 32 heads × 32 query tiles = 1,024: FA2_HOPPER_GRID's 0.274 / 0.231), the rest
    against the gathered prefix at the 65,536 non-causal row (0.354 / 0.323; 1,024 tiles: the full
    grid's); the fraction is FA2_HOPPER's × that mean over the table's 64k end (0.351 / 0.327)."""
    gpu = load_gpu("h100-sxm")
    for backward, (causal, other, end, paper) in enumerate(
        [((0.274, 0.354, 0.351, 0.35)), ((0.231, 0.323, 0.327, 0.32))]
    ):
        mean = 1 / ((1 / 16) / causal + (15 / 16) / other)
        got = attention.flash_fraction(gathered(), gpu, backward=bool(backward))
        assert got == pytest.approx(paper * mean / end, rel=1e-12)


def test_the_non_causal_grid_rows_are_the_h200_measurement() -> None:
    """FA2_HOPPER_NONCAUSAL_GRID: per query-tile count below 512, the median over the measured non-causal
    rows (benchmarks/data/h200-ring.jsonl ``smallgrid`` and ``longkv``) of their rate over
    FA2_HOPPER_NONCAUSAL's at their key length, rounded to three places."""
    rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines()]
    peak = 989.5e12
    ratios: dict[int, list[tuple[float, float]]] = {}
    for r in rows:
        if r["kind"] in ("smallgrid", "longkv") and not r["causal"]:
            full = [attention._log_interpolate(eff.FA2_HOPPER_NONCAUSAL, r["sk"], col) for col in (1, 2)]
            rate = (
                r["fwd_flops"] / r["fwd_s"] / peak / full[0],
                r["bwd_flops"] / r["bwd_s"] / peak / full[1],
            )
            ratios.setdefault(r["heads"] * r["sq"] // 128, []).append(rate)
    table = tuple(
        (tiles, *(round(statistics.median(x[i] for x in got), 3) for i in (0, 1)))
        for tiles, got in sorted(ratios.items())
        if tiles < 512
    )
    assert table == eff.FA2_HOPPER_NONCAUSAL_GRID
    # from 512 tiles the full grid's, within 4 %
    assert all(
        abs(f - 1) < 0.04 and abs(b - 1) < 0.04 for t, got in ratios.items() if t >= 512 for f, b in got
    )


def test_trace_and_profile_run_torchs_ring_only() -> None:
    with pytest.raises(ValueError, match=r"^cp-rotate: kv-gather .* use --cp-rotate allgather or alltoall$"):
        cpx.check_torch_ring(gathered())
    cpx.check_torch_ring(gathered(cp=1))


def test_fit_searches_each_given_kind_of_cp_under_the_given_impl_and_its_rows_reproduce() -> None:
    """``fit --cp-rotate allgather,kv-gather``: every cp > 1 layout in both kinds (the kv-gather one the
    faster at this cp 2: its rows' commands say which), every row's command with ``--impl megatron``."""
    argv = (
        "fit -m 8b --seq 65536 --gpus 16 --gpu h100-sxm --global-batch 16 --top 0 --checkpointing full "
        "--attention flash --micro-batches 1 --zero 3 --cp-rotate allgather,kv-gather --impl megatron --json"
    )
    r = runner.invoke(app, argv.split())
    assert r.exit_code == 0, r.stderr
    configs = json.loads(r.stdout)["configs"]
    kinds = {c["settings"]["cp_rotate"] for c in configs if c["settings"]["cp"] > 1}
    assert kinds == {"allgather", "kv-gather"}
    by = {(c["settings"]["cp"], c["settings"]["tp"], c["settings"]["cp_rotate"]): c for c in configs}
    ring, gather = by[(2, 1, "allgather")], by[(2, 1, "kv-gather")]
    assert gather["time"]["step_time_s"] < ring["time"]["step_time_s"]
    for c in (ring, gather, configs[0]):
        assert "--impl megatron" in c["command"]
        assert ("--cp-rotate kv-gather" in c["command"]) == (c["settings"]["cp_rotate"] == "kv-gather")
        again = runner.invoke(app, [*c["command"].removeprefix("memplan ").split(), "--json"])
        assert json.loads(again.stdout)["time"]["step_time_s"] == c["time"]["step_time_s"]


def test_fit_refuses_an_unknown_kind_in_one_line() -> None:
    r = runner.invoke(app, ["fit", "-m", "8b", "--gpus", "8", "--gpu", "h100-sxm", "--cp-rotate", "ring"])
    assert r.exit_code == 2
    assert r.stderr.strip() == (
        "error: cp-rotate: cannot read 'ring'; give a comma-separated list, e.g. "
        "--cp-rotate allgather,kv-gather"
    )


def test_the_kind_of_cp_is_not_taken_from_cached_pieces() -> None:
    """The per-rank pieces are shared between setups that differ only in ``--cp-rotate`` (their saved
    tensors are the same); the step time still follows each setup's own kind."""
    from memplan.api import Options, build

    def step(rotate: str) -> float:
        o = Options(model="llama-3.1-8b", seq=65536, cp=8, gpus=8, gpu="h100-sxm", cp_rotate=rotate)
        timing = build(o).timing
        assert timing is not None
        return timing.prediction.step_time_s

    ring = step("allgather")
    gather = step("kv-gather")
    assert gather != ring
    assert step("allgather") == ring
    assert step("kv-gather") == gather


def test_the_default_kind_is_the_implementations_own() -> None:
    """``--cp-rotate`` not given: Megatron-core's context parallelism is Transformer Engine's point-to-point
    ring (``--cp-comm-type`` default ``p2p``), memplan's per-block rotation ``alltoall``; every other
    implementation runs torch's ``context_parallel``, whose default is the all-gather. Without cp there is
    nothing to choose (``allgather``, the field's default, for every implementation). ``fit`` searches the
    implementation's own kind, and a row's command names a kind only where it is not the default."""

    def rotate(argv: str) -> str:
        r = runner.invoke(app, [*argv.split(), "--json"])
        assert r.exit_code == 0, r.stderr
        return str(json.loads(r.stdout)["setup"]["cp_rotate"])

    base = "estimate -m llama-3.1-8b --seq 65536 --gpus 8 --gpu h100-sxm"
    assert rotate(f"{base} --cp 8 --impl megatron") == "alltoall"
    assert rotate(f"{base} --cp 8") == "allgather"
    assert rotate(f"{base} --cp 8 --impl megatron --cp-rotate allgather") == "allgather"
    assert rotate(f"{base} --impl megatron") == rotate(base) == "allgather"
    argv = (
        "fit -m 8b --seq 65536 --gpus 16 --gpu h100-sxm --global-batch 16 --top 0 --checkpointing full "
        "--attention flash --micro-batches 1 --zero 3 --impl megatron --json"
    )
    r = runner.invoke(app, argv.split())
    assert r.exit_code == 0, r.stderr
    rings = [c for c in json.loads(r.stdout)["configs"] if c["settings"]["cp"] > 1]
    assert rings and {c["settings"]["cp_rotate"] for c in rings} == {"alltoall"}
    for c in rings[:2]:
        assert "--cp-rotate" not in c["command"]
        again = runner.invoke(app, [*c["command"].removeprefix("memplan ").split(), "--json"])
        assert json.loads(again.stdout)["setup"]["cp_rotate"] == "alltoall"
        assert json.loads(again.stdout)["time"]["step_time_s"] == c["time"]["step_time_s"]
