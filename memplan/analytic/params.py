"""Parameter counts per component, from the architecture alone, composed from the blocks' own counts.

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

from memplan.blocks.attention import attention_params, qk_norm_params
from memplan.blocks.embedding import embedding_params
from memplan.blocks.head import lm_head_params
from memplan.blocks.mlp import mlp_params
from memplan.blocks.moe import MoELayerParams, moe_layer_params
from memplan.blocks.norm import norm_params
from memplan.config import ModelConfig


class LayerParams(BaseModel):
    model_config = ConfigDict(frozen=True)
    attn_norm: int
    q_proj: int
    k_proj: int
    v_proj: int
    o_proj: int
    mlp_norm: int
    mlp: int
    qk_norm: int = 0
    """q_norm and k_norm (``ModelConfig.qk_norm``): an RMSNorm weight [d] each, replicated like the norms."""
    post_norms: int = 0
    """The norms after attention and after the MLP (Gemma-2's ``post_norms``)."""
    sinks: int = 0
    """The attention sinks (``ModelConfig.attn_sinks``): one learned logit per head, a."""

    @property
    def attention(self) -> int:
        return self.q_proj + self.k_proj + self.v_proj + self.o_proj

    @property
    def total(self) -> int:
        norms = self.attn_norm + self.qk_norm + self.mlp_norm + self.post_norms
        return norms + self.attention + self.sinks + self.mlp


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
    dense_layer: LayerParams | None = None
    """A dense layer between MoE layers (``ModelConfig.moe_every``: Llama 4 Maverick's), else None."""
    dense_layers: int = 0
    """How many layers are dense ones (``dense_layer``); the other ``num_layers - dense_layers`` are
    ``layer``."""
    moe_every: int | None = None
    """With ``dense_layer``: layer i is an MoE one when (i + 1) % n == 0 (``ModelConfig.moe_every``)."""

    def layers_from(self, first: int) -> int:
        """Parameters of layers ``first`` … L − 1 (the layers above ``first − 1``)."""
        n = max(self.num_layers - first, 0)
        if self.dense_layer is None or self.moe_every is None:
            return self.layer.total * n
        moe = sum((i + 1) % self.moe_every == 0 for i in range(first, self.num_layers))
        return self.layer.total * moe + self.dense_layer.total * (n - moe)

    @property
    def layers(self) -> int:
        dense = self.dense_layer.total * self.dense_layers if self.dense_layer else 0
        return self.layer.total * (self.num_layers - self.dense_layers) + dense

    @property
    def total(self) -> int:
        return self.embedding + self.positions + self.layers + self.final_norm + self.lm_head

    @property
    def active(self) -> int:
        """Parameters touched per token: all but the experts a token is not routed to (= total if dense)."""
        moe_layers = self.num_layers - self.dense_layers
        return self.total - (self.moe.inactive * moe_layers if self.moe else 0)


def layer_params(m: ModelConfig) -> LayerParams:
    q, k, v, o = attention_params(m)
    return LayerParams(
        attn_norm=norm_params(m) if m.pre_norms else 0,
        q_proj=q,
        k_proj=k,
        v_proj=v,
        o_proj=o,
        mlp_norm=norm_params(m) if m.pre_norms and not m.shared_norm else 0,
        mlp=moe_layer_params(m, m.moe).total if m.moe else mlp_params(m),
        qk_norm=qk_norm_params(m),  # NB: Llama 4's weightless q/k norm (qk_l2_norm) has none
        post_norms=2 * norm_params(m) if m.post_norms else 0,
        sinks=m.num_heads if m.attn_sinks else 0,
    )


def dense_layer_model(m: ModelConfig) -> ModelConfig:
    """A dense layer of a model interleaving dense and MoE layers (``moe_every``): no experts, the MLP
    ``dense_ffn_size`` wide (Llama 4's ``Llama4TextMLP(config, intermediate_size_mlp)``)."""
    return m.model_copy(
        update={"moe": None, "moe_every": None, "ffn_size": m.dense_ffn_size, "dense_ffn_size": None}
    )


def count_params(m: ModelConfig) -> ParamCount:
    embedding, positions = embedding_params(m)
    dense = sum(not m.is_moe_layer(i) for i in range(m.num_layers)) if m.moe_every else 0
    return ParamCount(
        dense_layer=layer_params(dense_layer_model(m)) if dense else None,
        dense_layers=dense,
        moe_every=m.moe_every if dense else None,
        embedding=embedding,
        positions=positions,
        layer=layer_params(m),
        num_layers=m.num_layers,
        final_norm=norm_params(m),
        lm_head=lm_head_params(m),
        moe=moe_layer_params(m, m.moe) if m.moe else None,
    )
