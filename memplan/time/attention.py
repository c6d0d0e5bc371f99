"""The attention core's time, by implementation and GPU generation (issue #21 item 2).

- eager attention (``--attention eager``: explicit ``bmm``s and a softmax, Megatron's fused softmax too)
  runs QKᵀ and P·V as batched cuBLAS GEMMs: ``MATMUL`` × their wave efficiency, and no faster than their
  bytes at ``MEMORY`` × HBM (``gemm.Roofline``: with a head dimension d ≈ 128 their intensity is ≈ d
  FLOPs per byte, memory-bound on an H100). Its softmax, mask and dropout are element-wise traffic
  (``compute.elementwise_bytes``).
- a flash kernel (``--attention flash``) at a fraction of the dense peak that depends on the kernel and
  the GPU's architecture (``arch`` in the GPU preset):

  | kernel | Ampere, Ada, CDNA3, unknown | Hopper, Blackwell: forward, backward |
  |---|---|---|
  | FlashAttention-2 (``auto``, ``fa2``) | ``ATTENTION`` 0.50 | ``FA2_HOPPER`` 0.35, ``_BACKWARD`` 0.32 |
  | FlashAttention-3 (``fa3``) | refused | ``FA3_SPEEDUP`` × those: 0.525, 0.48 |
  | FlashAttention-1 (``fa1``: flash-attn 1.x, its Triton version) | ``FA1`` 0.25 | ``FA1_HOPPER`` 0.175 |

  ``auto`` is FlashAttention-2: torch's SDPA flash backend and transformers' ``flash_attention_2`` both run
  it (torch vendors FA2), on every GPU.

- the causal mask: a flash kernel skips the tiles above the diagonal, so it runs about half of the s × s
  cells that FlopCounterMode (and memplan's FLOPs) count. FlashAttention's own benchmark counts a causal
  kernel's FLOPs that way, ``4·s²·heads·d // (2 if causal else 1)``
  (Dao-AILab/flash-attention benchmarks/benchmark_flash_attention.py), and the fractions above are TFLOP/s
  of that count: a kernel's seconds are its counted FLOPs × ``causal_work`` at the fraction. Under context
  parallelism (torch's load-balanced ring) a rank's local block is causal ((s/c)²/2 cells run, (s/c)²
  counted) and each of its c − 1 others a full block of (s/c)²/2 cells, so of the (c + 1)/2 · (s/c)²
  counted cells c/2 · (s/c)² run: c/(c + 1), 1/2 without cp. Eager attention's bmms run every cell.

Known limitations (NB): one fraction for every sequence length (the Hopper backward's at 8k; FA2 on
Ampere one fraction for both directions, the paper's low end); cuDNN's
and the memory-efficient SDPA kernels are not offered (no published figure in view); CDNA3 (MI300X,
Composable Kernel's flash attention) and Blackwell take the figures above without a measurement of their
own; a sliding window's further skipped tiles are not modelled (the window's cells are counted as causal).
"""

from __future__ import annotations

from memplan.config import Attention, AttentionKernel, Setup
from memplan.presets import GpuPreset
from memplan.time import efficiency

HOPPER_ON = frozenset({"hopper", "blackwell"})
"""Architectures with Hopper's asynchronous tensor cores (wgmma/TMA), where FA2 runs at ``FA2_HOPPER``."""


def kernel(setup: Setup) -> AttentionKernel:
    """The flash kernel that runs: ``auto`` is FlashAttention-2."""
    k = setup.impl.attention_kernel
    return AttentionKernel.FA2 if k is AttentionKernel.AUTO else k


def flash_fraction(setup: Setup, gpu: GpuPreset, backward: bool = False) -> float:
    """The flash kernel's fraction of the dense peak on ``gpu``, forward or ``backward`` (module
    docstring's table); a one-line ``ValueError`` for FlashAttention-3 off Hopper."""
    hopper = gpu.arch in HOPPER_ON
    if gpu.calibrated and gpu.calibrated.attention and setup.impl.attention_kernel is AttentionKernel.AUTO:
        return gpu.calibrated.attention  # measured on the device (``memplan calibrate``: SDPA's own pick)
    fa2 = efficiency.FA2_HOPPER_BACKWARD if backward else efficiency.FA2_HOPPER
    if kernel(setup) is AttentionKernel.FA3:
        if not hopper:
            raise ValueError(
                f"attention-kernel: FlashAttention-3 runs on Hopper GPUs only, not {gpu.name} "
                f"({gpu.arch or 'architecture unknown'}); use --attention-kernel fa2"
            )
        return efficiency.FA3_SPEEDUP * fa2
    if kernel(setup) is AttentionKernel.FA1:
        return efficiency.FA1_HOPPER if hopper else efficiency.FA1
    return fa2 if hopper else efficiency.ATTENTION


def causal_work(setup: Setup) -> float:
    """The share of its counted FLOPs a causal flash kernel runs (module docstring): c/(c + 1) of a
    context-parallel rank's, 1/2 without cp."""
    cp = setup.parallel.cp
    return cp / (cp + 1)


def is_eager(setup: Setup) -> bool:
    return setup.strategy.attention is Attention.EAGER
