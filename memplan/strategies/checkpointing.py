"""Activation checkpointing (``torch.utils.checkpoint``, non-reentrant): full and every-k segments, and
selective recompute of the attention core (Korthikanti et al. 2022).

Segments (Chen et al. 2016): every layer's saves are dropped; each segment of k layers keeps its input (a
``Block.CHECKPOINT`` residual, ⌈L/k⌉ of them) and re-runs its forward in backward. Selective: the attention
block leaves its core's saves out under it (``activations.attention_core_rules``), and the core re-runs.

Re-run FLOPs: torch.utils.checkpoint stops a recompute as soon as the last tensor backward needs is saved
again (``set_checkpoint_early_stop``, on by default). A matmul saves its inputs *before* it runs, so a region
whose last saving op is a matmul never re-runs that matmul: a segment ending in the MLP's down projection
(no residual dropout after it, whose mask is saved after it runs) skips it, and selective eager attention
skips P·V. The flash kernel saves its outputs, so it always re-runs. A checkpoint without early stop
re-runs whole regions (``Profile.checkpoint_reruns_all``: Megatron's own checkpoint, torchtitan's
``FullAC``; transformers' with ``use_reentrant=True``).
"""

from __future__ import annotations

from memplan.analytic import activations as act
from memplan.analytic.flops import layer_linear_flops
from memplan.blocks import llama4, mlp, moe
from memplan.blocks.attention import attention_core_flops
from memplan.blocks.inventory import Block, Dims, Kept, Role, Scope, save
from memplan.blocks.profiles import checkpoints_alone, hidden_dropouts, profile_of
from memplan.config import Attention, Checkpointing, Setup


def applies(setup: Setup) -> bool:
    return setup.strategy.checkpointing is not Checkpointing.NONE


def segments(setup: Setup) -> int:
    """Checkpointed segments of k layers: ⌈L / k⌉ (0 without segment checkpointing)."""
    k = setup.strategy.segment
    return -(-setup.model.num_layers // k) if k else 0


def keeps(kept: list[Kept], setup: Setup) -> list[Kept]:
    """Segments: the layers' saves give way to one checkpoint input per segment, where they stood."""
    if not setup.strategy.segment:
        return kept
    dims = Dims.of(setup)
    why = "checkpoint input: the segment is re-run"
    rule = save(Block.CHECKPOINT, "input", (dims.b, dims.s, dims.h), dims.act, Role.RESIDUAL, why)
    first = next(i for i, k in enumerate(kept) if k.scope is Scope.LAYER)
    rest = [k for k in kept if k.scope is not Scope.LAYER]
    inputs = act.kept([rule], Scope.LAYER, segments(setup))
    if checkpoints_alone(setup):  # the layers not checkpointed keep their saves
        plain = [
            k.model_copy(update={"count": k.count - segments(setup)}) for k in kept if k.scope is Scope.LAYER
        ]
        return rest[:first] + inputs + plain + rest[first:]
    return rest[:first] + inputs + rest[first:]


def recompute(setup: Setup, dims: Dims) -> int:
    whole = profile_of(setup).checkpoint_reruns_all  # no early stop: nothing skipped
    if setup.strategy.segment and llama4.applies(setup) and not llama4.is_uniform(setup.model):
        # Llama 4's kinds of layer, one checkpoint each (every-K refused): each kind's re-run per layer
        return sum(n * recompute(k, Dims.of(k)) // dims.layers for k, n in llama4.layer_kinds(setup))
    if setup.strategy.segment:
        layer_fwd = layer_linear_flops(setup, dims) + attention_core_flops(dims)
        # The last save of a segment with residual dropout is its mask, made after everything ran.
        last = moe.early_stop_skip if setup.model.moe else mlp.early_stop_skip
        # A norm after the MLP (post_norms) saves after W_down, so the re-run reaches W_down too.
        stops = hidden_dropouts(setup)[0] == 0 and not setup.model.post_norms and not whole
        dense = moe.dense_layer_setup(setup)
        if dense is not None:  # DeepSeek: each layer its own checkpoint (blocks.hf.deepseek.check)
            k = moe.dense_mlp_layers(setup)
            ours = _each_layer(setup, dims, dims.layers - k, moe.early_stop_skip(setup, dims) if stops else 0)
            ddims = Dims.of(dense)
            return ours + _each_layer(dense, ddims, k, mlp.early_stop_skip(dense, ddims) if stops else 0)
        skipped = last(setup, dims) if stops else 0
        rerun = segments(setup) if checkpoints_alone(setup) else dims.layers  # layers re-run
        return rerun * layer_fwd - segments(setup) * skipped
    if setup.strategy.checkpointing is Checkpointing.SELECTIVE:
        core = attention_core_flops(dims)
        return dims.layers * (core if setup.strategy.attention is Attention.FLASH or whole else core // 2)
    return 0


def _each_layer(setup: Setup, dims: Dims, layers: int, skipped: int) -> int:
    """The re-run forward of ``layers`` layers of one kind (DeepSeek's MoE layers, or its dense first
    ones under ``moe.dense_layer_setup``), each checkpointed alone (full checkpointing): projections,
    core and MLP, less what the early stop skips (``skipped``)."""
    return layers * (layer_linear_flops(setup, dims) + attention_core_flops(dims) - skipped)
