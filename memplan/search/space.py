"""The space ``fit`` searches: its settings (``Space``), the layouts of N devices and the global batch.

A layout is a (tp, sp, cp, pp, vpp, ep) split with dp = N / (tp·cp·pp) and an HSDP shard group (``layouts``):
ep from dp, and under Megatron with tp > 1 (a mixture of routed experts alone, sp, no cp:
``tensor_parallel.foldable``) also parallel folding, ep from tp × dp with whole experts (``etp`` 1); pp any
degree up to the layers that divides the devices, its stages uneven as ``estimate`` places them
(``stage_layers``: ⌈L/p⌉ each, the first and last one fewer in turn); with the interleaved schedule (vpp m >
1) the p·m virtual stages placed the same way (Llama 3 405B's 0, 1 × 126, 0), a layout only when every rank
gets a layer and no chunk but the first and last is empty; HSDP with one node's data-parallel ranks as the
shard group when dp leaves the node (dense layers only: ep 1). The global batch B sequences must split into
whole micro-batches of a searched size b on each of the dp ranks, b · dp | B (``searchable``; ``why_nothing``
says what to change when no layout allows it); the interleaved schedule also needs the micro-batches per step
to be a multiple of pp.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from memplan.config import Attention, Checkpointing, CpRotate, Impl, Parallel, Setup, ZeroStage
from memplan.config.impl_rules import titan_stage_layers
from memplan.config.strategy import MAX_DP
from memplan.strategies.pipeline_parallel import stage_layers
from memplan.strategies.tensor_parallel import divisors, foldable, tp_widths

TOKENS_PER_STEP = 1 << 22
"""Default global batch: about 4M tokens per step (Llama 2 and 3 pre-training), in whole sequences."""


@dataclass(frozen=True)
class Space:
    """What ``fit`` searches."""

    checkpointing: tuple[Checkpointing, ...] = (
        Checkpointing.NONE,
        Checkpointing.SELECTIVE,
        Checkpointing.FULL,
    )
    attention: tuple[Attention, ...] = (Attention.EAGER, Attention.FLASH)
    zero: tuple[ZeroStage, ...] = tuple(ZeroStage)
    micro_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    tp_max: int = 8
    """Tensor parallelism stays inside one 8-GPU NVLink domain by default."""
    cp_max: int = 16
    """Context parallelism: powers of two up to this, flash attention only, searched with every layout."""
    cp_rotate: tuple[CpRotate, ...] = (CpRotate.ALLGATHER,)
    """The kinds of context parallelism searched for every cp > 1 (``--cp-rotate``)."""
    vpp: tuple[int, ...] = (1, 2, 4, 8)
    """Virtual stages per pipeline rank (the interleaved schedule) searched with pp > 1."""
    hsdp: bool = True
    """Whether HSDP (the shard group one node's data-parallel ranks) is searched beside full sharding."""
    keep: int = 10
    """The fastest configurations the search must find exactly; one whose step-time bound is slower
    than the ``keep``-th fastest so far is pruned (``search.bound``); 0: evaluate every one."""


@dataclass(frozen=True)
class Layout:
    parallel: Parallel
    dp: int
    hsdp: int = 0
    """HSDP's shard group (0: shard over all of dp)."""

    def label(self) -> str:
        hsdp = f"(hsdp{self.hsdp})" if self.hsdp else ""
        return f"{self.parallel.label()}·dp{self.dp}{hsdp}"


def virtual_layers(layers: int, pp: int, vpp: int) -> tuple[int, ...] | None:
    """The p·m virtual stages' layers, placed as ``stage_layers`` places stages (⌈L/(p·m)⌉ each, the first
    and last one fewer in turn: a 0 is the embedding or the head alone); None when a rank would get no
    layer or a middle chunk none."""
    virtual = stage_layers(layers, Parallel(pp=pp * vpp))
    if min(virtual) < 0 or min(virtual[1:-1]) < 1:  # only the embedding's or the head's chunk may be empty
        return None
    if min(sum(virtual[k * pp + i] for k in range(vpp)) for i in range(pp)) < 1:
        return None
    return virtual


def pipelines(layers: int, room: int, space: Space) -> list[tuple[int, int, tuple[int, ...] | None]]:
    """(pp, vpp, virtual stages) searched over ``room`` = devices / (tp·cp): every pp ≤ the layers dividing
    it, each with the vpp of ``space`` (m > 1 only with pp > 1 and a placement, ``virtual_layers``)."""
    out: list[tuple[int, int, tuple[int, ...] | None]] = []
    for pp in divisors(room, layers):
        for vpp in space.vpp:
            if vpp == 1:
                out.append((pp, 1, None))
            elif pp > 1 and (virtual := virtual_layers(layers, pp, vpp)) is not None:
                out.append((pp, vpp, virtual))
    return out


def shard_groups(dp: int, stride: int, gpus_per_node: int, space: Space) -> list[int]:
    """HSDP shard groups searched: full sharding (0), and one node's data-parallel ranks (the node's GPUs
    over tp·cp·pp) when dp leaves the node."""
    node = gpus_per_node // stride
    if not space.hsdp or node < 2 or node >= dp or dp % node:
        return [0]
    return [0, node]


def layouts(setup: Setup, gpus: int, space: Space, cp: int = 1, gpus_per_node: int = 8) -> list[Layout]:
    """Every valid (tp, sp, pp, vpp, ep, dp, hsdp) split of ``gpus`` devices with ``cp`` context-parallel
    ranks (module docstring)."""
    m, seq = setup.model, setup.training.seq_len
    moe = m.moe
    widths = math.gcd(*tp_widths(m, moe.widths(m) if moe else ()).values())
    out = []
    for tp in divisors(widths, space.tp_max):
        inside = setup.impl.tp_comm_overlap or setup.impl.async_tp
        if gpus % (tp * cp) or (inside and tp > gpus_per_node):
            continue  # TE's userbuffers, torch's symmetric memory inside a node (``tp_overlap.check_node``)
        for pp, vpp, virtual in pipelines(m.num_layers, gpus // (tp * cp), space):
            if pp > 1 and setup.impl.impl is Impl.TORCHTITAN:
                # what the Setup validator fills in: torchtitan's placement over its pp·vpp stages
                virtual = titan_stage_layers(m.num_layers, pp * vpp)
                if min(virtual) < 0 or min(sum(virtual[i::pp]) for i in range(pp)) < 1:
                    continue
            dp = gpus // (tp * cp * pp)
            if dp > MAX_DP:  # what `estimate` refuses (StrategyConfig.dp)
                continue
            sp = tp > 1 and (seq // cp) % tp == 0
            # (ep, etp): ep from dp; with tp > 1 under Megatron also parallel folding, ep from tp × dp
            experts: list[tuple[int, int | None]] = (
                [(e, None) for e in divisors(moe.experts) if dp % e == 0] if moe else [(1, None)]
            )
            if moe and tp > 1 and foldable(setup, sp, cp):
                experts += [(e, 1) for e in divisors(moe.experts) if (tp * dp) % e == 0]
            rotates = space.cp_rotate if cp > 1 else (CpRotate.ALLGATHER,)
            for (ep, etp), rotate in itertools.product(experts, rotates):
                par = Parallel(
                    tp=tp, sp=sp, pp=pp, vpp=vpp, pp_layers=virtual, ep=ep, etp=etp, cp=cp, cp_rotate=rotate
                )
                dense = ep == 1 and etp is None
                groups = shard_groups(dp, tp * cp * pp, gpus_per_node, space) if dense else [0]
                for hsdp in groups:
                    out.append(Layout(par, dp, hsdp))
    return out


def default_global_batch(seq: int, gpus: int) -> int:
    """≈ 4M tokens of whole sequences, a power of two, at least one sequence per device."""
    return max(gpus, 1 << max(0, round(math.log2(max(1, TOKENS_PER_STEP // seq)))))


def context_degrees(base: Setup, gpus: int, space: Space) -> list[int]:
    """The context-parallel degrees searched: powers of two 2…``cp_max`` dividing the devices whose 2·cp
    chunks split the sequence (``strategies.context_parallel.check_context``)."""
    seq, out, cp = base.training.seq_len, [], 2
    while cp <= min(space.cp_max, gpus):
        if gpus % cp == 0 and seq % (2 * cp) == 0:
            out.append(cp)
        cp *= 2
    return out


def every_layout(base: Setup, gpus: int, space: Space, gpus_per_node: int = 8) -> list[Layout]:
    """``layouts`` without and (when the space searches flash attention) with each searched context-parallel
    degree, in that order (``gpus_per_node`` places HSDP's shard groups: the same layouts with hsdp 0 at
    any value)."""
    flash = Attention.FLASH in space.attention
    degrees = [1, *(context_degrees(base, gpus, space) if flash else [])]
    return [x for cp in degrees for x in layouts(base, gpus, space, cp, gpus_per_node)]


def searchable(base: Setup, gpus: int, batch: int, space: Space, every: list[Layout] | None = None) -> bool:
    """Whether some layout of ``gpus`` devices and micro-batch size splits ``batch`` sequences evenly
    (``every``: ``every_layout(base, gpus, space)`` when the caller has it)."""
    found = every_layout(base, gpus, space) if every is None else every
    return any(batch % (b * x.dp) == 0 for x in found for b in space.micro_batches)


def unsplit_degrees(every: list[Layout], batch: int, space: Space) -> tuple[int, ...]:
    """The data-parallel degrees of ``every`` over which no searched micro-batch size splits ``batch``
    sequences (b · dp ∤ B for every b): their layouts hold no configuration, so the search leaves them out
    (``families.micro_batches``) — said in ``fit``'s summary, not silently. Ascending."""
    dps = {x.dp for x in every}
    return tuple(sorted(dp for dp in dps if all(batch % (b * dp) for b in space.micro_batches)))


SPLIT_NEAR = 0.25
"""How far from the global batch (a fraction of it) ``splitting_batch`` looks: a batch much further off
changes the run more than it lets the search see."""


def splitting_batch(every: list[Layout], batch: int, space: Space) -> int | None:
    """The global batch nearest ``batch`` (the larger on a tie) that the smallest searched micro-batch
    splits over every data-parallel degree of ``every`` (a multiple of lcm(b_min · dp)), within
    ``SPLIT_NEAR`` of it; None where none is that near."""
    step = math.lcm(*{min(space.micro_batches) * x.dp for x in every})
    below, above = batch // step * step, -(-batch // step) * step
    best = min((c for c in (above, below) if c >= 1), key=lambda c: abs(c - batch))
    return best if abs(best - batch) <= SPLIT_NEAR * batch else None


NEAR = 64
"""How far from --gpus ``why_nothing`` looks for a device count that would split the batch."""


def too_many(base: Setup, gpus: int, space: Space, every: list[Layout] | None = None) -> str | None:
    """One line when every layout of ``gpus`` devices, with or without context parallelism, needs
    dp > ``MAX_DP`` (what `estimate` refuses), else None. The most devices a layout takes is
    tp · pp · cp · ``MAX_DP`` with the widest tp, the deepest pp (one layer a stage) and the largest cp that
    ``layouts`` and ``context_degrees`` search (cp under flash attention only, as ``fit`` searches it).
    ``every``: ``every_layout(base, gpus, space)`` when the caller has it."""
    flash = Attention.FLASH in space.attention
    if every_layout(base, gpus, space) if every is None else every:
        return None
    m, seq = base.model, base.training.seq_len
    widths = math.gcd(*tp_widths(m, m.moe.widths(m) if m.moe else ()).values())
    cps = [
        c
        for c in (2**i for i in range(space.cp_max.bit_length()))
        if c <= space.cp_max and seq % (2 * c) == 0
    ]
    cp = max(cps) if flash and cps else 1
    most = max(divisors(widths, space.tp_max)) * m.num_layers * cp * MAX_DP
    return (
        f"gpus: {gpus:,} devices need a data-parallel degree above {MAX_DP:,} in every layout fit searches "
        f"(tp ≤ {space.tp_max}, pp up to the {m.num_layers} layers, cp ≤ {cp}); use at most --gpus {most:,}"
    )


def why_nothing(base: Setup, gpus: int, batch: int, given: bool, space: Space) -> str:
    """One line: why no configuration of the space could be searched, and what to change.

    A layout always exists (tp = pp = 1), so the constraint that fails is the global batch: B sequences must
    split into whole micro-batches of a searched size b on each of the dp ranks, b · dp | B.
    """
    m = base.model
    dps = sorted({x.dp for x in every_layout(base, gpus, space)})
    sizes = ", ".join(map(str, space.micro_batches))
    step = min((b * dp for b in space.micro_batches for dp in dps), key=lambda k: (-(-batch // k) * k, k))
    better = -(-batch // step) * step
    # The nearest device count that would do, looked for in a window around --gpus (lazily: each look is a
    # layout enumeration, and --gpus may be large).
    window = sorted(range(max(1, gpus - NEAR), gpus + NEAR + 1), key=lambda g: (abs(g - gpus), g))
    fits = (
        g
        for g in window
        if g != gpus
        and searchable(base, g, batch if given else default_global_batch(base.training.seq_len, g), space)
    )
    near = [g for g in [next(fits, None)] if g is not None]
    gpus_fix = f" or --gpus {near[0]}" if near else ""
    origin = "" if given else " (the default, ≈ 4M tokens)"
    return (
        f"global-batch: {batch} sequences{origin} do not split into micro-batches of {sizes} on dp "
        f"{', '.join(map(str, dps))} ranks, the data-parallel degrees {gpus} GPUs allow (tp ≤ {space.tp_max} "
        f"dividing the heads and widths, pp up to the {m.num_layers} layers); nothing to search: use "
        f"--global-batch {better} (a multiple of {step}){gpus_fix}"
    )
