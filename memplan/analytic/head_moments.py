"""What the head and the training loop hold at ``analytic.peak``'s moments: the head's saves freed before
the final norm's backward, torchtitan's per-layer RoPE caches and token count, and its sequence-parallel
plan's head (the final norm's saves on the rank's T/t tokens, the lm head's input gradient
reduce-scattered)."""

from __future__ import annotations

from memplan.analytic.params import ParamCount
from memplan.blocks.embedding import embedding_rules
from memplan.blocks.inventory import Block, Dims, Kept, Role
from memplan.blocks.norm import (
    norm_backward_transient,
    norm_rules,
    released_as,
)
from memplan.blocks.profiles import hidden_dropouts, made_grad_bytes, profile_of
from memplan.config import Checkpointing, LossKind, NormType, PositionType, Setup
from memplan.config.trainable import embedding_trains, final_norm_trains, input_grads_hooked

# (block, role) of the head's saves released before the final norm's backward peaks: the log-probs, the
# chunked loss's own scalars and label copies and the lm head's input (their backward has run), and an
# RMSNorm's normalised output and rstd (its backward's first ops consumed them) and Gemma's fp32 1 + w [h]
# (``Profile.norm_fp32_affine``: the product's backward, its first op, frees both operands; measured at
# Gemma 7B's widths, h·4 = 12,288 B over before); LayerNorm's one backward op holds its statistics to the end.
_HEAD_FREED_BEFORE_NORM = {
    NormType.RMSNORM: {
        (Block.LOSS, Role.LOG_PROBS),
        (Block.LOSS, Role.HEAD_INPUT_GRAD),
        (Block.LOSS, Role.HEAD_WEIGHT_GRAD),
        (Block.LOSS, Role.CHUNK_SCALAR),
        (Block.LOSS, Role.CHUNK_LABELS),
        (Block.LM_HEAD, Role.LINEAR_INPUT),
        (Block.FINAL_NORM, Role.NORM_OUTPUT),
        (Block.FINAL_NORM, Role.NORM_STATS),
        (Block.FINAL_NORM, Role.PARAM_DERIVED),
    },
    NormType.LAYERNORM: {
        (Block.LOSS, Role.LOG_PROBS),
        (Block.LOSS, Role.HEAD_INPUT_GRAD),
        (Block.LOSS, Role.HEAD_WEIGHT_GRAD),
        (Block.LOSS, Role.CHUNK_SCALAR),
        (Block.LOSS, Role.CHUNK_LABELS),
        (Block.LM_HEAD, Role.LINEAR_INPUT),
    },
}


def loss_scalars(setup: Setup) -> int:
    """Bytes of the loss's scalars alive from the final norm's backward on: the fp32 loss (4), and the
    backward's seed gradient (``torch.autograd.backward``'s ``ones_like`` of the loss, held by its frame to
    the end, + 4) where no save of the loss's stands in for it: torchtitan's loss-parallel function (tp > 1)
    and Liger's fused loss keep no fp32 normaliser, the chunked loss's are freed by then
    (``Role.CHUNK_SCALAR``); the standard loss's nll_loss total_weight, counted among the saves, is the
    same 4 B (measured on CPU: tests/measure/test_peak.py)."""
    titan_parallel = profile_of(setup).loss_parallel_function and setup.parallel.tp > 1
    seed = titan_parallel or setup.loss in (LossKind.FUSED, LossKind.CHUNKED)
    return 4 + (4 if seed else 0)


def freed_before_final_norm(k: Kept, norm: NormType) -> bool:
    """Whether a head tensor's storage is released before the final norm's backward peaks."""
    return (k.block, k.role) in _HEAD_FREED_BEFORE_NORM[norm]


def layer_rope_buffer(setup: Setup, dims: Dims) -> int:
    """One layer's torchtitan RoPE cache (``Profile.rope_cache_per_layer``, without context parallelism):
    a module buffer, [s, d/2] complex64, alive all step; the layer's save is a view of it, so once its
    saves are freed the buffer stays (the layers above a layer's backward, the embedding's backward)."""
    if not profile_of(setup).rope_cache_per_layer or setup.parallel.cp > 1:
        return 0
    return dims.s * (dims.d // 2) * 8


def rope_saved(setup: Setup) -> bool:
    """Each layer's save holds a view of its RoPE cache (``layer_rope_buffer``): torchtitan without
    activation checkpointing. Under its FullAC and SelectiveAC (every-K is refused) no layer keeps it —
    the rotary ops are re-run — so the buffers are only module state (``module_rope_buffers``)."""
    return setup.strategy.checkpointing is Checkpointing.NONE


def module_rope_buffers(setup: Setup, dims: Dims) -> int:
    """torchtitan's per-layer RoPE caches where no layer's save views them (``rope_saved``): module
    buffers, [s, d/2] complex64 a layer, alive all step beside the saves (measured: 8 MiB at Llama 3.1
    8B's widths, two layers, s 8,192 under SelectiveAC; tests/hf/test_torchtitan_peak.py)."""
    return 0 if rope_saved(setup) else dims.layers * layer_rope_buffer(setup, dims)


def frozen_embedding_leaf(setup: Setup, dims: Dims) -> int:
    """At the embedding's backward, a frozen embedding's output under transformers' checkpointing
    (``config.trainable.input_grads_hooked``): ``enable_input_require_grads`` made it a leaf that requires
    grad, which its ``AccumulateGrad`` node holds to the backward's end — where the estimate had it freed
    with layer 0's checkpoint — and its gradient [T, h], which layer 0's backward made and the leaf keeps
    as its ``.grad``: two [T, h] in the activation dtype. Without a checkpoint the output does not
    require grad and no gradient reaches it. Measured at the embedding's moment under LoRA (fake tensors,
    s 512: Llama 3 8B 8,388,608 B, GPT-2 1,572,864 B, Falcon-7B 9,306,112 B, under before; non-reentrant,
    reentrant and every-K alike; tests/hf/test_hf_peak.py)."""
    if embedding_trains(setup) or not input_grads_hooked(setup):
        return 0
    return 2 * dims.tokens * dims.h * dims.act.bytes


def hooked_embedding_held(setup: Setup, dims: Dims) -> int:
    """A frozen embedding's hooked output (``frozen_embedding_leaf``: a leaf its ``AccumulateGrad`` node
    holds to the backward's end) where layer 0 reads another tensor — GPT-2's learned positions added to
    it, Granite's embedding multiplier (``Profile.embedding_multiplied``), StarCoder2's embedding dropout
    (``hidden_dropouts``' second, p > 0) — so nothing else keeps it: one [T, h] in the activation dtype
    from the forward's end to the embedding's backward (counted there by ``frozen_embedding_leaf``).
    Measured under LoRA with checkpointing (s 512): Granite 3.0 8B's loss, final norm and layer moments
    4,194,304 B under before (the loss's −8 the labels NB); GPT-2's loss's 786,432 B; StarCoder2 3B's loss
    and final norm 3,145,728 B (its layer's and GPT-2's, half a [T, h] over after it, were the frozen MLP's
    dropout noise read as a bool mask: ``blocks.mlp.mlp_backward_transient``)."""
    learned = setup.model.position is PositionType.LEARNED
    other = learned or profile_of(setup).embedding_multiplied or hidden_dropouts(setup)[1] > 0
    if not frozen_embedding_leaf(setup, dims) or not other:
        return 0
    return dims.tokens * dims.h * dims.act.bytes


def loop_count_bytes(setup: Setup) -> int:
    """The valid-token count the trainer holds, int64 (``Profile.loss_over_token_count``: torchtitan's
    ``global_valid_tokens``, passed to the loss and kept by the training loop to the step's end)."""
    return 8 if profile_of(setup).loss_over_token_count else 0


def sp_shards(setup: Setup) -> int:
    """The ranks a sequence-parallel norm splits its tokens over (torchtitan's SP plan runs the norms on
    the rank's T/t tokens): the final norm's backward transient is one rank's share; 1 without it."""
    return setup.parallel.tp if titan_sp_head_scatter(setup) else 1


def residual_shard(setup: Setup, dims: Dims) -> int:
    """The rank's share of one [T, h] residual-stream tensor in A: [T/t, h] under torchtitan's
    sequence-parallel plan (``sp_shards``), all of it elsewhere."""
    return dims.tokens // sp_shards(setup) * dims.h * dims.act.bytes


def titan_sp_head_scatter(setup: Setup) -> bool:
    """torchtitan's sequence-parallel plan (``Profile.sp_module_gather``) on more than one rank."""
    return profile_of(setup).sp_module_gather and setup.parallel.sp and setup.parallel.tp > 1


def final_norm_released(setup: Setup, dims: Dims) -> int:
    """The final norm's saves the moment's estimate releases before its backward peaks
    (``freed_before_final_norm``: RMSNorm's normalised output, rstd and Gemma's fp32 1 + w), on the rank's
    T/t tokens under the sequence-parallel plan (its saves are sequence shards)."""
    rms = released_as(setup) is NormType.RMSNORM
    released = (Role.NORM_OUTPUT, Role.NORM_STATS, Role.PARAM_DERIVED) if rms else ()
    rules = norm_rules(setup, Block.FINAL_NORM, dims)
    return sum(r.bytes for r in rules if r.role in released) // sp_shards(setup)


def final_norm_backward(setup: Setup, dims: Dims, params: ParamCount, made: bool) -> int:
    """The final norm's backward transient (``blocks.norm.norm_backward_transient``) on the rank's T/t
    tokens; its weight's gradient, where it trains, counted among the moment's gradients when ``made``
    (Cohere's Python LayerNorm tops before that gradient is made: ``norm.python_layernorm_backward``)."""
    grad = None
    if final_norm_trains(setup):
        grad = params.final_norm * setup.training.precision.grad_bytes if made else 0
    return norm_backward_transient(setup, dims, grad) // sp_shards(setup)


def head_input_scatter_transient(setup: Setup, dims: Dims) -> int:
    """torchtitan's SP plan gathers the final norm's output for the lm head (``Replicate`` at its input,
    models/common/decoder_sharding.py), so the head's input gradient goes back through a reduce-scatter
    before the final norm's backward: the lm head's dX [T, h] in A, funcol's
    ``reduce_scatter_tensor`` input (a concatenated copy of it, [T, h]) and its output [T/t, h] (the
    wait returns that tensor): 2·T·h·A + (T/t)·h·A (measured at 405B's widths on tp 8: the stretch's top,
    tests/hf/test_torchtitan_peak.py)."""
    return 2 * dims.tokens * dims.h * dims.act.bytes + residual_shard(setup, dims)


def gather_copies(dims: Dims) -> int:
    """[T, h] copies alive as a sequence-parallel all-gather lands (funcol's ``all_gather_single`` along
    the sequence dimension): its output, gathered along dim 0, and with more than one sequence a
    micro-batch ``_maybe_view_chunk_cat``'s ``torch.cat`` into sequence order (with one, a view). The
    wait returns the collective's own tensor (c10d's ``wait_tensor``)."""
    return 2 if dims.b > 1 else 1


def sp_embedding_gather(setup: Setup, dims: Dims, params: ParamCount) -> tuple[int, int]:
    """torchtitan's SP plan leaves the embedding's output on the rank's T/t tokens, so its backward starts
    by all-gathering layer 0's input gradient: (the embedding's gradient bytes not made yet, the [T/t, h]
    shard, ``gather_copies`` [T, h] and the vocabulary mask the lookup's product saves, freed by its
    backward: ``blocks.embedding.embedding_rules``' ``embed.vocab_mask``). (0, 0) elsewhere, tied or
    frozen (the moment is the sum's). Measured at Llama 3.1 70B's widths on tp 8 (s 8,192, two sequences
    a micro-batch, FullAC, dp 1 and ZeRO-3 over dp 2: ``fsdp.moments.zero3_embedding_parts``): the
    embedding's backward tops there, 39,354,368 B above the estimate before; on the tiny model's rank (s
    64) 8,448 B (tests/hf/test_torchtitan_peak.py). NB: under the 2024 root wrapping (``--fsdp-wrap root``,
    ``analytic.fsdp.root``) not placed: the tiny model's rank 8,448 B under there."""
    if not titan_sp_head_scatter(setup) or setup.model.tied_embeddings or not embedding_trains(setup):
        return 0, 0
    mask = sum(r.bytes for r in embedding_rules(setup, dims) if r.name == "embed.vocab_mask")
    gathered = gather_copies(dims) * dims.tokens * dims.h * dims.act.bytes
    return params.embedding * made_grad_bytes(setup), residual_shard(setup, dims) + gathered + mask
