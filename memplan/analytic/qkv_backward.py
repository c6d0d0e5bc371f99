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
"""

from __future__ import annotations

from memplan.analytic.head_moments import sp_shards
from memplan.blocks.inventory import Dims
from memplan.blocks.norm import cuda_fused_rms_norm, norm_backward_transient
from memplan.config import Checkpointing, Setup


def fused_qkv_input_gradient(setup: Setup, dims: Dims, norm_grad: int) -> int:
    """Under torch's fused CUDA RMSNorm (``cuda_fused_rms_norm``), W_QKV's dX matmul over the attention
    norm's moment: the cat of dq, dk, dv [T, (a + 2·kv)·d] (the rank's heads) and dX [T, h] in place of
    the norm's dY and dX (``norm_backward_transient``), W_QKV's saved input still held (its node runs)
    where the forward's saves are the layer's, the norm's weight gradient (``norm_grad``) not made yet;
    0 elsewhere (the decomposed norm's fp32 pieces are higher)."""
    if not cuda_fused_rms_norm(setup):
        return 0
    e, t, m = dims.act.bytes, dims.tokens, setup.model
    cat = t * (m.q_width + 2 * m.kv_width) * e  # the rank's model: its tensor-parallel heads already
    gathered = t * dims.h * e  # W_QKV's saved input: the sequence-parallel plan keeps it gathered
    # re-run (AC): the layer's re-run working set holds it already, as the rank's sequence shard
    rerun = setup.strategy.checkpointing is not Checkpointing.NONE
    held = gathered - gathered // sp_shards(setup) if rerun else gathered
    return cat + t * dims.h * e + held - norm_backward_transient(setup, dims) // sp_shards(setup) - norm_grad
