"""What torchtitan's FSDP2 holds beside a rank's tensors at the peak model's moments (``analytic.peak``):
ZeRO-3's gathered units under its reshard policy (``measure.distributed.titan.reshard_policy``: the
trainer's "default"), the [norm, lm_head] unit kept gathered, the prefetched all-gather output and the
previous unit's reduce-scatter input beside each layer's backward, a pipeline stage's weights kept gathered,
and ZeRO-2's shards beside the unsharded weights, its units resharded after their backward and reduced as
ZeRO-3's are (``units_reduced``), a tied embedding's one unit with the head (``tied_unit``). Each measured
on torchtitan's parallelised rank on the fake process group (tests/hf/test_torchtitan_peak.py,
tests/test_fsdp_buffers.py)."""

from __future__ import annotations

from memplan.analytic.fsdp.reduce import reduce_bytes, sharded_grad_bytes, unsharded_grad_bytes
from memplan.analytic.params import ParamCount
from memplan.blocks import fp8
from memplan.blocks.inventory import Dims
from memplan.blocks.profiles import profile_of
from memplan.blocks.torchtitan import (
    FSDP2_MIXED_BYTES,
    fsdp2_flat_elements,
    fsdp2_mixed,
    fsdp2_shard_elements,
    unit_shapes,
)
from memplan.config import FsdpWrap, Setup, ZeroStage


def titan_fsdp2(setup: Setup) -> bool:
    """torchtitan's FSDP2 is applied: ``Profile.fsdp2_dim0_shards``, ZeRO-2 or 3 (``--zero 2`` is its
    ``reshard_after_forward=False``), over more than one rank of dp × cp (``dp_shard_cp``)."""
    # the profile last: the cheap tests decide most setups (the same answer: each test is pure)
    sharded = setup.strategy.zero >= ZeroStage.GRADIENTS and setup.state_shards > 1
    return sharded and profile_of(setup).fsdp2_dim0_shards


def zero3_resharded(setup: Setup) -> bool:
    """torchtitan's FSDP2 under ZeRO-3 over more than one rank, as its trainer runs it by default
    (``measure.distributed.titan.reshard_policy``: ``fsdp_reshard_after_forward = "default"``): the
    embedding and every block resharded after their forward, the [norm, lm_head] unit not
    (torchtitan/distributed/fsdp.py ``apply_fsdp_to_decoder``: ``reshard_after_forward_policy ==
    "always"`` for that unit). With pp, "default" reshards no unit after forward
    (``get_fsdp_reshard_after_forward_policy``: ``not pp_enabled``): ``zero3_kept_gathered``."""
    s = setup.strategy
    units = setup.impl.fsdp_wrap is FsdpWrap.UNITS  # the 2024 wrapping: ``analytic.fsdp.root``
    return titan_fsdp2(setup) and s.zero >= ZeroStage.PARAMETERS and setup.parallel.pp == 1 and units


def units_reduced(setup: Setup) -> bool:
    """torchtitan's FSDP2 without a pipeline, its 0.3.0 wrapping (``titan_fsdp2``; ZeRO-2 or 3): each unit
    is resharded after its backward (``reshard_after_backward``, True) and reduce-scattered at its
    post-backward, its flat fp32 reduce-scatter input held until the next unit's reduce-scatter
    (``zero3_unit_buffers``' "above"). Under ZeRO-3 the units were resharded after their forward too
    (``zero3_resharded``); under ZeRO-2 (``reshard_after_forward=False``) every unit is still gathered
    when the backward begins, and those whose backward has run are not (``zero2_resharded``)."""
    return titan_fsdp2(setup) and setup.parallel.pp == 1 and setup.impl.fsdp_wrap is FsdpWrap.UNITS


def zero2_resharded(setup: Setup, blocks: int) -> int:
    """Bytes of unsharded parameters torchtitan's ZeRO-2 (``units_reduced``, ``reshard_after_forward=
    False``) has freed by a layer's backward: the [norm, lm_head] unit's and those of the ``blocks``
    blocks above it, each resharded after its backward (bf16 views of their padded all-gather outputs,
    ``zero3_head_unit``, ``layer_gather``); 0 elsewhere. Measured on the tiny model's rank (dp 2: the
    head's 32,896 B at the top layer's backward, a block's 73,984 B more below it)."""
    if not units_reduced(setup) or setup.strategy.zero is not ZeroStage.GRADIENTS:
        return 0
    head = 0 if tied_unit(setup) else zero3_head_unit(setup)  # tied: the one unit, resharded last
    return head + blocks * layer_gather(setup, setup.state_shards)


def units_beside_layer(setup: Setup, above: int) -> int:
    """Unsharded parameters beside a layer's backward beyond its own unit (ZeRO-3) or every unit gathered
    (ZeRO-2, the estimate's weights), with ``above`` layers above it: under ZeRO-3 the tied unit, held to
    the end (``zero3_tied``); under ZeRO-2, less the units resharded after their backward
    (``zero2_resharded``)."""
    return (zero3_head_unit(setup) if zero3_tied(setup) else 0) - zero2_resharded(setup, above)


def tied_copy_out(setup: Setup, i: int) -> int:
    """Under torchtitan's ZeRO-3 with a tied embedding (``zero3_tied``), layer 0's pre-backward copy-out,
    which nothing prefetched below it makes a moment of its own: its flat all-gather output beside its
    unsharded parameters (those the layer moment counts) and the incoming [T, h] gradient (no tp: a tied
    embedding's is refused under FSDP2), before its backward's own buffers (untied, the embedding's prefetched
    unit beside layer 0's backward tops it). Bytes beyond the unsharded parameters and the held
    reduce-scatter input; 0 elsewhere. Measured at Llama 3.2 1B's widths (dp 2, s 512: 121,643,008 B of
    flat output and 4,194,304 B of gradient, 54,534,144 B above layer 0's backward)."""
    if not zero3_tied(setup) or i:
        return 0
    dims = Dims.of(setup)
    return layer_gather(setup, setup.state_shards) + dims.tokens * dims.h * dims.act.bytes


def zero3_kept_gathered(setup: Setup) -> bool:
    """torchtitan's ZeRO-3 on a pipeline stage: its trainer's "default" policy reshards no unit after
    forward with pp (torchtitan/distributed/fsdp.py ``get_fsdp_reshard_after_forward_policy``), and torch's
    stage defers resharding after backward to the last micro-batch (``set_reshard_after_backward(False)``),
    so the stage's units, once gathered, stay gathered through its forwards and backwards: every moment
    holds the stage's unsharded weights beside its shards (ZeRO-2's picture, ``zero2_shards_beside``) —
    under the interleaved schedule at most three of the rank's chunks at once (torch's runtime reshards
    the others, ``strategies.torch_interleaved.most_unsharded``) — and its unsharded gradients
    (``pipeline_unsharded_gradients``). Measured per rank on the fake process group (titan_vpp's
    ``Fsdp2Held``, tests/hf/test_torchtitan_vpp.py): the most unsharded bytes at once, the gradients each
    chunk holds at its reduction, the shards after it.
    NB: the dim-0 padding of those unsharded views and the reduction's own fp32 buffers after the last
    backward (``perform_reduce_grad``: each unit's reduce-scatter input and output) are not counted; at a
    pipeline rank's measured peak these FSDP2 terms are exact, the rest of it is not (titan_vpp's NB)."""
    return titan_fsdp2(setup) and setup.strategy.zero >= ZeroStage.PARAMETERS and setup.parallel.pp > 1


def tied_unit(setup: Setup) -> bool:
    """torchtitan's FSDP2 (``units_reduced``: ZeRO-2 or 3) with a tied embedding: ``apply_fsdp_to_decoder``
    wraps [tok_embeddings, norm, lm_head] as one unit (their one [v, h] parameter and the final norm's),
    not resharded after forward (``reshard_after_forward_policy == "always"`` for it, False under the
    trainer's "default"): gathered at the embedding's forward, it stays gathered through the forward,
    the loss and every layer's backward, and is resharded and reduced once, after the embedding's
    backward, in FSDP2's final callback (the embedding's input, the ids, needs no gradient). Measured on
    torchtitan's tied rank (``measure.distributed.titan.retie``), tests/hf/test_torchtitan_peak.py."""
    return units_reduced(setup) and setup.model.tied_embeddings


def zero3_tied(setup: Setup) -> bool:
    """``tied_unit`` under ZeRO-3 (``zero3_resharded``), where the unit is the one gathered unit beside
    the shards (under ZeRO-2 every unit is gathered from the forward: in the estimate's weights)."""
    return tied_unit(setup) and zero3_resharded(setup)


def _head_shapes(setup: Setup) -> list[tuple[int, ...]]:
    """The [norm, lm_head] unit's parameters; tied, the one unit's: the embedding's [v, h] and the norm
    (``tied_unit``)."""
    embedding, _, head = unit_shapes(setup.model)
    return [*embedding, *head] if tied_unit(setup) else list(head)


def zero3_head_unit(setup: Setup) -> int:
    """Bytes of the [norm, lm_head] unit's unsharded parameters under torchtitan's ZeRO-3
    (``zero3_resharded``): gathered for its forward and, not resharded after it, still held from the
    loss to its own backward (FSDP2's ``reshard_after_backward`` reshards it then). Each is a view of
    its padded all-gather output (``FSDPParam.init_unsharded_param``: ``as_strided`` over the
    ``padded_unsharded_size`` buffer), so every dim 0 counts padded to the shard count
    (``fsdp2_flat_elements``; measured at Llama 3.1 405B's widths on tp 8 × dp 2,048: the lm head's
    16,032 rows held as 16,384). Tied, the one [tok_embeddings, norm, lm_head] unit (``zero3_tied``), held
    from the embedding's forward to the end of the embedding's backward."""
    return (
        fsdp2_flat_elements(_head_shapes(setup), setup.state_shards) * setup.training.precision.weight_bytes
    )


def zero3_head_gather(setup: Setup) -> int:
    """Under torchtitan's ZeRO-3 at the final norm's backward: the [norm, lm_head] unit's unsharded
    parameters (kept from its forward: ``zero3_head_unit``) and the top layer's flat all-gather output,
    prefetched by the head unit's backward (measured on the tiny model: 16,512 + 37,120 B on tp 2 + SP ×
    dp 2)."""
    shards = setup.state_shards
    return zero3_head_unit(setup) + layer_gather(setup, shards)


def layer_gather(setup: Setup, shards: int) -> int:
    """Bytes of one block's flat all-gather output (``fsdp2_flat_elements``) in the parameters' dtype, its
    converted linears' weights in float8 under ``--fp8-all-gather`` (``blocks.fp8.gathered_saving``), with
    the new fp32 scales its ``fsdp_pre_all_gather`` made, beside the ones the unsharded weights hold until
    the copy-out (measured: 20 B more at the final norm's backward, tests/hf/test_fp8_all_gather.py)."""
    _, layer, _ = unit_shapes(setup.model)
    weight = setup.training.precision.weight_bytes
    saving = fp8.gathered_saving(setup, shards)
    scales = fp8.SCALE * len(fp8.titan_linear_shapes(setup)) if saving else 0
    return fsdp2_flat_elements(layer, shards) * weight - saving + scales


def zero3_unit_buffers(setup: Setup, i: int, layers: int) -> int:
    """FSDP2's buffers beside layer i's backward under torchtitan's ZeRO-3 (``zero3_resharded``),
    besides the unit it computes with (``gather``): the next unit's flat all-gather output, prefetched
    (``FSDPParamGroup`` backward prefetch: the unit below, layer i − 1 or the embedding, in the
    parameters' dtype, until its copy-out), and the previous unit's reduce-scatter input, fp32 (the
    ``reduce_dtype``), which ``comm_ctx.reduce_scatter_state`` holds until the next reduce-scatter (the
    unit above, layer i + 1 or [norm, lm_head]); both flat, each dim 0 padded to the shard count
    (``blocks.torchtitan.fsdp2_flat_elements``). Measured on tp 2 + SP × dp 2 (the tiny model, layer 1:
    37,120 + 33,024 B; layer 0: 16,384 + 74,240 B). Tied (``zero3_tied``): the one unit of the embedding
    and the head is gathered already and reduced last, so neither is there beside layer 0 or the top
    layer. Under ZeRO-2 (``units_reduced``) the reduce-scatter input alone: no unit is gathered again
    (measured on the tiny model's rank, dp 2: the head's 65,792 B beside the top layer, a block's 147,968 B
    beside layer 0)."""
    if not units_reduced(setup):
        return 0
    shards = setup.state_shards
    embedding, layer, head = unit_shapes(setup.model)
    tied = setup.model.tied_embeddings
    above_unit = layer if i < layers - 1 else [] if tied else head  # the unit reduced before this one
    above = fsdp2_flat_elements(above_unit, shards) * reduce_bytes(setup)
    if not zero3_resharded(setup):  # ZeRO-2: no unit gathered again, none prefetched
        return above
    if i > 0:
        return layer_gather(setup, shards) + above
    weight = setup.training.precision.weight_bytes
    return (0 if tied else fsdp2_flat_elements(embedding, shards) * weight) + above


def pipeline_unsharded_gradients(setup: Setup, params: ParamCount, partial: int = 0) -> int:
    """Bytes of a torchtitan pipeline stage's unsharded gradients, accumulated across its micro-batches
    under FSDP2 (ZeRO-2/3 over dp × cp > 1, pp > 1): torch's ``PipelineStage.backward_maybe_with_nosync``
    runs every micro-batch's backward with ``set_requires_gradient_sync(False)``, so each unit's
    ``post_backward`` does not reduce-scatter; it casts the unsharded gradient to the ``reduce_dtype``
    (``FSDPParam.to_accumulated_grad_if_needed``: ``unsharded_accumulated_grad``, fp32 under torchtitan's
    policy, the bf16 gradient freed) and adds each later micro-batch's into it
    (``accumulate_unsharded_grad_if_needed``), until ``perform_reduce_grad`` reduce-scatters them after the
    stage's last backward (torch 2.13 pipelining/stage.py, fsdp/_fully_shard/_fsdp_param_group.py). Each
    is the parameter's unpadded shape: the stage's parameters (``params``) × the reduce dtype's bytes,
    plus the ``partial`` elements by which TP without SP leaves W_O's and W2's gradients whole
    (``blocks.torchtitan.partial_grad_elements`` of the user's setup and the rank's stage:
    ``stage_plan.partial_grads``). 0 off a torchtitan FSDP2 pipeline stage."""
    return (params.total + partial) * reduce_bytes(setup) if accumulates_unsharded(setup) else 0


def accumulates_unsharded(setup: Setup) -> bool:
    """A torchtitan FSDP2 pipeline stage: its gradients accumulate unsharded on the default stream until
    its last backward (``pipeline_unsharded_gradients``)."""
    return titan_fsdp2(setup) and setup.parallel.pp > 1


def zero2_shards_beside(setup: Setup, params: ParamCount | None = None) -> int:
    """Bytes of the rank's parameter shards alive beside the unsharded parameters under torchtitan's
    ZeRO-2 (FSDP2 with ``reshard_after_forward=False``): FSDP2 keeps each ``FSDPParam.sharded_param`` and
    gathers into new storages (``_fsdp_param.alloc_storage``) that stay from a unit's forward to its
    backward, so forward and backward hold both (the estimate's weights count the unsharded ones). The
    shards are the dim-0 shards over dp × cp (``blocks.torchtitan.fsdp2_shard_elements``). Measured on a
    tp 2 × dp 2 rank (tests/hf/test_torchtitan_peak.py). ``params``: a pipeline stage's parameters
    (``strategies.pipeline_parallel.stage_params``), whose shards alone the stage holds — its layers (of
    every chunk), the embedding on the first stage, the final norm and lm head on the last.
    NB: under ``--vpp`` > 3 torch's runtime keeps at most three chunks gathered (``zero3_kept_gathered``);
    ZeRO-2's weights still count every chunk's bf16 copy (an upper bound)."""
    s = setup.strategy
    shards = setup.state_shards
    if not profile_of(setup).fsdp2_dim0_shards or s.zero is not ZeroStage.GRADIENTS or shards == 1:
        return 0
    element = FSDP2_MIXED_BYTES if fsdp2_mixed(setup) else setup.training.precision.weight_bytes
    model, stage = setup.model, None
    if params is not None and setup.parallel.pp > 1:
        model = model.model_copy(update={"num_layers": params.num_layers})
        stage = (params.embedding > 0, params.final_norm + params.lm_head > 0)
    return fsdp2_shard_elements(model, shards, stage) * element  # fp32 under FSDP2's mixed precision


def zero3_embedding_parts(
    setup: Setup, params: ParamCount, incoming: int, gathering: int = 0
) -> tuple[tuple[int, int, int], ...]:
    """torchtitan's ZeRO-3 (``zero3_resharded``) at the embedding's backward, as two candidate moments,
    each (sharded gradient bytes not made yet, transient bytes, gathered parameters' bytes beside the
    shards: 0 here; tied, ``_tied_embedding_parts``): FSDP2 gathers the embedding's unit again in backward
    (prefetched by layer 0's), so

    - at its pre-backward's copy-out the flat all-gather output and the new unsharded parameter are alive
      at once, beside layer 0's fp32 reduce-scatter input (held until the next unit's reduce) and the
      ``incoming`` [T, h] gradient; the embedding's sharded gradient is not made yet;
    - at its post-backward (the root's final callback: its input, the ids, needs no gradient) its
      unsharded bf16 gradient is still alive beside the flat fp32 reduce-scatter input made for it and
      its sharded gradient, the reduce-scatter's output; layer 0's input was popped before;
    - with ``gathering`` (torchtitan's SP plan: ``head_moments.sp_embedding_gather``), after the copy-out
      (its flat all-gather output freed), as the embedding's backward all-gathers the gradient: those
      bytes where ``incoming`` was, beside the unsharded parameter and layer 0's reduce-scatter input
      (measured: the tiny model's tp 2 + SP rank on dp 2, s 64, two sequences a micro-batch: 8,448 B
      above the estimate before).

    Measured on the fake process group (tests/hf/test_torchtitan_peak.py): the tiny model on dp 2 and 4
    peaks at the first (32,768 + 32,768 B of the embedding, 147,968 B of layer 0's input, 8,192 B
    incoming), Llama 3.1 8B's widths on dp 4 and 8 at the second (1,050,673,152 B bf16 + 2,101,346,304 B
    fp32), and on tp 2 + SP × dp 2 (the vocabulary-parallel embedding's clamped ids, its save, freed by
    then: ``analytic.peak``). NB: on the tiny model's tp 2 + SP rank the copy-out moment measures 4,224 B
    more (a [T/t, h] bf16 gradient shard beside the gathered [T, h], and 128 B): not modelled.

    Under ZeRO-2 (``units_reduced``) the embedding is still gathered from its forward and every other unit
    resharded after its backward (``zero2_resharded``), beside the shards FSDP2 keeps
    (``zero2_shards_beside``): no copy-out, but its new [v, h] gradient beside the ``incoming`` [T, h] and
    layer 0's input, then the same reduce with the embedding resharded (measured on the tiny model's rank,
    dp 2: 32,768 + 8,192 + 147,968 B beside the embedding's 32,768 B gathered)."""
    zero2 = units_reduced(setup) and setup.strategy.zero is ZeroStage.GRADIENTS
    if not zero2 and not zero3_resharded(setup):
        return ()
    # ZeRO-2: the shards beside the units still gathered (the estimate's weights count every unit
    # gathered), less those resharded after their backward: all but the embedding's
    held = (
        zero2_shards_beside(setup, params) - zero2_resharded(setup, setup.model.num_layers) if zero2 else None
    )
    if tied_unit(setup):
        return _tied_embedding_parts(setup, params, held)
    shards = setup.state_shards
    embedding, layer, _ = unit_shapes(setup.model)
    flat = fsdp2_flat_elements(embedding, shards)
    unsharded = flat * setup.training.precision.weight_bytes
    shard = flat // shards * sharded_grad_bytes(setup)
    grad = params.embedding * unsharded_grad_bytes(setup)
    layer_input = fsdp2_flat_elements(layer, shards) * reduce_bytes(setup)
    reduce = grad + flat * reduce_bytes(setup)
    if held is not None:  # ZeRO-2: the new gradient where ZeRO-3 copies the unit out
        gather = ((shard, gathering + layer_input, held),) if gathering else ()
        return (shard, incoming + grad + layer_input, held), (0, reduce, held - unsharded), *gather
    gather = ((shard, gathering + unsharded + layer_input, 0),) if gathering else ()
    return (shard, incoming + 2 * unsharded + layer_input, 0), (0, reduce, 0), *gather


def _tied_embedding_parts(
    setup: Setup, params: ParamCount, held: int | None
) -> tuple[tuple[int, int, int], ...]:
    """``zero3_embedding_parts`` of the tied unit (``zero3_tied``), each (sharded gradient bytes not made
    yet, transient bytes, gathered parameters' bytes beside the shards):

    - at the embedding's backward, its [v, h] gradient summed with the lm head's, which waited in
      autograd's input buffer (one leaf, one ``AccumulateGrad``): the lm head's, the embedding's new one
      and their sum, with the final norm's unsharded gradient, beside layer 0's fp32 reduce-scatter input
      (held until the next reduce-scatter, the tied unit's) and the unit still gathered;
    - at its reduce (FSDP2's final callback), the unit resharded first, then its flat fp32 reduce-scatter
      input made beside its unsharded gradients (the sum freed after the copy-in: the unit's last
      parameter, the one ``foreach_reduce``'s loop variable keeps, is the norm's); layer 0's input freed
      by then, the sharded output not made yet.

    Measured on the tiny tied model's rank (dp 2: 3 × 32,768 B of [v, h] gradients, 128 B of the norm's,
    147,968 B of layer 0's input, the unit's 32,896 B; then 65,792 B of flat input beside 32,896 B of
    gradients), tests/hf/test_torchtitan_peak.py."""
    shards = setup.state_shards
    _, layer, _ = unit_shapes(setup.model)
    flat = fsdp2_flat_elements(_head_shapes(setup), shards)
    shard = flat // shards * sharded_grad_bytes(setup)
    grads = (params.embedding + params.final_norm) * unsharded_grad_bytes(setup)
    embedding = params.embedding * unsharded_grad_bytes(setup)
    layer_input = fsdp2_flat_elements(layer, shards) * reduce_bytes(setup)
    summed = grads + 2 * embedding + layer_input
    reduce = grads + flat * reduce_bytes(setup)
    if held is None:  # ZeRO-3: the unit the one gathered beside the shards, then resharded
        return (shard, summed, zero3_head_unit(setup)), (shard, reduce, 0)
    # ZeRO-2 (``held``: the shards beside the units still gathered): the unit resharded at its reduce
    return (shard, summed, held), (shard, reduce, held - zero3_head_unit(setup))


def zero3_head_reduce(setup: Setup, params: ParamCount, incoming: int) -> tuple[int, int, int] | None:
    """torchtitan's ZeRO-3 (``zero3_resharded``) and ZeRO-2 at the [norm, lm_head] unit's post-backward,
    after the final norm's backward: (the top layer's flat all-gather output, prefetched by the unit's
    pre-backward, beside the shards; the unit's sharded gradient, the reduce-scatter's output; the
    transient). FSDP2 reshards the unit, copies its unsharded gradients into one flat fp32 reduce-scatter
    input and allocates the output; torch 2.13's ``foreach_reduce``
    (fsdp/_fully_shard/_fsdp_collectives.py) binds each gradient in turn to the loop variable of its dim-0
    check (``for i, (fsdp_param, unsharded_grad) in enumerate(...)``), which outlives the loop, so the
    unit's last parameter's unsharded gradient — the lm head's [v, h] — is alive to the function's end
    while the others are freed after the copy-in: transient = that gradient + the flat input + the
    ``incoming`` [T, h] gradient flowing to the top layer. Under ZeRO-2 (``units_reduced``) no block is
    prefetched: beside the shards, every unit but this one still gathered (measured at Llama 3.2 1B's
    widths, where this moment tops the final norm's stretch by 1.0 GB). None elsewhere (tied:
    ``tied_unit``, reduced last). Measured at Llama 3.1 8B's widths on dp 4 and 8 (s 1,024, where this
    moment tops the final norm's stretch; tests/hf/test_torchtitan_peak.py)."""
    if not units_reduced(setup) or setup.model.tied_embeddings:
        return None
    shards = setup.state_shards
    _, _, head = unit_shapes(setup.model)
    flat = fsdp2_flat_elements(head, shards)
    last = params.lm_head * unsharded_grad_bytes(setup)
    made = flat // shards * sharded_grad_bytes(setup)
    # ZeRO-2: no block gathered again, none prefetched; the shards beside the units, this one resharded
    top = layer_gather(setup, shards) if zero3_resharded(setup) else 0
    top += zero2_shards_beside(setup, params) - zero2_resharded(setup, 0)
    return top, made, last + flat * reduce_bytes(setup) + incoming
