"""Wave and tile quantization of the GEMMs (memplan/time/gemm.py), derived by hand from NVIDIA's "Matrix
Multiplication Background User's Guide" §3: tiles = ⌈rows/Tm⌉·⌈cols/Tn⌉, waves = ⌈tiles/SMs⌉, efficiency =
rows·cols / (waves·SMs·Tm·Tn), the best of the 256×128, 128×256 and 128×128 tiles."""

from __future__ import annotations

import tomllib
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from memplan.analytic.flops import layer_linear_flops
from memplan.blocks.head import lm_head_flops
from memplan.blocks.inventory import Dims
from memplan.cli.app import app
from memplan.config import ImplConfig, LossKind, Parallel, Setup, TrainingConfig
from memplan.config.impl import Fp8Recipe, Impl
from memplan.presets import Calibration, load_gpu, load_model_preset
from memplan.time import efficiency as eff
from memplan.time import gemm
from memplan.time.gemm import Gemm
from memplan.time.published import RUNS, predicted_timing
from memplan.time.timing import timing

from .layout import plan

A100_SMS = 108


def test_the_22b_qkv_forward_by_hand() -> None:
    """Korthikanti's 22B under tp 8: W_QKV fused, [2048, 6144]·[6144, 3·6144/8 = 2304] on A100's 108 SMs.
    256×128: 8·18 = 144 tiles, 2 waves, 2048·2304 / (2·108·32768) = 2/3; 128×256 the same (16·9);
    128×128: 16·18 = 288 tiles, 3 waves, 2048·2304 / (3·108·16384) = 8/9, the best."""
    qkv = Gemm(rows=2048, inner=6144, cols=2304)
    assert [gemm.tiles(qkv, t) for t in gemm.TILES] == [144, 144, 288]
    assert [gemm.waves(qkv, t, A100_SMS) for t in gemm.TILES] == [2, 2, 3]
    assert gemm.tile_efficiency(qkv, (256, 128), A100_SMS) == pytest.approx(2 / 3, rel=1e-12)
    assert gemm.efficiency(qkv, A100_SMS) == pytest.approx(8 / 9, rel=1e-12)


def test_a_shape_that_fills_its_waves_runs_at_the_best_shapes_speed() -> None:
    """2304 × 1536 in 256×128 tiles: 9·12 = 108 tiles, one full wave of 108 SMs; twice that, two."""
    assert gemm.efficiency(Gemm(2304, 4096, 1536), A100_SMS) == 1.0
    assert gemm.efficiency(Gemm(4608, 4096, 1536), A100_SMS) == 1.0


def test_tile_quantization_one_row_more() -> None:
    """2305 rows: 128×128 tiles 19·12 = 228, 3 waves: 2305·1536 / (3·108·16384) (the 256×128 tiles:
    10·12 = 120, 2 waves, 2305·1536 / (2·108·32768), lower)."""
    g = Gemm(2305, 4096, 1536)
    assert gemm.efficiency(g, A100_SMS) == pytest.approx(2305 * 1536 / (3 * 108 * 16384), rel=1e-12)


def test_count_equal_gemms_share_the_waves() -> None:
    """8 experts of 128 × 1024 in one grouped launch: 8·8 = 64 tiles of 128×128, one wave on 108 SMs."""
    g = Gemm(128, 4096, 1024, count=8)
    assert gemm.tiles(g, (128, 128)) == 64
    assert gemm.efficiency(g, A100_SMS) == pytest.approx(8 * 128 * 1024 / (108 * 16384), rel=1e-12)
    assert g.flops == 8 * 2 * 128 * 4096 * 1024


def test_without_an_sm_count_every_shape_is_the_best() -> None:
    assert gemm.efficiency(Gemm(3, 5, 7), None) == 1.0
    assert gemm.class_efficiency([Gemm(3, 5, 7), Gemm(2048, 6144, 2304)], None) == 1.0


def test_backward_shapes() -> None:
    """Y[M, N] = X[M, K]·W[K, N]: dX[M, K] = dY·Wᵀ (inner N), dW[K, N] = Xᵀ·dY (inner M): 2× the FLOPs."""
    y = Gemm(rows=2048, inner=6144, cols=2304)
    assert gemm.backward(y) == [Gemm(2048, 2304, 6144), Gemm(6144, 2048, 2304)]
    assert sum(g.flops for g in gemm.backward(y)) == 2 * y.flops


def test_class_efficiency_is_the_flop_weighted_harmonic_mean() -> None:
    """Σ FLOPs / Σ (FLOPs / e): a full wave (e = 1) and the QKV above (8/9) of equal FLOPs give 16/17."""
    full = Gemm(2304, 4096, 1536)
    qkv = Gemm(2048, 6144, 2304)
    scaled = Gemm(full.rows, qkv.flops // (2 * full.rows * full.cols), full.cols)
    assert scaled.flops == qkv.flops
    assert gemm.class_efficiency([scaled, qkv], A100_SMS) == pytest.approx(
        float(Fraction(2) / (1 + Fraction(9, 8))), rel=1e-12
    )


dims = st.integers(min_value=1, max_value=20_000)
sms = st.sampled_from([108, 114, 132, 142, 148, 304])


@given(dims, dims, sms)
def test_efficiency_is_a_fraction(rows: int, cols: int, n: int) -> None:
    assert 0 < gemm.efficiency(Gemm(rows, 64, cols), n) <= 1


@given(dims, dims, sms)
def test_the_modelled_time_never_falls_as_a_shape_grows(rows: int, cols: int, n: int) -> None:
    """The guide's §3.1: under tile quantization a larger GEMM's runtime still grows monotonically; time ∝
    FLOPs / efficiency = min over tiles of waves·SMs·Tm·Tn·inner·2."""

    def seconds(g: Gemm) -> float:
        return g.flops / gemm.efficiency(g, n)

    g = Gemm(rows, 64, cols)
    assert seconds(Gemm(rows + 1, 64, cols)) >= seconds(g) * (1 - 1e-12)
    assert seconds(Gemm(rows, 64, cols + 1)) >= seconds(g) * (1 - 1e-12)


# ----------------------------------------------------------------------------------------------------
# The layer's GEMMs are the FLOPs the model counts
# ----------------------------------------------------------------------------------------------------
SEQ = {"llama-3.1-405b": 4096, "gpt3-175b": 2048, "mixtral-8x7b": 3840, "qwen1.5-moe-a2.7b": 3840}


@pytest.mark.parametrize("name", list(SEQ))
@pytest.mark.parametrize("tp", [1, 4])
def test_one_layers_gemms_are_its_linear_flops_over_tp(name: str, tp: int) -> None:
    """Σ the forward GEMMs' FLOPs on one rank × tp = ``analytic.flops.layer_linear_flops``, but for the
    router [h, E] and the shared experts' gate [h, 1], which every tensor-parallel rank runs whole
    (2·T·h·(E + 1) more per extra rank). s: the dropless experts' slots T·k divide over E (60 | 3840·4)."""
    model = load_model_preset(name).model
    setup = Setup(model=model, training=TrainingConfig(seq_len=SEQ[name]), parallel=Parallel(tp=tp))
    dims = Dims.of(setup)
    moe = model.moe
    replicated = 0 if moe is None else 2 * dims.tokens * dims.h * (moe.experts + int(moe.shared_gate))
    got = sum(g.flops for g in gemm.layer_gemms(setup)) * tp
    assert got == layer_linear_flops(setup, dims) + (tp - 1) * replicated
    (head,) = gemm.head_gemms(setup)  # the largest vocabulary shard, ⌈v/t⌉ (GPT-3's 50257 over 4)
    assert head == Gemm(dims.tokens, dims.h, -(-dims.v // tp))
    if dims.v % tp == 0:
        assert head.flops * tp == lm_head_flops(dims)


def test_expert_parallel_ranks_run_their_experts_on_more_slots() -> None:
    """Mixtral (E 8, top-2) at T = 3840 under ep 4: a rank's 2 experts take 4 ranks' tokens, S·ep/E = 3840
    slots each (dropless S = T·k = 7680) — the same FLOPs as 8 experts on 960 slots."""
    model = load_model_preset("mixtral-8x7b").model
    one = Setup(model=model, training=TrainingConfig(seq_len=3840))
    four = one.model_copy(update={"parallel": Parallel(ep=4)})
    experts = [[g for g in gemm.layer_gemms(s) if g.count > 1] for s in (one, four)]
    assert {(g.rows, g.count) for g in experts[0]} == {(960, 8)}
    assert {(g.rows, g.count) for g in experts[1]} == {(3840, 2)}
    assert sum(g.flops for g in experts[0]) == sum(g.flops for g in experts[1])


def test_the_22b_layer_forward_is_eight_ninths_on_a100() -> None:
    """Korthikanti's 22B, tp 8, T = 2048, reference code (W_Q, W_K, W_V apart): every forward GEMM is
    8/9 by hand — q, k, v [6144 → 768]: 128×128 16·6 = 96 tiles, one wave, 96/108; W_O [768 → 6144]
    16·48 = 768 tiles, 8 waves, 2048·6144/(8·108·16384) = 8/9; up [6144 → 3072] 384 tiles, 4 waves,
    8/9; down like W_O. The head [6144 → 6400]: 16·50 = 800 tiles, 8 waves, 2048·6400/(8·108·16384)
    = 25/27."""
    (run,) = [r for r in RUNS if r.name.startswith("22B")]
    setup = run.setup.model_copy(update={"parallel": run.parallel})
    e = gemm.efficiencies(setup, load_gpu(run.gpu).sms)
    assert e.layer_forward == pytest.approx(8 / 9, rel=1e-12)
    assert e.head_forward == pytest.approx(25 / 27, rel=1e-12)


# ----------------------------------------------------------------------------------------------------
# The prediction
# ----------------------------------------------------------------------------------------------------
def test_a_gpu_without_an_sm_count_loads_and_runs_at_matmul() -> None:
    """No ``sms``: every compute-bound GEMM at ``MATMUL`` × peak (the field is optional); what is left
    below 1 is the memory-bound shapes' roofline. Llama-3-8B at tp 8, T = 4096: W_K and W_V are
    [T, h]·[h, 128] (GQA 8 kv heads over 8 ranks), intensity T·h·128/(T·h + 128·h + 128·T) = 4096·128/4352
    FLOPs per byte (bf16: 2 bytes an element, 2 FLOPs a multiply-add), below H100's ridge 989.5 TFLOP/s /
    3,350 GB/s (MATMUL and MEMORY cancel); their dX and dW read and write the same three matrices. Every
    other GEMM is above it (q, o: 4096·512/5120 = 409.6; the MLP's 4096·1792/7680 = 955.7; the head
    wider). In units u = 2·T·h·128, a layer's forward is q 4u + k, v 1u each + o 4u + gate, up, down 14u
    each = 52u, its backward twice that; the head 2·T·h·⌈128256/8⌉ forward, twice that backward."""
    h100 = load_gpu("h100-sxm")
    bare = h100.model_copy(update={"sms": None})
    setup = Setup(
        model=load_model_preset("llama-3-8b").model,
        training=TrainingConfig(seq_len=4096),
        parallel=Parallel(tp=8),
    )
    with_sms, without = timing(plan(setup), h100), timing(plan(setup), bare)
    kv = (4096 * 128 / 4352) / (989.5e12 / 3350e9)
    u, head = 2 * 4096 * 4096 * 128, 2 * 4096 * 4096 * 16032
    layer = 32 * 3 * 52 * u
    expected = (layer + 3 * head) / (layer * (50 + 2 / kv) / 52 + 3 * head)
    assert without.prediction.matmul_wave_efficiency == pytest.approx(expected, rel=1e-12)
    assert with_sms.prediction.matmul_wave_efficiency < expected


def test_every_shipped_gpu_states_its_sms() -> None:
    names = [
        "a100-40gb",
        "a100-80gb",
        "h100-sxm",
        "h200",
        "b200",
        "b300",
        "gb200",
        "gb300",
        "l40s",
        "mi300x",
        "rtx-4090",
    ]
    assert [load_gpu(n).sms for n in names] == [108, 108, 132, 132, 148, 148, 152, 152, 142, 304, 128]


GPUS = Path(__file__).parents[2] / "presets" / "gpus"


@pytest.mark.parametrize(
    ("name", "best"),
    [("a100-80gb", 0.869), ("h100-sxm", 0.803), ("b200", 0.776), ("gb200", 0.729), ("mi300x", 0.511)],
)
def test_the_matmul_rate_is_capped_at_the_gpus_own_best(name: str, best: float) -> None:
    """``MATMUL`` (0.80, the H100's best shape) capped at the GPU's own best measured matmul (the "Maximum
    Achievable Matmul FLOPS" table's BF16 row over the preset's peak, in the preset file): GB200 72.9 %,
    B200 77.6 %, MI300X 668.4 of 1,307.4 TFLOP/s bind; A100's 86.9 % and H100's 80.3 % do not. Llama 3 8B
    at T = 4,096 on one GPU: every GEMM is compute-bound (above the ridge at either rate), so its seconds
    scale by 0.80 / the cap against the same GPU without the field (uncapped)."""
    stated = tomllib.loads((GPUS / f"{name}.toml").read_text())["matmul_best"]
    assert stated == best and eff.MATMUL == 0.80
    gpu = load_gpu(name)
    assert eff.matmul(gpu) == min(0.80, best)
    setup = Setup(model=load_model_preset("llama-3-8b").model, training=TrainingConfig(seq_len=4096))
    capped = timing(plan(setup), gpu).prediction
    uncapped = timing(plan(setup), gpu.model_copy(update={"matmul_best": None})).prediction
    assert capped.matmul_s == pytest.approx(uncapped.matmul_s * 0.80 / min(0.80, best), rel=1e-12)
    # the prediction says the rate (--json's time.predicted; the step table's matmul row)
    assert (capped.matmul_fraction, capped.fp8_matmul_fraction) == (min(0.80, best), None)
    # a calibrated device's own measurement replaces both
    calibrated = gpu.model_copy(update={"calibrated": Calibration(matmul=0.9, memory=0.8)})
    assert eff.matmul(calibrated) == 0.9


def test_the_step_table_says_the_matmul_rate() -> None:
    """The matmul row names its rate: GB200's cap (72.9 % of its peak), and under ``--fp8`` the layers'
    ``MATMUL_FP8`` of the FP8 peak beside the 16-bit GEMMs' 80.0 % on an H100."""
    run = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})
    gb200 = run.invoke(app, ["estimate", "-m", "8b", "--gpu", "gb200"])
    assert (
        gb200.exit_code == 0
        and "linears and the head at the best shape's 72.9% of the peak ×" in gb200.stdout
    )
    fp8 = run.invoke(app, ["estimate", "-m", "8b", "--gpu", "h100", "--fp8", "tensorwise"])
    text = (
        "linears and the head at the best shape's 80.0% of the peak (--fp8's layers: 70.9% of the FP8 peak) ×"
    )
    assert fp8.exit_code == 0 and text in fp8.stdout


def test_the_published_22b_matmul_time_by_hand() -> None:
    """Korthikanti's 22B (T = 2048, h = 6144, v = 51200, tp 8, 48 layers on one stage, 4 micro-batches,
    selective recompute: no linear re-runs) on A100: per layer and rank the forward linears are
    2·T·12h²/8 FLOPs at 8/9 (above), the backward twice that at 32/35 — q, k, v, o's dX and dW (8 GEMMs of
    2·T·h·h/8) and up/down's dX (2 of 4×) at 8/9, up/down's dW ([6144, 3072]: 128×128 48·24 = 1152 tiles,
    11 waves, 6144·3072/(11·108·16384) = 32/33) —, 24/(16·9/8 + 8·33/32) = 32/35; the head 2·T·h·v/8 at
    25/27 forward and backward (dX [2048, 6144] 8/9; dW [6400, 6144]: 50·48 = 2400 tiles, 23 waves,
    200/207; 2/(9/8 + 207/200) = 25/27)."""
    (published,) = [r for r in RUNS if r.name.startswith("22B")]
    # the reference's separate q, k, v, o and up, down linears (the table types Megatron's code)
    run = replace(published, setup=published.setup.model_copy(update={"impl": ImplConfig()}))
    t = predicted_timing(run)
    T, h, v, tp, layers, n = 2048, 6144, 51200, 8, 48, 4
    linear, head = 2 * T * 12 * h * h / tp, 2 * T * h * v / tp
    flops_time = layers * (linear / (8 / 9) + 2 * linear / (32 / 35)) + 3 * head / (25 / 27)
    expected = n * flops_time / (eff.MATMUL * t.peak_flops_per_device)
    assert t.prediction.matmul_s == pytest.approx(expected, rel=1e-12)
    total = n * (3 * layers * linear + 3 * head)
    assert t.prediction.matmul_wave_efficiency == pytest.approx(total / (n * flops_time), rel=1e-12)


def test_the_fused_loss_moves_the_heads_gradient_products_not_the_attention() -> None:
    """The fused loss runs the lm head's dX and dW inside its forward (blocks/head.py::head_flops: forward
    3·head, backward none): the same products, so the same matmul seconds, forward and backward together,
    and the attention core's backward untouched. On the 22B (above) the head's forward, dX and dW run at
    25/27, 8/9 and 200/207: in one class 3/(27/25 + 9/8 + 207/200) = 25/27, the standard loss's too."""
    (run,) = [r for r in RUNS if r.name.startswith("22B")]
    fused = replace(run, setup=run.setup.model_copy(update={"loss": LossKind.FUSED}))
    standard_t, fused_t = predicted_timing(run).prediction, predicted_timing(fused).prediction
    assert fused_t.attention_s == pytest.approx(standard_t.attention_s, rel=1e-12)
    assert fused_t.matmul_s == pytest.approx(standard_t.matmul_s, rel=1e-12)


def test_float8_layers_are_measured_against_the_peak_they_run_at() -> None:
    """``--fp8``'s layer GEMMs run at ``MATMUL_FP8`` × the FP8 peak: their wave efficiency is taken against
    that rate, not the bf16 one (which had printed "achievable peak × 181.7%"). On a GPU without an SM
    count a compute-bound GEMM has full waves, and Llama-3-8B at tp 1, T = 4096, has no GEMM under the
    FP8 ridge, so the step's products are at exactly 1; with H100's 132 SMs, below it."""
    h100 = load_gpu("h100-sxm")
    bare = h100.model_copy(update={"sms": None})
    setup = Setup(
        model=load_model_preset("llama-3-8b").model,
        training=TrainingConfig(seq_len=4096),
        impl=ImplConfig(impl=Impl.TORCHTITAN, fp8=Fp8Recipe.TENSORWISE),
    )
    assert timing(plan(setup), bare).prediction.matmul_wave_efficiency == pytest.approx(1.0, rel=1e-12)
    assert 0.9 < timing(plan(setup), h100).prediction.matmul_wave_efficiency < 1.0
