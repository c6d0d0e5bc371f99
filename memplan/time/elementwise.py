"""Bytes per element of the element-wise kernels one layer runs, fused or as eager PyTorch runs them.

A fused kernel (``--compile``: torch.compile's Inductor fuses each chain of point-wise ops and reductions
into one kernel; ``--impl megatron``'s Apex/TE kernels for its norms, SwiGLU and RoPE) reads its inputs
once and writes its output once. Eager PyTorch runs every op of the chain as its own kernel, each reading
its inputs from HBM and writing its output there (e the activation dtype's bytes, per element of the op's
tensor):

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

The backward of eager code, by the autograd nodes of each op (PyTorch's derivatives.yaml; listed kernel
by kernel from a traced H200 step of memplan's reference model, docs/step-time.md "Eager PyTorch on a
measured H200"), bytes per element:

- RMSNorm: ``weight ·``'s node: dY·w (2e), dY·n for dw (3e) and its sum over tokens (e); ``.to(dtype)``'s
  cast back to fp32 (e + 4); ``x · r``: dY·r (4 + 4), dY·x (4 + 4 + 4) and its sum over h (4); rsqrt's
  and ``+ eps``'s nodes on [T, 1] (nothing per element); ``mean``'s: dY/h written (4: its input is an
  expanded [T, 1]); ``pow(2)``'s: ``x.pow(1)`` (4 + 4), ·2 (4 + 4), ·dY (4 + 4 + 4); the two fp32
  gradients of x summed (4 + 4 + 4); ``x.to(float32)``'s cast back (4 + e): 6e + (e + 4) + 24 + 4 + 28 +
  12 + (4 + e) = 8e + 76, 92 in bf16 (fp32: no casts, 92 too) — against the forward's 28 + 4e; 17 kernels
  (the weight's sum in two passes, rsqrt's node three on [T, 1]; fp32 15).
- SwiGLU: ``·``'s node dY·up and dY·silu(gate) (3e each), ``silu_backward`` (3e): 9e, 3 kernels.
- rotary (``rotate_half``'s form), per element of q or k: ``·cos`` and ``·sin``'s nodes (2e each), the
  negation's (e: half the elements, read and written), ``cat``'s two slices (views), each slice's
  ``slice_backward`` (zeros of the whole, e, and a copy of the half, e), the three gradients of q summed
  (two adds, 3e each), and the copy of the [b, a, s, d] gradient back to the projection's [b, s, a, d]
  layout (2e): 17e, 10 kernels (torchtitan's and DeepSeek-V2's complex-multiply form: twice the forward).
- gradients of a tensor used twice are summed by autograd (3e an element, one kernel each): the
  residual stream before each of the two norms (2, on the rank's tokens), the normed input of W_Q, W_K,
  W_V when they are separate linears (2), of gate and up when separate (1).
- LayerNorm (``native_layer_norm_backward``), torch's ``F.rms_norm``, GELU, dropouts, eager attention's
  softmax, MoE and MLA layers and fused kernels (``--compile``, fused profiles): twice their forward's
  bytes and kernels, as before (not traced).

The bytes are right, and they do not all stream at ``MEMORY``: broadcasting and strided kernels
(RMSNorm's ``x · r`` and ``weight ·``, rotary's products on the transposed q and k, ``cat``) run
TensorIterator's non-vectorized path, and LayerNorm reduces rows. Each chain's rate was measured alone on an
H200 (``efficiency.ELEMENTWISE_STREAM``: eager RMSNorm 0.58 forward and 0.66 backward of HBM, LayerNorm 0.53
and 0.46, rotary 0.30 and 0.35, SwiGLU 0.87 and 0.88, GELU 0.76 and 1.11 of its counted bytes; the eager
attention core 0.34 and 0.39; and each compiled) and its bytes are weighed by ``MEMORY`` over that rate
(``weight``; ``layer_elementwise.streamed_bytes``); the residual adds, gradient sums, dropouts, Megatron's
fused softmax and other fused kernels stream at ``MEMORY``.

Known limitations (NB): the fused kernels' and the GEMMs' own launches are not charged (no figure of the
gap behind a long kernel in view; the host queues them ahead); the host's dispatch (≈ µs per eager op) is
taken to run ahead of the GPU, as it does when kernels outlast it; transformers' ``gelu_new`` (a Python
GELU of five ops) is counted as ``F.gelu``; torch.compile's other effects (recompute choices of its
min-cut partitioner, which change the saved tensors, and CUDA graphs) are not modelled: ``--compile``
changes the element-wise bytes and launches only.
"""

from __future__ import annotations

from memplan.blocks.norm import cuda_fused_rms_norm
from memplan.blocks.profile import Profile
from memplan.config import Impl, MlpType, NormType, Setup
from memplan.presets import GpuPreset
from memplan.time import efficiency

FP32 = 4


def rmsnorm(e: int, fp32_product: bool) -> int:
    """Eager RMSNorm's bytes per element (module docstring)."""
    casts = 0 if e == FP32 else (e + FP32) + (FP32 + e)
    weight = 2 * FP32 if fp32_product else 2 * e
    return casts + 2 * FP32 + FP32 + 2 * FP32 + weight


def fused(setup: Setup) -> bool:
    """Every chain runs as one kernel: ``--compile``."""
    return setup.impl.compile


def fused_norm(setup: Setup, p: Profile) -> bool:
    """The norm is one kernel each way: a fused-norm profile (Megatron's), or torch's ``nn.RMSNorm`` on CUDA
    (``blocks.norm.cuda_fused_rms_norm``: ``aten._fused_rms_norm``)."""
    return p.fused_norm or cuda_fused_rms_norm(setup)


def norm_bytes(setup: Setup, p: Profile, e: int) -> int:
    """Bytes per element of one norm: fused (``--compile``, a fused norm, LayerNorm) 2e."""
    if fused(setup) or fused_norm(setup, p) or setup.model.norm is not NormType.RMSNORM:
        return 2 * e
    return rmsnorm(e, p.rms_norm_fp32_product)


def swiglu_bytes(setup: Setup, p: Profile, e: int) -> int:
    """Bytes per [T, f] element of the SwiGLU product: fused 3e, eager 5e."""
    return 3 * e if fused(setup) or p.fused_swiglu else 5 * e


def rotary_bytes(setup: Setup, p: Profile, e: int) -> int:
    """Bytes per element of q or k through the rotary embedding: fused 2e (``--compile``; Megatron's
    ``fused_rope``), eager 10e."""
    return 2 * e if fused(setup) or p.fused_rope else 10 * e


def norm_kernels(setup: Setup, p: Profile, e: int) -> int:
    """Eager kernels of one norm (module docstring): RMSNorm 8 (6 in fp32), LayerNorm 1; fused 0."""
    if fused(setup) or fused_norm(setup, p):
        return 0
    if setup.model.norm is not NormType.RMSNORM:
        return 1
    return 6 if e == FP32 else 8


def swiglu_kernels(setup: Setup, p: Profile) -> int:
    """Eager kernels of the SwiGLU product: ``silu`` and the product, 2; fused 0."""
    return 0 if fused(setup) or p.fused_swiglu else 2


def eager_backward(setup: Setup) -> bool:
    """The backward is charged its eager op lists (module docstring): unfused code of a dense layer
    without MLA; otherwise twice the forward's bytes and kernels."""
    m = setup.model
    return not fused(setup) and m.moe is None and m.mla is None


def rmsnorm_backward(e: int) -> int:
    """Eager RMSNorm's backward bytes per element (module docstring): 8e + 76 with the casts, 92 in fp32."""
    casts = 0 if e == FP32 else (e + FP32) + (FP32 + e)
    return 6 * e + casts + 24 + 4 + 28 + 12


def norm_backward(setup: Setup, p: Profile, e: int) -> tuple[int, int]:
    """One norm's backward, (bytes per element, kernels): eager RMSNorm's op list (17 kernels, fp32 15);
    else twice the forward's."""
    if (
        fused(setup)
        or fused_norm(setup, p)
        or p.rms_norm_fp32_product
        or setup.model.norm is not NormType.RMSNORM
    ):
        return 2 * norm_bytes(setup, p, e), 2 * norm_kernels(setup, p, e)
    return rmsnorm_backward(e), 15 if e == FP32 else 17


def swiglu_backward(setup: Setup, p: Profile, e: int) -> tuple[int, int]:
    """SwiGLU's backward per [T, f] element, (bytes, kernels): eager 9e in 3; fused twice the forward's."""
    if fused(setup) or p.fused_swiglu:
        return 2 * swiglu_bytes(setup, p, e), 0
    return 9 * e, 3


def rotary_backward(setup: Setup, p: Profile, e: int) -> tuple[int, int]:
    """Rotary's backward per element of q or k, (bytes, kernels of q and k): ``rotate_half``'s eager op
    list 17e in 10 each; TE's fused kernel (``fused_rope``) its forward's, on the gradient; compiled code
    and the complex-multiply forms (torchtitan's per-layer ``freqs_cis``, DeepSeek-V2's; not traced)
    twice the forward's."""
    if p.fused_rope and not fused(setup):  # TE's fused backward: the gradient read once, written once
        return rotary_bytes(setup, p, e), 0
    if fused(setup) or p.rope_complex_table or p.rope_cache_per_layer:
        return 2 * rotary_bytes(setup, p, e), 2 * rotary_kernels(setup, p)
    return 17 * e, 20


def rotary_kernels(setup: Setup, p: Profile) -> int:
    """Eager kernels of the rotary embedding on q and k: 5 each; fused 0 (fused kernels are charged no
    gap)."""
    return 0 if fused(setup) or p.fused_rope else 10


def norm_chain(setup: Setup, p: Profile) -> str | None:
    """Which measured chain a norm is (``efficiency.ELEMENTWISE_STREAM``): eager Llama RMSNorm, LayerNorm,
    or either compiled (``--compile``: Inductor's fused kernel); None for other fused norms and torch's
    eager ``F.rms_norm`` (not measured: charged at ``MEMORY``)."""
    layer = setup.model.norm is not NormType.RMSNORM
    if fused(setup):
        return "layernorm_compiled" if layer else "rmsnorm_compiled"
    if fused_norm(setup, p):
        return None
    if layer:
        return "layernorm"
    return None if p.rms_norm_fp32_product else "rmsnorm"


def rotary_chain(setup: Setup, p: Profile) -> str | None:
    """``rotate_half``'s rotary, eager or compiled; the complex-multiply forms and TE's fused kernel
    (``fused_rope``, at ``MEMORY``) are not measured."""
    if p.rope_complex_table or p.rope_cache_per_layer or (p.fused_rope and not fused(setup)):
        return None
    return "rotary_compiled" if fused(setup) else "rotary"


def mlp_chain(setup: Setup, p: Profile) -> str | None:
    """The MLP's activation: SwiGLU's ``silu(gate)·up`` or GELU, eager or compiled; other fused ones (a
    fused-SwiGLU profile) not measured."""
    if setup.model.mlp is MlpType.SWIGLU:
        if fused(setup):
            return "swiglu_compiled"
        return None if p.fused_swiglu else "swiglu"
    return "gelu_compiled" if fused(setup) else "gelu"


def core_chain(setup: Setup) -> str | None:
    """The reference's eager attention core (``eager_core``'s op list) is a measured chain; fused cores
    (Megatron's kernel, ``--compile``) and other code are not."""
    return "eager_core" if setup.impl.impl is Impl.REFERENCE and not fused(setup) else None


def weight(chain: str | None, backward: bool = False, gpu: GpuPreset | None = None) -> float:
    """How many bytes at the device's memory rate one byte of ``chain`` costs: ``MEMORY`` over its measured
    fraction of HBM (``efficiency.ELEMENTWISE_STREAM``), or with a calibrated GPU file that measured the
    chain (``memplan calibrate``) the calibrated copy rate over the chain's; 1 for an unmeasured chain."""
    if chain is None:
        return 1.0
    i = 1 if backward else 0
    calibrated = gpu.calibrated.elementwise if gpu and gpu.calibrated and gpu.calibrated.elementwise else {}
    if gpu and chain in calibrated:
        return efficiency.memory(gpu) / calibrated[chain][i]
    return efficiency.MEMORY / efficiency.ELEMENTWISE_STREAM[chain][i]


def eager_core(setup: Setup, e: int, backward: bool = False) -> tuple[int, int]:
    """Eager attention's element-wise work per element of the [b, a, s, s] scores, (bytes, kernels):
    memplan's reference (``scores · d^-½``, ``masked_fill`` of the causal mask, ``softmax``) 2e each, 6e
    in 3 kernels; its backward ``_softmax_backward_data`` (3e: the gradient and the probabilities read, one
    written), the masked fill's (2e) and the scale's (2e), 7e in 3. Other code (Megatron's fused
    scale-mask-softmax, one kernel; transformers' eager path, not traced op by op) one kernel of 2e, its
    backward twice that."""
    if setup.impl.impl is Impl.REFERENCE and not fused(setup):
        return (7 * e, 3) if backward else (6 * e, 3)
    return (4 * e, 2) if backward else (2 * e, 1)
