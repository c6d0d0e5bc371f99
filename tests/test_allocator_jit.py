"""Issue #21 item 6: ``analytic.allocator.jit.replay_jit`` (the fit search's early-stopped replay compiled by
numba, an optional extra) is ``replay_plain`` — and so ``Allocator``: the same counters, peaks, segments,
released bytes, refusals and stopping event on random streams, real ones and at capacities where cached
segments are released; ``reserved._refuses`` gives the same verdict on either path. Skipped without
numba."""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan import alloc_stream, reserved
from memplan.analytic.allocator import Allocator, Replay
from memplan.analytic.allocator.plain import demand, replay_plain
from memplan.api import build_setup
from memplan.config import FineTune, Parallel
from memplan.config.finetune import Method
from memplan.engine import estimate
from memplan.options import AttentionChoice
from memplan.presets import load_gpu
from tests.test_allocator_plain import MIB, streams

pytest.importorskip("numba")

import numpy as np

from memplan.analytic.allocator import jit_replay as allocator_jit_replay
from memplan.analytic.allocator.jit import codes_jit, refuses_jit, replay_inputs_jit, replay_jit


def _reference(stream_codes: list[int], capacity: int | None) -> Replay:
    return Allocator(capacity=capacity).replay_codes(stream_codes)


@settings(max_examples=200, deadline=None)
@given(streams(), st.one_of(st.none(), st.integers(0, 120 * MIB)))
def test_random_streams_replay_as_the_allocator(stream_codes: list[int], capacity: int | None) -> None:
    got, stopped = replay_jit(stream_codes, capacity)
    assert stopped == len(stream_codes)
    assert got == _reference(stream_codes, capacity)


@settings(max_examples=200, deadline=None)
@given(streams(), st.integers(0, 200 * MIB))
def test_the_early_stop_stops_where_replay_plain_does(stream_codes: list[int], capacity: int) -> None:
    # the same event and the same counters there as the pure-Python replay with the same demand, whose
    # prefix is Allocator's (tests/test_allocator_plain.py); and the same verdict as the whole replay
    expected = replay_plain(stream_codes, capacity, demand(stream_codes))
    assert replay_jit(stream_codes, capacity, early=True) == expected
    assert expected[0] == _reference(stream_codes[: expected[1]], capacity)
    assert expected[0].oom is _reference(stream_codes, capacity).oom


@pytest.fixture
def python_path() -> Iterator[None]:
    """``reserved._refuses`` without the compiled replay, then as it was."""
    saved = list(reserved._JIT)
    reserved._JIT[:] = [None]
    yield
    reserved._JIT[:] = saved


@contextmanager
def policy(rent: float) -> Iterator[None]:
    """The compiled replay not loaded and the Python replays' rent at ``rent`` seconds, then as they were."""
    saved, paid = list(reserved._JIT), reserved._RENT[0]
    reserved._JIT[:] = []
    reserved._RENT[0] = rent
    try:
        yield
    finally:
        reserved._JIT[:] = saved
        reserved._RENT[0] = paid


def _load() -> None:
    """Load the compiled replay as ``MEMPLAN_JIT=auto`` does once the rent is paid (inside ``policy``)."""
    reserved._JIT[:] = []
    reserved._RENT[0] = max(reserved._RENT[0], reserved.JIT_LOAD_SECONDS)
    assert reserved._compiled() is not None  # numba imports here


@settings(max_examples=100, deadline=None)
@given(streams(), st.integers(0, 200 * MIB))
def test_refuses_is_the_same_on_either_path(stream_codes: list[int], capacity: int) -> None:
    expected = _reference(stream_codes, capacity).oom
    with policy(0.0):
        _load()
        assert reserved._refuses(stream_codes, capacity) is expected
        reserved._JIT[:] = [None]
        assert reserved._refuses(stream_codes, capacity) is expected


def test_memplan_jit_0_keeps_the_python_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMPLAN_JIT", "0")
    with policy(10 * reserved.JIT_LOAD_SECONDS):  # whatever the rent
        assert reserved._compiled() is None
        assert reserved._JIT == [None]


def test_memplan_jit_1_loads_at_the_first_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMPLAN_JIT", "1")
    with policy(0.0):
        assert reserved._compiled() is not None


def test_python_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    # unset (or empty): one command's replays take about the compiled replay's load, so none is loaded
    for unset in (True, False):
        if unset:
            monkeypatch.delenv("MEMPLAN_JIT", raising=False)
        else:
            monkeypatch.setenv("MEMPLAN_JIT", " ")
        with policy(10 * reserved.JIT_LOAD_SECONDS):
            assert reserved._compiled() is None and reserved._JIT == [None]


def test_auto_rents_before_it_buys(monkeypatch: pytest.MonkeyPatch) -> None:
    # Python replays until they have spent JIT_LOAD_SECONDS in the process, then compiled
    monkeypatch.setenv("MEMPLAN_JIT", "auto")
    below = reserved.JIT_LOAD_SECONDS * (1 - 1e-9)
    with policy(below):
        assert reserved._compiled() is None and reserved._JIT == []  # nothing decided: asked again later
        reserved._RENT[0] = reserved.JIT_LOAD_SECONDS
        assert reserved._compiled() is not None


def test_python_replays_pay_the_rent(monkeypatch: pytest.MonkeyPatch) -> None:
    # a refusal replayed in Python adds its seconds to the rent and loads nothing; the same question
    # asked compiled afterwards gives the same answer
    monkeypatch.setenv("MEMPLAN_JIT", "auto")
    setup = build_setup("llama-3.2-1b", seq=2048, checkpointing="full", zero=3, dp=16, grad_accum=4)
    r = estimate(setup)
    workspace = reserved.cublas_workspace(H100)
    full = reserved.replay_stream(alloc_stream.stream_inputs(r), workspace)
    capacity = full.requested_peak - 1  # one byte short of what the tensors ask: refused, by a replay
    with policy(0.0):
        reserved.clear_replays()
        assert reserved.refuses(r, H100, capacity)
        assert reserved._RENT[0] > 0 and reserved._JIT == []
        reserved.clear_replays()
        _load()
        assert reserved.refuses(r, H100, capacity)
    reserved.clear_replays()


def test_asking_for_the_compiled_replay_without_numba_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    # ``1`` is a request: without numba it is refused, where ``auto`` stays in Python
    monkeypatch.setattr(reserved, "numba_installed", lambda: False)
    monkeypatch.setenv("MEMPLAN_JIT", "1")
    with (
        policy(0.0),
        pytest.raises(ValueError, match=r"^MEMPLAN_JIT: 1 asks for the compiled replay, but numba"),
    ):
        reserved._compiled()
    monkeypatch.setenv("MEMPLAN_JIT", "auto")
    with policy(reserved.JIT_LOAD_SECONDS):
        assert reserved.jit_mode() == "auto"


def test_an_unknown_policy_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEMPLAN_JIT", "yes")
    with policy(0.0), pytest.raises(ValueError, match=r"^MEMPLAN_JIT: must be 0, 1 or auto, got 'yes'"):
        reserved._compiled()


H100 = load_gpu("h100-sxm")


@pytest.mark.parametrize(
    ("name", "seq", "ckpt", "zero", "dp", "par", "n"),
    [
        ("gpt2", 1024, "none", 0, 1, Parallel(), 1),
        ("qwen3-0.6b", 2048, "selective", 1, 4, Parallel(tp=2, sp=True), 4),
        ("llama-3.2-1b", 2048, "full", 3, 16, Parallel(tp=2, sp=True, pp=2), 4),
    ],
)
def test_real_streams_replay_as_the_allocator(
    name: str, seq: int, ckpt: str, zero: int, dp: int, par: Parallel, n: int
) -> None:
    setup = build_setup(name, seq=seq, checkpointing=ckpt, zero=zero, dp=dp, parallel=par, grad_accum=n)
    stream_codes = alloc_stream.codes(
        alloc_stream.stream_inputs(estimate(setup)), reserved.cublas_workspace(H100)
    )
    full = _reference(stream_codes, None)
    assert replay_jit(stream_codes) == (full, len(stream_codes))
    # capacities where the capped replay refuses, releases cached segments, or runs as the unlimited one;
    # early-stopped where replay_plain stops
    requested, peak = full.requested_peak, full.reserved_peak
    for capacity in (requested - 1, requested, (requested + peak) // 2, peak - 1, peak):
        assert replay_jit(stream_codes, capacity)[0] == _reference(stream_codes, capacity)
        early = replay_plain(stream_codes, capacity, demand(stream_codes))
        assert replay_jit(stream_codes, capacity, early=True) == early
    assert _reference(stream_codes, requested - 1).oom  # the path that refuses is exercised


def test_keys_wider_than_63_bits_fall_back_to_replay_plain() -> None:
    # five 200 TiB requests and one of 4 MiB: a new segment for every allocation is 1,000 TiB + 20 MiB,
    # 2⁴¹ units of 512 bytes (41 bits for an address), and a 200 TiB size needs 39 bits: 80 > 62, so the
    # stream is replayed by replay_plain (the same answer as Allocator, whose addresses pass 2⁴⁸)
    tib = 1 << 40
    stream_codes = [200 * tib, 200 * tib, 200 * tib, 4 * MIB, -3, -1, 200 * tib, 200 * tib, -6, -5]
    assert replay_jit(stream_codes) == (_reference(stream_codes, None), len(stream_codes))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 4000)), max_size=700))
def test_a_pool_is_a_sorted_set(ops: list[tuple[int, int]]) -> None:
    # the chunked pool (inserts, deletes, best fit's ceiling, and the ceiling taken out: ``_pool_take``)
    # against a sorted list, on sequences long enough to split chunks of 64, empty them and reuse their
    # ids; pool 1 is used, pool 0 stays empty
    room = len(ops) + 2
    data = np.empty((2, room, allocator_jit_replay.CHUNK), dtype=np.int64)
    lens, order, maxes = (np.zeros((2, room), dtype=np.int64) for _ in range(3))
    meta = np.zeros((2, 3), dtype=np.int64)
    pool = (data, lens, order, maxes, meta, 1)
    expected: list[int] = []
    for op, key in ops:
        if op == 0 and key not in expected:
            bisect.insort(expected, key)
            allocator_jit_replay._pool_insert(*pool, key)
        elif op == 1 and expected:
            gone = expected.pop(key % len(expected))
            allocator_jit_replay._pool_delete(*pool, gone)
        elif op == 3:
            k = bisect.bisect_left(expected, key)
            taken = expected.pop(k) if k < len(expected) else -1
            assert allocator_jit_replay._pool_take(*pool, key) == taken
        else:
            k = bisect.bisect_left(expected, key)
            assert allocator_jit_replay._pool_ceiling(*pool, key) == (
                expected[k] if k < len(expected) else -1
            )
        got = [int(data[1, order[1, p], j]) for p in range(meta[1, 0]) for j in range(lens[1, order[1, p]])]
        assert got == expected
        assert [int(maxes[1, p]) for p in range(meta[1, 0])] == [
            int(data[1, order[1, p], lens[1, order[1, p]] - 1]) for p in range(meta[1, 0])
        ]
    assert meta[0, 0] == 0


def test_replay_stream_is_the_same_compiled(python_path: None) -> None:
    # the verdict's unlimited and capped replays (``reserved.replay_stream``) take the compiled replay once
    # a search has loaded it: the same Replay as the Python path
    setup = build_setup("llama-3.2-1b", seq=2048, checkpointing="full", zero=3, dp=16, grad_accum=4)
    inputs = alloc_stream.stream_inputs(estimate(setup))
    workspace = reserved.cublas_workspace(H100)
    full = reserved.replay_stream(inputs, workspace)
    capped = reserved.replay_stream(inputs, workspace, capacity=full.requested_peak)
    reserved.clear_replays()
    with policy(0.0):
        _load()
        assert reserved.replay_stream(inputs, workspace) == full
        assert reserved.replay_stream(inputs, workspace, capacity=full.requested_peak) == capped
    reserved.clear_replays()


@st.composite
def stream_inputs(draw: st.DrawFn) -> alloc_stream.StreamInputs:
    """Random ``alloc_stream.StreamInputs``: timeline points whose terms rise and fall, tensors whose states
    are (or are not) a whole number of bytes per element over them, one layer's saves (some of them 0)."""
    per_tensor = tuple(draw(st.lists(st.integers(0, 6), max_size=6)))
    count = sum(per_tensor)
    state = st.one_of(st.integers(0, 40), st.integers(0, 4).map(lambda k: k * count))
    layer = tuple(draw(st.lists(st.integers(0, 3 * MIB), max_size=4)))
    term = st.one_of(st.integers(0, 8), st.sampled_from([sum(layer), 2 * sum(layer), 3 * MIB]))
    split = draw(st.integers(0, len(layer) + 1))
    first = sum(layer[:split])
    term = st.one_of(term, st.sampled_from([first, 2 * first, sum(layer) - first]))
    points = draw(st.lists(st.tuples(term, term, term, term, term), max_size=10))
    # some points' transients known as tensors (``timeline.Point.pieces``: not always their sum)
    piece = st.lists(st.integers(1, 3 * MIB), max_size=3).map(tuple)
    pieces = tuple(draw(piece) for _ in points) if points and draw(st.booleans()) else ()
    # some points' rises of the activations known as tensors (``timeline.Point.saves``: used where they
    # add up to the rise, so some are drawn from the points' own rises)
    saves: tuple[tuple[int, ...], ...] = ()
    if points and draw(st.booleans()):
        rises = [max(0, b[3] - a[3]) for a, b in zip([(0,) * 5, *points], points, strict=False)]
        split_rise = st.sampled_from(
            [(r,) if r else () for r in rises] + [(r // 2, r - r // 2) for r in rises]
        )
        saves = tuple(draw(st.one_of(piece, split_rise)) for _ in points)
    # the optimizer's tensors per parameter (``optimizer_parts``): a master copy or none, some states
    parts = draw(
        st.one_of(st.just(()), st.tuples(st.sampled_from([0, 4]), st.integers(1, 4), st.integers(1, 4)))
    )
    return alloc_stream.StreamInputs(
        points=tuple(points),
        per_tensor=per_tensor,
        states=(draw(state), draw(st.one_of(state, st.just(count * sum(parts)))), draw(state)),
        layer=layer,
        pieces=pieces,
        split=split,
        saves=saves,
        state_parts=parts,
    )


@settings(max_examples=300, deadline=None)
@given(stream_inputs(), st.sampled_from([0, 512, 32 * MIB]), st.integers(1, 3))
def test_codes_jit_is_reserved_codes(inputs: alloc_stream.StreamInputs, workspace: int, steps: int) -> None:
    got = codes_jit(inputs, workspace, steps)
    assert got == alloc_stream.codes(inputs, workspace, steps)


@settings(max_examples=200, deadline=None)
@given(stream_inputs(), st.sampled_from([0, 32 * MIB]), st.integers(0, 80 * MIB))
def test_refuses_jit_is_the_python_verdict(
    inputs: alloc_stream.StreamInputs, workspace: int, capacity: int
) -> None:
    stream_codes = alloc_stream.codes(inputs, workspace)
    expected = _reference(stream_codes, capacity).oom
    got = refuses_jit(inputs, workspace, 2, capacity)
    assert got is expected


@pytest.mark.parametrize(
    "kw",
    [
        {"model": "gpt2", "seq": 1024},
        {
            "model": "llama-3.2-1b",
            "seq": 2048,
            "zero": 3,
            "dp": 8,
            "parallel": Parallel(pp=2),
            "grad_accum": 4,
        },
        {"model": "llama-3.2-1b", "seq": 1024, "checkpointing": "full", "zero": 1, "dp": 4},
        {"model": "llama-3.2-1b", "seq": 1024, "finetune": FineTune(method=Method.LORA)},
        {"model": "qwen3-0.6b", "seq": 2048, "parallel": Parallel(tp=2, sp=True), "zero": 2, "dp": 2},
        # each layer's forward peak a point, its temporaries known as tensors (``timeline.layer_peak``)
        {
            "model": "llama-3.2-1b",
            "seq": 2048,
            "checkpointing": "selective",
            "attention": AttentionChoice.EAGER,
        },
        {"model": "llama-3.2-1b", "seq": 1024, "attention": AttentionChoice.EAGER, "zero": 1, "dp": 4},
    ],
)
def test_real_streams_code_as_reserved_codes(kw: dict[str, object]) -> None:
    # pipeline stages, checkpointed segments and LoRA's trainable subset (states laid as blocks) included,
    # and transients known as tensors (the reference's loss, its layers' forward peaks)
    setup = build_setup(**kw)  # type: ignore[arg-type]
    inputs = alloc_stream.stream_inputs(estimate(setup))
    workspace = reserved.cublas_workspace(H100)
    expected = alloc_stream.codes(inputs, workspace)
    assert codes_jit(inputs, workspace, 2) == expected
    full = _reference(expected, None)
    for capacity in (
        full.requested_peak - 1,
        full.requested_peak,
        full.reserved_peak - 1,
        full.reserved_peak,
    ):
        got = refuses_jit(inputs, workspace, 2, capacity)
        assert got is _reference(expected, capacity).oom


@settings(max_examples=200, deadline=None)
@given(stream_inputs(), st.sampled_from([0, 32 * MIB]), st.one_of(st.none(), st.integers(0, 80 * MIB)))
def test_replay_inputs_jit_is_the_allocator(
    inputs: alloc_stream.StreamInputs, workspace: int, capacity: int | None
) -> None:
    # the verdict's whole replay (``reserved.replay_stream``), coded and replayed compiled
    expected = _reference(alloc_stream.codes(inputs, workspace), capacity)
    got = replay_inputs_jit(inputs, workspace, 2, capacity)
    assert got == expected
