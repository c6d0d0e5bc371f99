"""Pre-norms: RMSNorm as Llama's reference code (fp32 upcast), LayerNorm as ``native_layer_norm``; under a
profile with ``fused_norm`` (Megatron's Apex / TE kernels) either norm as one fused op."""

from __future__ import annotations

from memplan.blocks.inventory import Block, Dims, Role, Rule, save
from memplan.blocks.profiles import profile_of, top_layer_grads
from memplan.config import Device, DType, ModelConfig, NormKernel, NormType, Setup
from memplan.config.trainable import base_trains

FP32 = DType.FP32
R = Role


def norm_params(m: ModelConfig) -> int:
    """RMSNorm has a weight [h]; LayerNorm a weight and a bias [h] each (no bias: ``norm_bias`` false)."""
    return m.hidden_size * (2 if m.norm is NormType.LAYERNORM and m.norm_bias else 1)


def cuda_fused_rms_norm(setup: Setup) -> bool:
    """torch's ``nn.RMSNorm`` on CUDA (``Profile.torch_rms_norm``): ``aten._fused_rms_norm``'s kernel, which
    keeps the input and the fp32 rstd (``compiled_rms_rules``) and runs as one kernel each way. The code's
    weight is in the activation dtype (FSDP2's ``param_dtype``, as the measured model's), so
    ``rms_norm_symint`` does not fall back to the composite over a dtype mismatch."""
    return (
        setup.device is Device.CUDA
        and setup.impl.norm_kernel is NormKernel.AUTO
        and setup.model.norm is NormType.RMSNORM
        and profile_of(setup).torch_rms_norm
    )


def released_as(setup: Setup) -> NormType:
    """The norm as its backward releases its saves: the decomposed RMSNorm frees its normalised x and rstd
    before its backward peaks (its first ops consumed them); LayerNorm's one backward op, and torch's fused
    CUDA RMSNorm's (``cuda_fused_rms_norm``), hold input and statistics to its end: read as LayerNorm's."""
    return NormType.LAYERNORM if cuda_fused_rms_norm(setup) else setup.model.norm


def norm_rules(setup: Setup, block: Block, dims: Dims) -> list[Rule]:
    """Saves of one pre-norm over [b, s, h]."""
    b, s, h, act = dims.b, dims.s, dims.h, dims.act
    if profile_of(setup).fused_norm:
        return fused_norm_rules(setup, block, dims)
    if profile_of(setup).compiled_block and block is not Block.FINAL_NORM:  # the final norm runs eagerly
        return compiled_rms_rules(block, "", (b, s, h), act)
    if cuda_fused_rms_norm(setup):
        why = "torch's fused CUDA RMSNorm (FusedRmsNormBackward0) keeps its input and the fp32 rstd"
        return compiled_rms_rules(block, "", (b, s, h), act, why)
    if setup.model.norm is NormType.RMSNORM:
        return rms_rules(setup, block, "", (b, s, h))
    if profile_of(setup).layernorm_python:
        return python_layernorm_rules(setup, block, "", (b, s, h))
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


def compiled_rms_rules(
    block: Block, prefix: str, shape: tuple[int, ...], act: DType, why: str = ""
) -> list[Rule]:
    """An RMSNorm inside a compiled block (``Profile.compiled_block``): the partitioner keeps x in the
    activation dtype and the fp32 rstd, and recomputes the fp32 upcast x32 and x32·rstd in backward
    (cheaper to rebuild by one element-wise pass than to keep in fp32). A fused RMSNorm kernel (TE's
    ``RMSNorm``: ``Profile.fused_norm``) keeps the same two (``why`` says which)."""
    stats = (*shape[:-1], 1)
    why = why or "kept by the compiled block: backward recomputes x32 and x32·rstd from x and rstd"
    return [
        save(block, prefix + "input", shape, act, R.NORM_INPUT, why),
        save(block, prefix + "rstd", stats, FP32, R.NORM_STATS, "rsqrt output: its derivative is -½·rstd³"),
    ]


def python_layernorm_rules(
    setup: Setup, block: Block, prefix: str, shape: tuple[int, ...], weight: tuple[int, ...] = ()
) -> list[Rule]:
    """Saves of Cohere's LayerNorm written in Python (``Profile.layernorm_python``) over the last dimension
    of ``shape``: x32 = x.to(fp32); mean; ``(x32 − mean).pow(2)`` keeps its fp32 input; ``(x32 − mean) *
    rsqrt(var + eps)`` a second fp32 x − mean (computed again) and rsqrt's output; ``weight.to(fp32) *
    normed`` the fp32 normalised x and, under 16-bit weights, the fp32 weight copy (``weight``: its shape,
    default the last dimension's)."""
    act = Dims.of(setup).act
    stats = (*shape[:-1], 1)

    def ln(part: str, shape: tuple[int, ...], role: Role, why: str) -> Rule:
        return save(block, prefix + part, shape, FP32, role, why)

    rules = [
        ln("input", shape, R.NORM_INPUT, "fp32 x − mean for pow(2): d(x²)/dx needs it"),
        ln("centered", shape, R.NORM_INPUT, "fp32 x − mean again, an operand of ·rstd: drstd needs it"),
        ln("rstd", stats, R.NORM_STATS, "rsqrt output: the product's d(x − mean) and its own derivative"),
        ln("normed", shape, R.NORM_OUTPUT, "fp32 normalised x: dW needs it"),
    ]
    if act is not FP32:
        why = "weight.to(fp32): d(normed) needs it"
        rules.append(ln("weight_fp32", weight or shape[-1:], R.PARAM_DERIVED, why))
    return rules


def rms_rules(setup: Setup, block: Block, prefix: str, shape: tuple[int, ...]) -> list[Rule]:
    """Saves of one RMSNorm over the last dimension of ``shape``.

    Llama's: x32 = x.float(); rstd = rsqrt(mean(x32²) + eps); n = (x32·rstd).to(A); w·n. pow and x32·rstd
    save x32 (the input itself when A is fp32); rsqrt saves rstd; w·n saves n (fp32 under torch's
    ``F.rms_norm``, ``rms_norm_fp32_product``). Gemma's
    (``norm_fp32_affine``): (x32·rstd) · (1 + w.float()), then cast: the product keeps both fp32 operands.
    """
    act = Dims.of(setup).act
    stats, width = (*shape[:-1], 1), (shape[-1],)

    def rms(part: str, shape: tuple[int, ...], dtype: DType, role: Role, why: str) -> Rule:
        return save(block, prefix + part, shape, dtype, role, why)

    rules = [
        rms("input", shape, FP32, R.NORM_INPUT, "x upcast to fp32: d(x²)/dx and d(x·rstd)/drstd need it"),
        rms("rstd", stats, FP32, R.NORM_STATS, "rsqrt output: its derivative is -½·rstd³"),
    ]
    prof = profile_of(setup)
    if prof.norm_fp32_affine:
        return [
            *rules,
            rms("normed", shape, FP32, R.NORM_OUTPUT, "fp32 normalised x: dW needs it"),
            rms("weight_plus_one", width, FP32, R.PARAM_DERIVED, "fp32 1 + w: d(normed) needs it"),
        ]
    # torch's F.rms_norm multiplies n by w in fp32 before the cast (Profile.rms_norm_fp32_product).
    normed = FP32 if prof.rms_norm_fp32_product else act
    return [*rules, rms("normed", shape, normed, R.NORM_OUTPUT, "normalised x: dW = Σ grad·n needs it")]


def qk_norm_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """The per-head RMSNorms on q [b, a, s, d] and k [b, kv, s, d] before RoPE (``qk_norm``); OLMo-2's
    (``qk_norm_whole``: ``self.q_norm(self.q_proj(x))``) over q_proj's [b, s, a·d] and k_proj's
    [b, s, kv·d] outputs, one statistic per token; Cohere's (``use_qk_norm``) a Python LayerNorm with a
    [heads, d] weight over each head of the [b, s, heads, d] views."""
    if not setup.model.qk_norm:
        return []
    b, s, d = dims.b, dims.s, dims.d
    if profile_of(setup).fused_norm:  # Megatron-core's TE layer spec: q_layernorm = k_layernorm = TENorm
        why = "the fused norm's backward rebuilds x̂ from x"
        q = compiled_rms_rules(Block.ATTN, "q_norm.", (b, dims.a, s, d), dims.act, why)
        return q + compiled_rms_rules(Block.ATTN, "k_norm.", (b, dims.kv, s, d), dims.act, why)
    if profile_of(setup).compiled_block:  # the projections' outputs and rstd (compiled_rms_rules)
        q = compiled_rms_rules(Block.ATTN, "q_norm.", (b, dims.a, s, d), dims.act)
        return q + compiled_rms_rules(Block.ATTN, "k_norm.", (b, dims.kv, s, d), dims.act)
    if setup.model.qk_norm_whole and profile_of(setup).layernorm_python:
        # Cohere's q_norm / k_norm: CohereLayerNorm((heads, d)) on the [b, s, heads, d] views, per head.
        a, kv = dims.a, dims.kv
        q = python_layernorm_rules(setup, Block.ATTN, "q_norm.", (b, s, a, d), (a, d))
        return q + python_layernorm_rules(setup, Block.ATTN, "k_norm.", (b, s, kv, d), (kv, d))
    if setup.model.qk_norm_whole and setup.model.norm is NormType.LAYERNORM:
        return per_head_layernorm_rules(setup, "q_norm.", dims.a, dims) + per_head_layernorm_rules(
            setup, "k_norm.", dims.kv, dims
        )
    if setup.model.qk_norm_whole:
        q = rms_rules(setup, Block.ATTN, "q_norm.", (b, s, dims.a * d))
        return q + rms_rules(setup, Block.ATTN, "k_norm.", (b, s, dims.kv * d))
    q = rms_rules(setup, Block.ATTN, "q_norm.", (b, dims.a, s, d))
    return q + rms_rules(setup, Block.ATTN, "k_norm.", (b, dims.kv, s, d))


def pre_norm_rules(setup: Setup, block: Block, dims: Dims) -> list[Rule]:
    """The norms before attention and the MLP (none without ``pre_norms``: OLMo-2's sublayers read the
    residual, which W_Q/W_K/W_V and W_gate/W_up keep as their input; the attention's alone under
    ``shared_norm``)."""
    if block is Block.MLP_NORM and setup.model.shared_norm:
        return []  # one norm feeds both branches (``shared_norm``): the attention's
    return norm_rules(setup, block, dims) if setup.model.pre_norms else []


def per_head_layernorm_rules(setup: Setup, prefix: str, heads: int, dims: Dims) -> list[Rule]:
    """StableLM's ``StableLmLayerNormPerHead`` (``qk_layernorm``): ``torch.split(x, 1, dim=1)`` of the
    [b, heads, s, d] view and one ``nn.LayerNorm(d, bias=False)`` per head. ``native_layer_norm`` keeps
    its input, a view of the projection's [b, s, heads·d] output (one storage for all heads), and each
    head's mean and rstd [b, 1, s, 1] (fp32 on CUDA, the input dtype on CPU)."""
    b, s, act = dims.b, dims.s, dims.act
    stats = FP32 if setup.device is Device.CUDA else act
    why = "the projection's output: each head's layer_norm keeps its view"
    rules = [save(Block.ATTN, prefix + "input", (b, s, heads * dims.d), act, R.NORM_INPUT, why)]
    for i in range(heads):
        for part in ("mean", "rstd"):
            why = f"head {i}'s layer_norm statistics for backward"
            rules.append(save(Block.ATTN, f"{prefix}{part}{i}", (b, 1, s, 1), stats, R.NORM_STATS, why))
    return rules


def post_norm_rules(setup: Setup, block: Block, dims: Dims) -> list[Rule]:
    """The norms on the attention's and the MLP's outputs (``post_norms``), saving as a pre-norm does."""
    return norm_rules(setup, block, dims) if setup.model.post_norms else []


def norm_backward_transient(
    setup: Setup, dims: Dims, weight_grad: int | None = None, unpacked: bool = False
) -> int:
    """A pre-norm's backward at its peak, beyond the saves still held then (``norm_saves_at_peak``).

    Llama's explicit RMSNorm: five fp32 [T, h] at once — d(x·rstd)'s part through rstd, mean's backward
    (grad / h, expanded and materialised) and pow's backward (x.pow(1), ×2, ×grad); the incoming gradient
    and the 16-bit pieces are freed by then. ``native_layer_norm`` and the fused kernels (torch's CUDA
    ``_fused_rms_norm_backward`` among them, ``cuda_fused_rms_norm``): the incoming dY and dX [T, h].
    Cohere's Python LayerNorm (``python_layernorm``) where its weight trains (``weight_grad``: the bytes
    of its gradient the moment counts as made) ``python_layernorm_backward``'s (``unpacked``: its saves a
    checkpoint's re-run); frozen (None) ``python_layernorm_frozen_backward``'s.
    """
    t, h = dims.tokens, dims.h
    prof = profile_of(setup)
    if python_layernorm(setup):  # frozen (None): no weight gradient, its pow's backward the top
        if weight_grad is None:
            return python_layernorm_frozen_backward(dims)
        return python_layernorm_backward(dims, unpacked) - weight_grad
    # NB: a compiled block's backward is one generated kernel graph; its norm's transient is taken as a
    # fused kernel's (dY and dX), not measured.
    if setup.model.norm is NormType.LAYERNORM or prof.fused_norm or prof.compiled_block:
        return 2 * t * h * dims.act.bytes
    if cuda_fused_rms_norm(setup):  # the fused backward kernel: dY and dX
        return 2 * t * h * dims.act.bytes
    return 5 * 4 * t * h


def python_layernorm(setup: Setup) -> bool:
    """The norm is Cohere's ``CohereLayerNorm`` in Python ops (``Profile.layernorm_python``;
    ``python_layernorm_rules``), not a fused kernel's nor a compiled block's."""
    prof = profile_of(setup)
    plain = not (prof.fused_norm or prof.compiled_block)
    return plain and prof.layernorm_python and setup.model.norm is NormType.LAYERNORM


def python_layernorm_backward(dims: Dims, unpacked: bool = False) -> int:
    """``CohereLayerNorm``'s backward at its top where its weight trains, beyond its saves, all still held
    (``python_layernorm_rules``): its first node, ``.to(input_dtype)``'s, makes the incoming dY in fp32
    (the 16-bit dY freed as it ends); ``self.weight.to(float32) * hidden_states``' backward then makes
    d(normed) = dY32 · w32 and dY32 · normed [T, h] fp32 and sums the latter over the tokens to the fp32
    [h] weight gradient: 3 · 4·T·h + 4·h, before the node ends (it frees dY32, normed and the weight copy)
    and the weight's 16-bit gradient is made. Later nodes hold less: at ``pow``'s backward five fp32
    [T, h] (d(x − mean) of the product, mean's, pow's three) and x − mean are alive, but the product's
    second x − mean, the normalised x and the weight copy are freed: lower by those two and the sum, less
    the weight's 16-bit gradient. ``unpacked``: the saves are a non-reentrant checkpoint's re-run, which
    the node holds only while its function runs: the engine's sum to [h] comes after the node returned
    them (the normalised x and the weight copy freed), so the top is the product, without the 4·h sum.
    Measured at Command R's widths (h 8,192, s 512): the final norm's backward 33,570,816 B above the
    native layer_norm's dY and dX before; the layer's 12·T·h + 6·h B above it without checkpointing,
    12·T·h + 2·h under full checkpointing (tests/hf/test_cohere_peak.py)."""
    return 3 * 4 * dims.tokens * dims.h + (0 if unpacked else 4 * dims.h)


def python_layernorm_frozen_backward(dims: Dims) -> int:
    """``CohereLayerNorm``'s backward at its top where its weight is frozen (LoRA), beyond its saves, all
    held at its start (``python_layernorm_rules``): ``.to(input_dtype)``'s node makes dY in fp32 and frees
    the 16-bit one; the weight product's makes d(normed) = dY32 · w32 (no weight gradient) and frees dY32
    and the weight copy [h]; the product with rsqrt's makes d(x − mean) and (x − mean) · d(normed), summed
    to rsqrt's [T, 1] gradient, then frees d(normed) and its second x − mean; at ``pow``'s backward five
    fp32 [T, h] are alive — d(x − mean), mean's backward (the gradient / h, expanded and materialised),
    pow's x.pow(1), its ×2 and ×grad — beside the first x − mean and rstd, still saved: 5 · 4·T·h less the
    second x − mean and the weight copy, 16·T·h − 4·h B. Measured at Command R's widths (h 8,192, s 512,
    LoRA, with and without checkpointing): the final norm's moment 50,298,880 B above the native
    layer_norm's dY and dX (4·T·h B at 16 bits) it was read as (tests/hf/test_cohere_peak.py); the
    layers' frozen norms read so too (``norm_backward_transient``), their moments exact as before."""
    return 4 * 4 * dims.tokens * dims.h - 4 * dims.h


def python_layernorm_over(setup: Setup, dims: Dims, weights: int) -> int:
    """The top layer's norm's backward transient (``weights``: its parameters, their gradient counted as
    made, ``top_layer_grads``, where its base trains; its saves unpacked from a non-reentrant
    checkpoint's re-run under ``segment``) over its reading as a frozen one (``norm_backward_transient``):
    Cohere's Python LayerNorm's fp32 pieces (``python_layernorm_backward``) over native layer_norm's dY
    and dX; 0 elsewhere. ``analytic.moments.layer_backward`` adds it at the attention norm's moment, the one
    norm
    of Cohere's parallel layer; its MLP norm's (the MLP's end: that layer has no MLP norm) is read without."""
    if not base_trains(setup, setup.model.num_layers - 1):
        return 0
    unpacked = bool(setup.strategy.segment) and not setup.impl.reentrant
    weight_grad = top_layer_grads(setup, weights)
    return norm_backward_transient(setup, dims, weight_grad, unpacked) - norm_backward_transient(setup, dims)
