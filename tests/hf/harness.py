"""Shared by the tests that run Hugging Face transformers' own models against ``--impl hf``: a setup with a
few layers at a family's real widths, measured under fake tensors on CPU, compared per layer and in total
(≤ 1 %, ``memplan.measure.impl_compare.TOLERANCE``); the exact bytes are in the failure message."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from memplan.api import build_setup
from memplan.config import AttentionChoice, Device, Impl, ImplConfig, ModelConfig, Setup
from memplan.engine import Result, estimate
from memplan.measure.compare import estimated_layers
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
    **fields: Any,
) -> Setup:
    """``model`` (a preset or a config) cut to ``layers`` layers (``fields`` replaced), CPU kernels."""
    m = load_model_preset(model).model if isinstance(model, str) else model
    m = ModelConfig.model_validate({**m.model_dump(), "num_layers": layers, **fields})
    impl = ImplConfig(impl=Impl.HF, reentrant=reentrant, use_cache=use_cache)
    return build_setup(
        m,
        seq=seq,
        batch=batch,
        attention=AttentionChoice(attention),
        checkpointing=checkpointing,
        device=Device.CPU,
        impl=impl,
    )


def check_hf(setup: Setup, fake: bool = True) -> tuple[Result, Measured]:
    """The estimate within 1 % of transformers' own run per layer and in total (``fake``: under fake
    tensors, else real ones); both returned for further checks."""
    est, meas = estimate(setup), measure_hf(setup, fake=fake)
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
