"""transformers' Granite (``modeling_granite.py``) against ``--impl hf``: Llama's code with four multipliers
(embedding, attention scale, residual branches, logits), scalar multiplies that keep nothing. Built from
Granite-3.0-8B's config.json through the importer (its attention dropout 0.1 included) and cut to tiny
widths (transformers' own ``GraniteConfig`` and code under fake tensors): SDPA and eager, without and
with gradient checkpointing (reentrant and not), the cache on and off; exact per layer, in total and
FLOPs per phase."""

from __future__ import annotations

from typing import Any

from memplan.analytic.params import count_params
from memplan.presets.hf import hf_notes, model_from_hf_config
from tests.hf.harness import check_exact, each_case, tiny_hf

# huggingface.co/ibm-granite/granite-3.0-8b-base/blob/main/config.json (the keys memplan reads)
GRANITE_3_8B: dict[str, Any] = {
    "architectures": ["GraniteForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.1,
    "attention_multiplier": 0.0078125,
    "embedding_multiplier": 12.0,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 12800,
    "logits_scaling": 16.0,
    "max_position_embeddings": 4096,
    "mlp_bias": False,
    "model_type": "granite",
    "num_attention_heads": 32,
    "num_hidden_layers": 40,
    "num_key_value_heads": 8,
    "residual_multiplier": 0.22,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "vocab_size": 49155,
}


def granite(**fields: Any) -> Any:
    return tiny_hf(GRANITE_3_8B, "granite-3.0-8b", **fields)


def test_granite_parameters() -> None:
    """Granite-3.0-8B, 8.17B on its model page: tied embedding 49155·4096 = 201,338,880; per layer W_Q
    and W_O 2·4096², W_K and W_V 2·4096·1024 (8 kv heads of 128), MLP 3·4096·12800, two norms 2·4096;
    40 layers and the final norm."""
    per_layer = 2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 12800 + 2 * 4096
    expected = 49155 * 4096 + 40 * per_layer + 4096
    assert count_params(model_from_hf_config(GRANITE_3_8B, "g")).total == expected == 8_170_848_256


@each_case
def test_granite(attention: str, checkpointing: str, reentrant: bool, use_cache: bool) -> None:
    """With Granite's attention dropout 0.1 (CPU SDPA: the math kernel; eager: dropout noise)."""
    check_exact(
        granite(attention=attention, checkpointing=checkpointing, reentrant=reentrant, use_cache=use_cache)
    )


def test_granite_without_dropout() -> None:
    check_exact(granite(attn_dropout=0.0))
    check_exact(granite(attn_dropout=0.0, attention="eager", batch=2))


def test_granite_import() -> None:
    """The multipliers are read and named; the dropout and tied embedding are Granite's."""
    m = model_from_hf_config(GRANITE_3_8B, "g")
    assert (m.code_family.value, m.attn_dropout, m.tied_embeddings) == ("granite", 0.1, True)
    notes = hf_notes(GRANITE_3_8B)
    assert "embedding ×12, attention scale 0.0078125, residual branches ×0.22, logits ÷16" in notes
