"""Model states per device: weights, gradients, master weights and optimizer states under ZeRO.

Rajbhandari et al. 2019 (ZeRO), §5: with mixed-precision Adam a model of Ψ parameters holds 2Ψ (16-bit
weights) + 2Ψ (16-bit gradients) + KΨ (K = 12: fp32 master, m, v). Per device over Nd data-parallel ranks:
  stage 0  (4 + K)Ψ          stage 1 (P_os)   4Ψ + KΨ/Nd
  stage 2  2Ψ + (2 + K)Ψ/Nd  stage 3 (P_os+g+p) (4 + K)Ψ/Nd
A sharded buffer is padded to a multiple of Nd (DeepSpeed pads the flat buffer), so a shard holds
ceil(Ψ / Nd) elements. Bytes per element come from the precision recipe and optimizer (config.py).
"""

from __future__ import annotations

from memplan.analytic.states import ModelStates, shard
from memplan.config import Optimizer, Precision, ZeroStage


def model_states(
    params: int,
    precision: Precision,
    optimizer: Optimizer,
    zero: ZeroStage,
    dp: int,
    per_shard: int | None = None,
    grad_bytes: int | None = None,
) -> ModelStates:
    """Per-device model states for ``params`` parameters (Ψ) replicated over ``dp`` data-parallel ranks;
    ``per_shard``: the elements of one shard where the sharding is not one flat buffer (FSDP2's per
    parameter dim-0 shards, ``blocks.torchtitan.fsdp2_shard_elements``); ``grad_bytes``: a gradient
    element's bytes where the framework keeps its own buffer (Megatron's fp32 ``main_grad``:
    ``blocks.megatron.main_grad_bytes``), else the recipe's."""

    def n(sharded: bool) -> int:
        return per_shard if sharded and per_shard is not None and dp > 1 else shard(params, dp, sharded)

    grad = precision.grad_bytes if grad_bytes is None else grad_bytes
    return ModelStates(
        weights=n(zero >= ZeroStage.PARAMETERS) * precision.weight_bytes,
        gradients=n(zero >= ZeroStage.GRADIENTS) * grad,
        master_weights=n(zero >= ZeroStage.OPTIMIZER) * precision.master_bytes,
        optimizer_states=n(zero >= ZeroStage.OPTIMIZER) * optimizer.state_bytes(precision),
    )
