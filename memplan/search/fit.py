"""Search the layouts and strategies that fit a model on N GPUs, ranked by estimated throughput.

The space: activation checkpointing × attention kernel × ZeRO stage × layouts of the N devices
(``space.layouts``: tp up to ``Space.tp_max``, sequence parallel whenever tp > 1; pp any degree up to the
layers, uneven stages as ``estimate`` places them, with the interleaved schedule's vpp of ``Space.vpp``;
context parallelism cp = 1, 2, 4, … ``Space.cp_max`` with flash attention, beside every layout; HSDP with
one node's data-parallel ranks as the shard group; dp = N / (tp·cp·pp); for a mixture of experts every ep
dividing both the experts and dp) × micro-batch size. The global batch (sequences per step) is fixed, so a
layout with dp ranks and micro-batch b runs B / (b·dp) micro-batches. Each listed configuration comes with
the ``memplan estimate`` command that reproduces it (``estimate_command``).

A family is (checkpointing, attention, ZeRO stage, layout); its configurations are its micro-batch sizes. A
family fails when none of them fits; its reason is the overflowing term (``budget.verdict``) of its
smallest micro-batch. Fitting configurations are ranked by tokens/s, predicted (``timing``: kernels,
the communication not hidden on the GPU's topology, the pipeline bubble; docs/step-time.md) or at an
assumed ``--mfu``, ties broken by fewer model-parallel devices, the lower ZeRO stage, the larger
micro-batch, then the lower peak.

Speed: the per-rank pieces (inventory, transients) are cached per (checkpointing, attention, tp, micro-
batch); a configuration then costs its stages' states and activations, and its peak only when the
lower bound (states + activations) does not already rule it out. A configuration whose step-time lower
bound (``bound``: its FLOPs at the best kernel fraction of peak, stretched by its bubble) is slower than
the ``Space.keep`` (``--top``) fastest found so far is pruned unevaluated — neither listed nor judged for
memory (``pruned``); layouts go fastest bound first so the cut-off tightens early. A ZeRO stage that
fits makes the higher stages of the same configuration redundant (they never need more memory and never
move fewer bytes): they are not evaluated and not listed. NB: ZeRO 1 moves ZeRO 0's all-reduce as a
reduce-scatter and an all-gather, and the all-gather may hide behind the next forward: a small gain this
search does not look for. Over one data-parallel rank (dp 1) the ZeRO stages shard nothing, so only stage
0 is searched there.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from memplan.config import (
    FULL_TRAINING,
    Attention,
    Checkpointing,
    FineTune,
    LossKind,
    Method,
    Offload,
    Optimizer,
    PositionType,
    Precision,
    Setup,
    ZeroStage,
    loss_label,
    offload_label,
)
from memplan.contract import to_json as result_json
from memplan.engine import Result, estimate
from memplan.presets import GpuPreset
from memplan.search.bound import Bound, Cutoff
from memplan.search.budget import DEFAULT_RESERVE, Verdict, allocator_memory, fits, host_fits, verdict
from memplan.search.methods import (
    SAVERS,
    searches_checkpointing,
    searches_layout,
    valid,
    with_method,
)
from memplan.search.space import (
    Layout,
    Space,
    context_degrees,
    default_global_batch,
    layouts,
    searchable,
    too_many,
    why_nothing,
)
from memplan.time.timing import Timing, check_time_inputs, timing

__all__ = [
    "Config",
    "Family",
    "FitResult",
    "Layout",
    "Outcome",
    "Rejected",
    "Space",
    "default_global_batch",
    "fit",
    "fits",
    "layouts",
    "longest_sequence",
]


@dataclass(frozen=True)
class Family:
    checkpointing: Checkpointing
    attention: Attention
    zero: ZeroStage
    layout: Layout
    finetune: FineTune = FULL_TRAINING
    saver: int = 0
    """The level of memory savers (``methods.SAVERS``: offload, loss)."""

    def settings(self) -> dict[str, Any]:
        par = self.layout.parallel
        saver = SAVERS[self.saver]
        return {
            "method": self.finetune.method.name.lower(),
            "offload": offload_label(saver.offload),
            "loss": loss_label(saver.loss, 1),
            "checkpointing": self.checkpointing.name.lower(),
            "attention": self.attention.name.lower(),
            "zero": int(self.zero),
            "tp": par.tp,
            "sp": par.sp,
            "pp": par.pp,
            "vpp": par.vpp,
            "pp_layers": list(par.pp_layers) if par.pp_layers is not None else None,
            "ep": par.ep,
            "cp": par.cp,
            "dp": self.layout.dp,
            "hsdp": self.layout.hsdp,
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

    def sort_key(self) -> tuple[int, int, float, int, int, int, int]:
        par = self.family.layout.parallel
        return (
            int(self.family.finetune.method),
            self.family.saver,
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


@dataclass(frozen=True)
class Outcome:
    """One method's answer: its fastest configuration at the lowest saver level that fits (None: none)."""

    finetune: FineTune
    best: Config | None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"method": self.finetune.method.name.lower(), "fits": self.best is not None}
        if self.best is not None:
            b = self.best
            out |= {
                "settings": {**b.family.settings(), "micro_batch": b.micro_batch},
                "peak": b.verdict.peak,
                "tokens_per_s": b.timing.tokens_per_s,
                "trainable": b.result.params_trainable,
            }
        return out


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
    pruned: int = 0
    """Configurations skipped unevaluated: their step-time bound (``bound``) is slower than the ``keep``
    fastest found (neither listed nor judged for memory)."""
    seconds: float = 0.0
    max_seq: int | None = None
    """The longest sequence the best configuration fits (micro-batch 1); None when nothing fits."""
    methods: list[Outcome] = field(default_factory=list)
    """Each method searched, in order: the fastest configuration at the lowest saver level that fits."""
    cutoffs: dict[tuple[FineTune, int], Cutoff] = field(default_factory=dict, repr=False)
    """Per method and saver level, the ``Space.keep`` fastest step times so far (``bound``)."""

    @property
    def usable(self) -> int:
        """Bytes of each GPU torch's allocator may reserve: the driver's memory less the CUDA context and
        the reserve (``budget.allocator_memory``)."""
        return allocator_memory(self.gpu, self.reserve)

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
            "pruned": self.pruned,
            "seconds": self.seconds,
            "max_seq": self.max_seq,
            "fitting": len(self.fitting),
            "configs": [c.to_json() | {"command": estimate_command(c, self)} for c in shown],
            "methods": [m.to_json() for m in self.methods],
            "rejected": [x.to_json() for x in self.rejected],
        }


# ----------------------------------------------------------------------------------------------------
# The command that reproduces a row
# ----------------------------------------------------------------------------------------------------
def estimate_command(c: Config, r: FitResult) -> str:
    """The ``memplan estimate`` command that gives configuration ``c`` of search ``r`` (the same setup, so the
    same memory and step time): the base's model and training settings that differ from the options'
    defaults, the searched family's strategy and layout, the GPU, the GPU count and the global batch."""
    s = c.result.setup
    t, st, par = s.training, s.strategy, s.parallel
    f = c.family
    args = ["memplan estimate", f"-m {s.model.name}", f"--seq {t.seq_len}"]
    if t.precision is not Precision.BF16_MIXED:
        args.append(f"--precision {t.precision.value}")
    if t.optimizer is not Optimizer.ADAMW:
        args.append(f"--optimizer {t.optimizer.value}")
    args += [f"--gpu {r.gpu.name}", f"--gpus {r.gpus}", f"--global-batch {r.global_batch}"]
    args += [f"--batch {t.micro_batch}", f"--tp {par.tp}"] + (["--sp"] if par.sp else [])
    args.append(f"--pp {par.pp}")
    if par.vpp > 1:
        args.append(f"--vpp {par.vpp}")
    if par.pp_layers is not None:
        args.append("--pp-layers " + ",".join(map(str, par.pp_layers)))
    args += [f"--cp {par.cp}"] if par.cp > 1 else []
    args += [f"--ep {par.ep}"] if par.ep > 1 else []
    args.append(f"--zero {int(st.zero)}")
    args += [f"--hsdp {st.hsdp}"] if st.hsdp else []
    args += [f"--checkpointing {f.checkpointing.name.lower()}", f"--attention {f.attention.name.lower()}"]
    saver = SAVERS[f.saver]
    if saver.offload is not Offload.NONE:
        args.append(f"--offload {offload_label(saver.offload)}")
    if saver.loss is not LossKind.STANDARD:
        args.append(f"--loss {loss_label(saver.loss, 1)}")
    return " ".join(args + _finetune_args(f.finetune))


def _finetune_args(ft: FineTune) -> list[str]:
    """The fine-tuning options that give ``ft`` (nothing for plain full training)."""
    out = [] if ft.method is Method.FULL else [f"--finetune {ft.method.name.lower()}"]
    if ft.method is not Method.FULL:
        out += [f"--lora-rank {ft.rank}", f"--lora-alpha {ft.alpha:g}", f"--lora-dropout {ft.dropout:g}"]
        out.append("--lora-targets " + ",".join(t.value for t in ft.targets))
    if ft.method is Method.QLORA:
        out.append(f"--quant {ft.quant.value}" + (" --double-quant" if ft.double_quant else ""))
    parts = ["embeddings"] * ft.freeze_embeddings + ["lm_head"] * ft.freeze_lm_head
    if ft.freeze_layers is not None:
        parts.append(f"layers:{ft.freeze_layers[0]}-{ft.freeze_layers[1]}")
    return out + ([f"--freeze {','.join(parts)}"] if parts else [])


# ----------------------------------------------------------------------------------------------------
# The space
# ----------------------------------------------------------------------------------------------------
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
                    "hsdp": family.layout.hsdp,
                    "reversible": False,
                }
            ),
        }
    )


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
    finetunes: tuple[FineTune, ...] = (),
    escalate: bool = False,
) -> FitResult:
    """Search ``space`` for ``base``'s model and sequence on ``gpus`` × ``gpu``, each with ``reserve`` bytes
    kept back (``budget``); see the module docstring. ``finetunes``: the methods to search, in order
    (default: ``base``'s); ``escalate``: stop at the first that fits without a saver (``methods``)."""
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
    crowded = too_many(base, gpus, space)
    if crowded:
        raise ValueError(crowded)
    if not searchable(base, gpus, batch, space):
        raise ValueError(why_nothing(base, gpus, batch, global_batch is not None, space))
    bound = Bound(gpu, gpus, batch) if mfu is None and space.keep else None
    tried: list[FineTune] = []
    for ft in finetunes or (base.finetune,):
        tried.append(ft)
        for level, saver in enumerate(SAVERS):
            if saver.offload and gpu.host_memory_gib is None:
                break  # offload needs the node's host memory (the preset's or --host-memory) to judge
            before = len(result.fitting)
            _search_level(result, with_method(base, ft, saver), ft, level, gpus, space, mfu, bound)
            if len(result.fitting) > before:
                break
        fits_plainly = any(c.family.finetune == ft and c.family.saver == 0 for c in result.fitting)
        if escalate and fits_plainly:
            break  # the method fits without a saver: the later methods are not needed
    result.fitting.sort(key=Config.sort_key)
    searched = {c.family.finetune: None for c in result.fitting} | {
        r.family.finetune: None for r in result.rejected
    }
    result.methods = [
        Outcome(ft, next((c for c in result.fitting if c.family.finetune == ft), None))
        for ft in finetunes or (base.finetune,)
        if ft in searched
    ]
    result.seconds = time.perf_counter() - start
    if max_seq and result.best is not None:
        result.max_seq = longest_sequence(result.best, memory, gpu=gpu)
    return result


def _search_level(
    result: FitResult,
    base: Setup,
    ft: FineTune,
    level: int,
    gpus: int,
    space: Space,
    mfu: float | None,
    bound: Bound | None,
) -> None:
    """Every layout, checkpointing and attention of method ``ft`` at saver ``level`` (``base`` carries
    both); context parallelism (flash attention only) with every layout, not only when nothing fits
    without it: it may be faster (fewer micro-batches per data-parallel rank, a smaller bubble). Layouts
    go fastest bound first (``bound``), so that the cut-off tightens early."""
    node = result.gpu.topology.gpus_per_node
    flash = Attention.FLASH in space.attention and ft.trains_everything
    degrees = [1, *(context_degrees(base, gpus, space) if flash else [])]
    candidates = [x for cp in degrees for x in layouts(base, gpus, space, cp, gpus_per_node=node)]
    candidates = [x for x in candidates if searches_layout(ft, x.parallel.tp, x.parallel.pp, x.parallel.cp)]
    if bound is not None:
        first = space.checkpointing[0]

        def key(x: Layout) -> float:
            n = max(1, result.global_batch // (min(space.micro_batches) * x.dp))
            return bound.seconds(base, first, Attention.FLASH, x.parallel, n)

        candidates.sort(key=key)
    cutoff = result.cutoffs.setdefault((ft, level), Cutoff(space.keep if bound is not None else 0))
    for layout in candidates:
        attentions = space.attention if layout.parallel.cp == 1 else (Attention.FLASH,)
        for ckpt in space.checkpointing:
            if not searches_checkpointing(ft, ckpt):
                continue
            for attention in attentions:
                _search_families(result, base, layout, ckpt, attention, space, mfu, ft, level, bound, cutoff)


def _search_families(
    result: FitResult,
    base: Setup,
    layout: Layout,
    ckpt: Checkpointing,
    attention: Attention,
    space: Space,
    mfu: float | None,
    ft: FineTune,
    level: int,
    bound: Bound | None,
    cutoff: Cutoff,
) -> None:
    """The ZeRO-stage families of one (layout, checkpointing, attention), micro-batch by micro-batch, at
    method ``ft`` and saver ``level``; families memplan does not model (``methods.valid``) are skipped, and
    a micro-batch size whose step-time bound is slower than ``cutoff`` is pruned."""
    memory, dp = result.usable, layout.dp
    # Over one data-parallel rank every ZeRO stage shards nothing: the same memory and time as stage 0
    # (parameter offload needs ZeRO-3's sharding: its level keeps stage 3 only).
    stages = sorted(space.zero) if dp > 1 else sorted(space.zero)[:1]
    if layout.hsdp:  # hybrid sharding shards inside its groups: ZeRO 1–3 only
        stages = [z for z in stages if z is not ZeroStage.NONE]
    if Offload.PARAMS in SAVERS[level].offload:
        stages = [ZeroStage.PARAMETERS] if ZeroStage.PARAMETERS in space.zero else []
    every = [Family(ckpt, attention, z, layout, ft, level) for z in stages]
    families = [f for f in every if valid(_setup(base, f, 1, 1))]
    first_failure: dict[Family, Rejected] = {}
    fitted: set[Family] = set()
    for b in space.micro_batches:
        if result.global_batch % (b * dp):
            continue
        n = result.global_batch // (b * dp)
        if layout.parallel.vpp > 1 and n % layout.parallel.pp:
            continue  # the interleaved schedule runs micro-batches in groups of pp
        result.searched += len(families)
        if bound is not None and bound.seconds(base, ckpt, attention, layout.parallel, n) > cutoff.seconds:
            result.pruned += len(families)
            continue
        for family in families:
            result.evaluated += 1
            p = estimate(_setup(base, family, b, n))
            ok = fits(p, memory, result.gpu) and host_fits(p, result.gpu)
            result.peaks += any("peak" in vars(sp) for sp in p.stages)  # computed (cached) or not
            if ok:
                higher = [f for f in families if f.zero > family.zero]
                best = _fastest_stage(result, base, family, p, higher, b, n, mfu)
                result.fitting.append(best)
                cutoff.add(best.timing.step_time_s)
                fitted.update(higher, (family,))
                break  # the higher ZeRO stages fit too (memory falls with the stage); the fastest is listed
            if family not in first_failure and family.saver == 0:  # why it fails without savers
                first_failure[family] = Rejected(
                    family, b, verdict(p, result.gpu, exact=False, reserve=result.reserve)
                )
    result.rejected += [r for f, r in first_failure.items() if f not in fitted]


def _fastest_stage(
    result: FitResult,
    base: Setup,
    first: Family,
    p: Result,
    higher: list[Family],
    b: int,
    n: int,
    mfu: float | None,
) -> Config:
    """The fastest of ``first`` (the lowest ZeRO stage that fits, estimated as ``p``) and the higher stages
    of the same family, ties to the lowest stage. A higher stage can be faster: each rank steps the
    optimizer on its 1/dp of the parameters (``time.compute.optimizer_step_bytes``), while its extra
    communication (ZeRO-3's parameter all-gathers) may hide behind compute."""
    best = Config(first, p, timing(p, result.gpu, mfu=mfu), verdict(p, result.gpu, reserve=result.reserve))
    for family in higher:
        result.evaluated += 1
        q = estimate(_setup(base, family, b, n))
        if not (fits(q, result.usable) and host_fits(q, result.gpu)):
            continue
        t = timing(q, result.gpu, mfu=mfu)
        # judged on the allocator's reserved peak (a replay) only when it would be listed: faster
        if t.step_time_s < best.timing.step_time_s and fits(q, result.usable, result.gpu):
            best = Config(family, q, t, verdict(q, result.gpu, reserve=result.reserve))
    return best


def longest_sequence(best: Config, memory: int, cap: int = 1 << 20, gpu: GpuPreset | None = None) -> int:
    """The longest sequence the best configuration fits at micro-batch 1 (binary search).

    Sequences step by tp under sequence parallelism, by 2·cp under context parallelism (cp·lcm(2, tp)
    with both); learned positions cap it at ``max_positions``. With ``gpu``, judged on what the allocator
    reserves (``budget.fits``). NB: that judgement is not monotonic in the sequence (the allocator's
    segments and splits change with the sizes), so a longer sequence than the binary search's boundary can
    fit; none beyond the tensors' own boundary can (reserved ≥ allocated ≥ the peak).
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
        return fits(estimate(p.setup.model_copy(update={"training": training})), memory, gpu)

    lo, hi = 0, cap // step  # in steps: ok(lo·step) (or lo = 0), not ok above hi·step
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid * step) else (lo, mid - 1)
    return lo * step
