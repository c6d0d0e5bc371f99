"""Data parallelism's rows of ``time.comm.collectives``'s table: the gradients' reduction and ZeRO's gathers
per stage (module docstring of ``time.comm.collectives``, "dp"), torchtitan's FSDP2 by its reshard policy and
under pp (``_titan_fsdp2_rows``), HSDP's replicas."""

from __future__ import annotations

from collections.abc import Callable

from memplan.analytic.fsdp.moments import titan_fsdp2
from memplan.analytic.fsdp.reduce import reduce_bytes
from memplan.blocks import fp8, megatron, te_fp8
from memplan.config import FsdpWrap, Impl, Precision, Setup, ZeroStage
from memplan.presets import Topology
from memplan.strategies import torch_interleaved
from memplan.strategies.pipeline_parallel import chunk_layers, stage
from memplan.time.comm.fabric import Collective, Link, link, placed
from memplan.time.comm.rows import (
    Critical,
    Overlap,
    Phase,
    Row,
    expert_groups,
    stride,
)


def gradient_bytes(setup: Setup) -> int:
    """Bytes of one gradient element as data parallelism reduces it: Megatron's ``main_grad`` buffer
    (``blocks.megatron.main_grad_bytes``: fp32 under bf16 unless ``--reduce-dtype bf16``); ``--reduce-dtype``
    (FSDP2's ``MixedPrecisionPolicy.reduce_dtype``; fp32 under ``--precision fsdp2-mixed``), else the
    gradients' own dtype."""
    main_grad = megatron.main_grad_bytes(setup)
    if main_grad is not None:
        return main_grad
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
    # Megatron-LM: --overlap-grad-reduce and --overlap-param-gather are off by default (arguments.py), so its
    # DDP reduces the gradient buffer after the backward (finish_grad_sync) and the distributed optimizer
    # gathers the updated parameters after the step: neither hides behind compute
    megatron = s.impl.impl is Impl.MEGATRON
    reduce = Overlap.NONE if megatron and not s.impl.overlap_grad_reduce else Overlap.LAST_BACKWARD
    gather = Overlap.NONE if megatron and not s.impl.overlap_param_gather else Overlap.FIRST_FORWARD
    if zero is ZeroStage.NONE:
        return [row(Collective.ALL_REDUCE, Phase.STEP, grads, 1, reduce, "gradients")]
    # --fp8-param-gather: the layers' linears gathered as their float8 data (blocks/te_fp8.py), by the
    # distributed optimizer (ZeRO 1) or Megatron FSDP (ZeRO 3); MXFP8's in 16-bit
    routed = dimension == "dp experts"  # the local experts' linears, over the expert-data-parallel group
    float8 = te_fp8.float8_gathered(s, c.result.pieces.setup.model, routed)
    weights -= c.layers * float8 * (prec.weight_bytes - 1)
    if zero is ZeroStage.OPTIMIZER:
        return [
            row(RS, Phase.STEP, grads, 1, reduce, "gradients"),
            row(AG, Phase.STEP, weights, 1, gather, "updated weights"),
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
    """torchtitan's FSDP2 over the dense parameters (``analytic.fsdp.moments.titan_fsdp2``), by its
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
    # --fp8-all-gather: each block's converted weights all-gathered in float8, 1 B an element
    weights -= c.layers * fp8.gathered_saving(s)
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
    if s.impl.fsdp_wrap is FsdpWrap.ROOT:
        return _titan_root_rows(c, row, params)
    again = (params - titan_kept_params(c)) * prec.weight_bytes - c.layers * fp8.gathered_saving(s)
    return [
        row(AG, Phase.FORWARD, weights, n, Overlap.FORWARD, "weights"),
        row(AG, Phase.BACKWARD, again, n, Overlap.BACKWARD, "weights again, not [norm, lm_head]"),
        row(RS, Phase.BACKWARD, grads, n, Overlap.BACKWARD, "gradients"),
        *_fp8_amax_rows(c, row),
    ]


def _titan_root_rows(c: Critical, row: Callable[..., Row], params: int) -> list[Row]:
    """torchtitan's 2024 wrapping under ZeRO-3 (``--fsdp-wrap root``, no pipeline: ``analytic.fsdp.root``):
    every micro-batch all-gathers every unit in forward (the root first) and, in backward, every block
    but the top one (neither the root nor the top block is resharded after forward); it reduce-scatters
    each block's gradients as its backward ends, hidden behind the backward, and the root's — the
    embedding's, the final norm's and the output's — at the backward's end, in FSDP2's final callback
    (``_root_post_backward_final_callback``), which the step waits for: nothing hides it."""
    s, p = c.setup, c.params
    n, prec = c.result.micro_batches, s.training.precision
    root = p.embedding + p.final_norm + p.lm_head
    saving = fp8.gathered_saving(s)  # --fp8-all-gather: a block's converted weights in float8
    weights = params * prec.weight_bytes - c.layers * saving
    again = (params - root - p.layer.total) * prec.weight_bytes - (c.layers - 1) * saving
    AG, RS = Collective.ALL_GATHER, Collective.REDUCE_SCATTER
    return [
        row(AG, Phase.FORWARD, weights, n, Overlap.FORWARD, "weights"),
        row(AG, Phase.BACKWARD, again, n, Overlap.BACKWARD, "weights again, not the root nor the top block"),
        row(RS, Phase.BACKWARD, (params - root) * reduce_bytes(s), n, Overlap.BACKWARD, "gradients"),
        row(RS, Phase.BACKWARD, root * reduce_bytes(s), n, Overlap.NONE, "the root's gradients, at the end"),
        *_fp8_amax_rows(c, row),
    ]


def _fp8_amax_rows(c: Critical, row: Callable[..., Row]) -> list[Row]:
    """``--fp8-all-gather``: torchtitan's ``precompute_float8_dynamic_scale_for_fsdp`` after the optimizer
    step (torchao float8/fsdp_utils.py): ``torch._foreach_norm(weights, ord=inf)`` of the rank's sharded
    float8 weights, stacked and clamped as a DTensor — "it will issue a single all-reduce" (its comment) of
    one fp32 amax per converted weight of the stage; none without it."""
    if not fp8.all_gather(c.setup):
        return []
    amaxes = fp8.SCALE * len(fp8.titan_linear_shapes(c.setup)) * c.layers
    what = "float8 weights' amaxes (precompute_float8_dynamic_scale_for_fsdp)"
    return [row(Collective.ALL_REDUCE, Phase.STEP, amaxes, 1, Overlap.NONE, what)]


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
    ``dp_shard_cp`` mesh does), routed experts over dp/ep (tp·dp/ep under parallel folding). With HSDP
    (``--hsdp R``) ZeRO's collectives run inside the shard group of R data-parallel ranks (× cp), the
    innermost of dp, and the gradient shards are all-reduced across the dp/R groups (``_replicas``). Each
    group's link: ``placed`` on its ranks."""
    s = c.setup
    cp = s.parallel.cp
    shard, replicas = s.strategy.shard_group, s.strategy.replicas
    experts = c.result.pieces.expert_params * c.layers
    at = stride(s, "dp")
    dense_on = placed(topo, ((stride(s, "cp"), cp), (at, shard)))
    dense = _dp_group("dp", c.params.total - experts, shard * cp, dense_on, c)
    dense += _replicas(dense, replicas, link(topo, at * shard, replicas))
    _, (edp_at, edp) = expert_groups(s)  # dp/ep ranks beyond ep's, or tp·dp/ep under parallel folding
    return dense + _dp_group("dp experts", experts, edp, link(topo, edp_at, edp), c)
