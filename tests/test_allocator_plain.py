"""Issue #21 item 6: ``analytic.allocator.plain.replay_plain`` (the fit search's replay, without block
objects) is the same allocator as ``Allocator``: the same counters and peaks, segment count, released
bytes and out-of-memory flag on random streams and on the streams of real configurations, unlimited and at
capacities where the out-of-memory path releases cached segments; and its early stop (``demand``) stops
at an event where the replay so far is ``Allocator``'s on that prefix."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.alloc_stream import codes, rank_tensors, stream_inputs
from memplan.analytic.allocator import Allocator, Replay, round_size, segment_size
from memplan.analytic.allocator.plain import replay_plain
from memplan.analytic.optimizer_step import step_tensors
from memplan.api import build_setup
from memplan.config import Parallel
from memplan.engine import estimate
from memplan.presets import load_gpu
from memplan.reserved import _refuses, clear_replays, cublas_workspace

KIB, MIB = 1 << 10, 1 << 20


def _reference(stream_codes: list[int], capacity: int | None) -> Replay:
    return Allocator(capacity=capacity).replay_codes(stream_codes)


# sizes around every threshold of the rules: 512-byte rounding, the 1 MiB small pool, the 10 MiB
# kMinLargeAlloc, the 2 MiB rounding of large segments, and the 1 MiB split threshold
SIZES = st.one_of(
    st.integers(1, 4 * KIB),
    st.integers(MIB - 2 * KIB, MIB + 2 * KIB),
    st.integers(1, 3 * MIB),
    st.integers(9 * MIB, 23 * MIB),
    st.sampled_from([512, MIB, 2 * MIB, 10 * MIB, 20 * MIB, 20 * MIB + 1]),
)


@st.composite
def streams(draw: st.DrawFn) -> list[int]:
    """A stream coded as ``alloc_stream.codes`` codes it: n ≥ 0 allocates n bytes (numbered in order),
    −k − 1 frees allocation k (each at most once)."""
    out: list[int] = []
    live: list[int] = []
    for _ in range(draw(st.integers(0, 120))):
        if live and draw(st.booleans()):
            k = live.pop(draw(st.integers(0, len(live) - 1)))
            out.append(-k - 1)
        else:
            live.append(sum(c >= 0 for c in out))
            out.append(draw(SIZES))
    return out


@settings(max_examples=150, deadline=None)
@given(streams(), st.one_of(st.none(), st.integers(0, 120 * MIB)))
def test_random_streams_replay_as_the_allocator(stream_codes: list[int], capacity: int | None) -> None:
    got, stopped = replay_plain(stream_codes, capacity)
    assert stopped == len(stream_codes)
    assert got == _reference(stream_codes, capacity)


def _demand(stream_codes: list[int]) -> list[int]:
    # a new segment for every allocation from i on (reserved.refuses' early stop), by hand
    out = [0] * (len(stream_codes) + 1)
    for i in range(len(stream_codes) - 1, -1, -1):
        c = stream_codes[i]
        out[i] = out[i + 1] + (segment_size(round_size(c)) if c >= 0 else 0)
    return out


@settings(max_examples=100, deadline=None)
@given(streams(), st.integers(0, 200 * MIB))
def test_the_early_stop_is_the_allocator_on_the_prefix(stream_codes: list[int], capacity: int) -> None:
    demand = _demand(stream_codes)
    got, stopped = replay_plain(stream_codes, capacity, demand)
    assert got == _reference(stream_codes[:stopped], capacity)
    # the verdict ``reserved.refuses`` reads: refused so far ⇔ refused by the whole replay (nothing later is)
    assert got.oom is _reference(stream_codes, capacity).oom
    # it stopped at the first event where a new segment for every later allocation fits, or right after
    # the first refusal
    prefixes = [_reference(stream_codes[:i], capacity) for i in range(stopped)]
    assert all(r.reserved + demand[i] > capacity and not r.oom for i, r in enumerate(prefixes))
    assert got.oom or stopped == len(stream_codes) or got.reserved + demand[stopped] <= capacity


def test_demand_by_hand() -> None:
    # 5 MiB → a 20 MiB segment (kLargeBuffer); 100 B → 2 MiB (kSmallBuffer); 11 MiB → 12 MiB (rounded up
    # to 2 MiB); frees add nothing
    assert _demand([5 * MIB, 100, -1, 11 * MIB, -2]) == [34 * MIB, 14 * MIB, 12 * MIB, 12 * MIB, 0, 0]


@settings(max_examples=100, deadline=None)
@given(streams(), st.integers(0, 200 * MIB))
def test_refuses_is_the_capped_replays_verdict(stream_codes: list[int], capacity: int) -> None:
    assert _refuses(stream_codes, capacity) is _reference(stream_codes, capacity).oom


H100 = load_gpu("h100-sxm")


@pytest.mark.parametrize(
    ("name", "seq", "ckpt", "zero", "dp", "par", "n"),
    [
        ("gpt2", 1024, "none", 0, 1, Parallel(), 1),
        ("qwen3-0.6b", 2048, "selective", 1, 4, Parallel(tp=2, sp=True), 4),
        ("llama-3.2-1b", 4096, "none", 2, 8, Parallel(pp=2), 8),
        ("llama-3.2-1b", 2048, "full", 3, 16, Parallel(tp=2, sp=True, pp=2), 4),
    ],
)
def test_real_streams_replay_as_the_allocator(
    name: str, seq: int, ckpt: str, zero: int, dp: int, par: Parallel, n: int
) -> None:
    setup = build_setup(name, seq=seq, checkpointing=ckpt, zero=zero, dp=dp, parallel=par, grad_accum=n)
    stream_codes = codes(stream_inputs(estimate(setup)), cublas_workspace(H100))
    full = _reference(stream_codes, None)
    assert replay_plain(stream_codes)[0] == full
    # capacities where the capped replay releases cached segments, refuses a request, or runs as the
    # unlimited one
    requested, reserved = full.requested_peak, full.reserved_peak
    for capacity in (requested - 1, requested, (requested + reserved) // 2, reserved - 1, reserved):
        expected = _reference(stream_codes, capacity)
        assert replay_plain(stream_codes, capacity)[0] == expected
    assert _reference(stream_codes, requested - 1).oom  # the path that refuses is exercised


def test_the_out_of_memory_path_releases_a_free_segment_and_retries() -> None:
    # 12 MiB (≥ 10 MiB: a 12 MiB segment), freed; 30 MiB finds no cached block ≥ it: 12 + 30 = 42 MiB
    # passes the 40 MiB capacity, so the wholly free 12 MiB segment is released and 30 MiB fits.
    stream_codes = [12 * MIB, -1, 30 * MIB]
    got = replay_plain(stream_codes, 40 * MIB)[0]
    assert (got.released, got.reserved, got.reserved_peak, got.oom) == (12 * MIB, 30 * MIB, 30 * MIB, False)
    assert got == _reference(stream_codes, 40 * MIB)
    # then 5 MiB: the 30 MiB block was handed out whole (0 left), so a 20 MiB segment (kLargeBuffer):
    # 30 + 20 > 40 MiB and no segment is wholly free: refused
    refused = replay_plain([*stream_codes, 5 * MIB], 40 * MIB)[0]
    assert refused.oom and refused.reserved == 30 * MIB
    assert refused == _reference([*stream_codes, 5 * MIB], 40 * MIB)


def test_rank_tensors_are_step_tensors_across_what_a_search_varies() -> None:
    # the memo's key leaves out the micro-batch, the layout and the checkpointing: setups that differ only
    # there share one entry, and each still equals step_tensors of its own setup
    clear_replays()
    for kw in (
        {"zero": 1, "dp": 8, "grad_accum": 2},
        {"zero": 1, "dp": 8, "grad_accum": 4, "checkpointing": "full"},
        {"zero": 1, "dp": 8, "parallel": Parallel(tp=2, sp=True)},
        {"zero": 3, "dp": 8},
        {"zero": 0, "dp": 8},
        {"zero": 2, "dp": 4, "parallel": Parallel(pp=2)},
    ):
        setup = build_setup("llama-3.2-1b", seq=1024, **kw)  # type: ignore[arg-type]
        assert rank_tensors(setup, setup.strategy) == tuple(step_tensors(setup))


def test_addresses_beyond_256_tib_keep_best_fit_order() -> None:
    # an unlimited replay of a huge plan: three 200 TiB segments laid one after another, the third at
    # 400 TiB, past 2⁴⁸ (256 TiB); the first and the third freed, two 200 TiB requests take the lower
    # address first (the size tie), then the block at 400 TiB, as Allocator does (an address past the
    # key's width would read back as a larger size and a wrong address)
    tib = 1 << 40
    stream_codes = [200 * tib, 200 * tib, 200 * tib, 4 * MIB, -3, -1, 200 * tib, 200 * tib, -6, -5]
    assert replay_plain(stream_codes)[0] == _reference(stream_codes, None)
