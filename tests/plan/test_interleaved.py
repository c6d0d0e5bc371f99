"""Interleaved 1F1B with uneven virtual stages: ``--pp-layers`` lists the p·m virtual stages in model order
(Megatron's ``--pipeline-model-parallel-layout``), 0 for a chunk of the embedding or head alone (Llama 3
405B, Dubey et al. 2024 §3.3.2)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memplan.cli.app import app
from memplan.config import ModelConfig, Parallel, Setup, TrainingConfig
from memplan.engine import estimate
from memplan.strategies.pipeline_parallel import Group, chunk_layers, stage_layers

TINY = ModelConfig(name="tiny", hidden_size=64, num_layers=14, num_heads=4, vocab_size=128, ffn_size=176)
VIRTUAL = (0, *[1] * 14, 0)  # 4 ranks × 4 chunks: the first chunk the embedding, the last the head


def setup(parallel: Parallel, micro_batches: int = 8) -> Setup:
    return Setup(
        model=TINY,
        training=TrainingConfig(seq_len=32, grad_accum=micro_batches),
        parallel=parallel,
    )


def test_virtual_stages_go_round_robin_over_the_ranks() -> None:
    """Virtual stage v = k·p + i is chunk k of rank i (Narayanan et al. 2021 §2.2.1)."""
    par = Parallel(pp=4, vpp=4, pp_layers=VIRTUAL)
    assert chunk_layers(14, par) == ((0, 1, 1, 1), (1, 1, 1, 1), (1, 1, 1, 1), (1, 1, 1, 0))
    assert stage_layers(14, par) == (3, 4, 4, 3)


def test_in_flight_layers_follow_megatrons_warm_up() -> None:
    """Megatron's interleaved warm-up on rank i: 2(p − i − 1) + (m − 1)·p forwards, then one more before
    the first backward; forward j runs chunk (j mod p·m) // p. p 4, m 4, 8 micro-batches:
    rank 0: 19 forwards, chunks 0,0,0,0 | 1×4 | 2×4 | 3×4 | 0,0,0 → 12 layers (chunk 0 is the embedding);
    rank 1: 17 forwards of one layer → 17; rank 3: 13 forwards, the last on chunk 3 (the head) → 12."""
    p = estimate(setup(Parallel(pp=4, vpp=4, pp_layers=VIRTUAL)))
    got = {st.stage.index: st.counts[Group.LAYER] for st in p.stages}
    assert got == {0: 12, 1: 17, 3: 12}
    assert {st.stage.index: st.stage.chunks for st in p.stages} == {0: 19, 1: 17, 3: 13}
    # RoPE tables and masks are made by chunks that run layers only
    assert {st.stage.index: st.counts[Group.STAGE] for st in p.stages} == {0: 12, 1: 17, 3: 12}


def test_an_even_list_is_the_even_default() -> None:
    even = estimate(setup(Parallel(pp=2, vpp=7)))
    listed = estimate(setup(Parallel(pp=2, vpp=7, pp_layers=(1,) * 14)))
    assert [s.counts for s in even.stages] == [s.counts for s in listed.stages]
    assert even.peak == listed.peak


def test_uneven_vpp_without_a_list_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"list the 16 virtual stages' layers with --pp-layers"):
        estimate(setup(Parallel(pp=4, vpp=4)))


@pytest.mark.parametrize(
    ("pp_layers", "message"),
    [
        ((0, 1, 1, 1) * 4, "every pipeline rank needs at least one layer"),  # rank 0 holds none
        ((-1, *[1] * 14, 1), "every pipeline rank needs at least one layer"),
        ((1, 2, 3), r"give one layer count per stage, or one per virtual stage \(16\)"),
    ],
)
def test_bad_virtual_lists(pp_layers: tuple[int, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Parallel(pp=4, vpp=4, pp_layers=pp_layers)


def test_the_cli_takes_a_virtual_stage_list() -> None:
    """Llama 3 405B as the paper places it: 16 ranks × 8 one-layer chunks, the first chunk the embedding
    alone and the last the head alone (Dubey et al. 2024 §3.3.2). The second rank holds 2·14 + 7·16 + 1 =
    141 one-layer chunks at the end of its warm-up (Megatron's count), the first 7 × 16 = 112 (its chunk 0
    has no layer), the last 112 (its 7 one-layer chunks × 16 micro-batches; the 113th forward is the head's
    chunk)."""
    layers = ",".join(["0", *["1"] * 126, "0"])
    args = ["estimate", "-m", "llama-3.1-405b", "-s", "8192", "--tp", "8", "--sp", "--pp", "16", "--vpp", "8"]
    args += ["--pp-layers", layers, "--dp", "64", "--grad-accum", "32", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    stages = {s["stage"]: s for s in json.loads(result.stdout)["stages"]}
    assert {i: s["layers"] for i, s in stages.items()} == {0: 7, 1: 8, 15: 7}
    assert {i: s["in_flight_layers"] for i, s in stages.items()} == {0: 112, 1: 141, 15: 112}
