"""``allocator.replay_plain`` compiled by numba (optional: ``pip install memplan[jit]``): the same rules,
decisions, counters and early stop, on integer arrays, ≈ 30× faster than the pure-Python loop.

The fit search judges most configurations by one capped replay with the early stop (``reserved.refuses``);
those replays were ≈ 40 % of a large search's time (docs/fit.md). ``reserved`` uses this module when numba
imports and falls back to ``replay_plain`` when it does not; tests/test_allocator_jit.py checks both give
the same counters, peaks, segments, released bytes, refusals and stopping event on random streams and on
real ones, at capacities where cached segments are released.

The state is that of ``replay_plain`` (the model of ``c10/cuda/CUDACachingAllocator.cpp`` described in
``allocator``'s docstring) without Python objects:

- each pool (large, small) is two parallel arrays, sizes and addresses of its free blocks, kept sorted
  by (size, address), so that best fit is the first entry ≥ (rounded, 0) (``_best_fit``'s
  (size, address) order, lower address on a tie);
- the free blocks by their start and by their end (for merging: ``try_merge_blocks``' neighbours) in two
  dicts shared by both pools (segments are disjoint, so addresses are unique across pools), the live
  segments by their start;
- the live allocations in arrays indexed by the allocation's number (the codes number them 0, 1, …).

All values are int64: byte counts and addresses (the model lays every segment it ever makes one after
another) stay far below 2⁶³ for any stream a step makes.

NB: the first call compiles the functions (≈ seconds; numba caches the machine code in ``__pycache__``,
``cache=True``, so later processes load it); a process that replays once gains nothing, so ``reserved``
uses this module only for the fit search's early-stopped replays (``reserved.refuses``).
"""

from __future__ import annotations

from typing import Any, cast

import numba
import numpy as np
import numpy.typing as npt
from numba.core.types import int64
from numba.typed import Dict

from memplan.analytic.allocator import (
    K_LARGE_BUFFER,
    K_MIN_BLOCK_SIZE,
    K_MIN_LARGE_ALLOC,
    K_ROUND_LARGE,
    K_SMALL_BUFFER,
    K_SMALL_SIZE,
    Replay,
    demand,
    replay_plain,
)

Codes = npt.NDArray[np.int64]


def _find(keys: Codes, n: int, key: int) -> int:
    """The first of the ``n`` sorted keys ≥ ``key`` (``bisect_left``)."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) >> 1
        if keys[mid] < key:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _insert(keys: Codes, n: int, key: int) -> None:
    """Insert ``key`` into the ``n`` sorted keys (``insort``)."""
    k = _find(keys, n, key)
    for j in range(n, k, -1):
        keys[j] = keys[j - 1]
    keys[k] = key


def _delete(keys: Codes, n: int, key: int) -> None:
    """Remove ``key`` from the ``n`` sorted keys."""
    for j in range(_find(keys, n, key), n - 1):
        keys[j] = keys[j + 1]


def _key(size: int, addr: int, shift: int) -> int:
    """A free block's pool key: (size, address) as one integer (``_replay``)."""
    return ((size >> 9) << shift) | (addr >> 9)


def _bits(value: int) -> int:
    """``int.bit_length``."""
    n = 0
    while value:
        value >>= 1
        n += 1
    return n


def _segment_size(rounded: int) -> int:
    """``allocator.segment_size``."""
    if rounded <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if rounded < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-rounded // K_ROUND_LARGE) * K_ROUND_LARGE


def _replay(codes: Codes, capacity: int, early: bool) -> Codes:
    """``replay_plain(codes, capacity or None, demand if early)``: its counters (allocated, reserved,
    requested, their three peaks, segments, released, oom) and the event it stopped before, as 10 int64.
    ``capacity`` < 0: unlimited. ``early``: ``reserved._refuses``' demand (a new segment for every
    allocation still to come) computed here, and the early stop on it."""
    n = len(codes)
    out = np.zeros(10, dtype=np.int64)
    demand = np.zeros(n + 1, dtype=np.int64)
    largest = 0
    for i in range(n - 1, -1, -1):
        c = codes[i]
        d = 0
        if c >= 0:
            d = _segment_size(max(K_MIN_BLOCK_SIZE, -(-c // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE))
            largest = max(largest, d)
        demand[i] = demand[i + 1] + d
    # A pool's key: size·2^shift + address, in units of 512 bytes (every size and address is a multiple):
    # a new segment for every allocation bounds every address and the largest segment every size
    shift = _bits(demand[0] >> 9)
    if shift + _bits(largest >> 9) > 62:
        out[9] = -1  # keys would not fit 63 bits: not replayed here
        return out
    # pools: row 0 large, row 1 small, each sorted; at most one free block per event
    keys = np.zeros((2, n + 1), dtype=np.int64)
    count = np.zeros(2, dtype=np.int64)
    # blocks (each event makes at most two: a segment and a split's rest), linked within their segment
    # (-1: none), as ``Allocator``'s ``_Block``; the pools' entries name them by address
    cap = 2 * n + 2
    b_addr = np.zeros(cap, dtype=np.int64)
    b_size = np.zeros(cap, dtype=np.int64)
    b_prev = np.full(cap, -1, dtype=np.int64)
    b_next = np.full(cap, -1, dtype=np.int64)
    b_free = np.zeros(cap, dtype=np.bool_)
    blocks = 0
    by_addr = Dict.empty(key_type=int64, value_type=int64)  # a free block's address -> its block
    live_block = np.full(n + 1, -1, dtype=np.int64)  # allocation -> its block (-1: refused)
    live_asked = np.zeros(n + 1, dtype=np.int64)
    live_small = np.zeros(n + 1, dtype=np.int64)
    top = made = 0
    allocated = reserved = requested = allocated_peak = reserved_peak = requested_peak = 0
    segments = released = oom = 0
    stop = n
    limited = capacity >= 0
    for i in range(n):
        if early and limited and reserved + demand[i] <= capacity:
            stop = i
            break
        c = codes[i]
        if c < 0:
            k = -c - 1
            x = live_block[k]
            if x < 0:  # an allocation refused (out of memory)
                continue
            live_block[k] = -1
            small = live_small[k]
            allocated -= b_size[x]
            requested -= live_asked[k]
            p = b_prev[x]
            if p >= 0 and b_free[p]:  # the free block before it in its segment joins it
                _delete(keys[small], count[small], _key(b_size[p], b_addr[p], shift))
                count[small] -= 1
                del by_addr[b_addr[p]]
                b_size[p] += b_size[x]
                b_next[p] = b_next[x]
                if b_next[x] >= 0:
                    b_prev[b_next[x]] = p
                x = p
            q = b_next[x]
            if q >= 0 and b_free[q]:  # …and the free block after it
                _delete(keys[small], count[small], _key(b_size[q], b_addr[q], shift))
                count[small] -= 1
                del by_addr[b_addr[q]]
                b_size[x] += b_size[q]
                b_next[x] = b_next[q]
                if b_next[q] >= 0:
                    b_prev[b_next[q]] = x
            b_free[x] = True
            by_addr[b_addr[x]] = x
            _insert(keys[small], count[small], _key(b_size[x], b_addr[x], shift))
            count[small] += 1
            continue
        rounded = max(K_MIN_BLOCK_SIZE, -(-c // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE)
        small = 1 if rounded <= K_SMALL_SIZE else 0
        k = _find(keys[small], count[small], _key(rounded, 0, shift))
        if k < count[small]:  # the smallest free block large enough, the lowest address on a tie
            addr = (keys[small, k] & ((1 << shift) - 1)) << 9
            x = by_addr[addr]
            del by_addr[addr]
            _delete(keys[small], count[small], keys[small, k])
            count[small] -= 1
        else:  # a new segment (releasing the wholly free ones when over the capacity)
            size = _segment_size(rounded)
            if limited and reserved + size > capacity:
                for p in range(2):
                    kept = 0
                    for j in range(count[p]):
                        y = by_addr[(keys[p, j] & ((1 << shift) - 1)) << 9]
                        if b_prev[y] < 0 and b_next[y] < 0:  # a whole segment, free
                            del by_addr[b_addr[y]]
                            b_free[y] = False
                            reserved -= b_size[y]
                            released += b_size[y]
                        else:
                            keys[p, kept] = keys[p, j]
                            kept += 1
                    count[p] = kept
                if reserved + size > capacity:
                    oom = 1
                    made += 1
                    if early:
                        stop = i + 1
                        break
                    continue
            x = blocks
            blocks += 1
            b_addr[x] = top
            b_size[x] = size
            top += size
            reserved += size
            segments += 1
            reserved_peak = max(reserved_peak, reserved)
        b_free[x] = False
        remaining = b_size[x] - rounded
        if remaining >= K_MIN_BLOCK_SIZE if small else remaining > K_SMALL_SIZE:  # should_split
            y = blocks
            blocks += 1
            b_addr[y] = b_addr[x] + rounded
            b_size[y] = remaining
            b_prev[y] = x
            b_next[y] = b_next[x]
            if b_next[x] >= 0:
                b_prev[b_next[x]] = y
            b_next[x] = y
            b_size[x] = rounded
            b_free[y] = True
            by_addr[b_addr[y]] = y
            _insert(keys[small], count[small], _key(remaining, b_addr[y], shift))
            count[small] += 1
        live_block[made] = x
        live_asked[made] = c
        live_small[made] = small
        made += 1
        allocated += b_size[x]
        requested += c
        allocated_peak = max(allocated_peak, allocated)
        requested_peak = max(requested_peak, requested)
    out[0] = allocated
    out[1] = reserved
    out[2] = requested
    out[3] = allocated_peak
    out[4] = reserved_peak
    out[5] = requested_peak
    out[6] = segments
    out[7] = released
    out[8] = oom
    out[9] = stop
    return out


_jit = numba.njit(cache=True)
_find = _jit(_find)
_insert = _jit(_insert)
_delete = _jit(_delete)
_segment_size = _jit(_segment_size)
_key = _jit(_key)
_bits = _jit(_bits)
_compiled: Any = _jit(_replay)


def replay_jit(codes: list[int], capacity: int | None = None, early: bool = False) -> tuple[Replay, int]:
    """``allocator.replay_plain(codes, capacity, demand)`` compiled, with ``demand`` — a new segment for
    every allocation from each event on (``reserved._refuses``) — when ``early``: the counters and the
    index of the event it stopped before. A stream whose pool keys would not fit 63 bits (segments
    beyond 2⁶² bytes in all, in a replay no step makes) is replayed by ``replay_plain`` itself."""
    array = np.array(codes, dtype=np.int64) if codes else np.zeros(0, dtype=np.int64)
    values = [int(v) for v in cast(Codes, _compiled(array, -1 if capacity is None else capacity, early))]
    if values[9] < 0:
        return replay_plain(codes, capacity, demand(codes) if early else None)
    stats = Replay(
        allocated=values[0],
        reserved=values[1],
        requested=values[2],
        allocated_peak=values[3],
        reserved_peak=values[4],
        requested_peak=values[5],
        segments=values[6],
        released=values[7],
        oom=bool(values[8]),
    )
    return stats, values[9]
