"""The step's allocation stream: what ``reserved`` replays through torch's caching allocator
(``analytic.allocator``), built from a result and coded as integers.

The allocation stream of the most loaded device is built from ``timeline.timeline`` at every layer (the
forward's layer boundaries, then the backward's and the optimizer step's modelled moments), term by term
(``analytic.peak.TERMS``): at each point the terms that shrink are freed first, newest first (the
backward frees the last layer's saves first), then the terms that grow are allocated:

- a layer's activations as that layer's saved tensors, one allocation each, in inventory order (one
  block of the difference when the layer's saves do not add up to it: fine-tuning's unequal layers,
  checkpointed segments, the embedding's and the head's saves); where the timeline has a point at each
  layer's forward peak (``timeline.layer_peak``), the saves made before it there and the rest at the
  layer's boundary (``StreamInputs.split``);
- weights, optimizer states and gradients as one allocation per parameter tensor of the rank
  (``analytic.optimizer_step.step_tensors``: whole tensors or ZeRO's dim-0 shards) when the term's full
  size is a whole number of bytes per element over them (else as one block per rise: pipeline stages,
  LoRA's trainable subset, offloaded parts): weights and states in parameter order, gradients in reverse
  (the backward makes the last layer's first), as many whole tensors as a rise holds, the rest one block;
  under FSDP2's modelled reduce-scatter the sharded gradients are that stream's pool, not this stream's
  (``analytic.fsdp.buffers``) — but on a torchtitan pipeline stage the moments' gradients are the
  unsharded ones FSDP2 accumulates on this stream until the stage's last backward
  (``analytic.fsdp.moments.accumulates_unsharded``), and stay;
- a moment's transient as one block, freed at the next point — or as the tensors it is, where the timeline
  knows them (``timeline.Point.pieces``: torchtitan's eager standard loss, its forward's logits, their fp32
  copy and the log-probs, and the loss backward's two fp32 gradients; ``blocks.head.forward_loss_blocks``;
  a fully checkpointed layer's backward, the tensors its re-run forward makes again, then the rest one
  block: ``timeline.rerun_tensors``; the reference's eager layer at its forward peak, the core's copies,
  scores, masked scores and probabilities: ``blocks.forward_locals``, freed at the layer's boundary, so
  that the next layer's saves are carved out of their blocks as the real allocator does);
- cuBLAS's workspaces (with a GPU), never freed: torch keeps one per cuBLAS handle and stream
  (aten/src/ATen/cuda/CublasHandlePool.cpp: ``cublas_handle_stream_to_workspace`` keyed by (handle,
  stream), ``getNewWorkspace`` takes it from the caching allocator) and one handle per thread (its
  ``thread_local`` ``PoolWindow``). A training step runs GEMMs on two threads: the forward's (Python's)
  and the autograd engine's device thread, which runs the backward (``CUBLAS_THREADS``). Measured on an
  H200 (docs/gpu-profile.md): two 32 MiB blocks in the allocator's snapshot, from ``THPVariable_linear``
  and ``MmBackward0``; the measured allocated peaks exceed the saves-and-states peak by exactly 64 MiB.
  Both are made before the first layer, each in a segment of its own (a request over 10 MiB).
  NB: the backward thread's is made at the first backward GEMM, where the allocator gives it a cached
  free block if one fits; the replay does not place it there, since its moments' transients are blocks
  that such a split would fragment where the real tensors would not (T4's layer backward, one 24 GiB
  block: a 32 MiB split of its cached block cost a second 23 GiB segment).

The stream holds ``STEPS`` steps: the second finds the first one's cached segments, as every step after
the first does (its gradients freed by ``zero_grad(set_to_none=True)`` and its transients reused). The
requests at its peak are the estimate's peak (plus the workspace) by construction (``reserved``'s
docstring says what the replay adds).

The stream is read from a few inputs of the result (``StreamInputs``): equal inputs give equal streams,
so ``reserved`` memoises its replays on them; ``codes`` codes the stream as integers (what the replays
read, in Python or compiled: ``analytic.allocator.jit.codes_jit`` codes it line by line the same way).

Known limitations:
- NB: a moment's transient is one block where its tensors are not known (the optimizer step's
  per-parameter temporaries, a layer backward's own buffers beyond the re-run's tensors, the loss
  backward of the losses other than the standard one of the reference and torchtitan): one large block
  cannot reuse the smaller blocks the freed activations left, so the unlimited replay can overstate the
  segments (before the loss's and the re-run's tensors were known: QLoRA on Llama-3-8B reserved 27.8 GiB
  for 20.0 GiB allocated, now 20.4; torchtitan's Llama 3.1 70B at TP 8 + SP, full AC, 24.8 GiB above its
  allocated peak, now 0.5). The
  verdict's replay at the device's capacity releases the free cached segments first, as the allocator
  does, but only where the unlimited replay passes that capacity: below it the two are the same replay.
- NB: the forward's own temporaries are allocations of the stream only at the modelled moments (the
  loss's, where known; the reference's eager layers' at their forward peaks, ``blocks.forward_locals``):
  those freed before a layer's peak (RoPE's products, the norm's fp32 square, q·kᵀ before its scaling),
  the flash layers' and the other implementations' are not (``timeline``'s NB), nor are the backward's
  between its modelled moments. Measured on an H200 (docs/gpu-profile.md): Llama-2-7B, s 2048,
  selective checkpointing with eager attention reserved 104.97 GiB; the replay 109.60 GiB without the
  layers' forward temporaries (each save its own segment, which the backward's gradients could not
  reuse), 102.98 GiB with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import itemgetter

from memplan.analytic.allocator import CUBLAS_THREADS, Alloc, Event, Free
from memplan.analytic.fsdp.moments import accumulates_unsharded
from memplan.analytic.fsdp.reduce import reduce_scatter_modelled
from memplan.analytic.optimizer_step import step_tensors
from memplan.analytic.peak import TERMS
from memplan.blocks.inventory import Dims, Scope
from memplan.config import Optimizer, Setup, StrategyConfig
from memplan.engine import Result
from memplan.strategies.pipeline_parallel import Group
from memplan.timeline import layer_peak, timeline

STEPS = 2
"""Steps in the stream: the first fills the cache, the second reuses it (module docstring)."""

MEMO_MAX = 2048
"""The most results (and rank tensor lists) memoised before the memos are cleared (``reserved``'s
replays are bounded the same)."""


def tensor_bytes(total: int, elements: list[int]) -> list[int]:
    """``total`` bytes laid over tensors of ``elements``, one allocation each, when ``total`` is a whole
    number of bytes per element over them; else none (the term is then allocated as blocks)."""
    count = sum(elements)
    if count and total % count == 0:
        return [e * (total // count) for e in elements if e]
    return []


def take(queue: list[int], delta: int) -> list[int]:
    """Allocations for ``delta`` more bytes of a term: its next whole tensors from ``queue`` (consumed)
    while they fit, the rest as one block."""
    out: list[int] = []
    rest, n = delta, 0
    while n < len(queue) and queue[n] <= rest:
        rest -= queue[n]
        n += 1
    out, queue[:] = queue[:n], queue[n:]
    return out + ([rest] if rest > 0 else [])


def optimizer_parts(setup: Setup) -> tuple[int, ...]:
    """Bytes per element of the optimizer's tensors of one parameter, as its code makes them: the fp32
    master copy (0 without one), then each state (AdamW's m and v; one momentum for SGD with momentum
    and Lion). The reference optimizer (``measure/reference/optim.py``) makes every master first, then
    each parameter's states; torch's AdamW makes each parameter's ``exp_avg`` and ``exp_avg_sq`` in turn
    (``_init_group``). Empty where the states are not whole tensors of one element size each (8-bit
    AdamW's codes and scales): then one allocation per parameter holds them all."""
    t = setup.training
    p, opt = t.precision, t.optimizer
    if opt is Optimizer.ADAMW_8BIT:
        return ()
    n = opt.state_bytes(p) // p.state_bytes
    return (p.master_bytes, *([p.state_bytes] * n))


def optimizer_tensors(total: int, elements: list[int], parts: tuple[int, ...]) -> list[int]:
    """The optimizer term's allocations (``tensor_bytes`` when ``parts`` do not lay it whole): every
    parameter's master copy in order, then each parameter's states."""
    count = sum(elements)
    if parts and count and count * sum(parts[1:]) == total:  # no master copy on this rank (FSDP2's fp32
        parts = (0, *parts[1:])  # shards are the weights the optimizer steps: ``--impl torchtitan``)
    if not parts or not count or count * sum(parts) != total:
        return tensor_bytes(total, elements)
    master, states = parts[0], parts[1:]
    out = [e * master for e in elements if e and master]
    return out + [e * b for e in elements if e for b in states]


def layer_saves(r: Result) -> list[int]:
    """Bytes of each tensor one layer saves, in inventory order (one instance each)."""
    return [k.bytes for k in r.pieces.kept if k.scope is Scope.LAYER and k.count]


@dataclass(frozen=True)
class StreamInputs:
    """All ``stream`` reads of a result: equal inputs give equal streams, so a replay is memoised on them
    (configurations of a search that differ only where the device's memory does not: the micro-batch
    count of an unpipelined layout, dp under ZeRO 0, … share one replay)."""

    points: tuple[tuple[int, ...], ...]
    """Each timeline point's bytes of ``analytic.peak.TERMS``, in order."""
    per_tensor: tuple[int, ...]
    """Elements of each tensor the rank steps (``step_tensors``), in parameter order."""
    states: tuple[int, int, int]
    """The device's weights, optimizer states and gradients (bytes)."""
    layer: tuple[int, ...]
    """One layer's saves (``layer_saves``)."""
    pieces: tuple[tuple[int, ...], ...] = ()
    """Each point's transient as its tensors (``timeline.Point.pieces``; empty: one block)."""
    state_parts: tuple[int, ...] = ()
    """The optimizer's tensors per parameter, bytes per element: the master copy first (0: none), then
    each state (``optimizer_parts``); empty: one allocation per parameter of all its states."""
    saves: tuple[tuple[int, ...], ...] = ()
    """Each point's rise of the activations as its tensors (``timeline.Point.saves``; empty: as ``codes``
    makes a rise)."""
    split: int = 0
    """How many of one layer's saves its forward makes before its peak (``timeline.layer_peak``; 0: no
    such point): a rise of the first ``split`` of ``layer``, or of the rest, is those tensors."""


_INPUTS: dict[int, tuple[Result, StreamInputs]] = {}
"""``stream_inputs`` of the last results asked (by identity; the result is kept so its id stays its)."""


def stream_inputs(r: Result) -> StreamInputs:
    """What ``stream`` reads of ``r`` (memoised for the last results asked)."""
    found = _INPUTS.get(id(r))
    if found is not None and found[0] is r:
        return found[1]
    if len(_INPUTS) >= MEMO_MAX:
        _INPUTS.clear()
    _INPUTS[id(r)] = (r, inputs := _stream_inputs(r))
    return inputs


_TERMS_OF = itemgetter(*TERMS)
"""A point's bytes of each of ``TERMS``, in order (one tuple)."""
_GRADIENTS = TERMS.index("gradients")


def _point_terms(terms: dict[str, int], off: dict[str, int] | None) -> tuple[int, ...]:
    """A point's bytes of each of ``TERMS``, less ``off`` (the all-gather stream's share at it)."""
    row: tuple[int, ...] = _TERMS_OF(terms)
    return tuple(v - off.get(k, 0) for k, v in zip(TERMS, row, strict=True)) if off else row


def _point_pieces(pieces: tuple[int, ...], off: dict[str, int] | None) -> tuple[int, ...]:
    """A point's transient as its tensors (``timeline.Point.pieces``), less the all-gather stream's share
    of it (``off``, as ``_point_terms`` takes it from the term): that share — FSDP2's prefetched flat
    all-gather output — is in the last piece, the part of the transient not known as tensors
    (``timeline._moment``: a checkpointed layer's backward beside its re-run's tensors); one block
    (empty) where that piece is smaller. Else the pieces would outgrow the term by that share and the
    stream keep the difference alive past the point (at Llama 3.1 70B's widths on tp 8 + SP under the
    2024 wrapping, 204 MiB more in the second step)."""
    cut = off.get("transient", 0) if off else 0
    if not cut or not pieces:
        return pieces
    *known, rest = pieces
    if rest < cut:
        return ()
    return (*known, rest - cut) if rest > cut else tuple(known)


def _stream_inputs(r: Result) -> StreamInputs:
    dev = r.device
    group = Group.CHECKPOINT if r.setup.strategy.segment else Group.LAYER
    points = timeline(r, forward_points=max(1, dev.counts[group]))
    per_tensor = rank_tensors(r.pieces.setup, dev.setup.strategy)
    st = dev.states
    # FSDP2's flat all-gather outputs in the moments: the all-gather stream's pool, replayed apart
    off = dev.peak.all_gather_stream
    rows = [_point_terms(p.terms, off.get(p.label)) for p in points]
    any_pieces = any(p.pieces for p in points)
    if reduce_scatter_modelled(r.setup) and not accumulates_unsharded(r.setup):
        # the sharded gradients: the reduce-scatter stream's blocks. Not on a torchtitan pipeline stage,
        # whose moments' gradients are the unsharded ones it accumulates in the reduce dtype on the
        # default stream until its last backward (``analytic.fsdp.moments.pipeline_unsharded_gradients``)
        rows = [(*t[:_GRADIENTS], 0, *t[_GRADIENTS + 1 :]) for t in rows]
    return StreamInputs(
        points=tuple(rows),
        per_tensor=per_tensor,
        states=(st.weights, st.optimizer, st.gradients),
        layer=tuple(layer_saves(r)),
        pieces=tuple(_point_pieces(p.pieces, off.get(p.label)) for p in points) if any_pieces else (),
        state_parts=optimizer_parts(r.setup),
        saves=tuple(p.saves for p in points) if any(p.saves for p in points) else (),
        split=core[0] if (core := layer_peak(r, Dims.of(r.rank_setup))) else 0,
    )


_TENSORS: dict[tuple[object, ...], tuple[int, ...]] = {}
"""``rank_tensors`` by what ``step_tensors`` reads; bounded as ``_INPUTS``."""


def rank_tensors(setup: Setup, strategy: StrategyConfig) -> tuple[int, ...]:
    """``step_tensors`` of ``setup`` under ``strategy``, memoised on what it reads: the model, the
    fine-tuning method, the implementation (the parameters' order) and the sharding (the ZeRO stage and
    its group) — not the micro-batch or the layout, which a search varies (tests/test_allocator_plain.py
    checks it against ``step_tensors``)."""
    key = (setup.model, setup.finetune, setup.impl, strategy.zero, strategy.shard_group, setup.parallel.cp)
    found = _TENSORS.get(key)
    if found is None:
        if len(_TENSORS) >= MEMO_MAX:
            _TENSORS.clear()
        found = _TENSORS[key] = tuple(step_tensors(setup.model_copy(update={"strategy": strategy})))
    return found


def stream(r: Result, workspace: int = 0, steps: int = STEPS) -> list[Event]:
    """The most loaded device's allocations and frees over ``steps`` steps (module docstring)."""
    return events(stream_inputs(r), workspace, steps)


def events(inputs: StreamInputs, workspace: int = 0, steps: int = STEPS) -> list[Event]:
    """``stream`` from its inputs."""
    out: list[Event] = []
    made = 0
    for c in codes(inputs, workspace, steps):
        if c >= 0:
            out.append(Alloc(made, c))
            made += 1
        else:
            out.append(Free(-c - 1))
    return out


def codes(inputs: StreamInputs, workspace: int = 0, steps: int = STEPS) -> list[int]:
    """``events`` as integers (``Allocator.replay_codes``: n ≥ 0 allocates n bytes, the allocations
    numbered in order; −k − 1 frees allocation k): what the replays read, with no event objects.

    A term that shrinks by less than its newest allocation frees that allocation whole and makes the
    rest again (its tensors are not known apart): the rest is allocated before any other term grows, so
    that it takes back the block it was freed from (best fit: no other free block smaller than that one
    fits it, or it takes that smaller one), as the tensors that stay alive keep their blocks. Allocated
    after another term's rise (the order of ``TERMS``), the rest found its block split by that rise and
    opened a segment of its own: at torchtitan's loss backward under context parallelism (the head's
    saves, 16.9 GiB, shrinking by 256 KiB while FSDP2's [norm, output] unit is gathered, 0.98 GiB) a
    second 16.9 GiB segment, 15.9 GiB of it free, that no run holds (docs/published-memory.md)."""
    per_tensor = list(inputs.per_tensor)
    full = dict(zip(("weights", "optimizer", "gradients"), inputs.states, strict=True))
    layer = list(inputs.layer)
    one_layer = sum(layer)
    first, rest = layer[: inputs.split], layer[inputs.split :]
    held: list[list[tuple[int, int]]] = [[] for _ in TERMS]
    total = [0] * len(TERMS)
    queues: dict[int, list[int]] = {}
    out: list[int] = []
    made = 0
    activations, transient = TERMS.index("activations"), TERMS.index("transient")
    names = list(TERMS)

    def pieces(term: int, delta: int, k: int) -> list[int]:
        if term == activations:  # the tensors the timeline knows this rise as; one layer's saves, the
            known = inputs.saves[k] if inputs.saves else ()  # first of them or the rest; else one block
            if known and sum(known) == delta:
                return list(known)
            if one_layer == delta:
                return layer
            if inputs.split and sum(first) == delta:
                return first
            return rest if inputs.split and sum(rest) == delta else [delta]
        if term == transient:  # one block, or the tensors the timeline knows it as
            return list(inputs.pieces[k]) if inputs.pieces and inputs.pieces[k] else [delta]
        if total[term] == 0:  # the term starts (again): its tensors in the order they are made
            name = names[term]
            order = per_tensor[::-1] if name == "gradients" else per_tensor
            queues[term] = (
                optimizer_tensors(full[name], order, inputs.state_parts)
                if name == "optimizer"
                else tensor_bytes(full[name], order)
            )
        return take(queues[term], delta)

    for step in range(steps):
        for k, point in enumerate(inputs.points):
            cut = [False] * len(TERMS)
            for term, target in enumerate(point):  # frees first: what shrinks, newest first; transients
                stack, now = held[term], total[term]
                if term == transient:
                    target = 0
                was = now
                while stack and now > target:
                    i, size = stack.pop()
                    out.append(-i - 1)
                    now -= size
                cut[term] = now < target < was  # freed past its target: the rest is made again, first
                total[term] = now
            if step == 0 and k == 0 and workspace:  # one per thread: ``CUBLAS_THREADS``
                out.extend([workspace] * CUBLAS_THREADS)
                made += CUBLAS_THREADS
            # a term freed past its target grows back before the others (``codes``' docstring)
            for term in sorted(range(len(TERMS)), key=lambda t: not cut[t]):
                target = point[term]
                delta = target - total[term]
                if delta <= 0:
                    continue
                stack = held[term]
                for size in pieces(term, delta, k):
                    out.append(size)
                    stack.append((made, size))
                    made += 1
                total[term] += delta
    return out


def clear_inputs() -> None:
    """Forget the memoised stream inputs and rank tensors (``reserved.clear_replays``)."""
    _INPUTS.clear()
    _TENSORS.clear()
