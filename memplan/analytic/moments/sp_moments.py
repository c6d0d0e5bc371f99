"""A layer's backward moments under torchtitan's sequence-parallel plan (``layer_backward``'s, where W_down's
output is reduce-scattered to the rank's T/t tokens): the MLP's (``sp_mlp_moments``) and a FullAC re-run's
last reduce-scatter (``sp_rerun_scatter``)."""

from __future__ import annotations

from memplan.analytic.head_moments import gather_copies, residual_shard, sp_shards
from memplan.analytic.moments import fp8_tp_moments
from memplan.analytic.moments.layer_saves import layer_saves
from memplan.blocks import fp8, fp8_tp
from memplan.blocks.inventory import Block, Dims, Role
from memplan.blocks.mlp import (
    down_backward_transient,
    fp8_first_backward,
    frozen_mlp,
    product_gradient_transient,
)
from memplan.blocks.profiles import top_layer_grads
from memplan.config import MlpType, Setup
from memplan.config.finetune import MLP_TARGETS


def sp_mlp(setup: Setup) -> bool:
    """A trained SwiGLU MLP under torchtitan's sequence-parallel plan (``sp_mlp_moments``), its matrices
    bf16 or torchao's float8."""
    return setup.model.mlp is MlpType.SWIGLU and not frozen_mlp(setup) and sp_shards(setup) > 1


def sp_rerun_scatter(setup: Setup, dims: Dims) -> int | None:
    """A layer re-run under torchtitan's FullAC and sequence-parallel plan, at its last reduce-scatter
    (W_down's output to the rank's T/t tokens), its saves all made again: the backward's first node, the
    all-gather of the layer's output gradient, ran before the re-run (it unpacks no save), so that
    gradient's shard and its gathered [T, h] are alive; W_down's output [T, h], funcol's concatenated copy
    of it (``reduce_scatter_single`` copies along any dimension but 0) and its [T/t, h] output; the
    attention's reduce-scattered output and the residual sum after it ([T/t, h] each).
    Measured at Llama 3.1 8B's widths on tp 8 (s 2,048, two sequences a micro-batch): the top of every
    layer's backward, 46,137,344 B above the estimate before (tests/hf/test_torchtitan_peak.py). None: the
    layer has no such moment."""
    if (float8 := fp8_tp_moments.rerun(setup, dims)) is not None:  # torchao's float8 re-runs
        return float8
    if not setup.strategy.segment or sp_shards(setup) == 1:
        return None
    return 3 * dims.tokens * dims.h * dims.act.bytes + 4 * residual_shard(setup, dims)


def sp_mlp_moments(setup: Setup, dims: Dims) -> dict[str, int]:
    """``mlp_backward_transient``'s moments, by name, under torchtitan's sequence-parallel plan. W_down's
    output is reduce-scattered to the rank's T/t tokens, so its backward all-gathers the layer's output
    gradient [T/t, h] to W_down's dY [T, h], a copy freed once W_down's backward has run, while the shard
    waits for the residual branch (``residual_gradient``):

    - ``gather``: as the all-gather lands, its copies beside the shard (``gather_copies``; the top where
      [T, h] outweighs the [T, f/t] buffers: tp 8 at long T);
    - ``down``: W_down's own backward, the gathered dY and the shard alive;
    - ``product``: the product's gradient, the shard alone beside the [T, f] buffers;
    - ``first``: W_gate's backward (after W_up's and silu's, ``fp8_first_backward``), the [T, f] saves
      all released (down input, act, up, gate): its dX [T, h] beside W_up's, d(gate) [T, f] and the three
      weight gradients — above ``product`` when 2·h·f·g + T·h·A > 4·T·f·A + (T − T/t)·h·A.

    Measured at Llama 3.1 8B's widths: on tp 2 (s 1,024, two sequences a micro-batch) the layer tops at
    ``first``, 4,194,304 B below the product's gradient as the unsplit layer counts it (the gathered dY
    alive); on tp 8 at ``first`` (s 2,048, one sequence), 11,534,336 B above the estimate before, and at
    ``gather`` (s 4,096, two), 2,097,152 B above; with torchao's tensorwise float8 (``first`` is
    ``fp8_first_backward``'s casts, dY's shard for dY) 8,388,608 B over before on tp 2; exact now
    (tests/hf/test_torchtitan_peak.py). Under SelectiveAC the layer tops in its re-run, at W_down's
    weight cast (``fp8_tp_moments.rerun``; 12,320,768 B under before, an upper bound now)."""
    if fp8_tp.applies(setup):  # torchao's float8 plan: casts before the collectives
        return fp8_tp_moments.mlp_moments(setup, dims, layer_saves(setup, {Block.MLP}, {Role.MLP_INNER}))
    a, t, h, f = dims.act.bytes, dims.tokens, dims.h, dims.f
    shard = residual_shard(setup, dims)
    gathered = t * h * a
    grads = top_layer_grads(setup, 3 * f * h + (2 * f + h if setup.model.mlp_bias else 0), MLP_TARGETS)
    released = layer_saves(setup, {Block.MLP}, {Role.MLP_INNER})
    first = shard + grads + 2 * gathered + t * f * a - released
    if fp8.enabled(setup):  # torchao's casts at W_up's and W_gate's backward, dY's shard for dY
        first = fp8_first_backward(setup, dims) - gathered + shard
    return {
        "gather": shard + gather_copies(dims) * gathered,
        "down": down_backward_transient(setup, dims) + shard,
        "product": product_gradient_transient(setup, dims) - gathered + shard,
        "first": first,
    }
