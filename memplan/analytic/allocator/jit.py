"""``allocator.plain.replay_plain`` compiled by numba (optional: ``pip install memplan[jit]``): the same
rules, decisions, counters and early stop, on integer arrays; and ``alloc_stream.codes`` compiled, so
that a stream is coded and replayed in one call. The entry points ``reserved`` calls: ``replay_jit``,
``codes_jit``, ``replay_inputs_jit``, ``refuses_jit``.

The fit search judges most configurations by one capped replay with the early stop (``reserved.refuses``);
those replays were ≈ 40 % of a large search's time (docs/fit.md). ``reserved`` uses this module as
``MEMPLAN_JIT`` says (``1``: from the first replay; ``auto``: once the Python replays have spent its load;
``0``, the default: never) and ``replay_plain`` otherwise; tests/test_allocator_jit.py checks that
both give the same counters, peaks, segments, released bytes, refusals and stopping event on random
streams and on real ones, at capacities where cached segments are released.

The replay itself, its pools and its state are ``analytic.allocator.jit_replay``'s; a stream whose pool
keys would not fit 63 bits (segments of 2⁶² bytes in all) is replayed by ``replay_plain`` instead.

NB: the first call in a fresh installation compiles the functions (≈ 5 s); numba caches the machine code
in ``__pycache__`` (``cache=True``) and later processes load it, with numba's import (0.66–0.78 CPU s
together: ``reserved.JIT_LOAD_SECONDS``), so ``reserved`` loads this module only for the fit search's
early-stopped replays (``reserved.refuses``), never for one estimate's replay.
"""

from __future__ import annotations

import itertools
from typing import Any, Protocol, cast

import numba
import numpy as np

from memplan.analytic.allocator import CUBLAS_THREADS, Replay
from memplan.analytic.allocator.jit_replay import Codes, replay_array, replay_stats
from memplan.analytic.allocator.plain import demand, replay_plain

WEIGHTS, OPTIMIZER, GRADIENTS, ACTIVATIONS, TRANSIENT = range(5)
"""The columns of ``_code``'s points: ``analytic.peak.TERMS``' order (``reserved`` passes them so)."""


def _code(
    points: Codes,
    per_tensor: Codes,
    states: Codes,
    layer: Codes,
    parts: Codes,
    split: int,
    piece_data: Codes,
    piece_start: Codes,
    save_data: Codes,
    save_start: Codes,
    threads: int,
    workspace: int,
    steps: int,
) -> Codes:
    """``alloc_stream.codes`` compiled: the stream of the timeline ``points`` (one row per point, one column
    per term) over ``steps`` steps, its allocations and frees coded as integers (n ≥ 0 allocates n bytes,
    the allocations numbered in order; −k − 1 frees allocation k). ``per_tensor``: the rank's tensors'
    elements in parameter order; ``states``: the weights', optimizer states' and gradients' bytes;
    ``layer``: one layer's saves, the first ``split`` of them made before the layer's forward peak
    (``alloc_stream.StreamInputs.split``); ``parts``: the optimizer's tensors per parameter, bytes per
    element (``alloc_stream.optimizer_parts``); ``piece_data[piece_start[k]:piece_start[k + 1]]``: point
    k's transient as its tensors (``StreamInputs.pieces``; ``piece_start`` empty: none), and
    ``save_data[save_start[k]:save_start[k + 1]]`` its rise of the activations (``StreamInputs.saves``,
    taken where they add up to the rise); ``threads``:
    the cuBLAS workspaces made at the first point (``CUBLAS_THREADS``). Line by line
    ``alloc_stream.codes`` (its docstring and the module's say why): at each point the terms that shrink
    free their newest allocations first (the transient all of them), then the terms that grow allocate, a
    term freed past its target first — the activations one layer's saves when the rise is one layer's (or
    the first ``split`` of them, or the rest), else one block; the transient its tensors where known, else
    one block; the model states their next whole tensors (``alloc_stream.take``) from the term's queue,
    refilled (``alloc_stream.tensor_bytes``, the optimizer's ``alloc_stream.optimizer_tensors``) each time
    the term starts from 0, gradients in reverse order."""
    out = [0]
    out.pop()
    # each term's held allocations, a stack kept as a linked list over all allocations
    held_id = [0]
    held_size = [0]
    held_below = [0]
    held_id.pop()
    held_size.pop()
    held_below.pop()
    top = np.full(5, -1, dtype=np.int64)
    total = np.zeros(5, dtype=np.int64)
    cut = np.zeros(5, dtype=np.bool_)
    tensors = len(per_tensor)
    queue = np.zeros((3, tensors * max(1, len(parts))), dtype=np.int64)
    queued = np.zeros(3, dtype=np.int64)
    taken = np.zeros(3, dtype=np.int64)
    count = 0
    for e in per_tensor:
        count += e
    one_layer = 0
    for e in layer:
        one_layer += e
    # the optimizer's tensors (``alloc_stream.optimizer_tensors``): a master copy each unless the states
    # alone make the term (FSDP2's fp32 shards), then each parameter's states; else whole tensors
    part_sum = 0
    for b in parts:
        part_sum += b
    master = parts[0] if len(parts) else 0
    if len(parts) and count * (part_sum - master) == states[OPTIMIZER]:
        master = 0
    by_parts = len(parts) > 0 and count > 0 and count * (part_sum - parts[0] + master) == states[OPTIMIZER]
    first = 0
    for j in range(min(split, len(layer))):
        first += layer[j]
    made = 0
    rise = [0]
    for step in range(steps):
        for k in range(points.shape[0]):
            for term in range(5):  # frees first: what shrinks, newest first; every transient
                target = 0 if term == TRANSIENT else points[k, term]
                now = total[term]
                was = now
                while top[term] >= 0 and now > target:
                    j = top[term]
                    out.append(-held_id[j] - 1)
                    now -= held_size[j]
                    top[term] = held_below[j]
                cut[term] = now < target < was  # freed past its target: the rest is made again, first
                total[term] = now
            if step == 0 and k == 0 and workspace:  # one per thread: analytic.allocator.CUBLAS_THREADS
                for _ in range(threads):
                    out.append(workspace)
                made += threads
            for turn in range(10):  # the terms freed past their target first, then the others
                term = turn % 5
                if cut[term] != (turn < 5):
                    continue
                delta = points[k, term] - total[term]
                if delta <= 0:
                    continue
                rise.clear()
                if term == ACTIVATIONS:
                    known = 0
                    if len(save_start) and save_start[k + 1] > save_start[k]:
                        for j in range(save_start[k], save_start[k + 1]):
                            known += save_data[j]
                    if known and known == delta:  # the tensors the timeline knows this rise as
                        for j in range(save_start[k], save_start[k + 1]):
                            rise.append(save_data[j])
                    elif one_layer == delta:
                        for e in layer:
                            rise.append(e)
                    elif split and first == delta:
                        for j in range(min(split, len(layer))):
                            rise.append(layer[j])
                    elif split and one_layer - first == delta:
                        for j in range(min(split, len(layer)), len(layer)):
                            rise.append(layer[j])
                    else:
                        rise.append(delta)
                elif term == TRANSIENT:
                    if len(piece_start) and piece_start[k + 1] > piece_start[k]:
                        for j in range(piece_start[k], piece_start[k + 1]):
                            rise.append(piece_data[j])
                    else:
                        rise.append(delta)
                else:
                    if total[term] == 0:  # the term starts (again): its tensors in the order they are made
                        queued[term] = taken[term] = 0
                        if term == OPTIMIZER and by_parts:
                            for h in range(tensors):  # every master copy, then each parameter's states
                                if per_tensor[h] and master:
                                    queue[term, queued[term]] = per_tensor[h] * master
                                    queued[term] += 1
                            for h in range(tensors):
                                if per_tensor[h]:
                                    for j in range(1, len(parts)):
                                        queue[term, queued[term]] = per_tensor[h] * parts[j]
                                        queued[term] += 1
                        elif count and states[term] % count == 0:
                            per = states[term] // count
                            for h in range(tensors):
                                e = per_tensor[tensors - 1 - h] if term == GRADIENTS else per_tensor[h]
                                if e:
                                    queue[term, queued[term]] = e * per
                                    queued[term] += 1
                    rest = delta
                    while taken[term] < queued[term] and queue[term, taken[term]] <= rest:
                        rest -= queue[term, taken[term]]
                        rise.append(queue[term, taken[term]])
                        taken[term] += 1
                    if rest > 0:
                        rise.append(rest)
                for size in rise:
                    out.append(size)
                    held_id.append(made)
                    held_size.append(size)
                    held_below.append(top[term])
                    top[term] = len(held_id) - 1
                    made += 1
                total[term] += delta
    array = np.empty(len(out), dtype=np.int64)
    for i in range(len(out)):
        array[i] = out[i]
    return array


_coded: Any = numba.njit(cache=True)(_code)


def replay_jit(codes: list[int], capacity: int | None = None, early: bool = False) -> tuple[Replay, int]:
    """``allocator.plain.replay_plain(codes, capacity, demand)`` compiled, with ``demand`` — a new segment for
    every allocation from each event on (``reserved._refuses``) — when ``early``: the counters and the
    index of the event it stopped before. A stream whose pool keys would not fit 63 bits (segments
    beyond 2⁶² bytes in all, in a replay no step makes) is replayed by ``replay_plain`` itself."""
    array = np.array(codes, dtype=np.int64) if codes else np.zeros(0, dtype=np.int64)
    values = [int(v) for v in cast(Codes, replay_array(array, -1 if capacity is None else capacity, early))]
    if values[9] < 0:
        return replay_plain(codes, capacity, demand(codes) if early else None)
    return replay_stats(values), values[9]


class StreamFields(Protocol):
    """What the compiled coding reads of a stream's inputs (``alloc_stream.StreamInputs``' fields)."""

    @property
    def points(self) -> tuple[tuple[int, ...], ...]: ...
    @property
    def per_tensor(self) -> tuple[int, ...]: ...
    @property
    def states(self) -> tuple[int, int, int]: ...
    @property
    def layer(self) -> tuple[int, ...]: ...
    @property
    def state_parts(self) -> tuple[int, ...]: ...
    @property
    def pieces(self) -> tuple[tuple[int, ...], ...]: ...
    @property
    def split(self) -> int: ...
    @property
    def saves(self) -> tuple[tuple[int, ...], ...]: ...


def _coded_stream(inputs: StreamFields, workspace: int, steps: int) -> Codes:
    """``_code`` of ``inputs``, their fields as int64 arrays (the points' rows and the tensors read by
    ``np.fromiter``: the same arrays as ``np.array`` of the tuples, in half its time)."""
    points, per_tensor = inputs.points, inputs.per_tensor
    flat = itertools.chain.from_iterable(points)
    columns = TRANSIENT + 1  # a point's terms
    rows = np.fromiter(flat, dtype=np.int64, count=columns * len(points)).reshape(len(points), columns)
    tensors = np.fromiter(per_tensor, dtype=np.int64, count=len(per_tensor))
    held = np.array(inputs.states, dtype=np.int64)
    saves = np.array(inputs.layer, dtype=np.int64)
    parts = np.array(inputs.state_parts, dtype=np.int64)
    data, start = _pieces(inputs.pieces)
    rise_data, rise_start = _pieces(inputs.saves)
    return cast(
        Codes,
        _coded(
            rows,
            tensors,
            held,
            saves,
            parts,
            inputs.split,
            data,
            start,
            rise_data,
            rise_start,
            CUBLAS_THREADS,
            workspace,
            steps,
        ),
    )


def _pieces(pieces: tuple[tuple[int, ...], ...]) -> tuple[Codes, Codes]:
    """Each point's tensors (its transient's, or its rise of the activations) laid end to end, and where
    each point's begin (one more: the end); both empty without any."""
    if not pieces:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    start = np.zeros(len(pieces) + 1, dtype=np.int64)
    for k, known in enumerate(pieces):
        start[k + 1] = start[k] + len(known)
    return np.array([b for known in pieces for b in known], dtype=np.int64), start


def codes_jit(inputs: StreamFields, workspace: int, steps: int) -> list[int]:
    """``alloc_stream.codes(inputs, workspace, steps)`` compiled (``_code``)."""
    return [int(c) for c in _coded_stream(inputs, workspace, steps)]


def _code_and_replay(
    inputs: StreamFields, workspace: int, steps: int, capacity: int | None, early: bool
) -> list[int] | None:
    """The stream of ``inputs`` coded and replayed in one compiled call: ``_replay``'s values; None when
    its pool keys would not fit 63 bits (``allocator.jit_replay._replay``: the caller replays it in
    Python)."""
    coded = _coded_stream(inputs, workspace, steps)
    out = cast(Codes, replay_array(coded, -1 if capacity is None else capacity, early))
    return None if out[9] < 0 else [int(v) for v in out]


def replay_inputs_jit(
    inputs: StreamFields, workspace: int, steps: int, capacity: int | None
) -> Replay | None:
    """``replay_plain(alloc_stream.codes(inputs, workspace, steps), capacity)[0]`` compiled: the stream
    coded and replayed whole (None: replay it in Python, ``_code_and_replay``)."""
    values = _code_and_replay(inputs, workspace, steps, capacity, False)
    return None if values is None else replay_stats(values)


def refuses_jit(inputs: StreamFields, workspace: int, steps: int, capacity: int) -> bool | None:
    """``reserved._refuses(alloc_stream.codes(inputs, workspace, steps), capacity)`` compiled: the stream
    coded and replayed with the early stop (None: replay it in Python, ``_code_and_replay``)."""
    values = _code_and_replay(inputs, workspace, steps, capacity, True)
    return None if values is None else bool(values[8])
