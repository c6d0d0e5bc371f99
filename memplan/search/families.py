"""The configurations of a method and saver level — (layout, checkpointing, attention) × ZeRO stage ×
micro-batch size — judged for memory, timed, and listed or rejected (``fit``'s module docstring).

The search is best-first. A micro-batch size of one (layout, checkpointing, attention) is a group: its
ZeRO stages' configurations. Every group enters a queue at its step-time lower bound and the queue is
worked lowest key first; a group is refined each time it comes out, cheapest first, and goes back at its
tighter key until it is listed:

1. its first bound (``bound``: one reference sequence's kernels at the layout's rates, no estimate);
2. the bound its ZeRO stages share (``bound.stages_bound``: the predicted step without its ZeRO-dependent
   terms, from one estimate without stage plans, ``engine.unplanned``);
3. the least of its stages' predicted step times (``timing``; a stage's estimate after the first is that
   one's with its own model states, ``restaged``: nothing else reads the ZeRO stage);
4. memory, stage by stage (``budget.fits``: the lower bounds, the requested peak, then one memoised
   replay at the usable memory), the lowest stage that fits and the faster higher stages listed as one
   row (``fastest_stage``); its time enters the cut-off (``bound.Cutoff``: the ``Space.keep`` fastest).

While nothing is listed (the cut-off open), a group's stages' model states come first
(``engine.states_floor``: a floor of ``budget.fits``' first test, the same at every micro-batch size, so
learnt once per triple): a stage whose states pass the usable memory is judged not to fit without an
estimate, at every size, and a group none of whose stages fit is not refined (``FitResult.states_only``).

The search stops when the lowest key is slower than the cut-off: every key is a lower bound of its group's
step times, so nothing left can be listed. It lists the same rows as evaluating everything, and it judges
memory only for groups with a stage predicted no slower than the final cut-off C* or than the cut-off when
it came out (a group whose key ≤ C* comes out before the search stops, since the kept rows' own keys are ≤
C*; work grows with how late the kept rows are found, and the first bound orders the queue).
``shortcuts=False`` skips steps 2 and 3 (every group that comes out is judged for memory: the reference the
tests and benchmarks/bench_fit.py compare with).

A family is rejected when no micro-batch size fits it (nor a lower ZeRO stage at the same size, which makes
it redundant); its reason is the verdict at the smallest micro-batch size. Rejection is judged for the
(layout, checkpointing, attention) one of whose groups has a stage predicted within C* — the families that
would have been among the listed rows had they fitted (when nothing fits, C* is open and every family is
judged) — over all its micro-batch sizes, in order, until every family is known to fit somewhere. Both
modes decide it from C* and the groups' predictions alone, so they reject the same families.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from dataclasses import dataclass, field

from memplan.config import Attention, Checkpointing, FineTune, Offload, Setup, ZeroStage
from memplan.engine import Result, estimate, floors, states_floor, unplanned
from memplan.presets import GpuPreset
from memplan.search.bound import Bound, Cutoff, stages_bound
from memplan.search.budget import fits, host_fits, verdict
from memplan.search.methods import SAVERS, valid
from memplan.search.mfu_bound import MfuBound
from memplan.search.results import Config, Family, FitResult, Rejected
from memplan.search.space import Layout, Space
from memplan.stage_plan import stage_states
from memplan.strategies import offload
from memplan.time.offload import reads_device
from memplan.time.predict import Unstaged, unstaged
from memplan.time.timing import Timing, assumed_seconds, peak_flops, timing


def micro_batches(global_batch: int, layout: Layout, space: Space) -> dict[int, int]:
    """The micro-batch sizes b ``space`` searches on ``layout``, each with its n micro-batches per step:
    those whose b·dp divides the global batch and, under the interleaved schedule, whose n is a multiple
    of pp (it runs micro-batches in groups of pp)."""
    out = {}
    for b in space.micro_batches:
        if global_batch % (b * layout.dp):
            continue
        n = global_batch // (b * layout.dp)
        if layout.parallel.vpp == 1 or n % layout.parallel.pp == 0:
            out[b] = n
    return out


def family_setup(base: Setup, family: Family, micro_batch: int, micro_batches: int) -> Setup:
    """``base`` with a family's strategy, layout and micro-batch (valid by construction: not
    re-validated)."""
    return base.replaced(
        parallel=family.layout.parallel,
        training=base.training.replaced(micro_batch=micro_batch, grad_accum=micro_batches),
        strategy=base.strategy.replaced(
            checkpointing=family.checkpointing,
            checkpoint_every=1,
            attention=family.attention,
            zero=family.zero,
            dp=family.layout.dp,
            hsdp=family.layout.hsdp,
            reversible=False,
        ),
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


def unplanned_at(r: Result, setup: Setup) -> Result:
    """``engine.unplanned(setup)`` for a ``setup`` that differs from ``r.setup`` in the ZeRO stage alone:
    ``r``'s pieces, FLOPs and parameter counts (none reads the ZeRO stage: ``restaged``), no stage plans.
    tests/plan/test_fit_restaged.py checks it equals ``unplanned(setup)``."""
    return dataclasses.replace(r, setup=setup, stages=())


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
    key: float = 0.0
    """Its first bound (``bound.Bound.seconds``, ``mfu_bound.MfuBound.seconds`` at an assumed MFU; 0
    without one): the key it enters the queue at."""
    step: int = 1
    """The refinement it is at (module docstring): 1 its first bound, 2 its stages' shared bound, 3 its
    stages' least step time, 4 judged for memory."""
    first_fit: int | None = None
    """The index of the lowest stage that fits (the stage count: none); None: not judged for the listing."""
    shared: Unstaged | None = None
    """``unstaged``, once made."""
    stages_bound: float | None = None
    """``shared_bound``, once made."""
    plain: Result | None = None
    """Stage 0's estimate without stage plans (``engine.unplanned``), once made (``first``)."""
    states: dict[int, int] = field(default_factory=dict)
    """Each stage's largest model states on a device (``engine.states_floor``: the same at every micro-batch
    size), once learnt: one dict shared by the triple's groups."""
    steps: dict[tuple[object, ...], tuple[float, float]] = field(default_factory=dict)
    """The optimizer step's and clipping's seconds (``predict.Unstaged.steps``: the same at every micro-batch
    size): one dict shared by the triple's groups."""
    setups: dict[int, Setup] = field(default_factory=dict)
    made: dict[int, Result] = field(default_factory=dict)
    timed: dict[int, Timing] = field(default_factory=dict)
    bounded: bool = False
    """Stage 0 bounded (``slower_than``) from ``engine.unplanned``: counted as estimated, as it was."""

    def setup(self, i: int) -> Setup:
        """Stage ``i``'s setup (``family_setup``), made once."""
        if i not in self.setups:
            family = self.families[i]
            self.setups[i] = family_setup(self.base, family, self.micro_batch, self.micro_batches)
        return self.setups[i]

    def estimate(self, i: int) -> Result:
        """Stage ``i``'s estimate: another stage's with its model states (``restaged``) once one is made."""
        if i not in self.made:
            setup = self.setup(i)
            other = next(iter(self.made.values()), None)
            self.made[i] = estimate(setup) if other is None else restaged(other, setup)
        return self.made[i]

    def learn_states(self, memory: int) -> None:
        """The stages' model states (``states``: ``engine.states_floor``) where no other micro-batch size
        has told them, lowest ZeRO stage first, up to the first within ``memory`` (the higher stages shard
        more; an unlearnt stage is simply not ruled out)."""
        shared = None  # ``engine.floors``: the pieces and stages' parameters, the same at every ZeRO stage
        for i in range(len(self.families)):
            if i not in self.states:
                shared = shared or floors(self.setup(i))
                self.states[i] = states_floor(self.setup(i), shared)
            if self.states[i] <= memory:
                return

    def too_big(self, i: int, memory: int) -> bool:
        """Stage ``i``'s model states, once learnt, pass ``memory``: it fits at no micro-batch size
        (``engine.states_floor``), judged without an estimate."""
        return self.states.get(i, 0) > memory

    def first(self) -> Result:
        """The first estimate made, else stage 0's without stage plans (``plain``: what the stages share
        reads none)."""
        first = self.made.get(0) or next(iter(self.made.values()), None)
        if first is None:
            if self.plain is None:
                self.plain, self.bounded = unplanned(self.setup(0)), True
            first = self.plain
        return first

    def unstaged(self) -> Unstaged:
        """What the stages' predictions share (``predict.unstaged``), from ``first``."""
        if self.shared is None:
            first = self.first()
            peak = peak_flops(self.gpu, first.setup.training.precision)
            self.shared = unstaged(first, self.gpu, peak, self.steps)
        return self.shared

    def time(self, i: int) -> Timing:
        """Stage ``i``'s predicted step: from its estimate once made, else from one without stage plans
        (``unplanned``: nothing the prediction reads but the parameter and activation offloads' copies
        reads them, ``time.offload.reads_device``; under those the estimate)."""
        if i not in self.timed:
            shared = self.unstaged()
            p = self.made.get(i)
            if p is None:
                setup = self.setup(i)
                bare = not reads_device(setup.offload)
                p = unplanned_at(shared.critical.result, setup) if bare else self.estimate(i)
            self.timed[i] = timing(p, self.gpu, mfu=self.mfu, shared=shared)
        return self.timed[i]

    def evaluated(self) -> int:
        """Its configurations estimated, with stage plans or without (``engine.unplanned``)."""
        return len(self.made.keys() | self.timed.keys() | ({0} if self.bounded else set()))

    def slower_than(self, seconds: float) -> bool:
        """Every stage predicted slower than ``seconds``: first their shared bound (``bound.stages_bound``),
        then stage by stage until one is not."""
        if not self.families:
            return False
        if self.key > seconds:
            return True
        if self.shared_bound() > seconds:
            return True
        if self.mfu is not None:
            return False  # ``shared_bound`` is every stage's step
        return all(self.time(i).step_time_s > seconds for i in range(len(self.families)))

    def shared_bound(self) -> float:
        """``bound.stages_bound`` of its stages (it reads no stage plan: the critical stage, its kernels
        and the tp/cp/pp/ep rows come from the setup, the pieces, the FLOPs and the parameters); at an
        assumed MFU every stage's step itself (``timing.assumed_seconds`` reads no ZeRO stage)."""
        if self.stages_bound is None:
            if self.mfu is not None:
                first = self.first()
                peak = peak_flops(self.gpu, first.setup.training.precision)
                self.stages_bound = assumed_seconds(first, peak, self.mfu)
            else:
                shared = self.unstaged()
                self.stages_bound = stages_bound(shared.critical.result, self.gpu, shared)
        return self.stages_bound

    def refine(self, key: float) -> float | None:
        """Its next, tighter key (module docstring, steps 2 and 3; never below ``key``), or None when what
        is left is to judge its memory (step 4)."""
        self.step += 1
        if self.step == 2:
            return max(key, self.shared_bound())
        if self.step == 3 and self.mfu is None:  # at an assumed MFU step 2's key is every stage's step
            return max(key, min(self.time(i).step_time_s for i in range(len(self.families))))
        return None

    def listable(self, cutoff: float) -> bool:
        """Could one of its stages be listed beside rows as fast as ``cutoff`` (the final cut-off): at an
        open cut-off (nothing pruned by time then), or some stage predicted (or at an assumed MFU) within
        it."""
        return cutoff == math.inf or not self.slower_than(cutoff)


@dataclass
class Triple:
    """One (layout, checkpointing, attention) at a method and saver level: its ZeRO-stage families (those
    memplan models, ``methods.valid``) and one group per micro-batch size, smallest first."""

    layout: Layout
    checkpointing: Checkpointing
    attention: Attention
    families: list[Family]
    groups: list[_Group]


def triple(
    result: FitResult,
    base: Setup,
    layout: Layout,
    ckpt: Checkpointing,
    attention: Attention,
    space: Space,
    mfu: float | None,
    ft: FineTune,
    level: int,
    steps: dict[tuple[object, ...], tuple[float, float]],
) -> Triple:
    """The families and groups of one (layout, checkpointing, attention), counted as searched. ``steps``:
    the optimizer step's and clipping's seconds (``predict.Unstaged.steps``) shared with the layout's other
    checkpointings and attentions, which read neither."""
    dp = layout.dp
    # Over one data-parallel rank every ZeRO stage shards nothing: the same memory and time as stage 0
    # (parameter offload needs ZeRO-3's sharding: its level keeps stage 3 only).
    stages = sorted(space.zero) if dp > 1 else sorted(space.zero)[:1]
    if layout.hsdp:  # hybrid sharding shards inside its groups: ZeRO 1–3 only
        stages = [z for z in stages if z is not ZeroStage.NONE]
    if Offload.PARAMS in SAVERS[level].offload:
        stages = [ZeroStage.PARAMETERS] if ZeroStage.PARAMETERS in space.zero else []
    every = [Family(ckpt, attention, z, layout, ft, level) for z in stages]
    families = [f for f, setup in zip(every, _stage_setups(base, every), strict=True) if valid(setup)]
    states: dict[int, int] = {}  # shared: a stage's model states do not depend on the micro-batch
    groups = [
        _Group(b, n, base, families, result.gpu, mfu, states=states, steps=steps)
        for b, n in micro_batches(result.global_batch, layout, space).items()
    ]
    result.searched += len(families) * len(groups)
    return Triple(layout, ckpt, attention, families, groups)


def _stage_setups(base: Setup, families: list[Family]) -> list[Setup]:
    """``family_setup(base, f, 1, 1)`` of each of ``families`` — one (layout, checkpointing, attention) at
    several ZeRO stages — made once and copied with each stage."""
    if not families:
        return []
    first = family_setup(base, families[0], 1, 1)
    return [first] + [first.replaced(strategy=first.strategy.replaced(zero=f.zero)) for f in families[1:]]


def search(
    result: FitResult,
    triples: list[Triple],
    bound: Bound | MfuBound | None,
    cutoff: Cutoff,
    shortcuts: bool = True,
) -> None:
    """Best-first over the groups of ``triples`` (module docstring): list what fits among the fastest,
    then reject, in ``triples``' order, the families of those that could have been listed."""
    order = itertools.count()
    queue: list[tuple[float, int, _Group]] = []
    for t in triples:
        if not t.families:
            continue
        for g in t.groups:
            if bound is not None:
                par = t.layout.parallel
                g.key = bound.seconds(g.base, t.checkpointing, t.attention, par, g.micro_batches)
            queue.append((g.key, next(order), g))
    heapq.heapify(queue)
    while queue and queue[0][0] <= cutoff.seconds:
        key, _, g = heapq.heappop(queue)
        if shortcuts and g.step == 1 and cutoff.seconds == math.inf:
            g.learn_states(
                result.usable
            )  # nothing listed yet: a group none of whose stages' states fit needs no refining
        if all(g.too_big(i, result.usable) for i in range(len(g.families))):
            g.step, g.first_fit = 4, len(g.families)  # no stage fits (``states_floor``): nothing to refine
            continue
        better = g.refine(key) if shortcuts else None
        if better is None:
            _judge(result, g, cutoff)
        else:
            heapq.heappush(queue, (better, next(order), g))
    final = cutoff.seconds
    for t in triples:
        if any(g.listable(final) for g in t.groups):
            _reject(result, t)
    usable = result.usable
    for t in triples:
        for g in t.groups:
            result.pruned += len(t.families) if g.first_fit is None else 0
            result.evaluated += g.evaluated()
            if g.first_fit is not None:  # judged: the stages ruled out by their states without an estimate
                result.states_only += sum(
                    1 for i in range(g.first_fit) if i not in g.made and g.too_big(i, usable)
                )


def _fits(result: FitResult, p: Result) -> bool:
    ok = fits(p, result.usable, result.gpu, result.expandable) and host_fits(p, result.gpu)
    result.peaks += any("peak" in vars(sp) for sp in p.stages)  # computed (cached) or not
    return ok


def _judge(result: FitResult, group: _Group, cutoff: Cutoff) -> None:
    """The lowest stage of ``group`` that fits and the fastest of it and the higher ones, listed."""
    group.step = 4
    for i in range(len(group.families)):
        if not group.too_big(i, result.usable) and _fits(result, group.estimate(i)):
            group.first_fit = i
            best = fastest_stage(result, group, i)
            result.fitting.append(best)
            cutoff.add(best.timing.step_time_s)
            return
    group.first_fit = len(group.families)


def fastest_stage(result: FitResult, group: _Group, first: int) -> Config:
    """The fastest of stage ``first`` of ``group`` (the lowest ZeRO stage that fits) and the higher stages
    of the same configuration, ties to the lowest stage. A higher stage can be faster: each rank steps the
    optimizer on its 1/dp of the parameters (``time.compute.optimizer_step_bytes``), while its extra
    communication (ZeRO-3's parameter all-gathers) may hide behind compute."""
    gpu, usable, families = result.gpu, result.usable, group.families
    reserve, expandable = result.reserve, result.expandable
    best = Config(families[first], group.estimate(first), group.time(first), gpu, reserve, expandable)
    for k in range(first + 1, len(families)):
        q = group.estimate(k)
        if not (fits(q, usable) and host_fits(q, gpu)):
            continue
        t = group.time(k)
        # judged on the allocator's reserved peak (a replay) only when it would be listed: faster
        if t.step_time_s < best.timing.step_time_s and fits(q, usable, gpu, expandable):
            best = Config(families[k], q, t, gpu, reserve, expandable)
    return best


def _reject(result: FitResult, t: Triple) -> None:
    """The families of ``t`` no micro-batch size fits, each with the verdict of the smallest (where it
    fails, as at every one); the groups not judged for the listing are judged, in order, only while that
    is undecided."""
    families, groups = t.families, t.groups
    count = len(families)
    fitted = {i for g in groups if g.first_fit is not None for i in range(g.first_fit, count)}
    for g in groups:
        if len(fitted) == count:
            return
        if g.first_fit is None:  # only the stages up to the highest one still undecided matter here
            top = max(i for i in range(count) if i not in fitted)
            k = next(
                (
                    i
                    for i in range(top + 1)
                    if not g.too_big(i, result.usable) and _fits(result, g.estimate(i))
                ),
                None,
            )
            fitted.update(range(k, count) if k is not None else ())
    if not groups:
        return
    # A family not fitted fails at every micro-batch size: first at the smallest (the first group).
    g = groups[0]
    for i, family in enumerate(families):
        if i not in fitted and family.saver == 0:
            v = verdict(
                g.estimate(i), result.gpu, exact=False, reserve=result.reserve, expandable=result.expandable
            )
            result.rejected.append(Rejected(family, g.micro_batch, v))
