"""Issue #22 item 1: the caching allocator's decisions, each derived by hand from the rules of
c10/cuda/CUDACachingAllocator.cpp (the constants and functions of memplan/analytic/allocator/)."""

from __future__ import annotations

import pytest

from memplan.analytic.allocator import Alloc, Allocator, Event, Free, replay

KIB, MIB = 1 << 10, 1 << 20


def test_a_byte_is_a_512_byte_block_in_a_2_mib_small_segment() -> None:
    # round_size(1) = 512 (kMinBlockSize); 512 ≤ 1 MiB → small pool; no cached block → cudaMalloc of
    # kSmallBuffer = 2 MiB, split (2 MiB − 512 ≥ 512).
    r = replay([Alloc(0, 1)])
    assert (r.requested_peak, r.allocated_peak, r.reserved_peak, r.segments) == (1, 512, 2 * MIB, 1)


def test_sizes_round_to_512_bytes() -> None:
    # 513 → 1024 and 1024 → 1024, both in one small segment.
    r = replay([Alloc(0, 513), Alloc(1, 1024)])
    assert r.allocated_peak == 1024 + 1024 and r.reserved_peak == 2 * MIB


def test_small_blocks_share_a_segment_until_it_is_full() -> None:
    # 600 KiB each: the first splits the 2 MiB segment (1448 KiB left), the second takes 600 of it
    # (848 left), the third too (248 left); the fourth finds no block ≥ 600 KiB: a second segment.
    r = replay([Alloc(i, 600 * KIB) for i in range(4)])
    assert r.segments == 2 and r.reserved_peak == 4 * MIB and r.allocated_peak == 2400 * KIB


def test_requests_between_1_and_10_mib_share_a_20_mib_segment() -> None:
    # 5 MiB < kMinLargeAlloc: a kLargeBuffer (20 MiB) segment, split while more than 1 MiB remains: four
    # 5 MiB blocks fill it exactly (the fourth takes the last 5 MiB block whole).
    r = replay([Alloc(i, 5 * MIB) for i in range(4)])
    assert (r.segments, r.reserved_peak, r.allocated_peak) == (1, 20 * MIB, 20 * MIB)
    # a fifth opens a second 20 MiB segment
    assert replay([Alloc(i, 5 * MIB) for i in range(5)]).reserved_peak == 40 * MIB


def test_large_requests_round_up_to_2_mib_and_small_remainders_stay_in_the_block() -> None:
    # 11 MiB ≥ kMinLargeAlloc: a segment of 11 MiB rounded up to kRoundLarge (2 MiB) = 12 MiB; the 1 MiB
    # left is not > kSmallSize: not split, the whole 12 MiB block is handed out (allocated counts it).
    r = replay([Alloc(0, 11 * MIB)])
    assert (r.reserved_peak, r.allocated_peak, r.requested_peak) == (12 * MIB, 12 * MIB, 11 * MIB)
    # 1.5 MiB in a 20 MiB segment leaves 18.5 MiB; 19 MiB does not fit it: a new segment of 20 MiB
    # (19 rounded to 2 MiB), whose 1 MiB remainder is not split either.
    r = replay([Alloc(0, 3 * MIB // 2), Alloc(1, 19 * MIB)])
    assert (r.reserved_peak, r.allocated_peak) == (40 * MIB, 3 * MIB // 2 + 20 * MIB)


def test_best_fit_takes_the_smallest_free_block_that_is_large_enough() -> None:
    # Segments of 30, 50 and 40 MiB, all freed; a 35 MiB request takes the 40 MiB one (smallest ≥ 35),
    # a second 35 MiB request the 50 MiB one; nothing new is reserved.
    events: list[Event] = [Alloc(0, 30 * MIB), Alloc(1, 50 * MIB), Alloc(2, 40 * MIB)]
    events += [Free(0), Free(1), Free(2), Alloc(3, 35 * MIB), Alloc(4, 35 * MIB)]
    a = Allocator()
    r = a.replay(events)
    assert r.segments == 3 and r.reserved_peak == 120 * MIB
    # the 35 MiB blocks split their segments (5 and 15 MiB left, both > 1 MiB): 70 MiB allocated
    assert r.allocated == 70 * MIB


def test_freed_neighbours_merge_and_serve_a_larger_request() -> None:
    # Two 5 MiB blocks of one 20 MiB segment, freed: they merge with the free 10 MiB after them into
    # the whole 20 MiB block, which an 18 MiB request reuses (2 MiB left > 1 MiB: split).
    r = replay([Alloc(0, 5 * MIB), Alloc(1, 5 * MIB), Free(0), Free(1), Alloc(2, 18 * MIB)])
    assert (r.segments, r.reserved_peak, r.allocated) == (1, 20 * MIB, 18 * MIB)


def test_fragmentation_a_freed_block_too_small_for_the_next_request() -> None:
    # A and B 30 MiB each; A freed; C 40 MiB does not fit A's 30 MiB block: a third segment.
    # allocated peak 70 MiB (B + C), reserved 100 MiB.
    r = replay([Alloc(0, 30 * MIB), Alloc(1, 30 * MIB), Free(0), Alloc(2, 40 * MIB)])
    assert (r.allocated_peak, r.reserved_peak) == (70 * MIB, 100 * MIB)


def test_blocks_are_reused_on_their_own_stream_only() -> None:
    # A 30 MiB block freed on stream 0 does not serve a 20 MiB request on stream 1: a new segment.
    r = replay([Alloc(0, 30 * MIB), Free(0), Alloc(1, 20 * MIB, stream=1)])
    assert r.reserved_peak == 50 * MIB and r.segments == 2


def test_oversize_blocks_are_not_split_and_serve_only_near_sizes() -> None:
    # max_split_size 100 MiB: a freed 200 MiB block is oversize. 150 MiB: 200 ≥ 150 + kLargeBuffer (20):
    # refused, a new 150 MiB segment (350 reserved). 190 MiB: 200 < 210: taken whole (oversize: no split).
    events: list[Event] = [Alloc(0, 200 * MIB), Free(0), Alloc(1, 150 * MIB), Free(1), Alloc(2, 190 * MIB)]
    r = replay(events, max_split_size=100 * MIB)
    assert (r.reserved_peak, r.allocated) == (350 * MIB, 200 * MIB)
    # a request below max_split_size never takes an oversize block: 50 MiB opens its own segment
    r = replay([Alloc(0, 200 * MIB), Free(0), Alloc(1, 50 * MIB)], max_split_size=100 * MIB)
    assert r.reserved_peak == 250 * MIB
    # without the setting the 200 MiB block is split: 50 MiB taken, nothing new
    assert replay([Alloc(0, 200 * MIB), Free(0), Alloc(1, 50 * MIB)]).reserved_peak == 200 * MIB


def test_expandable_segments_grow_by_20_mib_pages() -> None:
    # Expandable: one large-pool segment mapped in 20 MiB pages. 30 MiB maps 40 (10 free at the end);
    # freed, the 40 MiB end block grows by one page for 50 MiB: 60 MiB mapped, where the plain allocator
    # reserves a 30 and a 50 MiB segment (80).
    events: list[Event] = [Alloc(0, 30 * MIB), Free(0), Alloc(1, 50 * MIB)]
    assert replay(events, expandable=True).reserved_peak == 60 * MIB
    assert replay(events).reserved_peak == 80 * MIB
    # the small pool maps 2 MiB pages: 600 KiB → 2 MiB mapped, one segment
    r = replay([Alloc(0, 600 * KIB)], expandable=True)
    assert (r.reserved_peak, r.segments) == (2 * MIB, 1)


def test_expandable_segments_grow_after_a_block_that_is_handed_out_whole() -> None:
    # 40 MiB maps two pages exactly (no free end block); a further 10 MiB maps one more page after it.
    r = replay([Alloc(0, 40 * MIB), Alloc(1, 10 * MIB)], expandable=True)
    assert (r.reserved_peak, r.segments, r.allocated) == (60 * MIB, 1, 50 * MIB)


def test_out_of_memory_releases_the_free_cached_segments_and_retries() -> None:
    # Capacity 60 MiB: 40 MiB reserved and freed; 50 MiB would make 90: the free 40 MiB segment is
    # released (release_cached_blocks), then 50 fits.
    r = replay([Alloc(0, 40 * MIB), Free(0), Alloc(1, 50 * MIB)], capacity=60 * MIB)
    assert not r.oom and r.released == 40 * MIB and r.reserved == 50 * MIB and r.reserved_peak == 50 * MIB
    # a live 40 MiB block cannot be released: 50 more is refused
    r = replay([Alloc(0, 40 * MIB), Alloc(1, 50 * MIB)], capacity=60 * MIB)
    assert r.oom and r.reserved_peak == 40 * MIB


@pytest.mark.parametrize("expandable", [False, True])
def test_reserved_never_below_allocated_nor_allocated_below_requested(expandable: bool) -> None:
    sizes = [1, 700 * KIB, 3 * MIB, 12 * MIB + 5, 64 * MIB, 511, 9 * MIB]
    events: list[Event] = [Alloc(i, s) for i, s in enumerate(sizes)]
    events += [Free(i) for i in (1, 3, 5)] + [Alloc(10 + i, s) for i, s in enumerate(reversed(sizes))]
    r = replay(events, expandable=expandable)
    assert (
        r.reserved_peak
        >= r.allocated_peak
        >= r.requested_peak
        == sum(sizes) + sum(sizes) - (sizes[1] + sizes[3] + sizes[5])
    )
