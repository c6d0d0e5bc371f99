"""FSDP2's communication buffers: the segments torch's caching allocator holds on FSDP2's all-gather
stream, and (under its mixed precision) its reduce-scatter buffers on the default and reduce-scatter streams.

FSDP2 (``torch.distributed.fsdp.fully_shard``; torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py
``foreach_all_gather``) allocates each unit's ``all_gather_output`` — its parameters' padded shards
(⌈rows/W⌉ · cols each, ``_get_dim0_padded_size``) × the W ranks it shards over, in the parameter dtype —
under ``device_handle.stream(all_gather_copy_in_stream)``: a stream of its own, whose blocks the caching
allocator keeps in their own pools (``analytic.allocator``: pools per stream). The unsharded parameters the
layer computes with are copied out of it on the default stream (``foreach_all_gather_copy_out``); those are
the estimate's gathered unit (``analytic.step.zero3_gather``), not these.

When each buffer is freed, from _fsdp_param_group.py (torch 2.13), per micro-batch:

- forward (implicit prefetch): unit k's ``pre_forward`` all-gathers it (allocates), then
  ``wait_for_unshard`` frees the *previous* unit's buffer (``comm_ctx.all_gather_state``), keeping unit
  k's until the next unit's; the last unit's is freed when the root's forward ends (_fsdp_state.py
  ``_post_forward``: ``if self._state_ctx.iter_forward_root is self: … self._comm_ctx.all_gather_state =
  None  # free the all-gather result``; torch 2.3's torch/distributed/_composable/fsdp/ and torch 2.13's
  torch/distributed/fsdp/_fully_shard/ alike — every FSDP2 stack wraps the root, so it applies to all);
- backward: unit j's ``pre_backward`` all-gathers it unless prefetched or still unsharded, frees it after
  the copy-out (not deferred outside the forward), then prefetches the unit whose forward ended before
  its own (``_backward_prefetch`` walks ``post_forward_order`` back): unit j − 1, but for the reference's
  root, which wraps the layers — its forward ends last, so its backward comes first, at the loss, and
  prefetches the top layer (``backward_order``).

Checked event for event against torch 2.13 on the fake process group (``measure.distributed.
fsdp_streams``, tests/measure/test_fsdp_streams.py): torchtitan's units with and without tensor
parallelism (dp 2, tp 2 × dp 2, tp 2 × dp 3: the padding of the TP-local shards) and the reference's root.

Tensor parallelism: FSDP2 shards a DTensor parameter's TP-local tensor (torch 2.13 _fsdp_param.py
``_init_sharding_spec_tp`` returns ``param._local_tensor``; ``_init_sharded_param`` chunks it on dim 0
over the dp shard group, every chunk padded to the first one's rows), so a unit's all-gather output is
its TP-local parameters, each dim 0 padded to the dp shard count, in the parameter dtype; the order of
gathers and frees is the same (``unit_shapes`` reads the tensor-parallel rank's model). So is the
reduce-scatter side under torchtitan: each unit's output is its TP-local shard over dp (``foreach_reduce``
reduces the DTensor gradients' local tensors; measured on the fake process group, tests/measure/
test_fsdp_streams.py).

Units, by implementation:

- ``--impl torchtitan`` (torchtitan 0.3.0's ``apply_fsdp``): the token embedding, each transformer block,
  and the final norm with the output projection, that last group not resharded after forward: ZeRO-3
  re-gathers every unit but the last in backward; ZeRO-2 (``reshard_after_forward=False``) none.
  torchtitan's ZeRO-3 runs its trainer's ``reshard_after_forward_policy="default"``
  (``measure.distributed.titan.reshard_policy``), which with pp reshards no unit after forward
  (torchtitan/distributed/fsdp.py ``get_fsdp_reshard_after_forward_policy``: ``not pp_enabled``): none
  re-gathered there either.
- ``--impl reference`` (memplan's own model, ``measure.distributed.parallelize``: ``fully_shard`` on each
  layer, then on the root) and the 2024 torchtitan (``--impl torchtitan --fsdp-wrap root``;
  parallelize_llama.py of the time: each block, then ``fully_shard(model)``): the root unit holds the
  embedding, the final norm and the head together and is gathered first, before layer 0 (the root's
  pre-forward runs before its children's). Whether the backward gathers it again: the torch of 2024
  never resharded a root after forward (``FSDPState._lazy_init``: "For the root, do not reshard after
  forward since for training, the parameters would be freed and all-gathered immediately",
  ``post_forward_mesh_info = None``, unconditional then; torch 2.13 does it only when the flag is not
  given, ``_auto_reshard_after_forward``), so the 2024 torchtitan's root is not gathered again, nor its
  last block (not resharded after forward); memplan's reference passes the flag (ZeRO-3: True), so torch
  2.13 reshards its root and the backward gathers it again, first. A pipeline stage's root holds
  whichever of them the stage has (none: no root unit).

The stream's segments are never returned while the step runs, and the default stream cannot use them:
its reserved bytes add to the default stream's (``stream_reserved``: this stream's events replayed
through its own ``analytic.allocator.Allocator``, two steps as ``alloc_stream.STEPS``). Its reserved peak is
reached at the forward's second unit (the first two buffers are live together) and held from there to
the end of the run, through the default stream's peak in the backward: the verdict and ``fit`` keep it
back from the default stream's allocator (``search.budget``, ``time.comm.buffers.comm_buffer_bytes``).

The reduce-scatter side, as torch 2.13 runs it (torch/distributed/fsdp/_fully_shard/), per unit in the
backward's order (the reverse of the forward's: the reference's root, which holds the embedding, last):

- its input, a flat copy of the unit's unsharded gradients (each dim 0 padded to W rows) in the reduce
  dtype (fp32: ``MixedPrecisionPolicy(reduce_dtype=float32)``), is allocated on the *default* stream
  (_fsdp_collectives.py ``foreach_reduce``, l. 597–601: ``reduce_scatter_comm.allocate(...)`` outside any
  stream context, ``DefaultAllocMixin``: ``torch.empty``), the unsharded gradients freed once it is copied
  in (l. 603–606). ``FSDPParamGroup.post_backward`` keeps it in ``comm_ctx.reduce_scatter_states``
  (_fsdp_param_group.py l. 717–718) until the next unit's ``post_backward`` pops it, before that unit's
  own is allocated (l. 647–658; ``reduce_scatter_max_input_buffers`` 1 by default, l. 112); the last one
  is freed by the root's final callback at the backward's end (_fsdp_state.py l. 420–431). So beside each
  unit's backward the previous unit's input is alive: ``reduce_scatter_input`` for the reference's layer
  and embedding moments (torchtitan's in ``analytic.fsdp.moments.zero3_unit_buffers``). torch 2.3's
  ``foreach_reduce_scatter`` allocated it on the reduce-scatter stream instead (docs/published-memory.md).
- its output, the unit's shard of the reduced gradients (padded elements / W, reduce dtype), is allocated
  on the *reduce-scatter* stream (l. 611–616: ``with device_handle.stream(reduce_scatter_stream):
  reduce_output = ...allocate(...)``): its own pool. With the fp32 model's parameters (orig dtype fp32) and
  an fp32 reduce, ``_to_dtype_if_needed`` is no cast (l. 696) and the output *is* the sharded gradient
  (``torch.as_strided`` views of it, l. 704–709; "the sharded parameters hold refs through the end of
  backward", l. 762–765), freed by the optimizer loop's ``zero_grad(set_to_none=True)``; with a bf16
  reduce (``--reduce-dtype bf16``) the cast's fp32 block is made on the same stream (l. 685–696) and the
  output freed. ``reduce_scatter_stream`` replays that pool (two steps); the default stream's replay then
  holds no sharded gradients (``reserved``). Its segments hold only the sharded gradients: wholly free at
  every moment without them (after ``zero_grad``, before the next backward's first reduce), when the
  allocator's out-of-memory path releases them for the default stream (``release_cached_blocks``), so the
  verdict does not keep them back (``search.budget``).

Known limitations:
- NB: fine-tuning (LoRA's adapters in the units, QLoRA's 4-bit storage) and a mixture of experts under
  tensor parallelism are not modelled (``gather_units`` returns None).
- NB: the per-parameter all-gather inputs ``foreach_all_gather`` makes on the same stream before the
  copy-in (``_get_param_all_gather_inputs``: the shards cast to the parameter dtype, 1/W of the output)
  are not counted.
- The 2024 torchtitan (``--fsdp-wrap root``) also kept its last block gathered after forward
  (``reshard_after_forward = int(layer_id) < len(model.layers) - 1``) and its root too (the torch of the
  time cleared the root's ``post_forward_mesh_info`` unconditionally): neither is gathered again in
  backward (``unit_shapes``), and the root's pre-backward prefetch of the top block is a no-op. Checked
  event for event on dp 2 and 3 (tests/measure/test_fsdp_streams.py).
- NB: the reduce-scatter side is modelled under FSDP2's mixed precision only (``--precision fsdp2-mixed``,
  ``--impl torchtitan``'s bf16-mixed: ``reduce_scatter_modelled``, below); the reference's bf16-mixed
  (DeepSpeed's split, no ``MixedPrecisionPolicy``) keeps its gradients on the default stream and its bf16
  reduce-scatter input is not counted.
- NB: under memory pressure the allocator's out-of-memory path releases this stream's wholly free cached
  segments too (``release_cached_blocks``); the default stream's replay at capacity does not see them.
"""

from __future__ import annotations

import math
from functools import lru_cache

from memplan.analytic.allocator import Allocator, Replay
from memplan.analytic.fsdp.reduce import block_shapes, reduce_bytes, reduce_scatter_modelled, root_wrapped
from memplan.analytic.optimizer_step import _norm_shapes
from memplan.blocks import fp8
from memplan.blocks.torchtitan import FSDP2_MIXED_BYTES
from memplan.config import Impl, PositionType, Setup, ZeroStage

Shape = tuple[int, ...]
STEPS = 2
"""Steps replayed: the second finds the first one's cached segments (``alloc_stream.STEPS``)."""


def gathered(shapes: list[Shape], world: int, element: int) -> int:
    """Bytes of one unit's ``all_gather_output``: each tensor's dim-0 shard padded to ⌈rows/W⌉ rows,
    times W ranks, in ``element`` bytes."""
    return element * world * sum(-(-s[0] // world) * math.prod(s[1:]) for s in shapes)


def unit_shapes(setup: Setup, layers: int, first: bool, last: bool) -> list[tuple[list[Shape], bool]] | None:
    """Each FSDP2 unit of a rank holding ``layers`` layers (the embedding when ``first``, the final norm and
    head when ``last``), in forward order: (its parameters' shapes, whether the backward gathers it
    again); units as the implementation wraps them (module docstring). Empty without ZeRO-2/3 over more
    than one rank; None where not modelled (module NB).

    ``setup`` is one rank's: under tensor parallelism its model is the tensor-parallel rank's
    (``strategies.tensor_parallel.tp_model``, the engine's ``Pieces.setup.model``), whose shapes are each
    DTensor parameter's TP-local tensor — the tensor FSDP2 shards over dp (torch 2.13 _fsdp_param.py
    ``_init_sharding_spec_tp`` returns ``param._local_tensor``; ``_init_sharded_param`` chunks it on dim
    0 over the dp shard group and pads every chunk to the first one's rows). Column-parallel weights
    (and their biases) hold dim 0 / t rows, row-parallel ones dim 1 / t columns, the vocabulary-parallel
    embedding and head ⌈v/t⌉ rows; norms (and row-parallel biases) are replicated, whole."""
    s, m = setup.strategy, setup.model
    world = setup.state_shards  # torchtitan's dp_shard_cp mesh
    if s.zero < ZeroStage.GRADIENTS or world == 1:
        return []
    if not setup.finetune.trains_everything or (setup.parallel.tp > 1 and m.moe is not None):
        return None
    h = m.hidden_size
    # torchtitan's "default" policy under pp: no unit resharded after forward (module docstring)
    titan_pp = setup.impl.impl is Impl.TORCHTITAN and setup.parallel.pp > 1
    again = s.zero >= ZeroStage.PARAMETERS and not titan_pp
    embed: list[Shape] = [(m.vocab_size, h)] if first else []
    embed += [(m.max_positions, h)] if first and m.position is PositionType.LEARNED else []
    head: list[Shape] = []
    if last:
        head = [*_norm_shapes(m), *([] if m.tied_embeddings else [(m.vocab_size, h)])]
    block = [(block_shapes(setup), again)] * layers
    titan = setup.impl.impl is Impl.TORCHTITAN
    if titan and not root_wrapped(setup):  # torchtitan 0.3.0: the embedding, each block, [norm, output]
        if m.tied_embeddings:  # one unit [tok_embeddings, norm, lm_head], gathered first, never again
            return [(embed + head, False), *block]  # (``analytic.fsdp.moments.zero3_tied``; no pp tied)
        units = [(embed, again)] if first else []
        return units + block + ([(head, False)] if last else [])
    root = embed + head  # the root unit: gathered first
    if titan:  # 2024: the root and the last block not resharded after forward
        return ([(root, False)] if root else []) + block[:-1] + ([(block[-1][0], False)] if layers else [])
    return ([(root, again)] if root else []) + block  # the reference: resharded as the layers (flag passed)


def gather_units(setup: Setup, layers: int, first: bool, last: bool) -> list[tuple[int, bool]] | None:
    """``unit_shapes`` as (each unit's all-gather output's bytes, whether the backward gathers it again)."""
    units = unit_shapes(setup, layers, first, last)
    if units is None:
        return None
    world, e = setup.state_shards, setup.training.precision.weight_bytes
    # --fp8-all-gather: a block's converted weights gathered in float8 (blocks.fp8.gathered_saving)
    block, saving = block_shapes(setup), fp8.gathered_saving(setup, world)
    # the blocks are one list of shapes repeated (``unit_shapes``): each distinct list summed once (an
    # MoE block lists every expert's tensors: thousands of shapes per unit, a unit per layer)
    made: dict[int, int] = {}
    out = []
    for shapes, again in units:
        if id(shapes) not in made:
            made[id(shapes)] = gathered(shapes, world, e) - (saving if shapes == block else 0)
        out.append((made[id(shapes)], again))
    return out


class _Coder:
    """A stream's events coded as ``alloc_stream.codes`` does (n ≥ 0 allocates n bytes, the allocations
    numbered in order; −k − 1 frees k): ``alloc`` appends an allocation and returns its number."""

    def __init__(self) -> None:
        self.out: list[int] = []
        self.made = 0

    def alloc(self, size: int) -> int:
        self.out.append(size)
        self.made += 1
        return self.made - 1


def root_wraps(setup: Setup, first: bool, last: bool) -> bool:
    """The first of ``unit_shapes``' units is a root that wraps the others (``--impl reference``'s root and
    torchtitan's of 2024, ``reduce.root_wrapped``, on a rank holding the embedding or the head): its
    forward ends after theirs, so its backward comes first (``codes``' ``root``). torchtitan 0.3.0's root
    holds no parameters of its own (no unit)."""
    return root_wrapped(setup) and (first or last)


def backward_order(count: int, root: bool = False) -> list[int]:
    """The units' indices in the order their backward runs: the reverse of the order their forwards end
    (FSDP2's ``post_forward_order``, which ``_backward_prefetch`` walks back), the root's, when the first
    unit wraps the others (``root``), last — its backward first, before the top layer's."""
    ended = [*range(1, count), 0] if root and count else list(range(count))
    return ended[::-1]


def codes(
    units: list[tuple[int, bool]], micro_batches: int = 1, steps: int = STEPS, root: bool = False
) -> list[int]:
    """The all-gather stream's allocations and frees over ``steps`` steps of ``micro_batches`` (coded as
    ``alloc_stream.codes``: n ≥ 0 allocates n bytes, the allocations numbered in order; −k − 1 frees k).
    ``root``: the first unit wraps the others (``root_wraps``), its backward first (``backward_order``).
    Measured on the fake process group: ``measure.distributed.fsdp_streams``."""
    coder = _Coder()
    out, alloc = coder.out, coder.alloc
    held: int | None = None  # the forward's kept buffer (``all_gather_state``)
    order = backward_order(len(units), root)
    for _ in range(steps * micro_batches):
        for size, _again in units:  # forward: allocate this unit's, then free the one kept before it
            i = alloc(size)
            if held is not None:
                out.append(-held - 1)
            held = i
        if held is not None:  # the root's post-forward frees the last one
            out.append(-held - 1)
            held = None
        pending: int | None = None
        for n, j in enumerate(order):  # backward
            size, again = units[j]
            if again and pending is None:
                pending = alloc(size)  # its own unshard (nothing prefetched it)
            if pending is not None:
                out.append(-pending - 1)  # freed after the copy-out
                pending = None
            if n + 1 < len(order) and units[order[n + 1]][1]:
                pending = alloc(units[order[n + 1]][0])  # _backward_prefetch
    return out


def stream_reserved(units: list[tuple[int, bool]], micro_batches: int = 1, root: bool = False) -> Replay:
    """The all-gather stream's allocator counters (its own pools: a fresh ``Allocator``): ``codes``'
    micro-batches replayed one after another until one opens no segment. Each frees every block it makes
    (the forward's last kept buffer at the root's post-forward, the backward's after each copy-out), so the
    allocator enters the next holding only wholly free segments: a micro-batch that opens none leaves the
    state it found, and every later one replays it alike (a search's thousands of micro-batches cost two or
    three)."""
    one = codes(units, 1, steps=1, root=root)
    per = sum(1 for c in one if c >= 0)
    alloc = Allocator()
    for n in range(STEPS * micro_batches):
        before = alloc.stats.segments
        base = n * per
        made = base
        for c in one:
            if c >= 0:
                alloc.malloc(made, c)
                made += 1
            else:
                alloc.free(base - c - 1)
        if n and alloc.stats.segments == before:
            break
    return alloc.stats


@lru_cache(maxsize=1024)
def _reserved_peak(units: tuple[tuple[int, bool], ...], micro_batches: int, root: bool) -> int:
    """``stream_reserved``'s reserved peak, memoised: a fit search judges many configurations whose ranks
    hold the same units (``reserved``'s replays are memoised the same way)."""
    return stream_reserved(list(units), micro_batches, root).reserved_peak


def all_gather_stream(setup: Setup, layers: int, first: bool, last: bool, micro_batches: int) -> int | None:
    """Bytes the caching allocator reserves on FSDP2's all-gather stream for a rank holding ``layers``
    layers (``gather_units``; 0 without FSDP2's gathers, None where not modelled)."""
    units = gather_units(setup, layers, first, last)
    if units is None:
        return None
    root = root_wraps(setup, first, last)
    return _reserved_peak(tuple(units), micro_batches, root) if units else 0


# ----------------------------------------------------------------------------------------------------
# The reduce-scatter side (FSDP2's mixed precision: ``blocks.torchtitan.fsdp2_mixed``)
# ----------------------------------------------------------------------------------------------------
def reduce_scatter_outputs(setup: Setup, layers: int, first: bool, last: bool) -> list[tuple[int, int]]:
    """Each unit's reduce-scatter output on the reduce-scatter stream, in the order the backward reduces
    them (the reverse of the forward's: the reference's root, which holds the embedding, last): (its
    bytes in the reduce dtype, the bytes of its cast to the fp32 sharded parameters' dtype, 0 when the
    reduce dtype is fp32). Empty where not modelled (``reduce_scatter_modelled``)."""
    units = unit_shapes(setup, layers, first, last) if reduce_scatter_modelled(setup) else None
    world, reduce = setup.state_shards, reduce_bytes(setup)
    cast = FSDP2_MIXED_BYTES if reduce != FSDP2_MIXED_BYTES else 0
    out = []
    for shapes, _ in reversed(units or []):
        elements = gathered(shapes, world, 1) // world  # the padded shard: ⌈rows/W⌉ rows of each
        out.append((elements * reduce, elements * cast))
    return out


def reduce_scatter_codes(
    outputs: list[tuple[int, int]], micro_batches: int = 1, steps: int = STEPS
) -> list[int]:
    """The reduce-scatter stream's allocations and frees (coded as ``codes``) over ``steps`` steps of
    ``micro_batches``: each unit's output; with a cast, the cast's block, then the output freed; the first
    micro-batch's results are the sharded gradients, kept to the step's end (``zero_grad(set_to_none=
    True)`` after the optimizer step); a later micro-batch's is added into them and freed."""
    coder = _Coder()
    out, alloc = coder.out, coder.alloc
    for _ in range(steps):
        grads: list[int] = []
        for micro_batch in range(micro_batches):
            for size, cast in outputs:
                got = alloc(size)
                if cast:
                    kept = alloc(cast)
                    out.append(-got - 1)
                    got = kept
                if micro_batch == 0:
                    grads.append(got)
                else:
                    out.append(-got - 1)
        out += [-g - 1 for g in grads]
    return out


@lru_cache(maxsize=1024)
def _reduce_scatter_peak(outputs: tuple[tuple[int, int], ...], micro_batches: int) -> int:
    """The reduce-scatter stream's reserved peak (its own pool: a fresh ``Allocator``), memoised."""
    return reduce_scatter_reserved(list(outputs), micro_batches)


def reduce_scatter_reserved(outputs: list[tuple[int, int]], micro_batches: int) -> int:
    """The reduce-scatter stream's reserved peak over ``micro_batches``, replayed with 1, 2, 3, …
    micro-batches until one more opens no segment: from the second micro-batch on each frees what it
    makes and the first's gradients stay, so a micro-batch that opens none leaves the state it found,
    and every later one replays it alike (a search's thousands of micro-batches cost a few replays)."""
    last = -1
    for m in range(1, micro_batches + 1):
        peak = Allocator().replay_codes(reduce_scatter_codes(outputs, m)).reserved_peak
        if m >= 3 and peak == last:
            return peak
        last = peak
    return last


def reduce_scatter_stream(setup: Setup, layers: int, first: bool, last: bool, micro_batches: int) -> int:
    """Bytes the caching allocator reserves on FSDP2's reduce-scatter stream for a rank holding ``layers``
    layers (0 where not modelled: ``reduce_scatter_modelled``)."""
    outputs = reduce_scatter_outputs(setup, layers, first, last)
    return _reduce_scatter_peak(tuple(outputs), micro_batches) if outputs else 0
