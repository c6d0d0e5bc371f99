"""The space ``fit`` searches: its settings (``Space``), the layouts of N devices and the global batch.

A layout is a (tp, sp, pp, ep, cp) split with dp = N / (tp·cp·pp) (``layouts``); the global batch B
sequences must split into whole micro-batches of a searched size b on each of the dp ranks, b · dp | B
(``searchable``; ``why_nothing`` says what to change when no layout allows it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from memplan.config import Attention, Checkpointing, Parallel, Setup, ZeroStage
from memplan.config.strategy import MAX_DP
from memplan.strategies.tensor_parallel import divisors, tp_widths

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
    """Context parallelism (powers of two up to this, flash attention only) is searched when the sequence
    needs it: only if no layout without it fits."""


@dataclass(frozen=True)
class Layout:
    parallel: Parallel
    dp: int

    def label(self) -> str:
        return f"{self.parallel.label()}·dp{self.dp}"


def layouts(setup: Setup, gpus: int, space: Space, cp: int = 1) -> list[Layout]:
    """Every valid (tp, sp, pp, ep, dp) split of ``gpus`` devices with ``cp`` context-parallel ranks."""
    m, seq = setup.model, setup.training.seq_len
    moe = m.moe
    widths = math.gcd(*tp_widths(m, moe.widths(m) if moe else ()).values())
    out = []
    for tp in divisors(widths, space.tp_max):
        for pp in divisors(m.num_layers):
            if gpus % (tp * cp * pp):
                continue
            dp = gpus // (tp * cp * pp)
            if dp > MAX_DP:  # what `estimate` refuses (StrategyConfig.dp)
                continue
            eps = [e for e in divisors(moe.experts) if dp % e == 0] if moe else [1]
            for ep in eps:
                par = Parallel(tp=tp, sp=tp > 1 and (seq // cp) % tp == 0, pp=pp, ep=ep, cp=cp)
                out.append(Layout(par, dp))
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


def searchable(base: Setup, gpus: int, batch: int, space: Space) -> bool:
    """Whether some layout of ``gpus`` devices and micro-batch size splits ``batch`` sequences evenly."""
    return any(batch % (b * x.dp) == 0 for x in layouts(base, gpus, space) for b in space.micro_batches)


NEAR = 64
"""How far from --gpus ``why_nothing`` looks for a device count that would split the batch."""


def too_many(base: Setup, gpus: int, space: Space) -> str | None:
    """One line when every layout of ``gpus`` devices needs dp > ``MAX_DP`` (what `estimate` refuses),
    else None. The most devices a layout takes is tp · pp · ``MAX_DP`` with the widest tp and the deepest
    pp (one layer a stage) that ``layouts`` searches."""
    if layouts(base, gpus, space):
        return None
    m = base.model
    widths = math.gcd(*tp_widths(m, m.moe.widths(m) if m.moe else ()).values())
    most = max(divisors(widths, space.tp_max)) * m.num_layers * MAX_DP
    return (
        f"gpus: {gpus:,} devices need a data-parallel degree above {MAX_DP:,} in every layout fit searches "
        f"(tp ≤ {space.tp_max}, pp dividing the {m.num_layers} layers); use at most --gpus {most:,}"
    )


def why_nothing(base: Setup, gpus: int, batch: int, given: bool, space: Space) -> str:
    """One line: why no configuration of the space could be searched, and what to change.

    A layout always exists (tp = pp = 1), so the constraint that fails is the global batch: B sequences must
    split into whole micro-batches of a searched size b on each of the dp ranks, b · dp | B.
    """
    m = base.model
    dps = sorted({x.dp for x in layouts(base, gpus, space)})
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
        f"dividing the heads and widths, pp dividing the {m.num_layers} layers); nothing to search: use "
        f"--global-batch {better} (a multiple of {step}){gpus_fix}"
    )
