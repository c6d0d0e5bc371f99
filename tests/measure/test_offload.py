"""Offload measured on a CPU with two labelled pools (measure/runs/offload.py: host and "device" are the same
RAM there, so each byte is attributed to the pool the real system holds it in).

- ZeRO-Offload: one real step with the fp32 master weights, optimizer states and fp32 gradient buffers in
  the host pool; the device pool keeps the 16-bit weights only — equal to the estimate, byte for byte.
- Activation offload under torch's own ``save_on_cpu``: nothing saved stays in the device pool; the
  weights the forward saves are copied once each, as estimated; the host pool holds at least the
  estimate (save_on_cpu copies per save — a tensor saved by three ops three times, docs/offload.md).
"""

from __future__ import annotations

import pytest
from layouts import GPT_LAYOUT

from memplan.config import Device, LossKind, ModelConfig, Offload, Setup, TrainingConfig
from memplan.engine import estimate
from memplan.measure.runs.offload import activation_offload, optimizer_offload
from memplan.strategies.offload import saved_weight_bytes

LLAMA = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "ffn_size": 48}
GPT = {**LLAMA, "num_kv_heads": 4, **GPT_LAYOUT, "max_positions": 64}


def setup_for(arch: dict[str, object], offload: Offload, precision: str, optimizer: str = "adamw") -> Setup:
    return Setup(
        model=ModelConfig(name="offload", vocab_size=96, **arch),  # type: ignore[arg-type]
        training=TrainingConfig(micro_batch=2, seq_len=12, precision=precision, optimizer=optimizer),
        device=Device.CPU,
        offload=offload,
    )


@pytest.mark.parametrize("optimizer", ["adamw", "sgd-momentum", "lion", "sgd"])
@pytest.mark.parametrize(("arch", "precision"), [(LLAMA, "bf16-mixed"), (GPT, "fp16-mixed")])
def test_zero_offload_pools_equal_the_estimate(
    arch: dict[str, object], precision: str, optimizer: str
) -> None:
    setup = setup_for(arch, Offload.OPTIMIZER, precision, optimizer)
    dev = estimate(setup).device
    for pools in optimizer_offload(setup):  # after the gradients moved, and after the step
        assert pools.device == dev.states.total == dev.states.weights
        assert pools.host == dev.host.total == dev.host.gradients + dev.host.optimizer


@pytest.mark.parametrize("loss", [LossKind.STANDARD, LossKind.FUSED])
@pytest.mark.parametrize(("arch", "precision"), [(LLAMA, "bf16-mixed"), (GPT, "fp32")])
def test_save_on_cpu_leaves_nothing_on_the_device(
    arch: dict[str, object], precision: str, loss: LossKind
) -> None:
    setup = setup_for(arch, Offload.ACTIVATIONS, precision).model_copy(update={"loss": loss})
    est = estimate(setup)
    pools = activation_offload(setup)
    assert pools.device == est.activations == 0
    # The weights the forward saves are copied once each: exact.
    copies = saved_weight_bytes(est.device.params, setup.model, setup, last=True)
    assert pools.host_weights == copies > 0
    assert pools.host >= est.device.host.activations > copies  # a lower bound (module docstring)
