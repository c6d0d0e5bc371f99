"""A layer's backward beyond what the layers above and below keep: the transient of its backward (the
attention's and the MLP's gradients in flight, a reversible layer's re-run, a checkpointed layer's
re-run working set and what it saves again), the saves of the layers up to it, and a re-run segment's
bytes — the terms ``analytic.peak``'s layer moments add (its module docstring gives the moments)."""

from __future__ import annotations

from collections.abc import Iterable

from memplan.analytic import activations as act
from memplan.analytic.head_moments import layer_rope_buffer, residual_shard, sp_shards
from memplan.analytic.moments import lora_mlp, reentrant
from memplan.analytic.moments import post_norms as pn
from memplan.analytic.moments.input_free import input_needs_no_gradient, no_input_gradient_moments
from memplan.analytic.moments.layer_saves import (
    layer_saves,
    norm_saves,
    norm_saves_at_peak,
    segment_rerun_bytes,
    w_o_done,
)
from memplan.analytic.moments.qk_norms import per_head_norms_apply, per_head_qk_norm_moments
from memplan.analytic.moments.qkv_backward import fused_qkv_input_gradient, mlp_gradient_waits
from memplan.analytic.moments.rotary_backward import fp32_rotary_moment
from memplan.analytic.moments.sp_moments import sp_mlp, sp_mlp_moments, sp_rerun_scatter
from memplan.analytic.params import ParamCount
from memplan.blocks.attention.constants import tables_freed_by_layer0
from memplan.blocks.attention.core import (
    attention_core_rules,
    fp32_softmax_gradients,
    math_backward_buffers,
    math_dropout_core,
    mqa_value_gradient_over_save,
    projection_rules,
    sdpa_kv_heads,
    sink_backward_extra,
)
from memplan.blocks.attention.eager_locals import eager_core_copies, eager_forward_extra
from memplan.blocks.attention.mla import value_save_over_gradient
from memplan.blocks.attention.ring_memory import ring_backward_transient
from memplan.blocks.attention.workspace import flash_backward_workspace, softmax_backward_scratch
from memplan.blocks.inventory import Block, Dims, Kept, Role, Scope
from memplan.blocks.mlp import (
    mlp_backward_transient,
)
from memplan.blocks.moe import backward as moe_backward
from memplan.blocks.moe import mlp_backward_extra
from memplan.blocks.norm import norm_backward_transient, python_layernorm_over
from memplan.blocks.profiles import accumulates_in_place, checkpoints_alone, profile_of, top_layer_grads
from memplan.config import Attention, Checkpointing, Setup
from memplan.config.finetune import ATTN_TARGETS, MLP_TARGETS, Target


def attention_backward_transient(setup: Setup, dims: Dims, params: ParamCount) -> int:
    """Attention backward, after the MLP's: its saved tensors are freed, the MLP and W_O gradients exist;
    two [b, a, s, s] softmax gradients (eager; the dropped probabilities and V were released with P·V's
    backward, whose dV is still alive; on CUDA the softmax backward's own product,
    ``softmax_backward_scratch``; transformers' fp32 softmax, ``fp32_softmax_gradients``; MLA's v a view
    of a wider tensor, ``value_save_over_gradient``) or dq, dk, dv and dO (flash; on CUDA with the
    kernel's own workspace, ``flash_backward_workspace``; under context parallelism what torch's ring
    holds instead, ``ring_memory.ring_backward_transient``) or, SDPA's math kernel with dropout, fp32 dO,
    dV and d(attn) (``math_backward_buffers``), plus the incoming dY [T, h].
    W_O's backward has run (``w_o_done``): its input and the residual dropout mask after it are freed."""
    a_bytes = dims.act.bytes
    t = dims.tokens
    if setup.strategy.attention is Attention.EAGER:
        scores = dims.b * dims.a * dims.s * dims.s * a_bytes
        buffers = 2 * scores - (scores if setup.model.attn_dropout > 0 else 0)
        buffers += softmax_backward_scratch(setup, dims) + sink_backward_extra(setup, dims)
        buffers += fp32_softmax_gradients(setup, dims) - value_save_over_gradient(setup, dims)
        buffers += mqa_value_gradient_over_save(setup, dims)
    elif math_dropout_core(setup):  # SDPA's math kernel: fp32 dO, dV and d(attn) at P·V's backward
        buffers = math_backward_buffers(dims)
    else:
        ring = ring_backward_transient(setup, dims)
        if ring:  # dO, and what torch's ring holds (its accumulators, the K/V in flight, dq, dk, dv)
            buffers = t * dims.a * dims.d * a_bytes + ring
        else:
            buffers = (2 * t * dims.a * dims.d + 2 * t * sdpa_kv_heads(setup, dims) * dims.d) * a_bytes
            buffers += flash_backward_workspace(setup, dims)
    done = _mlp_done(setup, params) - w_o_done(setup) + pn.post_norm_done(setup, Block.POST_ATTN_NORM)
    # A parallel layer whose MLP norm runs before the attention (one norm for both branches, or Falcon's
    # ln_mlp): the MLP's input gradient [T, h] waits through the attention's backward (for W_QKV's dX)
    waiting = t * dims.h * a_bytes if mlp_gradient_waits(setup) else 0
    done += mlp_norm_not_run(setup, params)
    return t * dims.h * a_bytes + buffers + done + waiting + reversible_f_extra(setup, dims)


def mlp_norm_not_run(setup: Setup, params: ParamCount) -> int:
    """Where the MLP's norm runs before the attention in a parallel layer with two norms (Falcon-40B's
    ``ln_mlp``, ``qkv_backward.mlp_gradient_waits``), its backward runs after the attention's and W_QKV's:
    at those moments its saves are still held and its weight gradients not made, which ``_mlp_done``
    counts as done (0 with one norm for both branches: it has none of its own). Measured at Falcon-40B's
    widths (two layers): 32,768 − 4·T B over before at s 1,024 and 4,096, flash and eager; exact now."""
    if not mlp_gradient_waits(setup):
        return 0
    return norm_saves(setup, Block.MLP_NORM) - top_layer_grads(setup, params.layer.mlp_norm)


def reversible_f_extra(setup: Setup, dims: Dims) -> int:
    """While a reversible layer runs F's (the attention's) backward: six [T, h] more than a plain layer
    holds — dy1 and dy2 held by the caller, the new dy1, G's input gradient, x2 = y2 − g and F's output
    (see ``attention_rerun_transient``)."""
    return 6 * dims.tokens * dims.h * dims.act.bytes if setup.strategy.reversible else 0


def _mlp_done(setup: Setup, params: ParamCount) -> int:
    """Once the MLP's backward has run: its gradients are made and its saved tensors freed (a negative
    change of the live set, plus the gradients), the post-MLP norm's before them (``post_norm_done``)."""
    layer = params.layer
    grads = top_layer_grads(setup, layer.mlp + layer.mlp_norm + layer.o_proj, {*MLP_TARGETS, Target.O})
    freed = layer_saves(setup, {Block.MLP}) + norm_saves(setup, Block.MLP_NORM)
    return grads - freed + pn.post_norm_done(setup, Block.POST_MLP_NORM)


def residual_gradient(setup: Setup, dims: Dims) -> int:
    """The residual branch's gradient [T, h] alive through a pre-norm's backward (``layer_backward_
    transient``); none for a reversible layer, whose stack holds its own (``reversible_f_extra``)."""
    return 0 if setup.strategy.reversible else dims.tokens * dims.h * dims.act.bytes


def rope_view_kept(setup: Setup, dims: Dims) -> int:
    """Of the attention's saves freed at its end (``attn_saved_bytes``), the bytes no storage gives back:
    the layer's save of torchtitan's RoPE cache is a view of the layer's module buffer
    (``head_moments.layer_rope_buffer``), which stays. Not under its per-op SelectiveAC, whose
    re-run working set counts that view among the saves made again (``op_selective_working``), so its
    freeing is that count's end (measured: the attention norm's moment exact at one sequence a
    micro-batch at Llama 3.1 8B's widths)."""
    selective = setup.strategy.checkpointing is Checkpointing.SELECTIVE
    if selective and profile_of(setup).op_selective_checkpoint:
        return 0
    return layer_rope_buffer(setup, dims)


def attn_saved_bytes(setup: Setup) -> int:
    """One layer's attention saves (its norm's apart), the residual dropout masks with them."""
    return layer_saves(setup, {Block.ATTN}) + layer_saves(setup, {Block.MLP}, {Role.DROPOUT_MASK})


def not_yet_rerun(setup: Setup, dims: Dims) -> int:
    """Saves counted in the layer's working set that are not there yet while its MLP's backward runs.

    A reversible layer re-runs G (the MLP) and runs its backward before it re-runs F (the attention), and
    meanwhile G's output g and the second output gradient dy1 are alive beside dy2 ([T, h] each); a
    selectively checkpointed attention core is re-run only when its own backward comes.
    """
    if setup.strategy.reversible:
        return attn_saved_bytes(setup) + attn_norm_saved(setup) - 2 * dims.tokens * dims.h * dims.act.bytes
    if setup.strategy.checkpointing is Checkpointing.SELECTIVE:
        return recompute_working_set(setup)
    return 0


def mlp_moment(setup: Setup, dims: Dims) -> int:
    """The MLP backward's rise above the layer's live set (working set included), the post-MLP norm's
    backward done before it (``post_norm_done``)."""
    before = pn.post_norm_done(setup, Block.POST_MLP_NORM) - not_yet_rerun(setup, dims)
    if moe_backward.applies(setup):  # a mixture of experts' MLP, its backward replayed op by op
        return moe_backward.rise(setup, act.layer_saves_kept(setup)) + before
    sp = sp_mlp(setup)
    rise = max(sp_mlp_moments(setup, dims).values()) if sp else mlp_backward_transient(setup, dims)
    return rise + before


def layer_backward_transient(setup: Setup, dims: Dims, params: ParamCount, bottom: bool = False) -> int:
    """The largest rise above the layer's live set among its backward's moments: the MLP, the MLP's
    norm (MLP saves freed), the attention core (or a reversible layer's attention re-run) and the
    attention norm (the whole layer's gradients made, the attention's saves freed but for its norm's).

    At either norm's backward the residual branch's gradient [T, h] waits beside it in autograd's input
    buffer of the norm's input, to be summed with the norm's input gradient once its backward ends: the
    layer's output gradient at the MLP norm's (the MLP's incoming dY, the same tensor), the sum of the two
    at the attention norm's (``residual_gradient``). By then the MLP norm's own input is freed.
    Measured on torchtitan's rank at one sequence a micro-batch, where the attention norm's moment is the
    layer's top (the weight gradients outweigh the MLP's [T, f] buffers): exact on the tiny model and at
    Llama 3.1 8B's and 3.2 1B's widths (s 1,024 and 512) without AC, under FullAC and SelectiveAC, but the
    tiny model under SelectiveAC (1,024 B over); before, one [T, h] under at the tiny model's bottom layer,
    one over at 8B's top (its fp32 MLP-norm input counted, the residual gradient not)
    (tests/hf/test_torchtitan_peak.py). ``bottom``: layer 0's, the moments after its rotary backward
    less the tables it frees (``attention.constants.tables_freed_by_layer0``)."""
    layer = params.layer
    # W_O's gradient is not made yet at the MLP norm's backward: the residual sum before the MLP norm
    # waits for that norm's input gradient before the attention's backward (W_O first) can run
    w_o = top_layer_grads(setup, layer.o_proj, {Target.O})
    mlp_done = _mlp_done(setup, params) - w_o
    mlp_norm_input = norm_saves_at_peak(setup, Block.MLP_NORM)
    # on the rank's T/t tokens under torchtitan's sequence parallelism (the residual stream is sharded)
    norm_bwd = (norm_backward_transient(setup, dims) + residual_gradient(setup, dims)) // sp_shards(setup)
    mlp_norm = norm_bwd + mlp_done + mlp_norm_input
    # the post-attention norm's backward next (Gemma-2's, Gemma-3's, OLMo-2's), the MLP norm's input freed
    post_attn = mlp_norm - mlp_norm_input + pn.at_norm_peak(setup, Block.POST_ATTN_NORM)
    rest_grads = top_layer_grads(
        setup,
        layer.o_proj + layer.q_proj + layer.k_proj + layer.v_proj + layer.attn_norm + layer.qk_norm,
        ATTN_TARGETS,
    )
    attn_norm = (
        mlp_norm
        - mlp_norm_input  # freed once the MLP norm's backward has run
        + rest_grads  # the MLP's and its norm's are in mlp_done already
        - attn_saved_bytes(setup)
        + rope_view_kept(setup, dims)
        - attn_norm_saved(setup)
        + norm_saves_at_peak(setup, Block.ATTN_NORM)
        + reversible_f_extra(setup, dims)
        + python_layernorm_over(setup, dims, layer.attn_norm) // sp_shards(setup)  # its grad in rest_grads
        + pn.post_norm_done(setup, Block.POST_ATTN_NORM)
    )
    normed_in = setup.model.pre_norms or not setup.model.qk_norm_whole
    norm_grad = top_layer_grads(setup, layer.attn_norm)
    # W_QKV's dX runs before a late MLP norm's backward (``mlp_norm_not_run``)
    qkv = attn_norm + fused_qkv_input_gradient(setup, dims, norm_grad) + mlp_norm_not_run(setup, params)
    # OLMo-2 (no pre-norms): no MLP norm; its last norms are the whole-width q/k norms, no attention norm's
    last = [qkv, attn_norm] if normed_in else pn.whole_qk_norm_moments(setup, dims, params, attn_norm)
    # Qwen3's q_norm and k_norm chains, before the attention norm's
    qk_norms = (
        per_head_qk_norm_moments(setup, dims, params, attn_norm) if per_head_norms_apply(setup, dims) else []
    )
    core = attention_backward_transient(setup, dims, params)
    if input_needs_no_gradient(setup, dims):  # its input's gradient neither made nor summed (docstring)
        residual = residual_gradient(setup, dims)
        core -= residual
        last = no_input_gradient_moments(setup, dims, attn_norm, norm_grad, residual)
        qk_norms = [m - residual for m in qk_norms]  # no residual gradient waits for the input's
    last += qk_norms
    freed = tables_freed_by_layer0(setup, dims) if bottom else 0  # after the rotary backward
    # Reentrant checkpointing's frame holds the re-run output through the backward, and the layer's
    # output gradient past the residual sum below the MLP's norm (``analytic.moments.reentrant``).
    output, gradient = reentrant.held_output(setup, dims), reentrant.held_gradient(setup, dims)
    mlp_side = [
        mlp_moment(setup, dims),
        lora_mlp.down_backward(setup, dims),  # peft's fp32 adapters on the MLP: W_down's A backward
        lora_mlp.up_backward(setup, dims),  # and the first linear's scaled gradient
        # a shared norm (Cohere, Falcon) runs its backward once, after the attention's: no MLP-norm moment
        mlp_norm - not_yet_rerun(setup, dims) if normed_in and not setup.model.shared_norm else None,
        pn.post_mlp_norm_moment(setup, dims, residual_gradient(setup, dims) - not_yet_rerun(setup, dims)),
    ]
    attention_side = [
        post_attn - not_yet_rerun(setup, dims) if setup.model.post_norms else None,
        core,
        fp32_rotary_moment(setup, dims, core, freed),  # Cohere's rotation in fp32, after the core's
        *(m - freed for m in last),
    ]
    moments = [
        *(m + output for m in mlp_side if m is not None),
        *(m + output + gradient for m in attention_side if m is not None),
        sp_rerun_scatter(setup, dims),
        attention_rerun_transient(setup, dims, params),  # the re-run's forward: no output made yet
        lora_mlp.rerun_forward(setup, dims),  # the re-run at W_up's fp32 adapter
        selective_rerun_transient(setup, dims, params),
        selective_softmax_backward(setup, dims, params),
    ]
    # None: a moment only some layers have, which this one does not. (Each had been 0, itself a moment —
    # the whole live and working set —, which won where every rise is negative: a selective layer's with
    # its gradients summed into an earlier micro-batch's, one [T, h] over at h 64, s 64, b 2.)
    return max(m for m in moments if m is not None)


def selective_rerun_transient(setup: Setup, dims: Dims, params: ParamCount) -> int | None:
    """A selectively checkpointed eager core re-run at its backward, at its softmax: W_O's backward is
    done (``_mlp_done``, ``w_o_done``), dY [T, h] and the core's output gradient [T, a·d] are alive, the
    core's saves are back (the working set) and the scaled and the masked scores [b, a, s, s] are alive
    beside the probabilities.
    None: no selective eager core. NB: with attention dropout the re-run and P·V's backward are not
    modelled apart: 0, the working set back and nothing beside it, a floor (measured up to +0.7 % above)."""
    eager = setup.strategy.attention is Attention.EAGER
    if setup.strategy.checkpointing is not Checkpointing.SELECTIVE or not eager:
        return None
    if setup.model.attn_dropout:
        return 0
    a_bytes, t = dims.act.bytes, dims.tokens
    scores = dims.b * dims.a * dims.s * dims.s * a_bytes
    grads_in = t * dims.h * a_bytes + t * dims.a * dims.d * a_bytes
    done = _mlp_done(setup, params) - w_o_done(setup) + pn.post_norm_done(setup, Block.POST_ATTN_NORM)
    return grads_in + 2 * scores + done


def selective_softmax_backward(setup: Setup, dims: Dims, params: ParamCount) -> int | None:
    """The same re-run core at its softmax's backward: P·V's backward has made dP [b, a, s, s] and dV, and
    freed the core's output gradient [T, a·d] and (its last use) the V copy that dV equals in size; the
    softmax backward makes dS. Against the re-run's softmax (``selective_rerun_transient``): dP and dS for
    the scaled and masked scores, less the output gradient — below it by T·a·d elements on CPU (measured by
    tests/measure/test_peak.py), above it on CUDA by the op's own product (``softmax_backward_scratch``)."""
    rerun = selective_rerun_transient(setup, dims, params)
    if rerun is None or setup.model.attn_dropout:
        return rerun
    out_grad = dims.tokens * dims.a * dims.d * dims.act.bytes
    return rerun - out_grad + softmax_backward_scratch(setup, dims)


def attention_rerun_transient(setup: Setup, dims: Dims, params: ParamCount) -> int | None:
    """A layer's attention forward re-run in backward, above the layer's live set (its MLP not re-run).

    Reversible: the MLP's backward is done (``_mlp_done``) and six [T, h] are alive beside the rebuilt
    inputs (``reversible_f_extra``). A checkpointed segment's layer: its MLP's saves and its attention's
    residual dropout mask do not exist yet.
    Both add eager attention's forward locals (``eager_forward_extra``). None: neither.
    """
    if setup.strategy.reversible:
        rerun = reversible_f_extra(setup, dims) + _mlp_done(setup, params)
    elif setup.strategy.segment:
        # Not made yet at the core's softmax: the MLP's saves and the residual dropout mask after W_O.
        later = layer_saves(setup, {Block.MLP, Block.MLP_NORM})
        rerun = -later - layer_saves(setup, {Block.ATTN}, {Role.DROPOUT_MASK})
    else:
        return None
    return rerun + eager_forward_extra(setup, dims)


def attn_norm_saved(setup: Setup) -> int:
    return norm_saves(setup, Block.ATTN_NORM)


def recompute_working_set(setup: Setup) -> int:
    """Activations a re-run segment (k layers), a reversible layer or a selective attention core rebuilds
    in backward, alive while that layer's backward runs."""
    dims = Dims.of(setup)
    if setup.strategy.checkpointing is Checkpointing.SELECTIVE:
        plain = setup.model_copy(
            update={"strategy": setup.strategy.model_copy(update={"checkpointing": Checkpointing.NONE})}
        )
        # The core's own saves (eager: contiguous q, k, v copies and the probabilities; flash: lse) come
        # back beside the q, k, v the checkpoint keeps (only the projections' shared input is not new).
        core = projection_rules(plain, dims)[1:] + attention_core_rules(plain, dims)
        if profile_of(setup).qkv_views:
            # Megatron: the re-run's q, k, v are the checkpoint's own (views): only GQA's repeats are new.
            kept = {(r.name, r.shape) for r in projection_rules(setup, dims)}
            return sum(r.bytes for r in core if (r.name, r.shape) not in kept)
        new = sum(r.bytes for r in core)
        return new - (0 if eager_core_copies(setup) else _flash_kept(setup, dims))
    if setup.strategy.reversible:
        # One layer's saves, and the rebuilt inputs x1, x2 beside the stack outputs.
        return act.total_bytes(act.layer_working_set(setup)) + 2 * dims.tokens * dims.h * dims.act.bytes
    # transformers' every_n_layers re-runs one layer per checkpoint (``checkpoints_alone``).
    return segment_rerun_bytes(setup, 1 if checkpoints_alone(setup) else setup.strategy.segment)


_TERMS: dict[tuple[object, ...], tuple[int, int, int]] = {}
_TERMS_MAX = 8192


def layer_terms(
    setup: Setup, params: ParamCount, kept: Iterable[Kept] = (), bottom: bool = False
) -> tuple[int, int]:
    """(``layer_backward_transient``, ``recompute_working_set``) of ``setup`` — what ``analytic.peak``'s
    layer moments add — memoised on ``activations.rank_key`` (every field but the ZeRO stage, dp and the
    micro-batch count: the blocks' rules and this module read none of them but through
    ``accumulates_in_place``, which the key carries) and on one layer's parameters (the only part of
    ``params`` they read). tests/plan/test_fit_memos.py checks the memo against the two
    functions across ZeRO stages, dp degrees and micro-batch counts. ``kept``: the layer saves the
    estimate keeps (``Pieces.kept``), for torchtitan's per-op SelectiveAC (``op_selective_working``);
    ``bottom``: layer 0's transient (``layer_backward_transient``'s)."""
    key = (*act.rank_key(setup), params.layer, accumulates_in_place(setup))
    found = _TERMS.get(key)
    if found is None:
        if len(_TERMS) >= _TERMS_MAX:
            _TERMS.clear()
        dims = Dims.of(setup)
        working = 0 if setup.strategy.segment else recompute_working_set(setup)
        transient = layer_backward_transient(setup, dims, params)
        freed = tables_freed_by_layer0(setup, dims)  # layer 0's: its rotary backward frees the tables
        low = layer_backward_transient(setup, dims, params, bottom=True) if freed else transient
        if (moe := unreplayed_moe_moment(setup, dims)) is not None:
            transient, low = max(transient, moe), max(low, moe)
        found = _TERMS[key] = (transient, working, low)
    transient, working, low = found
    return low if bottom else transient, op_selective_working(setup, kept, working)


def unreplayed_moe_moment(setup: Setup, dims: Dims) -> int | None:
    """The dense reading of an MoE MLP's backward where ``blocks.moe.backward`` does not replay it (not
    measured): the dense MLP's moment with the experts' S-slot gradient buffers
    (``blocks.moe.mlp_backward_extra``); None for a dense layer or a replayed MoE one (its moment is among
    ``layer_backward_transient``'s, which may be negative: a layer whose gradients are summed). Part of
    each layer kind's own terms (``layer_kinds.layer_kind_terms``): before, it was added to whichever
    layer's moment was the largest, a dense one's too."""
    moe = setup.model.moe
    if moe is None or moe_backward.applies(setup):
        return None
    return mlp_moment(setup, dims) + mlp_backward_extra(setup, moe)


def op_selective_working(setup: Setup, kept: Iterable[Kept], working: int) -> int:
    """The working set of a block re-run under torchtitan's per-op ``SelectiveAC``
    (``Profile.op_selective_checkpoint``; ``kept``: the estimate's saves, the policy's cache among them):
    ``checkpoint_wrapper`` re-runs the block's forward in its backward, every op but the cached ones
    (every other mm's output, the SDPA op's on CUDA) making its output again, so what the un-checkpointed
    layer would save is alive again less the cache, which is alive already (one layer's kept bytes but the
    block input the wrapper keeps, which the un-checkpointed layer does not save). ``working`` elsewhere
    (the attention core's re-run of Korthikanti's selective recompute, ``recompute_working_set``).
    Measured on torchtitan's rank (no tp, ZeRO-3): the layer moment exact at Llama 3.1 8B's widths (s
    1,024, dp 4) and on the tiny model, at Llama 3.2 1B's (s 512, tied or not) one [s, d/2] complex64 RoPE
    slice under (131,072 B); before, 327 MB, 132,608 B and 92 MB under.
    Under torchtitan's SP plan the re-run's norms save on T/t tokens (``rank_working_set``): 16,779,264 B
    over before at 8B's widths on tp 2 (s 256), exact now. NB: on the tiny model's tp 2 + SP rank (s 32)
    11,264 B under at two sequences a micro-batch, 1,536 B over at one; at 8B's widths (s 1,024)
    262,144 B over: not found."""
    selective = setup.strategy.checkpointing is Checkpointing.SELECTIVE
    if not selective or not profile_of(setup).op_selective_checkpoint:
        return working
    one = sum(k.bytes for k in kept if k.scope is Scope.LAYER and k.count)
    if not one:
        return working
    # of one layer's kept bytes the cache alone: not the block's input, which the wrapper keeps and the
    # un-checkpointed layer does not save (``strategies.checkpointing.op_selective_rules``' first)
    dims = Dims.of(setup)
    block_input = residual_shard(setup, dims)  # under SP the rank's shard
    return rank_working_set(setup) - (one - block_input)


def rank_working_set(setup: Setup) -> int:
    """One un-checkpointed layer's saves as the rank holds them: ``act.layer_working_set`` with the
    norms' on the rank's T/t tokens under torchtitan's sequence-parallel plan (``norm_saves``)."""
    norms = {Block.ATTN_NORM, Block.MLP_NORM}
    unsplit = layer_saves(setup, norms)
    return act.total_bytes(act.layer_working_set(setup)) - unsplit + sum(norm_saves(setup, n) for n in norms)


def clear_terms() -> None:
    """Forget ``layer_terms``' memo (cold-start benchmarks)."""
    _TERMS.clear()


def _flash_kept(setup: Setup, dims: Dims) -> int:
    """Flash re-runs on the kept q, k, v themselves: they are not new."""
    return sum(r.bytes for r in projection_rules(setup, dims)[1:])
