"""Pre-norms: RMSNorm as Llama's reference code (fp32 upcast), LayerNorm as ``native_layer_norm``; under a
profile with ``fused_norm`` (Megatron's Apex / TE kernels) either norm as one fused op."""

from __future__ import annotations

from memplan.analytic.inventory import Block, Dims, Role, Rule, save
from memplan.blocks.profiles import profile_of
from memplan.config import Device, DType, ModelConfig, NormType, Setup

FP32 = DType.FP32
R = Role


def norm_params(m: ModelConfig) -> int:
    """RMSNorm has a weight [h]; LayerNorm a weight and a bias [h] each."""
    return m.hidden_size * (2 if m.norm is NormType.LAYERNORM else 1)


def norm_rules(setup: Setup, block: Block, dims: Dims) -> list[Rule]:
    """Saves of one pre-norm over [b, s, h]."""
    b, s, h, act = dims.b, dims.s, dims.h, dims.act
    if profile_of(setup).fused_norm:
        return fused_norm_rules(setup, block, dims)
    if setup.model.norm is NormType.RMSNORM:
        # Llama's RMSNorm: x32 = x.float(); rstd = rsqrt(mean(x32²) + eps); n = (x32·rstd).to(A); w·n.
        # pow and x32·rstd save x32 (the layer input itself when A is fp32); rsqrt saves rstd; w·n saves n.
        # torch's F.rms_norm multiplies n by w in fp32 before the cast (Profile.rms_norm_fp32_product).
        why_x = "x upcast to fp32: d(x²)/dx and d(x·rstd)/drstd need it"
        normed = FP32 if profile_of(setup).rms_norm_fp32_product else act
        return [
            save(block, "input", (b, s, h), FP32, R.NORM_INPUT, why_x),
            save(block, "rstd", (b, s, 1), FP32, R.NORM_STATS, "rsqrt output: its derivative is -½·rstd³"),
            save(block, "normed", (b, s, h), normed, R.NORM_OUTPUT, "normalised x: dW = Σ grad·n needs it"),
        ]
    # native_layer_norm keeps mean and rstd in fp32 on CUDA but in the input dtype on CPU.
    stats = FP32 if setup.device is Device.CUDA else act
    # Parallel residual: the MLP's norm reads the layer input, kept already by the attention's norm.
    shared = block is Block.MLP_NORM and setup.model.parallel_residual
    inputs = (
        []
        if shared
        else [save(block, "input", (b, s, h), act, R.NORM_INPUT, "layer_norm backward recomputes x̂ from x")]
    )
    return [
        *inputs,
        save(block, "mean", (b, s, 1), stats, R.NORM_STATS, "layer_norm statistics for backward"),
        save(block, "rstd", (b, s, 1), stats, R.NORM_STATS, "layer_norm statistics for backward"),
    ]


def fused_norm_rules(setup: Setup, block: Block, dims: Dims) -> list[Rule]:
    """Apex ``FusedLayerNormAffineFunction`` / ``FusedRMSNormAffineFunction`` (and TE's norms):
    ``save_for_backward(input_, weight, bias, mean, invvar)`` — the input as it comes and fp32 statistics
    over [b, s] on any device (the kernels accumulate in fp32); RMSNorm has no mean."""
    b, s, h = dims.b, dims.s, dims.h
    why = "fused norm statistics (fp32) for backward"
    stats = [] if setup.model.norm is NormType.RMSNORM else ["mean"]
    return [
        save(
            block, "input", (b, s, h), dims.act, R.NORM_INPUT, "the fused norm's backward rebuilds x̂ from x"
        ),
        *[save(block, name, (b, s, 1), FP32, R.NORM_STATS, why) for name in (*stats, "rstd")],
    ]


def norm_backward_transient(setup: Setup, dims: Dims) -> int:
    """A pre-norm's backward at its peak, beyond the saves still held then (``norm_saves_at_peak``).

    Llama's explicit RMSNorm: five fp32 [T, h] at once — d(x·rstd)'s part through rstd, mean's backward
    (grad / h, expanded and materialised) and pow's backward (x.pow(1), ×2, ×grad); the incoming gradient
    and the 16-bit pieces are freed by then. ``native_layer_norm`` and the fused kernels: the incoming dY and
    dX [T, h].
    """
    t, h = dims.tokens, dims.h
    if setup.model.norm is NormType.LAYERNORM or profile_of(setup).fused_norm:
        return 2 * t * h * dims.act.bytes
    return 5 * 4 * t * h
