"""transformers' Gemma-2 (``modeling_gemma2.py``) against ``--impl hf`` at Gemma-2-9B's widths (its
config.json through the importer): four fp32-affine norms per layer, softcapped scores and logits, sliding
layers alternating with full ones. transformers runs Gemma-2 eager only (``_supports_sdpa = False``);
the window is set below the sequence (128 < 256), and checkpointed runs take 4 layers so that each of the
two masks is read by two layers (the measurement gives a storage read by one layer to that layer)."""

from __future__ import annotations

from typing import Any

import pytest

from memplan.analytic.params import count_params
from memplan.api import build_setup
from memplan.config import AttentionChoice, ImplConfig
from memplan.presets.hf import model_from_hf_config
from tests.hf.harness import check_hf, hf_setup

# huggingface.co/google/gemma-2-9b/blob/main/config.json
GEMMA2_9B: dict[str, Any] = {
    "architectures": ["Gemma2ForCausalLM"],
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_size": 3584,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "model_type": "gemma2",
    "num_attention_heads": 16,
    "num_hidden_layers": 42,
    "num_key_value_heads": 8,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "vocab_size": 256000,
}


def test_gemma2_parameters() -> None:
    """Four norms per layer: 9,241,705,984 (the model page's 9.24B; exact from the config's shapes)."""
    assert count_params(model_from_hf_config(GEMMA2_9B, "gemma-2-9b")).total == 9_241_705_984


@pytest.mark.parametrize(
    ("checkpointing", "reentrant", "layers"), [("none", False, 2), ("full", False, 4), ("full", True, 4)]
)
def test_gemma2_eager(checkpointing: str, reentrant: bool, layers: int) -> None:
    model = model_from_hf_config(GEMMA2_9B, "gemma-2-9b")
    setup = hf_setup(
        model,
        layers=layers,
        seq=256,
        attention="eager",
        checkpointing=checkpointing,
        reentrant=reentrant,
        sliding_window=128,
    )
    check_hf(setup)


@pytest.mark.parametrize(("impl", "attention"), [("reference", "eager"), ("hf", "flash")])
def test_gemma2_refused(impl: str, attention: str) -> None:
    """Gemma-2's structure is modelled for transformers' code only, and that code has no SDPA path."""
    model = model_from_hf_config(GEMMA2_9B, "gemma-2-9b")
    with pytest.raises(ValueError, match=r"post_norms|attention"):
        build_setup(model, seq=256, attention=AttentionChoice(attention), impl=ImplConfig(impl=impl))
