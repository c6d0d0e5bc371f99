"""torch's ``ScheduleInterleaved1F1B`` on one pipeline rank (torchtitan's ``pipeline_parallel_schedule =
"Interleaved1F1B"``, ``--impl torchtitan --vpp M``): the order the rank runs its chunks' forwards and
backwards, and what is alive after each of them (``moments``), so that the engine takes the largest.

Order (torch 2.13 ``schedules.py``: ``ScheduleInterleaved1F1B._calculate_single_rank_operations``,
``_get_warmup_ops``, ``_get_1f1b_rank_ops``), rank i of p with m local chunks over n micro-batches:
rounds = max(1, ⌊n/p⌋), r = n / rounds micro-batches per round (torch refuses n not a multiple of rounds);
a warm-up of w = min((m − 1)·r + 2(p − 1 − i), m·n) forwards, then m·n − w steps of one forward and one
backward, then the w remaining backwards. Forward j runs local chunk ⌊j/r⌋ mod m, backward j (counted
from the first) chunk m − 1 − (⌊j/r⌋ mod m); each chunk takes its micro-batches in order. Local chunk k
is virtual stage k·p + i (torchtitan's ``_get_pp_rank_to_stage_indices_mapping``, "loop" style). With
n a multiple of p, r = p: Megatron's warm-up 2(p − i − 1) + (m − 1)·p (``pipeline_parallel``).

What the runtime holds beyond ``fwd_cache`` (``_PipelineScheduleRuntime._step_microbatches``): every send
is a ``Work`` appended to ``send_ops`` and waited only after the rank's last action, and the work keeps
its tensor (gloo's ``SendWork::tensor_``; pytorch/pytorch#194122: outstanding sends hold their memory to
the end-of-step drain). So each output a chunk sends (every virtual stage but the model's last) is alive
from its forward to the step's end (``pp.output``), and each input gradient it sends back (every virtual
stage but the model's first) from its backward on (``pp.grad_send``).

NB: only the moments after a forward and after a backward are candidates: within a forward the saves only
grow, within a backward they only shrink before its gradient is sent.
"""

from __future__ import annotations

import functools

from memplan.analytic.params import ParamCount
from memplan.config import Parallel
from memplan.strategies.pipeline_parallel import Stage


def rounds_of(p: int, n: int) -> tuple[int, int]:
    """(rounds, micro-batches per round) of torch's interleaved schedules: max(1, ⌊n/p⌋) and n / rounds."""
    rounds = max(1, n // p)
    return rounds, n // rounds


def warmup_ops(p: int, m: int, n: int, index: int) -> int:
    """Forwards rank ``index`` runs before its first backward (``_get_warmup_ops``, multiply_factor 2)."""
    _, r = rounds_of(p, n)
    return min((m - 1) * r + 2 * (p - 1 - index), m * n)


def rank_order(p: int, m: int, n: int, index: int) -> list[tuple[bool, int]]:
    """The rank's computations in order: (forward?, local chunk)."""
    _, r = rounds_of(p, n)
    w, total = warmup_ops(p, m, n, index), m * n
    out = [(True, (j // r) % m) for j in range(w)]
    for j in range(total - w):
        out.append((True, ((w + j) // r) % m))
        out.append((False, m - 1 - (j // r) % m))
    out += [(False, m - 1 - (j // r) % m) for j in range(total - w, total)]
    return out


def moments(parallel: Parallel, index: int, chunks_of: tuple[int, ...], n: int) -> list[Stage]:
    """What is alive on rank ``index`` after each forward and each backward of its step (module docstring):
    the chunk-forwards in flight (oldest first), the sent outputs and gradients held, as ``Stage``s."""
    p, m = parallel.pp, len(chunks_of)
    last_virtual = p * m - 1
    in_flight: list[int] = []  # local chunk of each forward whose backward has not run
    sent_out = sent_grad = 0
    out: list[Stage] = []
    for forward, k in rank_order(p, m, n, index):
        virtual = k * p + index
        if forward:
            in_flight.append(k)
            # a chunk of no layers between the embedding's and the head's returns the tensor it received:
            # the output it sends is the receive buffer (``pp.recv``), no new storage
            sent_out += virtual < last_virtual and (chunks_of[k] > 0 or virtual == 0)
        else:
            in_flight.remove(k)  # each chunk's backwards run in its forwards' order
            sent_grad += virtual > 0
        ids = tuple(in_flight)
        out.append(
            Stage(
                index=index,
                first=index == 0,
                last=index == p - 1,
                layers=sum(chunks_of),
                chunk_layers=max(chunks_of),
                chunks=len(ids),
                embed_micro_batches=ids.count(0) if index == 0 else 0,
                in_flight=tuple(chunks_of[c] for c in ids),
                chunks_of=chunks_of,
                sends=sum(1 for c in ids if c * p + index < last_virtual),
                micro_batches=n,
                chunk_ids=ids,
                sent_outputs=sent_out,
                sent_grads=sent_grad,
                head_forwards=sum(1 for c in ids if c * p + index == last_virtual),
            )
        )
    return out


MAX_ACTIVE_STAGES = 3
"""Local chunks torch's runtime schedules keep unsharded at once under FSDP (torch 2.13 schedules.py
``_add_unshard_reshard(compute_actions, max_active_stages=3)``, applied by
``_PipelineScheduleRuntime._prepare_schedule_with_comms``, which ``ScheduleInterleaved1F1B`` runs)."""


@functools.cache
def fsdp_unshards(p: int, m: int, n: int, index: int) -> tuple[tuple[int, ...], tuple[frozenset[int], ...]]:
    """torch's FSDP lowering of rank ``index``'s interleaved order (``_add_unshard_reshard``): before each
    computation the next ``MAX_ACTIVE_STAGES`` distinct chunks of the rest of the order are to be
    unsharded; an unsharded chunk not among them is resharded (``RESHARD``: ``FSDPModule.reshard()``), a
    missing one unsharded (``UNSHARD``: an all-gather of its units). Returns how many times each local
    chunk is all-gathered in the step, and the chunks unsharded during each computation. With m ≤ 3 every
    chunk is gathered once and stays so to its last backward; ``Schedule1F1B`` (m = 1) has no lowering,
    its one chunk is gathered once at its first forward (no unit resharded after forward under pp)."""
    order = [k for _, k in rank_order(p, m, n, index)]
    gathers = [0] * m
    active: list[int] = []
    during: list[frozenset[int]] = []
    for i in range(len(order)):
        upcoming: list[int] = []
        for k in order[i:]:
            if k not in upcoming:
                upcoming.append(k)
                if len(upcoming) == MAX_ACTIVE_STAGES:
                    break
        active = [k for k in active if k in upcoming]
        for k in upcoming:
            if k not in active:
                active.append(k)
                gathers[k] += 1
        during.append(frozenset(active))
    return tuple(gathers), tuple(during)


def most_unsharded(p: int, m: int, n: int, index: int, chunk_sizes: tuple[int, ...]) -> int:
    """The most of ``chunk_sizes`` (one per local chunk) unsharded at once on rank ``index`` during its
    step under torch's FSDP lowering (``fsdp_unshards``): all of them with m ≤ 3."""
    if m == 1:
        return chunk_sizes[0]
    _, during = fsdp_unshards(p, m, n, index)
    return max(sum(chunk_sizes[k] for k in ks) for ks in during)


def chunk_params(stage_params: ParamCount, st: Stage) -> tuple[int, ...]:
    """Parameters of each of the rank's local chunks (``st.chunks_of`` layers each), from the stage's
    (``pipeline_parallel.stage_params``): the embedding with the model's first virtual stage (chunk 0 of
    the first rank), the final norm and lm head with its last (the last chunk of the last rank)."""
    m = len(st.chunks_of) or 1
    layer = stage_params.layer.total
    out = [n * layer for n in (st.chunks_of or (st.layers,))]
    out[0] += stage_params.embedding + stage_params.positions
    out[m - 1] += stage_params.final_norm + stage_params.lm_head
    return tuple(out)
