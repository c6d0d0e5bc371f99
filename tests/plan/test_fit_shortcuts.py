"""Issue #21 item 6: ``fit``'s shortcuts give the answers of the full evaluation.

- Memory (``budget.fits``): the requested-peak lower bound and one memoised replay at the capacity
  against the rule as ``budget`` states it, from fresh replays of the stream: fits ⇔ the stages' lower
  bounds and the peak are within the memory and either the unlimited replay reserves no more than it or
  the replay at that capacity refuses nothing. Judged at memories around each configuration's own
  requested, allocated and reserved peaks — where the shortcuts decide.
- The verdict's figures from memoised replays equal those of fresh ones.
- The search: pruning by predicted time before any memory work (``search.families``) lists the same
  rows, the same best per method and the same rejected families as ``shortcuts=False``; the rejected
  families are those of the search that prunes nothing which could have been listed.
- The longest sequence: the largest that fits, found by scanning every sequence.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from memplan.alloc_stream import stream
from memplan.analytic.allocator import replay
from memplan.analytic.fsdp.buffers import gather_units, root_wraps, stream_reserved
from memplan.api import build_setup
from memplan.config import Attention, Checkpointing, Parallel, Setup, ZeroStage
from memplan.engine import Result, estimate
from memplan.presets import GpuPreset, load_gpu
from memplan.reserved import clear_replays, cublas_workspace, cublas_workspaces
from memplan.search.budget import fits, verdict
from memplan.search.families import family_setup
from memplan.search.fit import Space, fit
from memplan.search.longest import longest_sequence, sequence_step, tensors_fit
from memplan.search.methods import valid
from memplan.search.results import Family
from memplan.search.space import every_layout, layouts, searchable, too_many
from memplan.time.comm.buffers import nccl_bytes
from memplan.time.timing import timing

H100 = load_gpu("h100-sxm")
A100 = load_gpu("a100-40gb")

CASES = [
    # (model, seq, checkpointing, zero, dp, parallel, micro-batches)
    ("gpt2", 1024, "none", 0, 1, Parallel(), 1),
    ("gpt2", 1024, "full", 3, 8, Parallel(), 4),
    ("qwen3-0.6b", 2048, "selective", 1, 4, Parallel(tp=2, sp=True), 4),
    ("llama-3.2-1b", 4096, "none", 2, 8, Parallel(pp=2), 8),
    ("llama-3.2-1b", 2048, "full", 3, 16, Parallel(tp=2, sp=True, pp=2), 4),
]


def _held(p: Result) -> int:
    """What the most loaded device holds beside the default stream's allocator: the layout's NCCL buffers
    (outside the allocator) and FSDP2's all-gather stream, its own pool, replayed afresh here (not the
    memoised figure ``fits`` reads; under tensor parallelism of the TP rank's local shards). No case runs
    DDP (--impl reference all-reduces in place)."""
    st, rank = p.device.stage, p.rank_setup
    units = gather_units(rank, st.layers, st.first, st.last)
    root = root_wraps(rank, st.first, st.last)
    stream = stream_reserved(units, p.micro_batches, root).reserved_peak if units else 0
    return nccl_bytes(p, H100) + stream


def _reference(p: Result, memory: int, gpu_workspace: int) -> bool:
    """``budget``'s rule from fresh replays: the tensors within ``memory``, then — in what the layout's
    NCCL buffers and FSDP2's all-gather stream leave of it — the unlimited replay's reserved peak within it
    or, if not, a replay at that capacity that refuses nothing."""
    if not (all(sp.lower_bound <= memory for sp in p.stages) and p.device.peak.bytes <= memory):
        return False
    usable = memory - _held(p)
    events = stream(p, gpu_workspace)
    unlimited = replay(events)
    return unlimited.reserved_peak <= usable or not replay(events, capacity=usable).oom


@pytest.mark.parametrize(("name", "seq", "ckpt", "zero", "dp", "par", "n"), CASES)
def test_fast_memory_judgement_is_the_replays(
    name: str, seq: int, ckpt: str, zero: int, dp: int, par: Parallel, n: int
) -> None:
    setup = build_setup(name, seq=seq, checkpointing=ckpt, zero=zero, dp=dp, parallel=par, grad_accum=n)
    p = estimate(setup)
    workspace = cublas_workspace(H100)
    full = replay(stream(p, workspace))
    requested, allocated, reserved = full.requested_peak, full.allocated_peak, full.reserved_peak
    # the stream reaches the estimate's peak, with both threads' workspaces
    assert requested == p.device.peak.bytes + cublas_workspaces(H100)
    assert requested <= allocated <= reserved
    memories = {requested - 1, requested, allocated - 1, allocated, (allocated + reserved) // 2}
    memories |= {reserved - 2**20, reserved - 1, reserved, reserved + 1, H100.device_bytes}
    memories |= {requested - (reserved - requested) // 4, allocated + (reserved - allocated) // 4}
    held = _held(p)  # fits() judges the allocator in memory less these: around each figure too
    memories |= {m + held + d for m in (requested, allocated, reserved) for d in (-1, 0, 1)}
    clear_replays()
    for memory in sorted(memories):
        expected = _reference(p, memory, workspace)
        assert fits(p, memory, H100) is expected, (memory, requested, allocated, reserved)
        assert fits(p, memory, H100) is expected  # memoised: the same answer again
    # the figures: a fresh replay's and the memoised ones agree
    clear_replays()
    fresh = verdict(p, H100)
    assert verdict(p, H100) == fresh
    assert fresh.reserved_peak == reserved and fresh.allocated_peak == allocated


def _answer(r: object, top: int) -> str:
    doc = r.to_json(top=top)  # type: ignore[attr-defined]
    return json.dumps({k: doc[k] for k in ("configs", "methods", "rejected", "max_seq")}, sort_keys=True)


@pytest.mark.parametrize(
    ("name", "seq", "gpu", "gpus", "batch", "space", "rejects"),
    [
        # 1B on 16 H100s: every family fits somewhere (the first bound prunes nearly all that step 2 would)
        (
            "llama-3.2-1b",
            4096,
            H100,
            16,
            64,
            Space(
                checkpointing=(Checkpointing.NONE, Checkpointing.FULL),
                micro_batches=(1, 2),
                vpp=(1,),
                cp_max=2,
                keep=1,
            ),
            False,
        ),
        # Mixtral 8x7B on 32 H100s, full checkpointing: step 2 prunes a few hundred configurations the
        # first bound leaves (it leaves out every collective but the tp and pp ones); some families fit
        # nowhere
        (
            "mixtral-8x7b",
            4096,
            H100,
            32,
            64,
            Space(checkpointing=(Checkpointing.FULL,), micro_batches=(1, 2), cp_max=2, keep=3),
            True,
        ),
        # 8B at 8,192 tokens on 8 A100-40GB: ZeRO 0 fits nowhere (rejected beside the rows)
        (
            "llama-3-8b",
            8192,
            A100,
            8,
            None,
            Space(checkpointing=(Checkpointing.NONE, Checkpointing.FULL), micro_batches=(1, 2), keep=4),
            True,
        ),
    ],
)
def test_search_shortcuts_give_the_full_evaluations_answer(
    name: str, seq: int, gpu: GpuPreset, gpus: int, batch: int | None, space: Space, rejects: bool
) -> None:
    base = build_setup(name, seq=seq)
    fast = fit(base, gpu, gpus, global_batch=batch, space=space)
    slow = fit(base, gpu, gpus, global_batch=batch, space=space, shortcuts=False)
    assert fast.pruned > slow.pruned  # the shortcut pruned configurations the full evaluation judged
    assert bool(slow.rejected) is rejects
    assert _answer(fast, space.keep) == _answer(slow, space.keep)
    # what the full evaluation lists beyond the fast search's rows is no faster than its kept rows
    listed = {(c.family, c.micro_batch) for c in fast.fitting}
    slowest_kept = slow.fitting[space.keep - 1].timing.step_time_s
    assert all(
        c.timing.step_time_s >= slowest_kept for c in slow.fitting if (c.family, c.micro_batch) not in listed
    )


def test_longest_sequence_is_the_largest_that_fits() -> None:
    """GPT-2 on an H100, in the least memory (to 64 KiB) in which it fits 32 tokens: every sequence
    1 … 40 judged (``budget.fits``); the largest that fits is ``longest_sequence``'s (capped at 40).
    Fitting is not monotonic there: the tensors' peak barely moves (the optimizer step's transient is the
    peak), while the activations' sizes change which cached blocks split (a remainder over 1 MiB) and
    which new 2 MiB-rounded segments open, so a sequence fits although a shorter one does not — and a
    binary search over "fits" could stop below the answer."""
    base = build_setup("gpt2", seq=1024)
    result = fit(base, H100, 1, global_batch=1, space=Space(checkpointing=(Checkpointing.NONE,)))
    best = result.best
    assert best is not None and sequence_step(best.result) == 1

    def at(seq: int) -> Result:
        s = best.result.setup
        training = s.training.model_copy(update={"seq_len": seq, "micro_batch": 1, "grad_accum": 1})
        return estimate(s.model_copy(update={"training": training}))

    p32 = at(32)
    lo, hi = p32.device.peak.bytes, p32.device.peak.bytes + 2**31  # fits at hi, not at lo
    while hi - lo > 2**16:
        lo, hi = (lo, (lo + hi) // 2) if fits(p32, (lo + hi) // 2, H100) else ((lo + hi) // 2, hi)
    memory = hi
    seqs = range(1, 41)
    ok = [fits(at(seq), memory, H100) for seq in seqs]
    tensors = [tensors_fit(at(seq), memory, H100) for seq in seqs]
    assert tensors == sorted(tensors, reverse=True)  # the tensors' judgement is monotonic: a prefix
    assert all(t or not o for t, o in zip(tensors, ok, strict=True))  # and necessary
    largest = max(seq for seq, o in zip(seqs, ok, strict=True) if o)
    assert longest_sequence(best, memory, cap=40, gpu=H100) == largest
    # not monotonic: a sequence that fits above one that does not
    assert any(ok[j] and not ok[i] for i in range(len(ok)) for j in range(i + 1, len(ok)))


def test_longest_sequence_without_a_gpu_is_the_tensors() -> None:
    base = build_setup("gpt2", seq=1024)
    best = fit(base, H100, 1, global_batch=1, space=Space(checkpointing=(Checkpointing.NONE,))).best
    assert best is not None
    memory = 6 * 2**30
    got = longest_sequence(best, memory)
    s = best.result.setup

    def peak(seq: int) -> int:
        training = s.training.model_copy(update={"seq_len": seq, "micro_batch": 1, "grad_accum": 1})
        return estimate(s.model_copy(update={"training": training})).device.peak.bytes

    assert got == 1024 if peak(1024) <= memory else (peak(got) <= memory < peak(got + 1))


def test_rejected_families_are_those_that_could_have_been_listed() -> None:
    """A family is judged for rejection exactly when a ZeRO stage of its (layout, checkpointing,
    attention) at one of its micro-batch sizes could be listed (``families._Group.listable``): predicted
    no slower than the ``keep``-th row. Against the search that prunes nothing (``keep`` 0, every family
    judged), the pruned search rejects a subset, with the same verdicts (at the smallest micro-batch
    size), and a family is in it if and only if some stage of its own (layout, checkpointing, attention)
    is predicted within that row's time at some size. 8B at 8,192 tokens on 8 A100-40GB, where ZeRO 0
    fits nowhere."""
    base = build_setup("llama-3-8b", seq=8192)
    space = Space(checkpointing=(Checkpointing.NONE, Checkpointing.FULL), micro_batches=(1, 2), keep=4)
    pruned = fit(base, A100, 8, space=space, max_seq=False)
    full = fit(base, A100, 8, space=dataclasses.replace(space, keep=0), max_seq=False)
    kept = {r.family: r for r in pruned.rejected}
    assert kept and all(r == kept.get(r.family, r) for r in full.rejected)
    assert set(kept) <= {r.family for r in full.rejected}
    slowest_kept = pruned.fitting[space.keep - 1].timing.step_time_s

    def fastest(family: Family) -> float:
        """The fastest predicted step of any searched ZeRO stage of ``family``'s triple, any size."""
        stages = sorted(space.zero) if family.layout.dp > 1 else [ZeroStage.NONE]
        times = []
        for z in stages:
            f = dataclasses.replace(family, zero=z)
            for b in space.micro_batches:
                if pruned.global_batch % (b * f.layout.dp) == 0:
                    setup = family_setup(base, f, b, pruned.global_batch // (b * f.layout.dp))
                    if valid(setup):
                        times.append(timing(estimate(setup), A100).step_time_s)
        return min(times)

    left = 0
    for family in {r.family for r in full.rejected}:
        listable = fastest(family) <= slowest_kept
        assert (family in kept) is listable, family
        left += not listable
    assert left  # the rule is exercised


STATES_CASES = [
    # (model, seq, overrides of build_setup): ZeRO stages, pipelines (uneven, interleaved, torchtitan's),
    # offload, LoRA, experts over ep, FSDP2's mixed precision, HSDP
    ("llama-3.2-1b", 2048, {"zero": 0, "dp": 1}),
    ("llama-3.2-1b", 2048, {"zero": 3, "dp": 8, "checkpointing": "full"}),
    ("llama-3.2-1b", 2048, {"zero": 1, "dp": 4, "tp": 2, "sp": True, "pp": 3}),
    ("llama-3.2-1b", 2048, {"zero": 2, "dp": 2, "pp": 2, "vpp": 2}),
    ("llama-3.2-1b", 2048, {"zero": 3, "dp": 8, "offload": "optimizer"}),
    ("llama-3.2-1b", 2048, {"zero": 3, "dp": 8, "offload": "params"}),
    ("llama-3.2-1b", 2048, {"finetune": "lora"}),
    ("qwen3-30b-a3b", 1024, {"zero": 3, "dp": 8, "ep": 4}),
    ("llama-3.2-1b", 2048, {"zero": 3, "dp": 8, "precision": "fsdp2-mixed", "impl": "torchtitan"}),
    ("llama-3.2-1b", 2048, {"zero": 3, "dp": 16, "hsdp": 8}),
    ("llama-3-8b", 1024, {"zero": 2, "dp": 2, "impl": "torchtitan", "pp": 2, "vpp": 2}),
]


def _states_setup(name: str, seq: int, over: dict[str, object], micro_batch: int) -> object:
    from memplan.api import Options, setup_of

    return setup_of(Options(model=name, seq=seq, batch=micro_batch, grad_accum=4, **over))


@pytest.mark.parametrize(("name", "seq", "over"), STATES_CASES)
def test_states_floor_is_the_plans_states_at_every_micro_batch(name: str, seq: int, over: dict) -> None:
    """``engine.states_floor``, without stage plans, is the largest ``ModelStates.total`` of the
    estimate's devices, the same at every micro-batch size (what lets ``fit`` judge a configuration by
    another micro-batch size's states), and no more than any plan's ``lower_bound`` (so a configuration it
    rules out fails ``budget.fits``' first test)."""
    from memplan.engine import states_floor

    floors = set()
    for b in (1, 2, 4):
        setup = _states_setup(name, seq, over, b)
        r = estimate(setup)  # type: ignore[arg-type]
        floor = states_floor(setup)  # type: ignore[arg-type]
        assert floor == max(sp.states.total for sp in r.stages)
        assert all(sp.states.total <= sp.lower_bound for sp in r.stages)
        floors.add(floor)
    assert len(floors) == 1


@pytest.mark.parametrize(("name", "seq", "over"), STATES_CASES)
def test_states_floor_from_another_stages_floors(name: str, seq: int, over: dict) -> None:
    """``states_floor`` given ``engine.floors`` of the same configuration at another ZeRO stage (what
    ``fit``'s groups share between their stages) is ``states_floor`` alone."""
    from memplan.engine import floors, states_floor

    setup: Setup = _states_setup(name, seq, over, 2)  # type: ignore[assignment]
    every = {z: setup.replaced(strategy=setup.strategy.replaced(zero=z)) for z in ZeroStage}
    at = {z: s for z, s in every.items() if valid(s)}  # the stages memplan models here
    alone = {z: states_floor(s) for z, s in at.items()}
    for source in at:
        shared = floors(at[source])
        assert {z: states_floor(s, shared) for z, s in at.items()} == alone, source
    if len(at) > 1 and setup.strategy.dp > 1 and not over.get("offload"):
        assert len(set(alone.values())) > 1  # the stages' floors differ: the check is not vacuous


@pytest.mark.parametrize(
    ("name", "seq", "gpus", "batch", "space", "reserve_gib", "saver"),
    [
        # nothing fits without a saver: Qwen3 0.6B's states at every ZeRO stage over 4 GPUs pass the 1.9
        # GiB a 77 GiB reserve leaves an H100
        (
            "qwen3-0.6b",
            2048,
            4,
            None,
            Space(checkpointing=(Checkpointing.NONE, Checkpointing.FULL), micro_batches=(1, 2, 4), keep=3),
            77.0,
            True,
        ),
        # states close to the memory: Llama 3 8B at 512 tokens, full checkpointing, in 29.5 GiB — ZeRO 1's
        # states pass it on one pipeline stage, ZeRO 2's fit within 3 % of its reserved peak (a floor 20 %
        # too high drops the fastest rows)
        (
            "llama-3-8b",
            512,
            8,
            64,
            Space(checkpointing=(Checkpointing.FULL,), micro_batches=(1, 2), keep=3, tp_max=2),
            49.4,
            False,
        ),
    ],
)
def test_configurations_judged_by_their_states_give_the_full_evaluations_answer(
    name: str, seq: int, gpus: int, batch: int | None, space: Space, reserve_gib: float, saver: bool
) -> None:
    """While nothing is listed the search judges the configurations whose model states pass the memory by
    those states (``engine.states_floor``, ``FitResult.states_only``) instead of refining and estimating
    every micro-batch size, and lists what the full evaluation lists, rejecting the same families."""
    base, reserve = build_setup(name, seq=seq), int(reserve_gib * 2**30)
    fast = fit(base, H100, gpus, space=space, global_batch=batch, reserve=reserve, max_seq=False)
    slow = fit(
        base, H100, gpus, space=space, global_batch=batch, reserve=reserve, max_seq=False, shortcuts=False
    )
    assert fast.states_only > 0 and slow.states_only == 0
    assert fast.best is not None and (fast.best.family.saver > 0) is saver
    assert _answer(fast, space.keep) == _answer(slow, space.keep)


@pytest.mark.parametrize(
    ("name", "gpus", "space"),
    [
        ("llama-3.1-405b", 16384, Space()),
        ("mixtral-8x7b", 64, Space()),
        ("llama-3.2-1b", 24, Space(attention=(Attention.EAGER,))),
        ("llama-3.2-1b", 7, Space()),
    ],
)
def test_the_layouts_are_enumerated_once_at_any_node_size(name: str, gpus: int, space: Space) -> None:
    """``fit`` enumerates the layouts once, on the GPU's nodes, for its two checks and every saver level
    (``fit._search_level`` keeps the context-parallel degrees it searches, in order): the checks read only
    whether there is a layout and its dp, which the node size (HSDP's shard groups) does not change."""
    base = build_setup(name, seq=8192)
    by_node = {node: every_layout(base, gpus, space, node) for node in (4, 8, 16)}
    plain = {(x.parallel, x.dp) for x in by_node[8] if not x.hsdp}
    for node, every in by_node.items():
        assert {(x.parallel, x.dp) for x in every if not x.hsdp} == plain
        assert [x for x in every if x.parallel.cp == 1] == layouts(base, gpus, space, 1, node)
        assert too_many(base, gpus, space, every) == too_many(base, gpus, space)
        for batch in (gpus, 2 * gpus, 3):
            assert searchable(base, gpus, batch, space, every) == searchable(base, gpus, batch, space)
