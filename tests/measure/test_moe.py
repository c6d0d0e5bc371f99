"""Mixture of experts measured: the reference model's MoE blocks against ``estimate(setup)``.

Estimate == measurement exactly, per tensor name (count and bytes), per layer and per FLOP phase: real
tiny tensors over strategies and expert kinds, and fake tensors at Mixtral-8x7B's size (seq 4096).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memplan.blocks.moe.params import moe_layer_params
from memplan.config import (
    Attention,
    Device,
    ModelConfig,
    MoEConfig,
    Precision,
    Setup,
    StrategyConfig,
    TrainingConfig,
    parse_checkpointing,
)
from memplan.engine import Result, estimate
from memplan.measure.compare.tensors import Comparison, compare, comparison_json
from memplan.measure.reference.model import Layer, Reference
from memplan.measure.reference.moe import MoEMlp, expert_counts
from memplan.measure.runs.run import make_batch, measure, run_step
from memplan.presets import load_model_preset

from .test_random_shapes import small_setups

MIXTRAL_LIKE = MoEConfig(experts=4, top_k=2)
QWEN_LIKE = MoEConfig(experts=4, top_k=2, shared_experts=1, shared_ffn=40, shared_gate=True)
SHARED_NO_GATE = MoEConfig(experts=3, top_k=1, shared_experts=2)


def with_moe(setup: Setup, moe: MoEConfig) -> Setup:
    """``setup`` with every MLP a mixture of experts ``moe``."""
    return setup.model_copy(update={"model": setup.model.model_copy(update={"moe": moe})})


def estimate_for(setup: Setup, moe: MoEConfig) -> Result:
    return estimate(with_moe(setup, moe))


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny matmuls on one intra-op thread: on a loaded 2-core machine two OpenMP threads make each one
    take milliseconds (the experts' loop runs hundreds). Results do not depend on it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny(
    mlp: str = "swiglu",
    checkpointing: str = "none",
    attention: Attention = Attention.FLASH,
    precision: Precision = Precision.BF16_MIXED,
    dropout: float = 0.0,
    reversible: bool = False,
) -> Setup:
    ckpt, k = parse_checkpointing(checkpointing)
    model = ModelConfig(
        name="tiny-moe",
        hidden_size=32,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        ffn_size=48,
        vocab_size=96,
        mlp=mlp,
        max_positions=64,
        attn_dropout=0.0 if attention is Attention.FLASH else dropout,
        resid_dropout=dropout,
    )
    return Setup(
        model=model,
        training=TrainingConfig(micro_batch=2, seq_len=12, precision=precision),
        strategy=StrategyConfig(
            attention=attention, checkpointing=ckpt, checkpoint_every=k, reversible=reversible
        ),
        device=Device.CPU,
    )


def assert_equal(c: Comparison) -> None:
    wrong = [(r.name, r.est_count, r.est_bytes, r.meas_count, r.meas_bytes) for r in c.tensors if not r.equal]
    assert not wrong
    assert [(r.name, r.est_bytes) for r in c.flops] == [(r.name, r.meas_bytes) for r in c.flops]
    assert c.est_layers == c.meas_layers
    assert c.equal


CASES: list[tuple[dict[str, Any], MoEConfig]] = [
    ({}, MIXTRAL_LIKE),
    ({"checkpointing": "full", "attention": Attention.EAGER}, QWEN_LIKE),
    ({"mlp": "gelu", "checkpointing": "selective"}, SHARED_NO_GATE),
    ({"mlp": "gelu", "checkpointing": "every-2", "attention": Attention.EAGER, "dropout": 0.1}, MIXTRAL_LIKE),
    ({"checkpointing": "every-2", "precision": Precision.FP32}, QWEN_LIKE),
    ({"checkpointing": "full"}, SHARED_NO_GATE),
    ({"mlp": "gelu", "reversible": True, "precision": Precision.BF16}, QWEN_LIKE),
]


@pytest.mark.parametrize(("options", "moe"), CASES)
def test_estimate_equals_measurement(options: dict[str, Any], moe: MoEConfig) -> None:
    setup = tiny(**options)
    assert_equal(compare(estimate_for(setup, moe), measure(with_moe(setup, moe), fake=False)))


@pytest.mark.parametrize("moe", [MIXTRAL_LIKE, QWEN_LIKE])
def test_fake_run_equals_real_run(moe: MoEConfig) -> None:
    setup = tiny(checkpointing="selective")
    real, fake = measure(with_moe(setup, moe), fake=False), measure(with_moe(setup, moe), fake=True)
    assert real.by_name() == fake.by_name()
    assert real.flops == fake.flops


@st.composite
def moe_configs(draw: st.DrawFn) -> MoEConfig:
    experts = draw(st.integers(2, 6))
    shared = draw(st.integers(0, 2))
    return MoEConfig(
        experts=experts,
        top_k=draw(st.integers(1, experts)),
        shared_experts=shared,
        shared_ffn=draw(st.none() | st.integers(1, 40)) if shared else None,
        shared_gate=shared > 0 and draw(st.booleans()),
        norm_topk_prob=draw(st.none() | st.booleans()),
    )


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_setups(), moe_configs())
def test_estimate_equals_measurement_for_random_shapes(setup: Setup, moe: MoEConfig) -> None:
    """Random architectures and strategies (tests/measure/test_random_shapes.py) with random MoE layers."""
    assert_equal(compare(estimate_for(setup, moe), measure(with_moe(setup, moe), fake=False)))


def test_unbalanced_routing_keeps_every_total() -> None:
    """A zero router ties every expert, so top-k picks the first k for every token: the most skewed
    routing there is. Bytes and FLOPs are those of the balanced estimate all the same."""
    setup, moe = tiny(), MIXTRAL_LIKE
    torch.manual_seed(0)
    model = Reference(with_moe(setup, moe))
    blocks = [layer.mlp for layer in model.layers if isinstance(layer, Layer)]
    for block in blocks:
        assert isinstance(block, MoEMlp)
        torch.nn.init.zeros_(block.router.weight)
    _, chosen = blocks[0].route(torch.randn(24, 32, dtype=model.dtype))
    assert sorted(expert_counts(chosen.view(-1), moe.experts)) == [0, 0, 24, 24]  # 24 tokens, top-2
    assert_equal(compare(estimate_for(setup, moe), run_step(model, *make_batch(setup, "cpu"))))


def grads(setup: Setup, moe: MoEConfig) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Reference(with_moe(setup, moe))
    batch = make_batch(setup, "cpu")
    model(*batch).backward()
    return [p.grad for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("checkpointing", ["full", "selective", "every-2"])
def test_checkpointed_gradients_equal_plain(checkpointing: str) -> None:
    plain = grads(tiny(precision=Precision.FP32), QWEN_LIKE)
    checkpointed = grads(tiny(checkpointing=checkpointing, precision=Precision.FP32), QWEN_LIKE)
    assert len(plain) == len(checkpointed) > 0
    for a, b in zip(plain, checkpointed, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("mlp", ["swiglu", "gelu"])
def test_moe_layer_parameters_match_the_count(mlp: str) -> None:
    setup = tiny(mlp=mlp)
    block = Layer(with_moe(setup, QWEN_LIKE), torch.float32, torch.device("meta")).mlp
    p = moe_layer_params(setup.model, QWEN_LIKE)
    assert sum(t.numel() for t in block.parameters()) == p.dense() + QWEN_LIKE.experts * p.expert


def test_capacity_factor_is_refused() -> None:
    moe = MoEConfig(experts=4, top_k=2, capacity_factor=1.25)
    with pytest.raises(ValueError, match=r"^capacity_factor: "):
        measure(with_moe(tiny(), moe), fake=True)


def mixtral(layers: int, checkpointing: str, attention: Attention) -> tuple[Setup, MoEConfig]:
    pm = load_model_preset("mixtral-8x7b")
    assert pm.model.moe is not None
    ckpt, k = parse_checkpointing(checkpointing)
    setup = Setup(
        model=pm.model.model_copy(update={"num_layers": layers}),
        training=TrainingConfig(micro_batch=1, seq_len=4096),
        strategy=StrategyConfig(attention=attention, checkpointing=ckpt, checkpoint_every=k),
        device=Device.CPU,
    )
    return setup, pm.model.moe


def test_mixtral_8x7b_one_layer_seq_4096_fake() -> None:
    setup, moe = mixtral(1, "none", Attention.FLASH)
    est, meas = estimate_for(setup, moe), measure(with_moe(setup, moe), fake=True)
    assert_equal(compare(est, meas))
    # The MoE block beyond mlp.input, bf16 activations: T = 4096 tokens, S = T·k = 8192 slots, h = 4096,
    # f = 14336, E = 8, k = 2. [S, f] gate/act/up/down-input; [S, h] expert input, output, weighted
    # output; fp32 [T, E] router probs, [T, k] top-k weights, [T, 1] their sum; int64 [T, k] top-k
    # indices, [S] dispatch and weight indices; bf16 [S] routing weights.
    t, s, h, f, e, k = 4096, 8192, 4096, 14336, 8, 2
    moe_bytes = 4 * s * f * 2 + 3 * s * h * 2 + 4 * (t * e + t * k + t) + 8 * (t * k + 2 * s) + 2 * s
    assert moe_bytes == 1_141_243_904
    by_name = meas.by_name()
    assert sum(t.bytes for n, t in by_name.items() if n.startswith("moe.")) == moe_bytes
    assert meas.layer_bytes(0) == 1_494_122_496  # 1.39 GiB: attention, norms and mlp.input besides
    result = comparison_json(est, meas)
    assert result["diff"]["equal"] and result["estimated"]["moe"]["experts"] == 8


def test_mixtral_8x7b_two_layers_full_checkpointing_seq_4096_fake() -> None:
    setup, moe = mixtral(2, "full", Attention.EAGER)
    assert_equal(compare(estimate_for(setup, moe), measure(with_moe(setup, moe), fake=True)))
