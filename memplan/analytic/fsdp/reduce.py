"""FSDP2's reduce-scatter under its mixed precision: where it is modelled, its dtype, and the input the
default stream holds beside a unit's backward (torch 2.13's ``foreach_reduce``; the streams, the lines
and the replay of the reduce-scatter stream's pool: ``analytic.fsdp.buffers``). Apart from that module so
the peak's moments (``analytic.peak``) read it without importing the stream replays."""

from __future__ import annotations

from memplan.analytic.optimizer_step import Shape, _layer_shapes
from memplan.blocks.torchtitan import FSDP2_MIXED_BYTES, fsdp2_flat_elements, fsdp2_mixed
from memplan.blocks.torchtitan import unit_shapes as titan_unit_shapes
from memplan.config import FsdpWrap, Impl, Setup


def block_shapes(setup: Setup) -> list[Shape]:
    """One block's parameters as FSDP2 holds them in its unit (``setup``'s model: the rank's):
    torchtitan's, with its fused ``wqkv`` (``blocks.torchtitan.unit_shapes``), or the reference layer's."""
    if setup.impl.impl is Impl.TORCHTITAN:
        return titan_unit_shapes(setup.model)[1]
    return _layer_shapes(setup.model)


def root_wrapped(setup: Setup) -> bool:
    """The units hang under a root unit that holds the embedding, the final norm and the head, which the
    backward reduces last: memplan's reference wrapping, and torchtitan's of 2024 (``--fsdp-wrap root``);
    not torchtitan 0.3.0's, whose root holds nothing (``analytic.fsdp.buffers``)."""
    return setup.impl.impl is Impl.REFERENCE or (
        setup.impl.impl is Impl.TORCHTITAN and setup.impl.fsdp_wrap is FsdpWrap.ROOT
    )


def reduce_bytes(setup: Setup) -> int:
    """Bytes of one element FSDP2 reduce-scatters in under its mixed precision: ``--reduce-dtype``, else
    the policy's ``reduce_dtype=float32`` (torchtitan's ``mixed_precision_reduce`` default)."""
    chosen = setup.strategy.reduce_dtype
    return chosen.bytes if chosen is not None else 4


def unsharded_grad_bytes(setup: Setup) -> int:
    """Bytes of one element of an unsharded gradient FSDP2 reduces: the gathered parameters' dtype under
    its mixed precision (``blocks.torchtitan.fsdp2_mixed``), else the recipe's gradient."""
    p = setup.training.precision
    return p.weight_bytes if fsdp2_mixed(setup) else p.grad_bytes


def sharded_grad_bytes(setup: Setup) -> int:
    """Bytes of one element of a sharded gradient (the reduce-scatter's output, cast to the sharded
    parameters' dtype): fp32 under FSDP2's mixed precision, else the recipe's gradient."""
    return FSDP2_MIXED_BYTES if fsdp2_mixed(setup) else setup.training.precision.grad_bytes


def reduce_scatter_modelled(setup: Setup) -> bool:
    """FSDP2's reduce-scatter buffers are modelled: its mixed precision (``--precision fsdp2-mixed``, or
    ``--impl torchtitan``'s bf16-mixed under FSDP2: ``blocks.torchtitan.fsdp2_mixed``) on units memplan
    models (``analytic.fsdp.buffers.unit_shapes``: sharded over more than one rank, every parameter
    trained; under tensor parallelism torchtitan's, whose units are each rank's TP-local parameters, as
    ``foreach_reduce`` reduces their DTensor gradients' local tensors — not the reference's, whose moments
    under tp are not measured with FSDP2's mixed precision). There the sharded gradients are the
    reduce-scatter stream's blocks, not the default stream's (``analytic.fsdp.buffers``)."""
    return (
        fsdp2_mixed(setup)
        and setup.impl.impl in (Impl.REFERENCE, Impl.TORCHTITAN)
        and setup.state_shards > 1
        and (setup.parallel.tp == 1 or setup.impl.impl is Impl.TORCHTITAN)
        and setup.finetune.trains_everything
    )


def reduce_scatter_input(setup: Setup, i: int, layers: int) -> int:
    """Bytes of the default stream's reduce-scatter input held beside layer i's backward (i = −1: the
    embedding's backward) under a root wrapping (``root_wrapped``) and FSDP2's mixed precision: the unit
    reduced before it — layer i + 1 (layer 0 beside the embedding); none beside the top layer, whose unit
    above is the root, reduced last (it holds the embedding). Flat, each dim 0 padded to the shard count
    (``blocks.torchtitan.fsdp2_flat_elements``), in the reduce dtype. torchtitan's moments count theirs
    (``analytic.fsdp.moments.zero3_unit_buffers``)."""
    if not root_wrapped(setup) or not reduce_scatter_modelled(setup) or i + 1 >= layers:
        return 0
    shards = setup.state_shards
    return fsdp2_flat_elements(block_shapes(setup), shards) * reduce_bytes(setup)
