"""A model of torch's CUDA caching allocator: replay an allocation stream, in order, into segments.

The rules are those of ``c10/cuda/CUDACachingAllocator.cpp`` (pytorch/pytorch; the constants at the top
of the file, ``round_size``, ``get_pool``, ``get_allocation_size``, ``get_free_block``, ``should_split``,
``alloc_found_block``, ``free_block``/``try_merge_blocks``, ``release_cached_blocks`` and the note
[Expandable Segments]):

- every request is rounded up to a multiple of 512 bytes (``kMinBlockSize``; 512 at least);
- a rounded request ≤ 1 MiB (``kSmallSize``) is served from the *small* pool, whose segments are 2 MiB
  (``kSmallBuffer``); a larger one from the *large* pool: requests below 10 MiB (``kMinLargeAlloc``)
  open a 20 MiB segment (``kLargeBuffer``), larger ones a segment of the request rounded up to 2 MiB
  (``kRoundLarge``);
- a request first takes the smallest free cached block of its pool and stream that is large enough
  (best fit; the lower address on a tie: the pool is ordered by stream, size, address); only when none
  fits does the allocator ``cudaMalloc`` a new segment;
- the block taken is split when what remains is worth keeping: in the small pool when ≥ 512 bytes, in
  the large pool when > 1 MiB (and the request is below ``max_split_size``); otherwise the whole block is
  handed out (``allocated_bytes`` counts the whole block);
- a freed block merges with its free neighbours of the same segment and goes back to its pool; segments
  are never returned while the step runs, but for the out-of-memory path: when a new segment would pass
  the device's capacity, every cached segment wholly free is released (``release_cached_blocks``) and the
  request retried;
- ``max_split_size`` (``PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb``, unlimited by default): cached blocks
  at least that large are *oversize*: never split, never given to a smaller request, and given to a
  request at least that large only when they exceed it by less than 20 MiB (``kLargeBuffer``);
- ``expandable_segments:True``: one segment per pool and stream whose mapped size grows by pages, 2 MiB
  for the small pool and 20 MiB for the large one; a free block is split whenever ≥ 512 bytes remain; the
  free block at the segment's mapped end counts, for best fit, as the size it can grow to (taken last),
  and grows by the pages the request lacks.

``Allocator`` replays any stream; ``analytic.allocator.plain.replay_plain`` the default allocator (no
expandable segments, no ``max_split_size``) on one stream, with the same decisions and counters, without
block objects (the fit search's replays).

Reserved bytes are the segments' (mapped pages'); allocated bytes the blocks handed out; requested bytes
the requests as made. Peaks are taken after every event, as ``torch.cuda.memory_stats()`` keeps them
(``reserved_bytes.all.peak``, ``allocated_bytes.all.peak``, ``requested_bytes.all.peak``).

NB: CUDA graphs' private pools, ``garbage_collection_threshold``, ``roundup_power2_divisions`` and the
``record_stream`` events that delay a block's reuse until another stream is done with it are not
modelled; a block is free for reuse the moment it is freed. The addresses are the model's own (segments
laid one after another), so best-fit ties between segments break in creation order. Under expandable
segments the out-of-memory path's unmapping of free pages (``release_cached_blocks`` → ``unmap_block``) is
not modelled: only whole free segments of the plain allocator are released.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import NamedTuple

K_MIN_BLOCK_SIZE = 512
"""``kMinBlockSize``: all sizes are rounded to at least 512 bytes."""
K_SMALL_SIZE = 1 << 20
"""``kSmallSize``: the largest "small" allocation, 1 MiB."""
K_SMALL_BUFFER = 2 << 20
"""``kSmallBuffer``: "small" allocations are packed in 2 MiB segments (and expandable pages)."""
K_LARGE_BUFFER = 20 << 20
"""``kLargeBuffer``: allocations between 1 and 10 MiB use a 20 MiB segment (and expandable pages)."""
K_MIN_LARGE_ALLOC = 10 << 20
"""``kMinLargeAlloc``: allocations below 10 MiB may use ``kLargeBuffer``."""
K_ROUND_LARGE = 2 << 20
"""``kRoundLarge``: larger allocations are rounded up to 2 MiB."""


CUBLAS_THREADS = 2
"""Threads of a training step whose GEMMs each take a cuBLAS workspace from this allocator: the
forward's and the autograd engine's device thread, which runs the backward. torch keeps one workspace
per cuBLAS handle and stream (aten/src/ATen/cuda/CublasHandlePool.cpp: ``cublas_handle_stream_to_
workspace``, keyed by (handle, stream)) and one handle per thread (its ``thread_local`` ``PoolWindow``);
measured on an H200 (docs/gpu-profile.md, ``alloc_stream``'s docstring)."""


class Alloc(NamedTuple):
    """One allocation of ``size`` bytes on ``stream``, named ``id`` for its free."""

    id: int
    size: int
    stream: int = 0


class Free(NamedTuple):
    id: int


Event = Alloc | Free


def round_size(size: int) -> int:
    """``round_size``: up to a multiple of 512 bytes, 512 at least."""
    return max(K_MIN_BLOCK_SIZE, -(-size // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE)


def is_small(rounded: int) -> bool:
    """``get_pool``: the small pool serves rounded sizes up to 1 MiB."""
    return rounded <= K_SMALL_SIZE


def segment_size(rounded: int) -> int:
    """``get_allocation_size``: the ``cudaMalloc`` a request that found no cached block makes."""
    if rounded <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if rounded < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-rounded // K_ROUND_LARGE) * K_ROUND_LARGE


@dataclass(eq=False, slots=True)
class _Block:
    addr: int
    size: int
    small: bool
    stream: int
    prev: _Block | None = None
    next: _Block | None = None
    allocated: bool = False
    tail: bool = False
    """Expandable segments: the block at the mapped end (it can grow)."""


@dataclass
class Replay:
    """The allocator's counters after a replay (bytes) and how many segments it made."""

    allocated: int = 0
    reserved: int = 0
    requested: int = 0
    allocated_peak: int = 0
    reserved_peak: int = 0
    requested_peak: int = 0
    segments: int = 0
    released: int = 0
    """Bytes of cached segments released by the out-of-memory path."""
    oom: bool = False
    """A request did not fit the capacity even with every wholly free cached segment released."""


@dataclass
class Allocator:
    """The caching allocator of one device; ``capacity``: bytes ``cudaMalloc`` may hand out (None:
    unlimited)."""

    expandable: bool = False
    max_split_size: int | None = None
    capacity: int | None = None
    stats: Replay = field(default_factory=Replay)
    _pools: dict[tuple[bool, int], list[tuple[int, int]]] = field(default_factory=dict)
    _free: dict[int, _Block] = field(default_factory=dict)
    """Free blocks by address (the pools hold their (size, address) keys, sorted)."""
    _live: dict[int, tuple[_Block, int]] = field(default_factory=dict)
    _top: int = 0
    """The next segment's address: segments are laid one after another."""
    _expanding: dict[tuple[bool, int], _Block] = field(default_factory=dict)

    # ------------------------------------------------------------------------------------------------
    def replay(self, events: list[Event]) -> Replay:
        malloc, free = self.malloc, self.free
        for e in events:
            if type(e) is Alloc:
                malloc(e[0], e[1], e[2])
            else:
                free(e[0])
        return self.stats

    def replay_codes(self, codes: list[int]) -> Replay:
        """``replay`` of a stream on stream 0 coded as integers (``alloc_stream.codes``: n ≥ 0 allocates n
        bytes, the allocations numbered 0, 1, … in order; −k − 1 frees allocation k): no event objects."""
        malloc, free = self.malloc, self.free
        made = 0
        for c in codes:
            if c >= 0:
                malloc(made, c)
                made += 1
            else:
                free(-c - 1)
        return self.stats

    def malloc(self, id_: int, size: int, stream: int = 0) -> None:
        rounded = -(-size // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE or K_MIN_BLOCK_SIZE  # round_size, inline
        small = rounded <= K_SMALL_SIZE  # is_small
        keys = self._pools.get((small, stream))
        block = self._best_fit(small, stream, rounded) if keys or self.expandable else None
        block = block or self._new_block(small, stream, rounded)
        if block is not None and block.size < rounded:  # an expandable segment's end: map more pages
            block = self._grow(block, rounded)
        if block is None:
            self.stats.oom = True
            return
        remaining = block.size - rounded  # should_split, inline
        if (
            remaining >= K_MIN_BLOCK_SIZE
            if small or self.expandable
            else remaining > K_SMALL_SIZE and self._below_max_split(rounded)
        ):
            rest = _Block(block.addr + rounded, block.size - rounded, small, stream, block, block.next)
            rest.tail, block.tail = block.tail, False
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, rounded
            self._insert(rest)
        block.allocated = True
        self._live[id_] = (block, size)
        s = self.stats
        s.allocated += block.size
        s.requested += size
        if s.allocated > s.allocated_peak:
            s.allocated_peak = s.allocated
        if s.requested > s.requested_peak:
            s.requested_peak = s.requested

    def free(self, id_: int) -> None:
        found = self._live.pop(id_, None)
        if found is None:  # an allocation that failed (out of memory) or was never made
            return
        block, size = found
        self.stats.allocated -= block.size
        self.stats.requested -= size
        block.allocated = False
        for other in (block.prev, block.next):
            if other is not None and not other.allocated:
                self._remove(other)
                block = self._merge(block, other)
        self._insert(block)

    # ------------------------------------------------------------------------------------------------
    def _below_max_split(self, size: int) -> bool:
        return self.max_split_size is None or size < self.max_split_size

    def _best_fit(self, small: bool, stream: int, rounded: int) -> _Block | None:
        """``get_free_block``: the smallest free block ≥ the request (lower address on a tie), with the
        oversize rules; under expandable segments the growable end block last (it counts as the size it
        can grow to)."""
        keys = self._pools.get((small, stream), [])
        for size, addr in keys[bisect.bisect_left(keys, (rounded, -1)) :]:
            block = self._free[addr]
            if block.tail:
                continue
            if self.max_split_size is not None and not small:
                if rounded < self.max_split_size <= size:
                    return None  # do not return an oversized block for a smaller request
                if rounded >= self.max_split_size and size >= rounded + K_LARGE_BUFFER:
                    return None  # an oversized block only within 20 MiB of the request
            self._remove(block)
            return block
        end = self._expanding.get((small, stream))
        if end is None or end.allocated:
            return None
        self._remove(end)
        return end

    def _new_block(self, small: bool, stream: int, rounded: int) -> _Block | None:
        """``alloc_block``: a new segment (releasing wholly free cached segments when over capacity);
        under expandable segments an empty block at the mapped end of the pool's one segment."""
        if self.expandable:
            end = self._expanding.get((small, stream))
            if end is None:  # the pool's segment: address space for the whole device, mapped on demand
                block = _Block(self._top, 0, small, stream, tail=True)
                self._top += 1 << 48
                self.stats.segments += 1
            else:  # the end block is handed out: a new, empty one after it
                block = _Block(end.addr + end.size, 0, small, stream, end, None, tail=True)
                end.next, end.tail = block, False
            self._expanding[(small, stream)] = block
            return block
        size = segment_size(rounded)
        if not self._room(size):
            return None
        block = _Block(self._top, size, small, stream)
        self._top += size
        self._reserve(size)
        self.stats.segments += 1
        return block

    def _grow(self, block: _Block, rounded: int) -> _Block | None:
        """Map the pages the growable end block lacks for ``rounded`` bytes (2 MiB small, 20 MiB large)."""
        page = K_SMALL_BUFFER if block.small else K_LARGE_BUFFER
        more = -(-(rounded - block.size) // page) * page
        if not self._room(more):
            if block.size:
                self._insert(block)
            else:  # the empty end block made for this request: undo it
                self._unlink_empty(block)
            return None
        block.size += more
        self._reserve(more)
        return block

    def _unlink_empty(self, block: _Block) -> None:
        key = (block.small, block.stream)
        if block.prev is None:
            del self._expanding[key]
        else:
            block.prev.next, block.prev.tail = None, True
            self._expanding[key] = block.prev

    def _room(self, size: int) -> bool:
        """Whether ``size`` more bytes fit the capacity, after releasing every wholly free segment."""
        if self.capacity is None or self.stats.reserved + size <= self.capacity:
            return True
        for addr in [a for a, b in self._free.items() if b.prev is None and b.next is None and not b.tail]:
            block = self._free[addr]
            self._remove(block)
            self.stats.reserved -= block.size
            self.stats.released += block.size
        return self.stats.reserved + size <= self.capacity

    def _reserve(self, size: int) -> None:
        s = self.stats
        s.reserved += size
        if s.reserved > s.reserved_peak:
            s.reserved_peak = s.reserved

    def _merge(self, block: _Block, other: _Block) -> _Block:
        """``try_merge_blocks``: ``other`` (a free neighbour) joins ``block``."""
        first, second = (block, other) if block.addr < other.addr else (other, block)
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        first.tail = first.tail or second.tail
        first.allocated = False
        if first.tail:
            self._expanding[(first.small, first.stream)] = first
        return first

    def _insert(self, block: _Block) -> None:
        if block.tail:
            self._expanding[(block.small, block.stream)] = block
        self._free[block.addr] = block
        bisect.insort(self._pools.setdefault((block.small, block.stream), []), (block.size, block.addr))

    def _remove(self, block: _Block) -> None:
        keys = self._pools[(block.small, block.stream)]
        del keys[bisect.bisect_left(keys, (block.size, block.addr))]
        del self._free[block.addr]


def replay(
    events: list[Event],
    *,
    expandable: bool = False,
    max_split_size: int | None = None,
    capacity: int | None = None,
) -> Replay:
    """The allocator's counters and peaks after ``events``, from an empty cache."""
    return Allocator(expandable=expandable, max_split_size=max_split_size, capacity=capacity).replay(events)
