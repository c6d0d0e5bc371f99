"""The fit search: what it claims about the configurations it lists, rejects and skips."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import pytest
from typer.testing import CliRunner

from memplan.api import build_setup
from memplan.cli.app import app
from memplan.config import Attention, Checkpointing, Parallel, Setup, ZeroStage
from memplan.presets import load_gpu, load_model_preset
from memplan.search.fit import Space, default_global_batch, fit, fits, layouts
from memplan.time.timing import timing

from .layout import plan
from .test_fit_search import run_json

SMALL = Space(micro_batches=(1, 2, 4))
# One xdist worker runs this file (pyproject.toml's --dist loadgroup), so that the four tests of the cached
# Llama-3-8B search below share one search.
pytestmark = pytest.mark.xdist_group("fit")


@functools.cache  # four tests search Llama-3-8B on 8 A100-40GBs alike (≈ 1.4 CPU s each); they only read it
def _search(name: str, seq: int, gpu: str, gpus: int, space: Space = SMALL):  # type: ignore[no-untyped-def]
    pm = load_model_preset(name)
    return fit(build_setup(pm.model, seq=seq), load_gpu(gpu), gpus, space=space)


def _replan(setup: Setup, zero: ZeroStage, micro_batch: int, n: int) -> Setup:
    return setup.model_copy(
        update={
            "training": setup.training.model_copy(update={"micro_batch": micro_batch, "grad_accum": n}),
            "strategy": setup.strategy.model_copy(update={"zero": zero}),
        }
    )


def test_listed_configs_fit_and_higher_zero_stages_fit_too() -> None:
    result = _search("llama-3-8b", 8192, "a100-40gb", 8)
    memory = result.usable
    assert result.fitting and result.best is result.fitting[0]
    for c in result.fitting:
        assert c.result.device.peak.bytes <= memory
        for z in ZeroStage:
            if z > c.family.zero:  # not listed, claimed to fit as well
                s = _replan(c.result.setup, z, c.micro_batch, c.result.micro_batches)
                assert plan(s).device.peak.bytes <= memory


def test_each_listed_config_is_its_fastest_zero_stage() -> None:
    """A higher ZeRO stage can be the faster one (each rank steps the optimizer on its 1/dp of the
    parameters): every listed configuration is the fastest of its stages that fit, ties to the lowest, and
    on this cluster at least one listed row is above the lowest stage that fits. Every configuration that
    fits is listed (keep 0: nothing pruned), not only those that can be among the fastest."""
    result = _search("llama-3-8b", 8192, "a100-40gb", 8, dataclasses.replace(SMALL, keep=0))
    memory, above_lowest = result.usable, 0
    for c in result.fitting:
        if c.result.setup.strategy.dp == 1:
            continue
        lowest_fitting = True
        for z in ZeroStage:
            if z == c.family.zero:
                continue
            q = plan(_replan(c.result.setup, z, c.micro_batch, c.result.micro_batches))
            # the search's own judgement: what the allocator reserves, not the allocated peak alone (a stage
            # whose allocated peak is within the memory can still not fit once its segments are counted)
            if not fits(q, memory, result.gpu):
                continue
            t = timing(q, result.gpu).step_time_s
            assert t >= c.timing.step_time_s if z > c.family.zero else t > c.timing.step_time_s
            lowest_fitting &= z > c.family.zero
        above_lowest += not lowest_fitting
    assert above_lowest


def test_rejected_families_fit_at_no_micro_batch() -> None:
    result = _search("llama-3-8b", 8192, "a100-40gb", 8)
    memory = result.usable
    assert result.rejected
    for r in result.rejected:
        par = r.family.layout.parallel
        for b in SMALL.micro_batches:
            if result.global_batch % (b * r.family.layout.dp):
                continue
            n = result.global_batch // (b * r.family.layout.dp)
            base = build_setup(result.setup.model, seq=8192)
            s = base.model_copy(
                update={
                    "training": base.training.model_copy(update={"micro_batch": b, "grad_accum": n}),
                    "strategy": base.strategy.model_copy(
                        update={
                            "checkpointing": r.family.checkpointing,
                            "attention": r.family.attention,
                            "zero": r.family.zero,
                            "dp": r.family.layout.dp,
                        }
                    ),
                }
            )
            # judged on what the allocator reserves (budget.fits): the peak, then the replay
            assert not fits(plan(s, par), memory, result.gpu)
        assert not r.verdict.fits and r.verdict.overflow is not None


def test_ranking_is_by_throughput() -> None:
    result = _search("llama-3-8b", 8192, "a100-40gb", 8)
    speeds = [c.timing.tokens_per_s for c in result.fitting]
    assert speeds == sorted(speeds, reverse=True)
    # Full checkpointing re-runs the forward: never faster than the same layout without recompute.
    best = {}
    for c in result.fitting:
        key = (c.family.layout, c.family.attention)
        best.setdefault((key, c.family.checkpointing), c.timing.tokens_per_s)
    for (key, ckpt), speed in best.items():
        if ckpt is Checkpointing.FULL and (key, Checkpointing.NONE) in best:
            assert speed < best[(key, Checkpointing.NONE)]


def test_lower_bound_never_exceeds_the_peak() -> None:
    pm = load_model_preset("llama-3-70b")
    for ckpt, attention, zero, (tp, pp), b in itertools.product(
        (Checkpointing.NONE, Checkpointing.SELECTIVE, Checkpointing.FULL),
        tuple(Attention),
        tuple(ZeroStage),
        ((1, 1), (8, 1), (4, 4), (2, 8)),
        (1, 4),
    ):
        s = build_setup(
            pm.model, seq=4096, batch=b, grad_accum=8, checkpointing=ckpt.name.lower(), zero=zero, dp=8
        )
        s = s.model_copy(update={"strategy": s.strategy.model_copy(update={"attention": attention})})
        for stage in plan(s, Parallel(tp=tp, sp=tp > 1, pp=pp)).stages:
            assert stage.lower_bound <= stage.peak.bytes


def test_layouts_split_the_devices_exactly() -> None:
    pm = load_model_preset("mixtral")
    base = build_setup(pm.model, seq=4096)
    found = layouts(base, 32, Space())
    assert found
    for lay in found:
        par = lay.parallel
        assert par.tp * par.pp * lay.dp == 32 and par.tp <= 8
        assert 8 % par.ep == 0 and lay.dp % par.ep == 0 and par.sp == (par.tp > 1)
    assert {lay.parallel.ep for lay in found} == {1, 2, 4, 8}


def test_longest_sequence_is_the_boundary() -> None:
    result = _search("llama-3-8b", 8192, "a100-40gb", 8)
    best, longest = result.best, result.max_seq
    assert best is not None and longest is not None
    p = best.result
    step = p.parallel.tp if p.parallel.sp else 1
    if p.parallel.cp > 1:  # 2·cp chunks, each rank's s/cp split over tp: cp·lcm(2, tp)
        step = p.parallel.cp * math.lcm(2, step)

    def at(seq: int) -> bool:
        n = p.micro_batches * p.setup.training.micro_batch
        training = p.setup.training.model_copy(update={"seq_len": seq, "micro_batch": 1, "grad_accum": n})
        return fits(plan(p.setup.model_copy(update={"training": training}), p.parallel), result.usable, gpu)

    # judged as the search judges (budget.fits with the GPU: the allocator's reserved peak)
    gpu = result.gpu
    assert at(longest) and not at(longest + step)


@pytest.mark.parametrize(("seq", "gpus", "expected"), [(4096, 64, 1024), (2048, 8, 2048), (8192, 1024, 1024)])
def test_default_global_batch_is_about_4m_tokens(seq: int, gpus: int, expected: int) -> None:
    assert default_global_batch(seq, gpus) == expected


def test_nothing_fits_says_why() -> None:
    result = _search("llama-3.1-405b", 4096, "rtx-4090", 2)
    assert not result.fitting and result.max_seq is None
    assert all(r.verdict.overflow == "weights" for r in result.rejected if r.family.zero == ZeroStage.NONE)


def test_zero_stages_are_not_searched_over_one_data_parallel_rank() -> None:
    # 8 GPUs at tp 8: dp 1, where ZeRO shards nothing (the same states, no gather): one family, not four.
    result = _search("llama-3-70b", 8192, "h100-sxm", 8)
    single = [r.family for r in result.rejected if r.family.layout.dp == 1]
    assert single and all(f.zero == ZeroStage.NONE for f in single)
    assert any(r.family.zero > ZeroStage.NONE for r in result.rejected if r.family.layout.dp > 1)


def test_fit_lists_only_layouts_estimate_takes() -> None:
    """Issue #20: `fit --gpus 1000000000` recommended dp 3,906,250, which `estimate` refuses (dp ≤ 2²⁰).
    On 2²⁸ devices every row fit lists has dp ≤ 2²⁰ and tp · cp · pp · dp = 2²⁸, and estimate takes its
    setup as it is; past tp 8 × pp 32 (one layer a stage) × cp 16 × 2²⁰ = 2³² nothing is searchable."""
    from memplan.config.strategy import MAX_DP
    from memplan.engine import estimate

    base = build_setup("7b", seq=2048)
    narrow = Space(checkpointing=(Checkpointing.NONE,), attention=(Attention.FLASH,), micro_batches=(1,))
    result = fit(base, load_gpu("h100"), 1 << 28, max_seq=False, space=narrow)
    assert result.fitting
    for c in result.fitting:
        s = c.result.setup
        assert s.strategy.dp <= MAX_DP
        assert s.parallel.tp * s.parallel.cp * s.parallel.pp * s.strategy.dp == 1 << 28
        assert estimate(Setup.model_validate(s.model_dump())).setup.strategy.dp == s.strategy.dp
    with pytest.raises(ValueError) as err:
        fit(base, load_gpu("h100"), 1 << 40, max_seq=False)
    assert str(err.value) == (
        "gpus: 1,099,511,627,776 devices need a data-parallel degree above 1,048,576 in every layout fit "
        "searches (tp ≤ 8, pp up to the 32 layers, cp ≤ 16); use at most --gpus 4,294,967,296"
    )


def test_the_data_parallel_degrees_the_global_batch_does_not_split_are_said() -> None:
    """3 GPUs and the default global batch of 512 sequences: dp 3 splits 512 into no whole micro-batches
    (512 = 3 · 170 + 2), so its layouts hold no configuration and only dp 1 (pp 3) is searched — said in the
    summary and the JSON, with the nearest batch that splits over dp 1 and 3: 513 (1 away; 510 is 2). With
    it the dp-3 layouts are searched, and memplan's own fastest row is one of them, faster."""
    common = "-m 8b --seq 8192 --gpus 3 --gpu h100-sxm --top 1"
    default = run_json(f"fit {common} --json")
    assert default["global_batch"] == 512
    assert (default["unsplit_dp"], default["splitting_global_batch"]) == ([3], 513)
    assert " --pp 3 " in default["configs"][0]["command"]
    split = run_json(f"fit {common} --global-batch 513 --json")
    assert (split["unsplit_dp"], split["splitting_global_batch"]) == ([], None)
    best = split["configs"][0]
    assert best["setup"]["dp"] == 3
    assert best["time"]["tokens_per_s"] > default["configs"][0]["time"]["tokens_per_s"]
    text = " ".join(CliRunner(env={"COLUMNS": "120"}).invoke(app, ["fit", *common.split()]).stdout.split())
    text = text.replace("│ ", "").replace(" │", "")
    assert "not searched: the layouts with dp 3, over which the global batch of 512 sequences" in text
    assert "--global-batch 513 splits over every one" in text
