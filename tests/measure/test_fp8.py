"""``--fp8``: torchao 0.18's Float8Linear, measured against the estimate (blocks/fp8.py).

1. One linear's casts, tracked storage by storage, equal the sequence derived by hand here.
2. The saved tensors of the whole reference model under fp8 equal the estimate's (bf16's), to the byte.
3. The step's peak with fp8, measured on real CPU tensors, equals the estimate's layer-backward moment.
"""

from __future__ import annotations

import pytest
import torch

from memplan.blocks import fp8
from memplan.config import (
    Attention,
    Device,
    Fp8Recipe,
    Impl,
    ModelConfig,
    Setup,
    StrategyConfig,
    TrainingConfig,
)
from memplan.engine import estimate
from memplan.measure.compare.tensors import comparison_json
from memplan.measure.instruments.tracker import LiveMemoryTracker
from memplan.measure.reference.fp8 import require_torchao, torchao_config
from memplan.measure.runs.profile import profile
from memplan.measure.runs.run import measure

T, IN, OUT = 64, 128, 256


def _setup(recipe: Fp8Recipe, **training: object) -> Setup:
    model = ModelConfig(
        hidden_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        ffn_size=160,
        vocab_size=32,
        max_positions=512,
    )
    return Setup(
        model=model,
        training=TrainingConfig(**{"micro_batch": 2, "seq_len": 64, **training}),
        strategy=StrategyConfig(attention=Attention.FLASH),
        impl={"fp8": recipe},
        device=Device.CPU,
    )


def _linear_peaks(recipe: Fp8Recipe) -> tuple[int, int]:
    """One bf16 Float8Linear [T, IN] → [T, OUT]: its forward's and backward's top above what is alive
    before each (X and W; then also Y and dY)."""
    float8 = require_torchao()
    lin = torch.nn.Sequential(torch.nn.Linear(IN, OUT, bias=False, dtype=torch.bfloat16))
    float8.convert_to_float8_training(lin, config=torchao_config(recipe))
    x = torch.randn(T, IN, dtype=torch.bfloat16, requires_grad=True)
    tracker = LiveMemoryTracker()
    with tracker:
        tracker.track([x, lin[0].weight])
        before = tracker.current
        y = lin(x)
        forward = tracker.mark("forward").peak - before
        dy = torch.ones_like(y)
        alive = tracker.current
        y.backward(dy)
        backward = tracker.mark("backward").peak - alive
    return forward, backward


# By hand, bf16 (e = 2), X 64×128 = 8,192 elements, W 128×256 = 32,768, Y 64×256 = 16,384. One cast of n
# elements tops at 9n (fp32 scaled 4n + fp32 clamped 4n + float8 n).
# Forward: cast X (9·8,192 + 4 = 73,732), cast W beside float8 X and its scale (8,192 + 4 + 9·32,768 + 4 =
# 303,112), the GEMM's output beside both float8 copies (8,192 + 32,768 + 8 + 2·16,384 = 73,736): 303,112.
# Backward: cast dY (9·16,384 + 4 = 147,460), cast W beside float8 dY (16,384 + 4 + 294,912 + 4 = 311,304),
# dX (16,388 + 32,772 + 2·8,192 = 65,544), dY again (65,544 + 147,460 = 213,004), X (65,544 + 16,388 +
# 73,732 = 155,664), dW (65,544 + 16,388 + 8,196 + 2·32,768 = 155,664): 311,304.
# Rowwise: scales per row: forward X by token (4·64 = 256), W by output (4·256 = 1,024): 8,192 + 256 +
# 294,912 + 1,024 = 304,384; backward dY by token (256), W by input (4·128 = 512): 16,384 + 256 + 294,912 +
# 512 = 312,064.
HAND = {Fp8Recipe.TENSORWISE: (303_112, 311_304), Fp8Recipe.ROWWISE: (304_384, 312_064)}


@pytest.mark.parametrize("recipe", [Fp8Recipe.TENSORWISE, Fp8Recipe.ROWWISE], ids=str)
def test_one_linear_casts_are_the_hand_derived_sequence(recipe: Fp8Recipe) -> None:
    measured = _linear_peaks(recipe)
    assert measured == HAND[recipe]
    setup = _setup(recipe, precision="bf16")
    assert (fp8.forward_transient(setup, T, IN, OUT), fp8.backward_transient(setup, T, IN, OUT)) == measured


@pytest.mark.parametrize("recipe", [Fp8Recipe.TENSORWISE, Fp8Recipe.ROWWISE], ids=str)
def test_saved_tensors_under_fp8_equal_the_estimate(recipe: Fp8Recipe) -> None:
    setup = _setup(recipe)
    est = estimate(setup)
    out = comparison_json(est, measure(setup, fake=True))
    assert out["diff"]["equal"]
    # torchao saves the bf16 input and the weight's view: the same bytes as bf16 training.
    bf16 = estimate(_setup(Fp8Recipe.NONE))
    assert est.activations == bf16.activations == out["measured"]["memory"]["activations"]


@pytest.mark.parametrize(
    ("recipe", "batch", "seq"),
    [
        # 128 tokens: the down projection's backward casts its [T, f] input: the peak.
        (Fp8Recipe.TENSORWISE, 2, 64),
        (Fp8Recipe.ROWWISE, 2, 64),
        # 16 tokens: the weight casts dominate; W_gate's backward, W_down's and W_up's gradients made.
        (Fp8Recipe.TENSORWISE, 1, 16),
    ],
    ids=str,
)
def test_peak_with_fp8_casts_equals_the_measured_step(recipe: Fp8Recipe, batch: int, seq: int) -> None:
    setup = _setup(recipe, precision="fp32", micro_batch=batch, seq_len=seq)
    est = estimate(setup)
    assert est.peak.phase == "layer backward"
    measured = profile(setup, steps=1)
    assert measured.phase_peaks["backward"] == est.peak.phases["layer backward"]
    assert measured.peak == est.peak.bytes
    # The casts raise the peak above bf16 training's (the same step without --fp8).
    plain = _setup(Fp8Recipe.NONE, precision="fp32", micro_batch=batch, seq_len=seq)
    assert est.peak.bytes > estimate(plain).peak.bytes


def test_no_amax_history_in_torchao() -> None:
    """Delayed scaling (an amax history buffer per tensor) is gone: only dynamic or disabled scaling."""
    float8 = require_torchao()
    assert {t.name for t in float8.config.ScalingType} == {"DYNAMIC", "DISABLED"}


@pytest.mark.parametrize("impl", [Impl.REFERENCE, Impl.TORCHTITAN], ids=str)
@pytest.mark.parametrize("recipe", [Fp8Recipe.TENSORWISE, Fp8Recipe.ROWWISE], ids=str)
def test_compiled_float8_block_keeps_the_float8_weights(recipe: Fp8Recipe, impl: Impl) -> None:
    """``--compile --fp8`` (``fp8.compiled_rules``): the min-cut partitioner keeps each linear's float8
    weight cast for backward (pytorch/pytorch#141881), transposed, one byte per parameter of the layer's
    linears, and the float8 cast of W_O's input, each with its scale, and recomputes the two normalised
    inputs and SwiGLU's product. The block's saves equal the estimate's layer, and by hand, against the
    compiled bf16 block (T = 48 tokens: no activation has a weight's shape; h 64, a·d 64, kv·d 32, f 160):
    + 1 B × (2·64·64 + 2·64·32 + 3·64·160) weights + 1 B × 48·64 of W_O's input − 2 B × (2·48·64 + 48·160)
    recomputed + the scales (tensorwise: 4 B a cast, one per linear and W_O's input; rowwise: one bf16
    amax per row of each weight's [in, out] copy and per column of W_O's input)."""
    from memplan.blocks.inventory import Scope
    from memplan.blocks.profiles import compile_note
    from memplan.measure.frameworks.titan import compiled_block_records as titan_records
    from memplan.measure.runs.compiled import compiled_block_records

    base = _setup(recipe, micro_batch=1, seq_len=48)
    setup = base.model_copy(update={"impl": base.impl.model_copy(update={"compile": True, "impl": impl})})
    bf16 = setup.model_copy(update={"impl": setup.impl.model_copy(update={"fp8": Fp8Recipe.NONE})})
    assert compile_note(setup) is None
    measure = titan_records if impl is Impl.TORCHTITAN else compiled_block_records
    measured = sum(r.bytes for r in measure(setup))

    def layer(s: Setup) -> int:
        return sum(k.bytes for k in estimate(s).tensors if k.scope is Scope.LAYER)

    assert layer(setup) == measured
    weights = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 160  # 43,008 (torchtitan's fused W_QKV: the same)
    linears = 5 if impl is Impl.TORCHTITAN else 7
    ins = 64 * 4 + 160 if impl is Impl.TORCHTITAN else 64 * 6 + 160  # each weight's in_features
    scales = 4 * (linears + 1) if recipe is Fp8Recipe.TENSORWISE else 2 * (ins + 64)
    assert layer(setup) - layer(bf16) == weights + 48 * 64 - 2 * (2 * 48 * 64 + 48 * 160) + scales


def test_compiled_float8_stays_a_note_where_it_was_not_traced() -> None:
    """Over tensor-parallel ranks and with FSDP2's float8 all-gather the compiled float8 block is not traced:
    the note says the memory is the eager code's."""
    from memplan.blocks.profiles import compile_note

    base = _setup(Fp8Recipe.TENSORWISE, micro_batch=1, seq_len=48)
    impl = base.impl.model_copy(update={"compile": True, "impl": Impl.TORCHTITAN})
    titan = base.model_copy(update={"impl": impl})
    tp = titan.model_copy(update={"parallel": titan.parallel.model_copy(update={"tp": 2})})
    note = compile_note(tp)
    assert note is not None and "141881" in note and "underestimate" in note


def test_compiled_float8_block_under_full_ac_keeps_its_input_alone() -> None:
    """Why ``--compile --fp8 --checkpointing full`` is exact (``blocks.profiles.compile_note``): torchtitan's
    FullAC block compiled as torchtitan compiles it — dynamo turns the checkpoint into its higher-order op,
    AOTAutograd's min-cut partitioner recomputes what it tags — keeps its input alone, float8 casts made
    again in backward (tensorwise, the recipe of the 2025 tables; rowwise the same by hand), beside the CPU
    generator's state (a host tensor the checkpoint keeps for the CPU flash op's re-run)."""
    from memplan.blocks.profiles import compile_note
    from memplan.measure.frameworks.titan import compiled_sac_block_records
    from tests.hf.harness import hf_setup

    base = hf_setup("tiny", layers=2, seq=64, impl=Impl.TORCHTITAN, checkpointing="full")
    setup = base.model_copy(
        update={"impl": base.impl.model_copy(update={"compile": True, "fp8": Fp8Recipe.TENSORWISE})}
    )
    note = compile_note(setup)
    assert note is not None and "keeps its input alone" in note and "underestimate" not in note
    records = compiled_sac_block_records(setup)
    state = [r for r in records if r.dtype == "uint8"]  # torch.get_rng_state(): one 1-D byte tensor
    assert len(state) == 1 and len(state[0].shape) == 1
    assert [(r.shape, r.dtype) for r in records if r not in state] == [
        ((1, 64, setup.model.hidden_size), "bf16")
    ]
