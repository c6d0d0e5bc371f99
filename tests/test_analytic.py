"""Golden numbers of the analytic core, each from a named table or equation.

Sources: ../shared/reference/formulas.md (Korthikanti 2022, ZeRO, Narayanan 2021, Kaplan 2020, PaLM).
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from memplan.analytic.params import count_params
from memplan.config import (
    Attention,
    Checkpointing,
    CpRotate,
    Device,
    ModelConfig,
    Optimizer,
    Parallel,
    Precision,
    Setup,
    StrategyConfig,
    TrainingConfig,
    ZeroStage,
)
from memplan.engine import estimate
from memplan.presets import load_model_preset
from memplan.strategies.zero import model_states

GB = 10**9


def gpt3(seq: int = 2048, ckpt: Checkpointing = Checkpointing.NONE, device: Device = Device.CUDA) -> Setup:
    return Setup(
        model=load_model_preset("gpt3-175b").model,
        training=TrainingConfig(seq_len=seq, precision=Precision.FP16_MIXED),
        strategy=StrategyConfig(attention=Attention.EAGER, checkpointing=ckpt),
        device=device,
    )


# ----------------------------------------------------------------------------------------------------
# ZeRO (Rajbhandari et al. 2019)
# ----------------------------------------------------------------------------------------------------
def zero_gb(psi: int, stage: int, dp: int) -> float:
    s = model_states(psi, Precision.FP16_MIXED, Optimizer.ADAMW, ZeroStage(stage), dp)
    return s.total / GB


@pytest.mark.parametrize(
    ("stage", "expected"),
    # §5 (Figure 1 text): Ψ = 7.5B, Nd = 64 → 120 GB, 31.4 GB, 16.6 GB, 1.9 GB.
    [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)],
)
def test_zero_paper_7_5b_at_64(stage: int, expected: float) -> None:
    assert round(zero_gb(7_500_000_000, stage, 64), 1) == expected


@pytest.mark.parametrize(
    ("psi", "dp", "expected"),
    # Table 1 (GB per device for P_os, P_os+g, P_os+g+p).
    [
        (7_500_000_000, 4, (52.5, 41.25, 30.0)),
        (7_500_000_000, 16, (35.62, 21.56, 7.5)),
        (128_000_000_000, 64, (536.0, 284.0, 32.0)),
        (1_000_000_000_000, 1024, (4011.7, 2013.7, 15.6)),
    ],
)
def test_zero_table_1(psi: int, dp: int, expected: tuple[float, float, float]) -> None:
    digits = [len(str(x).split(".")[1]) for x in expected]
    got = tuple(round(zero_gb(psi, stage, dp), n) for stage, n in zip((1, 2, 3), digits, strict=True))
    assert got == pytest.approx(expected, abs=0.011)  # the paper truncates 35.625 to 35.62


@pytest.mark.parametrize("nd", [64, 1000])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_llama_2_7b(stage: int, nd: int) -> None:
    """The paper's per-device formulas (4+K)Ψ, 4Ψ+KΨ/Nd, 2Ψ+(2+K)Ψ/Nd, (4+K)Ψ/Nd with K = 12; Nd = 64
    divides Ψ, Nd = 1000 does not."""
    psi, k = 6_738_415_616, 12
    paper = [(4 + k) * psi, 4 * psi + k * psi / nd, 2 * psi + (2 + k) * psi / nd, (4 + k) * psi / nd][stage]
    setup = Setup(
        model=load_model_preset("llama-2-7b").model, strategy=StrategyConfig(zero=ZeroStage(stage), dp=nd)
    )
    got = estimate(setup).states.total
    # A sharded buffer is padded to a multiple of Nd (DeepSpeed's flat buffer): each device holds ⌈Ψ/Nd⌉
    # elements, at most one more than Ψ/Nd per sharded buffer (16 bytes in all).
    shard = -(-psi // nd)
    weights, grads, opt = (shard if stage >= s else psi for s in (3, 2, 1))
    assert got == 2 * weights + 2 * grads + k * opt
    assert 0 <= got - paper < 16


def test_zero_stage_is_stage_0_at_dp_1() -> None:
    for stage in ZeroStage:
        s = model_states(1_000_003, Precision.BF16_MIXED, Optimizer.ADAMW, stage, 1)
        assert s == model_states(1_000_003, Precision.BF16_MIXED, Optimizer.ADAMW, ZeroStage.NONE, 1)


@pytest.mark.parametrize(
    ("precision", "optimizer", "per_param"),
    # EleutherAI "Transformer Math 101": mixed AdamW 16 (2 + 2 + 12), 8-bit Adam 2 + 2 + 4 + 2,
    # SGD+momentum 2 + 2 + 4 + 4; fp32 AdamW 4 + 4 + 8; pure bf16 AdamW 2 + 2 + 4.
    [
        (Precision.BF16_MIXED, Optimizer.ADAMW, 16),
        (Precision.FP16_MIXED, Optimizer.ADAMW_8BIT, 10),
        (Precision.BF16_MIXED, Optimizer.SGD_MOMENTUM, 12),
        (Precision.BF16_MIXED, Optimizer.SGD, 8),
        (Precision.BF16_MIXED, Optimizer.LION, 12),
        (Precision.FP32, Optimizer.ADAMW, 16),
        (Precision.BF16, Optimizer.ADAMW, 8),
        (Precision.BF16, Optimizer.LION, 6),
    ],
)
def test_bytes_per_parameter(precision: Precision, optimizer: Optimizer, per_param: int) -> None:
    assert model_states(1000, precision, optimizer, ZeroStage.NONE, 1).total == per_param * 1000


# ----------------------------------------------------------------------------------------------------
# Activations: Korthikanti et al. 2022, §4 and Table 2
# ----------------------------------------------------------------------------------------------------
def norm_stats_residual(setup: Setup) -> int:
    """What the paper ignores: two LayerNorms' fp32 mean and rstd, [b, s] each (CUDA kernels)."""
    t = setup.training
    return 2 * 2 * t.micro_batch * t.seq_len * 4


def test_korthikanti_no_recompute() -> None:
    setup = gpt3()
    m, s, b = setup.model, 2048, 1
    sbh, a = s * b * m.hidden_size, m.num_heads
    paper = sbh * 34 + 5 * a * s * s * b  # sbh(34 + 5as/h)
    assert estimate(setup).per_layer == paper + norm_stats_residual(setup)


def test_korthikanti_selective_recompute() -> None:
    setup = gpt3(ckpt=Checkpointing.SELECTIVE)
    sbh = 2048 * setup.model.hidden_size
    assert estimate(setup).per_layer == 34 * sbh + norm_stats_residual(setup)


def test_korthikanti_full_recompute() -> None:
    setup = gpt3(ckpt=Checkpointing.FULL)
    assert estimate(setup).per_layer == 2 * 2048 * setup.model.hidden_size  # 2sbh, exactly


def test_korthikanti_general_ffn_width() -> None:
    """sb(18h + 4·ffn + 5as) per layer for any FFN width (formulas.md)."""
    base = load_model_preset("gpt3-175b").model
    model = base.model_copy(update={"ffn_size": 3 * base.hidden_size})
    setup = gpt3().model_copy(update={"model": model})
    s, h, a, f = 2048, model.hidden_size, model.num_heads, model.ffn
    assert estimate(setup).per_layer == s * (18 * h + 4 * f + 5 * a * s) + norm_stats_residual(setup)


def test_korthikanti_model_level_extras() -> None:
    """p = 1 extras: final LayerNorm input 2sbh, output-layer input 2sbh, fp32 logits 4sbv."""
    e = estimate(gpt3())
    m = e.setup.model
    by = {k.name: k.total_bytes for k in e.tensors}
    s = 2048
    assert by["final_norm.input"] == 2 * s * m.hidden_size
    assert by["lm_head.input"] == 2 * s * m.hidden_size
    assert by["loss.log_probs"] == 4 * s * m.vocab_size


def test_cpu_and_cuda_layer_norm_statistics_differ_only_in_dtype() -> None:
    cuda, cpu = estimate(gpt3()), estimate(gpt3(device=Device.CPU))
    # fp32 vs fp16 mean and rstd: 2 norms × 2 stats × [b, s] × 2 bytes per layer.
    assert cuda.per_layer - cpu.per_layer == 2 * 2 * 2048 * 2


def test_llama3_70b_cuda_flash_activations_closed_form() -> None:
    """Llama-3-70B (model card: h 8192, 64 heads, 8 kv heads, d 128, f 28672, v 128256, 80 layers), bf16,
    b 1, s 8192, flash on CUDA, summed from the ops' saves (aten's autograd formulas, per layer):
    RMSNorm ×2: fp32 x (4sh), fp32 rstd (4s), bf16 x̂ (2sh); W_QKV input 2sh; q 2sh, k and v 2·s·kv·d each;
    flash lse fp32 4·a·s; out 2sh; MLP input 2sh; gate, silu, up, down input 2sf each; and the flash RNG
    state: PyTorch's flash_api.cpp allocates a [2] uint64 and a [] uint64 (16 + 8 = 24 B, with or without
    dropout), 8 B more per layer than two int64 scalars: 640 B more over 80 layers.
    Model level: ids and labels 8s each, RoPE cos and sin 2·s·d each, final norm 4sh + 4s + 2sh, lm-head
    input 2sh, fp32 log-probs 4sv, nll_loss's fp32 total weight 4."""
    h, a, kv, d, f, v, n, s = 8192, 64, 8, 128, 28672, 128256, 80, 8192
    norm = 4 * s * h + 4 * s + 2 * s * h
    attn = 2 * s * h + 2 * s * h + 2 * (2 * s * kv * d) + 4 * a * s + 2 * s * h + (16 + 8)
    mlp = 2 * s * h + 4 * (2 * s * f)
    layer = 2 * norm + attn + mlp
    model = 8 * s + 2 * (2 * s * d) + norm + 2 * s * h + 4 * s * v + 8 * s + 4
    setup = Setup(model=load_model_preset("llama-3-70b").model, training=TrainingConfig(seq_len=s))
    e = estimate(setup)
    assert setup.device is Device.CUDA and setup.strategy.attention is Attention.FLASH
    assert e.activations == n * layer + model
    cpu = estimate(setup.model_copy(update={"device": Device.CPU}))
    assert e.activations - cpu.activations == n * (16 + 8)  # RMSNorm: no other CUDA/CPU difference


# ----------------------------------------------------------------------------------------------------
# FLOPs: Narayanan et al. 2021, Korthikanti et al. 2022, Kaplan et al. 2020, PaLM
# ----------------------------------------------------------------------------------------------------
def test_model_flops_closed_form() -> None:
    """72·B·L·s·h²·(1 + s/(6h) + v/(12hL)), exact for eager attention (one micro-batch, B = 1)."""
    e = estimate(gpt3())
    m = e.setup.model
    big_l, s, h, v = m.num_layers, 2048, m.hidden_size, m.vocab_size
    closed = 72 * big_l * s * h * h * (1 + Fraction(s, 6 * h) + Fraction(v, 12 * h * big_l))
    assert e.flops.model == closed


def test_full_recompute_flops_closed_form() -> None:
    """Narayanan: 96·B·s·l·h²·(1 + s/(6h) + V/(16lh)) with full recompute (GPT-3 has residual dropout, so
    torch's early-stopping checkpoint re-runs every matmul)."""
    e = estimate(gpt3(ckpt=Checkpointing.FULL))
    m = e.setup.model
    big_l, s, h, v = m.num_layers, 2048, m.hidden_size, m.vocab_size
    closed = 96 * s * big_l * h * h * (1 + Fraction(s, 6 * h) + Fraction(v, 16 * big_l * h))
    assert e.flops.total == closed


def test_forward_is_kaplan_2n_plus_attention() -> None:
    """Kaplan Table 1: C_forward ≈ 2N + 2·n_layer·n_ctx·d_attn per token (N without embeddings; ours
    counts the matmul weights exactly, attention with the full s×s, causal not halved: 4·L·s·h)."""
    e = estimate(gpt3())
    m = e.setup.model
    p = count_params(m)
    matmul_weights = m.num_layers * (4 * m.hidden_size**2 + 2 * m.hidden_size * m.ffn) + p.embedding
    per_token = Fraction(e.flops.forward, 2048)
    assert per_token == 2 * matmul_weights + 4 * m.num_layers * 2048 * m.hidden_size


def test_palm_attention_term() -> None:
    """PaLM App. B: 6N + 12·L·H·Q·T per token; the attention part is ours exactly (eager, fwd + bwd)."""
    e = estimate(gpt3())
    m = e.setup.model
    attention = e.flops.model - 3 * (e.flops.layer_linear + e.flops.lm_head)
    assert attention == 12 * m.num_layers * m.num_heads * m.dim * 2048 * 2048


@pytest.mark.parametrize("rotate", [CpRotate.ALLGATHER, CpRotate.KV_GATHER])
@pytest.mark.parametrize("cp", [2, 4])
def test_model_flops_do_not_depend_on_context_parallelism(cp: int, rotate: CpRotate) -> None:
    """The model's FLOPs (MFU's, the step's at an assumed MFU) are one device's at any cp: the ranks
    together run fewer attention FLOPs — a load-balanced rank's causal block counts (s/c)² cells, each of
    its c − 1 others (s/c)²/2, so c·(s/c)²·(c + 1)/2 = s²·(c + 1)/(2c) cells against one device's s² —
    and ``cp_skipped`` is the rest, 3 × (forward) of the missing cells: Llama 3 8B (32 layers, 32 heads of
    128) at 8,192 tokens, 2·d·2 FLOPs a cell forward. The hardware FLOPs (``total``) stay the ranks'."""
    base = Setup(model=load_model_preset("llama-3-8b").model, training=TrainingConfig(seq_len=8192))
    base = base.model_copy(update={"strategy": StrategyConfig(attention=Attention.FLASH)})
    one = estimate(base).flops
    split = estimate(base.model_copy(update={"parallel": Parallel(cp=cp, cp_rotate=rotate)})).flops
    s, layers, heads, d = 8192, 32, 32, 128
    assert split.model == one.model
    assert split.cp_skipped == 3 * layers * heads * 4 * d * s * s * (cp - 1) // (2 * cp)
    assert split.total == split.model - split.cp_skipped + split.kernel_recompute < one.total


@pytest.mark.parametrize(
    ("name", "seq", "cp", "tflops", "tokens"),
    [
        ("llama-2-7b", 4096, 1, 776, 16847),
        ("llama-2-13b", 4096, 1, 754, 8646),
        ("llama-2-70b", 4096, 1, 759, 1707),
        ("llama-3-8b", 8192, 2, 697, 12036),
        ("llama-3-70b", 8192, 2, 738, 1533),
        # Llama 2 7B's long sequences (container 24.03.01): tokens/s from that version's summary (the
        # held-out rows, benchmarks/heldout_nemo.py), TFLOP/s from performance_long_sequence.md's "With-CP"
        ("llama-2-7b", 4 * 1024, 1, 768, 16671),
        ("llama-2-7b", 32 * 1024, 2, 610, 6687),
        ("llama-2-7b", 64 * 1024, 2, 574, 4021),
        ("llama-2-7b", 128 * 1024, 4, 555, 2260),
        ("llama-2-7b", 256 * 1024, 8, 549, 1214),
        ("llama-2-7b", 512 * 1024, 16, 549, 635),
        ("llama-2-7b", 1024 * 1024, 32, 536, 318),
    ],
)
def test_model_flops_are_nemos(name: str, seq: int, cp: int, tflops: int, tokens: int) -> None:
    """NVIDIA NeMo's performance summary (docs/source/performance/performance_summary.md, container 24.07,
    DGX-H100, "Pretraining") prints each run's tokens/s and model TFLOP/s per GPU: their ratio is NeMo's
    model FLOPs a token, the attention core counted whole and the same under context parallelism (the
    Llama 3 rows ran CP 2, the long sequences up to CP 32, where the cp ranks' own count is 47 % under it).
    memplan's ``flops.model`` a token is it, to the rounding of the printed figures (to the unit)."""
    setup = Setup(model=load_model_preset(name).model, training=TrainingConfig(seq_len=seq))
    setup = setup.model_copy(
        update={"strategy": StrategyConfig(attention=Attention.FLASH), "parallel": Parallel(cp=cp)}
    )
    per_token = estimate(setup).flops.model / seq
    assert per_token == pytest.approx(tflops * 1e12 / tokens, rel=0.5 / tflops + 0.5 / tokens)


def test_flash_backward_recomputes_scores() -> None:
    eager = estimate(gpt3())
    flash = estimate(gpt3().model_copy(update={"strategy": StrategyConfig(attention=Attention.FLASH)}))
    assert flash.flops.backward - eager.flops.backward == eager.flops.layer_attention // 2
    assert flash.flops.forward == eager.flops.forward
    # The recompute of S = QKᵀ (2·b·a·s²·d per layer, GPT-3: b 1, a 96, d 128, 96 layers) is hardware
    # work, not model FLOPs: both kernels do the same model FLOPs, Korthikanti's closed form.
    assert flash.flops.kernel_recompute == 96 * 2 * 96 * 2048 * 2048 * 128
    assert flash.flops.total - eager.flops.total == flash.flops.kernel_recompute
    assert flash.flops.model == eager.flops.model


def test_selective_recompute_flops() -> None:
    """Eager selective re-runs QKᵀ only (torch's early stop skips P·V, whose saves precede it)."""
    e = estimate(gpt3(ckpt=Checkpointing.SELECTIVE))
    assert e.flops.recompute == e.flops.layer_attention // 2
    assert e.flops.total == e.flops.model + e.flops.recompute


def test_six_n_ratio_near_one_for_short_sequences() -> None:
    e = estimate(Setup(model=load_model_preset("70b").model, training=TrainingConfig(seq_len=2048)))
    assert 0.95 < e.flops.model / e.six_n < 1.15


# ----------------------------------------------------------------------------------------------------
# Peak
# ----------------------------------------------------------------------------------------------------
def test_peak_is_the_largest_phase_and_covers_states() -> None:
    e = estimate(Setup(model=load_model_preset("70b").model, training=TrainingConfig(seq_len=8192)))
    assert e.peak.bytes == max(e.peak.phases.values())
    assert e.peak.bytes >= e.states.total
    assert e.peak.phases["loss backward"] >= e.states.weights + e.states.optimizer + e.activations


def test_grad_accumulation_keeps_gradients_through_forward() -> None:
    model = load_model_preset("8b").model
    one = estimate(Setup(model=model, training=TrainingConfig(seq_len=4096)))
    four = estimate(Setup(model=model, training=TrainingConfig(seq_len=4096, grad_accum=4)))
    assert four.peak.phases["loss backward"] - one.peak.phases["loss backward"] == one.states.gradients


def test_zero3_optimizer_step_steps_one_shard() -> None:
    """Under ZeRO a rank steps only its shards (FSDP2: each parameter cut along dim 0): Llama-3-70B
    (v 128256, h 8192) over dp 1024 steps at most ⌈128256/1024⌉ = 126 rows of the embedding / head."""
    model = load_model_preset("70b").model

    def at(zero: ZeroStage) -> Setup:
        return Setup(
            model=model,
            training=TrainingConfig(seq_len=512),
            strategy=StrategyConfig(checkpointing=Checkpointing.FULL, zero=zero, dp=1024),
        )

    z0, z3 = estimate(at(ZeroStage.NONE)), estimate(at(ZeroStage.PARAMETERS))
    ids_and_labels = 2 * 8 * 512  # int64 [1, 512] each
    # bf16-mixed AdamW: the fp32 gradient copy and the fp32 denominator, 8 bytes per element stepped.
    assert z3.peak.phases["optimizer step"] == z3.states.total + ids_and_labels + 126 * 8192 * 8
    assert z0.peak.phases["optimizer step"] == z0.states.total + ids_and_labels + 128256 * 8192 * 8
    # States and the step's temporaries both shrink by about the shard factor (126 rows for 125.25).
    assert 1000 < z0.peak.phases["optimizer step"] / z3.peak.phases["optimizer step"] <= 1024


def test_zero3_loss_backward_holds_the_root_and_the_prefetched_top_layer() -> None:
    # The reference's FSDP2 wrapping (a unit per layer and the root: embedding, final norm, untied head)
    # under torch 2.13 (analytic.fsdp.root): at the loss backward the root is gathered again, v·h + h +
    # v·h = 2 × 128,256 × 8,192 + 8,192 = 2,101,354,496 parameters for Llama-3-70B, and the top layer's
    # all-gather prefetched (855,654,400), bf16; every dim 0 divisible by dp 8 (no padding). At the loss
    # backward ZeRO-2 and ZeRO-3 (dp 8) differ only by the sharded weights and those (no gradients exist
    # yet at grad-accum 1).
    psi, root, layer, dp = 70_553_706_496, 2 * 128_256 * 8_192 + 8_192, 855_654_400, 8
    model = load_model_preset("70b").model

    def loss_backward(stage: ZeroStage) -> int:
        setup = Setup(model=model, strategy=StrategyConfig(zero=stage, dp=dp))
        return estimate(setup).peak.phases["loss backward"]

    weights_z2, weights_z3 = 2 * psi, 2 * -(-psi // dp)
    expected = weights_z3 - weights_z2 + 2 * root + 2 * layer
    assert loss_backward(ZeroStage.PARAMETERS) - loss_backward(ZeroStage.GRADIENTS) == expected


@pytest.mark.parametrize(
    ("name", "unit"),
    [
        # GPT-3 175B (tied head): one layer, 12h² + 13h = 1,812,099,072 parameters (QKV and output
        # projections 4h², MLP 8h², their biases 9h, two LayerNorms 4h), beats the embedding v·h =
        # 50,257 × 12,288 = 617,558,016.
        ("gpt3-175b", 12 * 12_288**2 + 13 * 12_288),
        # GPT-2 (tied head): the embedding v·h = 50,257 × 768 = 38,597,376 beats a layer (7,087,872).
        ("gpt2", 50_257 * 768),
    ],
)
def test_zero3_gathers_a_layer_or_the_embedding_whichever_is_larger(name: str, unit: int) -> None:
    # As above: ZeRO-3 minus ZeRO-2 at the loss backward = the weights' shard change + the gathered unit's
    # 16-bit weights. Ψ from count_params (checked against the model cards above).
    model, dp = load_model_preset(name).model, 8
    psi = count_params(model).total

    def loss_backward(stage: ZeroStage) -> int:
        training = TrainingConfig(seq_len=1024)  # GPT-2's 1,024 learned positions
        setup = Setup(model=model, training=training, strategy=StrategyConfig(zero=stage, dp=dp))
        return estimate(setup).peak.phases["loss backward"]

    expected = 2 * -(-psi // dp) - 2 * psi + 2 * unit
    assert loss_backward(ZeroStage.PARAMETERS) - loss_backward(ZeroStage.GRADIENTS) == expected


def test_reversible_recompute_is_every_layers_forward_by_hand() -> None:
    # RevNet backward re-runs each layer's forward once. Llama-style layer, h 64, 4 heads of 16, 4 kv
    # heads, SwiGLU f 160, T = 2 × 64 tokens: projections 2·T·(4h² + 3hf) = 12,058,624 FLOPs; attention
    # core QKᵀ and P·V 2 × 2·b·a·s²·d = 2,097,152 (causal not halved); two layers.
    model = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, ffn_size=160, vocab_size=1000)
    training = TrainingConfig(micro_batch=2, seq_len=64)
    setup = Setup(model=model, training=training, strategy=StrategyConfig(reversible=True))
    t = 2 * 64
    linear = 2 * t * (4 * 64**2 + 3 * 64 * 160)
    core = 2 * 2 * 2 * 4 * 64**2 * 16
    assert estimate(setup).flops.recompute == 2 * (linear + core)
