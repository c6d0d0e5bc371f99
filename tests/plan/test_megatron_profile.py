"""``--impl megatron`` against Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
Transformer Models", arXiv 2205.05198): per-layer activation bytes sbh(34 + 5as/h) (§4.1) and Table 2's rows.

The expected bytes are written from the paper's formulas (16-bit activations, 1-byte dropout masks) for
its GPT models: GPT-3 175B (the gpt3-175b preset) and Table 3's 22B, 530B and 1T (GPT layout: LayerNorm,
GeLU MLP of 4h, dropout 0.1), s 2048, b 1, fp16, eager attention (Megatron's fused softmax). Where memplan
and the paper legitimately differ, the test's name says by what, exactly:
- the fused LayerNorms' fp32 mean and rstd [s·b] (Apex ``FusedLayerNormAffineFunction`` saves them; the
  paper ignores them): 2 norms × 2 × 4·s·b = 16sb per layer, ÷t with sequence parallelism;
- flash attention (TE / flash-attn) keeps the fp32 logsumexp [b, a, s] and the [2] int64 RNG state
  (16 B) beside Korthikanti's selective-recompute form 34sbh.
Beyond the paper (layouts it does not count) the expected bytes are summed from Megatron-core's ops, each
named (blocks/megatron.py).
"""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest
from typer.testing import CliRunner

from memplan.analytic.moments.layer_backward import recompute_working_set
from memplan.blocks.inventory import Block
from memplan.cli.app import app
from memplan.config import (
    Attention,
    Checkpointing,
    Impl,
    ImplConfig,
    ModelConfig,
    Parallel,
    Precision,
    Setup,
    StrategyConfig,
    TrainingConfig,
    ZeroStage,
)
from memplan.engine import Result, estimate
from memplan.presets import load_model_preset
from memplan.strategies.pipeline_parallel import Group
from memplan.time.published import gpt

from .layout import plan

S, B = 2048, 1
MEGATRON = ImplConfig(impl=Impl.MEGATRON)
# Korthikanti Table 3 (h, heads, layers); 175B is the gpt3-175b preset (Brown et al. 2020, Table 2.1).
TABLE3 = {"22B": (6144, 64, 48), "530B": (20480, 128, 105), "1T": (25600, 160, 128)}
MODELS = ["175B", *TABLE3]


def model(name: str) -> ModelConfig:
    if name == "175B":
        return load_model_preset("gpt3-175b").model
    return gpt(*TABLE3[name])


def setup(
    m: ModelConfig,
    ckpt: Checkpointing = Checkpointing.NONE,
    attention: Attention = Attention.EAGER,
    seq: int = S,
    impl: ImplConfig = MEGATRON,
    **training: object,
) -> Setup:
    return Setup(
        model=m,
        training=TrainingConfig(seq_len=seq, micro_batch=B, precision=Precision.FP16_MIXED, **training),  # type: ignore[arg-type]
        strategy=StrategyConfig(attention=attention, checkpointing=ckpt),
        impl=impl,
    )


def korthikanti(
    m: ModelConfig, t: int = 1, sp: bool = False, selective: bool = False, s: int = S
) -> Fraction:
    """Table 2's bytes per layer (exact rationals): sbh(10 + 24/t + 5as/(ht)) under tensor parallelism,
    (sbh/t)(34 + 5as/h) with sequence parallelism; selective recompute drops the 5as/h term."""
    sbh, a, h = s * B * m.hidden_size, m.num_heads, m.hidden_size
    core = Fraction(0) if selective else Fraction(5 * a * s, h)
    if sp:
        return Fraction(sbh, t) * (34 + core)
    return sbh * (10 + Fraction(24, t) + core / t)


def norm_stats(t: int = 1, sp: bool = False, s: int = S) -> Fraction:
    """What the paper ignores: two fused LayerNorms' fp32 mean and rstd over [s, b] (÷t with sp)."""
    return Fraction(2 * 2 * 4 * s * B, t if sp else 1)


# ----------------------------------------------------------------------------------------------------
# §4.1 and Table 2
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", MODELS)
def test_no_parallelism_is_sbh_34_plus_5as_over_h_plus_fp32_norm_statistics(name: str) -> None:
    m = model(name)
    sbh, a = S * B * m.hidden_size, m.num_heads
    paper = sbh * 34 + 5 * a * S * S * B  # sbh(34 + 5as/h)
    assert estimate(setup(m)).per_layer == paper + 16 * S * B


@pytest.mark.parametrize(
    ("name", "t", "sp", "selective"), list(itertools.product(MODELS, (2, 4, 8), (False, True), (False, True)))
)
def test_table2_rows_plus_fp32_norm_statistics(name: str, t: int, sp: bool, selective: bool) -> None:
    m = model(name)
    ckpt = Checkpointing.SELECTIVE if selective else Checkpointing.NONE
    got = plan(setup(m, ckpt), Parallel(tp=t, sp=sp)).per_layer
    assert got == korthikanti(m, t, sp, selective) + norm_stats(t, sp)


@pytest.mark.parametrize(("name", "sp"), list(itertools.product(MODELS, (False, True))))
def test_table2_full_recompute_keeps_2sbh_exactly(name: str, sp: bool) -> None:
    # Table 2: 2sbh (tensor parallelism alone); Megatron keeps the sequence-parallel shard with sp.
    m = model(name)
    got = plan(setup(m, Checkpointing.FULL), Parallel(tp=8, sp=sp)).per_layer
    assert got == 2 * S * B * m.hidden_size // (8 if sp else 1)


@pytest.mark.parametrize("name", MODELS)
def test_general_ffn_width_is_sb_18h_4ffn_5as_plus_fp32_norm_statistics(name: str) -> None:
    base = model(name)
    m = base.model_copy(update={"ffn_size": 3 * base.hidden_size})
    h, a, f = m.hidden_size, m.num_heads, m.ffn
    assert estimate(setup(m)).per_layer == S * B * (18 * h + 4 * f + 5 * a * S) + 16 * S * B


# ----------------------------------------------------------------------------------------------------
# Flash attention: Korthikanti's selective-recompute form
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "t", "sp"), [(n, 1, False) for n in MODELS] + [("175B", 8, False), ("1T", 8, True)]
)
def test_flash_is_selective_recompute_plus_fp32_lse_int64_rng_state_and_norm_statistics(
    name: str, t: int, sp: bool
) -> None:
    m = model(name)
    lse = 4 * B * (m.num_heads // t) * S  # fp32 [b, a/t, s]
    rng = 2 * 8  # flash-attn's rng_state: [2] int64
    got = plan(setup(m, attention=Attention.FLASH), Parallel(tp=t, sp=sp)).per_layer
    assert got == korthikanti(m, t, sp, selective=True) + lse + rng + norm_stats(t, sp)


@pytest.mark.parametrize("name", MODELS)
def test_the_selective_rerun_rebuilds_exactly_the_5as2b_it_dropped(name: str) -> None:
    # Megatron's checkpoint re-runs the core on the kept q, k, v (views): only its own saves come back.
    m = model(name)
    assert recompute_working_set(setup(m, Checkpointing.SELECTIVE)) == 5 * m.num_heads * S * S * B


def test_flash_and_selective_recompute_keep_the_same_layer_but_the_kernels_lse_and_rng_state() -> None:
    m = model("175B")
    flash = estimate(setup(m, attention=Attention.FLASH)).per_layer
    selective = estimate(setup(m, Checkpointing.SELECTIVE)).per_layer
    assert flash - selective == 4 * B * m.num_heads * S + 16


# ----------------------------------------------------------------------------------------------------
# Pipeline parallelism (§4.2.3) and what the fused softmax leaves out of the model
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pp", [2, 4, 8])
def test_first_stage_holds_l_layers_whatever_p_and_no_causal_mask(pp: int) -> None:
    m, t = model("175B"), 8
    p = plan(setup(m, grad_accum=16), Parallel(tp=t, sp=True, pp=pp))
    first = p.stages[0]
    layers = p.pieces.group_bytes[Group.LAYER] * first.counts[Group.LAYER]
    assert first.counts[Group.LAYER] == m.num_layers
    assert layers == m.num_layers * (korthikanti(m, t, sp=True) + norm_stats(t, sp=True))
    # Per micro-batch in flight, beyond the formula: int64 token ids [b, s] and positions [s], the embedding
    # dropout's mask (sbh/t with sp) — and no [s, s] causal mask: the fused kernel masks in registers.
    # And the stage output each of the p forwards in flight sent, which deallocate_output_tensor
    # shrinks to a 0-dim bf16 placeholder: 2 bytes.
    extras = 8 * S * B + 8 * S + S * B * m.hidden_size // t + 2
    assert first.activations == layers + pp * extras


def test_single_stage_extras_final_norm_output_layer_and_fp32_logits_plus_statistics_and_loss_masks() -> None:
    # Korthikanti §4.3, p = 1: final LayerNorm input 2sbh/t, output-layer input 2sbh/t, fp32 logits 4sbv/t.
    m, t = model("175B"), 8
    p = plan(setup(m), Parallel(tp=t, sp=True))
    head = p.pieces.group_bytes[Group.HEAD] + p.pieces.group_bytes[Group.HEAD_FREED]
    sbh, vocab_rows = S * B * m.hidden_size, -(-m.vocab_size // t)  # ⌈v/t⌉ rows per rank
    paper = 2 * sbh // t + 2 * sbh // t + 4 * S * B * vocab_rows
    # Beyond the paper: the final norm's fp32 mean and rstd (8sb/t); the vocabulary-parallel cross
    # entropy's bool target mask (sb) and int64 shifted targets (8sb); pretrain_gpt's fp32 loss mask (4sb).
    assert head == paper + 8 * S * B // t + (1 + 8 + 4) * S * B


def test_the_fused_softmax_keeps_no_causal_mask_where_the_reference_keeps_one() -> None:
    m = model("22B")
    ref, meg = estimate(setup(m, impl=ImplConfig())), estimate(setup(m))
    assert ref.per_layer == meg.per_layer

    def outside_the_loss(e: Result) -> int:
        return sum(k.total_bytes for k in e.tensors if k.block is not Block.LOSS)

    assert outside_the_loss(ref) - outside_the_loss(meg) == S * S  # the reference's bool [s, s] mask
    assert "attn.causal_mask" not in {k.name for k in meg.tensors}


def test_beyond_4096_keys_the_torch_softmax_keeps_fp32_probabilities_and_the_causal_mask() -> None:
    # FusedScaleMaskSoftmax.is_kernel_available needs sk ≤ 4096; forward_torch_softmax then keeps the fp32
    # softmax output (attention_softmax_in_fp32) 4as²b and masked_fill_'s cached bool [s, s] mask.
    s = 8192
    m = model("1T").model_copy(update={"max_positions": s})
    sbh, a = s * B * m.hidden_size, m.num_heads
    e = estimate(setup(m, seq=s))
    assert e.per_layer == 34 * sbh + (4 + 1 + 2) * a * s * s * B + norm_stats(s=s)
    assert {k.name: k.total_bytes for k in e.tensors}["attn.causal_mask"] == s * s


def test_the_fused_kernel_needs_the_ranks_heads_in_fours() -> None:
    # is_kernel_available: b·a/t a multiple of 4 (get_batch_per_block for s > 128). 22B at t 32: 2 heads.
    m = model("22B")
    kept = {k.name: k for k in plan(setup(m), Parallel(tp=32)).tensors}
    assert kept["attn.probs"].dtype.bytes == 4 and kept["attn.causal_mask"].bytes == S * S


# ----------------------------------------------------------------------------------------------------
# Layouts the paper does not count: RMSNorm, SwiGLU, RoPE, GQA (Megatron-core's ops, blocks/megatron.py)
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama-2-7b", "llama-3-8b"])
def test_llama_flash_keeps_rotated_q_and_k_and_a_copy_of_v(name: str) -> None:
    m = load_model_preset(name).model
    s, h, a, kv, d, f = 4096, m.hidden_size, m.num_heads, m.kv_heads, m.dim, m.ffn
    x = Setup(model=m, training=TrainingConfig(seq_len=s), impl=MEGATRON)  # bf16, flash, CUDA
    norms = 2 * (2 * s * h + 4 * s)  # fused RMSNorm: input and fp32 rstd
    # W_QKV input; q and k after RoPE; v made contiguous by TEDotProductAttention with RoPE fusion ("WAR
    # for peak memory usage": x.transpose(0, 1).contiguous(), so no view keeps the W_QKV output); lse;
    # rng; W_O input.
    attn = 2 * s * h + 2 * s * a * d + 2 * s * kv * d + 2 * s * kv * d + 4 * a * s + 16 + 2 * s * h
    mlp = 2 * s * h + 2 * s * 2 * f + 2 * s * f  # W_fc1 input, its fused [s, 2f] output, W_fc2 input
    assert estimate(x).per_layer == norms + attn + mlp


def test_gqa_eager_repeats_k_and_v_and_frees_the_qkv_buffer() -> None:
    m = load_model_preset("llama-3-8b").model
    s, a, d = 2048, m.num_heads, m.dim
    x = Setup(
        model=m,
        training=TrainingConfig(seq_len=s),
        strategy=StrategyConfig(attention=Attention.EAGER),
        impl=MEGATRON,
    )
    names = {k.name for k in estimate(x).tensors if k.block is Block.ATTN}
    assert {"attn.q", "attn.k", "attn.v"} <= names and "attn.qkv" not in names
    qkv = sum(k.bytes for k in estimate(x).tensors if k.name in ("attn.q", "attn.k", "attn.v"))
    assert qkv == 3 * 2 * s * a * d


# ----------------------------------------------------------------------------------------------------
# Every strategy runs under the profile
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("parallel", "zero"),
    [
        (Parallel(tp=4, sp=True, pp=2), ZeroStage.NONE),
        (Parallel(cp=2), ZeroStage.NONE),
        (Parallel(), ZeroStage.OPTIMIZER),
        (Parallel(tp=2), ZeroStage.PARAMETERS),
    ],
)
def test_megatron_differs_from_the_reference_gpt_layer_by_the_rng_state_only(
    parallel: Parallel, zero: ZeroStage
) -> None:
    # GPT layout, flash on CUDA: the reference keeps torch's [2] + [] uint64 RNG state (24 B), Megatron
    # flash-attn's [2] int64 (16 B); every other byte of a layer is the same.
    base = setup(model("22B"), attention=Attention.FLASH, grad_accum=8)
    base = base.model_copy(update={"strategy": base.strategy.model_copy(update={"zero": zero, "dp": 2})})
    ref = plan(base.model_copy(update={"impl": ImplConfig()}), parallel)
    meg = plan(base, parallel)
    assert ref.per_layer - meg.per_layer == 24 - 16


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--device", "cpu"],
            "device: --impl megatron follows Megatron-core's CUDA kernels; use --device cuda",
        ),
        (
            ["--finetune", "lora"],
            "finetune: --impl megatron with LoRA, QLoRA or frozen parts is not modelled; "
            "use --impl reference or train every weight",
        ),
    ],
)
def test_what_megatron_does_not_model_is_a_one_line_error(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["estimate", "-m", "gpt3", "--impl", "megatron", *args])
    assert result.exit_code == 2
    assert result.stderr.splitlines() == [f"error: {message}"]


# ----------------------------------------------------------------------------------------------------
# FLOPs: Megatron's checkpoint re-runs whole regions (Narayanan et al. 2021, Korthikanti et al. 2022)
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_full_recompute_total_is_narayanans_96bslh2_with_or_without_dropout(dropout: float) -> None:
    # F = 96·B·s·l·h²·(1 + s/(6h) + V/(16lh)): every matmul re-run, also where torch's early stop would
    # skip the last W_fc2 (no residual dropout after it).
    m = model("22B").model_copy(update={"attn_dropout": dropout, "resid_dropout": dropout})
    e = estimate(setup(m, Checkpointing.FULL))
    big_l, h, v = m.num_layers, m.hidden_size, m.vocab_size
    assert e.flops.total == 96 * B * S * big_l * h * h * (
        1 + Fraction(S, 6 * h) + Fraction(v, 16 * big_l * h)
    )


def test_selective_recompute_reruns_qk_and_pv_and_model_flops_are_korthikantis() -> None:
    m = model("175B")
    e = estimate(setup(m, Checkpointing.SELECTIVE))
    big_l, h, v = m.num_layers, m.hidden_size, m.vocab_size
    assert e.flops.model == 72 * B * big_l * S * h * h * (
        1 + Fraction(S, 6 * h) + Fraction(v, 12 * h * big_l)
    )
    assert e.flops.recompute == big_l * 2 * (2 * B * S * S * h)  # QKᵀ and P·V forward, 2·b·s²·h each
