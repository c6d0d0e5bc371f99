"""Shared by the tests that run a framework's own models (transformers against ``--impl hf``, torchtitan
against ``--impl torchtitan``): a setup with a few layers at a family's real widths, measured under fake
tensors on CPU, compared per layer and in total (≤ 1 %, ``memplan.measure.impl_compare.TOLERANCE``); the
exact bytes are in the failure message."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from memplan.api import build_setup
from memplan.config import AttentionChoice, Device, Impl, ImplConfig, ModelConfig, Setup
from memplan.engine import Result, estimate
from memplan.measure.compare import estimated_layers
from memplan.measure.framework import check_traceable
from memplan.measure.hf import measure_hf
from memplan.measure.impl_compare import paired_tensors, within
from memplan.measure.run import Measured
from memplan.presets import load_model_preset


def hf_setup(
    model: str | ModelConfig,
    *,
    layers: int = 2,
    seq: int = 512,
    batch: int = 1,
    attention: str = "flash",
    checkpointing: str = "none",
    reentrant: bool = False,
    use_cache: bool = True,
    impl: Impl = Impl.HF,
    **fields: Any,
) -> Setup:
    """``model`` (a preset or a config) cut to ``layers`` layers (``fields`` replaced), CPU kernels."""
    m = load_model_preset(model).model if isinstance(model, str) else model
    m = ModelConfig.model_validate({**m.model_dump(), "num_layers": layers, **fields})
    return build_setup(
        m,
        seq=seq,
        batch=batch,
        attention=AttentionChoice(attention),
        checkpointing=checkpointing,
        device=Device.CPU,
        impl=ImplConfig(impl=impl, reentrant=reentrant, use_cache=use_cache),
    )


def check_hf(setup: Setup, fake: bool = True) -> tuple[Result, Measured]:
    """The estimate within 1 % of the framework's own run (``setup.impl``) per layer and in total
    (``fake``: under fake tensors, else real ones, transformers only); both returned for further checks."""
    measure = check_traceable(setup)
    meas = measure(setup) if fake else measure_hf(setup, fake=False)
    est = estimate(setup)
    est_layers = estimated_layers(est)
    meas_layers = [meas.layer_bytes(i) for i in range(setup.model.num_layers)]
    unpaired = [r["name"] for r in paired_tensors(est, meas) if r["delta_bytes"]]
    report = (
        f"layers est {est_layers} meas {meas_layers}; total est {est.activations:,} meas "
        f"{meas.activations:,}; unpaired {unpaired}"
    )
    for e, m in zip(est_layers, meas_layers, strict=True):
        assert within(e, m), report
    assert within(est.activations, meas.activations), report
    return est, meas
