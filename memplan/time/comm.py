"""Communication of one training step, per parallel dimension, placed on the GPU's topology.

Each row is one kind of collective a device of the busiest pipeline stage (``Critical``) runs: its
dimension, the collective, the phase, the bytes of ONE call, the calls per step, the group it runs over and
the link that group sits on, and which compute it overlaps with (``Overlap``).

Bytes of one call, NCCL's convention: an all-reduce's buffer, an all-gather's output, a reduce-scatter's
input, an all-to-all's send buffer, a point-to-point's message. X = b·s·h·e is one micro-batch's hidden
states on one rank (e the activation bytes); P a rank's parameters on the stage; w, g the bytes of a weight
and a gradient element.

Time of one call and the link a group runs on: ``fabric`` (ring and tree, a group's NICs, latency per
step).

Placement: ranks are numbered with tp innermost, then cp, pp and dp outward (Llama 3, Dubey et al. 2024
§3.3.2: "[TP, CP, PP, DP]"); a group's ranks on one node follow from the strides (``per_node``). Expert
parallelism takes its ranks from dp (stride tp·cp·pp); HSDP's shard group is dp's innermost R ranks, its
replicas R·tp·cp·pp apart.

Per dimension (Megatron-LM; Shoeybi et al. 2019 §3, Korthikanti et al. 2022 §4.2.2, Narayanan et al. 2021):
- tp without sp: per layer two all-reduces of X in forward (after the attention and MLP row-parallel
  linears; the embedding adds one), two in backward (the column-parallel linears' input gradient, and the
  head's), overlapped with the weight-gradient GEMM (Megatron's async all-reduce); a re-run layer repeats
  its forward ones. The vocabulary-parallel cross entropy all-reduces three [b, s] fp32 tensors (max,
  sum of exponentials, target logit).
- tp with sp: each all-reduce becomes an all-gather and a reduce-scatter of X (same bytes on the wire);
  forward 2L+1 of each (the embedding reduce-scatters, the head all-gathers); backward the transposes
  (an all-gather for each forward reduce-scatter, exposed; a reduce-scatter for each forward all-gather,
  overlapped with the weight gradient) plus the re-gather of each column-parallel linear's saved sharded
  input for its weight gradient (overlapped with the input-gradient GEMM).
- pp: the stage sends its output forward and its input's gradient backward, one message per micro-batch
  and model chunk (X, or X/t with sp); not overlapped. The bubble is time, not bytes (``timing``).
- dp: gradients reduce in ``--reduce-dtype`` (FSDP2's ``reduce_dtype``), else their own dtype (fp32 under
  ``--impl torchtitan``'s FSDP2: its ``mixed_precision_reduce`` default). ZeRO 0
  all-reduces the gradients once per step (overlapped with the last micro-batch's backward,
  bucketed as DDP does); ZeRO 1 reduce-scatters them once and all-gathers the updated weights once (with the
  next forward, Megatron's overlap_param_gather); ZeRO 2 reduce-scatters every micro-batch's gradients
  (with its backward, and with a forward the schedule runs before the next backward: FSDP's one buffer in
  flight, ``Overlap.BACKWARD_THEN_FORWARD``); ZeRO 3 also all-gathers the weights in every forward and
  again in every backward (FSDP's prefetch, overlapped). torchtitan's FSDP2 follows its reshard policy
  (``_titan_fsdp2_rows``): without pp the [norm, lm_head] unit, kept gathered after forward, is not
  gathered again in backward, and ZeRO-2 gathers in every forward (each unit resharded after backward);
  on a pipeline stage the weights are gathered once per step and the gradients, accumulated unsharded,
  reduce-scattered once after the last backward, exposed (torch's ``PipelineStage``). Routed experts are
  reduced over their own dp/ep group. HSDP (``--hsdp R``): all of this inside groups of R (× cp), then
  each gradient reduce-scatter's shard all-reduced across the dp/R groups (FSDP2's hybrid sharding).
- ep: per MoE layer an all-to-all dispatch and combine of the routed tokens (slots × h × e) in forward,
  two in backward, two more in a re-run; not overlapped.

- fp8 (Transformer Engine's delayed scaling): per micro-batch and model chunk an all-reduce of the amax
  buffer after the forward and after the backward, over tp × dp × cp; exposed (``fp8_rows``).
- cp: per attention layer torch's ring all-gathers K/V in forward (again in backward and in a re-run) and
  rotates the fp32 dK/dV cp times in backward; not overlapped. Every [b, s, h] collective of the other
  dimensions carries s/cp tokens; dp's gradients and ZeRO shards run over dp × cp.

Adding a dimension: write one row function ``(Critical, Topology) → list[Row]`` below and append it to
``ROWS``; give its degree a place in ``ORDER`` so the groups outside it get their stride.

Known limitations (NB): counts are for the busiest stage's device; buckets are one call (the latency of
each bucket is not counted); the MoE's tensor-parallel collectives are counted as a dense MLP's;
concurrent groups of different dimensions are taken not to share NICs (``fabric``'s own limitations).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from memplan.analytic.fsdp2_moments import titan_fsdp2
from memplan.analytic.fsdp2_reduce import reduce_bytes
from memplan.analytic.params import ParamCount
from memplan.blocks import te_fp8
from memplan.config import Checkpointing, Precision, Setup, ZeroStage
from memplan.engine import Result
from memplan.presets import Topology
from memplan.strategies import context_parallel, torch_interleaved
from memplan.strategies.pipeline_parallel import chunk_layers, stage, stage_layers, stage_params
from memplan.time.fabric import Collective, Link, collective_seconds, link, placed


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


ORDER: tuple[tuple[str, Callable[[Setup], int]], ...] = (
    ("tp", lambda s: s.parallel.tp),
    ("cp", lambda s: s.parallel.cp),  # Llama 3's order: tp, cp, pp, dp
    ("pp", lambda s: s.parallel.pp),
    ("dp", lambda s: s.strategy.dp),
)
"""The parallel dimensions, innermost first: a group's stride is the product of the degrees before it."""


def stride(setup: Setup, dimension: str) -> int:
    out = 1
    for name, degree in ORDER:
        if name == dimension:
            return out
        out *= degree(setup)
    raise ValueError(f"dimension: {dimension!r} is not one of {[n for n, _ in ORDER]}")


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
def tp_rows(c: Critical, topo: Topology) -> list[Row]:
    """Tensor (and sequence) parallelism, per micro-batch × micro-batches (module docstring)."""
    s, t = c.setup, c.setup.parallel.tp
    if t == 1:
        return []
    n, x = c.result.micro_batches, hidden_bytes(s)
    on = link(topo, stride(s, "tp"), t)
    embed, head = int(c.first), int(c.last)
    fwd_in = (2 * c.layers + head) * n  # column-parallel linears' inputs: QKV, MLP in, the head
    fwd_out = (2 * c.layers + embed) * n  # row-parallel outputs: attention out, MLP out, the embedding
    rerun = 2 * c.rerun_layers * n

    def row(kind: Collective, phase: Phase, count: int, overlap: Overlap, what: str, nbytes: int = x) -> Row:
        return Row("tp", kind, phase, nbytes, count, t, on, overlap, what)

    loss = 4 * rank_tokens(s)  # one fp32 per token
    rows = [row(Collective.ALL_REDUCE, Phase.FORWARD, 3 * n * head, Overlap.NONE, "cross entropy", loss)]
    if not s.parallel.sp:
        rows += [
            row(Collective.ALL_REDUCE, Phase.FORWARD, fwd_out, Overlap.NONE, "row-parallel outputs"),
            row(Collective.ALL_REDUCE, Phase.BACKWARD, fwd_in, Overlap.BACKWARD, "input gradients ‖ dW"),
            row(Collective.ALL_REDUCE, Phase.RECOMPUTE, rerun, Overlap.NONE, "re-run layers' outputs"),
        ]
    else:
        AG, RS = Collective.ALL_GATHER, Collective.REDUCE_SCATTER
        rows += [
            row(AG, Phase.FORWARD, fwd_in, Overlap.NONE, "sequence → linear inputs"),
            row(RS, Phase.FORWARD, fwd_out, Overlap.NONE, "outputs → sequence shards"),
            row(AG, Phase.BACKWARD, fwd_out, Overlap.NONE, "output gradients"),
            row(RS, Phase.BACKWARD, fwd_in, Overlap.BACKWARD, "input gradients ‖ dW"),
            row(AG, Phase.BACKWARD, fwd_in, Overlap.BACKWARD, "saved inputs for dW ‖ dX"),
            row(AG, Phase.RECOMPUTE, rerun, Overlap.NONE, "re-run layers' inputs"),
            row(RS, Phase.RECOMPUTE, rerun, Overlap.NONE, "re-run layers' outputs"),
        ]
    return [r for r in rows if r.count]


def pp_rows(c: Critical, topo: Topology) -> list[Row]:
    """Pipeline sends: one per micro-batch and chunk each way (a middle stage; the first stage sends
    forward only, the last backward only). Each tensor-parallel rank sends its 1/t of X: sharded already
    with sp; without sp Megatron's scatter/gather optimisation (Narayanan et al. 2021 §4.1) sends 1/t and
    all-gathers X on the receiving side, over the tensor-parallel group."""
    s = c.setup
    p, m, n, t = s.parallel.pp, s.parallel.vpp, c.result.micro_batches, s.parallel.tp
    if p == 1:
        return []
    x = hidden_bytes(s)
    on = link(topo, stride(s, "pp"), 2)  # two neighbouring stages
    rows = [
        Row("pp", Collective.SEND_RECV, Phase.FORWARD, x // t, n * m, 2, on, Overlap.NONE, "activations →"),
        Row("pp", Collective.SEND_RECV, Phase.BACKWARD, x // t, n * m, 2, on, Overlap.NONE, "← gradients"),
    ]
    if t > 1 and not s.parallel.sp:
        inside = link(topo, stride(s, "tp"), t)
        rows += [
            Row("pp", Collective.ALL_GATHER, phase, x, n * m, t, inside, Overlap.NONE, "received 1/t → X")
            for phase in (Phase.FORWARD, Phase.BACKWARD)
        ]
    return rows


def gradient_bytes(setup: Setup) -> int:
    """Bytes of one gradient element as data parallelism reduces it: ``--reduce-dtype`` (FSDP2's
    ``MixedPrecisionPolicy.reduce_dtype``; fp32 under ``--precision fsdp2-mixed``), else the gradients' own
    dtype."""
    chosen = setup.strategy.reduce_dtype
    if chosen is None and setup.training.precision is Precision.FSDP2_MIXED:
        return 4  # the recipe's reduce_dtype=float32 (``config.training.Precision.FSDP2_MIXED``)
    return chosen.bytes if chosen is not None else setup.training.precision.grad_bytes


def _dp_group(dimension: str, params: int, ranks: int, on: Link, c: Critical) -> list[Row]:
    """ZeRO's collectives over ``ranks`` data-parallel ranks for ``params`` parameters (module docstring)."""
    s = c.setup
    if ranks == 1 or params == 0:
        return []
    zero, n, prec = s.strategy.zero, c.result.micro_batches, s.training.precision
    grads, weights = params * gradient_bytes(s), params * prec.weight_bytes

    def row(kind: Collective, phase: Phase, nbytes: int, count: int, overlap: Overlap, what: str) -> Row:
        return Row(dimension, kind, phase, nbytes, count, ranks, on, overlap, what)

    AG, RS = Collective.ALL_GATHER, Collective.REDUCE_SCATTER
    if zero is ZeroStage.NONE:
        return [row(Collective.ALL_REDUCE, Phase.STEP, grads, 1, Overlap.LAST_BACKWARD, "gradients")]
    if zero is ZeroStage.OPTIMIZER:
        return [
            row(RS, Phase.STEP, grads, 1, Overlap.LAST_BACKWARD, "gradients"),
            row(AG, Phase.STEP, weights, 1, Overlap.FIRST_FORWARD, "updated weights"),
        ]
    if titan_fsdp2(s) and dimension == "dp":
        return _titan_fsdp2_rows(c, row, params)
    if zero is ZeroStage.GRADIENTS:
        return [
            row(RS, Phase.BACKWARD, grads, n, Overlap.BACKWARD_THEN_FORWARD, "gradients"),
            row(AG, Phase.STEP, weights, 1, Overlap.FIRST_FORWARD, "updated weights"),
        ]
    return [
        row(AG, Phase.FORWARD, weights, n, Overlap.FORWARD, "weights"),
        row(AG, Phase.BACKWARD, weights, n, Overlap.BACKWARD, "weights again"),
        row(RS, Phase.BACKWARD, grads, n, Overlap.BACKWARD, "gradients"),
    ]


def titan_kept_params(c: Critical) -> int:
    """Parameters of the stage's units torchtitan's ZeRO-3 keeps gathered from their forward to their
    backward without a pipeline: the [norm, lm_head] unit on the last stage, one unit with the embedding
    when tied (torchtitan/distributed/fsdp.py ``apply_fsdp_to_decoder``: ``reshard_after_forward=
    reshard_after_forward_policy == "always"`` for it, False under the trainer's "default")."""
    if not c.last:
        return 0
    p = c.params
    return p.final_norm + p.lm_head + (p.embedding if c.setup.model.tied_embeddings else 0)


def _titan_fsdp2_rows(c: Critical, row: Callable[..., Row], params: int) -> list[Row]:
    """torchtitan's FSDP2 over the dense parameters (``analytic.fsdp2_moments.titan_fsdp2``), by its
    reshard policy (FSDP2: a unit resharded after forward is all-gathered again in backward, one kept
    gathered is not; every unit reshards after backward, ``reshard_after_backward`` True):

    - no pipeline, ZeRO-3 (the trainer's "default" policy): every micro-batch all-gathers every unit in
      forward and all but [norm, lm_head] again in backward (``titan_kept_params``), and reduce-scatters
      every unit's gradients in backward (the trainer syncs every micro-batch: it never calls
      ``set_requires_gradient_sync(False)``);
    - no pipeline, ZeRO-2 (``reshard_after_forward=False``): one all-gather per micro-batch (forward; the
      unit is resharded after each backward), the reduce-scatter as ZeRO-3's;
    - a pipeline stage: torch's ``PipelineStage.backward_maybe_with_nosync`` sets
      ``set_reshard_after_backward(False)`` and ``set_requires_gradient_sync(False)`` for every micro-batch
      and ``perform_reduce_grad`` runs each unit's ``post_backward`` with both True once, after the
      schedule's last backward (torch/distributed/pipelining/stage.py, torch 2.13); no unit is resharded
      after forward ("default" with pp, or ZeRO-2's "never"). So the stage's weights are all-gathered
      once per step, at their first forward, and its accumulated gradients reduce-scattered once, after
      its last backward, where nothing hides them."""
    s = c.setup
    n, prec = c.result.micro_batches, s.training.precision
    # torchtitan's reduce dtype: ``--reduce-dtype``, else its ``mixed_precision_reduce`` default, fp32
    grads, weights = params * reduce_bytes(s), params * prec.weight_bytes
    AG, RS = Collective.ALL_GATHER, Collective.REDUCE_SCATTER
    if s.parallel.pp > 1:
        return [
            row(AG, Phase.STEP, weights, 1, Overlap.FIRST_FORWARD, "weights, kept gathered through the step"),
            *_regathers(c, row),
            row(RS, Phase.STEP, grads, 1, Overlap.NONE, "gradients, accumulated unsharded"),
        ]
    if s.strategy.zero is ZeroStage.GRADIENTS:
        return [
            row(RS, Phase.BACKWARD, grads, n, Overlap.BACKWARD_THEN_FORWARD, "gradients"),
            row(AG, Phase.FORWARD, weights, n, Overlap.FORWARD, "weights, resharded after backward"),
        ]
    again = (params - titan_kept_params(c)) * prec.weight_bytes
    return [
        row(AG, Phase.FORWARD, weights, n, Overlap.FORWARD, "weights"),
        row(AG, Phase.BACKWARD, again, n, Overlap.BACKWARD, "weights again, not [norm, lm_head]"),
        row(RS, Phase.BACKWARD, grads, n, Overlap.BACKWARD, "gradients"),
    ]


def _regathers(c: Critical, row: Callable[..., Row]) -> list[Row]:
    """The interleaved schedule's chunks gathered again (torch's runtime keeps at most
    ``torch_interleaved.MAX_ACTIVE_STAGES`` of a rank's chunks unsharded and reshards the others between
    computations: ``fsdp_unshards``), one row per chunk size: each all-gather of a chunk after its first,
    prefetched up to three computations ahead (``UNSHARD`` with ``async_op=True``) and counted as hidden
    behind the backwards. None with three chunks or fewer."""
    par = c.setup.parallel
    if par.vpp <= torch_interleaved.MAX_ACTIVE_STAGES:
        return []
    chunks_of = chunk_layers(c.setup.model.num_layers, par)[c.index]
    st = stage(par, c.index, chunks_of, c.result.micro_batches)
    sizes = torch_interleaved.chunk_params(c.params, st)
    gathers, _ = torch_interleaved.fsdp_unshards(par.pp, par.vpp, c.result.micro_batches, c.index)
    again: dict[int, int] = {}
    for size, k in zip(sizes, gathers, strict=True):
        again[size] = again.get(size, 0) + k - 1
    weight = c.setup.training.precision.weight_bytes
    AG = Collective.ALL_GATHER
    return [
        row(AG, Phase.STEP, size * weight, k, Overlap.BACKWARD, "a chunk's weights, gathered again")
        for size, k in again.items()
        if k
    ]


def _replicas(rows: list[Row], replicas: int, on: Link) -> list[Row]:
    """HSDP across ``replicas`` shard groups: after each gradient reduce-scatter inside a group, an
    all-reduce of the rank's gradient shard (1/group of it) with its peers in the other groups, as often
    and under the same compute (FSDP2's HSDP: reduce-scatter over the shard mesh dimension, then
    all-reduce over the replicate one)."""
    if replicas == 1:
        return []
    what = "gradient shards across replicas"
    return [
        Row("dp", Collective.ALL_REDUCE, r.phase, r.bytes // r.group, r.count, replicas, on, r.overlap, what)
        for r in rows
        if r.collective is Collective.REDUCE_SCATTER
    ]


def dp_rows(c: Critical, topo: Topology) -> list[Row]:
    """Data parallelism and ZeRO: the dense parameters over dp (× cp: the context-parallel ranks hold
    replicas too, their gradients reduced and their states sharded with dp's, as torchtitan's
    ``dp_shard_cp`` mesh does), routed experts over dp/ep. With HSDP (``--hsdp R``) ZeRO's collectives run
    inside the shard group of R data-parallel ranks (× cp), the innermost of dp, and the gradient shards
    are all-reduced across the dp/R groups (``_replicas``). Each group's link: ``placed`` on its ranks."""
    s = c.setup
    dp, ep, cp = s.strategy.dp, s.parallel.ep, s.parallel.cp
    shard, replicas = s.strategy.shard_group, s.strategy.replicas
    experts = c.result.pieces.expert_params * c.layers
    at = stride(s, "dp")
    dense_on = placed(topo, ((stride(s, "cp"), cp), (at, shard)))
    dense = _dp_group("dp", c.params.total - experts, shard * cp, dense_on, c)
    dense += _replicas(dense, replicas, link(topo, at * shard, replicas))
    return dense + _dp_group("dp experts", experts, dp // ep, link(topo, at * ep, dp // ep), c)


RING = {
    ("forward", "first"): Overlap.RING_FIRST_FORWARD,
    ("backward", "first"): Overlap.RING_FIRST_BACKWARD,
    ("forward", "blocks"): Overlap.RING_FORWARD,
    ("backward", "blocks"): Overlap.RING_BACKWARD,
}
"""Where a context-parallel exchange runs (``context_parallel.Exchange.under``) → the compute it hides
behind (``predict.windows``: the attention of those blocks)."""


def cp_rows(c: Critical, topo: Topology) -> list[Row]:
    """Context parallelism: per attention layer and micro-batch the K/V exchanges of torch's ring
    (``context_parallel.kv_exchanges``, the rank's setup: kv/t heads, s/cp tokens) — with ``allgather`` one
    all-gather in forward, another in backward (and in a re-run), with ``alltoall`` c − 1 rotations each —
    and the c fp32 dK/dV rotations of the backward. Ring overlap per block: each exchange hides behind the
    attention of the block(s) it runs under (``RING``); a block costs max(its compute, the transfer of
    the next). An all-gather's row carries its output (cp × the rank's shard), as the other dimensions' do."""
    s = c.setup
    cp = s.parallel.cp
    if cp == 1:
        return []
    on, n = link(topo, stride(s, "cp"), cp), c.result.micro_batches
    phases = {"forward": Phase.FORWARD, "backward": Phase.BACKWARD, "recompute": Phase.RECOMPUTE}
    rows = []
    for e in context_parallel.kv_exchanges(c.result.pieces.setup, s.parallel.cp_rotate):
        gather = e.collective == "all-gather"
        kind = Collective.ALL_GATHER if gather else Collective.SEND_RECV
        layers = c.rerun_layers if e.phase == "recompute" else c.layers
        nbytes = e.bytes * cp if gather else e.bytes
        group = cp if gather else 2
        what = "K/V shards" if e.bytes == context_parallel.kv_bytes_of(c.result.pieces.setup) else "dK/dV"
        overlap = RING.get((e.phase, e.under), Overlap.NONE)
        rows.append(Row("cp", kind, phases[e.phase], nbytes, e.calls * layers * n, group, on, overlap, what))
    return [r for r in rows if r.count]


def ep_rows(c: Critical, topo: Topology) -> list[Row]:
    """Expert parallelism: dispatch and combine all-to-alls of the routed tokens, per MoE layer."""
    s, moe = c.setup, c.setup.model.moe
    ep = s.parallel.ep
    if moe is None or ep == 1:
        return []
    t = s.training
    tokens = rank_tokens(s) // (s.parallel.tp if s.parallel.sp else 1)
    nbytes = moe.slots(tokens) * s.model.hidden_size * t.precision.activation_dtype.bytes
    on = link(topo, stride(s, "dp"), ep)
    n = c.result.micro_batches

    def row(phase: Phase, layers: int) -> Row:
        count = 2 * layers * n  # dispatch and combine
        return Row("ep", Collective.ALL_TO_ALL, phase, nbytes, count, ep, on, Overlap.NONE, "tokens ⇄")

    rows = [row(Phase.FORWARD, c.layers), row(Phase.BACKWARD, c.layers), row(Phase.RECOMPUTE, c.rerun_layers)]
    return [r for r in rows if r.count]


def fp8_rows(c: Critical, topo: Topology) -> list[Row]:
    """Transformer Engine's delayed scaling (``--impl megatron --fp8 delayed``, blocks/te_fp8.py): per
    micro-batch and model chunk one all-reduce (MAX) of the chunk's amax buffer at the forward's end and one
    at the backward's (``FP8GlobalStateManager.reduce_and_update_fp8_tensors``; ``te_fp8.amax_buffer_bytes``:
    12 B a layer forward, 8 B backward), over Megatron's amax reduction group — tp × dp × cp
    (``get_amax_reduction_group(with_context_parallel=True)``: ``_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP``)
    — synchronous (``async_op=False``): exposed. A chunk without layers registers no amax and reduces
    nothing. NB: a re-run forward under full recompute is taken to add no reduction (TE's checkpoint
    re-enters ``fp8_autocast`` in backward; not verified)."""
    s = c.setup
    if not te_fp8.delayed(s):
        return []
    par, n = s.parallel, c.result.micro_batches
    group = par.tp * par.cp * s.strategy.dp
    if group == 1:  # ``torch.distributed.get_world_size(group=group) > 1``
        return []
    on = placed(
        topo, ((stride(s, "tp"), par.tp), (stride(s, "cp"), par.cp), (stride(s, "dp"), s.strategy.dp))
    )
    chunks = chunk_layers(s.model.num_layers, par)[c.index]
    rows = []
    for layers in sorted(set(chunks) - {0}):
        count = n * chunks.count(layers)
        for phase, forward in ((Phase.FORWARD, True), (Phase.BACKWARD, False)):
            nbytes = te_fp8.amax_buffer_bytes(layers, forward)
            rows.append(
                Row("fp8", Collective.ALL_REDUCE, phase, nbytes, count, group, on, Overlap.NONE, "amaxes")
            )
    return rows


ROWS: tuple[Callable[[Critical, Topology], list[Row]], ...] = (
    tp_rows,
    cp_rows,
    pp_rows,
    dp_rows,
    ep_rows,
    fp8_rows,
)
"""One function per dimension, in the table's order."""


def communication(r: Result, topo: Topology) -> tuple[Critical, list[Row]]:
    """The busiest stage and every collective one of its devices runs in one step."""
    c = critical_stage(r)
    return c, [row for rows in ROWS for row in rows(c, topo)]
