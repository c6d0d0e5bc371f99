"""The per-rank pieces of an estimate: one micro-batch on one tensor-parallel rank, every layer.

``pieces(core)`` is the blocks' inventory of the rank's model (``strategies.tensor_parallel.tp_model``)
under ``STRATEGIES`` in order, with what the peak needs (group bytes, the layer-backward correction). They
do not depend on pp, dp, ZeRO or the number of micro-batches, so the engine caches them on the fields
they do depend on (``pieces_by_key``); ``whole_flops`` is the whole model's FLOPs of one micro-batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from memplan.analytic import activations as act
from memplan.analytic.flops import Flops, flops
from memplan.analytic.moments import layer_backward as lb
from memplan.analytic.params import ParamCount, count_params
from memplan.blocks.attention.rope import is_rope_cache, rope_buffers
from memplan.blocks.inventory import Dims, Kept
from memplan.blocks.norm import released_as
from memplan.blocks.profiles import checkpoints_alone, profile_of
from memplan.config import Checkpointing, Impl, ModelConfig, Setup, ZeroStage
from memplan.strategies import (
    Strategy,
    checkpointing,
    context_parallel,
    lora,
    reversible,
    sequence_parallel,
)
from memplan.strategies.lora_flow import flows
from memplan.strategies.pipeline_parallel import (
    Group,
    clear_placements,
    group_of,
    rope_caches,
)
from memplan.strategies.tensor_parallel import tp_model


# ----------------------------------------------------------------------------------------------------
# Per-rank pieces (cached: they do not depend on pp, dp, ZeRO or the number of micro-batches)
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Pieces:
    """One micro-batch on one tensor-parallel rank, every layer: the inventory and what the peak needs."""

    core: Setup
    """The whole model's setup with ZeRO 0, dp 1, one micro-batch, one pipeline stage (what the pieces
    depend on)."""
    setup: Setup
    """The rank's setup: ``tp_model``, ZeRO 0, dp 1, one micro-batch."""
    kept: tuple[Kept, ...]
    params: ParamCount
    """The rank's parameters, whole model; an MoE layer's ``mlp`` = router + local experts + shared."""
    expert_params: int
    """Routed-expert parameters of one layer on this rank (ZeRO-sharded over dp/ep)."""
    group_bytes: dict[Group, int]
    """Bytes of one instance of each group's tensors (one layer, one micro-batch)."""
    layer_correction: int
    """What ``analytic.peak`` cannot see in the layer-backward moment: a re-run layer's saves under MoE and
    sequence parallelism. An MoE's dense-reading gradient buffers, once added here to whichever layer's
    moment was the largest, are its kind's own term now (``layer_backward.unreplayed_moe_moment``)."""
    layer_bytes: tuple[int, ...] = ()
    """Fine-tuning: each layer's bytes (they differ along the gradient flow); ``group_bytes`` the largest."""
    alone_layers: tuple[int, ...] = ()
    """transformers' every-K (``Profile.checkpoints_alone``): each layer's bytes, the checkpoint's input
    where i % K == 0, its saves elsewhere (``analytic.every_k``)."""
    rerun_layers: tuple[int, ...] = ()
    """Checkpointed segments: what each layer keeps when re-run, as the rank holds it (fine-tuning's along
    the gradient flow; layers of two kinds each their kind's, ``activations.layer_kind_setups``; else one
    value for every layer, MoE's and sequence parallelism's changes in it):
    ``analytic.every_k.rerun_bytes`` sums the re-run layers'. Before, one layer's full-training working
    set was counted for each and ``layer_correction`` took the difference off k times, right only at a
    segment's top: a frozen layer re-run under ``--freeze`` was charged a trainable one's saves."""
    rates: dict[tuple[object, ...], object] = field(default_factory=dict, compare=False, repr=False)
    """What the time layer derives from the same fields per layer (``time.compute.layer_rates``, by GPU and
    peak), memoised here: made once for every pipeline layout, ZeRO stage and dp of these pieces, and
    forgotten with them (``clear_caches``)."""


def core_of(setup: Setup) -> Setup:
    """The setup without what the pieces do not depend on (ZeRO, dp, micro-batches, pipeline stages)."""
    s, t, par = setup.strategy, setup.training, setup.parallel
    if s.zero is ZeroStage.NONE and s.dp == 1 and t.grad_accum == 1 and par.pp == 1:
        return setup
    return setup.model_copy(
        update={
            "strategy": s.model_copy(update={"zero": ZeroStage.NONE, "dp": 1}),
            "training": t.model_copy(update={"grad_accum": 1}),
            "parallel": par.model_copy(update={"pp": 1, "vpp": 1, "pp_layers": None}),
        }
    )


STRATEGIES: tuple[Strategy, ...] = (lora, checkpointing, reversible, sequence_parallel)
"""Applied in this order to the blocks' inventory of one rank (``memplan.strategies``)."""


def _device_kept(kept: list[Kept], rank: Setup) -> list[Kept]:
    """What one rank keeps: the blocks' inventory (an MoE's MLPs swapped in) under every strategy."""
    for strategy in STRATEGIES:
        kept = strategy.keeps(kept, rank)
    return kept


def _without_recompute(setup: Setup) -> Setup:
    """``setup`` without the strategies that re-run layers: what a re-run layer keeps under the others.
    transformers fills no KV cache under gradient checkpointing (``blocks.hf.llama.common``: the layers get
    None), so a re-run layer — and under every-K each other one — keeps what a cache-less layer keeps:
    ``use_cache`` off where the setup checkpoints. Before, the plain layer had the cache on: its
    ``torch.cat`` copy of v for the cache, where the re-run keeps v as a view of the fused ``qkv_proj``
    output whole (Phi-3-mini under LoRA and full checkpointing: 6,291,456 B under at s 512)."""
    plain = setup.strategy.model_copy(update={"checkpointing": Checkpointing.NONE, "reversible": False})
    update: dict[str, object] = {"strategy": plain}
    hf_cache = setup.impl.impl is Impl.HF and setup.impl.use_cache  # transformers' alone reads it
    if setup.strategy.checkpointing is not Checkpointing.NONE and hf_cache:
        update["impl"] = setup.impl.model_copy(update={"use_cache": False})
    return setup.model_copy(update=update)


_PIECES: dict[tuple[object, ...], Pieces] = {}
_PIECES_MAX = 8192


_PER_STEP = {"grad_accum", "zero", "dp"}
"""The setup fields the pieces do not depend on (``core_of`` resets them)."""


def pieces_key(setup: Setup) -> tuple[object, ...]:
    """Every field of the setup but ``_PER_STEP``, and the rank's degrees: a cheap key (no copies)."""
    fields = [v for part in (setup.training, setup.strategy) for k, v in part if k not in _PER_STEP]
    par = setup.parallel
    savers = (setup.offload, setup.loss, setup.loss_chunks)
    return (
        setup.model,
        setup.device,
        setup.impl,
        setup.finetune,
        *fields,
        par.tp,
        par.sp,
        par.ep,
        par.etp,
        par.cp,
        par.cp_rotate,  # the ring's backward ledger (blocks.attention.ring_memory) reads both
        par.cp_rank,
        *savers,
    )


def pieces_by_key(key: tuple[object, ...], setup: Setup) -> Pieces:
    """``pieces`` memoised on the fields they depend on (cheaper to hash than the setups themselves)."""
    found = _PIECES.get(key)
    if found is None:
        if len(_PIECES) >= _PIECES_MAX:
            _PIECES.clear()
        found = _PIECES[key] = pieces(core_of(setup))
    return found


def clear_caches() -> None:
    """Forget the cached pieces, layer terms, FLOPs, parameter counts and pipeline placements (for
    cold-start benchmarks)."""
    _PIECES.clear()
    clear_placements()
    lb.clear_terms()
    act.clear_working_sets()
    whole_flops.cache_clear()
    param_counts.cache_clear()


def rerun_kept(rank: Setup) -> list[Kept]:
    """What a re-run layer of the rank (``Pieces.setup``) saves again in its backward, as the rank holds
    it: the dense, unsequence-split working set (``act.layer_working_set``) with MoE's and sequence
    parallelism's changes (``pieces``' ``layer_correction``). Not fine-tuning's (``lora.layer_bytes``).
    Nor a view of a module buffer: torchtitan's per-layer RoPE cache (``rope_buffers``), whose save is a
    view of the layer's buffer, is made by no re-run — under checkpointing every buffer is module state
    already (``analytic.head_moments.module_rope_buffers``). Measured under FullAC on torchtitan's rank:
    the layer moment one [s, d/2] complex64 over without this (524,288 B at Llama 3.1 8B's widths, s
    1,024; 2,048 B on the tiny model)."""
    working = list(act.layer_saves_kept(rank))
    if rope_buffers(rank):
        working = [k for k in working if not is_rope_cache(k)]
    return _device_kept(working, _without_recompute(rank))


def pieces(core: Setup) -> Pieces:
    """The pieces of ``core`` (a ``core_of`` setup) on one rank."""
    parallel = core.parallel
    rank = core.model_copy(update={"model": tp_model(core.model, parallel.tp, parallel.etp)})
    kept = _device_kept(act.inventory(rank), rank)
    params = count_params(rank.model)
    experts = 0
    if params.moe is not None:
        experts = params.moe.local_experts(parallel.ep)
        params = params.model_copy(
            update={"layer": params.layer.model_copy(update={"mlp": params.moe.dense() + experts})}
        )
    groups = dict.fromkeys(Group, 0)
    flags = (profile_of(rank).rope_cached_per_chunk, rope_buffers(rank), rope_caches(rank))
    for k in kept:
        groups[group_of(k, released_as(rank), *flags)] += k.bytes
    groups[Group.LAYER_CONSTANTS] //= rank.model.num_layers  # one layer's (the entry spans every layer)
    per_layer: tuple[int, ...] = ()
    if not rank.strategy.segment:  # layers that differ: fine-tuning's gradient flow, or two layer kinds
        per_layer = tuple(lora.layer_bytes(rank)) if lora.applies(rank) else act.layer_kind_bytes(rank)
    groups[Group.LAYER] = max(per_layer, default=groups[Group.LAYER])
    # layer_backward.recompute_working_set re-runs whole layers of the dense, unsequence-split rank: correct
    # by what MoE and sequence parallelism change in each re-run layer's saves.
    working = act.layer_working_set(rank)
    rerun = rank.strategy.segment or (1 if rank.strategy.reversible else 0)
    plain = _without_recompute(rank)  # fine-tuning: the largest layer
    if lora.applies(rank):
        redone = lora.layer_bytes(plain, flows(rank))  # the checkpointed setup's flows (its hooked input)
    else:  # each layer's kind's (``act.layer_kind_setups``: DeepSeek's dense first layers, Llama 4's)
        kinds = act.layer_kind_setups(rank) or (rank,)
        made = {k.model: act.total_bytes(rerun_kept(k)) for k in kinds}
        redone = [made[k.model] for k in kinds]
    changed = act.total_bytes(working) - max(redone)
    alone, segmented, n = checkpoints_alone(rank), bool(rank.strategy.segment), rank.model.num_layers
    return Pieces(
        core=core,
        setup=rank,
        kept=tuple(kept),
        params=params,
        expert_params=experts,
        group_bytes=groups,
        layer_correction=-(0 if segmented else rerun * changed),
        layer_bytes=per_layer,
        alone_layers=alone_layer_bytes(rank, groups) if alone else (),
        rerun_layers=(tuple(redone) if len(redone) == n else tuple(redone) * n) if segmented else (),
    )


def alone_layer_bytes(rank: Setup, groups: dict[Group, int]) -> tuple[int, ...]:
    """Each layer's bytes under transformers' every-K (``Pieces.alone_layers``): a checkpointed layer's
    input, every other layer's saves as un-checkpointed (fine-tuning's along the gradient flow, a model's
    kinds of layer; else the group's one layer)."""
    plain, k = _without_recompute(rank), rank.strategy.segment
    each = lora.layer_bytes(plain, flows(rank)) if lora.applies(rank) else act.layer_kind_bytes(plain)
    each = each or [groups[Group.LAYER]] * rank.model.num_layers
    return tuple(groups[Group.CHECKPOINT] if i % k == 0 else n for i, n in enumerate(each))


@functools.lru_cache(maxsize=256)
def param_counts(model: ModelConfig) -> ParamCount:
    return count_params(model)


@functools.lru_cache(maxsize=1024)
def whole_flops(core: Setup) -> Flops:
    """FLOPs of one micro-batch through the whole model (all devices of one replica together): ``Dims.of``
    speaks in one context-parallel rank's s/cp tokens, whose FLOPs every one of the cp ranks runs."""
    if lora.applies(core):
        return lora.flops(core)
    dims = Dims.of(core)
    recompute = sum(s.recompute(core, dims) for s in STRATEGIES if s.applies(core))
    cp = core.parallel.cp
    # the model's FLOPs are the whole sequence's on one device (``Flops.cp_skipped``)
    unsplit = flops(core.replaced(parallel=core.parallel.replaced(cp=1, cp_rank=None))) if cp > 1 else None
    return context_parallel.whole_model(flops(core, recompute), cp, unsplit)
