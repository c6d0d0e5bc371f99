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
§3.3.2: "[TP, CP, PP, DP]"; memplan's reference), or, under Megatron and torchtitan, tp, cp, dp and pp
outermost (Megatron-core's default ``order="tp-cp-ep-dp-pp"``, torchtitan's mesh ``["pp", "dp_replicate",
"dp_shard", "cp", "tp"]``: ``comm.rows.order``); a group's ranks on one node follow from the strides
(``per_node``). Expert parallelism takes its ranks from dp, innermost (dp's stride); HSDP's shard group is
dp's innermost R ranks, its replicas R × dp's stride apart.

Per dimension (Megatron-LM; Shoeybi et al. 2019 §3, Korthikanti et al. 2022 §4.2.2, Narayanan et al. 2021):
- tp without sp: per layer two all-reduces of X in forward (after the attention and MLP row-parallel
  linears; the embedding adds one), two in backward (the column-parallel linears' input gradient, and the
  head's), overlapped with the weight-gradient GEMM (Megatron's async all-reduce); a re-run layer repeats
  its forward ones. The vocabulary-parallel cross entropy all-reduces three [b, s] fp32 tensors (max,
  sum of exponentials, target logit).
- tp with sp: each all-reduce becomes an all-gather and a reduce-scatter of X (same bytes on the wire);
  forward 2L+1 of each (the embedding reduce-scatters, the head all-gathers); backward the transposes
  (an all-gather for each forward reduce-scatter, exposed; a reduce-scatter for each forward all-gather,
  overlapped with the weight gradient) plus, where the column-parallel linears save their sharded input
  (Megatron), its re-gather for the weight gradient (overlapped with the input-gradient GEMM); torchtitan
  keeps the gathered input (``Profile.sp_module_gather``): no re-gather. Under torchao's float8 plan
  (``--fp8-tp``) the layers' gathers move float8 (``float8_gathers``). Under TE's userbuffers
  (``--tp-comm-overlap``, ``time.tp_overlap``) or torchtitan's async TP (``--async-tp``, ``time.async_tp``)
  the layers' forward all-gathers and reduce-scatters and the backward's output-gradient all-gathers run
  under the GEMMs they feed or drain (``userbuffer_rows``).
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
``ROWS``; give its degree a place in ``comm.rows.ORDER`` and ``PP_OUTERMOST`` (and ``stride``'s degrees) so
the groups outside it get their stride. The vocabulary (``Row``, ``Critical``, ``Overlap``, placement) is
``time.comm.rows``; dp's rows ``time.comm.dp``.

Known limitations (NB): counts are for the busiest stage's device; buckets are one call (the latency of
each bucket is not counted); the MoE's tensor-parallel collectives are counted as a dense MLP's but for
Megatron-core's (``expert_rows``: its dispatched slots gathered over tp; none under parallel folding);
concurrent groups of different dimensions are taken not to share NICs (``fabric``'s own limitations).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from memplan.blocks import te_fp8
from memplan.blocks.moe import rank_slots
from memplan.blocks.profiles import profile_of
from memplan.config import Setup
from memplan.engine import Result
from memplan.presets import Topology
from memplan.strategies import context_parallel
from memplan.strategies.pipeline_parallel import chunk_layers
from memplan.strategies.tensor_parallel import every_layer_moe
from memplan.time import tp_overlap
from memplan.time.comm.dp import dp_rows
from memplan.time.comm.fabric import Collective, link, placed
from memplan.time.comm.rows import (
    Critical,
    Overlap,
    Phase,
    Row,
    critical_stage,
    expert_groups,
    hidden_bytes,
    rank_tokens,
    stride,
)


def tp_rows(c: Critical, topo: Topology) -> list[Row]:
    """Tensor (and sequence) parallelism, per micro-batch × micro-batches (module docstring)."""
    s, t = c.setup, c.setup.parallel.tp
    if t == 1:
        return []
    n, x = c.result.micro_batches, hidden_bytes(s)
    on = link(topo, stride(s, "tp"), t)
    embed, head = int(c.first), int(c.last)
    # per layer the attention's and the MLP's; a Megatron MoE without shared experts gathers no [T, h]
    # over tp: folded, the rank's own tokens go to whole experts; split, its dispatched slots are gathered
    # over tp (``expert_rows``); shared experts gather their input as an MLP does
    shared = s.model.moe is not None and s.model.moe.shared_experts > 0
    per = 1 if (s.parallel.fold > 1 or _megatron_slot_gathers(s)) and not shared else 2
    fwd_in = (per * c.layers + head) * n  # column-parallel linears' inputs: QKV, MLP in, the head
    fwd_out = (per * c.layers + embed) * n  # row-parallel outputs: attention out, MLP out, the embedding
    rerun = per * c.rerun_layers * n

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
        regather = 0 if profile_of(s).sp_module_gather else fwd_in
        rows += [
            row(AG, Phase.FORWARD, fwd_in, Overlap.NONE, "sequence → linear inputs"),
            row(RS, Phase.FORWARD, fwd_out, Overlap.NONE, "outputs → sequence shards"),
            row(AG, Phase.BACKWARD, fwd_out, Overlap.NONE, "output gradients"),
            row(RS, Phase.BACKWARD, fwd_in, Overlap.BACKWARD, "input gradients ‖ dW"),
            # Megatron saves the shard and gathers it again for dW; torchtitan keeps the gathered input
            # (``Profile.sp_module_gather``, its memory: ``strategies.sequence_parallel``): no gather
            row(AG, Phase.BACKWARD, regather, Overlap.BACKWARD, "saved inputs for dW ‖ dX"),
            row(AG, Phase.RECOMPUTE, rerun, Overlap.NONE, "re-run layers' inputs"),
            row(RS, Phase.RECOMPUTE, rerun, Overlap.NONE, "re-run layers' outputs"),
        ]
        rows += expert_rows(c, topo)
        if s.impl.fp8_tp:
            rows = float8_gathers(rows, x // s.training.precision.activation_dtype.bytes, per * c.layers * n)
        if tp_overlap.applies(s):
            rows = userbuffer_rows(rows, per * c.layers * n, tp_overlap.kind(s), s.impl.fp8_tp)
    return [r for r in rows if r.count]


def _megatron_slot_gathers(s: Setup) -> bool:
    """Megatron-core's alltoall dispatcher with its experts split over etp > 1 ranks (sp; every layer an
    MoE): after the all-to-all it gathers the dispatched slots over the expert tensor-parallel group and
    reduce-scatters the experts' outputs before the all-to-all back (``expert_rows``)."""
    par = s.parallel
    return every_layer_moe(s.model) and par.expert_tp > 1 and par.sp and profile_of(s).megatron_moe


def expert_rows(c: Critical, topo: Topology) -> list[Row]:
    """The expert tensor-parallel collectives of Megatron-core's alltoall dispatcher with the experts split
    over etp > 1 ranks (``_megatron_slot_gathers``; token_dispatcher.py ``dispatch_postprocess``:
    ``gather_from_sequence_parallel_region(global_input_tokens, group=self.tp_group)``, its expert
    tensor-parallel group, and ``combine_preprocess``'s reduce-scatter): per MoE layer and micro-batch the
    rank's dispatched slots gathered over its etp consecutive ranks into the slots its experts take
    (``blocks.moe.rank_slots``: the tp group's S = T·k with etp = tp; S·etp/tp below; S_rank·h·e
    gathered), the experts' outputs reduce-scattered, and in backward their autograd inverses (the output
    gradients gathered, the input gradients reduce-scattered), each waited for (no GEMM beside it: the
    grouped GEMMs need the whole gathered input); a re-run layer's forward pair again. The probabilities'
    [S] gather (k per token) is not counted. Empty elsewhere: the reference MoE gathers its [T, h] input as
    an MLP does."""
    s = c.setup
    if not _megatron_slot_gathers(s):
        return []
    moe, n, etp = s.model.moe, c.result.micro_batches, s.parallel.expert_tp
    assert moe is not None  # _megatron_slot_gathers
    slots = rank_slots(s, moe, rank_tokens(s))
    y = slots * s.model.hidden_size * s.training.precision.activation_dtype.bytes
    on = link(topo, stride(s, "tp"), etp)  # the etp innermost ranks of the tp group
    AG, RS = Collective.ALL_GATHER, Collective.REDUCE_SCATTER
    layers, rerun = c.layers * n, c.rerun_layers * n

    def row(kind: Collective, phase: Phase, count: int, what: str) -> Row:
        return Row("tp", kind, phase, y, count, etp, on, Overlap.NONE, what)

    return [
        row(AG, Phase.FORWARD, layers, "dispatched slots → experts"),
        row(RS, Phase.FORWARD, layers, "experts' outputs → slots"),
        row(AG, Phase.BACKWARD, layers, "experts' output gradients"),
        row(RS, Phase.BACKWARD, layers, "dispatched slots' gradients"),
        row(AG, Phase.RECOMPUTE, rerun, "re-run dispatched slots"),
        row(RS, Phase.RECOMPUTE, rerun, "re-run experts' outputs"),
    ]


USERBUFFERS = {
    ("sequence → linear inputs", Phase.FORWARD): Overlap.UB_COLUMN_FORWARD,
    ("outputs → sequence shards", Phase.FORWARD): Overlap.UB_ROW_FORWARD,
    ("output gradients", Phase.BACKWARD): Overlap.UB_ROW_DGRAD,
    ("re-run layers' inputs", Phase.RECOMPUTE): Overlap.UB_COLUMN_RERUN,
    ("re-run layers' outputs", Phase.RECOMPUTE): Overlap.UB_ROW_RERUN,
}
"""The sequence-parallel rows TE's userbuffers run under a GEMM (``--tp-comm-overlap``, ``time.tp_overlap``)
and the GEMMs they hide behind."""


def userbuffer_rows(
    rows: list[Row], layer_calls: int, kind: str = "userbuffers", float8: bool = False
) -> list[Row]:
    """``rows`` with the layers' calls of each ``USERBUFFERS`` row under its GEMMs: ``layer_calls`` (2 a
    layer and micro-batch) of a forward or backward row, all of a re-run row; the head's all-gather and
    the embedding's reduce-scatter and gradient all-gather (Megatron's own modules, not TE's; torchtitan's
    eager ones under ``--async-tp``, ``time.async_tp``) keep theirs. ``kind``: what runs them, for the
    label (``tp_overlap.kind``). ``float8``: ``float8_gathers`` has split its rows already, the layers'
    calls into the float8 row (all of them under its GEMMs) and the head's or embedding's into the rest."""
    out: list[Row] = []
    for r in rows:
        name = r.what.removesuffix(FLOAT8)
        overlap = USERBUFFERS.get((name, r.phase))
        rest = float8 and name == r.what and name in FLOAT8_GATHERS  # the head's or embedding's calls
        if overlap is None or not r.count or rest:
            out.append(r)
            continue
        layers = r.count if r.phase is Phase.RECOMPUTE or name != r.what else layer_calls
        out.append(dataclasses.replace(r, count=layers, overlap=overlap, what=f"{r.what} ‖ GEMM ({kind})"))
        if r.count > layers:
            out.append(dataclasses.replace(r, count=r.count - layers))
    return out


FLOAT8 = " (float8)"
"""The label ``float8_gathers`` gives the layers' float8 calls."""
FLOAT8_GATHERS = ("sequence → linear inputs", "output gradients", "re-run layers' inputs")
"""The sequence-parallel all-gathers torchao's float8 plan (``--fp8-tp``, blocks/fp8_tp.py) runs in float8:
the layers' linear inputs, cast on their shard, and the row-parallel outputs' gradients, cast before the
backward's all-gather; the head's input and the embedding's output gradient stay in the activation dtype."""


def float8_gathers(rows: list[Row], f8: int, layer_calls: int) -> list[Row]:
    """``rows`` with ``FLOAT8_GATHERS``' layer calls at ``f8`` bytes (one byte an element): of the forward's
    and the backward's ``layer_calls`` are the layers' (the rest the head's and the embedding's), every
    re-run call is."""
    out = []
    for r in rows:
        if r.what not in FLOAT8_GATHERS:
            out.append(r)
            continue
        layers = r.count if r.phase is Phase.RECOMPUTE else min(layer_calls, r.count)
        out.append(dataclasses.replace(r, bytes=f8, count=layers, what=f"{r.what}{FLOAT8}"))
        out.append(dataclasses.replace(r, count=r.count - layers))
    return out


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
    the next). ``kv-gather``: an all-gather in forward, backward and a re-run and a reduce-scatter of dK/dV,
    all exposed. An all-gather's row carries its output (cp × the rank's shard) and a reduce-scatter's its
    input, as the other dimensions' do."""
    s = c.setup
    cp = s.parallel.cp
    if cp == 1:
        return []
    on, n = link(topo, stride(s, "cp"), cp), c.result.micro_batches
    phases = {"forward": Phase.FORWARD, "backward": Phase.BACKWARD, "recompute": Phase.RECOMPUTE}
    rows = []
    kinds = {
        "all-gather": Collective.ALL_GATHER,
        "reduce-scatter": Collective.REDUCE_SCATTER,
        "send-recv": Collective.SEND_RECV,
    }
    for e in context_parallel.kv_exchanges(c.result.pieces.setup, s.parallel.cp_rotate):
        collective = e.collective == "all-gather" or e.collective == "reduce-scatter"
        kind = kinds[e.collective]
        layers = c.rerun_layers if e.phase == "recompute" else c.layers
        nbytes = e.bytes * cp if collective else e.bytes
        group = cp if collective else 2
        shards = e.bytes == context_parallel.kv_bytes_of(c.result.pieces.setup)
        what = "K/V shards" if shards and e.collective != "reduce-scatter" else "dK/dV"
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
    (at, _), _ = expert_groups(s)
    on = link(topo, at, ep)
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
