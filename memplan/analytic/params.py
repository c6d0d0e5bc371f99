"""Parameter counts per component, from the architecture alone.

Layout (pre-norm decoder): token embedding [v, h]; learned positions [max_positions, h] when used;
per layer: attention norm, W_Q [h, a·d], W_K and W_V [h, kv·d], W_O [a·d, h] (+ biases), MLP norm,
MLP (SwiGLU: gate and up [h, f], down [f, h]; GELU: fc1 [h, f], fc2 [f, h], + biases); final norm;
lm head [h, v] unless tied to the embedding. Norm weights are h (RMSNorm) or 2h (LayerNorm: weight + bias).

A mixture of experts (``model.moe``) replaces each layer's MLP by a router h×E (no bias), E routed experts
(each an MLP of the model's kind and ``ffn_size``) and the shared experts with their optional gate h→1.
``total`` counts every expert; ``active`` the top-k a token is routed to plus everything else (router
included), which is what 6N counts (Jiang et al. 2024, Mixtral; Qwen1.5-MoE).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from memplan.config import MlpType, ModelConfig, MoEConfig, NormType, PositionType


class LayerParams(BaseModel):
    model_config = ConfigDict(frozen=True)
    attn_norm: int
    q_proj: int
    k_proj: int
    v_proj: int
    o_proj: int
    mlp_norm: int
    mlp: int

    @property
    def attention(self) -> int:
        return self.q_proj + self.k_proj + self.v_proj + self.o_proj

    @property
    def total(self) -> int:
        return self.attn_norm + self.attention + self.mlp_norm + self.mlp


class MoELayerParams(BaseModel):
    """One MoE layer's MLP parameters, split by who shards them: dense (ZeRO over dp) vs routed experts."""

    model_config = ConfigDict(frozen=True)
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


class ParamCount(BaseModel):
    model_config = ConfigDict(frozen=True)
    embedding: int
    positions: int
    layer: LayerParams
    """One layer; an MoE layer's ``mlp`` is its router, every expert and the shared experts."""
    num_layers: int
    final_norm: int
    lm_head: int
    moe: MoELayerParams | None = None

    @property
    def layers(self) -> int:
        return self.layer.total * self.num_layers

    @property
    def total(self) -> int:
        return self.embedding + self.positions + self.layers + self.final_norm + self.lm_head

    @property
    def active(self) -> int:
        """Parameters touched per token: all but the experts a token is not routed to (= total if dense)."""
        return self.total - (self.moe.inactive * self.num_layers if self.moe else 0)


def norm_params(m: ModelConfig) -> int:
    """RMSNorm has a weight [h]; LayerNorm a weight and a bias [h] each."""
    return m.hidden_size * (2 if m.norm is NormType.LAYERNORM else 1)


def linear_params(fan_in: int, fan_out: int, bias: bool) -> int:
    return fan_in * fan_out + (fan_out if bias else 0)


def mlp_params(m: ModelConfig) -> int:
    h, f, b = m.hidden_size, m.ffn, m.mlp_bias
    up = linear_params(h, f, b)
    down = linear_params(f, h, b)
    return (2 * up if m.mlp is MlpType.SWIGLU else up) + down


def moe_layer_params(m: ModelConfig, moe: MoEConfig) -> MoELayerParams:
    """Router h×E, one routed expert (an MLP of the model's kind and ffn_size), shared experts and gate."""
    h = m.hidden_size
    width = moe.shared_width(m)
    shared = mlp_params(m.model_copy(update={"ffn_size": width})) if width else 0
    return MoELayerParams(
        router=h * moe.experts,
        expert=mlp_params(m),
        shared=shared + (h if moe.shared_gate else 0),
        experts=moe.experts,
        top_k=moe.top_k,
    )


def layer_params(m: ModelConfig) -> LayerParams:
    h = m.hidden_size
    return LayerParams(
        attn_norm=norm_params(m),
        q_proj=linear_params(h, m.q_width, m.qkv_bias),
        k_proj=linear_params(h, m.kv_width, m.qkv_bias),
        v_proj=linear_params(h, m.kv_width, m.qkv_bias),
        o_proj=linear_params(m.q_width, h, m.out_bias),
        mlp_norm=norm_params(m),
        mlp=moe_layer_params(m, m.moe).total if m.moe else mlp_params(m),
    )


def count_params(m: ModelConfig) -> ParamCount:
    h = m.hidden_size
    return ParamCount(
        embedding=m.vocab_size * h,
        positions=m.max_positions * h if m.position is PositionType.LEARNED else 0,
        layer=layer_params(m),
        num_layers=m.num_layers,
        final_norm=norm_params(m),
        lm_head=0 if m.tied_embeddings else h * m.vocab_size,
        moe=moe_layer_params(m, m.moe) if m.moe else None,
    )
