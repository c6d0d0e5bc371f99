"""The reversible stack's hand-written backward equals autograd through the same coupling."""

from __future__ import annotations

import pytest
import torch

from memplan.config import Attention, Device, ModelConfig, Precision, Setup, StrategyConfig, TrainingConfig
from memplan.measure.reference.model import Consts, Layer, Reference
from memplan.measure.runs.run import make_batch


def naive_reversible(model: Reference, x: torch.Tensor, c: Consts) -> torch.Tensor:
    """y1 = x1 + F(x2), y2 = x2 + G(y1), with autograd keeping everything."""
    x1, x2 = x, x
    for layer in model.layers:
        assert isinstance(layer, Layer)
        y1 = x1 + model.attention(layer, x2, c)
        y2 = x2 + model.mlp(layer, y1)
        x1, x2 = y1, y2
    return (x1 + x2) * 0.5


def grads(model: Reference, batch: tuple[torch.Tensor, torch.Tensor]) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the same dropout masks in both runs
    model(*batch).backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("attention", [Attention.EAGER, Attention.FLASH])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_reversible_gradients_match_autograd(attention: Attention, dropout: float) -> None:
    attn_dropout = 0.0 if attention is Attention.FLASH else dropout  # no dropout in the CPU flash kernel
    model_cfg = ModelConfig(
        hidden_size=32,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        ffn_size=48,
        vocab_size=64,
        attn_dropout=attn_dropout,
        resid_dropout=dropout,
    )
    setup = Setup(
        model=model_cfg,
        training=TrainingConfig(micro_batch=2, seq_len=8, precision=Precision.FP32),
        strategy=StrategyConfig(attention=attention, reversible=True),
        device=Device.CPU,
    )
    torch.manual_seed(0)
    model = Reference(setup)
    batch = make_batch(setup, "cpu")
    reversible = grads(model, batch)
    model.run_layers = lambda x, c: naive_reversible(model, x, c)  # type: ignore[method-assign]
    plain = grads(model, batch)
    assert len(reversible) == len(plain) == len(list(model.parameters()))
    for r, p in zip(reversible, plain, strict=True):
        torch.testing.assert_close(r, p, rtol=1e-4, atol=1e-6)
