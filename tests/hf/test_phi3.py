"""transformers' Phi-3 (``modeling_phi3.py``) against ``--impl hf``: fused qkv and gate_up, SDPA and eager,
with and without transformers' gradient checkpointing, at Phi-3-mini's widths (its published config.json
through the importer). Its sliding window (2047) is set below the sequence (128 < 256) in half the cases:
transformers then masks SDPA explicitly (a float mask per layer) and a checkpoint keeps the bool mask."""

from __future__ import annotations

import pytest

from memplan.presets.hf import model_from_hf_config
from tests.hf.harness import check_hf, hf_setup
from tests.test_hf_config import PHI3_MINI


@pytest.mark.parametrize(
    ("attention", "checkpointing", "window"),
    [("flash", "none", 128), ("flash", "full", 128), ("eager", "none", 2047), ("eager", "full", 128)],
)
def test_phi3(attention: str, checkpointing: str, window: int) -> None:
    model = model_from_hf_config(PHI3_MINI, "phi-3-mini")
    setup = hf_setup(model, seq=256, attention=attention, checkpointing=checkpointing, sliding_window=window)
    check_hf(setup)
