"""transformers' GLM-4 (``modeling_glm.py``) against ``--impl hf``: Llama's code with a fused gate_up and
partial interleaved rotary (half of each head; the tables repeat_interleaved per layer, the rotated and
passed dims cat'ed: head-major q). Built from GLM-4-9B's config.json through the importer and cut to tiny
widths (transformers' own ``GlmConfig`` and code under fake tensors; the real vocabulary, which holds
GlmConfig's pad id): SDPA and eager, without and with gradient checkpointing (reentrant and not, every-K),
the cache on and off; exact per layer, in total and FLOPs per phase."""

from __future__ import annotations

from typing import Any

from memplan.analytic.params import count_params
from memplan.engine import estimate
from memplan.presets.hf import model_from_hf_config
from tests.hf.harness import check_exact, each_case, tiny_hf

# huggingface.co/THUDM/glm-4-9b-hf/blob/main/config.json (the keys memplan reads)
GLM4_9B: dict[str, Any] = {
    "architectures": ["GlmForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 13696,
    "max_position_embeddings": 131072,
    "model_type": "glm",
    "num_attention_heads": 32,
    "num_hidden_layers": 40,
    "num_key_value_heads": 2,
    "partial_rotary_factor": 0.5,
    "rms_norm_eps": 1.5625e-07,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "vocab_size": 151552,
}


def glm(**fields: Any) -> Any:
    return tiny_hf(GLM4_9B, "glm-4-9b", **({"vocab_size": GLM4_9B["vocab_size"]} | fields))


def test_glm_parameters() -> None:
    """GLM-4-9B, 9.4B on its model page: embedding and head 2·151552·4096; per layer W_Q 4096² + 4096
    (bias), W_K and W_V 4096·256 + 256 each (2 kv heads of 128), W_O 4096², gate_up and down
    3·4096·13696, two norms 2·4096; 40 layers and the final norm."""
    per_layer = 4096**2 + 4096 + 2 * (4096 * 256 + 256) + 4096**2 + 3 * 4096 * 13696 + 2 * 4096
    expected = 2 * 151552 * 4096 + 40 * per_layer + 4096
    assert count_params(model_from_hf_config(GLM4_9B, "g")).total == expected == 9_399_951_360


@each_case
def test_glm(attention: str, checkpointing: str, reentrant: bool, use_cache: bool) -> None:
    check_exact(
        glm(attention=attention, checkpointing=checkpointing, reentrant=reentrant, use_cache=use_cache)
    )


def test_glm_switches() -> None:
    check_exact(glm(layers=4, checkpointing="every-2"))
    check_exact(glm(attn_dropout=0.1))


def test_glm_rotary_by_hand() -> None:
    """Tiny GLM, b 1, s 256, bf16: each layer keeps its own repeat_interleaved cos and sin [256, 32] (half
    of d = 64): 2·256·32 B each, and no shared table; under full checkpointing the layers keep only their
    inputs and the checkpoint keeps the shared [256, 32] tables."""
    rows = {
        r.name: r.total_bytes for r in estimate(glm(layers=2)).tensors if "cos" in r.name or "sin" in r.name
    }
    assert rows == {"attn.rope_cos": 2 * 2 * 256 * 32, "attn.rope_sin": 2 * 2 * 256 * 32}
    full = estimate(glm(layers=2, checkpointing="full")).tensors
    rows = {r.name: r.total_bytes for r in full if "cos" in r.name or "sin" in r.name}
    assert rows == {"rope.cos": 2 * 256 * 32, "rope.sin": 2 * 256 * 32}
