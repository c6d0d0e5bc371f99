"""transformers' Gemma (``modeling_gemma.py``) against ``--impl hf``: SDPA and eager, with and without
transformers' gradient checkpointing (reentrant and not), at Gemma-2B's widths (MQA: kv = 1, head_dim 256)
and Gemma-7B's (MHA). Both read from the published config.json through the importer: GeGLU, the √h
embedding scale, the fp32 (1 + w) RMSNorm."""

from __future__ import annotations

from typing import Any

import pytest

from memplan.presets.hf import model_from_hf_config
from tests.hf.harness import check_hf, hf_setup
from tests.test_hf_config import GEMMA_2B

# huggingface.co/google/gemma-7b/blob/main/config.json (the keys that differ from gemma-2b's)
GEMMA_7B: dict[str, Any] = GEMMA_2B | {
    "hidden_size": 3072,
    "intermediate_size": 24576,
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 16,
}


@pytest.mark.parametrize(
    ("config", "attention", "checkpointing", "reentrant"),
    [
        (GEMMA_2B, "flash", "none", False),
        (GEMMA_2B, "eager", "full", True),
        (GEMMA_7B, "eager", "none", False),
        (GEMMA_7B, "flash", "full", False),
    ],
)
def test_gemma(config: dict[str, Any], attention: str, checkpointing: str, reentrant: bool) -> None:
    model = model_from_hf_config(config, "gemma")
    check_hf(hf_setup(model, seq=256, attention=attention, checkpointing=checkpointing, reentrant=reentrant))
