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
            sent_out += virtual < last_virtual
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
