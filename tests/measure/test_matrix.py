"""Result == measurement, exactly, across the strategy matrix (real CPU tensors, tiny shapes).

Every option of every axis and every pair of options of any two axes is covered by an all-pairs design
(the full product is 3072 runs). Constraints, each a real restriction of the reference model:
- reversible layers take no checkpointing (config rejects the pair: they already recompute every layer);
- flash attention runs without attention-probability dropout on CPU (the CPU flash kernel has none), so
  the "dropout on" option of a flash row sets residual and embedding dropout only.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from memplan.config import (
    Attention,
    Device,
    ModelConfig,
    Setup,
    StrategyConfig,
    TrainingConfig,
    parse_checkpointing,
)
from memplan.engine import estimate
from memplan.measure.compare.tensors import compare
from memplan.measure.runs.run import measure
from tests.grids import pairwise

AXES: dict[str, list[Any]] = {
    "attention": ["eager", "flash"],
    "checkpointing": ["none", "full", "selective", "every-2"],
    "reversible": [False, True],
    "dropout": [False, True],
    "norm": ["rmsnorm", "layernorm"],
    "mlp": ["swiglu", "gelu"],
    "heads": ["mha", "gqa", "mqa"],
    "tied": [False, True],
    "precision": ["fp32", "bf16-mixed", "fp16-mixed", "bf16"],
}


def allowed(case: dict[str, Any]) -> bool:
    return not (case.get("reversible") and case.get("checkpointing", "none") != "none")


def all_pairs() -> list[dict[str, Any]]:
    """The allowed cases covering every allowed pair of two axes' values (``tests.grids.pairwise``)."""
    names = list(AXES)
    cases = pairwise(*AXES.values(), allowed=lambda c: allowed(dict(zip(names, c, strict=True))))
    return [dict(zip(names, c, strict=True)) for c in cases]


def setup_for(case: dict[str, Any]) -> Setup:
    heads, kv = 4, {"mha": 4, "gqa": 2, "mqa": 1}[case["heads"]]
    p = 0.1 if case["dropout"] else 0.0
    flash = case["attention"] == "flash"
    gpt = case["norm"] == "layernorm"
    model = ModelConfig(
        name="matrix",
        hidden_size=32,
        num_layers=3,
        num_heads=heads,
        num_kv_heads=kv,
        ffn_size=48,
        vocab_size=96,
        tied_embeddings=case["tied"],
        norm=case["norm"],
        mlp=case["mlp"],
        qkv_bias=gpt,
        out_bias=gpt,
        mlp_bias=gpt,
        position="learned" if gpt else "rope",
        max_positions=64,
        attn_dropout=0.0 if flash else p,
        resid_dropout=p,
        embd_dropout=p,
    )
    ckpt, k = parse_checkpointing(case["checkpointing"])
    return Setup(
        model=model,
        training=TrainingConfig(micro_batch=2, seq_len=12, precision=case["precision"]),
        strategy=StrategyConfig(
            attention=Attention[case["attention"].upper()],
            checkpointing=ckpt,
            checkpoint_every=k,
            reversible=case["reversible"],
        ),
        device=Device.CPU,
    )


CASES = all_pairs()


def case_id(case: dict[str, Any]) -> str:
    return "-".join(str(v) if not isinstance(v, bool) else ("y" if v else "n") for v in case.values())


def test_design_covers_every_allowed_pair() -> None:
    names = list(AXES)
    for a, b in itertools.combinations(names, 2):
        for va, vb in itertools.product(AXES[a], AXES[b]):
            if allowed({a: va, b: vb}):
                assert any(c[a] == va and c[b] == vb for c in CASES), (a, va, b, vb)
    assert len(CASES) < 40


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_estimate_equals_measurement(case: dict[str, Any]) -> None:
    setup = setup_for(case)
    est = estimate(setup)
    c = compare(est, measure(setup, fake=False))
    wrong = [r for r in c.tensors if not r.equal]
    assert not wrong, [(r.name, r.est_count, r.est_bytes, r.meas_count, r.meas_bytes) for r in wrong]
    assert [(r.name, r.est_bytes) for r in c.flops] == [(r.name, r.meas_bytes) for r in c.flops]
    assert c.est_layers == c.meas_layers
    assert c.equal


@pytest.mark.parametrize("case", CASES[::4], ids=case_id)
def test_fake_run_equals_real_run(case: dict[str, Any]) -> None:
    setup = setup_for(case)
    real, fake = measure(setup, fake=False), measure(setup, fake=True)
    assert real.records == fake.records
    assert real.flops == fake.flops


@pytest.mark.parametrize("case", CASES[:6], ids=case_id)
def test_qk_norm_estimate_equals_measurement(case: dict[str, Any]) -> None:
    """Qwen3's q_norm / k_norm (``ModelConfig.qk_norm``) in the reference model: saves, FLOPs, parameters."""
    base = setup_for(case)
    setup = base.model_copy(update={"model": base.model.model_copy(update={"qk_norm": True})})
    est = estimate(setup)
    c = compare(est, measure(setup, fake=False))
    wrong = [r for r in c.tensors if not r.equal]
    assert not wrong, [(r.name, r.est_count, r.est_bytes, r.meas_count, r.meas_bytes) for r in wrong]
    assert c.est_layers == c.meas_layers and c.equal
    assert est.params.total - estimate(base).params.total == 2 * base.model.dim * base.model.num_layers
