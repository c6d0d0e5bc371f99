"""The configurations of one (layout, checkpointing, attention) at one method and saver level — its ZeRO
stages × micro-batch sizes — judged for memory, timed and listed or rejected (``fit``'s module docstring).

Work goes cheapest first, and every shortcut gives the answer of the full evaluation:

1. a micro-batch size whose step-time bound (``bound``: one reference sequence's kernels, no estimate) is
   slower than the cut-off (the ``Space.keep`` fastest so far) is pruned;
2. otherwise, when every ZeRO stage is predicted slower than the cut-off, none of them can be listed (the
   full evaluation would list at most one, slower than the cut-off, which leaves the cut-off as it is),
   so no memory is judged for the listing: pruned. Decided cheapest first: one bound shared by the
   stages (``bound.stages_bound``: the predicted step without its ZeRO-dependent terms, from the first
   stage's estimate alone), then the stages timed one by one (``timing``) until one is within the
   cut-off. Estimates and timings are made when first asked and kept with the micro-batch; a stage's
   estimate after the first is that one's with its own model states (``restaged``: nothing else reads
   the ZeRO stage);
3. otherwise memory, stage by stage (``budget.fits``: the lower bounds, the requested peak, then one
   memoised replay at the usable memory), the lowest stage that fits and the faster higher stages listed
   as one row (``fastest_stage``).

A family is rejected when no micro-batch fits it (nor a lower ZeRO stage at the same micro-batch, which
makes it redundant); its reason is the verdict at the smallest micro-batch where it fails. Rejection is
judged only for the (layout, checkpointing, attention) one of whose micro-batch sizes could be listed —
some ZeRO stage predicted within the cut-off when it was reached (``_Group.listable``); one slower than
the cut-off at every micro-batch size, by either step, is neither listed nor judged: the rejected
families are the ones that would have been among the fastest rows had they fitted (when nothing fits the
cut-off stays open and every family is judged). Micro-batches pruned at step 2 are judged for memory only
when that decides a family's rejection, in order, until every family is known to fit somewhere.
``shortcuts=False`` skips step 2 (the reference the tests and benchmarks/bench_fit.py compare with: it
judges the same families for rejection, asking ``listable`` when a family fits nowhere).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from memplan.config import Attention, Checkpointing, FineTune, Offload, Setup, ZeroStage
from memplan.engine import Result, estimate, unplanned
from memplan.presets import GpuPreset
from memplan.search.bound import Bound, Cutoff, stages_bound
from memplan.search.budget import fits, host_fits, verdict
from memplan.search.methods import SAVERS, valid
from memplan.search.results import Config, Family, FitResult, Rejected
from memplan.search.space import Layout, Space
from memplan.stage_plan import stage_states
from memplan.strategies import offload
from memplan.time.predict import Unstaged, unstaged
from memplan.time.timing import Timing, peak_flops, timing


def family_setup(base: Setup, family: Family, micro_batch: int, micro_batches: int) -> Setup:
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


def restaged(r: Result, setup: Setup) -> Result:
    """``estimate(setup)`` for a ``setup`` that differs from ``r.setup`` in the ZeRO stage alone, from
    ``r``'s pieces: ``stage_plan.stage_plan`` reads the ZeRO stage only in the model states
    (``stage_plan.stage_states``) — the stage, its parameters, group counts, boundary tensors and
    activations are the same, and so are the pieces (``pieces._PER_STEP``: keyed without it), the FLOPs
    and the parameter counts — so each stage plan is ``r``'s with the states of ``setup``. Under offload
    the host's share and the device's activations depend on the states too: estimated afresh there.
    tests/plan/test_fit_shortcuts.py checks it equals ``estimate(setup)`` over every family of searches."""
    if offload.applies(setup) or offload.applies(r.setup):
        return estimate(setup)
    # no ``check_layout``: it reads the degrees, the model, the sequence, the attention and dp, never the
    # ZeRO stage, so ``setup`` passes it as ``r.setup`` did
    ep = setup.parallel.ep
    stages = tuple(
        dataclasses.replace(sp, states=stage_states(sp.pieces, sp.params, sp.stage, setup, ep), setup=setup)
        for sp in r.stages
    )
    return dataclasses.replace(r, setup=setup, stages=stages)


@dataclass
class _Group:
    """One micro-batch size's configurations: the families' estimates and step times, in ZeRO-stage order,
    each made when first asked (a group pruned by ``stages_bound`` needs one estimate, or none more)."""

    micro_batch: int
    micro_batches: int
    base: Setup
    families: list[Family]
    gpu: GpuPreset
    mfu: float | None
    cutoff: float = math.inf
    """The cut-off when the search reached this micro-batch size (``listable`` reads it)."""
    first_fit: int | None = None
    """The index of the lowest stage that fits (the stage count: none); None: not judged for the listing."""
    within: bool | None = None
    """``listable``'s answer, once asked."""
    shared: Unstaged | None = None
    """``unstaged``, once made."""
    made: dict[int, Result] = field(default_factory=dict)
    timed: dict[int, Timing] = field(default_factory=dict)
    bounded: bool = False
    """Stage 0 bounded (``slower_than``) from ``engine.unplanned``: counted as estimated, as it was."""

    def estimate(self, i: int) -> Result:
        """Stage ``i``'s estimate: another stage's with its model states (``restaged``) once one is made."""
        if i not in self.made:
            setup = family_setup(self.base, self.families[i], self.micro_batch, self.micro_batches)
            other = next(iter(self.made.values()), None)
            self.made[i] = estimate(setup) if other is None else restaged(other, setup)
        return self.made[i]

    def unstaged(self) -> Unstaged:
        """What the stages' predictions share (``predict.unstaged``), from the first estimate made (or an
        estimate without stage plans: ``slower_than``'s bound reads none)."""
        if self.shared is None:
            first = self.made.get(0) or next(iter(self.made.values()), None)
            if first is None:
                setup = family_setup(self.base, self.families[0], self.micro_batch, self.micro_batches)
                first, self.bounded = unplanned(setup), True
            self.shared = unstaged(first, self.gpu, peak_flops(self.gpu, first.setup.training.precision))
        return self.shared

    def time(self, i: int) -> Timing:
        if i not in self.timed:
            self.timed[i] = timing(self.estimate(i), self.gpu, mfu=self.mfu, shared=self.unstaged())
        return self.timed[i]

    def slower_than(self, seconds: float) -> bool:
        """Every stage predicted slower than ``seconds`` (module docstring, step 2): first their shared
        bound (``bound.stages_bound``), then stage by stage until one is not."""
        if not self.families:
            return False
        # the bound reads no stage plan (the critical stage, its kernels and the tp/cp/pp/ep rows come from
        # the setup, the pieces, the FLOPs and the parameters): an estimate without them when none is made
        shared = self.unstaged()
        if stages_bound(shared.critical.result, self.gpu, shared) > seconds:
            return True
        return all(self.time(i).step_time_s > seconds for i in range(len(self.families)))

    def listable(self) -> bool:
        """Could one of its stages be listed: at an assumed MFU or an open cut-off (nothing pruned by time
        then), or some stage predicted within the cut-off it was reached at (step 2). The same answer
        with and without step 2's shortcut: the cut-off evolves alike (a configuration step 2 prunes is
        slower than it, so listing it would not move it), and ``slower_than`` reads no memory."""
        if self.within is None:
            self.within = self.mfu is not None or self.cutoff == math.inf or not self.slower_than(self.cutoff)
        return self.within


def search_families(
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
    shortcuts: bool = True,
) -> None:
    """The ZeRO-stage families of one (layout, checkpointing, attention), micro-batch by micro-batch, at
    method ``ft`` and saver ``level`` (module docstring); families memplan does not model
    (``methods.valid``) are skipped."""
    dp = layout.dp
    # Over one data-parallel rank every ZeRO stage shards nothing: the same memory and time as stage 0
    # (parameter offload needs ZeRO-3's sharding: its level keeps stage 3 only).
    stages = sorted(space.zero) if dp > 1 else sorted(space.zero)[:1]
    if layout.hsdp:  # hybrid sharding shards inside its groups: ZeRO 1–3 only
        stages = [z for z in stages if z is not ZeroStage.NONE]
    if Offload.PARAMS in SAVERS[level].offload:
        stages = [ZeroStage.PARAMETERS] if ZeroStage.PARAMETERS in space.zero else []
    every = [Family(ckpt, attention, z, layout, ft, level) for z in stages]
    families = [f for f in every if valid(family_setup(base, f, 1, 1))]
    groups: list[_Group] = []
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
        group = _Group(b, n, base, families, result.gpu, mfu, cutoff.seconds)
        groups.append(group)
        if shortcuts and not group.listable():
            result.pruned += len(families)
            continue  # none can be listed (module docstring, step 2)
        _judge(result, families, group, cutoff)
    _reject(result, families, groups)
    result.evaluated += sum(len(g.made) + (g.bounded and 0 not in g.made) for g in groups)


def _fits(result: FitResult, p: Result) -> bool:
    ok = fits(p, result.usable, result.gpu) and host_fits(p, result.gpu)
    result.peaks += any("peak" in vars(sp) for sp in p.stages)  # computed (cached) or not
    return ok


def _judge(result: FitResult, families: list[Family], group: _Group, cutoff: Cutoff) -> None:
    """The lowest stage of ``group`` that fits and the fastest of it and the higher ones, listed."""
    for i in range(len(families)):
        if _fits(result, group.estimate(i)):
            group.first_fit = i
            best = fastest_stage(result, group, i)
            result.fitting.append(best)
            cutoff.add(best.timing.step_time_s)
            return
    group.first_fit = len(families)


def fastest_stage(result: FitResult, group: _Group, first: int) -> Config:
    """The fastest of stage ``first`` of ``group`` (the lowest ZeRO stage that fits) and the higher stages
    of the same configuration, ties to the lowest stage. A higher stage can be faster: each rank steps the
    optimizer on its 1/dp of the parameters (``time.compute.optimizer_step_bytes``), while its extra
    communication (ZeRO-3's parameter all-gathers) may hide behind compute."""
    gpu, usable, families = result.gpu, result.usable, group.families
    best = Config(families[first], group.estimate(first), group.time(first), gpu, result.reserve)
    for k in range(first + 1, len(families)):
        q = group.estimate(k)
        if not (fits(q, usable) and host_fits(q, gpu)):
            continue
        t = group.time(k)
        # judged on the allocator's reserved peak (a replay) only when it would be listed: faster
        if t.step_time_s < best.timing.step_time_s and fits(q, usable, gpu):
            best = Config(families[k], q, t, gpu, result.reserve)
    return best


def _reject(result: FitResult, families: list[Family], groups: list[_Group]) -> None:
    """The families no micro-batch fits, each with the verdict of the smallest micro-batch (where it fails,
    as at every one); the groups pruned by time are judged, in order, only while that is undecided. None
    unless some micro-batch could be listed (``_Group.listable``; module docstring)."""
    if not any(g.listable() for g in groups):
        return
    count = len(families)
    fitted = {i for g in groups if g.first_fit is not None for i in range(g.first_fit, count)}
    for g in groups:
        if len(fitted) == count:
            return
        if g.first_fit is None:  # only the stages up to the highest one still undecided matter here
            top = max(i for i in range(count) if i not in fitted)
            k = next((i for i in range(top + 1) if _fits(result, g.estimate(i))), None)
            fitted.update(range(k, count) if k is not None else ())
    if not groups:
        return
    # A family not fitted fails at every judged micro-batch: first at the smallest (the first group).
    g = groups[0]
    for i, family in enumerate(families):
        if i not in fitted and family.saver == 0:
            v = verdict(g.estimate(i), result.gpu, exact=False, reserve=result.reserve)
            result.rejected.append(Rejected(family, g.micro_batch, v))
