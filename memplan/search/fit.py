"""Search the layouts and strategies that fit a model on N GPUs, ranked by estimated throughput.

The space: activation checkpointing × attention kernel × ZeRO stage × (tp, pp, dp) splits of the N devices
(tp up to ``Space.tp_max``, sequence parallel whenever tp > 1, pp dividing the layers, dp = N / (tp·pp);
context parallelism cp = 2, 4, … ``Space.cp_max`` with flash attention only when nothing fits without it;
for a mixture of experts every ep dividing both the experts and dp) × micro-batch size. The global batch
(sequences per step) is fixed, so a layout with dp ranks and micro-batch b runs B / (b·dp) micro-batches.

A family is (checkpointing, attention, ZeRO stage, layout); its configurations are its micro-batch sizes. A
family fails when none of them fits; its reason is the overflowing term (``budget.verdict``) of its
smallest micro-batch. Fitting configurations are ranked by tokens/s, predicted (``timing``: kernels,
the communication not hidden on the GPU's topology, the pipeline bubble; docs/step-time.md) or at an
assumed ``--mfu``, ties broken by fewer model-parallel devices, the lower ZeRO stage, the larger
micro-batch, then the lower peak.

Speed: the per-rank pieces (inventory, transients) are cached per (checkpointing, attention, tp, micro-
batch); a configuration then costs its stages' states and activations, and its peak only when the
lower bound (states + activations) does not already rule it out. A ZeRO stage that fits makes the higher
stages of the same configuration redundant (they never need more memory and never move fewer bytes):
they are not evaluated and not listed. NB: ZeRO 1 moves ZeRO 0's all-reduce as a reduce-scatter and an
all-gather, and the all-gather may hide behind the next forward: a small gain this search does not look
for. Over one data-parallel rank (dp 1) the
ZeRO stages shard nothing, so only stage 0 is searched there.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from memplan.config import Attention, Checkpointing, Parallel, PositionType, Setup, ZeroStage
from memplan.contract import to_json as result_json
from memplan.engine import Result, estimate
from memplan.presets import GpuPreset
from memplan.search.budget import DEFAULT_RESERVE, Verdict, verdict
from memplan.strategies.tensor_parallel import divisors, tp_widths
from memplan.time.timing import Timing, check_time_inputs, timing

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


@dataclass(frozen=True)
class Family:
    checkpointing: Checkpointing
    attention: Attention
    zero: ZeroStage
    layout: Layout

    def settings(self) -> dict[str, Any]:
        par = self.layout.parallel
        return {
            "checkpointing": self.checkpointing.name.lower(),
            "attention": self.attention.name.lower(),
            "zero": int(self.zero),
            "tp": par.tp,
            "sp": par.sp,
            "pp": par.pp,
            "ep": par.ep,
            "cp": par.cp,
            "dp": self.layout.dp,
        }


@dataclass(frozen=True)
class Config:
    """A configuration that fits."""

    family: Family
    result: Result
    timing: Timing
    verdict: Verdict

    @property
    def micro_batch(self) -> int:
        return self.result.setup.training.micro_batch

    def sort_key(self) -> tuple[float, int, int, int, int]:
        par = self.family.layout.parallel
        return (
            -self.timing.tokens_per_s,
            par.model_parallel,
            int(self.family.zero),
            -self.micro_batch,
            self.verdict.peak,
        )

    def to_json(self) -> dict[str, Any]:
        out = result_json(self.result)
        out["settings"] = {**self.family.settings(), "micro_batch": self.micro_batch}
        out["fit"] = self.verdict.to_json()
        out["time"] = self.timing.to_json()
        return out


@dataclass(frozen=True)
class Rejected:
    """A family none of whose micro-batch sizes fits, with the verdict of its smallest."""

    family: Family
    micro_batch: int
    verdict: Verdict

    def to_json(self) -> dict[str, Any]:
        return {**self.family.settings(), "micro_batch": self.micro_batch, "fit": self.verdict.to_json()}


@dataclass
class FitResult:
    setup: Setup
    gpu: GpuPreset
    gpus: int
    global_batch: int
    reserve: int = DEFAULT_RESERVE
    """Bytes of each GPU kept back (``budget``): configurations fit in ``usable``."""
    fitting: list[Config] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)
    searched: int = 0
    """Configurations of the space (families × micro-batch sizes that divide the global batch)."""
    evaluated: int = 0
    """Configurations whose states and activations were computed (the rest: redundant ZeRO stages)."""
    peaks: int = 0
    """Configurations whose peak had to be computed (the lower bound did not rule them out)."""
    seconds: float = 0.0
    max_seq: int | None = None
    """The longest sequence the best configuration fits (micro-batch 1); None when nothing fits."""

    @property
    def usable(self) -> int:
        """Bytes of each GPU a configuration may use: its memory less the reserve."""
        return self.gpu.memory_bytes - self.reserve

    @property
    def best(self) -> Config | None:
        return self.fitting[0] if self.fitting else None

    def to_json(self, top: int = 0) -> dict[str, Any]:
        """The search, its ``top`` configurations (0: all) with their plans' keys, every rejected family."""
        shown = self.fitting[:top] if top else self.fitting
        return {
            "model": self.setup.model.name,
            "gpu": self.gpu.name,
            "gpus": self.gpus,
            "seq_len": self.setup.training.seq_len,
            "global_batch": self.global_batch,
            "reserve": self.reserve,
            "searched": self.searched,
            "evaluated": self.evaluated,
            "peaks": self.peaks,
            "seconds": self.seconds,
            "max_seq": self.max_seq,
            "fitting": len(self.fitting),
            "configs": [c.to_json() for c in shown],
            "rejected": [x.to_json() for x in self.rejected],
        }


# ----------------------------------------------------------------------------------------------------
# The space
# ----------------------------------------------------------------------------------------------------
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
            eps = [e for e in divisors(moe.experts) if dp % e == 0] if moe else [1]
            for ep in eps:
                par = Parallel(tp=tp, sp=tp > 1 and (seq // cp) % tp == 0, pp=pp, ep=ep, cp=cp)
                out.append(Layout(par, dp))
    return out


def default_global_batch(seq: int, gpus: int) -> int:
    """≈ 4M tokens of whole sequences, a power of two, at least one sequence per device."""
    return max(gpus, 1 << max(0, round(math.log2(max(1, TOKENS_PER_STEP // seq)))))


def _setup(base: Setup, family: Family, micro_batch: int, micro_batches: int) -> Setup:
    """``base`` with a family's strategy, layout and micro-batch (valid by construction: not
    re-validated)."""
    return base.model_copy(
        update={
            "parallel": family.layout.parallel,
            "training": base.training.model_copy(
                update={"micro_batch": micro_batch, "grad_accum": micro_batches}
            ),
            "strategy": base.strategy.model_copy(
                update={
                    "checkpointing": family.checkpointing,
                    "checkpoint_every": 1,
                    "attention": family.attention,
                    "zero": family.zero,
                    "dp": family.layout.dp,
                    "reversible": False,
                }
            ),
        }
    )


def fits(p: Result, memory: int) -> bool:
    """Every computed stage fits: the lower bound first, the peak only when needed."""
    return all(sp.lower_bound <= memory for sp in p.stages) and p.device.peak.bytes <= memory


# ----------------------------------------------------------------------------------------------------
# The search
# ----------------------------------------------------------------------------------------------------
def fit(
    base: Setup,
    gpu: GpuPreset,
    gpus: int,
    *,
    global_batch: int | None = None,
    mfu: float | None = None,
    space: Space | None = None,
    max_seq: bool = True,
    reserve: int = DEFAULT_RESERVE,
) -> FitResult:
    """Search ``space`` for ``base``'s model and sequence on ``gpus`` × ``gpu``, each with ``reserve`` bytes
    kept back (``budget``); see the module docstring."""
    space = space or Space()
    if gpus < 1:
        raise ValueError(f"gpus: need at least one device, got {gpus}; e.g. --gpus 8")
    if space.tp_max < 1:
        raise ValueError(f"tp-max: must be at least 1, got {space.tp_max}; e.g. --tp-max 8")
    if space.cp_max < 1:
        raise ValueError(
            f"cp-max: must be at least 1 (1: no context parallelism), got {space.cp_max}; e.g. --cp-max 16"
        )
    if global_batch is not None and global_batch < 1:
        raise ValueError(
            f"global-batch: must be at least one sequence, got {global_batch}; e.g. --global-batch 512"
        )
    check_time_inputs(mfu, None, None)
    batch = global_batch or default_global_batch(base.training.seq_len, gpus)
    start = time.perf_counter()
    result = FitResult(setup=base, gpu=gpu, gpus=gpus, global_batch=batch, reserve=reserve)
    memory = result.usable
    if not _searchable(base, gpus, batch, space):
        raise ValueError(_why_nothing(base, gpus, batch, global_batch is not None, space))
    for layout in layouts(base, gpus, space):
        for ckpt in space.checkpointing:
            for attention in space.attention:
                _search_families(result, base, layout, ckpt, attention, space, mfu)
    if not result.fitting and Attention.FLASH in space.attention:  # the sequence needs context parallelism
        for cp in context_degrees(base, gpus, space):
            for layout in layouts(base, gpus, space, cp):
                for ckpt in space.checkpointing:
                    _search_families(result, base, layout, ckpt, Attention.FLASH, space, mfu)
    result.fitting.sort(key=Config.sort_key)
    result.seconds = time.perf_counter() - start
    if max_seq and result.best is not None:
        result.max_seq = longest_sequence(result.best, memory)
    return result


def context_degrees(base: Setup, gpus: int, space: Space) -> list[int]:
    """The context-parallel degrees searched: powers of two 2…``cp_max`` dividing the devices whose 2·cp
    chunks split the sequence (``strategies.context_parallel.check_context``)."""
    seq, out, cp = base.training.seq_len, [], 2
    while cp <= min(space.cp_max, gpus):
        if gpus % cp == 0 and seq % (2 * cp) == 0:
            out.append(cp)
        cp *= 2
    return out


def _searchable(base: Setup, gpus: int, batch: int, space: Space) -> bool:
    """Whether some layout of ``gpus`` devices and micro-batch size splits ``batch`` sequences evenly."""
    return any(batch % (b * x.dp) == 0 for x in layouts(base, gpus, space) for b in space.micro_batches)


def _why_nothing(base: Setup, gpus: int, batch: int, given: bool, space: Space) -> str:
    """One line: why no configuration of the space could be searched, and what to change.

    A layout always exists (tp = pp = 1), so the constraint that fails is the global batch: B sequences must
    split into whole micro-batches of a searched size b on each of the dp ranks, b · dp | B.
    """
    m = base.model
    dps = sorted({x.dp for x in layouts(base, gpus, space)})
    sizes = ", ".join(map(str, space.micro_batches))
    step = min((b * dp for b in space.micro_batches for dp in dps), key=lambda k: (-(-batch // k) * k, k))
    better = -(-batch // step) * step
    near = [
        g
        for g in sorted(range(1, 2 * gpus + 9), key=lambda g: (abs(g - gpus), g))
        if g != gpus
        and _searchable(base, g, batch if given else default_global_batch(base.training.seq_len, g), space)
    ][:1]
    gpus_fix = f" or --gpus {near[0]}" if near else ""
    origin = "" if given else " (the default, ≈ 4M tokens)"
    return (
        f"global-batch: {batch} sequences{origin} do not split into micro-batches of {sizes} on dp "
        f"{', '.join(map(str, dps))} ranks, the data-parallel degrees {gpus} GPUs allow (tp ≤ {space.tp_max} "
        f"dividing the heads and widths, pp dividing the {m.num_layers} layers); nothing to search: use "
        f"--global-batch {better} (a multiple of {step}){gpus_fix}"
    )


def _search_families(
    result: FitResult,
    base: Setup,
    layout: Layout,
    ckpt: Checkpointing,
    attention: Attention,
    space: Space,
    mfu: float | None,
) -> None:
    """The ZeRO-stage families of one (layout, checkpointing, attention), micro-batch by micro-batch."""
    memory, dp = result.usable, layout.dp
    # Over one data-parallel rank every ZeRO stage shards nothing: the same memory and time as stage 0.
    stages = sorted(space.zero) if dp > 1 else sorted(space.zero)[:1]
    families = [Family(ckpt, attention, z, layout) for z in stages]
    first_failure: dict[Family, Rejected] = {}
    fitted: set[Family] = set()
    for b in space.micro_batches:
        if result.global_batch % (b * dp):
            continue
        n = result.global_batch // (b * dp)
        result.searched += len(families)
        for family in families:
            result.evaluated += 1
            p = estimate(_setup(base, family, b, n))
            ok = fits(p, memory)
            result.peaks += any("peak" in vars(sp) for sp in p.stages)  # computed (cached) or not
            if ok:
                t = timing(p, result.gpu, mfu=mfu)
                result.fitting.append(Config(family, p, t, verdict(p, result.gpu, reserve=result.reserve)))
                fitted.update(f for f in families if f.zero >= family.zero)
                break  # the higher ZeRO stages fit too, no faster
            if family not in first_failure:
                first_failure[family] = Rejected(
                    family, b, verdict(p, result.gpu, exact=False, reserve=result.reserve)
                )
    result.rejected += [r for f, r in first_failure.items() if f not in fitted]


def longest_sequence(best: Config, memory: int, cap: int = 1 << 20) -> int:
    """The longest sequence the best configuration fits at micro-batch 1 (binary search).

    Sequences step by tp under sequence parallelism, by 2·cp under context parallelism (cp·lcm(2, tp)
    with both); learned positions cap it at ``max_positions``.
    """
    p = best.result
    par = p.parallel
    step = par.tp if par.sp else 1
    if par.cp > 1:
        step = par.cp * math.lcm(2, step)
    if p.setup.model.position is PositionType.LEARNED:
        cap = min(cap, p.setup.model.max_positions)
    n = p.micro_batches * p.setup.training.micro_batch

    def ok(seq: int) -> bool:
        training = p.setup.training.model_copy(update={"seq_len": seq, "micro_batch": 1, "grad_accum": n})
        return fits(estimate(p.setup.model_copy(update={"training": training})), memory)

    lo, hi = 0, cap // step  # in steps: ok(lo·step) (or lo = 0), not ok above hi·step
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid * step) else (lo, mid - 1)
    return lo * step
