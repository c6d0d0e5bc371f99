"""A mixture of experts' parameters, one MoE layer's (``blocks.moe`` keeps what it saves): the router, one
routed expert, the shared experts and their gate, split by who shards them — the dense part (ZeRO over dp)
and the routed experts (over the experts' data-parallel group)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from memplan.blocks.mlp import mlp_params
from memplan.config import ModelConfig, MoEConfig


class MoELayerParams(BaseModel):
    """One MoE layer's MLP parameters, split by who shards them: dense (ZeRO over dp) vs routed experts."""

    model_config = ConfigDict(frozen=True, defer_build=True)  # built on first use (start-up)
    router: int
    expert: int
    """One routed expert's MLP."""
    shared: int
    """All shared experts and their gate."""
    experts: int
    top_k: int

    def dense(self) -> int:
        return self.router + self.shared

    def local_experts(self, ep: int) -> int:
        """Routed-expert parameters on one expert-parallel rank (E/ep experts)."""
        return self.expert * (self.experts // ep)

    @property
    def total(self) -> int:
        return self.dense() + self.experts * self.expert

    @property
    def inactive(self) -> int:
        """Parameters of the experts a token is not routed to, E − k of them."""
        return (self.experts - self.top_k) * self.expert


def moe_layer_params(m: ModelConfig, moe: MoEConfig) -> MoELayerParams:
    """Router h×E (+ E with ``router_bias``), one routed expert (an MLP of the model's kind and ffn_size,
    + 2f + h with ``expert_bias``: gpt-oss's gate_up and down biases), shared experts and gate."""
    h = m.hidden_size
    width = moe.shared_width(m)
    shared = mlp_params(m.model_copy(update={"ffn_size": width})) if width else 0
    return MoELayerParams(
        router=h * moe.experts + (moe.experts if moe.router_bias else 0),
        expert=mlp_params(m) + (2 * m.ffn + h if moe.expert_bias else 0),
        shared=shared + (h if moe.shared_gate else 0),
        experts=moe.experts,
        top_k=moe.top_k,
    )
