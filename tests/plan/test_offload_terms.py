"""Offload's pieces by hand: which model states each ``--offload`` choice moves, one layer's linear biases,
and the weights the forward saves (which ``save_on_cpu`` copies to the host).

tests/measure/test_offload.py measures the saved weights under ``save_on_cpu`` (torch); tests/plan/
test_offload.py checks the ZeRO-Offload states of Llama-2-13B. This file pins the rest in the fast,
torch-free suite the mutation run uses (docs/mutation.md). A small model whose parameters are counted here:
h = 64, 4 heads of 16 (2 kv heads: k/v width 32), f = 160, v = 1000, 4 layers, RMSNorm (a weight [h]).
"""

from __future__ import annotations

from typing import Any

import pytest

from memplan.analytic.params import count_params
from memplan.config import LossKind, ModelConfig, Offload, Setup, StrategyConfig, TrainingConfig, ZeroStage
from memplan.strategies import offload as off
from memplan.strategies.zero import ModelStates

H, F, V, L, KV = 64, 160, 1000, 4, 32
STATES = ModelStates(weights=2, gradients=3, master_weights=5, optimizer_states=7)


def model(**kw: Any) -> ModelConfig:
    return ModelConfig(
        hidden_size=H,
        num_layers=L,
        num_heads=4,
        num_kv_heads=2,
        ffn_size=F,
        vocab_size=V,
        max_positions=64,
        **kw,
    )


def setup(m: ModelConfig | None = None, offload: Offload = Offload.NONE, **kw: Any) -> Setup:
    return Setup(
        model=m or model(), training=TrainingConfig(micro_batch=1, seq_len=64), offload=offload, **kw
    )


@pytest.mark.parametrize(
    ("offload", "host", "device"),
    [
        # Parameter offload alone: the 16-bit weights leave; gradients and optimizer stay on the device.
        (Offload.PARAMS, off.HostMemory(weights=2), ModelStates(**{**STATES.model_dump(), "weights": 0})),
        # Activation offload alone moves no model state.
        (Offload.ACTIVATIONS, off.HostMemory(), STATES),
    ],
)
def test_only_the_named_states_leave_the_device(
    offload: Offload, host: off.HostMemory, device: ModelStates
) -> None:
    s = setup(offload=offload, strategy=StrategyConfig(zero=ZeroStage.PARAMETERS))  # params need ZeRO-3
    assert off.host_states(STATES, 1000, s) == host
    assert off.device_states(STATES, s) == device


@pytest.mark.parametrize(
    ("flags", "biases"),
    [
        ({"qkv_bias": True}, H + 2 * KV),  # b_Q [h], b_K and b_V [kv·d]
        ({"out_bias": True}, H),  # b_O [h]
        ({"mlp_bias": True}, 2 * F + H),  # gate and up [f], down [h]
        ({"mlp_bias": True, "mlp": "gelu"}, F + H),  # up [f], down [h]
        ({"qkv_bias": True, "out_bias": True, "mlp_bias": True}, H + 2 * KV + H + 2 * F + H),
    ],
)
def test_linear_biases_of_one_layer(flags: dict[str, Any], biases: int) -> None:
    assert off.linear_bias_params(model(**flags)) == biases


# One layer's saved weights: two norm weights [h] and the seven matmul weights (h², 2·h·32, h², 3·h·f).
LAYER_WEIGHTS = 2 * H + 2 * H * H + 2 * H * KV + 3 * H * F


@pytest.mark.parametrize(
    ("tied", "last", "loss", "head"),
    [
        (False, True, LossKind.STANDARD, V * H),  # the head's weight [v, h]
        (True, True, LossKind.STANDARD, V * H),  # tied: the head saves the embedding's weight, once
        (True, False, LossKind.STANDARD, 0),  # an earlier stage's tied embedding: a lookup saves the ids
        (False, True, LossKind.FUSED, 0),  # Liger's fused loss keeps the head's gradient only
    ],
)
def test_the_forward_saves_every_weight_but_tables_and_biases(
    tied: bool, last: bool, loss: LossKind, head: int
) -> None:
    m = model(tied_embeddings=tied, qkv_bias=True, out_bias=True, mlp_bias=True)
    s = setup(m, loss=loss)
    saved = L * LAYER_WEIGHTS + H + head  # the layers, the final norm, the head
    assert off.saved_weight_bytes(count_params(m), m, s, last) == 2 * saved  # bf16 weights
