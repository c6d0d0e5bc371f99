"""transformers' ``modeling_llama4.py`` (``Llama4ForCausalLM``, the text model of Scout and Maverick) against
``--impl hf``: sigmoid-scaled experts that every token runs through, a shared expert, dense layers between
MoE ones (Maverick), NoPE layers with temperature tuning, chunked attention and weightless q/k norms on the
RoPE layers. Small widths under fake tensors (SDPA and eager, checkpointing on and off, use_cache on and
off): every layer's bytes, the total and the FLOPs exact. The full-size imports are checked against
transformers' own count of the published configs."""

from __future__ import annotations

from typing import Any

import pytest

from memplan.analytic.params import count_params
from memplan.config import Family
from memplan.presets.hf import model_from_hf_config

# huggingface.co/meta-llama/Llama-4-Scout-17B-16E/blob/main/config.json, its text_config (the keys memplan
# reads; attn_temperature_tuning true where the early file wrote 4: transformers 5's config is strict)
_LLAMA4: dict[str, Any] = {
    "model_type": "llama4_text",
    "attention_bias": False,
    "attention_chunk_size": 8192,
    "attn_scale": 0.1,
    "attn_temperature_tuning": True,
    "floor_scale": 8192,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "intermediate_size": 8192,
    "intermediate_size_mlp": 16384,
    "no_rope_layers": [],
    "num_attention_heads": 40,
    "num_experts_per_tok": 1,
    "num_hidden_layers": 48,
    "num_key_value_heads": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "vocab_size": 202048,
}
SCOUT: dict[str, Any] = {
    **_LLAMA4,
    "interleave_moe_layer_step": 1,
    "max_position_embeddings": 10485760,
    "moe_layers": list(range(48)),
    "num_local_experts": 16,
    "rope_scaling": {
        "factor": 16.0,
        "high_freq_factor": 1.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "use_qk_norm": True,
}
# huggingface.co/meta-llama/Llama-4-Maverick-17B-128E/blob/main/config.json, its text_config
MAVERICK: dict[str, Any] = {
    **_LLAMA4,
    "interleave_moe_layer_step": 2,
    "max_position_embeddings": 1048576,
    "moe_layers": list(range(1, 48, 2)),
    "num_local_experts": 128,
    "rope_scaling": None,
    "use_qk_norm": False,
}

# Attention per layer: q 5120·5120, k and v 5120·1024 each, o 5120·5120; two norms 2·5120.
_ATTN = 2 * 5120 * 5120 + 2 * 5120 * 1024 + 2 * 5120
_EXPERT = 3 * 5120 * 8192  # gate, up and down of one expert (and of the shared one)
_EMBED = 2 * 202048 * 5120 + 5120  # untied embedding and lm head, final norm


def test_scout_import_and_count() -> None:
    """Scout: 48 MoE layers of attention, router 5120·16, 16 experts and the shared one (17 · 3·5120·8192)
    = 62,924,800 + 81,920 + 2,139,095,040 = 2,202,101,760 each; the weightless q/k norm has none.
    48 · that + 2·202,048·5120 + 5120 = 107,769,861,120, transformers' count of the file (the page's
    109B counts the vision tower too).
    Active: less 15 of 16 experts per layer, 48·15·3·5120·8192 = 90,596,966,400: 17,172,894,720 (17B)."""
    m = model_from_hf_config(SCOUT, "llama-4-scout-17b-16e")
    layer = _ATTN + 5120 * 16 + 17 * _EXPERT
    assert layer == 2_202_101_760
    p = count_params(m)
    assert p.total == 48 * layer + _EMBED == 107_769_861_120
    assert p.active == p.total - 48 * 15 * _EXPERT == 17_172_894_720
    assert m.code_family is Family.LLAMA4 and m.moe is not None and m.moe.router_sigmoid
    assert (m.moe.experts, m.moe.top_k, m.moe.shared_experts, m.moe_every) == (16, 1, 1, None)
    assert (m.nope_every, m.attn_chunk, m.qk_l2_norm, m.attn_temperature) == (4, 8192, True, True)
    assert [i for i in range(48) if m.is_nope_layer(i)] == list(range(3, 48, 4))


def test_maverick_import_and_count() -> None:
    """Maverick: 24 dense layers (attention + 3·5120·16384) and 24 MoE layers (attention + router
    5120·128 + 129 · 3·5120·8192): 24·(_ATTN + 251,658,240) + 24·(_ATTN + 655,360 + 16,233,005,056) + the
    embeddings = 400,711,848,960, transformers' count (the page's 400B). Active: less 127 of 128 experts in
    each MoE layer, 24·127·3·5120·8192: 17,184,691,200 (17B)."""
    m = model_from_hf_config(MAVERICK, "llama-4-maverick-17b-128e")
    dense, moe = _ATTN + 3 * 5120 * 16384, _ATTN + 5120 * 128 + 129 * _EXPERT
    p = count_params(m)
    assert p.total == 24 * dense + 24 * moe + _EMBED == 400_711_848_960
    assert p.active == p.total - 24 * 127 * _EXPERT == 17_184_691_200
    assert (m.moe_every, m.dense_ffn_size, m.qk_l2_norm) == (2, 16384, False)
    assert [i for i in range(48) if m.is_moe_layer(i)] == list(range(1, 48, 2))


def test_multimodal_config_reads_its_text_config() -> None:
    """A ``llama4`` (multimodal) config.json is its ``text_config``'s text model."""
    doc = {"model_type": "llama4", "text_config": {k: v for k, v in SCOUT.items() if k != "model_type"}}
    assert count_params(model_from_hf_config(doc, "scout")).total == 107_769_861_120


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("moe_layers", [0, 2]),
        ("no_rope_layers", [0] * 48),
        ("layer_types", ["full_attention"] * 48),
        ("output_router_logits", True),
        ("attn_temperature_tuning", 4),
    ],
)
def test_unmodelled_keys_are_refused(key: str, value: Any) -> None:
    """A pattern other than the defaults, or the auxiliary loss: one line naming the key."""
    with pytest.raises(ValueError, match=f"^hf config x: {key}: "):
        model_from_hf_config({**SCOUT, key: value}, "x")
