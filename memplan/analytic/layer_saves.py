"""What one layer keeps, by block and role, as ``analytic.layer_backward``'s moments free it: the layer's
saves (an MoE's with its MLP's), a norm's on the rank that runs it, and what a norm still holds at its
backward's peak."""

from __future__ import annotations

from memplan.analytic import activations as act
from memplan.analytic.head_moments import sp_shards
from memplan.blocks.inventory import Block, Role
from memplan.blocks.norm import python_layernorm, released_as
from memplan.config import NormType, Setup


def layer_saves(setup: Setup, blocks: set[Block], roles: set[Role] | None = None) -> int:
    """Bytes one un-checkpointed layer keeps in ``blocks`` (only of ``roles`` when given), an MoE's saves
    with the MLP's (``act.layer_saves_kept``; the dense MLP's had been freed: 302 MB fewer at Mixtral)."""
    wanted, kept = blocks | ({Block.MOE} if Block.MLP in blocks else set()), act.layer_saves_kept(setup)
    return sum(k.bytes for k in kept if k.block in wanted and (roles is None or k.role in roles))


def norm_saves(setup: Setup, norm: Block, roles: set[Role] | None = None) -> int:
    """``layer_saves`` of a layer norm as the rank holds them: torchtitan's sequence-parallel plan runs the
    norms on the rank's T/t tokens (``head_moments.sp_shards``; ``strategies.sequence_parallel`` splits
    their saves so), where ``act.layer_working_set`` is the unsequence-split layer's."""
    return layer_saves(setup, {norm}, roles) // sp_shards(setup)


def norm_saves_at_peak(setup: Setup, norm: Block) -> int:
    """The norm's own saves still alive at its backward's peak: RMSNorm has released n and rstd by then
    (its fp32 input remains); LayerNorm and torch's fused CUDA RMSNorm (``blocks.norm.released_as``) hold
    input and statistics until their one backward op ends; Cohere's Python LayerNorm all its saves, the
    normalised x and the fp32 weight copy too, to its top (``blocks.norm.python_layernorm_backward``)."""
    if python_layernorm(setup):  # all held: its first node, the weight's product's, holds normed and w32
        return norm_saves(setup, norm)
    staged = released_as(setup) is NormType.RMSNORM
    keep = {Role.NORM_INPUT} if staged else {Role.NORM_INPUT, Role.NORM_STATS}
    return norm_saves(setup, norm, keep)
