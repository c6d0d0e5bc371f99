"""The attention core's time, by implementation and GPU generation (issue #21 item 2).

- eager attention (``--attention eager``: explicit ``bmm``s and a softmax, Megatron's fused softmax too)
  runs QKᵀ and P·V as batched cuBLAS GEMMs: ``MATMUL`` × their wave efficiency, and no faster than their
  bytes at ``MEMORY`` × HBM (``gemm.Roofline``: with a head dimension d ≈ 128 their intensity is ≈ d
  FLOPs per byte, memory-bound on an H100). Its softmax, mask and dropout are element-wise traffic
  (``compute.elementwise_bytes``).
- a flash kernel (``--attention flash``) at a fraction of the dense peak that depends on the kernel and
  the GPU's architecture (``arch`` in the GPU preset):

  | kernel | Ampere, Ada, CDNA3, unknown | Hopper, Blackwell |
  |---|---|---|
  | FlashAttention-2 (``auto``, ``fa2``) | ``ATTENTION`` 0.50 | ``FA2_HOPPER`` 0.35 |
  | FlashAttention-3 (``fa3``) | refused | ``FA3_SPEEDUP`` × 0.35 = 0.525 |

  ``auto`` is FlashAttention-2: torch's SDPA flash backend and transformers' ``flash_attention_2`` both run
  it (torch vendors FA2), on every GPU.

Known limitations (NB): one fraction for forward and backward (the papers' ranges, their low end); cuDNN's
and the memory-efficient SDPA kernels are not offered (no published figure in view); CDNA3 (MI300X,
Composable Kernel's flash attention) and Blackwell take the figures above without a measurement of their
own; the causal mask's skipped blocks are not modelled (FLOPs count the whole s × s, as FlopCounterMode).
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


def flash_fraction(setup: Setup, gpu: GpuPreset) -> float:
    """The flash kernel's fraction of the dense peak on ``gpu`` (module docstring's table); a one-line
    ``ValueError`` for FlashAttention-3 off Hopper."""
    hopper = gpu.arch in HOPPER_ON
    if gpu.calibrated and gpu.calibrated.attention and setup.impl.attention_kernel is AttentionKernel.AUTO:
        return gpu.calibrated.attention  # measured on the device (``memplan calibrate``: SDPA's own pick)
    if kernel(setup) is AttentionKernel.FA3:
        if not hopper:
            raise ValueError(
                f"attention-kernel: FlashAttention-3 runs on Hopper GPUs only, not {gpu.name} "
                f"({gpu.arch or 'architecture unknown'}); use --attention-kernel fa2"
            )
        return efficiency.FA3_SPEEDUP * efficiency.FA2_HOPPER
    return efficiency.FA2_HOPPER if hopper else efficiency.ATTENTION


def is_eager(setup: Setup) -> bool:
    return setup.strategy.attention is Attention.EAGER
