"""Parameter counts per component, from the architecture alone.

Layout (pre-norm decoder): token embedding [v, h]; learned positions [max_positions, h] when used;
per layer: attention norm, W_Q [h, a·d], W_K and W_V [h, kv·d], W_O [a·d, h] (+ biases), MLP norm,
MLP (SwiGLU: gate and up [h, f], down [f, h]; GELU: fc1 [h, f], fc2 [f, h], + biases); final norm;
lm head [h, v] unless tied to the embedding. Norm weights are h (RMSNorm) or 2h (LayerNorm: weight + bias).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from memplan.config import MlpType, ModelConfig, NormType, PositionType


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


class ParamCount(BaseModel):
    model_config = ConfigDict(frozen=True)
    embedding: int
    positions: int
    layer: LayerParams
    num_layers: int
    final_norm: int
    lm_head: int

    @property
    def layers(self) -> int:
        return self.layer.total * self.num_layers

    @property
    def total(self) -> int:
        return self.embedding + self.positions + self.layers + self.final_norm + self.lm_head

    @property
    def active(self) -> int:
        """Parameters touched per token; equal to total for dense models."""
        return self.total


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


def layer_params(m: ModelConfig) -> LayerParams:
    h = m.hidden_size
    return LayerParams(
        attn_norm=norm_params(m),
        q_proj=linear_params(h, m.q_width, m.qkv_bias),
        k_proj=linear_params(h, m.kv_width, m.qkv_bias),
        v_proj=linear_params(h, m.kv_width, m.qkv_bias),
        o_proj=linear_params(m.q_width, h, m.out_bias),
        mlp_norm=norm_params(m),
        mlp=mlp_params(m),
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
    )
