"""Invariants of the analytic estimate over random valid configurations (hypothesis).

Each test states one invariant; where an ordering one might expect does not hold in general, the test says
why and checks what does hold instead. The whole file runs in a few seconds (bounded examples, no torch).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # (no stubs installed)
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memplan.analytic.fsdp import root as fsdp2_root
from memplan.blocks.inventory import Kept, Role, Scope
from memplan.blocks.profiles import accumulates_in_place
from memplan.config import (
    Attention,
    Checkpointing,
    Device,
    MlpType,
    ModelConfig,
    NormType,
    Optimizer,
    PositionType,
    Precision,
    Setup,
    StrategyConfig,
    TrainingConfig,
    ZeroStage,
)
from memplan.contract import to_json
from memplan.engine import Result, estimate
from memplan.presets import load_model_preset
from memplan.schema import contract_keys, estimate_schema

# FSDP2's recipe needs ZeRO-2/3 over dp > 1 (``config.setup.check_fsdp2_mixed``): tests/test_fsdp2_mixed.py
RECIPES = [p for p in Precision if p is not Precision.FSDP2_MIXED]

PROPS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MAX_POSITIONS = 4096
MAX_SEQ = 1024  # < MAX_POSITIONS, so seq + 1 is valid with learned positions too


# ----------------------------------------------------------------------------------------------------
# Random valid configurations
# ----------------------------------------------------------------------------------------------------
@st.composite
def models(draw: st.DrawFn) -> ModelConfig:
    heads = draw(st.integers(1, 16))
    kv = draw(st.sampled_from([k for k in range(1, heads + 1) if heads % k == 0]))
    position = draw(st.sampled_from(PositionType))
    head_dim = draw(st.integers(1, 24)) * (2 if position is PositionType.ROPE else 1)
    # Either h = a·d (head_dim derived) or a width of its own with head_dim set apart.
    explicit = draw(st.booleans())
    hidden = draw(st.integers(1, 256)) if explicit else heads * head_dim
    mlp = draw(st.sampled_from(MlpType))
    ffn = draw(st.integers(1, 512)) if mlp is MlpType.SWIGLU or draw(st.booleans()) else None
    dropout = st.sampled_from([0.0, 0.1, 0.5])
    return ModelConfig(
        hidden_size=hidden,
        num_layers=draw(st.integers(1, 12)),
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim if explicit else None,
        ffn_size=ffn,
        vocab_size=draw(st.integers(1, 5000)),
        tied_embeddings=draw(st.booleans()),
        norm=draw(st.sampled_from(NormType)),
        mlp=mlp,
        qkv_bias=draw(st.booleans()),
        out_bias=draw(st.booleans()),
        mlp_bias=draw(st.booleans()),
        position=position,
        max_positions=MAX_POSITIONS,
        attn_dropout=draw(dropout),
        resid_dropout=draw(dropout),
        embd_dropout=draw(dropout),
    )


def trainings() -> st.SearchStrategy[TrainingConfig]:
    return st.builds(
        TrainingConfig,
        micro_batch=st.integers(1, 8),
        seq_len=st.integers(1, MAX_SEQ),
        precision=st.sampled_from(RECIPES),
        optimizer=st.sampled_from(Optimizer),
        grad_accum=st.integers(1, 4),
    )


@st.composite
def strategies_for(draw: st.DrawFn, layers: int) -> StrategyConfig:
    """A valid strategy: reversible only without checkpointing, k only for every-k (1 ≤ k ≤ layers)."""
    checkpointing = draw(st.sampled_from(Checkpointing))
    every = draw(st.integers(1, layers)) if checkpointing is Checkpointing.EVERY_K else 1
    reversible = checkpointing is Checkpointing.NONE and draw(st.booleans())
    return StrategyConfig(
        checkpointing=checkpointing,
        checkpoint_every=every,
        attention=draw(st.sampled_from(Attention)),  # flash with attention dropout is valid in the estimate
        reversible=reversible,
        zero=draw(st.sampled_from(ZeroStage)),
        dp=draw(st.sampled_from([1, 2, 3, 8, 64])),
    )


@st.composite
def setups(draw: st.DrawFn) -> Setup:
    model = draw(models())
    return Setup(
        model=model,
        training=draw(trainings()),
        strategy=draw(strategies_for(model.num_layers)),
        device=draw(st.sampled_from(Device)),
    )


def changed(
    setup: Setup, *, training: dict[str, Any] | None = None, strategy: dict[str, Any] | None = None
) -> Setup:
    """The same setup with some training or strategy fields replaced (re-validated)."""
    return Setup(
        model=setup.model,
        training=TrainingConfig(**{**setup.training.model_dump(), **(training or {})}),
        strategy=StrategyConfig(**{**setup.strategy.model_dump(), **(strategy or {})}),
        device=setup.device,
    )


def with_checkpointing(setup: Setup, checkpointing: Checkpointing, every: int = 1) -> Setup:
    return changed(
        setup, strategy={"checkpointing": checkpointing, "checkpoint_every": every, "reversible": False}
    )


def layer_entries(e: Result) -> dict[str, Kept]:
    return {k.name: k for k in e.tensors if k.scope is Scope.LAYER}


def act_bytes(setup: Setup) -> int:
    return setup.training.precision.activation_dtype.bytes


# ----------------------------------------------------------------------------------------------------
# Activations grow with batch and sequence
# ----------------------------------------------------------------------------------------------------
@PROPS
@given(setups(), st.sampled_from(["micro_batch", "seq_len"]))
def test_activations_grow_with_batch_and_sequence(setup: Setup, field: str) -> None:
    bigger = changed(setup, training={field: getattr(setup.training, field) + 1})
    small, large = estimate(setup), estimate(bigger)
    assert large.activations >= small.activations
    assert large.peak.bytes >= small.peak.bytes
    # Every model-scope entry is non-decreasing (rope tables and the loss's scalar do not depend on b).
    small_model = {k.name: k.total_bytes for k in small.tensors if k.scope is Scope.MODEL}
    for k in large.tensors:
        if k.scope is Scope.MODEL:
            assert k.total_bytes >= small_model[k.name], k.name
    # Every layer-scope entry is [b, s, …]-shaped: strictly larger, entry by entry. The one exception is
    # the CUDA flash kernel's RNG state ([2] and [] uint64 per layer, role RNG_STATE): a constant.
    small_layer, large_layer = layer_entries(small), layer_entries(large)
    assert small_layer.keys() == large_layer.keys()
    for name, k in large_layer.items():
        if setup.device is Device.CUDA and k.role is Role.RNG_STATE:
            assert k == small_layer[name], name
        else:
            assert k.total_bytes > small_layer[name].total_bytes, name
    if small_layer:  # (reversible layers keep no layer-scope entry: the stack's outputs are model-scope)
        assert sum(k.total_bytes for k in large_layer.values()) > sum(
            k.total_bytes for k in small_layer.values()
        )
        assert large.activations > small.activations
    # per_layer is the layer-scope total floor-divided by L (every-K: ceil(L/K) inputs spread over L
    # layers), so it may stay put for a one-token step: non-decreasing only.
    assert large.per_layer >= small.per_layer


# ----------------------------------------------------------------------------------------------------
# Strategies only ever save memory where they promise to
# ----------------------------------------------------------------------------------------------------
@PROPS
@given(setups())
def test_checkpointing_keeps_no_more_than_none(setup: Setup) -> None:
    none = estimate(with_checkpointing(setup, Checkpointing.NONE)).activations
    layers = setup.model.num_layers
    assert estimate(with_checkpointing(setup, Checkpointing.SELECTIVE)).activations <= none
    assert estimate(with_checkpointing(setup, Checkpointing.FULL)).activations <= none
    for k in {1, 2, layers, (layers + 1) // 2}:
        if 1 <= k <= layers:
            assert estimate(with_checkpointing(setup, Checkpointing.EVERY_K, k)).activations <= none
    reversible = changed(setup, strategy={"checkpointing": Checkpointing.NONE, "checkpoint_every": 1})
    assert estimate(changed(reversible, strategy={"reversible": True})).activations <= none


@PROPS
@given(setups(), st.data())
def test_every_k_and_full_keep_layer_inputs(setup: Setup, data: st.DataObject) -> None:
    """Full keeps L layer inputs, every-K keeps ceil(L/K); each one layer input [b, s, h].

    NB: ``full ≤ every-K`` (the enum's order) does NOT hold for saved activations: every-K keeps
    ceil(L/K) ≤ L layer inputs, so it saves *at least as much* as full; what it pays instead is a larger
    working set in backward (K layers re-run at once) and more recompute (below). So the check is the
    reverse inequality and the exact counts.
    """
    layers = setup.model.num_layers
    k = data.draw(st.integers(1, layers), label="k")
    full = estimate(with_checkpointing(setup, Checkpointing.FULL))
    every = estimate(with_checkpointing(setup, Checkpointing.EVERY_K, k))
    t = setup.training
    one_input = t.micro_batch * t.seq_len * setup.model.hidden_size * act_bytes(setup)
    for e, count in ((full, layers), (every, math.ceil(layers / k))):
        inputs = [x for x in e.tensors if x.scope is Scope.LAYER]
        assert [(x.name, x.count, x.bytes) for x in inputs] == [("layer.input", count, one_input)]
        assert inputs[0].shape == (t.micro_batch, t.seq_len, setup.model.hidden_size)
    assert every.activations <= full.activations
    assert full.activations - every.activations == (layers - math.ceil(layers / k)) * one_input
    # Model-scope entries are the same under both.
    assert [x for x in full.tensors if x.scope is Scope.MODEL] == [
        x for x in every.tensors if x.scope is Scope.MODEL
    ]
    # every-1 is full.
    one = estimate(with_checkpointing(setup, Checkpointing.EVERY_K, 1))
    assert (one.tensors, one.flops, one.peak) == (full.tensors, full.flops, full.peak)
    # Recompute: both re-run every layer; torch's early stop skips the down projection once per segment
    # (when no residual dropout mask is saved after it), so full (L segments) re-runs no more than every-K.
    assert full.flops.recompute <= every.flops.recompute


@PROPS
@given(setups())
def test_flash_keeps_no_more_than_eager_from_five_tokens(setup: Setup) -> None:
    """flash ≤ eager for s ≥ 5. Per layer and (batch, head) row flash keeps a fp32 logsumexp of s·4 bytes
    where eager keeps s·s probabilities of 2 bytes or more, and on CUDA flash one 24-byte RNG state a layer;
    eager's s×s bool mask is one for all layers. So b·a·2s² ≥ b·a·4s + 24 must hold at b = a = 1: s ≥ 5
    (at s = 4, one head, bf16 and more than one layer flash keeps 8 bytes a layer more — hypothesis found it;
    ``test_flash_exceeds_eager_when_tiny``)."""
    if setup.training.seq_len < 5:
        setup = changed(setup, training={"seq_len": 5})
    flash = estimate(changed(setup, strategy={"attention": Attention.FLASH}))
    eager = estimate(changed(setup, strategy={"attention": Attention.EAGER}))
    assert flash.activations <= eager.activations
    # The same matrix products run forward; the flash backward recomputes S = QKᵀ (5 products, not 4).
    assert flash.flops.forward == eager.flops.forward
    assert flash.flops.backward >= eager.flops.backward


@pytest.mark.parametrize("device", list(Device))
def test_flash_exceeds_eager_when_tiny(device: Device) -> None:
    """The exception to flash ≤ eager: per (batch, head) row flash keeps a fp32 logsumexp (4 bytes) where
    eager keeps s probabilities (s × 2 bytes in bf16); on CUDA flash also keeps a 24-byte RNG state
    where eager keeps an s×s bool mask. At s = 1, MHA, bf16 the flash inventory is the larger one."""
    model = ModelConfig(hidden_size=8, num_layers=1, num_heads=2, ffn_size=8, vocab_size=8)
    setup = Setup(model=model, training=TrainingConfig(seq_len=1, precision=Precision.BF16), device=device)
    flash = estimate(changed(setup, strategy={"attention": Attention.FLASH}))
    eager = estimate(changed(setup, strategy={"attention": Attention.EAGER}))
    assert flash.activations > eager.activations


def test_flash_exceeds_eager_at_four_tokens_of_one_head() -> None:
    """On CUDA at s = 4, one head, bf16, three layers: flash keeps 16 + 24 bytes a layer (logsumexp, RNG
    state), eager 32 (probabilities) and one 16-byte mask for all: 120 against 112 bytes."""
    model = ModelConfig(hidden_size=2, num_layers=3, num_heads=1, head_dim=2, ffn_size=1, vocab_size=1)
    setup = Setup(model=model, training=TrainingConfig(seq_len=4, precision=Precision.BF16_MIXED))
    flash = estimate(changed(setup, strategy={"attention": Attention.FLASH}))
    eager = estimate(changed(setup, strategy={"attention": Attention.EAGER}))
    assert flash.activations - eager.activations == 3 * (16 + 24 - 32) - 16


# ----------------------------------------------------------------------------------------------------
# ZeRO
# ----------------------------------------------------------------------------------------------------
def gathered_unit_bytes(e: Result) -> int:
    """Weights of the largest unit ZeRO-3 gathers whole: a layer, the embedding or the lm head. Under the
    reference's FSDP2 wrapping (``analytic.fsdp.root``) what ZeRO-3 holds beyond its shards at most: the
    root unit and its unsharded gradients, a layer unsharded, the next one's all-gather output, the
    previous one's reduce-scatter input."""
    p, s = e.params, e.setup
    if fsdp2_root.root_gathered(s):
        layer = fsdp2_root.layer_flat(s)
        held = fsdp2_root.root_unit(s) + fsdp2_root.root_grads(s, embedding=True)
        return held + 2 * layer + fsdp2_root.layer_reduce_input(s)
    return max(p.layer.total, p.embedding, p.lm_head) * s.training.precision.weight_bytes


@PROPS
@given(setups())
def test_higher_zero_stage_never_needs_more(setup: Setup) -> None:
    """Model states never grow with the stage; the peak neither, with one exception from 2 to 3.

    NB: ZeRO-3 holds its weight shard *and* the unit it has gathered (the unsharded layer or head; under
    the reference's FSDP2 wrapping the root, a layer and FSDP2's buffers: ``gathered_unit_bytes``). When
    that unit alone is more than the weights sharding saves (Ψ − ⌈Ψ/dp⌉ elements), e.g. a one-layer model
    at dp 2, stage 3 truly peaks higher than stage 2. What holds then: the excess is exactly that
    difference. Real models (many layers, each a small share of Ψ) are in the first case.
    NB: the same from 1 to 2 with gradient accumulation: ZeRO 0–1 sum a later micro-batch's gradients into
    the whole ones as they are made (``accumulates_in_place``), where ZeRO-2 holds a unit's whole new
    gradients until its reduce-scatter; when the largest unit's are more than sharding the gradients
    saves, stage 2 peaks higher, by at most that difference.
    """
    stages = [estimate(changed(setup, strategy={"zero": z})) for z in ZeroStage]
    for low, high in itertools.pairwise(stages):
        assert high.states.total <= low.states.total
        assert high.states.weights <= low.states.weights
        assert high.states.gradients <= low.states.gradients
        assert high.states.optimizer <= low.states.optimizer
    zero0, zero1, zero2, zero3 = stages
    assert zero1.peak.bytes <= zero0.peak.bytes
    p, grad_bytes = zero2.params, setup.training.precision.grad_bytes
    made = max(p.layer.total, p.embedding, p.lm_head) * grad_bytes  # the largest unit's whole gradients
    saved_grads = zero1.states.gradients - zero2.states.gradients
    if accumulates_in_place(zero1.setup) and made > saved_grads:
        assert zero2.peak.bytes - zero1.peak.bytes <= made - saved_grads
    else:
        assert zero2.peak.bytes <= zero1.peak.bytes
    saved = zero2.states.weights - zero3.states.weights
    gathered = gathered_unit_bytes(zero3) if setup.strategy.dp > 1 else 0
    if gathered <= saved:
        assert zero3.peak.bytes <= zero2.peak.bytes
    else:
        assert zero3.peak.bytes - zero2.peak.bytes <= gathered - saved


@pytest.mark.parametrize("dp", [2, 8, 64])
def test_zero3_peak_below_zero2_for_a_real_model(dp: int) -> None:
    """The exception above never bites a real model: Llama-2-70B's layers are 1/80 of it each."""
    model = load_model_preset("llama-2-70b").model
    setup = Setup(model=model, training=TrainingConfig(seq_len=4096), strategy=StrategyConfig(dp=dp))
    zero2 = estimate(changed(setup, strategy={"zero": ZeroStage.GRADIENTS}))
    zero3 = estimate(changed(setup, strategy={"zero": ZeroStage.PARAMETERS}))
    assert zero3.peak.bytes < zero2.peak.bytes


@PROPS
@given(setups())
def test_every_zero_stage_is_stage_zero_at_dp_1(setup: Setup) -> None:
    base = estimate(changed(setup, strategy={"zero": ZeroStage.NONE, "dp": 1}))
    for z in ZeroStage:
        e = estimate(changed(setup, strategy={"zero": z, "dp": 1}))
        assert e.states == base.states
        assert e.peak == base.peak


# ----------------------------------------------------------------------------------------------------
# Totals are the sums of their parts
# ----------------------------------------------------------------------------------------------------
@PROPS
@given(setups())
def test_totals_equal_the_sum_of_their_parts(setup: Setup) -> None:
    e = estimate(setup)
    j = to_json(e)
    tensors = j["activations"]["tensors"]
    assert (
        j["memory"]["activations"]
        == j["activations"]["total"]
        == sum(t["bytes"] * t["count"] for t in tensors)
    )
    for t in tensors:
        assert (
            t["bytes"]
            == math.prod(t["shape"])
            * {"fp32": 4, "bf16": 2, "fp16": 2, "bool": 1, "int64": 8, "uint64": 8, "complex64": 8}[
                t["dtype"]
            ]
        )
        assert t["total_bytes"] == t["bytes"] * t["count"]
        assert (
            t["count"] == (setup.model.num_layers if t["scope"] == "layer" else 1)
            or t["name"] == "layer.input"
        )
    layer = sum(t["bytes"] * t["count"] for t in tensors if t["scope"] == "layer")
    assert j["activations"]["per_layer"] == layer // setup.model.num_layers
    f = j["flops"]
    assert f["total"] == f["forward"] + f["backward"] + f["recompute"] == f["hardware"]
    # Model FLOPs: forward + backward less the flash kernel's re-computation of S (analytic/flops.py);
    # with every weight trained each matmul's backward is 2× its forward, so that is 3 × the forward.
    assert f["model"] == f["forward"] + f["backward"] - f["kernel_recompute"] + f["cp_skipped"]
    assert f["cp_skipped"] == 0 and f["model"] == 3 * f["forward"]  # one device: no causal split to skip
    assert f["per_step"] == f["total"] * setup.training.grad_accum
    assert f["forward"] == e.flops.layer_linear + e.flops.layer_attention + e.flops.lm_head
    m = j["memory"]
    assert m["optimizer"] == m["master_weights"] + m["optimizer_states"]
    assert m["peak"] == max(m["phases"].values()) == m["phases"][m["peak_phase"]]
    assert m["peak"] >= m["weights"] + m["gradients"] + m["optimizer"]
    p = j["params"]
    assert p["total"] == p["embedding"] + p["positions"] + p["layers"] + p["final_norm"] + p["lm_head"]
    assert p["layers"] == p["per_layer"] * setup.model.num_layers
    assert p["active"] == p["total"]


# ----------------------------------------------------------------------------------------------------
# FLOPs
# ----------------------------------------------------------------------------------------------------
@PROPS
@given(setups(), st.integers(2, 16))
def test_flops_are_linear_in_batch(setup: Setup, factor: int) -> None:
    one = estimate(changed(setup, training={"micro_batch": 1})).flops
    many = estimate(changed(setup, training={"micro_batch": factor})).flops
    assert many.forward == factor * one.forward
    assert many.backward == factor * one.backward
    assert many.recompute == factor * one.recompute


@PROPS
@given(setups())
def test_hardware_flops_cover_model_flops(setup: Setup) -> None:
    f = estimate(setup).flops
    assert f.recompute >= 0
    assert f.total >= f.model > 0
    s = setup.strategy
    recomputes = s.reversible or s.checkpointing is not Checkpointing.NONE
    assert (f.recompute > 0) == recomputes
    # Recompute is at most one more forward of the layers (never the lm head).
    assert f.recompute <= f.layer_linear + f.layer_attention


# ----------------------------------------------------------------------------------------------------
# The machine-readable contract
# ----------------------------------------------------------------------------------------------------
VALIDATOR = jsonschema.Draft202012Validator(estimate_schema())


def test_schema_is_a_valid_json_schema() -> None:
    jsonschema.Draft202012Validator.check_schema(estimate_schema())
    keys = set(contract_keys())
    for key in (
        "params.total",
        "params.active",
        "memory.weights",
        "memory.gradients",
        "memory.optimizer",
        "memory.activations",
        "memory.peak",
        "activations.tensors[].name",
        "activations.tensors[].shape",
        "activations.tensors[].dtype",
        "activations.tensors[].bytes",
        "activations.tensors[].count",
        "activations.per_layer",
        "flops.forward",
        "flops.backward",
        "flops.recompute",
        "flops.total",
        "flops.model",
    ):
        assert key in keys


@PROPS
@given(setups())
def test_json_output_validates_against_the_schema(setup: Setup) -> None:
    VALIDATOR.validate(to_json(estimate(setup)))


def _drop(doc: dict[str, Any], path: str) -> None:
    *parents, last = path.replace("[]", ".0").split(".")
    node: Any = doc
    for p in parents:
        node = node[int(p)] if p.isdigit() else node[p]
    del node[last]


# Ids without "[]": pytest cannot address a node id with brackets inside its parameter (mutmut runs tests
# by node id).
@pytest.mark.parametrize("key", contract_keys(), ids=lambda k: k.replace("[]", ".0"))
def test_schema_rejects_output_missing_a_contract_key(key: str) -> None:
    model = ModelConfig(hidden_size=8, num_layers=1, num_heads=2, ffn_size=8, vocab_size=8)
    doc = to_json(estimate(Setup(model=model)))
    _drop(doc, key)
    assert not VALIDATOR.is_valid(doc)


@pytest.mark.parametrize("key", ["memory.peak", "flops.total", "activations.per_layer"])
def test_schema_rejects_float_bytes_and_flops(key: str) -> None:
    model = ModelConfig(hidden_size=8, num_layers=1, num_heads=2, ffn_size=8, vocab_size=8)
    doc = to_json(estimate(Setup(model=model)))
    section, name = key.split(".")
    doc[section][name] = float(doc[section][name]) + 0.5
    assert not VALIDATOR.is_valid(doc)


# ----------------------------------------------------------------------------------------------------
# What a setting must not change, and what it must
# ----------------------------------------------------------------------------------------------------
@PROPS
@given(setups())
def test_sharding_changes_neither_activations_nor_flops(setup: Setup) -> None:
    """ZeRO and dp shard model states only: one device's micro-batch keeps and computes the same."""
    base = estimate(changed(setup, strategy={"zero": ZeroStage.NONE, "dp": 1}))
    sharded = estimate(setup)
    assert sharded.tensors == base.tensors
    assert sharded.flops == base.flops


@PROPS
@given(setups())
def test_gradient_accumulation_keeps_gradients_alive(setup: Setup) -> None:
    """With accumulation the gradients live through the forward and backward too: the peak never drops;
    the activations and one micro-batch's FLOPs stay."""
    one = estimate(changed(setup, training={"grad_accum": 1}))
    many = estimate(changed(setup, training={"grad_accum": 2}))
    assert many.tensors == one.tensors
    assert many.flops == one.flops
    assert many.peak.bytes >= one.peak.bytes
    assert many.peak.bytes >= many.states.total + many.activations


@pytest.mark.parametrize(
    ("preset", "zero", "dp"), [("7b", ZeroStage.GRADIENTS, 64), ("70b", ZeroStage.PARAMETERS, 512)]
)
def test_accumulation_never_lowers_the_peak_under_zero2(preset: str, zero: ZeroStage, dp: int) -> None:
    model = load_model_preset(preset).model
    peaks = [
        estimate(
            Setup(
                model=model,
                training=TrainingConfig(seq_len=1024, grad_accum=accum),
                strategy=StrategyConfig(checkpointing=Checkpointing.FULL, zero=zero, dp=dp),
            )
        ).peak.bytes
        for accum in (1, 2)
    ]
    assert peaks[1] >= peaks[0]


@PROPS
@given(setups())
def test_peak_covers_what_is_alive_when_the_forward_ends(setup: Setup) -> None:
    e = estimate(setup)
    assert e.peak.bytes >= e.states.weights + e.states.optimizer + e.activations
    assert e.peak.bytes >= e.states.total


@PROPS
@given(setups())
def test_activation_bytes_follow_the_activation_dtype(setup: Setup) -> None:
    """Recipes with the same activation dtype keep the same inventory; fp32 keeps at least as much."""
    by = {p: estimate(changed(setup, training={"precision": p})) for p in RECIPES}
    assert by[Precision.BF16_MIXED].tensors == by[Precision.BF16].tensors
    assert by[Precision.BF16_MIXED].activations == by[Precision.FP16_MIXED].activations
    assert by[Precision.FP32].activations >= by[Precision.BF16_MIXED].activations
    assert len({e.flops for e in by.values()}) == 1  # FLOPs do not depend on the dtype
