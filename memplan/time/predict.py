"""The predicted step time: compute per kernel class, plus the communication not hidden, plus the bubble.

On one device of the busiest pipeline stage (``comm.rows.critical_stage``), n micro-batches per step, p stages
and m virtual stages per rank:

    busy   = n · (forward + backward) + exposed(tp, cp, ep) + exposed host copies of every micro-batch
    bubble = busy · (p − 1)/(m·n)                              1F1B (Narayanan et al. 2021 §2.2)
    step   = busy + bubble + exposed(pp) + exposed(dp) + gradient clipping + optimizer + host step
             + exposed once-per-step copies + data parallelism's copy kernels

forward, backward: ``compute.kernel_times`` (QLoRA's dequantisation included); optimizer:
``compute.optimizer_seconds`` on the GPU, or under optimizer offload the CPU's step and the host link's
copies (``offload``); gradient clipping: ``compute.clip_seconds``; FSDP2's copy-outs and copy-ins and DDP's
bucket copies on the compute stream: ``dp_copies``.
``Prediction.parts`` lists every term; they add up to the step.

A collective's exposure (``comm.Overlap``): a row that overlaps nothing costs its whole time; the rows of
one dimension that overlap the same compute cost what they take beyond it,
max(0, Σ their time − that compute) — every micro-batch's forward or backward, the last backward (a
once-per-step gradient reduction) or the first forward (the weight all-gather after the step). The
collectives of tensor and expert parallelism stretch every micro-batch of the stage (and so the bubble);
pipeline sends and data-parallel reductions are added once.

MFU = model FLOPs / (step · devices · peak), as for any other step time (``timing``).

A collective whose ring runs over NVLink slows the compute it overlaps: ``efficiency.OVERLAP_SLOWDOWN``
(18.9 %, a published measurement) of the seconds they run together, min(Σ its rows' time, that compute),
joins its dimension's exposed time. That is a group inside a node, and a group that leaves the node with
several of its ranks on each (``Link.per_node`` > 1: FSDP over 8-GPU nodes): its ring crosses each node
over NVLink at NVLink's rate (``fabric.ring_bandwidth``: 301.5 GB/s for 128 H100s, bound by those hops),
the same kernels moving the same bytes through SMs and HBM as the measured single-node case.

Known limitations (NB): different dimensions' overlapped collectives are assumed to share nothing (they
run on different links); a group with one rank per node (a dp group beside tp 8) slows nothing it
overlaps (its kernels feed one NIC at ≈ 42 GB/s, a seventh of the NVLink ring's traffic; no measurement in
view); the bubble is the balanced pipeline's.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field
from functools import cached_property

from pydantic import BaseModel, ConfigDict

from memplan.config import unvalidated
from memplan.engine import Result
from memplan.presets import GpuPreset, Topology
from memplan.strategies.context_parallel import block_shares
from memplan.strategies.pipeline_parallel import warmup_forwards
from memplan.time import dp_copies, efficiency, fp8, offload
from memplan.time.calibration import calibrated_topology
from memplan.time.comm.collectives import ROWS, communication
from memplan.time.comm.dp import dp_rows
from memplan.time.comm.fabric import Link
from memplan.time.comm.rows import Critical, Overlap, Row, critical_stage
from memplan.time.compute import (
    KernelTime,
    clip_seconds,
    kernel_times,
    optimizer_seconds,
    userbuffer_windows,
)

IN_STAGE = frozenset({"tp", "cp", "ep", "fp8"})
"""Dimensions whose exposed collectives are part of every micro-batch's work (context parallelism's
ring exchange joins them; so does delayed scaling's amax all-reduce after each forward and backward)."""


class Prediction(BaseModel):
    """The predicted step on one device of the busiest stage; seconds per step."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)
    stage: int
    """The busiest pipeline stage (0 without a pipeline)."""
    stage_layers: int
    matmul_s: float
    matmul_wave_efficiency: float
    """The matrix products' seconds at full waves / ``matmul_s`` (``wave_efficiency``): what wave and tile
    quantization of their shapes, and the memory-bound ones' bytes, leave of the best shape's speed
    (``gemm``); ``--fp8``'s layers measured against the FP8 peak they run at (before, against the bf16
    peak: above 1)."""
    matmul_fraction: float
    """The best shape's fraction of the dense 16-bit peak the GEMMs run at (``efficiency.matmul``:
    ``MATMUL`` capped at the GPU's own best measured matmul, or what ``memplan calibrate`` measured)."""
    fp8_matmul_fraction: float | None
    """``--fp8``'s layers: the best shape's fraction of the FP8 peak (``MATMUL_FP8``); None without it."""
    attention_s: float
    elementwise_s: float
    compute_s: float
    """n · (forward + backward), the three classes together."""
    exposed_s: dict[str, float]
    """Communication not hidden behind compute, per dimension (every dimension with a collective)."""
    bubble_s: float
    optimizer_s: float
    """The optimizer step on the GPU, once per step (memory-bound; 0 when offloaded)."""
    clip_s: float = 0.0
    """Gradient-norm clipping before the step (``compute.clip_seconds``; 0 without it)."""
    dequant_s: float = 0.0
    """QLoRA's dequantisation of the frozen 4-bit weights, n · (forward + backward)."""
    launch_s: float = 0.0
    """The per-launch gaps of the eager element-wise kernels, n · (forward + backward)."""
    offload_micro_batch_s: float = 0.0
    """Host-link copies of every micro-batch that no compute hides (``offload``), n of them."""
    offload_step_s: float = 0.0
    """Host-link copies once per step that no compute hides (the updated weights)."""
    host_optimizer_s: float = 0.0
    """The CPU optimizer step under optimizer offload."""
    dp_copies_s: float = 0.0
    """FSDP2's all-gather copy-outs and reduce-scatter copy-ins, DDP's bucket copies, on the compute stream
    (``dp_copies``)."""
    step_time_s: float
    mfu: float
    communication: tuple[Row, ...]

    def parts(self) -> dict[str, float]:
        """Every term of the step, in order; they add up to ``step_time_s``."""
        out = {
            "matmul": self.matmul_s,
            "attention": self.attention_s,
            "element-wise": self.elementwise_s,
            "dequantize": self.dequant_s,
            "launch gaps": self.launch_s,
        }
        out.update({f"{k} exposed": v for k, v in self.exposed_s.items()})
        out["offload copies"] = self.offload_micro_batch_s + self.offload_step_s
        out["bubble"] = self.bubble_s
        out["gradient clipping"] = self.clip_s
        out["optimizer"] = self.optimizer_s
        out["host optimizer"] = self.host_optimizer_s
        out["dp copies"] = self.dp_copies_s
        return out

    def to_json(self) -> dict[str, object]:
        out = self.model_dump(exclude={"communication"})
        out["parts"] = self.parts()
        out["communication"] = [r.to_json() for r in self.communication]
        return out


def followed_backwards(c: Critical, n: int) -> int:
    """Chunk-backwards of the stage after which the schedule runs a forward before the next backward: the
    steady state's one-forward-one-backward pairs but the last (``pipeline_parallel.warmup_forwards``);
    without a pipeline every micro-batch's backward but the last (the next micro-batch's forward)."""
    par = c.setup.parallel
    return max(0, par.vpp * n - warmup_forwards(par, c.index, n) - 1)


def reduce_window(c: Critical, forward: KernelTime, backward: KernelTime, n: int, rows: list[Row]) -> float:
    """What ``Overlap.BACKWARD_THEN_FORWARD``'s reduce-scatters hide behind: every backward, plus each
    forward chunk the schedule runs between two backwards (``followed_backwards``) — but FSDP keeps one
    reduce-scatter buffer in flight and the compute stream waits for it at the next layer's copy-in
    (torch's ``set_reduce_scatter_max_input_buffers``: "FSDP keeps 1 such buffer in flight by default, so
    the compute stream must wait on the previous reduce-scatter before the next copy-in"), so a forward
    hides at most one layer's reduce-scatter: Σ their seconds / (n · the stage's layers)."""
    total = sum(r.time_s for r in rows if r.overlap is Overlap.BACKWARD_THEN_FORWARD)
    if not total:
        return 0.0
    chunk_forward = forward.total_s / c.setup.parallel.vpp
    one_layer = total / (n * max(1, c.layers))
    return n * backward.total_s + followed_backwards(c, n) * min(chunk_forward, one_layer)


def windows(forward: KernelTime, backward: KernelTime, n: int, cp: int = 1) -> dict[Overlap, float]:
    """Seconds of the compute each kind of overlap hides behind (the ring's: the attention of its blocks,
    ``context_parallel.block_shares``; ``BACKWARD_THEN_FORWARD``'s every backward, ``reduce_window`` adds
    the forwards between them)."""
    first, blocks = block_shares(cp)
    return {
        Overlap.NONE: 0.0,
        Overlap.FORWARD: n * forward.total_s,
        Overlap.BACKWARD: n * backward.total_s,
        Overlap.BACKWARD_THEN_FORWARD: n * backward.total_s,
        Overlap.LAST_BACKWARD: backward.total_s,
        Overlap.FIRST_FORWARD: forward.total_s,
        Overlap.RING_FIRST_FORWARD: n * forward.attention_s * first,
        Overlap.RING_FIRST_BACKWARD: n * backward.attention_s * first,
        Overlap.RING_FORWARD: n * forward.attention_s * blocks,
        Overlap.RING_BACKWARD: n * backward.attention_s * blocks,
    }


def slows_compute(link: Link) -> bool:
    """Whether a collective on ``link`` slows the compute it overlaps (module docstring): its ring runs over
    NVLink — inside a node, or across nodes with more than one of its ranks on each."""
    return link.level == "intra-node" or link.per_node > 1


def exposed(rows: list[Row], hide: dict[Overlap, float]) -> dict[str, float]:
    """Per dimension: the time of its rows that no compute hides (module docstring), plus the slowdown of
    the compute that hides the ones whose ring runs over NVLink (``slows_compute``): ``OVERLAP_SLOWDOWN`` ×
    the seconds they overlap, min(Σ their time, that compute)."""
    per: dict[tuple[str, Overlap], float] = defaultdict(float)
    intra: dict[tuple[str, Overlap], float] = defaultdict(float)
    for r in rows:
        per[(r.dimension, r.overlap)] += r.time_s
        if slows_compute(r.link):
            intra[(r.dimension, r.overlap)] += r.time_s
    out: dict[str, float] = {r.dimension: 0.0 for r in rows}
    for (dimension, overlap), seconds in per.items():
        window = hide[overlap]
        slowed = efficiency.OVERLAP_SLOWDOWN * min(intra[(dimension, overlap)], window)
        out[dimension] += max(0.0, seconds - window) + slowed
    return out


def wave_efficiency(forward: KernelTime, backward: KernelTime) -> float:
    """The matrix products' seconds at full waves over their seconds (1 without any): each at its class's
    rate, so ``--fp8``'s layers are measured against the FP8 peak they run at, not the bf16 one."""
    seconds = forward.matmul_s + backward.matmul_s
    return (forward.matmul_full_s + backward.matmul_full_s) / seconds if seconds else 1.0


_DP = ROWS.index(dp_rows)


@dataclass(frozen=True)
class Unstaged:
    """What the prediction of a plan shares with every plan that differs from it in the ZeRO stage alone
    (``search.bound.stages_bound``'s premise, checked there): the busiest stage, its kernels and the rows
    of every dimension but data parallelism's, in ``ROWS``' order around dp's."""

    critical: Critical
    forward: KernelTime
    backward: KernelTime
    before_dp: tuple[Row, ...]
    after_dp: tuple[Row, ...]
    userbuffers: dict[Overlap, float] = field(default_factory=dict)
    """``compute.userbuffer_windows`` of its plan (``--tp-comm-overlap``; {} without): what ZeRO does not
    change."""
    steps: dict[tuple[object, ...], tuple[float, float]] | None = field(default=None, compare=False)
    """``step_seconds``' memo, or None: the caller may share one dict between the ``Unstaged`` of plans that
    differ in the ZeRO stage, the micro-batch size and the micro-batch count alone (``search.families``:
    one layout × checkpointing × attention)."""

    def step_seconds(self, c: Critical, gpu: GpuPreset) -> tuple[float, float]:
        """``compute.optimizer_seconds`` and ``compute.clip_seconds`` of ``c`` (a plan of such a family),
        memoised in ``steps`` on the ZeRO stage and the busiest stage (its index and layers; its
        parameters follow from them in one layout). Neither reads the micro-batch size or count: the
        optimizer and clipping kernels run once per step over the parameters the device owns, by the
        implementation, precision, optimizer, fine-tuning method, offload, dp and ZeRO shards
        (``compute.optimizer_step_bytes``, ``optimizer.launch_kernels``, ``optimizer.clip_ops``);
        tests/plan/test_fit_memos.py checks the memo against both."""
        if self.steps is None:
            return optimizer_seconds(c, gpu), clip_seconds(c, gpu)
        key = (c.setup.strategy.zero, c.index, c.layers)
        found = self.steps.get(key)
        if found is None:
            found = self.steps[key] = (optimizer_seconds(c, gpu), clip_seconds(c, gpu))
        return found

    def rows(self, c: Critical, topo: Topology) -> list[Row]:
        """Every row of ``c`` (a plan of the same family at any ZeRO stage): these and its dp rows."""
        return [*self.before_dp, *dp_rows(c, topo), *self.after_dp]

    @cached_property
    def windows(self) -> dict[Overlap, float]:
        """``windows`` of its kernels over its plan's n micro-batches (every stage's: the same n)."""
        c = self.critical
        return windows(self.forward, self.backward, c.result.micro_batches, c.setup.parallel.cp) | (
            self.userbuffers
        )

    @cached_property
    def others_exposed(self) -> dict[str, float]:
        """``exposed`` of every row but dp's in ``windows``: the same at every ZeRO stage (only dp's
        reduce-scatters hide behind ``Overlap.BACKWARD_THEN_FORWARD``, the one window a stage's rows
        change, ``reduce_window``)."""
        return exposed([*self.before_dp, *self.after_dp], self.windows)

    def exposed(self, dp: list[Row], hide: dict[Overlap, float]) -> dict[str, float]:
        """``exposed([*before_dp, *dp, *after_dp], hide)`` for ``hide`` that differs from ``windows`` in
        ``Overlap.BACKWARD_THEN_FORWARD`` alone: ``others_exposed`` with dp's rows' own, the same numbers in
        the same order (each dimension's sum is made in one part; where dp's rows share a dimension with
        the others, computed whole)."""
        others, own = self.others_exposed, exposed(dp, hide)
        if others.keys() & own.keys():
            return exposed([*self.before_dp, *dp, *self.after_dp], hide)
        order = [*self.before_dp, *dp, *self.after_dp]
        out: dict[str, float] = {}
        for r in order:
            if r.dimension not in out:
                out[r.dimension] = own[r.dimension] if r.dimension in own else others[r.dimension]
        return out


def unstaged(
    p: Result, gpu: GpuPreset, peak: float, steps: dict[tuple[object, ...], tuple[float, float]] | None = None
) -> Unstaged:
    """``Unstaged`` of plan ``p`` on ``gpu`` at ``peak`` FLOP/s per device (``steps``: its memo of the
    optimizer step's and clipping's seconds, ``Unstaged.steps``)."""
    c, topo = critical_stage(p), calibrated_topology(gpu)
    forward, backward = kernel_times(c, gpu, peak)
    before = tuple(r for rows in ROWS[:_DP] for r in rows(c, topo))
    after = tuple(r for rows in ROWS[_DP + 1 :] for r in rows(c, topo))
    return Unstaged(c, forward, backward, before, after, userbuffer_windows(c, gpu, peak), steps)


def predict(p: Result, gpu: GpuPreset, peak: float, shared: Unstaged | None = None) -> Prediction:
    """The predicted step of plan ``p`` on ``gpu`` at ``peak`` FLOP/s per device (module docstring).
    ``shared``: ``unstaged`` of a plan that differs from ``p`` in the ZeRO stage alone (``fit``'s stages of
    one configuration); the same prediction, without recomputing what no stage changes."""
    n, par = p.micro_batches, p.parallel
    if shared is None:
        c, rows = communication(p, calibrated_topology(gpu))
        forward, backward = kernel_times(c, gpu, peak)
        hide = windows(forward, backward, n, par.cp) | userbuffer_windows(c, gpu, peak)
        hide[Overlap.BACKWARD_THEN_FORWARD] = reduce_window(c, forward, backward, n, rows)
        hidden = exposed(rows, hide)
    else:
        c = dataclasses.replace(shared.critical, result=p)
        dp = dp_rows(c, calibrated_topology(gpu))
        rows = [*shared.before_dp, *dp, *shared.after_dp]
        forward, backward = shared.forward, shared.backward
        hide = dict(shared.windows)
        hide[Overlap.BACKWARD_THEN_FORWARD] = reduce_window(c, forward, backward, n, rows)
        hidden = shared.exposed(dp, hide)
    copies_stage, copies_step = offload.exposed_transfers(offload.transfers(c, p), hide, gpu)
    in_stage = sum(v for k, v in hidden.items() if k in IN_STAGE)
    compute = n * (forward.total_s + backward.total_s)
    busy = compute + in_stage + copies_stage
    bubble = busy * (par.pp - 1) / (par.vpp * n)
    if shared is None:
        optimizer, clip = optimizer_seconds(c, gpu), clip_seconds(c, gpu)
    else:
        optimizer, clip = shared.step_seconds(c, gpu)
    host = offload.host_optimizer_seconds(c, gpu)
    outside = sum(v for k, v in hidden.items() if k not in IN_STAGE)
    transposed = dp_copies.fp8_transposed(c.setup, c.layers, p.pieces.setup.model)
    fsdp = dp_copies.copy_seconds(c.setup, rows, gpu, transposed)
    step = busy + bubble + outside + clip + optimizer + host + copies_step + fsdp
    model = p.flops.model * n * p.setup.strategy.dp
    # unvalidated (``fit`` makes thousands): every field typed as validation would make it, in declaration
    # order — the seconds as floats (validation turns an int into one), the rows a tuple
    # (tests/test_config_replaced.py)
    return unvalidated(
        Prediction,
        stage=c.index,
        stage_layers=c.layers,
        matmul_s=float(n * (forward.matmul_s + backward.matmul_s)),
        matmul_wave_efficiency=float(wave_efficiency(forward, backward)),
        matmul_fraction=float(efficiency.matmul(gpu)),
        fp8_matmul_fraction=float(efficiency.MATMUL_FP8) if fp8.enabled(p.setup) else None,
        attention_s=float(n * (forward.attention_s + backward.attention_s)),
        elementwise_s=float(n * (forward.elementwise_s + backward.elementwise_s)),
        compute_s=float(compute),
        exposed_s={k: float(v) for k, v in hidden.items()},
        bubble_s=float(bubble),
        optimizer_s=float(optimizer),
        clip_s=float(clip),
        dequant_s=float(n * (forward.dequant_s + backward.dequant_s)),
        launch_s=float(n * (forward.launch_s + backward.launch_s)),
        offload_micro_batch_s=float(copies_stage),
        offload_step_s=float(copies_step),
        host_optimizer_s=float(host),
        dp_copies_s=float(fsdp),
        step_time_s=float(step),
        mfu=float(model / (step * p.devices * peak)),
        communication=tuple(rows),
    )
