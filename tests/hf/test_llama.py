"""transformers' Llama (``modeling_llama.py``) against ``--impl hf``: SDPA and eager, with and without
transformers' gradient checkpointing (reentrant and not), at Llama-2-7B's and Llama-3-8B's widths."""

from __future__ import annotations

import pytest

from tests.hf.harness import check_hf, hf_setup


@pytest.mark.parametrize("preset", ["llama-2-7b", "llama-3-8b"])
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_llama_sdpa(preset: str, checkpointing: str) -> None:
    check_hf(hf_setup(preset, checkpointing=checkpointing))
