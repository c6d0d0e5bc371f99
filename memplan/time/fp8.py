"""Float8 training of the layers' linears (``--fp8 tensorwise|rowwise``, torchao's ``Float8Linear`` as
torchtitan converts them: every linear of the layers, not the lm head).

torchao quantizes the three products of a linear Y = X·Wᵀ ("Quantized Training", docs.pytorch.org/ao):
``Y = to_fp8(X) @ to_fp8(Wᵀ)``, ``dX = to_fp8(dY) @ to_fp8(W)``, ``dW = to_fp8(Xᵀ) @ to_fp8(dY)``: the
GEMMs run at the GPU's FP8 peak (``peak_tflops.fp8``, ``MATMUL`` × their wave and roofline efficiency with
1-byte operands), and each of the six ``to_fp8`` is a dynamic-scaling cast, memory-bound:
- tensorwise: an amax reduction over the tensor (reads e bytes an element), then the scaled cast (reads e,
  writes 1): 2e + 1 per element;
- rowwise: a row's amax and its cast in one pass (reads e, writes 1): e + 1.
X is [T, in], W [in, out], dY [T, out] per linear (e the activation bytes).

Known limitations (NB): rowwise's CUTLASS GEMM is taken as fast as cuBLAS's tensorwise one (torchao calls
tensorwise the fastest recipe; no figure in view); casts fused into a neighbouring op by torch.compile,
the float8 all-gather of FSDP and the amax all-reduce are not modelled. The memory: blocks/fp8.py (the saved
activations are bf16's; the casts' temporaries join the peak).
"""

from __future__ import annotations

from memplan.config import Fp8Recipe, Setup
from memplan.presets import GpuPreset
from memplan.time import gemm


def enabled(setup: Setup) -> bool:
    return setup.impl.fp8 is not Fp8Recipe.NONE


def peak(setup: Setup, gpu: GpuPreset) -> float:
    """FP8 dense peak FLOP/s; a one-line ``ValueError`` where the GPU has none."""
    if gpu.peak_tflops.fp8 is None:
        raise ValueError(
            f"fp8: {gpu.name} has no FP8 tensor cores; drop --fp8 or choose an FP8 GPU (H100, ...)"
        )
    return gpu.peak_tflops.fp8 * 1e12


def per_element(setup: Setup) -> int:
    """Bytes one cast moves per element (module docstring)."""
    e = setup.training.precision.activation_dtype.bytes
    return 2 * e + 1 if setup.impl.fp8 is Fp8Recipe.TENSORWISE else e + 1


def cast_bytes(setup: Setup) -> tuple[int, int]:
    """One layer's casts on one rank, (forward: X and Wᵀ; backward: dY twice, W and Xᵀ); 0 without fp8."""
    if not enabled(setup):
        return 0, 0
    forward = backward = 0
    for g in gemm.layer_gemms(setup):
        x, w, dy = g.count * g.rows * g.inner, g.count * g.inner * g.cols, g.count * g.rows * g.cols
        forward += x + w
        backward += 2 * dy + w + x
    per = per_element(setup)
    return forward * per, backward * per
