"""Parameter counts per component, from the architecture alone, composed from the blocks' own counts.

Layout (pre-norm decoder): token embedding [v, h]; learned positions [max_positions, h] when used;
per layer: attention norm, W_Q [h, a·d], W_K and W_V [h, kv·d], W_O [a·d, h] (+ biases), MLP norm,
MLP (SwiGLU: gate and up [h, f], down [f, h]; GELU: fc1 [h, f], fc2 [f, h], + biases); final norm;
lm head [h, v] unless tied to the embedding. Norm weights are h (RMSNorm) or 2h (LayerNorm: weight + bias).

A mixture of experts (``model.moe``) replaces each layer's MLP by a router h×E (no bias), E routed experts
(each an MLP of the model's kind and ``ffn_size``) and the shared experts with their optional gate h→1.
``total`` counts every expert; ``active`` the top-k a token is routed to plus everything else (router
included), which is what 6N counts (Jiang et al. 2024, Mixtral; Qwen1.5-MoE). DeepSeek's first
``moe.dense_layers`` layers keep a dense MLP of ``dense_ffn`` (``dense_layer``); multi-head latent
attention's projections are ``blocks.attention.mla.mla_params``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from memplan.blocks.attention.core import attention_params, qk_norm_params
from memplan.blocks.attention.mla import mla_params
from memplan.blocks.embedding import embedding_params
from memplan.blocks.head import lm_head_params
from memplan.blocks.mlp import mlp_params
from memplan.blocks.moe.params import MoELayerParams, moe_layer_params
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
    """One dense layer of a model mixing dense and MoE layers (``ModelConfig.is_moe_layer``: DeepSeek's
    first ``moe.dense_layers``, Llama 4 Maverick's layers between MoE ones), else None."""
    dense_at: tuple[bool, ...] = ()
    """Per layer, whether it is a dense one (``dense_layer``); () when every layer is ``layer``."""

    @property
    def dense_layers(self) -> int:
        """How many layers are dense ones; the other ``num_layers - dense_layers`` are ``layer``."""
        return sum(self.dense_at)

    def layers_from(self, first: int, end: int | None = None) -> int:
        """Parameters of layers ``first`` … ``end`` − 1 (default: the last), each of its own kind."""
        stop = self.num_layers if end is None else end
        dense = sum(self.dense_at[first:stop])
        own = self.layer.total * (max(stop - first, 0) - dense)
        return own + (self.dense_layer.total * dense if self.dense_layer else 0)

    @property
    def layers(self) -> int:
        dense = self.dense_layer.total * self.dense_layers if self.dense_layer else 0
        return self.layer.total * (self.num_layers - self.dense_layers) + dense

    @property
    def total(self) -> int:
        return self.embedding + self.positions + self.layers + self.final_norm + self.lm_head

    def layers_above(self, i: int, layers: int) -> int:
        """Parameters of layers i+1 … ``layers`` − 1, each of its own kind (dense or MoE)."""
        return self.layers_from(i + 1, layers)

    @property
    def active(self) -> int:
        """Parameters touched per token: all but the experts a token is not routed to (= total if dense)."""
        return self.total - (self.moe.inactive * (self.num_layers - self.dense_layers) if self.moe else 0)


def layer_params(m: ModelConfig) -> LayerParams:
    q, k, v, o = mla_params(m) if m.mla else attention_params(m)
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
    """A dense layer of a model mixing dense and MoE layers: no experts, the MLP ``dense_ffn_size`` wide
    between MoE layers (``moe_every``: Llama 4's ``Llama4TextMLP(config, intermediate_size_mlp)``), or
    ``moe.dense_ffn`` wide in DeepSeek's first ``moe.dense_layers``."""
    if m.moe_every is not None:
        return m.model_copy(
            update={"moe": None, "moe_every": None, "ffn_size": m.dense_ffn_size, "dense_ffn_size": None}
        )
    assert m.moe is not None and m.moe.dense_ffn is not None
    return m.model_copy(update={"moe": None, "ffn_size": m.moe.dense_ffn})


def count_params(m: ModelConfig) -> ParamCount:
    embedding, positions = embedding_params(m)
    dense_at = tuple(not m.is_moe_layer(i) for i in range(m.num_layers)) if m.moe else ()
    dense = any(dense_at)
    return ParamCount(
        dense_layer=layer_params(dense_layer_model(m)) if dense else None,
        dense_at=dense_at if dense else (),
        embedding=embedding,
        positions=positions,
        layer=layer_params(m),
        num_layers=m.num_layers,
        final_norm=norm_params(m),
        lm_head=lm_head_params(m),
        moe=moe_layer_params(m, m.moe) if m.moe else None,
    )
