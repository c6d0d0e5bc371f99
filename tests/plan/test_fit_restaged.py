"""``search.families.restaged``: a configuration's estimate at another ZeRO stage, built from an estimate
of the same configuration (its pieces, stages, parameters and activations, with that stage's model
states), is ``engine.estimate``'s — field by field, and in what is computed from it (the peak, the most
loaded device, the lower bounds, the predicted step time). Checked over setups that reach every branch
of ``stage_plan.stage_states`` (ZeRO over dp × cp, pipeline stages, tensor and sequence parallelism, HSDP,
experts over ep, FSDP2's per-parameter shards, LoRA/QLoRA's states) and offload (estimated afresh)."""

from __future__ import annotations

import pytest

from memplan.api import build_setup
from memplan.config import Method, Parallel, Setup, ZeroStage
from memplan.config.finetune import FineTune
from memplan.engine import estimate, unplanned
from memplan.options import AttentionChoice
from memplan.presets import load_gpu
from memplan.search.families import restaged, unplanned_at
from memplan.time.offload import reads_device
from memplan.time.predict import unstaged
from memplan.time.timing import peak_flops, timing

H100 = load_gpu("h100-sxm")

SETUPS = [
    # (model, seq, options of build_setup): dp > 1 so that every ZeRO stage shards something
    ("gpt2", 1024, {"dp": 8, "grad_accum": 4}),
    ("llama-3.2-1b", 2048, {"dp": 4, "checkpointing": "full", "parallel": Parallel(tp=2, sp=True, pp=2)}),
    ("llama-3.2-1b", 4096, {"dp": 8, "grad_accum": 8, "parallel": Parallel(pp=4, vpp=2), "batch": 2}),
    ("qwen3-0.6b", 8192, {"dp": 4, "checkpointing": "selective", "parallel": Parallel(cp=2)}),
    ("llama-3.2-1b", 2048, {"dp": 16, "hsdp": 4}),
    ("mixtral-8x7b", 4096, {"dp": 8, "parallel": Parallel(tp=2, ep=4, pp=4)}),
    ("llama-3.2-1b", 2048, {"dp": 4, "finetune": FineTune(method=Method.LORA)}),
    ("llama-3.2-1b", 2048, {"dp": 4, "finetune": FineTune(method=Method.QLORA)}),
    ("llama-3.2-1b", 2048, {"dp": 4, "offload": "optimizer"}),
    ("llama-3.2-1b", 2048, {"dp": 4, "offload": "optimizer,activations"}),
]


def _at_zero(setup: Setup, zero: int) -> Setup:
    return setup.model_copy(update={"strategy": setup.strategy.model_copy(update={"zero": ZeroStage(zero)})})


@pytest.mark.parametrize(("name", "seq", "options"), SETUPS)
def test_restaged_is_the_estimate(name: str, seq: int, options: dict[str, object]) -> None:
    first = 1 if options.get("hsdp") else 0  # hybrid sharding: ZeRO 1–3 only
    base = build_setup(name, seq=seq, zero=first, **options)  # type: ignore[arg-type]
    stages = range(first, 4)
    fresh = {z: estimate(_at_zero(base, z)) for z in stages}
    for source in stages:
        for z in stages:
            got = restaged(fresh[source], _at_zero(base, z))
            want = estimate(_at_zero(base, z))
            assert got == want, (source, z)  # setup, pieces, every stage plan's fields, FLOPs, parameters
            assert [sp.lower_bound for sp in got.stages] == [sp.lower_bound for sp in want.stages]
            assert [sp.peak for sp in got.stages] == [sp.peak for sp in want.stages]
            assert got.device.stage == want.device.stage
            assert timing(got, H100) == timing(want, H100)
    if "offload" in options:
        return  # estimated afresh (the host's share moves with the states)
    # the stages differ in their states (else the check above would be vacuous): ZeRO shards them
    states = {z: fresh[z].device.states for z in stages}
    assert len({(s.optimizer, s.gradients, s.weights) for s in states.values()}) == len(states)


@pytest.mark.parametrize(("name", "seq", "options"), SETUPS)
def test_a_shared_prediction_is_the_prediction(name: str, seq: int, options: dict[str, object]) -> None:
    """``predict.unstaged`` of one ZeRO stage's estimate — with its stage plans or without them
    (``engine.unplanned``, what ``fit``'s bound has) — given to ``timing`` for another stage: the same
    ``Timing`` as timing that stage's estimate alone (the kernels and every row but dp's read no stage);
    and that stage timed without its stage plans (``families.unplanned_at``), but where the offload's
    copies read the device (``time.offload.reads_device``: parameters, activations)."""
    first = 1 if options.get("hsdp") else 0
    base = build_setup(name, seq=seq, zero=first, **options)  # type: ignore[arg-type]
    stages = range(first, 4)
    plans = {z: estimate(_at_zero(base, z)) for z in stages}
    peak = peak_flops(H100, base.training.precision)
    for source in (*(plans[z] for z in stages), unplanned(base)):
        shared = unstaged(source, H100, peak)
        for z in stages:
            assert timing(plans[z], H100, shared=shared) == timing(plans[z], H100), z
            # what ``fit`` times a stage from before (or without) its stage plans
            bare = unplanned_at(source, _at_zero(base, z))
            assert bare == unplanned(_at_zero(base, z)), z
            if not reads_device(plans[z].setup.offload):  # else timed from the estimate (its copies)
                assert timing(bare, H100, shared=shared) == timing(plans[z], H100), z


@pytest.mark.parametrize(("name", "seq", "options"), SETUPS)
def test_the_step_seconds_memo_is_the_prediction(name: str, seq: int, options: dict[str, object]) -> None:
    """One ``Unstaged.steps`` memo (the optimizer step's and clipping's seconds) shared by the plans of one
    layout × checkpointing × attention at other micro-batch sizes and counts and every ZeRO stage, as
    ``fit``'s groups share it, filled first by each of them in turn: every ``Timing`` equals timing that
    plan alone."""
    first = 1 if options.get("hsdp") else 0
    b, n = int(options.get("batch", 1)), int(options.get("grad_accum", 1))  # type: ignore[call-overload]
    sizes = [(b, n), (2 * b, n), (b, 2 * n), (4 * b, 2 * n)]
    rest = {k: v for k, v in options.items() if k not in ("batch", "grad_accum")}
    plans = {
        (size, z): estimate(_at_zero(build_setup(name, seq=seq, zero=first, batch=size[0], grad_accum=size[1],
                                                 **rest), z))  # type: ignore[arg-type]
        for size in sizes
        for z in range(first, 4)
    }  # fmt: skip
    peak = peak_flops(H100, plans[(sizes[0], first)].setup.training.precision)
    for start in range(len(sizes)):
        steps: dict[tuple[object, ...], tuple[float, float]] = {}
        for size in sizes[start:] + sizes[:start]:
            shared = unstaged(plans[(size, first)], H100, peak, steps)
            for z in range(first, 4):
                assert timing(plans[(size, z)], H100, shared=shared) == timing(plans[(size, z)], H100)
        assert steps  # the memo was read back, not bypassed


@pytest.mark.parametrize(("name", "seq", "options"), SETUPS)
def test_the_step_seconds_memo_holds_across_checkpointing_and_attention(
    name: str, seq: int, options: dict[str, object]
) -> None:
    """``fit`` shares one ``Unstaged.steps`` memo between the checkpointings and attentions of a layout
    (``fit._search_level``): filled first by each (checkpointing, attention) in turn, every ``Timing`` of
    every ZeRO stage equals timing that plan alone — the optimizer step and clipping read neither, and the
    busiest stage they may move is in the memo's key."""
    first = 1 if options.get("hsdp") else 0
    rest = {k: v for k, v in options.items() if k != "checkpointing"}
    kinds = []
    for ckpt in ("none", "selective", "full"):
        for attention in (AttentionChoice.FLASH, AttentionChoice.EAGER):
            try:
                base = build_setup(name, seq=seq, zero=first, checkpointing=ckpt, attention=attention, **rest)  # type: ignore[arg-type]
                kinds.append({z: estimate(_at_zero(base, z)) for z in range(first, 4)})
            except ValueError:
                continue  # not modelled (context parallelism runs flash attention only; LoRA no selective)
    assert len(kinds) > 1
    peak = peak_flops(H100, kinds[0][first].setup.training.precision)
    for start in range(len(kinds)):
        steps: dict[tuple[object, ...], tuple[float, float]] = {}
        for plans in kinds[start:] + kinds[:start]:
            shared = unstaged(plans[first], H100, peak, steps)
            for z, p in plans.items():
                assert timing(p, H100, shared=shared) == timing(p, H100), (start, z)
        assert len(steps) < len(kinds) * len(range(first, 4))  # read back across the kinds
