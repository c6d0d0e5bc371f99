"""The vocabulary of ``time.comm.collectives``'s table: a collective's phase and what it overlaps (``Phase``,
``Overlap``), one row (``Row``), the busiest pipeline stage whose device the rows describe (``Critical``),
and the ranks' placement (tp innermost; [TP, CP, PP, DP] or, under Megatron and torchtitan, [TP, CP, DP,
PP]: ``order``, ``stride``)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from memplan.analytic.params import ParamCount
from memplan.config import Checkpointing, Impl, Parallel, Setup
from memplan.engine import Result
from memplan.strategies.pipeline_parallel import chunk_layers, stage, stage_layers, stage_params
from memplan.time.comm.fabric import Collective, Link, collective_seconds


class Phase(StrEnum):
    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"
    STEP = "step"
    """Once per optimizer step."""


class Overlap(StrEnum):
    """The compute a collective runs under (``none``: it waits, exposed)."""

    NONE = "none"
    FORWARD = "forward"
    """Every micro-batch's forward."""
    BACKWARD = "backward"
    """Every micro-batch's backward."""
    BACKWARD_THEN_FORWARD = "backward, and a forward after it"
    """A gradient reduce-scatter issued per layer in every backward (ZeRO 2): FSDP keeps one reduce-scatter
    buffer in flight, so the compute stream waits for it at the next layer's backward; it hides behind that
    backward and, where the schedule runs a forward chunk before the next backward (1F1B's steady state;
    the next micro-batch without a pipeline), behind that forward too (``predict.windows``)."""
    LAST_BACKWARD = "last backward"
    """The last micro-batch's backward (a once-per-step gradient reduction)."""
    FIRST_FORWARD = "first forward"
    """The next step's first forward (a once-per-step weight all-gather)."""
    RING_FIRST_FORWARD = "ring's first block, forward"
    """Context parallelism: every micro-batch's forward attention in each rank's first (local) block."""
    RING_FIRST_BACKWARD = "ring's first block, backward"
    RING_FORWARD = "ring's blocks, forward"
    """Context parallelism: every micro-batch's forward attention in all blocks but the last."""
    RING_BACKWARD = "ring's blocks, backward"
    UB_COLUMN_FORWARD = "column-parallel GEMMs, forward"
    """``--tp-comm-overlap`` (``time.tp_overlap``): every micro-batch's W_QKV and W_fc1 forward GEMMs."""
    UB_ROW_FORWARD = "row-parallel GEMMs, forward"
    """W_O and W_fc2 forward GEMMs (their outputs reduce-scattered chunk by chunk)."""
    UB_ROW_DGRAD = "row-parallel input-gradient GEMMs"
    """W_O and W_fc2 input-gradient GEMMs in backward (fed by the output gradients' all-gather)."""
    UB_COLUMN_RERUN = "column-parallel GEMMs, re-run"
    UB_ROW_RERUN = "row-parallel GEMMs, re-run"


@dataclass(frozen=True)
class Row:
    """One kind of collective: ``count`` calls per step of ``bytes`` each over ``group`` ranks."""

    dimension: str
    collective: Collective
    phase: Phase
    bytes: int
    count: int
    group: int
    link: Link
    overlap: Overlap
    what: str

    @property
    def call_s(self) -> float:
        """Seconds of one call (module docstring)."""
        return collective_seconds(self.collective, self.bytes, self.group, self.link)

    @property
    def time_s(self) -> float:
        return self.count * self.call_s

    def to_json(self) -> dict[str, Any]:
        return {
            "dimension": self.dimension,
            "collective": self.collective.value,
            "phase": self.phase.value,
            "bytes": self.bytes,
            "count": self.count,
            "group": self.group,
            "link": self.link.level,
            "time_s": self.time_s,
            "overlapped": self.overlap is not Overlap.NONE,
            "overlaps": self.overlap.value,
            "what": self.what,
        }


# ----------------------------------------------------------------------------------------------------
# The device the rows are for, and where its groups sit
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Critical:
    """The busiest pipeline stage (most layer FLOPs, the head's counted on the last): what one of its
    devices runs per micro-batch bounds the pipeline's pace."""

    result: Result
    index: int
    layers: int
    params: ParamCount
    """The stage's parameters on one tensor-parallel rank."""

    @property
    def setup(self) -> Setup:
        return self.result.setup

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.setup.parallel.pp - 1

    @property
    def rerun_layers(self) -> int:
        """Layers whose forward (and its collectives) re-runs in backward: full / every-k checkpointing
        and reversible layers re-run whole layers; selective only the attention core (no collective)."""
        s = self.setup.strategy
        whole = s.checkpointing >= Checkpointing.EVERY_K or s.reversible
        return self.layers if whole else 0


def critical_stage(r: Result) -> Critical:
    """The stage with the most forward FLOPs: its layers' share, plus the head on the last stage."""
    par, f = r.setup.parallel, r.flops
    counts = stage_layers(r.setup.model.num_layers, par)
    per_layer = (f.layer_linear + f.layer_attention) / r.setup.model.num_layers
    work = [n * per_layer + (f.lm_head if i == par.pp - 1 else 0) for i, n in enumerate(counts)]
    i = max(range(par.pp), key=lambda k: (work[k], k))
    st = stage(par, i, chunk_layers(r.setup.model.num_layers, par)[i], r.micro_batches)
    return Critical(r, i, counts[i], stage_params(r.pieces.params, st, r.setup.model.tied_embeddings, par.pp))


ORDER = ("tp", "cp", "pp", "dp")
"""The parallel dimensions, innermost first: a group's stride is the product of the degrees before it.
memplan's reference (``measure.distributed.nproc``'s (dp, pp, tp) mesh) and Llama 3 (Dubey et al. 2024
§3.3.2, "[TP, CP, PP, DP]") place the pipeline inside data parallelism."""
PP_OUTERMOST = ("tp", "cp", "dp", "pp")
"""Megatron-core's and torchtitan's placement, pp outermost: ``initialize_model_parallel(order=
"tp-cp-ep-dp-pp")`` (megatron/core/parallel_state.py's default; its expert parallelism the innermost of dp,
as memplan places it) and torchtitan's device mesh ``["pp", "dp_replicate", "dp_shard", "cp", "tp"]``
(torchtitan/distributed/parallel_dims.py; HSDP's shard group inside its replicas, as memplan places it)."""


def order(impl: Impl) -> tuple[str, ...]:
    """The placement of an implementation's ranks (``ORDER``, ``PP_OUTERMOST``)."""
    return PP_OUTERMOST if impl in (Impl.MEGATRON, Impl.TORCHTITAN) else ORDER


def stride_in(impl: Impl, par: Parallel, dp: int, dimension: str) -> int:
    """``dimension``'s stride under ``impl``'s placement of layout ``par`` over ``dp`` data-parallel ranks:
    the product of the degrees inside it."""
    degrees = {"tp": par.tp, "cp": par.cp, "pp": par.pp, "dp": dp}
    out = 1
    for name in order(impl):
        if name == dimension:
            return out
        out *= degrees[name]
    raise ValueError(f"dimension: {dimension!r} is not one of {list(ORDER)}")


def stride(setup: Setup, dimension: str) -> int:
    return stride_in(setup.impl.impl, setup.parallel, setup.strategy.dp, dimension)


def expert_groups(setup: Setup) -> tuple[tuple[int, int], tuple[int, int]]:
    """(stride, size) of the expert-parallel group and of the experts' data-parallel group. Expert
    parallelism takes its ep ranks from dp, innermost (dp's stride), its data-parallel group the dp/ep
    beyond them; under parallel folding (``Parallel.fold``: ``--etp`` below tp, cp 1) Megatron-core lays
    the experts out over the tp × dp ranks in its own order etp-ep-dp (``RankGenerator(tp=etp, ep=ep,
    dp=edp, pp=pp, order="tp-ep-dp-pp")``, parallel_state.py): etp consecutive ranks split an expert, ep
    groups of them (stride etp: consecutive ranks under ``--etp 1``), then tp/etp·dp/ep of those."""
    par, dp = setup.parallel, setup.strategy.dp
    if par.fold > 1:
        etp = par.expert_tp
        return (etp, par.ep), (etp * par.ep, par.fold * dp // par.ep)
    at = stride(setup, "dp")
    return (at, par.ep), (at * par.ep, dp // par.ep)


def rank_tokens(setup: Setup) -> int:
    """Tokens of one micro-batch on one context-parallel rank: b·s/cp."""
    return setup.training.micro_batch * setup.training.seq_len // setup.parallel.cp


def hidden_bytes(setup: Setup) -> int:
    """X = b·(s/cp)·h·e: one micro-batch's hidden states, the rank's whole sequence (s/cp with context
    parallelism)."""
    return rank_tokens(setup) * setup.model.hidden_size * setup.training.precision.activation_dtype.bytes


# ----------------------------------------------------------------------------------------------------
# One function per dimension: the rows of its collectives
# ----------------------------------------------------------------------------------------------------
