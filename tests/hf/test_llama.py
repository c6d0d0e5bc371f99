"""transformers' Llama-style families (``modeling_llama.py``, ``modeling_mistral.py``, ``modeling_qwen2.py``,
``modeling_qwen3.py``) against ``--impl hf``: SDPA and eager, without and with transformers' gradient
checkpointing (reentrant and not), at each family's real widths (2 layers); the cache off, attention
dropout (CPU: SDPA's math kernel, dropout noise), a sliding window shorter than the sequence, b = 2,
every-K checkpointing (transformers' every_n_layers).
Every case is exact to the byte per layer and in total, and the FLOPs per phase are equal."""

from __future__ import annotations

from typing import Any

import pytest

from tests.grids import pairwise_cases
from tests.hf.harness import CHECKPOINTING, check_exact, hf_setup

FAMILIES = ["llama-2-7b", "llama-3-8b", "mistral-7b", "qwen2.5-7b", "qwen3-8b"]


@pairwise_cases("preset, attention, how", FAMILIES, ["flash", "eager"], CHECKPOINTING)
def test_family(preset: str, attention: str, how: tuple[str, bool]) -> None:
    checkpointing, reentrant = how
    setup = hf_setup(preset, seq=256, attention=attention, checkpointing=checkpointing, reentrant=reentrant)
    check_exact(setup)


CASES: dict[str, dict[str, Any]] = {
    "no-cache": {"use_cache": False},
    "dropout-sdpa": {"attn_dropout": 0.1},
    "dropout-eager": {"attn_dropout": 0.1, "attention": "eager"},
    "window-sdpa": {"sliding_window": 128},
    "window-eager": {"sliding_window": 128, "attention": "eager"},
    "window-full": {"sliding_window": 256, "checkpointing": "full"},
    "batch-2-window-full": {"batch": 2, "sliding_window": 128, "checkpointing": "full"},
    "batch-2-eager-reentrant": {"batch": 2, "attention": "eager", "checkpointing": "full", "reentrant": True},
    # MQA: repeat_kv's expand + reshape is a view; torch.matmul copies it to a heads when b > 1.
    "mqa-window-sdpa": {"num_kv_heads": 1, "sliding_window": 128},
    "mqa-batch-2-eager": {"num_kv_heads": 1, "batch": 2, "attention": "eager"},
}


@pytest.mark.parametrize("case", CASES)
def test_switch(case: str) -> None:
    """One switch at a time at Mistral-7B's widths (its code has the sliding window)."""
    check_exact(hf_setup("mistral-7b", seq=256, **CASES[case]))


def test_qwen3_window_and_dropout() -> None:
    check_exact(hf_setup("qwen3-8b", seq=256, sliding_window=128, attn_dropout=0.1))


def test_every_k_is_every_n_layers() -> None:
    """transformers' every_n_layers: every K-th layer checkpointed alone, the others keep all they save."""
    check_exact(hf_setup("qwen2.5-7b", layers=4, seq=256, checkpointing="every-2"))
    check_exact(
        hf_setup("qwen3-8b", layers=3, seq=256, attention="eager", checkpointing="every-2", reentrant=True)
    )


def test_dropout_option_reaches_the_attention_only() -> None:
    """``--dropout`` sets residual and embedding dropout too; Llama's code has neither
    (``Profile.hidden_dropout``)."""
    check_exact(hf_setup("llama-3-8b", seq=256, attn_dropout=0.1, resid_dropout=0.1, embd_dropout=0.1))


def test_qk_norm_follows_the_family_code() -> None:
    with pytest.raises(ValueError, match="qk_norm: Qwen3's code"):
        hf_setup("qwen3-8b", qk_norm=False)
    with pytest.raises(ValueError, match="qk_norm: llama's code has no"):
        hf_setup("llama-3-8b", qk_norm=True)
