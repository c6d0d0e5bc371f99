"""``allocator.Allocator``'s default allocator (no expandable segments, no ``max_split_size``) on one
stream, without block objects: ``replay_plain`` (the fit search's replays, in Python) and ``demand``
(its early stop's bound).

The rules, decisions and counters are ``analytic.allocator``'s (its docstring: torch's
``c10/cuda/CUDACachingAllocator.cpp``); tests/test_allocator_plain.py checks ``replay_plain`` against
``Allocator`` on random and real streams, at capacities. ``analytic.allocator.jit`` compiles the same
replay (numba; ``reserved``'s ``MEMPLAN_JIT`` policy says when it runs).

NB: as ``Allocator``'s default path: no expandable segments, no ``max_split_size``, one stream.
"""

from __future__ import annotations

import bisect
from itertools import accumulate, repeat

from memplan.analytic.allocator import (
    K_MIN_BLOCK_SIZE,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
    Replay,
    round_size,
    segment_size,
)

_KEY = 1 << 64
"""``replay_plain``'s pool keys: size·2⁶⁴ + address, so that one integer orders as (size, address) does
while the addresses stay below 2⁶⁴ (the model lays segments one after another: the bytes of every
segment ever made, 16 EiB; 2⁴⁸ = 256 TiB could be passed by an unlimited replay of a huge plan; the wider
key measured no slower)."""


def replay_plain(
    codes: list[int], capacity: int | None = None, demand: list[int] | None = None
) -> tuple[Replay, int]:
    """``Allocator(capacity=capacity).replay_codes(codes)`` — the default allocator (no expandable
    segments, no ``max_split_size``) on one stream — with the same decisions and counters, faster: no
    block objects. Each pool is one sorted list of integer keys size·2⁶⁴ + address (best fit is the
    first key ≥ the request's, as ``_best_fit`` takes the first (size, address) ≥ (rounded, −1)); a free
    block is found by its start and its end (``try_merge_blocks``' neighbours: the free block that starts
    where it ends, the one that ends where it starts, unless that address starts a segment — blocks never
    merge across segments, and the model lays segments one after another).

    ``demand`` (``reserved.refuses``' early stop, one entry per code and one more): before the event i,
    when the reserved bytes plus ``demand[i]`` fit ``capacity`` the replay stops there; it stops too
    right after a request it refuses. Returns the counters and the index of the event it stopped before
    (``len(codes)`` when it ran to the end).
    tests/test_allocator.py checks it against ``Allocator`` on random and real streams, at capacities."""
    stats = Replay()
    pools: tuple[list[int], list[int]] = ([], [])  # large, small: keys of free blocks
    starts: tuple[dict[int, int], dict[int, int]] = ({}, {})  # free blocks: address -> size
    ends: tuple[dict[int, int], dict[int, int]] = ({}, {})  # free blocks: end address -> address
    segment_at: dict[int, int] = {}  # a live segment's start -> its size
    live: dict[int, tuple[int, int, int, bool]] = {}  # id -> (address, block size, request, small)
    top = made = 0
    allocated = reserved = requested = allocated_peak = reserved_peak = requested_peak = 0
    limit = capacity
    insort, bisect_left = bisect.insort, bisect.bisect_left
    for i, c in enumerate(codes):
        if demand is not None and limit is not None and reserved + demand[i] <= limit:
            _store(stats, allocated, reserved, requested, allocated_peak, reserved_peak, requested_peak)
            return stats, i
        if c < 0:
            found = live.pop(-c - 1, None)
            if found is None:  # an allocation refused (out of memory)
                continue
            addr, size, asked, small = found
            allocated -= size
            requested -= asked
            pool, start, end = pools[small], starts[small], ends[small]
            before = end.pop(addr, None) if addr not in segment_at else None
            if before is not None:  # the free block that ends where this one starts joins it
                before_size = start.pop(before)
                del pool[bisect_left(pool, before_size * _KEY + before)]
                addr, size = before, size + before_size
            after = addr + size
            if after not in segment_at:
                after_size = start.pop(after, None)
                if after_size is not None:  # the free block that starts where this one ends
                    del end[after + after_size]
                    del pool[bisect_left(pool, after_size * _KEY + after)]
                    size += after_size
            start[addr] = size
            end[addr + size] = addr
            insort(pool, size * _KEY + addr)
            continue
        rounded = -(-c // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE or K_MIN_BLOCK_SIZE
        small = rounded <= K_SMALL_SIZE
        pool, start, end = pools[small], starts[small], ends[small]
        k = bisect_left(pool, rounded * _KEY)
        if k < len(pool):  # the smallest free block large enough, the lowest address on a tie
            key = pool.pop(k)
            size, addr = divmod(key, _KEY)
            del start[addr], end[addr + size]
        else:  # a new segment (releasing the wholly free ones when over the capacity)
            size = K_SMALL_BUFFER if small else segment_size(rounded)
            if limit is not None and reserved + size > limit:
                for p, s, e in zip(pools, starts, ends, strict=True):
                    for addr in [a for a, n in s.items() if segment_at.get(a) == n]:
                        n = s.pop(addr)
                        del e[addr + n], p[bisect_left(p, n * _KEY + addr)], segment_at[addr]
                        reserved -= n
                        stats.released += n
                if reserved + size > limit:
                    stats.oom = True
                    made += 1
                    if demand is not None:  # ``refuses`` has its answer
                        _store(
                            stats,
                            allocated,
                            reserved,
                            requested,
                            allocated_peak,
                            reserved_peak,
                            requested_peak,
                        )
                        return stats, i + 1
                    continue
            addr = top
            top += size
            segment_at[addr] = size
            reserved += size
            stats.segments += 1
            if reserved > reserved_peak:
                reserved_peak = reserved
        remaining = size - rounded
        if remaining >= K_MIN_BLOCK_SIZE if small else remaining > K_SMALL_SIZE:  # should_split
            rest = addr + rounded
            start[rest] = remaining
            end[rest + remaining] = rest
            insort(pool, remaining * _KEY + rest)
            size = rounded
        live[made] = (addr, size, c, small)
        made += 1
        allocated += size
        requested += c
        if allocated > allocated_peak:
            allocated_peak = allocated
        if requested > requested_peak:
            requested_peak = requested
    _store(stats, allocated, reserved, requested, allocated_peak, reserved_peak, requested_peak)
    return stats, len(codes)


def demand(codes: list[int]) -> list[int]:
    """``replay_plain``'s ``demand`` for ``reserved.refuses``' early stop: for each event (and one past
    the last), the bytes of a new segment for every allocation from it on (frees add nothing) — the most
    the rest of the stream can add to the reserved bytes (a request that finds no cached block opens one
    segment of ``segment_size`` of its rounded size, and nothing else grows them). By the distinct sizes
    (a stream repeats few)."""
    segment = {c: segment_size(round_size(c)) for c in set(codes) if c >= 0}
    out = [*accumulate(map(segment.get, reversed(codes), repeat(0)))][::-1]
    out.append(0)
    return out


def _store(s: Replay, *counters: int) -> None:
    s.allocated, s.reserved, s.requested, s.allocated_peak, s.reserved_peak, s.requested_peak = counters
