"""The per-kernel time model (issue #21 item 2): attention by implementation and GPU generation, GEMMs
that are memory-bound by their arithmetic intensity, LoRA's narrow adapters. Every expected figure is
derived here by hand from the shapes, the GPU's datasheet figures and the constants' sources."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from memplan.api import Options, build
from memplan.cli.app import app
from memplan.config import Setup
from memplan.time import efficiency as eff
from memplan.time import gemm
from memplan.time.gemm import Gemm

runner = CliRunner(env={"COLUMNS": "120", "NO_COLOR": "1"})

# Llama-3-8B: 32 heads of 128, 32 layers.
A, D, L = 32, 128, 32


def _attention_s(**kw: object) -> float:
    b = build(Options(model="llama-3-8b", **kw))  # type: ignore[arg-type]
    assert b.timing is not None
    return b.timing.prediction.attention_s


def _flash_flops(s: int) -> tuple[int, int]:
    """The flash core of one micro-batch (b 1), forward and backward: forward QKᵀ and P·V 2 × 2·a·s²·d
    per layer, backward five such products (S recomputed, dP, dV, dQ, dK) → 4 and 10·a·s²·d per layer."""
    return 4 * A * s * s * D * L, 10 * A * s * s * D * L


# FlashAttention-2 on Hopper at s 4,096, heads of 128 (time/efficiency.py FA2_HOPPER_BY_SEQUENCE, measured
# on an H200): 0.328 forward and 0.251 backward on a full grid, against its 64k end of 0.351 and 0.327,
# which the paper's figures stand for (forward 35 %, FlashAttention-3's abstract; backward 318 of 989
# TFLOP/s, 0.32); this call's grid, b 1 × 32 heads × 32 query tiles = 1,024 tiles on 132 SMs, runs 0.274
# and 0.231 of peak (FA2_HOPPER_GRID at 4,096), so 0.274/0.328 and 0.231/0.251 of the full grid's.
F4K = 0.35 * 0.328 / 0.351 * (0.274 / 0.328)
B4K = 0.32 * 0.251 / 0.327 * (0.231 / 0.251)


@pytest.mark.parametrize(
    ("gpu", "kernel", "peak", "forward", "backward"),
    [
        ("a100-80gb", "auto", 312e12, 0.50, 0.50),  # FlashAttention-2 on A100: the FA2 paper's low end
        ("h100-sxm", "auto", 989.5e12, F4K, B4K),
        ("h100-sxm", "fa2", 989.5e12, F4K, B4K),
        ("h100-sxm", "fa3", 989.5e12, F4K * 1.5, B4K * 1.5),  # FA3: 1.5–2.0× FA2 on H100, the low end
        # FA1 (flash-attn 1.x and its Triton version) on A100: "25-40%" (the FA2 paper on FA1), the low end
        ("a100-80gb", "fa1", 312e12, 0.25, 0.25),
        # FA1 on H100: an Ampere kernel, scaled as FA2 falls from A100 (0.50) to H100: 0.25 × FA2's / 0.5
        ("h100-sxm", "fa1", 989.5e12, 0.25 * F4K / 0.5, 0.25 * B4K / 0.5),
        # cuDNN on Hopper: its own measured rows (time/efficiency.py CUDNN_HOPPER), at s 4,096
        ("h100-sxm", "cudnn", 989.5e12, 0.527, 0.458),
    ],
)
def test_flash_attention_by_kernel_and_generation(
    gpu: str, kernel: str, peak: float, forward: float, backward: float
) -> None:
    # A causal flash kernel runs half the counted cells (FlashAttention's benchmark halves causal FLOPs,
    # and the fractions are TFLOP/s of that count).
    seconds = _attention_s(seq=4096, gpu=gpu, attention_kernel=kernel)
    fwd, bwd = _flash_flops(4096)
    assert seconds == pytest.approx(fwd / 2 / (forward * peak) + bwd / 2 / (backward * peak), rel=1e-12)


@pytest.mark.parametrize("cp", [2, 4, 16])
def test_a_context_parallel_rank_runs_c_of_c_plus_one_of_its_counted_cells(cp: int) -> None:
    """torch's load-balanced ring: a rank's local block is causal ((s/c)²/2 cells run of (s/c)² counted), its
    c − 1 others full blocks of (s/c)²/2 cells: counted (c + 1)/2 · (s/c)², run c/2 · (s/c)²."""
    s = 8192
    counted = (s // cp) ** 2 + (cp - 1) * (s // cp) ** 2 // 2
    ran = cp * (s // cp) ** 2 // 2
    assert ran / counted == pytest.approx(cp / (cp + 1), rel=1e-15)
    one = _attention_s(seq=s, gpu="h100-sxm", cp=cp, gpus=cp)
    # the core's products on the rank's counted cells, forward 4 and backward 10 per cell, head and layer
    fwd, bwd = 4 * A * counted * D * L, 10 * A * counted * D * L
    # FlashAttention-2's rate at the calls' length s/c (4,096, 2,048, 512 → held at the table's 1,024): the
    # local block causal (FA2_HOPPER_BY_SEQUENCE) on its grid, 32 heads × (s/c)/128 query tiles
    # (FA2_HOPPER_GRID: 1,024 tiles at 4,096, 512 at 2,048, 128 at 512, the 1,024 row's ratios); the c − 1
    # others not causal (FA2_HOPPER_NONCAUSAL) at their full-grid rate from 512 tiles, at 128 tiles
    # FA2_HOPPER_NONCAUSAL_GRID's 0.801 forward and 0.868 backward of it; by cells
    causal = {2: (0.328, 0.251), 4: (0.306, 0.212), 16: (0.268, 0.168)}[cp]
    other = {2: (0.348, 0.280), 4: (0.333, 0.251), 16: (0.309, 0.214)}[cp]
    grid = {
        2: (0.274 / 0.328, 0.231 / 0.251),
        4: (0.208 / 0.306, 0.176 / 0.212),
        16: (0.124 / 0.268, 0.072 / 0.168),
    }[cp]
    other_grid = {2: (1.0, 1.0), 4: (1.0, 1.0), 16: (0.801, 0.868)}[cp]
    rate = [
        1 / (1 / cp / (c * g) + (1 - 1 / cp) / (o * og))
        for c, o, g, og in zip(causal, other, grid, other_grid, strict=True)
    ]
    forward, backward = 0.35 * rate[0] / 0.351, 0.32 * rate[1] / 0.327
    expected = (fwd / (forward * 989.5e12) + bwd / (backward * 989.5e12)) * cp / (cp + 1)
    assert one == pytest.approx(expected, rel=1e-12)


def test_the_constants_are_the_sources_figures() -> None:
    assert (eff.ATTENTION, eff.FA2_HOPPER, eff.FA3_SPEEDUP) == (0.50, 0.35, 1.5)
    # FlashAttention-3's backward figure: FA2 318 TFLOP/s at 8k, head dim 128, of H100 SXM's 989
    assert round(318 / 989, 2) == eff.FA2_HOPPER_BACKWARD
    # STREAM triad at 2,493 MB/s of DDR4-1600 × 16 bit's 3,200 MB/s wire rate (TI SPRAD45A Table 3-3)
    assert round(2493 / 3200, 2) == eff.HOST_MEMORY


def test_flashattention_3_off_hopper_is_a_one_line_error() -> None:
    r = runner.invoke(
        app, ["estimate", "-m", "llama-3-8b", "--gpu", "a100-80gb", "--attention-kernel", "fa3"]
    )
    assert r.exit_code == 2
    assert "attention-kernel: FlashAttention-3 runs on Hopper GPUs only" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_eager_attention_is_memory_bound_on_a100() -> None:
    # Eager QKᵀ [s, d]·[d, s] per head reads 2·s·d and writes s² elements for 2·s²·d FLOPs: intensity
    # s·d/(2d + s) = 2048·128/2304 ≈ 113.8 FLOPs per byte (bf16) under A100-80GB's ridge
    # (MATMUL·312 TFLOP/s)/(MEMORY·2,039 GB/s) ≈ 153. P·V [s, s]·[s, d] and every gradient product (dQ, dK,
    # dP, dV) move the same three matrices' kind: the same intensity. Their waves are fuller than that
    # (QKᵀ's 32 heads × 128 tiles of 256×128 on 108 SMs: 38 waves, 99.8 %; the [s, d] outputs of 128×128
    # tiles: 512 tiles, 5 waves, 94.8 %), so every product runs at its bytes: time = FLOPs / (MEMORY ·
    # 2,039 GB/s · 113.8). FLOPs: forward 2 × 2·a·s²·d, backward twice that, per layer.
    s = 2048
    intensity = s * D / (2 * D + s)
    flops = 12 * A * s * s * D * L
    seconds = _attention_s(seq=s, gpu="a100-80gb", attention="eager")
    assert seconds == pytest.approx(flops / (eff.MEMORY * 2039e9 * intensity), rel=1e-12)


def test_a_narrow_gemm_runs_at_its_bytes() -> None:
    # [4096, 4096]·[4096, 16] (a LoRA A of rank 16): 2·4096·4096·16 FLOPs over (4096² + 2·4096·16)·2 bytes
    # = 4096·16/4128 ≈ 15.9 FLOPs per byte; against a ridge of 295.4 it runs at 15.9/295.4 of MATMUL.
    roof = gemm.Roofline(ridge=989.5e12 / 3350e9, element_bytes=2)
    g = Gemm(4096, 4096, 16)
    assert gemm.efficiency(g, None, roof) == pytest.approx(
        (4096 * 16 / 4128) / (989.5e12 / 3350e9), rel=1e-12
    )
    assert gemm.efficiency(g, None) == 1.0  # without a roofline: the best shape's speed


def test_lora_adapters_are_gemms_of_rank_r() -> None:
    b = build(Options(model="llama-3-8b", seq=2048, finetune="lora", lora_rank=8))
    setup: Setup = b.result.setup
    shapes = gemm.adapter_gemms(setup, 2048)
    # q: A [4096, 8], B [8, 4096]; v: A [4096, 8], B [8, 1024] (8 kv heads of 128)
    assert shapes == [Gemm(2048, 4096, 8), Gemm(2048, 8, 4096), Gemm(2048, 4096, 8), Gemm(2048, 8, 1024)]
    assert gemm.adapter_gemms(setup.model_copy(update={"finetune": type(setup.finetune)()}), 2048) == []


def _elementwise_s(**kw: object) -> float:
    b = build(Options(model="llama-3-8b", seq=4096, gpu="h100-sxm", **kw))  # type: ignore[arg-type]
    assert b.timing is not None
    return b.timing.prediction.elementwise_s


def test_eager_and_compiled_element_wise_bytes_by_hand() -> None:
    # One layer's forward on one H100, T = 4096 tokens, h 4096, f 14336, 32 q + 8 kv heads of 128, bf16
    # (e = 2); 32 layers, at MEMORY × 3,350 GB/s.
    T, h, f, e = 4096, 4096, 14336, 2
    residual = 2 * 3 * T * h * e  # two adds: read two, write one
    rope_elements = T * (32 + 8) * 128
    # eager: RMSNorm 28 + 4e per element (fp32 upcast, pow, mean, rsqrt product, cast back, weight);
    # rotary 10e (q·cos, rotate_half's neg and cat, ·sin, the sum); SwiGLU 5e (silu, then the product)
    eager = 2 * T * h * (28 + 4 * e) + residual + rope_elements * 10 * e + T * f * 5 * e
    # its backward by the eager autograd op lists (time/elementwise.py): RMSNorm 8e + 76; five gradient
    # sums of 3e (the residual stream before each norm, the input of the separate W_Q, W_K, W_V twice, of
    # gate and up once); rotary 17e; SwiGLU 9e
    eager_back = 2 * T * h * (8 * e + 76) + 5 * 3 * T * h * e + rope_elements * 17 * e + T * f * 9 * e
    # --compile: each chain one kernel, its input read and its output written once; its backward twice that
    compiled = 2 * T * h * 2 * e + residual + rope_elements * 2 * e + T * f * 3 * e
    # the compiled chains at their measured rates (ELEMENTWISE_STREAM *_compiled: RMSNorm 0.705/0.703,
    # rotary 0.755/0.402, SwiGLU 0.851/0.988; the adds at MEMORY), backward twice the forward's bytes
    norm_c, rope_c, mlp_c = 2 * T * h * 2 * e, rope_elements * 2 * e, T * f * 3 * e
    assert compiled == norm_c + residual + rope_c + mlp_c
    c_forward = norm_c / 0.705 + residual / 0.80 + rope_c / 0.755 + mlp_c / 0.851
    c_backward = 2 * (norm_c / 0.703 + residual / 0.80 + rope_c / 0.402 + mlp_c / 0.988)
    assert _elementwise_s(compile=True) == pytest.approx(32 * (c_forward + c_backward) / 3350e9, rel=1e-12)
    # eager chains stream at the fractions of HBM measured alone on an H200 (time/efficiency.py
    # ELEMENTWISE_STREAM, forward/backward): RMSNorm 0.584/0.664, rotary 0.295/0.348, SwiGLU 0.872/0.877;
    # the residual adds and gradient sums at MEMORY
    hbm = 3350e9
    norm, rope, mlp = 2 * T * h * (28 + 4 * e), rope_elements * 10 * e, T * f * 5 * e
    norm_b, rope_b, mlp_b = 2 * T * h * (8 * e + 76), rope_elements * 17 * e, T * f * 9 * e
    sums = 5 * 3 * T * h * e
    assert eager == norm + residual + rope + mlp and eager_back == norm_b + sums + rope_b + mlp_b
    forward = norm / 0.584 + residual / 0.80 + rope / 0.295 + mlp / 0.872
    backward = norm_b / 0.664 + sums / 0.80 + rope_b / 0.348 + mlp_b / 0.877
    assert _elementwise_s() == pytest.approx(32 * (forward + backward) / hbm, rel=1e-12)


def test_megatrons_fused_kernels_need_no_compile() -> None:
    assert _elementwise_s(impl="megatron") < _elementwise_s(impl="reference")


def test_megatrons_fused_element_wise_bytes_by_hand() -> None:
    """Megatron-core's default fusions, every chain one kernel at ``MEMORY`` (none of them measured): the
    Apex/TE norms 2e, TE's fused RoPE (``apply_rope_fusion``, on unless ``--no-rope-fusion``) 2e per
    element of q and k in forward and again on their gradients, the fused SwiGLU 3e per [T, f] element; the
    norms' and SwiGLU's backward twice their forward's; W_QKV and W_fc1 fused, so no gradient of a normed
    input is summed, only the residual stream's before each norm (3e each). Llama-3-8B at T = 4096 on one
    H100, 32 layers, bf16; no launch gap is charged for fused kernels."""
    T, h, f, e = 4096, 4096, 14336, 2
    residual = 2 * 3 * T * h * e
    rope = T * (32 + 8) * 128 * 2 * e
    forward = 2 * T * h * 2 * e + residual + rope + T * f * 3 * e
    backward = 2 * (2 * T * h * 2 * e) + 2 * 3 * T * h * e + rope + 2 * (T * f * 3 * e)
    assert _elementwise_s(impl="megatron") == pytest.approx(
        32 * (forward + backward) / (0.80 * 3350e9), rel=1e-12
    )


@pytest.mark.parametrize(("ep", "sorts"), [(8, 2), (128, 0)])
def test_megatrons_token_dispatch_and_combine_by_hand(ep: int, sorts: int) -> None:
    """Megatron-core's MoE layer under TE's fused permutation (transformer_engine/pytorch/triton/
    permutation.py): the permute reads each of the T tokens once and writes its k slots, the unpermute
    reads the S = T·k slots and writes T; with more than one local expert (E/ep = 16) two chunk sorts copy
    the S slots each, with one (ep 128) none. The backward runs each kernel's inverse: the same bytes, not
    twice them. Qwen3 30B-A3B (h 2048, k 8) at T = 4,096, bf16."""
    from memplan.time import layer_elementwise as le

    T, S, h, e = 4096, 4096 * 8, 2048, 2
    setup = build(Options(model="qwen3-30b-a3b", seq=T, impl="megatron", ep=ep, gpus=ep)).result.setup
    expected = (2 * (T + S) + sorts * 2 * S) * h * e
    assert le.dispatch(setup) == (expected, None)
    assert le.elementwise_parts(setup)[-1] == le.elementwise_backward_parts(setup)[-1] == (expected, None)


def test_the_reference_moes_dispatch_and_combine_by_hand() -> None:
    """memplan's reference MoE op by op (measure/reference/moe.py ``routed``): forward ``index_select`` 2Sh,
    the grouped products' ``cat`` of gate's, up's (2Sf each) and down's (2Sh) outputs, the weighted product
    2Sh, ``new_zeros`` Th and ``index_add_`` 3Sh; backward ``index_select`` 2Sh, the product's two
    gradients 6Sh, the ``split`` backwards' ``cat`` 2Sf (down's input) and 2Sh each (gate's and up's
    input), their sum 3Sh, ``index_add_`` into zeros 3Sh + Th. Qwen3 30B-A3B (h 2048, f 768, k 8) at T =
    4,096, bf16; transformers' code (``--impl hf``) is not counted."""
    from memplan.time import layer_elementwise as le

    T, S, h, f, e = 4096, 4096 * 8, 2048, 768, 2
    reference = build(Options(model="qwen3-30b-a3b", seq=T)).result.setup
    assert le.dispatch(reference) == (((9 * h + 4 * f) * S + T * h) * e, None)
    assert le.dispatch(reference, backward=True) == (((18 * h + 2 * f) * S + T * h) * e, None)
    assert le.elementwise_backward_parts(reference)[-1] == le.dispatch(reference, backward=True)


@pytest.mark.parametrize(
    ("model", "h", "k", "q"), [("qwen3-30b-a3b", 2048, 8, 2), ("mixtral-8x7b", 4096, 2, 4)]
)
def test_transformers_grouped_mm_dispatch_and_combine_by_hand(model: str, h: int, k: int, q: int) -> None:
    """transformers' ``grouped_mm_experts_forward`` op by op: forward the gather 2She, ``proj_out * w``
    Sh(e + q), the inverse permutation's gather 2Shq, the per-token sum Shq + Thq, and where the weighted
    output is fp32 (Mixtral's router keeps its weights fp32: q = 4) the cast back Th(q + e); backward the
    casts, the gathers' ``index_put_`` into zeros (4Shq; the first Th e + 3She) and the product's 5Shq + She.
    At T = 4,096, bf16; ``--experts eager`` (the modeling file's loop) is not counted."""
    from memplan.time import layer_elementwise as le

    T, e = 4096, 2
    S = T * k
    cast = q != e
    forward = 2 * S * h * e + S * h * (e + q) + 3 * S * h * q + T * h * q + (T * h * (q + e) if cast else 0)
    backward = (T + S) * h * (q + e) * cast + S * h * (5 * q + e) + 4 * S * h * q + T * h * e + 3 * S * h * e
    hf = build(Options(model=model, seq=T, impl="hf")).result.setup
    assert le.dispatch(hf) == (forward, None)
    assert le.dispatch(hf, backward=True) == (backward, None)
    eager = build(Options(model=model, seq=T, impl="hf", experts="eager")).result.setup
    assert le.dispatch(eager) == (0, None)  # NB: the loop's ops are not counted


def _fp8_prediction(recipe: str) -> tuple[float, float]:
    """(matmul_s, elementwise_s) of Llama-3-8B at T = 4096 on one H100 without an SM count (no wave loss)."""
    from memplan.config import ImplConfig, Setup, TrainingConfig
    from memplan.engine import estimate
    from memplan.presets import load_gpu, load_model_preset
    from memplan.time.timing import timing

    setup = Setup(
        model=load_model_preset("llama-3-8b").model,
        training=TrainingConfig(seq_len=4096),
        impl=ImplConfig(fp8=recipe),  # type: ignore[arg-type]
    )
    pr = timing(estimate(setup), load_gpu("h100-sxm").model_copy(update={"sms": None})).prediction
    return pr.matmul_s, pr.elementwise_s


# Llama-3-8B's linears per layer, (in, out): q, k, v, o, gate, up, down.
LINEARS = [
    (4096, 4096),
    (4096, 1024),
    (4096, 1024),
    (4096, 4096),
    (4096, 14336),
    (4096, 14336),
    (14336, 4096),
]


@pytest.mark.parametrize(("recipe", "per_element"), [("tensorwise", 2 * 2 + 1), ("rowwise", 2 + 1)])
def test_fp8_gemms_at_the_fp8_peak_and_their_casts(recipe: str, per_element: int) -> None:
    T = 4096
    # Every layer GEMM is compute-bound at T = 4096 (the narrowest, W_K [4096, 4096]·[4096, 1024], has
    # 4096·1024/6144 ≈ 683 FLOPs per bf16 byte against a ridge of 295; in fp8 twice the intensity against
    # 0.709 · 1,979 / 3,350 ≈ 419): the layers' forward and backward (3×) at MATMUL_FP8 × 1,979 TFLOP/s
    # (the float8 sweep's fraction on H100), the lm head [T, 4096]·[4096, 128256] in bf16 at MATMUL × 989.5.
    layer = sum(2 * T * i * o for i, o in LINEARS)
    head = 2 * T * 4096 * 128256
    matmul, elementwise = _fp8_prediction(recipe)
    expected = 3 * 32 * layer / (eff.MATMUL_FP8 * 1979e12) + 3 * head / (eff.MATMUL * 989.5e12)
    assert matmul == pytest.approx(expected, rel=1e-12)
    # Six casts per linear (torchao's docs: X and Wᵀ forward; dY twice, W and Xᵀ backward) on [T, in],
    # [in, out], [T, out]; tensorwise 2e + 1 bytes an element (amax pass, then the cast), rowwise e + 1.
    casts = sum((T * i + i * o) + (2 * T * o + i * o + T * i) for i, o in LINEARS)
    _, plain = _fp8_prediction("none")
    assert elementwise - plain == pytest.approx(32 * casts * per_element / (eff.MEMORY * 3350e9), rel=1e-9)


def test_fp8_on_a_gpu_without_fp8_is_a_one_line_error() -> None:
    r = runner.invoke(app, ["estimate", "-m", "llama-3-8b", "--gpu", "a100-80gb", "--fp8", "tensorwise"])
    assert r.exit_code == 2
    assert (
        r.stderr.strip()
        == "error: fp8: a100-80gb has no FP8 tensor cores; drop --fp8 or choose an FP8 GPU (H100, ...)"
    )


def test_the_hopper_length_curve_is_the_h200_measurement() -> None:
    """FA2_HOPPER_BY_SEQUENCE and FA2_HOPPER_NONCAUSAL are the flash rows of benchmarks/hopper_kernels.py's
    run on an H200 (benchmarks/data/h200-kernels.jsonl), FLOPs over seconds over the dense bf16 peak,
    rounded to three places: causal with 32 heads of 128 and 12 of 64, and non-causal with heads of 128."""
    import json
    from pathlib import Path

    data = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "h200-kernels.jsonl"
    rows = [json.loads(line) for line in data.read_text(encoding="utf-8").splitlines()]
    peak = 989.5e12  # H200 (GH100, as the H100 SXM): dense bf16

    def rate(r: dict[str, float]) -> tuple[float, float]:
        return round(r["fwd_flops"] / r["fwd_s"] / peak, 3), round(r["bwd_flops"] / r["bwd_s"] / peak, 3)

    def measured(
        d: int, heads: int, causal: bool, backend: str = "flash"
    ) -> tuple[tuple[int, float, float], ...]:
        return tuple(
            (r["s"], *rate(r))
            for r in rows
            if r["kind"] == "attention"
            and r["backend"] == backend
            and not r.get("grid")
            and (r["d"], r["heads"], r["kv_heads"], r["causal"]) == (d, heads, heads, causal)
        )

    # the grid rows (back to back): by length and b · heads · s/128 query tiles, 32 heads preferred
    grid: dict[int, dict[int, tuple[float, float]]] = {}
    for r in sorted((r for r in rows if r.get("grid")), key=lambda r: -r["heads"]):
        grid.setdefault(r["s"], {}).setdefault(r["b"] * r["heads"] * (r["s"] // 128), rate(r))
    assert {s: tuple((n, *fb) for n, fb in sorted(g.items())) for s, g in grid.items()} == eff.FA2_HOPPER_GRID
    # heads of 128 up to 8k: the grid run's full-grid rows; from 16k the first run's
    full = tuple((s, *g[max(g)]) for s, g in sorted(grid.items()))
    assert full + measured(128, 32, True)[4:] == eff.FA2_HOPPER_BY_SEQUENCE[128]
    assert measured(64, 12, True) == eff.FA2_HOPPER_BY_SEQUENCE[64]
    assert measured(128, 32, False) == eff.FA2_HOPPER_NONCAUSAL
    assert measured(128, 32, True, "cudnn") == eff.CUDNN_HOPPER
    assert measured(128, 32, False, "cudnn") == eff.CUDNN_HOPPER_NONCAUSAL
    # its long end is the FlashAttention-3 paper's FA2 on H100 (FA2_HOPPER 0.35, 318/989 backward)
    end = eff.FA2_HOPPER_BY_SEQUENCE[128][-1]
    assert end[1] == pytest.approx(eff.FA2_HOPPER, abs=0.005)
    assert end[2] == pytest.approx(eff.FA2_HOPPER_BACKWARD, abs=0.01)


def test_the_ring_rows_hold_what_the_cp_rate_assumes() -> None:
    """benchmarks/ring_kernels.py on an H200 (benchmarks/data/h200-ring.jsonl): the two readings
    ``attention.curve_rate`` makes of a context-parallel rank, checked against the measured rows.
    (1) Non-causal calls run at FA2_HOPPER_NONCAUSAL's full-grid rate on small grids (16 heads × 32 or 64
    query tiles: 512 and 1,024 tiles), where the causal kernel's small-grid loss (FA2_HOPPER_GRID) comes
    from its tail of long rows; (2) torch's ring's half blocks (s/2c queries against s/c keys, s/c against
    s/2c) run at the square non-causal rate at s/c. Both within 3 % forward and 4 % backward; the causal
    rows on the same small grids are FA2_HOPPER_GRID's within 0.01."""
    import json
    from pathlib import Path

    from memplan.time.attention import _log_interpolate

    data = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "h200-ring.jsonl"
    rows = [json.loads(line) for line in data.read_text(encoding="utf-8").splitlines()]
    peak = 989.5e12

    def rate(r: dict[str, float]) -> tuple[float, float]:
        return r["fwd_flops"] / r["fwd_s"] / peak, r["bwd_flops"] / r["bwd_s"] / peak

    square = [r for r in rows if r["kind"] == "longkv" and r["sq"] == r["sk"]]
    halves = [r for r in rows if r["kind"] == "block" and not r["causal"]]
    for r in [r for r in square if not r["causal"]] + halves:
        full = (_log_interpolate(eff.FA2_HOPPER_NONCAUSAL, max(r["sq"], r["sk"]), c) for c in (1, 2))
        (f, b), (ff, fb) = rate(r), full
        assert f == pytest.approx(ff, rel=0.03) and b == pytest.approx(fb, rel=0.04), r
    for r in (r for r in square if r["causal"]):
        tiles = r["heads"] * r["sq"] // 128
        table = dict((n, (f, b)) for n, f, b in eff.FA2_HOPPER_GRID[r["sq"]])
        assert rate(r) == pytest.approx(table[tiles], abs=0.01), r


def test_the_eager_chains_rates_are_the_h200_measurement() -> None:
    """ELEMENTWISE_STREAM is benchmarks/hopper_kernels.py's chain run on an H200
    (benchmarks/data/h200-chains.jsonl): the bytes time/elementwise.py counts for each chain (bf16) over
    the measured seconds, as a fraction of the H200's 4.8 TB/s, the median of its shapes (Llama 3.1 8B's
    and MPT-7B's; the eager core's Llama-2-7B's at three lengths), rounded to three places."""
    import json
    import statistics
    from pathlib import Path

    from memplan.time import elementwise as ew

    data = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "h200-chains.jsonl"
    rows = [json.loads(line) for line in data.read_text(encoding="utf-8").splitlines()]
    e, hbm = 2, 4.8e12
    counted = {  # bytes per element, forward and backward (time/elementwise.py)
        "rmsnorm": ("rmsnorm_eager", ew.rmsnorm(e, False), ew.rmsnorm_backward(e)),
        "layernorm": ("layer_norm", 2 * e, 4 * e),
        "rotary": ("rotary", 10 * e, 17 * e),
        "swiglu": ("swiglu", 5 * e, 9 * e),
        "gelu": ("gelu_tanh", 2 * e, 4 * e),
        "eager_core": ("eager_core", 6 * e, 7 * e),  # the scale, masked_fill and softmax of the scores
        # torch.compile's fused chains: one read and one write forward, twice that backward
        "rmsnorm_compiled": ("rmsnorm_eager_compiled", 2 * e, 4 * e),
        "layernorm_compiled": ("layer_norm_compiled", 2 * e, 4 * e),
        "rotary_compiled": ("rotary_compiled", 2 * e, 4 * e),
        "swiglu_compiled": ("swiglu_compiled", 3 * e, 6 * e),
        "gelu_compiled": ("gelu_tanh_compiled", 2 * e, 4 * e),
    }
    for chain, (name, fwd, bwd) in counted.items():
        runs = [r for r in rows if r.get("chain") == name]
        assert len(runs) == (3 if chain == "eager_core" else 2)  # Llama-2-7B's s 1,024, 2,048, 3,072
        if chain.endswith("_compiled"):  # the process's first compile, Llama 3.1 8B's shape
            runs = [r for r in runs if r["model"] == "llama-3.1-8b"]
        f = statistics.median(fwd * r["elements"] / r["fwd_s"] / hbm for r in runs)
        b = statistics.median(bwd * r["elements"] / r["bwd_s"] / hbm for r in runs)
        assert (round(f, 3), round(b, 3)) == eff.ELEMENTWISE_STREAM[chain], chain


def test_cudnn_attention_off_hopper_is_a_one_line_error() -> None:
    r = runner.invoke(
        app, ["estimate", "-m", "llama-3-8b", "--gpu", "a100-80gb", "--attention-kernel", "cudnn"]
    )
    assert r.exit_code == 2
    assert "cuDNN attention's rate is measured on Hopper only" in r.output
    assert "Traceback" not in r.output
