"""What one layer keeps, by block and role, as ``analytic.moments.layer_backward``'s moments free it: the
layer's
saves (an MoE's with its MLP's), a norm's on the rank that runs it, what a norm still holds at its
backward's peak, what W_O's backward frees; the layers' saves alive at a layer's backward and those a
checkpointed segment makes again."""

from __future__ import annotations

from memplan.analytic import activations as act
from memplan.analytic.head_moments import sp_shards
from memplan.blocks.attention.core import math_dropout_core
from memplan.blocks.attention.eager_locals import eager_core_copies
from memplan.blocks.inventory import Block, Dims, Kept, Role, Scope
from memplan.blocks.moe import dense_layer_setup
from memplan.blocks.norm import python_layernorm, released_as
from memplan.config import DType, NormType, Setup


def layer_saves(setup: Setup, blocks: set[Block], roles: set[Role] | None = None) -> int:
    """Bytes one un-checkpointed layer keeps in ``blocks`` (only of ``roles`` when given), an MoE's saves
    with the MLP's (``act.layer_saves_kept``; the dense MLP's had been freed: 302 MB fewer at Mixtral)."""
    wanted, kept = blocks | ({Block.MOE} if Block.MLP in blocks else set()), act.layer_saves_kept(setup)
    return sum(k.bytes for k in kept if k.block in wanted and (roles is None or k.role in roles))


def named_saves(setup: Setup, *names: str) -> int:
    """Bytes of the layer's saves of these names (``act.layer_working_set``: ``attn.input``,
    ``attn.q_norm.input``, …), for moments that hold some saves and not others of one block."""
    return sum(k.bytes for k in act.layer_working_set(setup) if k.name in names)


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


OUTPUT_KEPT_APART = ("attn.merged_out", "attn.kernel_out")
"""Flash outputs kept apart from W_O's input (``blocks.attention.flash_rules``): torch's ring merge made
head-major, or a kernel output in q's head-major layout; W_O's input ``attn.out`` is then a copy."""


def w_o_done(setup: Setup) -> int:
    """Saves released once W_O's backward has run, before the attention core's: the residual dropout's
    mask after W_O, and W_O's input where it is a [b, s, a·d] copy nothing else holds — eager P·V's
    output, SDPA's math kernel's (``attn @ v`` cast back: neither the cast nor
    ``transpose(1, 2).contiguous()`` saves it; measured: tests/hf/test_math_core_peak.py), or a flash
    output kept apart (``OUTPUT_KEPT_APART``: torch's ring on every rank but the last,
    measured by tests/measure/test_ring_memory.py).
    NB: otherwise the flash kernel's output is that input (a view), and its own backward still needs it."""
    copied = eager_core_copies(setup) or math_dropout_core(setup)
    freed = {Role.DROPOUT_MASK} | ({Role.ATTN_OUT} if copied else set())
    done = layer_saves(setup, {Block.ATTN}, freed)
    if not copied:
        kept = [k for k in act.layer_working_set(setup) if k.block is Block.ATTN]
        if any(k.name in OUTPUT_KEPT_APART for k in kept):
            done += sum(k.bytes for k in kept if k.name == "attn.out")
    return done


def segment_rerun_bytes(setup: Setup, layers: int) -> int:
    """The saves of ``layers`` re-run layers of a checkpointed segment. Its first norm saves the kept
    input itself when it needs no upcast (LayerNorm, or fp32 activations): that storage is the
    checkpoint's, not a new one."""
    if not layers:
        return 0
    return layers * act.total_bytes(act.layer_working_set(setup)) - checkpoint_shared_bytes(setup)


def checkpoint_shared_bytes(setup: Setup) -> int:
    """The kept input a re-run segment's first norm saves as its own (LayerNorm, or fp32 activations: no
    upcast copy), or its attention's projections without a norm before them (OLMo-2: ``pre_norms`` false;
    measured at its 7B's widths under full checkpointing: one [T, h] over before), counted once, as the
    checkpoint's; else 0. Cohere's Python LayerNorm saves no input of its own, only fp32 x − mean
    (``blocks.norm.python_layernorm_rules``): measured, one [T, h] under before at Command R's widths under
    full checkpointing (tests/hf/test_cohere_peak.py)."""
    dims = Dims.of(setup)
    m = setup.model
    own = not python_layernorm(setup) and (m.norm is NormType.LAYERNORM or dims.act is DType.FP32)
    if not (own or not m.pre_norms):
        return 0
    # only where the layer keeps that input (``act.layer_saves_kept``: under fine-tuning its gradient flow's
    # saves — OLMo-2's frozen projections keep none, its q and v adapters fp32 copies; measured: one [T, h]
    # under at its 7B's widths under LoRA and full checkpointing before)
    saves = act.layer_saves_kept(setup)
    if m.pre_norms:
        kept = any(k.block is Block.ATTN_NORM and k.role is Role.NORM_INPUT for k in saves)
    else:  # W_Q/W_K/W_V's input itself (``unfused_projection_rules``), not an adapter's copy of it
        kept = any(k.name == "attn.input" for k in saves)
    return dims.tokens * dims.h * dims.act.bytes if kept else 0


def saved_layers_up_to(setup: Setup, kept: list[Kept], i: int) -> int:
    """Layer-scope saves still alive when layer i's backward runs (those of layers 0..i)."""
    k = setup.strategy.segment
    if not k and dense_layer_setup(setup) is not None:  # DeepSeek: dense first layers keep less
        return sum(act.layer_kind_bytes(setup)[: i + 1])
    one = sum(k.bytes for k in kept if k.scope is Scope.LAYER)
    if k:  # one kept input per segment of k layers, up to layer i's segment
        return (i // k + 1) * one
    return (i + 1) * one
