"""The temporaries of the step's exactly modelled moments, by hand from the ops that run.

tests/measure/test_peak.py measures these moments to the byte on CPU (every storage alive); this file pins
their transients in the fast, torch-free suite too, so that the mutation run (docs/mutation.md), which only
runs fast tests, sees a changed factor. Expected values are derived from the ops, not read from the code:
T = b·s tokens, v the vocabulary, h the width; fp32 = 4 bytes.
"""

from __future__ import annotations

import pytest

from memplan.config import (
    Device,
    ModelConfig,
    Optimizer,
    Precision,
    Setup,
    StrategyConfig,
    TrainingConfig,
    ZeroStage,
)
from memplan.engine import estimate

B, S, H, V = 2, 64, 64, 1000
T = B * S
LOSS_SCALAR = 4  # the fp32 loss, alive through the backward


def setup(norm: str = "rmsnorm", precision: Precision = Precision.BF16_MIXED, **training: object) -> Setup:
    model = ModelConfig(
        hidden_size=H, num_layers=2, num_heads=4, ffn_size=160, vocab_size=V, norm=norm, max_positions=S
    )
    return Setup(
        model=model,
        training=TrainingConfig(micro_batch=B, seq_len=S, precision=precision, **training),
        device=Device.CPU,
    )


def transient(s: Setup, moment: str) -> int:
    return estimate(s).peak.moments[moment]["transient"]


@pytest.mark.parametrize("precision", [Precision.BF16_MIXED, Precision.FP32])
def test_loss_backward_holds_two_fp32_t_by_v_gradients(precision: Precision) -> None:
    # nll_loss's backward makes d(log-probs) [T, v] and log_softmax's backward d(logits) [T, v], both fp32
    # (the loss is computed in fp32 whatever the activations' dtype).
    assert transient(setup(precision=precision), "loss backward") == 2 * 4 * T * V + LOSS_SCALAR


@pytest.mark.parametrize(
    ("norm", "precision", "expected"),
    [
        # Llama's explicit RMSNorm in fp32: five [T, h] fp32 pieces at once (rstd's path, mean's expanded
        # gradient, pow's backward x, 2x, 2x·grad).
        ("rmsnorm", Precision.BF16_MIXED, 5 * 4 * T * H),
        ("rmsnorm", Precision.FP32, 5 * 4 * T * H),
        # native_layer_norm's backward: dY and dX [T, h] in the activations' dtype (bf16: 2 bytes).
        ("layernorm", Precision.BF16_MIXED, 2 * 2 * T * H),
        ("layernorm", Precision.FP32, 2 * 4 * T * H),
    ],
)
def test_final_norm_backward_transient(norm: str, precision: Precision, expected: int) -> None:
    assert transient(setup(norm, precision), "final norm backward") == expected + LOSS_SCALAR


# The optimizer step's temporaries for the largest tensor it steps, here the embedding [v, h] = 64,000
# elements (larger than any layer's: gate/up [160, 64] = 10,240): per element, the fp32 upcast of a 16-bit
# gradient (4) and Adam's fp32 denominator √v̂ + ε (4) or Lion's fp32 update (4); 8-bit Adam dequantises m
# and v and makes the denominator in fp32 (12), plus its fp32 absmax scalar (4 bytes once). SGD: none.
@pytest.mark.parametrize(
    ("precision", "optimizer", "per_element", "extra"),
    [
        (Precision.BF16_MIXED, Optimizer.ADAMW, 4 + 4, 0),
        (Precision.FP32, Optimizer.ADAMW, 4, 0),
        (Precision.BF16_MIXED, Optimizer.LION, 4 + 4, 0),
        (Precision.FP16_MIXED, Optimizer.ADAMW_8BIT, 4 + 12, 4),
        (Precision.FP32, Optimizer.ADAMW_8BIT, 12, 4),
        (Precision.FP32, Optimizer.SGD, 0, 0),
        # Pure bf16 (no master copy): the gradient stays bf16 (measure/reference/optim.py upcasts only for
        # the mixed
        # recipes and 8-bit Adam), Adam's denominator and Lion's update are bf16 like their states (2);
        # 8-bit Adam still upcasts it (4) and dequantises in fp32 (12). (bf16 AdamW is also measured:
        # tests/measure/test_peak.py test_one_ranks_step_transient_is_exact[bf16-adamw].)
        (Precision.BF16, Optimizer.ADAMW, 2, 0),
        (Precision.BF16, Optimizer.LION, 2, 0),
        (Precision.BF16, Optimizer.ADAMW_8BIT, 4 + 12, 4),
    ],
)
def test_optimizer_step_transient(
    precision: Precision, optimizer: Optimizer, per_element: int, extra: int
) -> None:
    s = setup(precision=precision, optimizer=optimizer)
    assert transient(s, "optimizer step") == V * H * per_element + extra


@pytest.mark.parametrize(("position", "largest"), [("learned", 4096 * H), ("rope", V * H)])
def test_the_step_follows_the_largest_tensor_learned_positions_included(position: str, largest: int) -> None:
    # A learned position table [max_positions, h] = [4096, 64] is a parameter the optimizer steps, larger
    # than the embedding [1000, 64]; rotary positions have no table, so the embedding is the largest.
    # bf16-mixed AdamW: fp32 gradient copy (4) + fp32 denominator (4) per element of that one tensor.
    model = ModelConfig(
        hidden_size=H,
        num_layers=2,
        num_heads=4,
        ffn_size=160,
        vocab_size=V,
        norm="layernorm",
        mlp="gelu",
        position=position,
        max_positions=4096,
    )
    s = Setup(model=model, training=TrainingConfig(micro_batch=B, seq_len=S), device=Device.CPU)
    assert transient(s, "optimizer step") == largest * (4 + 4)


@pytest.mark.parametrize(
    ("zero", "dp", "largest"),
    [
        (ZeroStage.NONE, 8, V * H),
        (ZeroStage.OPTIMIZER, 8, 125 * H),
        (ZeroStage.GRADIENTS, 8, 125 * H),
        (ZeroStage.OPTIMIZER, 2, 500 * H),
    ],
)
def test_zero_steps_one_ranks_shard_from_stage_one(zero: ZeroStage, dp: int, largest: int) -> None:
    # From ZeRO-1 on, a rank steps its shard of each parameter: FSDP2 cuts dim 0 into dp chunks, rank 0
    # holding ceil(rows / dp) rows. At dp 8: embedding [1000, 64] -> 125 rows of 64 = 8,000 elements (the
    # MLP's [160, 64] -> 20 rows, down [64, 160] -> 8 rows of 160: smaller); at dp 2, 500 rows.
    # ZeRO-0 steps whole tensors.
    s = setup().model_copy(update={"strategy": StrategyConfig(zero=zero, dp=dp)})
    assert transient(s, "optimizer step") == largest * (4 + 4)
