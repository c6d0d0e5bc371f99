"""What a forward makes once and every layer reads (one storage each): the rotary tables, the eager core's
causal mask, transformers' checkpointed attention masks, and torchtitan's whole RoPE caches under context
parallelism (``blocks.attention.rope.titan_cp_rules``)."""

from __future__ import annotations

from memplan.blocks.attention.core import fused_softmax_runs, window_masked
from memplan.blocks.attention.rope import titan_cp_rules
from memplan.blocks.attention.windows import full_and_sliding, is_sliding
from memplan.blocks.inventory import Block, Dims, Role, Rule, save
from memplan.blocks.profiles import profile_of, reentrant_checkpoint
from memplan.config import Attention, DType, PositionType, Setup

FP32, BOOL, COMPLEX64, INT64 = DType.FP32, DType.BOOL, DType.COMPLEX64, DType.INT64
B, R = Block, Role


def constant_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """Tensors made once per forward and shared by every layer (one storage each)."""
    rules: list[Rule] = titan_cp_rules(setup, dims)
    prof = profile_of(setup)
    per_layer = prof.rope_cache_per_layer or (prof.rope_tables_per_layer and not setup.strategy.segment)
    if setup.model.position is PositionType.ROPE and prof.rope_complex_table:
        why = "q·freqs_cis in complex64 (DeepSeek-V2): dq needs the table"
        rules.append(
            save(B.ROPE, "freqs_cis", (dims.s, setup.model.rotary_dims // 2), COMPLEX64, R.ROPE_TABLE, why)
        )
    elif setup.model.position is PositionType.ROPE and not per_layer:
        rot = setup.model.rotary_dims  # d, or the rotated part of each head (partial rotary)
        rot = rot // 2 if profile_of(setup).rope_half_table else rot
        table = FP32 if profile_of(setup).rope_fp32_tables else dims.act
        rules += [
            save(B.ROPE, "cos", (dims.s, rot), table, R.ROPE_TABLE, "q·cos and k·cos: dq needs cos"),
            save(B.ROPE, "sin", (dims.s, rot), table, R.ROPE_TABLE, "rotate_half(q)·sin: dq needs sin"),
        ]
        if profile_of(setup).rope_per_layer_type and full_and_sliding(setup.model):
            why = "the full-attention layers' table (the sliding layers' base differs)"
            rules += [
                save(B.ROPE, "full_cos", (dims.s, dims.d), dims.act, R.ROPE_TABLE, why),
                save(B.ROPE, "full_sin", (dims.s, dims.d), dims.act, R.ROPE_TABLE, why),
            ]
    eager = setup.strategy.attention is Attention.EAGER
    prof = profile_of(setup)
    if eager and not prof.additive_mask and not fused_softmax_runs(setup, dims):
        # Named attn.causal_mask (it belongs to the attention) but made once per forward, not per layer.
        why = "masked_fill's backward zeroes masked cells"
        rules.append(Rule("attn.causal_mask", (dims.s, dims.s), BOOL, why, B.CONST, R.CAUSAL_MASK))
    rules += checkpointed_mask_rule(setup, dims)
    return rules + checkpointed_position_ids(setup, dims)


def checkpointed_mask_rule(setup: Setup, dims: Dims) -> list[Rule]:
    """transformers' mask is an argument of every decoder layer (``GradientCheckpointingLayer``
    checkpoints ``partial(forward, self, **kwargs)``): a gradient checkpoint keeps it until backward
    (``Profile.checkpoint_keeps_mask``, ``--checkpointing full`` / ``every-k``), one storage for every
    layer. Eager: ``masking_utils.eager_mask``, ``torch.where`` of the bool mask expanded to [b, 1, s, s]
    (0 or the dtype's min), in A; SDPA: the bool window mask (an expand of one [s, s] storage), only when
    a sliding window needs it (``window_masked``). Without a checkpoint the add keeps nothing."""
    prof, eager = profile_of(setup), setup.strategy.attention is Attention.EAGER
    if not (prof.checkpoint_keeps_mask and setup.strategy.segment):
        return []
    b, s = dims.b, dims.s
    if eager and prof.additive_mask:
        shape, dtype = (b, 1, s, s), dims.act
    elif not eager and window_masked(setup, dims):
        shape, dtype = (1, 1, s, s), BOOL
    else:
        return []
    why = "attention mask bound in the checkpointed layer's partial(forward, **kwargs)"
    rules = [Rule("attn.mask", shape, dtype, why, B.CONST, R.CAUSAL_MASK)]
    if eager and full_and_sliding(setup.model):
        why = "the full-attention layers' mask, an input of theirs (the sliding layers have their own)"
        rules.append(Rule("attn.full_mask", shape, dtype, why, B.CONST, R.CAUSAL_MASK))
    return rules


def partials_bind_positions(setup: Setup) -> bool:
    """transformers' checkpointed decoder layers bind the model's position ids in their ``partial(forward,
    self, **kwargs)`` (every family passes ``position_ids=position_ids`` to its layers, GPT-2's learned
    positions too): ``Profile.checkpoint_keeps_mask``'s checkpoint, under full or every-K."""
    return profile_of(setup).checkpoint_keeps_mask and bool(setup.strategy.segment)


def checkpointed_position_ids(setup: Setup, dims: Dims) -> list[Rule]:
    """transformers' position ids, an argument of every decoder layer beside the mask: the model makes them
    once before its layers (``torch.arange(s) + past_seen_tokens``, then ``unsqueeze(0)``: one int64
    [1, s] storage whatever b) and a gradient checkpoint binds them in its ``partial(forward, self,
    **kwargs)`` (``checkpointed_mask_rule``), so they live until the lowest checkpointed layer's backward
    (reentrant: to the backward's end, ``bound_in_partials``). Without a checkpoint nothing keeps them past
    the forward (the rotary tables are made from them under no_grad); learned positions (GPT-2) pass none
    to the layers as a tensor of their own (their position table's lookup saves them: ``embed.positions``,
    which the checkpoints keep even where a frozen table saves nothing, ``strategies.lora``). Measured
    under fake tensors: 8·s B at every backward moment down to layer 0's (4,096 B at s 512:
    tests/hf/test_hf_peak.py)."""
    if not partials_bind_positions(setup) or setup.model.position is not PositionType.ROPE:
        return []
    why = "position ids bound in the checkpointed layer's partial(forward, **kwargs)"
    return [Rule("rope.position_ids", (1, dims.s), INT64, why, B.CONST, R.TOKEN_IDS)]


def released_below(setup: Setup, dims: Dims, i: int) -> int:
    """Of the tensors made once per forward for one layer kind (a full and a sliding-window kind:
    ``full_and_sliding``), those no layer at or below layer i holds, at layer i's backward (the layers
    above are done; the forward's ``causal_mask_mapping`` and ``position_embeddings_mapping`` are gone):
    the lowest holder's backward releases them.

    - The checkpointed masks (``checkpointed_mask_rule``): each bound in the partials of its kind's
      checkpointed layers (every one under ``full``, i % K == 0 under transformers' every-K).
    - Gemma-3's rotary tables per layer type (``Profile.rope_per_layer_type``): each held by its kind's
      layers (their rotary products' saves, or their checkpoint's ``position_embeddings``).

    Measured under full checkpointing (eager): at Gemma-2 2B's widths (s 512) layer 0 (sliding) below
    layer 1 (full) holds the sliding mask alone, the full one's [b, 1, s, s] (524,288 B) was over; at
    Gemma-3 1B's (s 2,048, six layers, layer 5 full) layers 0-4 hold neither the full mask nor the full
    layers' cos and sin [s, d] (2,097,152 B over beyond the mask before)."""
    m = setup.model
    if not full_and_sliding(m) or reentrant_checkpoint(setup):  # reentrant: held to the end (below)
        return 0
    k = setup.strategy.segment or 1
    kinds = {is_sliding(m, j) for j in range(i + 1)}
    checkpointed = {is_sliding(m, j) for j in range(i + 1) if j % k == 0}
    masks = checkpointed_mask_rule(setup, dims)
    freed = sum(r.bytes for r in masks if len(masks) > 1 and (r.name == "attn.mask") not in checkpointed)
    if profile_of(setup).rope_per_layer_type and not {True, False} <= kinds:
        full = "rope.full_cos", "rope.full_sin"  # the full layers'; rope.cos and rope.sin the sliding ones'
        tables = [r for r in constant_rules(setup, dims) if r.block is B.ROPE]
        freed += sum(r.bytes for r in tables if (r.name not in full) not in kinds)
    return freed


def tables_freed_by_layer0(setup: Setup, dims: Dims) -> int:
    """The rotary tables layer 0's rotary backward frees (``Profile.rope_tables_freed_by_layer0``), gone
    at the moments after it: its projections' and its attention norm's backward. Those of its own kind:
    the others' are released below their lowest layer already (``released_below``, nothing else there
    without checkpointing). Measured at Llama 3 8B's widths (s 512, no checkpointing): cos and sin [s, d]
    bf16, 262,144 B, freed before the attention norm's backward that tops layer 0's; OLMo-2 7B's fp32
    (524,288 B), Phi-3-mini's d 96, Falcon-7B's and StableLM 2's partial rotary (rot 64, 16) alike."""
    if not profile_of(setup).rope_tables_freed_by_layer0 or setup.strategy.segment:
        return 0
    tables = sum(r.bytes for r in constant_rules(setup, dims) if r.role is R.ROPE_TABLE)
    return tables - released_below(setup, dims, 0)


def bound_in_partials(setup: Setup, dims: Dims) -> int:
    """Under reentrant checkpointing (``reentrant_checkpoint``) the tables and masks every checkpointed
    layer's ``partial(forward, **kwargs)`` binds (``position_embeddings``, ``attention_mask``: the
    constants here) stay alive to the backward's end, the partial being its ``CheckpointFunction`` node's
    ``ctx.run_function``, which lives with the graph, not with the node's saved tensors; the non-reentrant
    checkpoint frees them with the lowest holder's backward (``released_below``: not under reentrant).
    Measured at the embedding's backward (two layers, s 512): Llama 3 8B's cos and sin [s, 128] bf16
    (262,144 B), Falcon-7B's and its materialised bool mask [1, 1, s, s] (393,216 B), StableLM 2's
    [s, 16] (32,768 B); the int64 [1, s] position ids the partials bind too (8·s B: under rotary
    positions one of the constants, ``checkpointed_position_ids``; under GPT-2's learned positions the
    storage the position table's lookup saves, whose backward, before the token embedding's, frees the
    save but not the partials' reference: 4,096 B at s 512). 0 elsewhere."""
    if not reentrant_checkpoint(setup):
        return 0
    learned = setup.model.position is PositionType.LEARNED and partials_bind_positions(setup)
    ids = DType.INT64.bytes * dims.s if learned else 0
    return sum(r.bytes for r in constant_rules(setup, dims)) + ids
