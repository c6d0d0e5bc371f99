"""What the attention's backward holds inside its kernels on CUDA, beyond the tensors it makes: the eager
softmax backward's own product and FlashAttention-2's workspace (``analytic.moments.layer_backward``'s
attention
moments and ``blocks.attention.ring_memory``'s ring blocks add them). Found on an H200
(docs/gpu-profile.md) and derived from torch's kernels; 0 on CPU, whose kernels keep none
(tests/measure/test_peak.py)."""

from __future__ import annotations

from memplan.blocks.attention.core import Core, core_of, fused_softmax_runs, head_major_output
from memplan.blocks.inventory import Dims
from memplan.blocks.profiles import profile_of
from memplan.config import Device, DType, Setup

FP32 = DType.FP32


def softmax_backward_scratch(setup: Setup, dims: Dims) -> int:
    """The eager core's softmax backward on CUDA makes one more [b, a, s, s] tensor than on CPU, inside the
    op: torch's ``softmax_backward_cuda_out`` (aten/src/ATen/native/cuda/SoftMax.cu) runs ``Tensor tmp =
    grad * output;`` before ``host_softmax_backward(tmp, output, …)``, in the gradient's dtype — the softmax
    output's (fp32 under transformers' ``softmax(dtype=float32)`` and Megatron's unfused
    ``softmax_in_fp32``); with gpt-oss's sink column, [b, a, s, s+1]. Alive beside dP and dS until the op
    returns (the H200's allocator history: ``benchmarks/eager_core_order.py --model``, docs/gpu-profile.md).
    0 on CPU (its kernel reads grad and output directly), for the flash core, and where Megatron's fused
    causal softmax runs (its own backward kernel)."""
    if setup.device is not Device.CUDA or core_of(setup) is not Core.EAGER or fused_softmax_runs(setup, dims):
        return 0
    prof = profile_of(setup)
    fp32 = prof.eager_fp32_softmax or prof.fused_causal_softmax
    cols = dims.s + 1 if setup.model.attn_sinks else dims.s
    return dims.b * dims.a * dims.s * cols * (FP32.bytes if fp32 else dims.act.bytes)


FLASH_QUERY_BLOCK = 128
"""FlashAttention-2's backward rounds the query length up to its largest query block, 128 rows
(``mha_bwd``: ``seqlen_q_rounded = round_multiple(seqlen_q, 128)``)."""


def flash_backward_workspace(setup: Setup, dims: Dims) -> int:
    """What FlashAttention-2's backward allocates inside the op on CUDA beyond dq, dk, dv (``mha_bwd`` in
    torch's aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp, the same in the flash-attn
    package): ``softmax_d`` [b, a, s_r] fp32 and, non-deterministic, ``dq_accum`` [b, s_r, a, d_r] fp32
    (s_r = s rounded up to 128 rows, d_r = d rounded up to 32 up to 192, else 256); with fewer K/V heads
    than query heads (GQA, MQA) ``dk_expanded`` and ``dv_expanded`` [b, s, a, d] in the activation dtype,
    summed over each group into dk and dv before the op returns. Measured on an H200 (one rank's ring
    memory, benchmarks/ring_kernels.py ``memory``: b 1, 32 heads of 128, 8 K/V heads, s 32,768 — 4 + 512 +
    2 · 256 MiB). 0 on CPU (its kernel: outputs only, tests/measure/test_peak.py) and for the eager core.
    Where the output is head-major (``head_major_output``) torch's wrapper also copies it for the kernel.
    NB: FlashAttention-3, cuDNN's and FlashAttention-1's backward workspaces (``--attention-kernel``) are not
    modelled: FlashAttention-2's is counted for every flash kernel."""
    if setup.device is not Device.CUDA or core_of(setup) is not Core.FLASH:
        return 0
    d = dims
    work = fa2_backward_workspace(d.b, d.a, d.kv, d.s, d.s, d.qk_dim, d.v_dim, d.act.bytes)
    copy = d.b * d.a * d.s * d.v_dim * d.act.bytes if head_major_output(setup) else 0
    return work + copy


def fa2_backward_workspace(b: int, a: int, kv: int, sq: int, sk: int, dqk: int, dv: int, e: int) -> int:
    """``flash_backward_workspace`` of one call: sq queries of a heads against sk keys of kv heads, query/key
    width dqk, value width dv, e bytes an activation."""
    rows = -(-sq // FLASH_QUERY_BLOCK) * FLASH_QUERY_BLOCK
    d_rounded = -(-dqk // 32) * 32 if dqk <= 192 else 256
    fp32 = DType.FP32.bytes
    work = b * a * rows * fp32 + b * rows * a * d_rounded * fp32
    if kv != a:
        work += b * sk * a * (dqk + dv) * e
    return work
