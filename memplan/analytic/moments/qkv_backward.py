"""W_QKV's input-gradient matmul as a moment of the layer's backward, where the attention norm's own
moment falls below it: under torch's fused CUDA RMSNorm (``blocks.norm.cuda_fused_rms_norm``) the norm's
backward holds one [T, h] dY and dX, less than what is alive just before it — the fused projection's
output gradient (the cat of dq, dk, dv) and its dX [T, h], beside the residual gradient. Measured on
torchtitan's CUDA rank (its ``nn.RMSNorm`` as ``aten._fused_rms_norm``, ``measure.frameworks.titan_norm``)
at Llama 3 8B's widths, s 256: every backward moment exact without AC, under FullAC and under SelectiveAC,
on one rank and on a tp 2 + SP rank, with and without ZeRO-3 over dp 2 (tests/hf/test_torchtitan_cuda.py;
ten layouts in all, by hand). Under AC on a sequence-parallel rank the re-run's all-gathered W_QKV input
[T, h] is alive at that point (its ``all_gather_into_tensor`` output in the trace), where the re-run
working set counts the rank's [T/t, h]: the rest is added here.

Under transformers' LayerNorm (``native_layer_norm``: dY and dX alone in its backward) the same moment
tops Falcon's parallel layer (``parallel_fused_qkv``) and, with separate projections, StableLM's
(``q_input_gradient``): measured at their real widths (tests/hf/test_layernorm_peak.py).
"""

from __future__ import annotations

from memplan.analytic.head_moments import sp_shards
from memplan.blocks.inventory import Dims
from memplan.blocks.norm import cuda_fused_rms_norm, norm_backward_transient
from memplan.blocks.profiles import profile_of, top_layer_grads
from memplan.config import Checkpointing, Setup
from memplan.config.trainable import base_trains


def parallel_fused_qkv(setup: Setup) -> bool:
    """A parallel layer whose q, k, v are views of one fused projection and whose MLP's norm runs before
    the attention (transformers' Falcon: ``query_key_value``, ``qkv_views``; one norm for both branches,
    ``shared_norm``, or the new architecture's ``ln_attn`` and ``ln_mlp``, both on the layer input).
    Autograd runs the MLP's backward first (its output made last: ``mlp_output += attention_output``), so
    the MLP's input gradient [T, h] waits — in the one norm's output buffer, or in ``ln_mlp``'s — while the
    attention's backward runs, to be summed with W_QKV's dX; that dX matmul is the layer's top where the
    fused output gradient [T, (a + 2·kv)·d] and the norm's output (W_QKV's saved input) outweigh
    LayerNorm's backward. Measured at Falcon-7B's widths (s 512, layer 0): ``mm`` [512, 4544] after W_QKV's
    [4672, 4544] weight gradient, 9,419,008 B above the norm's backward; at Falcon-40B's (s 1,024):
    35,590,144 B under before the new architecture was read so (tests/hf/test_layernorm_peak.py)."""
    m = setup.model
    return m.parallel_residual and profile_of(setup).qkv_views


def mlp_gradient_waits(setup: Setup) -> bool:
    """Whether the MLP's input gradient [T, h] waits through the attention's backward: a parallel layer
    whose MLP norm runs before the attention — one norm for both branches (Cohere, Falcon-7B) or Falcon's
    ``ln_mlp`` beside ``ln_attn`` (``parallel_fused_qkv``); not GPT-NeoX's, whose MLP norm runs after it."""
    m = setup.model
    return m.parallel_residual and (m.shared_norm or profile_of(setup).qkv_views)


def q_input_gradient(setup: Setup, dims: Dims, norm_grad: int) -> int:
    """Separate q, k, v projections on one LayerNorm's output (``Profile.q_input_gradient_top``): W_Q's
    backward, the last of the three, at its bias gradient, over the attention norm's moment. Alive: q's
    output gradient [T, a·d] (the contiguous copy the rotary backward's [b, s, a, d] view is ``clone``d
    to for the matmul), W_Q's dX [T, h], the sum of W_K's and W_V's dX [T, h] (one ``add`` of the two,
    waiting in the norm output's input buffer), and W_Q's saved input, the norm's output [T, h] (freed
    after this node, forward's or re-run's) — in place of the norm's dY and dX (``norm_backward_
    transient``), its weight and bias gradients (``norm_grad``) not made yet. A checkpoint's re-run norm
    output is freed right after W_Q's weight-gradient matmul, its last use, before W_Q's bias gradient is
    made: the top is at that matmul then, the bias gradient not counted (not under reentrant
    checkpointing: the re-run graph's own saves, freed after the node; measured, +4,096 B before).
    Measured at StableLM 2 1.6B's widths (s 512, layer 0): 4,186,112 B above the norm's backward, the
    layer's top (4,182,016 B under full checkpointing: less W_Q's [a·d] bias gradient). 0 where the
    layer's base does not train (LoRA, ``--freeze``: not measured)."""
    m, e, t, h = setup.model, dims.act.bytes, dims.tokens, dims.h
    if not base_trains(setup, m.num_layers - 1):
        return 0
    q_grad = t * m.q_width * e
    unpacked = setup.strategy.segment and not setup.impl.reentrant  # reentrant: the re-run graph's save
    bias = top_layer_grads(setup, m.q_width) if m.qkv_bias and unpacked else 0
    return q_grad + 3 * t * h * e - norm_backward_transient(setup, dims) - norm_grad - bias


def fused_qkv_input_gradient(setup: Setup, dims: Dims, norm_grad: int) -> int:
    """Under torch's fused CUDA RMSNorm (``cuda_fused_rms_norm``) or in a parallel shared-norm layer
    (``parallel_fused_qkv``), W_QKV's dX matmul over the attention norm's moment: the cat of dq, dk, dv
    [T, (a + 2·kv)·d] (the rank's heads) and dX [T, h] in place of the norm's dY and dX
    (``norm_backward_transient``), W_QKV's saved input still held (its node runs) where the forward's
    saves are the layer's, the norm's weight gradient (``norm_grad``) not made yet; in the parallel layer
    the MLP's input gradient [T, h] beside them, not yet summed into the norm's dY; 0 elsewhere (the
    decomposed norm's fp32 pieces are higher)."""
    if profile_of(setup).q_input_gradient_top:
        return q_input_gradient(setup, dims, norm_grad)
    if not (cuda_fused_rms_norm(setup) or parallel_fused_qkv(setup)):
        return 0
    return w_qkv_dx(setup, dims, norm_grad)


def w_qkv_dx(setup: Setup, dims: Dims, norm_grad: int) -> int:
    """W_QKV's dX matmul over the attention norm's moment (``fused_qkv_input_gradient``'s terms): the cat
    of dq, dk, dv, dX [T, h], W_QKV's saved input, the MLP's input gradient in a parallel layer
    (``parallel_fused_qkv``), less the norm's transient and weight gradient. Also the top of a layer whose
    input needs no gradient under a fused projection (``input_free``: Phi-3's ``qkv_proj``, the op-by-op
    RMSNorm's chain never run)."""
    parallel = parallel_fused_qkv(setup)
    e, t, m = dims.act.bytes, dims.tokens, setup.model
    cat = t * (m.q_width + 2 * m.kv_width) * e  # the rank's model: its tensor-parallel heads already
    gathered = t * dims.h * e  # W_QKV's saved input: the sequence-parallel plan keeps it gathered
    # re-run (AC): the layer's re-run working set holds it already, as the rank's sequence shard. Not
    # in the parallel layer: its re-run norm output, freed by W_QKV's dX matmul (the MLP's save of it
    # unpacked already), is alive there as the forward's is (measured, Falcon-7B under full AC: +[T, h])
    rerun = setup.strategy.checkpointing is not Checkpointing.NONE and not parallel
    held = gathered - gathered // sp_shards(setup) if rerun else gathered
    waiting = t * dims.h * e if parallel else 0  # the MLP's input gradient, summed after W_QKV's dX
    norm = norm_backward_transient(setup, dims) // sp_shards(setup)
    return cat + t * dims.h * e + waiting + held - norm - norm_grad
