"""The compiled replay behind ``analytic.allocator.jit``: ``allocator.plain.replay_plain``'s rules,
decisions, counters and early stop, on integer arrays, compiled by numba (``replay_array``), with the
sorted pools it keeps free blocks in.

The state is ``Allocator``'s (the model of ``c10/cuda/CUDACachingAllocator.cpp`` in ``allocator``'s
docstring) without Python objects:

- blocks in arrays (address, size, free, the previous and next block of their segment: ``_Block``'s
  links, so a freed block merges with its free neighbours as ``try_merge_blocks`` does); a free block is
  found by its address (unique: segments are laid one after another) in one open-addressed table of
  int64 arrays (``_find``: linear probing, deletion by shifting the probe chain back), twice the blocks'
  room so at most half full — with numba's typed dict instead the 405B fit search's 67 replays took
  0.142–0.148 CPU s against 0.115 (alternately, docs/fit.md's fifth round);
- each pool (large, small) one sorted set of integer keys (size, address) — size·2^shift + address, in
  units of 512 bytes (every size and address is a multiple of 512) — so that best fit is the first key ≥
  the request's (``_best_fit``'s (size, address) order, the lower address on a tie), kept as a sorted
  list of chunks of at most ``CHUNK`` keys (a pool holds hundreds of free blocks in a large plan's
  stream: one sorted array would move them all on every insertion);
- the live allocations in arrays indexed by their number (the codes number them 0, 1, …).

The keys must fit 63 bits: every address is below the bytes of a new segment for every allocation
(``allocator.plain.demand``'s first entry) and every size at most the largest segment; a stream where they
would not (segments of 2⁶² bytes in all) is not replayed here (``replay_array`` says so; the entry points
in ``allocator.jit`` replay it by ``replay_plain``). Every other value is an int64 byte count, far below
2⁶³ for any stream a step makes.

NB: the pools and the replay stay in this one module: numba's cache (``cache=True``) is invalidated when
the compiled function's own file changes, not when a function it calls from another file does.
NB: ``allocator.segment_size`` is compiled as it is (its constants frozen into the machine code).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import numpy.typing as npt

from memplan.analytic.allocator import K_MIN_BLOCK_SIZE, K_SMALL_SIZE, Replay, segment_size

Codes = npt.NDArray[np.int64]


CHUNK = 64
"""Keys per chunk of a pool (``_pool_insert``): a chunk full splits in two halves."""

# A pool q (0 large, 1 small) is a sorted list of chunks: chunk c holds lens[q, c] sorted keys in
# data[q, c, :]; order[q, :meta[q, 0]] lists the chunks in key order and maxes[q, :] their largest keys;
# meta[q, 1] chunk ids made, meta[q, 2] spare ids (kept at the end of order[q]). Each function takes the
# whole arrays and q (numba's array views count references: one per call would cost more than the work).


def _chunk_at(maxes: Codes, q: int, chunks: int, key: int) -> int:
    """The first chunk (in key order) whose largest key is ≥ ``key`` (``chunks``: none): bisect_left."""
    lo, hi = 0, chunks
    while lo < hi:
        mid = (lo + hi) >> 1
        if maxes[q, mid] < key:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _in_chunk(data: Codes, q: int, c: int, n: int, key: int) -> int:
    """The first of chunk ``c``'s ``n`` keys ≥ ``key``: bisect_left."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) >> 1
        if data[q, c, mid] < key:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _pool_ceiling(data: Codes, lens: Codes, order: Codes, maxes: Codes, meta: Codes, q: int, key: int) -> int:
    """The smallest key of pool ``q`` ≥ ``key``; −1 when there is none."""
    p = _chunk_at(maxes, q, meta[q, 0], key)
    if p == meta[q, 0]:
        return -1
    c = order[q, p]
    return int(data[q, c, _in_chunk(data, q, c, lens[q, c], key)])


def _pool_insert(data: Codes, lens: Codes, order: Codes, maxes: Codes, meta: Codes, q: int, key: int) -> None:
    """Insert ``key`` into pool ``q``: into the chunk where it sorts (the last one when it is the
    largest), split when full; the chunks' order and largest keys kept."""
    chunks = meta[q, 0]
    if chunks == 0:
        c = _new_chunk(meta, order, q)
        data[q, c, 0] = key
        lens[q, c] = 1
        order[q, 0] = c
        maxes[q, 0] = key
        meta[q, 0] = 1
        return
    p = min(_chunk_at(maxes, q, chunks, key), chunks - 1)
    c = order[q, p]
    n = lens[q, c]
    k = _in_chunk(data, q, c, n, key)
    for j in range(n, k, -1):
        data[q, c, j] = data[q, c, j - 1]
    data[q, c, k] = key
    n += 1
    lens[q, c] = n
    maxes[q, p] = data[q, c, n - 1]
    if n == CHUNK:  # split: the upper half to a new chunk right after it
        d = _new_chunk(meta, order, q)
        half = CHUNK // 2
        for j in range(half, CHUNK):
            data[q, d, j - half] = data[q, c, j]
        lens[q, c] = half
        lens[q, d] = CHUNK - half
        for j in range(chunks, p + 1, -1):
            order[q, j] = order[q, j - 1]
            maxes[q, j] = maxes[q, j - 1]
        order[q, p + 1] = d
        maxes[q, p + 1] = data[q, d, CHUNK - half - 1]
        maxes[q, p] = data[q, c, half - 1]
        meta[q, 0] = chunks + 1


def _remove(
    data: Codes, lens: Codes, order: Codes, maxes: Codes, meta: Codes, q: int, p: int, k: int
) -> None:
    """Remove the ``k``-th key of the chunk at position ``p`` of pool ``q``'s order; a chunk left empty
    leaves the order and its id becomes a spare one."""
    c = order[q, p]
    n = lens[q, c]
    for j in range(k, n - 1):
        data[q, c, j] = data[q, c, j + 1]
    n -= 1
    lens[q, c] = n
    if n:
        maxes[q, p] = data[q, c, n - 1]
        return
    chunks = meta[q, 0]
    for j in range(p, chunks - 1):
        order[q, j] = order[q, j + 1]
        maxes[q, j] = maxes[q, j + 1]
    meta[q, 0] = chunks - 1
    order[q, order.shape[1] - 1 - meta[q, 2]] = c  # a spare id now
    meta[q, 2] += 1


def _pool_delete(data: Codes, lens: Codes, order: Codes, maxes: Codes, meta: Codes, q: int, key: int) -> None:
    """Remove ``key`` (in pool ``q``)."""
    p = _chunk_at(maxes, q, meta[q, 0], key)
    c = order[q, p]
    _remove(data, lens, order, maxes, meta, q, p, _in_chunk(data, q, c, lens[q, c], key))


def _pool_take(data: Codes, lens: Codes, order: Codes, maxes: Codes, meta: Codes, q: int, key: int) -> int:
    """The smallest key of pool ``q`` ≥ ``key``, removed (−1: none): ``_pool_ceiling`` then ``_pool_delete``
    of what it found, without finding it twice."""
    p = _chunk_at(maxes, q, meta[q, 0], key)
    if p == meta[q, 0]:
        return -1
    c = order[q, p]
    k = _in_chunk(data, q, c, lens[q, c], key)
    found = int(data[q, c, k])
    _remove(data, lens, order, maxes, meta, q, p, k)
    return found


def _new_chunk(meta: Codes, order: Codes, q: int) -> int:
    """A chunk id of pool ``q``: a spare one, else the next unused."""
    if meta[q, 2]:
        meta[q, 2] -= 1
        return int(order[q, order.shape[1] - 1 - meta[q, 2]])
    meta[q, 1] += 1
    return int(meta[q, 1] - 1)


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


def _join(b_size: Codes, b_prev: Codes, b_next: Codes, first: int, second: int) -> None:
    """``try_merge_blocks`` on the block arrays: ``second``, the block after ``first`` in its segment,
    joins ``first``."""
    b_size[first] += b_size[second]
    b_next[first] = b_next[second]
    if b_next[second] >= 0:
        b_prev[b_next[second]] = first


_FIB = -7046029254386353131
"""2⁶⁴/φ as an int64 (Fibonacci hashing): a table slot is bits 17 and up of key·_FIB."""


def _find(keys: Codes, mask: int, k: int) -> int:
    """The slot of key ``k`` (≥ 0) in the open-addressed table ``keys`` (−1: empty; ``mask`` its size less
    one), or the empty slot where it would go: linear probing from its hash."""
    i = ((k * _FIB) >> 17) & mask
    while keys[i] != -1 and keys[i] != k:
        i = (i + 1) & mask
    return i


def _put(keys: Codes, values: Codes, mask: int, k: int, v: int) -> None:
    """Key ``k`` → ``v`` in the table."""
    i = _find(keys, mask, k)
    keys[i] = k
    values[i] = v


def _drop(keys: Codes, values: Codes, mask: int, k: int) -> None:
    """Remove key ``k`` (present): each later entry of the probe chain whose home slot is not cyclically
    in (its slot's, the hole's] moves back into the hole (no tombstones, so lookups stay exact)."""
    i = _find(keys, mask, k)
    j = i
    while True:
        j = (j + 1) & mask
        if keys[j] == -1:
            break
        h = ((keys[j] * _FIB) >> 17) & mask
        if (j > i and (h <= i or h > j)) or (j < i and h <= i and h > j):
            keys[i] = keys[j]
            values[i] = values[j]
            i = j
    keys[i] = -1


def _replay(codes: Codes, capacity: int, early: bool) -> Codes:
    """``replay_plain(codes, capacity or None, demand if early)``: its counters (allocated, reserved,
    requested, their three peaks, segments, released, oom) and the event it stopped before, as 10 int64.
    ``capacity`` < 0: unlimited. ``early``: ``reserved._refuses``' demand (a new segment for every
    allocation still to come) computed here, and the early stop on it."""
    n = len(codes)
    out = np.zeros(10, dtype=np.int64)
    demand = np.zeros(n + 1, dtype=np.int64)
    largest = 0
    allocs = 0  # the allocations: what the blocks, the live allocations and the pools are sized by
    for i in range(n - 1, -1, -1):
        c = codes[i]
        d = 0
        if c >= 0:
            d = _segment_size(max(K_MIN_BLOCK_SIZE, -(-c // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE))
            largest = max(largest, d)
            allocs += 1
        demand[i] = demand[i + 1] + d
    # A pool's key: size·2^shift + address, in units of 512 bytes (every size and address is a multiple):
    # a new segment for every allocation bounds every address and the largest segment every size
    shift = _bits(demand[0] >> 9)
    if shift + _bits(largest >> 9) > 62:
        out[9] = -1  # keys would not fit 63 bits: not replayed here
        return out
    # pools: 0 large, 1 small, each a sorted list of chunks (``_pool_insert``); a pool holds at most one
    # free block per event and at most every block (two per allocation, below), and each of its chunks
    # at least one
    room = min(n, 2 * allocs) + 2
    data = np.empty((2, room, CHUNK), dtype=np.int64)
    lens = np.zeros((2, room), dtype=np.int64)
    order = np.zeros((2, room), dtype=np.int64)
    maxes = np.zeros((2, room), dtype=np.int64)
    meta = np.zeros((2, 3), dtype=np.int64)  # chunks in order, ids made, spare ids
    kept = np.zeros(room, dtype=np.int64)
    # blocks (each allocation makes at most two: a segment and a split's rest; a free makes none), linked
    # within their segment (-1: none), as ``Allocator``'s ``_Block``; the pools' keys name them by address
    # (``at_keys``). Sized by the allocations, not the events: half the arrays to fill in a step's stream
    cap = 2 * allocs + 2
    b_addr = np.zeros(cap, dtype=np.int64)
    b_size = np.zeros(cap, dtype=np.int64)
    b_prev = np.full(cap, -1, dtype=np.int64)
    b_next = np.full(cap, -1, dtype=np.int64)
    b_free = np.zeros(cap, dtype=np.bool_)
    blocks = 0
    # a free block's address (in 512-byte units) -> its block: an open-addressed table at most half full
    mask = 1
    while mask < 2 * cap:
        mask <<= 1
    mask -= 1
    at_keys = np.full(mask + 1, -1, dtype=np.int64)
    at_blocks = np.zeros(mask + 1, dtype=np.int64)
    live_block = np.full(allocs + 1, -1, dtype=np.int64)  # allocation -> its block (-1: refused)
    live_asked = np.zeros(allocs + 1, dtype=np.int64)
    live_small = np.zeros(allocs + 1, dtype=np.int64)
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
            if p >= 0 and b_free[p]:  # the free block before it in its segment: it joins it
                _pool_delete(data, lens, order, maxes, meta, small, _key(b_size[p], b_addr[p], shift))
                _drop(at_keys, at_blocks, mask, b_addr[p] >> 9)
                _join(b_size, b_prev, b_next, p, x)
                x = p
            q = b_next[x]
            if q >= 0 and b_free[q]:  # …and the free block after it joins it
                _pool_delete(data, lens, order, maxes, meta, small, _key(b_size[q], b_addr[q], shift))
                _drop(at_keys, at_blocks, mask, b_addr[q] >> 9)
                _join(b_size, b_prev, b_next, x, q)
            b_free[x] = True
            _put(at_keys, at_blocks, mask, b_addr[x] >> 9, x)
            _pool_insert(data, lens, order, maxes, meta, small, _key(b_size[x], b_addr[x], shift))
            continue
        rounded = max(K_MIN_BLOCK_SIZE, -(-c // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE)
        small = 1 if rounded <= K_SMALL_SIZE else 0
        key = _pool_take(data, lens, order, maxes, meta, small, _key(rounded, 0, shift))
        if key >= 0:  # the smallest free block large enough, the lowest address on a tie
            unit = key & ((1 << shift) - 1)  # its address, in 512-byte units
            x = at_blocks[_find(at_keys, mask, unit)]
            _drop(at_keys, at_blocks, mask, unit)
        else:  # a new segment (releasing the wholly free ones when over the capacity)
            size = _segment_size(rounded)
            if limited and reserved + size > capacity:
                for p in range(2):  # the pool's keys in order, the released ones left out, rebuilt
                    m = 0
                    for h in range(meta[p, 0]):
                        chunk = order[p, h]
                        for j in range(lens[p, chunk]):
                            y = at_blocks[_find(at_keys, mask, data[p, chunk, j] & ((1 << shift) - 1))]
                            if b_prev[y] < 0 and b_next[y] < 0:  # a whole segment, free
                                _drop(at_keys, at_blocks, mask, b_addr[y] >> 9)
                                b_free[y] = False
                                reserved -= b_size[y]
                                released += b_size[y]
                            else:
                                kept[m] = data[p, chunk, j]
                                m += 1
                    meta[p, 0] = meta[p, 1] = meta[p, 2] = 0
                    for j in range(m):
                        _pool_insert(data, lens, order, maxes, meta, p, kept[j])
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
            _put(at_keys, at_blocks, mask, b_addr[y] >> 9, y)
            _pool_insert(data, lens, order, maxes, meta, small, _key(remaining, b_addr[y], shift))
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
_in_chunk = _jit(_in_chunk)
_chunk_at = _jit(_chunk_at)
_pool_ceiling = _jit(_pool_ceiling)
_pool_insert = _jit(_pool_insert)
_remove = _jit(_remove)
_pool_delete = _jit(_pool_delete)
_pool_take = _jit(_pool_take)
_new_chunk = _jit(_new_chunk)
_segment_size = _jit(segment_size)
_key = _jit(_key)
_bits = _jit(_bits)
_join = _jit(_join)
_find = _jit(_find)
_put = _jit(_put)
_drop = _jit(_drop)
replay_array: Any = _jit(_replay)
"""``_replay`` compiled: (codes as int64, capacity (< 0: unlimited), early) → its 10 int64."""


def replay_stats(values: list[int]) -> Replay:
    """``_replay``'s counters (its first nine values) as a ``Replay``."""
    return Replay(
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
