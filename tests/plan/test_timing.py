"""Step time, MFU and HFU: Korthikanti et al. 2022 Table 5; Narayanan et al. 2021's training-time estimates.

Korthikanti (arXiv 2205.05198) Table 5, A100 (312 TFLOP/s), s 2048, v 51200, tensor + sequence parallel,
selective recompute; model FLOPs 72·B·L·s·h²·(1 + s/(6h) + v/(12hL)) (their App. A) and hardware FLOPs
72·B·L·s·h²·(1 + s/(3h) + v/(12hL)).
Narayanan (arXiv 2104.04473) §5.1: training time ≈ 8TP/(nX): GPT-3 175B on 300B tokens with 1024 A100 at
140 TFLOP/s → 34 days; 1T on 450B tokens with 3072 GPUs at 163 TFLOP/s → 84 days; their FLOPs per
iteration with full recompute F = 96·B·s·l·h²·(1 + s/(6h) + V/(16lh)).
"""

from __future__ import annotations

import pytest

from memplan.config import (
    Attention,
    Checkpointing,
    ModelConfig,
    Parallel,
    Precision,
    Setup,
    StrategyConfig,
    TrainingConfig,
)
from memplan.presets import load_gpu, load_model_preset
from memplan.time.published import gpt  # the GPT layout of Megatron's papers
from memplan.time.timing import timing

from .layout import plan

A100 = load_gpu("a100-80gb")  # 312 TFLOP/s bf16/fp16 dense
SEQ, VOCAB = 2048, 51200


def korthikanti_model(batch: int, layers: int, h: int, s: int = SEQ, v: int = VOCAB) -> int:
    """72·B·L·s·h²·(1 + s/(6h) + v/(12hL)), expanded to integers."""
    return 72 * batch * layers * s * h * h + 12 * batch * layers * s * s * h + 6 * batch * s * h * v


def korthikanti_hardware_selective(batch: int, layers: int, h: int, s: int = SEQ, v: int = VOCAB) -> int:
    """72·B·L·s·h²·(1 + s/(3h) + v/(12hL))."""
    return 72 * batch * layers * s * h * h + 24 * batch * layers * s * s * h + 6 * batch * s * h * v


# (name, heads, h, L, t, p, GPUs, global batch, iteration s, MFU %, HFU %)
TABLE5 = [
    ("22B", 64, 6144, 48, 8, 1, 8, 4, 1.10, 41.5, 43.7),
    ("175B", 96, 12288, 96, 8, 8, 64, 64, 13.75, 51.4, 52.8),
    ("530B", 128, 20480, 105, 8, 35, 280, 280, 37.83, 56.0, 57.0),
    ("1T", 160, 25600, 128, 8, 64, 512, 512, 71.49, 56.3, 57.0),
]


def table5_plan(a: int, h: int, layers: int, t: int, p: int, gpus: int, batch: int):  # type: ignore[no-untyped-def]
    dp = gpus // (t * p)
    setup = Setup(
        model=gpt(h, a, layers),
        training=TrainingConfig(seq_len=SEQ, precision=Precision.FP16_MIXED, grad_accum=batch // dp),
        strategy=StrategyConfig(checkpointing=Checkpointing.SELECTIVE, attention=Attention.EAGER, dp=dp),
    )
    return plan(setup, Parallel(tp=t, sp=True, pp=p))


@pytest.mark.parametrize("row", TABLE5, ids=[r[0] for r in TABLE5])
def test_table5_mfu_from_the_measured_iteration_time(row: tuple) -> None:  # type: ignore[type-arg]
    _, a, h, layers, t, p, gpus, batch, seconds, mfu, hfu = row
    plan_ = table5_plan(a, h, layers, t, p, gpus, batch)
    got = timing(plan_, A100, step_time=seconds)
    # memplan's model FLOPs are Korthikanti's, exactly (every matmul counted, causal not halved).
    assert got.model_flops_per_step == korthikanti_model(batch, layers, h)
    # The table rounds the iteration time to 10 ms and the MFU to 0.1 %: the published MFU lies between
    # the MFUs of the two ends of the time's rounding interval (± 0.05 %).
    fast, slow = (timing(plan_, A100, step_time=seconds + d).mfu * 100 for d in (-0.005, 0.005))
    assert slow - 0.05 <= mfu <= fast + 0.05
    assert got.mfu * 100 == pytest.approx(mfu, abs=0.2)
    # Their HFU formula reproduces the table within the same rounding ...
    ours = korthikanti_hardware_selective(batch, layers, h) / (gpus * 312e12) * 100
    assert ours / (seconds + 0.005) - 0.05 <= hfu <= ours / (seconds - 0.005) + 0.05
    # ... but memplan counts the recompute torch runs: selective recompute of the eager core re-runs QKᵀ
    # (2·B·s²·h per layer; the softmax and dropout are not FLOPs, P·V is never re-run since its inputs are
    # the last saves), not the 12·B·s²·h per layer of Korthikanti's s/(3h) term. That is the residual.
    assert got.hardware_flops_per_step == got.model_flops_per_step + 2 * batch * layers * SEQ * SEQ * h
    assert got.hfu < hfu / 100


def test_flash_attention_has_the_same_model_flops() -> None:
    """One definition of model FLOPs (analytic/flops.py): the flash backward's re-computation of S = QKᵀ
    (2·B·s²·h per layer) is hardware work; MFU's model FLOPs stay Korthikanti's, as for eager attention."""
    _, a, h, layers, t, p, gpus, batch, seconds, _, _ = TABLE5[0]
    eager = table5_plan(a, h, layers, t, p, gpus, batch)
    setup = eager.setup.model_copy(
        update={"strategy": eager.setup.strategy.model_copy(update={"attention": Attention.FLASH})}
    )
    flash = plan(setup, Parallel(tp=t, sp=True, pp=p))
    got = timing(flash, A100, step_time=seconds)
    assert got.model_flops_per_step == korthikanti_model(batch, layers, h)
    assert got.model_flops_per_step == flash.flops.model * flash.micro_batches * flash.setup.strategy.dp
    # Selective flash re-runs the whole kernel's forward (4·B·s²·h per layer), and its backward re-runs QKᵀ.
    kernel = 2 * batch * layers * SEQ * SEQ * h
    assert got.hardware_flops_per_step == got.model_flops_per_step + 2 * kernel + kernel


def narayanan_days(tokens: float, params: float, gpus: int, flops_per_gpu: float) -> float:
    """8TP/(nX), in days."""
    return 8 * tokens * params / (gpus * flops_per_gpu) / 86_400


def narayanan_flops(batch: int, layers: int, h: int, s: int, v: int) -> int:
    """F = 96·B·s·l·h²·(1 + s/(6h) + V/(16lh)): one iteration with full recompute."""
    return 96 * batch * s * layers * h * h + 16 * batch * s * s * layers * h + 6 * batch * s * h * v


@pytest.mark.parametrize(
    ("model", "tokens", "params", "gpus", "tflops", "days"),
    [
        # GPT-3: the preset (vocab 50257, tied); Narayanan's P = 175e9.
        (load_model_preset("gpt3-175b").model, 300e9, 175e9, 1024, 140, 34),
        # 1T: h 25600, L 128, a 160, v 51200 (Narayanan Table 1); P from their own formula, 1.008T.
        (gpt(25600, 160, 128), 450e9, 1.008e12, 3072, 163, 84),
    ],
    ids=["gpt3-175b", "1t"],
)
def test_narayanan_training_days(
    model: ModelConfig, tokens: float, params: float, gpus: int, tflops: float, days: int
) -> None:
    assert round(narayanan_days(tokens, params, gpus, tflops * 1e12)) == days
    # memplan: full recompute, the achieved 140 (163) TFLOP/s as the assumed MFU of a 312 TFLOP/s A100,
    # global batch 1536 (GPT-3) / 3072 (1T) as in their Table 1, no pipeline bubble (the achieved rate
    # already includes theirs).
    batch = 1536 if model.num_layers == 96 else 3072
    dp = gpus // 8
    setup = Setup(
        model=model,
        training=TrainingConfig(seq_len=SEQ, precision=Precision.FP16_MIXED, grad_accum=batch // dp),
        strategy=StrategyConfig(checkpointing=Checkpointing.FULL, attention=Attention.EAGER, dp=dp),
    )
    got = timing(plan(setup, Parallel(tp=8)), A100, mfu=tflops / 312, tokens=int(tokens))
    h, layers = model.hidden_size, model.num_layers
    per_step = narayanan_flops(batch, layers, h, SEQ, model.vocab_size)
    assert got.hardware_flops_per_step == per_step
    steps = tokens / (batch * SEQ)
    assert got.training_days == pytest.approx(steps * per_step / (gpus * tflops * 1e12) / 86_400, rel=1e-12)
    # The residual against 8TP/(nX) (GPT-3: 34.73 vs 33.9 days; 1T: 84.96 vs 83.9): its attention term
    # s/(6h) and logits term V/(16lh), which 8TP drops, and the exact parameter count for the rounded P.
    assert got.training_days is not None and abs(got.training_days - days) / days < 0.03


MFU = 0.4
"""An assumed MFU (``--mfu``) for the tests of that basis."""


def llama_plan(checkpointing: Checkpointing = Checkpointing.NONE, pp: int = 1, grad_accum: int = 8):  # type: ignore[no-untyped-def]
    setup = Setup(
        model=load_model_preset("llama-3-8b").model,
        training=TrainingConfig(seq_len=4096, grad_accum=grad_accum),
        strategy=StrategyConfig(checkpointing=checkpointing, dp=4),
    )
    return plan(setup, Parallel(pp=pp))


def test_assumed_mfu_is_achieved_without_recompute_or_bubble() -> None:
    got = timing(llama_plan(), load_gpu("h100"), mfu=MFU)
    assert got.basis == "assumed"
    assert got.assumed_mfu == MFU and got.mfu == pytest.approx(MFU)
    assert got.global_batch == 8 * 4 and got.devices == 4 and got.tokens_per_step == 8 * 4 * 4096
    # Llama-3-8B (h 4096, 32 layers, 32 heads of 128, 8 kv heads, SwiGLU 14336, v 128256), T = 4096: a
    # layer's linears W_Q, W_O [h, h], W_K, W_V [h, 1024], three [h, f]; model FLOPs = 3 × forward, the
    # forward 2·T·(their parameters) × 32 + the attention core 4·b·a·s²·d × 32 + the head 2·T·h·v; × 8
    # micro-batches × dp 4
    t, h = 4096, 4096
    layer = 2 * h * h + 2 * h * 1024 + 3 * h * 14336
    forward = 2 * t * layer * 32 + 4 * 32 * t * t * 128 * 32 + 2 * t * h * 128256
    assert got.model_flops_per_step == 3 * forward * 8 * 4
    # step = model FLOPs / (devices · peak · mfu), H100's dense bf16 989.5 TFLOP/s
    step = 3 * forward * 8 * 4 / (4 * 989.5e12 * MFU)
    assert got.step_time_s == pytest.approx(step, rel=1e-12)
    assert got.tokens_per_s == pytest.approx(8 * 4 * 4096 / step, rel=1e-12)


def test_recompute_and_bubble_lengthen_the_step() -> None:
    h100 = load_gpu("h100")
    base = timing(llama_plan(), h100, mfu=MFU)
    full = timing(llama_plan(Checkpointing.FULL), h100, mfu=MFU)
    piped = timing(llama_plan(pp=4), h100, mfu=MFU)
    assert full.step_time_s == pytest.approx(
        base.step_time_s * (1 + full.recompute_flops_per_step / full.model_flops_per_step)
    )
    assert piped.bubble == pytest.approx(3 / 8)  # (p − 1)/(m·n), Narayanan §2.2.1
    assert piped.step_time_s == pytest.approx(base.step_time_s / 4 * (1 + 3 / 8))  # 4 × the devices, same dp
    assert piped.mfu == pytest.approx(MFU / (1 + 3 / 8))


def test_precision_picks_the_peak() -> None:
    setup = Setup(
        model=load_model_preset("gpt2").model, training=TrainingConfig(seq_len=1024, precision=Precision.FP32)
    )
    assert timing(plan(setup), A100).peak_flops_per_device == 19.5e12  # no TF32 by default


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(mfu=0.4, step_time=1.0), "mfu: give either --mfu"),
        (dict(step_time=0.0), "step-time: must be finite positive seconds"),
        (dict(step_time=float("inf")), "step-time: must be finite positive seconds"),
        (dict(mfu=1.5), r"mfu: must be in \[1e-06, 1\]"),
        (dict(mfu=1e-320), r"mfu: must be in \[1e-06, 1\]"),
        (dict(tokens=0), "tokens: must be a positive number of tokens"),
    ],
)
def test_timing_mistakes(kwargs: dict[str, float], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        timing(llama_plan(), A100, **kwargs)  # type: ignore[arg-type]


def _fp8_plan(fp8: str):  # type: ignore[no-untyped-def]
    """Llama 3.2 1B at 2,048 tokens on one H100, ``--fp8 fp8`` (or bf16 without: "none")."""
    from memplan.api import build_setup
    from memplan.config import Fp8Recipe

    setup = build_setup("llama-3.2-1b", seq=2048)
    return plan(setup.model_copy(update={"impl": setup.impl.model_copy(update={"fp8": Fp8Recipe(fp8)})}))


H100 = load_gpu("h100-sxm")  # 989.5 TFLOP/s bf16 dense, 1,979 FP8


@pytest.mark.parametrize("fp8", ["tensorwise", "rowwise"])
def test_under_fp8_mfu_is_against_the_16_bit_peak_and_can_pass_one(fp8: str) -> None:
    """torchtitan's MFU of a float8 run is against the BF16 peak (its ``get_peak_flops``); the float8
    GEMMs run on the FP8 peak, so a measured step may be faster than every model FLOP at the 16-bit peak:
    taken up to every model FLOP at the FP8 peak (MFU 1979 / 989.5 = 2), refused below it. By hand."""
    p = _fp8_plan(fp8)
    t = timing(p, H100)
    assert t.peak_flops_per_device == 989.5e12
    assert t.fp8_peak_flops_per_device == 1979e12
    model = p.flops.model  # one micro-batch, one device
    at_16_bit_peak = model / 989.5e12
    measured = timing(p, H100, step_time=0.6 * at_16_bit_peak)  # faster than the 16-bit peak allows
    assert measured.mfu == pytest.approx(1 / 0.6, rel=1e-12)
    assert measured.mfu > 1
    at_fp8_peak = model / 1979e12
    assert timing(p, H100, step_time=at_fp8_peak).mfu == pytest.approx(2, rel=1e-12)
    with pytest.raises(ValueError, match=r"at its FP8 peak .*MFU 250% > 200% \(its FP8 peak\)"):
        timing(p, H100, step_time=0.8 * at_fp8_peak)


def test_without_fp8_a_step_faster_than_the_peak_is_refused() -> None:
    p = _fp8_plan("none")
    t = timing(p, H100)
    assert t.fp8_peak_flops_per_device is None
    at_peak = p.flops.model / 989.5e12
    assert timing(p, H100, step_time=at_peak).mfu == pytest.approx(1, rel=1e-12)
    with pytest.raises(ValueError, match=r"at peak .*MFU 125% > 100%;"):
        timing(p, H100, step_time=0.8 * at_peak)


def test_under_fp8_an_assumed_mfu_may_pass_one_up_to_the_fp8_peak() -> None:
    """``--mfu`` is against the same 16-bit peak: under ``--fp8`` it is taken up to the FP8 peak over the
    16-bit one (1979 / 989.5 = 2 on the H100), refused above; without ``--fp8`` up to 1."""
    p = _fp8_plan("tensorwise")
    t = timing(p, H100, mfu=1.5)
    assert t.step_time_s == pytest.approx(p.flops.model / (989.5e12 * 1.5), rel=1e-12)
    assert t.mfu == pytest.approx(1.5, rel=1e-12)
    timing(p, H100, mfu=2.0)
    with pytest.raises(ValueError, match=r"mfu: must be in \[1e-06, 2\] \(--fp8: up to its FP8 peak"):
        timing(p, H100, mfu=2.01)
    with pytest.raises(ValueError, match=r"mfu: must be in \[1e-06, 1\], got 1.5"):
        timing(_fp8_plan("none"), H100, mfu=1.5)
