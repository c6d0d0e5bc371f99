"""transformers' Phi-3 (``modeling_phi3.py``) against ``--impl hf``: fused qkv and gate_up, SDPA and eager,
with and without transformers' gradient checkpointing, at Phi-3-mini's widths (its published config.json
through the importer). Its sliding window (2047) is set below the sequence (128 < 256) in half the cases:
transformers then masks SDPA explicitly (a float mask per layer) and a checkpoint keeps the bool mask.

With ``use_cache=False`` no ``DynamicCache`` copies k and v: v reaches the core as a view of
``qkv_proj``'s slice and keeps the whole fused output alive (``attention.fused_v_is_view``), unless k and
v are repeated (GQA under eager, or SDPA with a window's mask) or eager's matmul copies the view (b > 1)."""

from __future__ import annotations

from typing import Any

import pytest

from memplan.engine import estimate
from memplan.presets.hf import model_from_hf_config
from tests.hf.harness import check_exact, check_hf, hf_setup
from tests.test_hf_config import PHI3_MINI


@pytest.mark.parametrize(
    ("attention", "checkpointing", "window"),
    [("flash", "none", 128), ("flash", "full", 128), ("eager", "none", 2047), ("eager", "full", 128)],
)
def test_phi3(attention: str, checkpointing: str, window: int) -> None:
    model = model_from_hf_config(PHI3_MINI, "phi-3-mini")
    setup = hf_setup(model, seq=256, attention=attention, checkpointing=checkpointing, sliding_window=window)
    check_hf(setup)


NO_CACHE: dict[str, dict[str, Any]] = {
    "sdpa": {},
    "eager": {"attention": "eager"},
    "sdpa-window": {"sliding_window": 128},
    "eager-batch-2": {"attention": "eager", "batch": 2},
    "sdpa-full": {"checkpointing": "full"},
    "eager-full-reentrant": {"attention": "eager", "checkpointing": "full", "reentrant": True},
    "gqa-sdpa": {"num_kv_heads": 8},
    "gqa-sdpa-window": {"num_kv_heads": 8, "sliding_window": 128},
    "gqa-eager": {"num_kv_heads": 8, "attention": "eager"},
    "mqa-sdpa-window": {"num_kv_heads": 1, "sliding_window": 128},
    "sdpa-dropout": {"attn_dropout": 0.1},
}


@pytest.mark.parametrize("case", NO_CACHE)
def test_phi3_without_cache(case: str) -> None:
    """``use_cache=False`` at Phi-3-mini's widths (GQA and MQA cases with kv heads cut): exact per layer,
    in total and FLOPs per phase against transformers' own run."""
    model = model_from_hf_config(PHI3_MINI, "phi-3-mini")
    check_exact(hf_setup(model, seq=256, use_cache=False, **NO_CACHE[case]))


def test_phi3_without_cache_keeps_the_fused_output() -> None:
    """Phi-3-mini, b = 1, s = 256, SDPA, bf16: v's view keeps qkv_proj's whole output
    [1, 256, (32 + 2·32)·96] = 256·9216·2 B = 4,718,592 B per layer where v alone was 256·3072·2 =
    1,572,864 B: 2·b·s·h·2 = 2·256·3072·2 = 3,145,728 B more per layer than the cached run's v copy."""
    model = model_from_hf_config(PHI3_MINI, "phi-3-mini")
    rows = {
        r.name: r.bytes
        for r in estimate(hf_setup(model, seq=256, use_cache=False)).tensors
        if r.name.startswith("attn.")
    }
    assert rows["attn.qkv"] == 256 * 9216 * 2 == 4_718_592
    assert "attn.v" not in rows
    cached = {
        r.name: r.bytes for r in estimate(hf_setup(model, seq=256)).tensors if r.name.startswith("attn.")
    }
    assert cached["attn.v"] == 256 * 3072 * 2 and "attn.qkv" not in cached
    assert rows["attn.qkv"] - cached["attn.v"] == 2 * 1 * 256 * 3072 * 2
