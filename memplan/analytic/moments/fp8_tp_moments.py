"""Float8's own moments of a tensor-parallel layer: the MLP's backward under torchao's float8
tensor-parallel plan (``--fp8-tp``, blocks/fp8_tp.py) moment by moment — what
``sp_moments.sp_mlp_moments`` gives for torchtitan 0.3.0's plan, for the 2024 plan's casts — and the
float8 re-runs of full and selective checkpointing (``rerun``). The MLP's backward, in its order (W_down
a ``Float8RowwiseParallel``, W_up and W_gate ``Float8ColwiseParallel``s):

1. the layer's output gradient, the [T/t, h] shard (``residual_shard``, alive to the end), is cast to
   float8 by ``NoopFwToFloat8BwDynamic`` (``blocks.fp8.cast_top`` of its elements: ``cast``) and
   all-gathered in float8 (``gather``: the float8 shard, the collective's output and, with more than one
   sequence a micro-batch, the chunks' ``cat``, T·h bytes each: ``head_moments.gather_copies``);
2. W_down's backward with that float8 dY [T, h]: its weight cast (``down_weight``: 9 bytes an element of
   W, beside dY), dX [T, f/t] and dW (``down``); no cast of dY or of the saved float8 input;
3. the product's and SiLU's gradients, then W_up's: its output gradient d(up) [T, f/t] cast by the
   colwise style's ``NoopFwToFloat8BwDynamic`` (``up``: d(act) and d(up) alive, the down input, act and
   up saves released);
4. W_gate's: d(gate) cast the same way (``first``: W_up's dX [T, h] and two weight gradients made, every
   inner save released), then its weight cast beside the float8 d(gate) (``gate_weight``) and its dX
   [T, h] beside W_up's (``first_dx``);
5. the two [T, h] input gradients summed (``sum``) once W_gate's weight gradient has released the saved
   float8 input [T, h] and the scales of it and of W_gate's weight cast.

Measured at Llama 3 8B's widths (tp 8 + SP, s 4,096, two sequences a micro-batch; fake process group):
every step above as written (``first_dx``, never the top there, derived from the same sequence),
``first`` the layer's top (163,577,856 B above its live set), 284,164,108 B below what 0.3.0's plan's casts
of the gathered bf16 [T, h] gave; on tp 2 (s 1,024) ``gate_weight`` tops (tests/hf/test_fp8_tp.py).
"""

from __future__ import annotations

from memplan.analytic.head_moments import gather_copies, residual_shard, sp_shards
from memplan.blocks.fp8 import SCALE, cast_top
from memplan.blocks.inventory import Dims
from memplan.blocks.profiles import made_grad_bytes, op_selective
from memplan.config import Fp8Recipe, Setup


def mlp_moments(setup: Setup, dims: Dims, released: int) -> dict[str, int]:
    """The moments (module docstring) above the layer's live set; ``released``: the MLP's inner saves
    (gate, act, up and the float8 down input; all but the gate freed by W_up's backward)."""
    a, t, h, f = dims.act.bytes, dims.tokens, dims.h, dims.f
    released_up = released - t * f * a  # the gate [T, f/t] waits for SiLU's backward
    g = made_grad_bytes(setup)
    shard = residual_shard(setup, dims)
    shard_elems = shard // a
    w = f * h  # one weight of the rank, [f/t, h] or [h, f/t]
    gathered = t * h  # float8 dY, 1 byte an element
    return {
        "cast": shard + cast_top(shard_elems) + SCALE,
        "gather": shard + shard_elems + SCALE + gather_copies(dims) * gathered,
        "down_weight": shard + gathered + SCALE + cast_top(w) + SCALE,
        "down": shard + gathered + SCALE + w + SCALE + t * f * a + w * g,
        "up": shard + w * g + 2 * t * f * a + cast_top(t * f) - released_up,
        "first": shard + 2 * w * g + t * h * a + t * f * a + cast_top(t * f) - released,
        "gate_weight": shard + 2 * w * g + t * h * a + t * f + SCALE + cast_top(w) - released,
        "first_dx": shard + 2 * w * g + 2 * t * h * a + t * f + w - released,
        "sum": shard + 3 * w * g + 3 * t * h * a - released - (t * h + 2 * SCALE),
    }


def rerun(setup: Setup, dims: Dims) -> int | None:
    """A layer re-run under full checkpointing (``sp_moments.sp_rerun_scatter``'s moment under the
    float8 plan), above the re-run's saves: the backward's first nodes (the output gradient's cast and
    float8 all-gather) ran before the re-run, so the [T/t, h] shard and the float8 dY [T, h] are alive,
    beside the re-run's attention output and residual sum ([T/t, h] each) and the bf16 product [T, f/t],
    W_down's input, whose float8 cast is the save (its call holds the product) — at that cast, at W_down's
    weight cast (``cast_top`` of W) or at its output's reduce-scatter (the [T, h] output, funcol's
    concatenated copy and the [T/t, h] result), whichever is larger. Measured: on the tiny model (h = f)
    the product's cast tops; at Llama 3 8B's widths on tp 2 (s 1,024, two sequences) the weight cast
    (8,388,612 B above the estimate before), on tp 8 (s 4,096) the reduce-scatter (4,194,300 B below the
    bf16 plan's figure, whose gathered dY is two bytes an element). Under torchtitan's SelectiveAC the block
    re-runs all but the cached ops: W_down's matmul and reduce-scatter are cached (their outputs alive, no
    reduce-scatter moment), its input's and weight's casts re-run. NB: SelectiveAC's moment is an upper
    bound, 393,216 B above at 8B's widths on tp 2 (s 1,024), 1,966,078 B on tp 8 (s 4,096), 3,070 B on the
    tiny model (33,292,292 B below at 8B's widths before).

    torchtitan 0.3.0's plan with tensorwise float8 under SelectiveAC re-runs the same casts: its W_down
    input is the bf16 product (a save), whose cast ``Float8Linear`` makes again before the cached matmul,
    then W's, beside the gathered bf16 dY, the four [T/t, h] (the shard, the attention's cached
    reduce-scatter, the residual sum, W_down's cached reduce-scatter) and W_down's cached partial [T, h]:
    the layer's top at 8B's widths on tp 2 (s 1,024; 12,320,768 B below before, 393,208 B above now, the
    same NB). None where neither applies (``sp_moments.sp_rerun_scatter``'s own figure then)."""
    a, t, h, f = dims.act.bytes, dims.tokens, dims.h, dims.f
    shard = residual_shard(setup, dims)
    if not setup.impl.fp8_tp:
        if setup.impl.fp8 is not Fp8Recipe.TENSORWISE or not op_selective(setup) or sp_shards(setup) == 1:
            return None
        alive = 4 * shard + 2 * t * h * a
        return alive + max(cast_top(t * f) + SCALE, t * f + SCALE + cast_top(f * h) + SCALE)
    alive = 3 * shard + t * h + SCALE + t * f * a
    # the product's own cast (its float8 result is the save), W's cast; FullAC: W_down's reduce-scatter
    moments = [cast_top(t * f) - t * f, cast_top(f * h) + SCALE]
    if setup.strategy.segment:
        moments.append(2 * t * h * a + shard)
    elif op_selective(setup):
        # SelectiveAC caches W_down's output (a partial [T, h]) and its reduce-scatter: no re-run of them
        alive += t * h * a + shard
    else:
        return 0
    return alive + max(moments)
