"""Rotary tables kept per layer: torchtitan's complex cache (and its rows under context parallelism), GLM's
tables made per layer; the caches torchtitan keeps whole under context parallelism, model constants
(``titan_cp_rules``). The tables made once per forward are ``blocks.attention.constants``'."""

from __future__ import annotations

from memplan.blocks.inventory import Block, Dims, Kept, Role, Rule, save
from memplan.blocks.profiles import profile_of
from memplan.config import Checkpointing, DType, PositionType, Setup

COMPLEX64, INT64 = DType.COMPLEX64, DType.INT64
B, R = Block, Role


def rope_cache_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """torchtitan's per-layer complex rotary cache (``Profile.rope_cache_per_layer``): [s, d/2] complex64,
    the cache sized to the training sequence (``Decoder.Config.update_from_config``; under context
    parallelism the whole buffer plus the rank's gathered rows); GLM's interleaved
    tables made per layer (``Profile.rope_tables_per_layer``): [s, rot] cos and sin in A."""
    if setup.model.position is not PositionType.ROPE:
        return []
    if profile_of(setup).rope_tables_per_layer:
        rot, why = setup.model.rotary_dims, "this layer's repeat_interleaved table: dq_rot needs it"
        return [
            save(B.ATTN, "rope_cos", (dims.s, rot), dims.act, R.ROPE_TABLE, f"q_rot·cos: {why}"),
            save(B.ATTN, "rope_sin", (dims.s, rot), dims.act, R.ROPE_TABLE, f"rotate_half(q_rot)·sin: {why}"),
        ]
    if not profile_of(setup).rope_cache_per_layer:
        return []
    why = "complex q·cache and k·cache: dq = dout·conj(cache) needs the cache"
    if setup.parallel.cp == 1:
        return [save(B.ATTN, "rope_cache", (dims.s, dims.d // 2), COMPLEX64, R.ROPE_TABLE, why)]
    # Context parallel: the rank's rows gathered from the layer's whole cache by position
    # (rope._reshape_for_broadcast: torch.gather [b, s/c, 1, d/2], or cache[positions] [s/c, d/2] at b = 1);
    # the caches themselves are model constants (titan_cp_rules).
    gathered = "the rank's rows of the cache, gathered by position: " + why.replace("the cache", "them")
    return [save(B.ATTN, "rope_rows", (dims.b, dims.s, dims.d // 2), COMPLEX64, R.ROPE_TABLE, gathered)]


def titan_cp_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """torchtitan under context parallelism (``prepare_context_parallel_input`` shards the inputs, labels
    and positions, not the RoPE caches): every layer's ComplexRoPE buffer stays whole, [seq, d/2] complex64,
    alive all step (L of them, one entry); a checkpointed block (non-reentrant ``checkpoint``'s
    ``save_inputs``) keeps its tensor inputs, the positions [b, s/c] int64 among them (one storage)."""
    if not (profile_of(setup).rope_cache_per_layer and setup.parallel.cp > 1):
        return []
    layers, seq = setup.model.num_layers, setup.training.seq_len
    why = "each layer's ComplexRoPE buffer [seq, d/2]: context parallelism shards the positions, not it"
    rules = [save(B.ROPE, "caches", (layers, seq, dims.d // 2), COMPLEX64, R.ROPE_TABLE, why)]
    # torchtitan's FullAC or SelectiveAC (its every-K is refused): a checkpoint_wrapper's save_inputs
    if setup.strategy.checkpointing is not Checkpointing.NONE:
        why = "the rank's positions: every checkpointed block's save_inputs keeps its tensor inputs"
        rules.append(save(B.ROPE, "positions", (dims.b, dims.s), INT64, R.TOKEN_IDS, why))
    return rules


def is_rope_cache(k: Kept) -> bool:
    """The save of a layer's torchtitan RoPE cache (``rope_cache_rules``)."""
    return k.block is Block.ATTN and k.role is Role.ROPE_TABLE and k.name == "attn.rope_cache"


def rope_buffers(setup: Setup) -> bool:
    """A layer's saved RoPE cache is its module buffer (``strategies.pipeline_parallel.Group.LAYER_BUFFER``):
    torchtitan's ``rope_cache_per_layer`` without context parallelism (under cp each forward gathers its
    own rows)."""
    return profile_of(setup).rope_cache_per_layer and setup.parallel.cp == 1
