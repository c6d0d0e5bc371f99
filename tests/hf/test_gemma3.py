"""transformers' Gemma-3 text model (``modeling_gemma3.py``, ``Gemma3ForCausalLM``) against ``--impl hf``
at Gemma-3-4B's text widths, imported from a multimodal ``gemma3`` config's ``text_config``: Gemma-2's
layout without softcaps, per-head q/k norms and a rotary table pair per layer type. Four layers with
every 2nd one full (the published pattern is every 6th) so both layer types run and each table and mask
is read by two layers; the window is below the sequence (128) for eager and above it (512) for SDPA,
where transformers then needs no mask (a window ≤ seq on alternating layers is refused)."""

from __future__ import annotations

from typing import Any

import pytest

from memplan.analytic.params import count_params
from memplan.presets.hf import hf_notes, model_from_hf_config
from tests.hf.harness import check_hf, hf_setup

# huggingface.co/google/gemma-3-4b-pt/blob/main/config.json (the text model's keys)
GEMMA3_4B: dict[str, Any] = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "text_config": {
        "head_dim": 256,
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_attention_heads": 8,
        "num_hidden_layers": 34,
        "num_key_value_heads": 4,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
        "vocab_size": 262208,
    },
    "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model"},
}


def test_gemma3_import() -> None:
    """The text model, every 6th layer full (``Gemma3TextConfig``'s default pattern); its q/k norms add
    2·d parameters per layer."""
    m = model_from_hf_config(GEMMA3_4B, "gemma-3-4b")
    assert (m.num_heads, m.kv_heads, m.dim, m.sliding_window_pattern) == (8, 4, 256, 6)
    plain = m.model_copy(update={"qk_norm": False})
    assert count_params(m).total - count_params(plain).total == 2 * 256 * 34
    assert "text model only" in hf_notes(GEMMA3_4B)


@pytest.mark.parametrize(
    ("attention", "checkpointing", "reentrant", "window"),
    [
        ("flash", "none", False, 512),
        ("flash", "full", False, 512),
        ("eager", "none", False, 128),
        ("eager", "full", True, 128),
    ],
)
def test_gemma3(attention: str, checkpointing: str, reentrant: bool, window: int) -> None:
    model = model_from_hf_config(GEMMA3_4B, "gemma-3-4b")
    setup = hf_setup(
        model,
        layers=4,
        seq=256,
        attention=attention,
        checkpointing=checkpointing,
        reentrant=reentrant,
        sliding_window=window,
        sliding_window_pattern=2,
    )
    check_hf(setup)
