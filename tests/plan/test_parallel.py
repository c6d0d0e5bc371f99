"""Tensor, sequence and pipeline parallelism per device: Korthikanti et al. 2022 Table 2 and §4.2.3.

Golden rows (arXiv 2205.05198, Table 2, bytes per layer; 16-bit activations, 1-byte dropout masks, LayerNorm
statistics ignored): tensor parallel sbh(10 + 24/t + 5as/(ht)); + sequence parallel (sbh/t)(34 + 5as/h);
+ selective recompute sbh(10 + 24/t) and 34sbh/t; full recompute 2sbh. GPT-3 175B (Brown et al. 2020:
h 12288, a 96, L 96) at s 2048, b 1, fp16 mixed precision, eager attention, dropout 0.1, t 8.

The residual memplan keeps beyond every row is exactly what the paper ignores: the two LayerNorms'
fp32 mean and rstd, 2 × 2 × 4·s·b bytes per layer (split by t with sequence parallelism).
"""

from __future__ import annotations

import itertools
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memplan.analytic import activations as act
from memplan.analytic import flops as fl
from memplan.analytic import peak as pk
from memplan.analytic.params import count_params
from memplan.blocks.inventory import Block, Dims, Role
from memplan.config import (
    Attention,
    Checkpointing,
    Device,
    MlpType,
    ModelConfig,
    NormType,
    Parallel,
    PositionType,
    Precision,
    Setup,
    StrategyConfig,
    TrainingConfig,
    ZeroStage,
)
from memplan.contract import to_json
from memplan.engine import estimate
from memplan.presets import load_model_preset
from memplan.stage_plan import head_gradient_bytes
from memplan.strategies import checkpointing, reversible
from memplan.strategies.pipeline_parallel import Group, stage_layers
from memplan.strategies.sequence_parallel import SPLITS, Split, rule, tensor_dim
from memplan.strategies.tensor_parallel import tp_model
from memplan.strategies.zero import model_states

from .layout import plan

# FSDP2's recipe needs ZeRO-2/3 over dp > 1 (``config.setup.check_fsdp2_mixed``): tests/test_fsdp2_mixed.py
RECIPES = [p for p in Precision if p is not Precision.FSDP2_MIXED]

S, B, H, A, L, T = 2048, 1, 12288, 96, 96, 8
SBH = S * B * H
LN_STATS = 2 * 2 * 4 * S * B  # two LayerNorms × (mean, rstd) × fp32 × [b, s, 1]: the ignored residual


def gpt3(checkpointing: Checkpointing = Checkpointing.NONE, grad_accum: int = 1, **strategy: object) -> Setup:
    return Setup(
        model=load_model_preset("gpt3-175b").model,
        training=TrainingConfig(
            seq_len=S, micro_batch=B, precision=Precision.FP16_MIXED, grad_accum=grad_accum
        ),
        strategy=StrategyConfig(attention=Attention.EAGER, checkpointing=checkpointing, **strategy),  # type: ignore[arg-type]
    )


# ----------------------------------------------------------------------------------------------------
# Korthikanti Table 2
# ----------------------------------------------------------------------------------------------------
def korthikanti(sp: bool, selective: bool, t: int = T) -> Fraction:
    """Table 2's bytes per layer (exact rationals)."""
    core = Fraction(0) if selective else Fraction(5 * A * S, H)
    if sp:
        return Fraction(SBH, t) * (34 + core)
    return SBH * (10 + Fraction(24, t) + core / t)


@pytest.mark.parametrize(("sp", "selective"), list(itertools.product([False, True], repeat=2)))
def test_table2_tensor_and_sequence_parallel(sp: bool, selective: bool) -> None:
    ckpt = Checkpointing.SELECTIVE if selective else Checkpointing.NONE
    p = plan(gpt3(ckpt), Parallel(tp=T, sp=sp))
    residual = Fraction(LN_STATS, T if sp else 1)
    assert p.per_layer == korthikanti(sp, selective) + residual


def test_table2_no_parallelism_is_the_single_device_estimate() -> None:
    e = estimate(gpt3())
    assert plan(gpt3()).per_layer == e.per_layer == SBH * (34 + Fraction(5 * A * S, H)) + LN_STATS


@pytest.mark.parametrize("sp", [False, True])
def test_table2_full_recompute_keeps_the_layer_input(sp: bool) -> None:
    # Table 2: 2sbh, under tensor parallelism alone; Megatron keeps the sequence-parallel shard with sp.
    p = plan(gpt3(Checkpointing.FULL), Parallel(tp=T, sp=sp))
    assert p.per_layer == 2 * SBH // (T if sp else 1)


def test_pipeline_first_stage_holds_p_micro_batches_of_l_over_p_layers() -> None:
    # §4.2.3: the first stage's total is (sbhL/t)(34 + 5as/h) whatever p is (enough micro-batches).
    for pp in (2, 4, 8):
        p = plan(gpt3(grad_accum=16), Parallel(tp=T, sp=True, pp=pp))
        first = p.stages[0]
        layer_bytes = p.pieces.group_bytes[Group.LAYER] * first.counts[Group.LAYER]
        assert first.counts[Group.LAYER] == L
        assert layer_bytes == L * (korthikanti(sp=True, selective=False) + Fraction(LN_STATS, T))
        # The whole first stage adds, per micro-batch in flight, what the formula leaves out: the int64
        # token and position ids, the embedding dropout mask (sbh/t with sp) and the eager causal mask s².
        extras = 8 * S * B + 8 * S + SBH // T + S * S
        # torch's pipelining (the reference's schedule) also holds, per forward in flight, the stage
        # output it sent (fwd_cache), one more from Schedule1F1B's warm-up send_work (p ≥ 2 forwards in
        # flight) and, for each of the step's 16 micro-batches, a gradient receive buffer: [b, s/t, h] in
        # 16 bits each, 2·sbh/t bytes.
        boundary = (pp + 1 + 16) * 2 * SBH // T
        assert first.activations == layer_bytes + pp * extras + boundary


@pytest.mark.parametrize(("pp", "m"), [(2, 2), (4, 2), (8, 2), (8, 3), (4, 4)])
def test_interleaved_first_stage_multiplies_by_1_plus_p_minus_1_over_pm(pp: int, m: int) -> None:
    p = plan(gpt3(grad_accum=8 * pp), Parallel(tp=T, sp=True, pp=pp, vpp=m))
    layers = p.stages[0].counts[Group.LAYER]
    assert Fraction(layers) == L * (1 + Fraction(pp - 1, pp * m))


def test_few_micro_batches_cap_what_is_in_flight() -> None:
    p = plan(gpt3(grad_accum=2), Parallel(tp=T, pp=8))
    assert p.stages[0].counts[Group.LAYER] == 2 * L // 8  # 2 micro-batches, not 8


def test_single_stage_extras_final_norm_output_layer_and_logits() -> None:
    # Korthikanti §4.3, p = 1: final LayerNorm input 2sbh/t, output-layer input 2sbh/t, fp32 logits 4sbv/t.
    v = 50257
    p = plan(gpt3(), Parallel(tp=T, sp=True))
    head = p.pieces.group_bytes[Group.HEAD] + p.pieces.group_bytes[Group.HEAD_FREED]
    vocab_rows = -(-v // T)  # memplan: ⌈v/t⌉ rows per rank (Megatron pads v to a multiple of 128·t)
    # Residual: final LayerNorm statistics (8sb/t), int64 labels (8sb) and nll_loss's fp32 total weight.
    residual = 8 * S * B // T + 8 * S * B + 4
    assert head == 2 * SBH // T + 2 * SBH // T + 4 * S * B * vocab_rows + residual


# ----------------------------------------------------------------------------------------------------
# The rules table is what the tensor-parallel rank's model does
# ----------------------------------------------------------------------------------------------------
PRESETS = ("gpt3-175b", "llama-3-70b", "mixtral-8x7b", "qwen1.5-moe-a2.7b")
STRATEGIES = [
    (Checkpointing.NONE, Attention.EAGER, False),
    (Checkpointing.NONE, Attention.FLASH, False),
    (Checkpointing.SELECTIVE, Attention.EAGER, False),
    (Checkpointing.SELECTIVE, Attention.FLASH, False),
    (Checkpointing.FULL, Attention.FLASH, False),
    (Checkpointing.NONE, Attention.FLASH, True),
]


def _setup(name: str, ckpt: Checkpointing, attention: Attention, reversible: bool, device: Device) -> Setup:
    model = load_model_preset(name).model
    return Setup(
        model=model,
        training=TrainingConfig(seq_len=1024),
        strategy=StrategyConfig(checkpointing=ckpt, attention=attention, reversible=reversible),
        device=device,
    )


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize(("ckpt", "attention", "reversible"), STRATEGIES)
@pytest.mark.parametrize("device", list(Device))
def test_every_name_has_a_rule_and_tp_model_splits_exactly_the_tensor_ones(
    name: str, ckpt: Checkpointing, attention: Attention, reversible: bool, device: Device
) -> None:
    setup = _setup(name, ckpt, attention, reversible, device)
    whole = {k.name: k for k in plan(setup).pieces.kept}
    split = {k.name: k for k in plan(setup, Parallel(tp=8)).pieces.kept}
    seq = {k.name: k for k in plan(setup, Parallel(tp=8, sp=True)).pieces.kept}
    assert whole.keys() == split.keys() == seq.keys()
    for n, k in whole.items():
        assert n == f"{k.block.value}.{n.split('.', 1)[1]}" or k.block is Block.CONST, n  # name = block.part
        r = rule(k.role)
        expected = list(k.shape)
        if r.split is Split.TENSOR:
            expected[tensor_dim(k)] = -(-expected[tensor_dim(k)] // 8)
        assert list(split[n].shape) == expected, n
        if r.split is Split.SEQUENCE:
            expected[r.dim] //= 8
        assert list(seq[n].shape) == expected, n


def test_every_role_has_a_split_and_an_unknown_one_is_an_error() -> None:
    assert set(SPLITS) == set(Role)
    with pytest.raises(ValueError, match=r"^role: .* has no tensor-parallel rule; add it to SPLITS$"):
        rule("bogus")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------------
# Parameters and model states per device
# ----------------------------------------------------------------------------------------------------
def test_tensor_parallel_layer_params_follow_megatron() -> None:
    # Column-parallel Q/K/V and fc1 (weights and biases /t), row-parallel W_O and fc2 (weights /t, bias
    # whole on every rank), both LayerNorms whole: (12h² + 7h)/t + 6h per layer, exactly.
    rank = count_params(tp_model(load_model_preset("gpt3-175b").model, T))
    assert rank.layer.total == (12 * H * H + 7 * H) // T + 6 * H


def test_pipeline_places_embedding_first_and_head_last_with_a_tied_copy() -> None:
    whole = count_params(load_model_preset("gpt3-175b").model)
    p = plan(gpt3(grad_accum=8), Parallel(tp=1, pp=8))
    first, last = p.stages
    per_stage_layers = whole.layer.total * L // 8
    assert first.params.total == per_stage_layers + whole.embedding + whole.positions
    # Tied embeddings: Megatron's last stage keeps its own copy of the word embedding for the head.
    assert last.params.total == per_stage_layers + whole.final_norm + whole.embedding
    assert first.stage.first and last.stage.last and "loss backward" not in first.peak.phases


def test_untied_head_on_the_last_stage() -> None:
    whole = count_params(load_model_preset("llama-3-70b").model)
    setup = Setup(model=load_model_preset("llama-3-70b").model, training=TrainingConfig(grad_accum=4))
    first, last = plan(setup, Parallel(pp=4)).stages
    assert last.params.lm_head == whole.lm_head and first.params.lm_head == 0
    assert first.params.embedding == whole.embedding and last.params.embedding == 0


def test_zero_shards_each_stage_over_dp() -> None:
    dp = 64
    p = plan(gpt3(grad_accum=8, zero=ZeroStage.PARAMETERS, dp=dp), Parallel(tp=8, pp=8))
    first = p.stages[0]
    n = first.params.total
    # ZeRO-3, mixed-precision AdamW: (2 + 2 + 12)Ψ/Nd, each shard ⌈Ψ/Nd⌉ elements (Rajbhandari et al. §5).
    assert first.states.weights + first.states.gradients + first.states.optimizer == 16 * -(-n // dp)


# ----------------------------------------------------------------------------------------------------
# At tp = pp = 1 the plan is the single-device estimate
# ----------------------------------------------------------------------------------------------------
@st.composite
def setups(draw: st.DrawFn) -> Setup:
    heads = draw(st.sampled_from([1, 2, 4, 8]))
    position = draw(st.sampled_from(PositionType))
    model = ModelConfig(
        hidden_size=heads * 8,
        num_layers=draw(st.integers(1, 6)),
        num_heads=heads,
        num_kv_heads=draw(st.sampled_from([k for k in (1, 2, 4, 8) if heads % k == 0])),
        ffn_size=draw(st.integers(1, 64)) * 8,
        vocab_size=draw(st.integers(1, 3000)),
        tied_embeddings=draw(st.booleans()),
        norm=draw(st.sampled_from(NormType)),
        mlp=draw(st.sampled_from(MlpType)),
        mlp_bias=draw(st.booleans()),
        position=position,
        max_positions=512,
        attn_dropout=draw(st.sampled_from([0.0, 0.1])),
        resid_dropout=draw(st.sampled_from([0.0, 0.1])),
    )
    ckpt = draw(st.sampled_from(Checkpointing))
    every = draw(st.integers(1, model.num_layers)) if ckpt is Checkpointing.EVERY_K else 1
    return Setup(
        model=model,
        training=TrainingConfig(
            micro_batch=draw(st.integers(1, 4)),
            seq_len=draw(st.integers(1, 256)),
            precision=draw(st.sampled_from(RECIPES)),
            grad_accum=draw(st.integers(1, 3)),
        ),
        strategy=StrategyConfig(
            checkpointing=ckpt,
            checkpoint_every=every,
            attention=draw(st.sampled_from(Attention)),
            reversible=ckpt is Checkpointing.NONE and draw(st.booleans()),
            zero=draw(st.sampled_from(ZeroStage)),
            dp=draw(st.sampled_from([1, 4])),
        ),
        device=draw(st.sampled_from(Device)),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setups())
def test_one_device_equals_the_blocks_composed_directly(setup: Setup) -> None:
    # One dense device composed straight from the blocks and the strategies (the single-device estimate
    # memplan had before the engine grouped inventories per pipeline stage): the engine's trivial layout
    # must give the same tensors, states, FLOPs and peak moments.
    params = count_params(setup.model)
    t, s = setup.training, setup.strategy
    states = model_states(params.total, t.precision, t.optimizer, s.zero, s.dp)
    kept = reversible.keeps(checkpointing.keeps(act.inventory(setup), setup), setup)
    direct = pk.peak(setup, states, kept, params, head_gradient_bytes(params, setup))
    dims = Dims.of(setup)
    recompute = checkpointing.recompute(setup, dims) + reversible.recompute(setup, dims)
    p = plan(setup)
    dev = p.device
    assert dev.peak.phases == direct.phases
    assert dev.states == states and dev.activations == act.total_bytes(kept)
    assert p.tensors == kept
    assert p.per_layer == act.per_layer_bytes(kept, setup.model.num_layers)
    assert p.flops == fl.flops(setup, recompute)
    assert to_json(p)["activations"]["per_layer"] == p.per_layer


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(setups(), st.sampled_from([2, 4]))
def test_more_tensor_parallelism_never_needs_more_per_device(setup: Setup, t: int) -> None:
    m = setup.model
    if m.num_heads % t or m.kv_heads % t or m.ffn % t:
        return
    one, split = plan(setup).device, plan(setup, Parallel(tp=t)).device
    assert split.activations <= one.activations
    assert split.states.total <= one.states.total
    if setup.training.seq_len % t == 0:
        assert plan(setup, Parallel(tp=t, sp=True)).device.activations <= split.activations


# ----------------------------------------------------------------------------------------------------
# One-line errors naming the field and the fix
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("parallel", "needle"),
    [
        (dict(tp=5), "tp: 5 does not divide num_heads 96 of gpt3-175b; use --tp 1, 2, 3, 4"),
        (dict(pp=97), "pp: 97 stages for the 96 layers of gpt3-175b; use --pp 96 or fewer"),
        (dict(pp=8, vpp=5), "vpp: 5 virtual stages need the same layers on every stage, a multiple of 5"),
        (dict(pp=5, vpp=2), "vpp: 2 virtual stages need the same layers on every stage"),
        (dict(pp=2, pp_layers=(40, 40)), "pp-layers: the stages hold 80 layers, gpt3-175b has 96"),
        (dict(ep=2), "ep: gpt3-175b is dense; expert parallelism needs a mixture of experts, drop --ep"),
    ],
)
def test_layout_mistakes_are_one_line(parallel: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError) as info:
        plan(gpt3(grad_accum=8), Parallel(**parallel))  # type: ignore[arg-type]
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_sequence_parallel_needs_tp_and_a_divisible_sequence() -> None:
    with pytest.raises(ValueError, match=r"sp: sequence parallelism splits over the tensor-parallel ranks"):
        Parallel(sp=True)
    with pytest.raises(ValueError, match=r"vpp: the interleaved schedule needs pipeline parallelism"):
        Parallel(vpp=2)
    setup = Setup(model=load_model_preset("llama-3-8b").model, training=TrainingConfig(seq_len=1001))
    with pytest.raises(ValueError, match=r"^seq: 1001 is not a multiple of --tp 8.*use --seq 1000 or 1008$"):
        plan(setup, Parallel(tp=8, sp=True))


def test_kv_heads_must_split_whole() -> None:
    setup = Setup(model=load_model_preset("llama-3-70b").model)
    with pytest.raises(ValueError, match=r"tp: 16 does not divide num_kv_heads 8 .*whole key/value groups"):
        plan(setup, Parallel(tp=16))


# The fix lists the valid degrees: all of them up to eight, else the first eight and "…". By hand: GPT-3's
# widths (96 heads, 96 kv heads, ffn 49,152) have gcd 96, whose divisors are 1, 2, 3, 4, 6, 8, 12, 16, 24,
# 32, 48, 96 (twelve); Llama-3-70B's (64, 8, 28,672) gcd 8: 1, 2, 4, 8; 24 layers have exactly eight
# divisors, 1, 2, 3, 4, 6, 8, 12, 24, all shown.
def test_the_fix_lists_at_most_eight_valid_degrees() -> None:
    with pytest.raises(ValueError) as many:
        plan(gpt3(), Parallel(tp=5))
    assert str(many.value).endswith("; use --tp 1, 2, 3, 4, 6, 8, 12, 16 …")
    with pytest.raises(ValueError) as few:
        plan(Setup(model=load_model_preset("llama-3-70b").model), Parallel(tp=3))
    assert str(few.value).endswith("; use --tp 1, 2, 4, 8")
    layers24 = ModelConfig(hidden_size=64, num_layers=24, num_heads=4, ffn_size=160, vocab_size=1000)
    with pytest.raises(ValueError) as eight:
        plan(Setup(model=layers24, training=TrainingConfig(grad_accum=10)), Parallel(pp=5, vpp=2))
    assert "use a --pp that divides the 24 layers (1, 2, 3, 4, 6, 8, 12, 24) and" in str(eight.value)


def test_interleaving_needs_micro_batches_in_groups_of_p() -> None:
    with pytest.raises(ValueError, match=r"^grad-accum: the interleaved schedule .* groups of --pp 8, got 4"):
        plan(gpt3(grad_accum=4), Parallel(pp=8, vpp=2))


# ----------------------------------------------------------------------------------------------------
# Uneven pipeline stages
# ----------------------------------------------------------------------------------------------------
def test_llama3_405b_places_126_layers_on_16_stages_as_meta_did() -> None:
    # Dubey et al. 2024 §3.3.2: the first and the last stage hold one layer fewer (they hold the embedding
    # and the head): 7 + 14 × 8 + 7 = 126.
    assert stage_layers(126, Parallel(pp=16)) == (7, *[8] * 14, 7)
    assert stage_layers(96, Parallel(pp=5)) == (19, 19, 20, 19, 19)  # 4 too many: first, last, 2nd, 4th
    assert stage_layers(96, Parallel(pp=8)) == (12,) * 8


def test_a_middle_stage_with_more_layers_is_computed_and_can_be_the_most_loaded() -> None:
    # 405B, pp 16, 64 micro-batches per step under 1F1B: stage 0 keeps 7 layers × 16 micro-batches in
    # flight = 112 layer-sets, stage 1 keeps 8 × 15 = 120, the last stage 7 × 1.
    model = load_model_preset("llama-3.1-405b").model
    setup = Setup(
        model=model,
        training=TrainingConfig(seq_len=8192, grad_accum=64),
        strategy=StrategyConfig(checkpointing=Checkpointing.FULL, dp=64, zero=ZeroStage.OPTIMIZER),
    )
    p = plan(setup, Parallel(tp=8, sp=True, pp=16))
    assert [(sp.stage.index, sp.stage.layers, sp.counts[Group.CHECKPOINT]) for sp in p.stages] == [
        (0, 7, 112),
        (1, 8, 120),
        (15, 7, 7),
    ]
    assert p.device.stage.index == 1
    whole = count_params(tp_model(model, 8))
    assert p.stages[1].params.total == 8 * whole.layer.total  # a middle stage: its layers only


def test_explicit_stage_layers() -> None:
    setup = gpt3(grad_accum=8)
    p = plan(setup, Parallel(pp=4, pp_layers=(23, 25, 25, 23)))
    assert [sp.stage.layers for sp in p.stages] == [23, 25, 23]
    with pytest.raises(ValueError, match=r"pp_layers: 3 stages listed for --pp 4; give one layer count"):
        Parallel(pp=4, pp_layers=(32, 32, 32))


# Refusals of a tensor-parallel degree, by hand (the seventh mutation run's holes, docs/mutation.md).
def _tp_setup(**model: Any) -> Setup:
    from memplan.config import ModelConfig, TrainingConfig

    fields: dict[str, Any] = {"hidden_size": 64, "num_layers": 2, "num_heads": 8, "num_kv_heads": 8}
    fields.update({"ffn_size": 128, "vocab_size": 1000, "max_positions": 64, **model})
    return Setup(model=ModelConfig(**fields), training=TrainingConfig(micro_batch=1, seq_len=64))


def test_divisors_stop_at_the_limit() -> None:
    """12's divisors are 1, 2, 3, 4, 6, 12; up to 5 only the first four (never 6, one past the limit)."""
    from memplan.strategies.tensor_parallel import divisors

    assert divisors(12) == [1, 2, 3, 4, 6, 12]
    assert divisors(12, limit=5) == [1, 2, 3, 4]


def test_tp_refusal_names_the_mlp_width() -> None:
    """8 heads and kv heads divide by 4 but an MLP width of 100 does not: the refusal names ffn_size, and
    offers the common divisors of 8, 8 and 100: 1, 2, 4."""
    from memplan.strategies.tensor_parallel import check_parallel

    with pytest.raises(ValueError, match=r"^tp: 8 does not divide ffn_size 100 of .*; use --tp 1, 2, 4$"):
        check_parallel(_tp_setup(ffn_size=100), Parallel(tp=8))


def test_tp_must_divide_the_extra_moe_widths() -> None:
    """A width given beside the model's (an expert's MLP) must divide by tp too: 6 is not a multiple of 4."""
    from memplan.strategies.tensor_parallel import check_parallel

    check_parallel(_tp_setup(), Parallel(tp=4))  # 8, 8 and 128 divide by 4
    with pytest.raises(ValueError, match=r"^tp: 4 does not divide moe width 0 6 of .*; use --tp 1, 2$"):
        check_parallel(_tp_setup(), Parallel(tp=4), extra_widths=(6,))


def test_sequence_parallelism_re_runs_nothing() -> None:
    """Sequence parallelism only gathers inputs (communication): it adds no recompute, not even a byte."""
    from memplan.strategies.sequence_parallel import recompute

    s = _tp_setup()
    assert recompute(s, Dims.of(s)) == 0
