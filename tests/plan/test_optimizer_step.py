"""The optimizer step's time: a memory-bound kernel over the parameters a device owns, once per step.

AdamW under bf16-mixed (DeepSpeed / ZeRO's recipe, Rajbhandari et al. 2020 §3.1: fp32 master weights,
momentum and variance, 16-bit weights and gradients): per owned parameter it reads and writes the master
weight, m and v (2 × 12 bytes), reads the 16-bit gradient (2) and writes the 16-bit weight (2): 28 bytes.
The parameter count is Hugging Face's own (``LlamaForCausalLM(config).num_parameters()``) for the
preset (LlamaConfig 4096 / 11008 / 32 layers / 32000, counted on the meta device), so nothing here
restates memplan's arithmetic.
"""

from __future__ import annotations

import pytest

from memplan.config import Optimizer, Precision, Setup, StrategyConfig, TrainingConfig, ZeroStage
from memplan.engine import estimate
from memplan.presets import load_gpu, load_model_preset
from memplan.time.comm_rows import critical_stage
from memplan.time.compute import optimizer_seconds, optimizer_step_bytes
from memplan.time.predict import predict
from memplan.time.timing import peak_flops

LLAMA2_7B_PARAMS = 6_738_415_616  # LlamaForCausalLM(LlamaConfig(...)).num_parameters(), as above


def llama7b(zero: ZeroStage = ZeroStage.NONE, dp: int = 1, optimizer: Optimizer = Optimizer.ADAMW) -> Setup:
    return Setup(
        model=load_model_preset("llama-2-7b").model,
        training=TrainingConfig(seq_len=256, precision=Precision.BF16_MIXED, optimizer=optimizer),
        strategy=StrategyConfig(zero=zero, dp=dp),
    )


def test_adamw_moves_28_bytes_per_parameter() -> None:
    assert optimizer_step_bytes(critical_stage(estimate(llama7b()))) == 28 * LLAMA2_7B_PARAMS


@pytest.mark.parametrize("zero", [ZeroStage.OPTIMIZER, ZeroStage.GRADIENTS, ZeroStage.PARAMETERS])
def test_zero_steps_only_the_owned_shard(zero: ZeroStage) -> None:
    owned = -(-LLAMA2_7B_PARAMS // 8)
    assert optimizer_step_bytes(critical_stage(estimate(llama7b(zero, 8)))) == 28 * owned


def test_sgd_without_state_moves_the_master_weights_only() -> None:
    # read + write the fp32 master (8), read the gradient (2), write the weight (2)
    sgd = critical_stage(estimate(llama7b(optimizer=Optimizer.SGD)))
    assert optimizer_step_bytes(sgd) == 12 * LLAMA2_7B_PARAMS


def test_the_step_time_includes_it_once() -> None:
    gpu = load_gpu("h100-sxm")
    p = estimate(llama7b())
    pr = predict(p, gpu, peak_flops(gpu, Precision.BF16_MIXED))
    assert pr.optimizer_s == pytest.approx(optimizer_seconds(critical_stage(p), gpu))
    assert pr.step_time_s == pytest.approx(
        pr.compute_s + sum(pr.exposed_s.values()) + pr.bubble_s + pr.optimizer_s
    )
