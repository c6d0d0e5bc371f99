"""The optimizer step's time: memory-bound kernels over the parameters a device owns, once per step, by
implementation (``time.optimizer``; issue #21).

AdamW under bf16-mixed (fp32 master weights, momentum and variance, 16-bit weights and gradients), bytes
per owned parameter, each kernel reading and writing whole tensors:
- memplan's reference optimizer (measure/reference/optim.py): ``grad.float()`` 2 + 4, ``w.mul_`` 4 + 4,
  ``m.lerp_(g)`` 4 + 4 + 4, ``v.mul_`` 4 + 4, ``v.addcmul_(g, g)`` 4 + 4 + 4 (g read once), ``v.sqrt()``
  4 + 4, ``.div_`` 4 + 4, ``.add_`` 4 + 4, ``w.addcdiv_(m, denom)`` 4 + 4 + 4 + 4, ``p.copy_(w)`` 4 + 2:
  6 + 8 + 12 + 8 + 12 + 8 + 8 + 8 + 16 + 6 = 92, in 10 kernels per tensor;
- torch's for-loop and foreach (torch/optim/adam.py): the same eight update kernels on the fp32 master
  with an fp32 gradient: 80;
- torch's fused kernel: reads param, grad, m, v (16), writes param, m, v (12): 28.
The parameter count is Hugging Face's own (``LlamaForCausalLM(config).num_parameters()``) for the
preset (LlamaConfig 4096 / 11008 / 32 layers / 32000, counted on the meta device), so nothing here
restates memplan's arithmetic.
"""

from __future__ import annotations

import pytest

from memplan.config import (
    Optimizer,
    OptimizerImpl,
    Precision,
    Setup,
    StrategyConfig,
    TrainingConfig,
    ZeroStage,
)
from memplan.engine import estimate
from memplan.presets import load_gpu, load_model_preset
from memplan.time import optimizer
from memplan.time.comm.rows import critical_stage
from memplan.time.compute import optimizer_seconds, optimizer_step_bytes
from memplan.time.predict import predict
from memplan.time.timing import peak_flops

LLAMA2_7B_PARAMS = 6_738_415_616  # LlamaForCausalLM(LlamaConfig(...)).num_parameters(), as above


def llama7b(
    zero: ZeroStage = ZeroStage.NONE,
    dp: int = 1,
    optimizer: Optimizer = Optimizer.ADAMW,
    impl: OptimizerImpl | None = None,
) -> Setup:
    return Setup(
        model=load_model_preset("llama-2-7b").model,
        training=TrainingConfig(
            seq_len=256, precision=Precision.BF16_MIXED, optimizer=optimizer, optimizer_impl=impl
        ),
        strategy=StrategyConfig(zero=zero, dp=dp),
    )


@pytest.mark.parametrize(
    ("impl", "per_param"),
    [
        (None, 92),
        (OptimizerImpl.REFERENCE, 92),
        (OptimizerImpl.FOR_LOOP, 80),
        (OptimizerImpl.FOREACH, 80),
        (OptimizerImpl.FUSED, 28),
    ],
)
def test_adamw_bytes_per_parameter_by_implementation(impl: OptimizerImpl | None, per_param: int) -> None:
    c = critical_stage(estimate(llama7b(impl=impl)))
    assert optimizer_step_bytes(c) == per_param * LLAMA2_7B_PARAMS


@pytest.mark.parametrize("zero", [ZeroStage.OPTIMIZER, ZeroStage.GRADIENTS, ZeroStage.PARAMETERS])
def test_zero_steps_only_the_owned_shard(zero: ZeroStage) -> None:
    owned = -(-LLAMA2_7B_PARAMS // 8)
    assert optimizer_step_bytes(critical_stage(estimate(llama7b(zero, 8)))) == 92 * owned


def test_reference_sgd_moves_its_four_kernels() -> None:
    # grad.float() 2 + 4, w.mul_ 4 + 4, w.add_(g) 4 + 4 + 4, p.copy_(w) 4 + 2
    sgd = critical_stage(estimate(llama7b(optimizer=Optimizer.SGD)))
    assert optimizer_step_bytes(sgd) == (6 + 8 + 12 + 6) * LLAMA2_7B_PARAMS


def test_bitsandbytes_is_one_pass() -> None:
    # AdamW8bit's kernel: the fp32 master read and written (8), m and v at 1 byte read and written (4), the
    # 16-bit gradient read (2), the 16-bit weight written (2)
    c = critical_stage(estimate(llama7b(optimizer=Optimizer.ADAMW_8BIT, impl=OptimizerImpl.BITSANDBYTES)))
    assert optimizer_step_bytes(c) == 16 * LLAMA2_7B_PARAMS


def test_reference_launches_ten_kernels_per_tensor_on_the_h200() -> None:
    """291 tensors (embed, head, 9 per layer × 32, the final norm), 10 kernels each: the 2,910 kernels of the
    traced step (docs/step-time.md, "Eager PyTorch on a measured H200"); at 0.80 × 4.8 TB/s and 1.1 µs a
    launch."""
    gpu = load_gpu("h200")
    c = critical_stage(estimate(llama7b()))
    assert optimizer.launch_kernels(c.setup, c.layers) == 10 * (2 + 9 * 32 + 1) == 2910
    seconds = 92 * LLAMA2_7B_PARAMS / (0.80 * 4800e9) + 2910 * 1.1e-6
    assert optimizer_seconds(c, gpu) == pytest.approx(seconds)
    assert optimizer_seconds(c, gpu) == pytest.approx(0.1646, abs=1e-4)


@pytest.mark.parametrize("impl", [OptimizerImpl.FOREACH, OptimizerImpl.FUSED])
def test_list_kernels_are_not_charged_launch_gaps(impl: OptimizerImpl) -> None:
    c = critical_stage(estimate(llama7b(impl=impl)))
    assert optimizer.launch_kernels(c.setup, c.layers) == 0


def test_the_step_time_includes_it_once() -> None:
    gpu = load_gpu("h100-sxm")
    p = estimate(llama7b())
    pr = predict(p, gpu, peak_flops(gpu, Precision.BF16_MIXED))
    assert pr.optimizer_s == pytest.approx(optimizer_seconds(critical_stage(p), gpu))
    assert pr.step_time_s == pytest.approx(
        pr.compute_s + sum(pr.exposed_s.values()) + pr.bubble_s + pr.optimizer_s
    )
