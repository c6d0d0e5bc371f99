"""Offload to the host: which model states and activations leave the device, and what the host holds.

- ``optimizer`` — ZeRO-Offload (Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training",
  §4.1, Fig. 2): the fp32 master weights and the optimizer states (KΨ, K = 12 for mixed-precision Adam)
  live on the host and the optimizer step runs on the CPU; the 16-bit weights (2Ψ) stay on the device, whose
  model states fall from 16Ψ to 2Ψ. The gradients leave the device as the backward makes them. The paper
  keeps them 16-bit on the host (2Ψ); DeepSpeed's implementation (``deepspeed/runtime/zero/
  stage_1_and_2.py``, ``async_inplace_copy_grad_to_fp32_buffer_from_gpu``) copies each reduced 16-bit
  gradient, upcast, into the fp32 ``.grad`` of the rank's fp32 partition on pinned host memory: 4 bytes
  per element of the partition. memplan models DeepSpeed: host gradients 4·⌈Ψ/Nd⌉ (ZeRO ≥ 1 partitions
  them like the optimizer states), and accumulation over micro-batches happens there.
- ``params`` — ZeRO-Infinity (Rajbhandari et al. 2021) / PyTorch FSDP2 ``CPUOffloadPolicy``: the ZeRO-3
  shards of the 16-bit weights live on the host and each unit (a layer, the embedding, the head) is
  gathered onto the device for its forward and its backward: the device's weights are that one gathered
  unit (``analytic.step.zero3_gather``). FSDP2 offloads the gradients and runs the step on the CPU too:
  that is ``--offload optimizer,params``.
- ``activations`` — ``torch.autograd.graph.save_on_cpu`` (torch 2.x, ``torch/autograd/graph.py``): its pack
  hook copies every tensor autograd saves to the host (``tensor.cpu()``, or a pinned ``torch.empty`` of the
  tensor's size + ``copy_`` with ``pin_memory=True``) and its unpack hook copies it back when the backward
  op that needs it runs. The device keeps no saved activation between forward and backward; the host holds
  the copies.

Known limitations (NB):
- the host's activation bytes are the storages autograd keeps, each counted once, plus the weights the
  forward saves (``saved_weight_bytes``, exact): a lower bound. save_on_cpu copies per save, not per
  storage — a tensor saved by three ops (the shared input of W_Q, W_K, W_V) is copied three times, the RoPE
  tables once per use in every layer (torchtune's ``OffloadActivations`` also copies per save, but skips
  parameters and tensors under 1 KiB). docs/offload.md gives the measured ratio.
- on the device the activation offload is modelled as one layer's saves brought back during its backward
  (an upper bound of save_on_cpu's per-op unpacking), and the head's during the loss backward.
- DeepSpeed's gradient buckets on the device, the host's optimizer-step temporaries (CPU Adam steps the
  fp32 partition in place, tile by tile) and the pinned-memory staging buffers are not counted.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from memplan.analytic.params import ParamCount
from memplan.analytic.states import ModelStates, shard
from memplan.config import LossKind, MlpType, ModelConfig, Offload, Setup, ZeroStage

HOST_GRADIENT_BYTES = 4
"""DeepSpeed's host gradient buffer: the fp32 ``.grad`` of the rank's fp32 partition (module docstring)."""


class HostMemory(BaseModel):
    """Bytes one device's offloaded tensors take in host memory."""

    model_config = ConfigDict(frozen=True)
    weights: int = 0
    gradients: int = 0
    optimizer: int = 0
    """Master weights and optimizer states."""
    activations: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.activations


def applies(setup: Setup) -> bool:
    return setup.offload is not Offload.NONE


def host_states(states: ModelStates, params: int, setup: Setup) -> HostMemory:
    """The model states ``states`` (one device's, of ``params`` parameters on that stage) that live on the
    host under ``setup.offload``."""
    o, s = setup.offload, setup.strategy
    optimizer = Offload.OPTIMIZER in o
    gradients = (
        shard(params, s.shard_group, s.zero >= ZeroStage.OPTIMIZER) * HOST_GRADIENT_BYTES if optimizer else 0
    )
    return HostMemory(
        weights=states.weights if Offload.PARAMS in o else 0,
        gradients=gradients,
        optimizer=states.optimizer if optimizer else 0,
    )


def device_states(states: ModelStates, setup: Setup) -> ModelStates:
    """What stays on the device: nothing the host holds (the gathered unit of offloaded weights is the
    peak's, ``analytic.step.zero3_gather``)."""
    o = setup.offload
    optimizer = Offload.OPTIMIZER in o
    return ModelStates(
        weights=0 if Offload.PARAMS in o else states.weights,
        gradients=0 if optimizer else states.gradients,
        master_weights=0 if optimizer else states.master_weights,
        optimizer_states=0 if optimizer else states.optimizer_states,
    )


def offloads_activations(setup: Setup) -> bool:
    return Offload.ACTIVATIONS in setup.offload


def linear_bias_params(m: ModelConfig) -> int:
    """One layer's linear biases: W_Q/W_K/W_V's (qkv_bias), W_O's (out_bias), the MLP's (mlp_bias)."""
    qkv = m.q_width + 2 * m.kv_width if m.qkv_bias else 0
    out = m.hidden_size if m.out_bias else 0
    mlp = (2 * m.ffn if m.mlp is MlpType.SWIGLU else m.ffn) + m.hidden_size if m.mlp_bias else 0
    return qkv + out + mlp


def saved_weight_bytes(stage: ParamCount, m: ModelConfig, setup: Setup, last: bool) -> int:
    """The parameters the forward saves for backward, each once, which ``save_on_cpu`` copies to the host
    like any saved tensor: every matmul's weight (dX = dY·Wᵀ) and every norm's weight (and LayerNorm's
    bias) — all of a stage's parameters but the embedding and position tables (a lookup saves the ids),
    the linear biases (their gradient is a sum) and, with the fused loss, the head's weight (Liger keeps
    only its gradients). The tied head reads the embedding's weight: saved once by the head.
    Measured (tests/measure/test_offload.py). ``m``: the rank's model. NB: an MoE's experts are counted as
    if every one ran."""
    head = stage.lm_head or (stage.embedding if last and m.tied_embeddings else 0)
    if setup.loss is LossKind.FUSED:
        head = 0
    weights = stage.layers - linear_bias_params(m) * stage.num_layers + stage.final_norm + head
    return weights * setup.training.precision.weight_bytes
