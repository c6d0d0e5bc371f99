"""Bytes per element of the element-wise kernels one layer runs, fused or as eager PyTorch runs them.

A fused kernel (``--compile``: torch.compile's Inductor fuses each chain of point-wise ops and reductions
into one kernel; ``--impl megatron``'s Apex/TE kernels for its norms and SwiGLU) reads its inputs once and
writes its output once. Eager PyTorch runs every op of the chain as its own kernel, each reading its inputs
from HBM and writing its output there (e the activation dtype's bytes, per element of the op's tensor):

- RMSNorm as Llama's reference code and transformers' ``LlamaRMSNorm`` write it: ``x.to(float32)``
  (e + 4; no kernel when e = 4), ``pow(2)`` (4 + 4), ``mean(-1)`` (4), ``x · rsqrt(var + eps)`` (4 + 4),
  ``.to(input dtype)`` (4 + e; none when e = 4), ``weight ·`` (e + e): 28 + 4e (20 + 2e = 28 in fp32);
  torch's ``F.rms_norm`` (torchtitan's ``nn.RMSNorm``, the profile's ``rms_norm_fp32_product``) multiplies
  the weight in fp32 and casts after: 4 + 4 for the product, 32 + 2e. Fused: e + e.
- SwiGLU: ``silu(gate)`` (e + e) then ``· up`` (2e + e): 5e per [T, f] element; fused 3e.
- rotary (transformers' ``apply_rotary_pos_emb`` on q and k): ``q·cos`` (2e), ``rotate_half`` — a negated
  half (e/2 + e/2) and a ``cat`` (2e) —, ``·sin`` (2e), the sum (3e): 10e; fused 2e (cos and sin tables,
  [s, d], are not counted).
- LayerNorm (``aten.native_layer_norm``), GELU (``F.gelu``), residual adds and dropout are one kernel each
  in eager PyTorch already: the same bytes either way.

Kernels (the per-launch gap, ``efficiency.LAUNCH_GAP_S``, is charged per kernel of eager code): eager
RMSNorm ``x.to(float32)``, ``pow``, ``mean``, ``+ eps``, ``rsqrt``, ``x ·``, ``.to(dtype)``, ``weight ·``: 8
kernels (6 in fp32: no casts); SwiGLU ``silu`` and ``·``: 2; rotary on q and k, each ``·cos``, the negated
half, ``cat``, ``·sin`` and the sum: 10; LayerNorm, GELU, a residual add, a dropout, an eager softmax: 1
each. Fused chains (``--compile``, a fused-kernel profile) are charged no gap.

Known limitations (NB): the fused kernels' and the GEMMs' own launches are not charged (no figure of the
gap behind a long kernel in view; the host queues them ahead); the host's dispatch (≈ µs per eager op) is
taken to run ahead of the GPU, as it does when kernels outlast it; transformers' ``gelu_new`` (a Python
GELU of five ops) is counted as ``F.gelu``; torch.compile's other effects (recompute choices of its
min-cut partitioner, which change the saved tensors, and CUDA graphs) are not modelled: ``--compile``
changes the element-wise bytes and launches only.
"""

from __future__ import annotations

from memplan.blocks.profile import Profile
from memplan.config import NormType, Setup

FP32 = 4


def rmsnorm(e: int, fp32_product: bool) -> int:
    """Eager RMSNorm's bytes per element (module docstring)."""
    casts = 0 if e == FP32 else (e + FP32) + (FP32 + e)
    weight = 2 * FP32 if fp32_product else 2 * e
    return casts + 2 * FP32 + FP32 + 2 * FP32 + weight


def fused(setup: Setup) -> bool:
    """Every chain runs as one kernel: ``--compile``."""
    return setup.impl.compile


def norm_bytes(setup: Setup, p: Profile, e: int) -> int:
    """Bytes per element of one norm: fused (``--compile``, a fused-norm profile, LayerNorm) 2e."""
    if fused(setup) or p.fused_norm or setup.model.norm is not NormType.RMSNORM:
        return 2 * e
    return rmsnorm(e, p.rms_norm_fp32_product)


def swiglu_bytes(setup: Setup, p: Profile, e: int) -> int:
    """Bytes per [T, f] element of the SwiGLU product: fused 3e, eager 5e."""
    return 3 * e if fused(setup) or p.fused_swiglu else 5 * e


def rotary_bytes(setup: Setup, e: int) -> int:
    """Bytes per element of q or k through the rotary embedding: fused 2e, eager 10e."""
    return 2 * e if fused(setup) else 10 * e


def norm_kernels(setup: Setup, p: Profile, e: int) -> int:
    """Eager kernels of one norm (module docstring): RMSNorm 8 (6 in fp32), LayerNorm 1; fused 0."""
    if fused(setup) or p.fused_norm:
        return 0
    if setup.model.norm is not NormType.RMSNORM:
        return 1
    return 6 if e == FP32 else 8


def swiglu_kernels(setup: Setup, p: Profile) -> int:
    """Eager kernels of the SwiGLU product: ``silu`` and the product, 2; fused 0."""
    return 0 if fused(setup) or p.fused_swiglu else 2


def rotary_kernels(setup: Setup) -> int:
    """Eager kernels of the rotary embedding on q and k: 5 each; fused 0."""
    return 0 if fused(setup) else 10
