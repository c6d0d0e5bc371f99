"""transformers' StableLM (``modeling_stablelm.py``) against ``--impl hf``: LayerNorm with bias, partial
rotary (the rotated quarter cat'ed to the rest: head-major q), q/k/v biases, the optional parallel layer
with one norm, dropout after the MLP only. Built from StableLM-2-1.6B's config.json through the importer
and cut to tiny widths (transformers' own ``StableLmConfig`` and code under fake tensors): SDPA and eager,
without and with gradient checkpointing (reentrant and not), the cache on and off; exact per layer, in
total and FLOPs per phase."""

from __future__ import annotations

from typing import Any

import pytest

from memplan.analytic.params import count_params
from memplan.engine import estimate
from memplan.presets.hf import model_from_hf_config
from tests.grids import pairwise_cases
from tests.hf.harness import check_exact, each_case, tiny_hf

# huggingface.co/stabilityai/stablelm-2-1_6b/blob/main/config.json (the keys memplan reads)
STABLELM_2_1_6B: dict[str, Any] = {
    "architectures": ["StableLmForCausalLM"],
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "hidden_dropout": 0.0,
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "layer_norm_eps": 1e-05,
    "max_position_embeddings": 4096,
    "model_type": "stablelm",
    "num_attention_heads": 32,
    "num_hidden_layers": 24,
    "num_key_value_heads": 32,
    "partial_rotary_factor": 0.25,
    "qk_layernorm": False,
    "rope_theta": 10000,
    "tie_word_embeddings": False,
    "use_parallel_residual": False,
    "use_qkv_bias": True,
    "vocab_size": 100352,
}
PARALLEL = {"parallel_residual": True, "shared_norm": True}


def stablelm(**fields: Any) -> Any:
    return tiny_hf(STABLELM_2_1_6B, "stablelm-2-1.6b", **fields)


def test_stablelm_parameters() -> None:
    """StableLM-2-1.6B, 1.64B on its model page: embedding and head 2·100352·2048; per layer W_Q/K/V
    2048² + 2048 (bias) each, W_O 2048², the MLP 3·2048·5632, two LayerNorms 2·2·2048; 24 layers and the
    final LayerNorm 2·2048."""
    per_layer = 3 * (2048**2 + 2048) + 2048**2 + 3 * 2048 * 5632 + 4 * 2048
    expected = 2 * 100352 * 2048 + 24 * per_layer + 2 * 2048
    assert count_params(model_from_hf_config(STABLELM_2_1_6B, "s")).total == expected == 1_644_515_328


@each_case
def test_stablelm(attention: str, checkpointing: str, reentrant: bool, use_cache: bool) -> None:
    check_exact(
        stablelm(attention=attention, checkpointing=checkpointing, reentrant=reentrant, use_cache=use_cache)
    )


@pytest.mark.parametrize("attention", ["flash", "eager"])
@pytest.mark.parametrize("fields", [PARALLEL, {"resid_dropout": 0.1}], ids=["parallel", "hidden-dropout"])
def test_stablelm_switches(attention: str, fields: dict[str, Any]) -> None:
    check_exact(stablelm(attention=attention, **fields))


def test_stablelm_by_hand() -> None:
    """Tiny StableLM, b 1, s 256, bf16, SDPA: q = cat(rot, pass) is head-major, so the kernel keeps its
    own output [1, 4, 256, 64] (2·4·256·64 B) beside W_O's [1, 256, 256] copy; the rotary tables are
    [256, 16] (a quarter of d = 64); hidden_dropout 0.1 keeps one noise [1, 256, 256] per layer, after
    the MLP, and none after the attention or the embedding."""
    rows = {r.name: r.bytes for r in estimate(stablelm(resid_dropout=0.1)).tensors}
    assert rows["attn.kernel_out"] == rows["attn.out"] == 2 * 4 * 256 * 64
    assert rows["rope.cos"] == rows["rope.sin"] == 2 * 256 * 16
    assert [n for n in rows if "dropout" in n] == ["mlp.resid_dropout_mask"]
    assert rows["mlp.resid_dropout_mask"] == 2 * 256 * 256


def test_stablelm_import() -> None:
    m = model_from_hf_config(STABLELM_2_1_6B, "s")
    assert (m.rotary_pct, m.qkv_bias, m.out_bias, m.parallel_residual) == (0.25, True, False, False)
    parallel = model_from_hf_config({**STABLELM_2_1_6B, "use_parallel_residual": True}, "s")
    assert (parallel.parallel_residual, parallel.shared_norm) == (True, True)
    big = model_from_hf_config(STABLELM_2_12B, "s")
    assert (big.qk_norm, big.qk_norm_whole, big.parallel_residual, big.shared_norm) == (
        True,
        True,
        True,
        True,
    )


# huggingface.co/stabilityai/stablelm-2-12b/blob/main/config.json (the keys memplan reads)
STABLELM_2_12B: dict[str, Any] = {
    **STABLELM_2_1_6B,
    "hidden_size": 5120,
    "intermediate_size": 13824,
    "num_attention_heads": 32,
    "num_hidden_layers": 40,
    "num_key_value_heads": 8,
    "qk_layernorm": True,
    "use_parallel_residual": True,
    "use_qkv_bias": False,
}


def test_stablelm_12b_parameters() -> None:
    """StableLM-2-12B, 12.1B on its model page: embedding and head 2·100352·5120; per layer W_Q and W_O
    5120², W_K and W_V 5120·1280 (8 kv heads of 160), the MLP 3·5120·13824, one LayerNorm 2·5120 (the
    parallel layer's), the per-head q/k LayerNorms (32 + 8)·160 (no bias); 40 layers and the final norm."""
    per_layer = 2 * 5120**2 + 2 * 5120 * 1280 + 3 * 5120 * 13824 + 2 * 5120 + (32 + 8) * 160
    expected = 2 * 100352 * 5120 + 40 * per_layer + 2 * 5120
    assert count_params(model_from_hf_config(STABLELM_2_12B, "s")).total == expected
    assert round(expected / 1e8) == 121


@pairwise_cases(
    "attention, checkpointing, fields",
    ["flash", "eager"],
    ["none", "full"],
    [{}, {"use_cache": False}, {"batch": 2}, PARALLEL],
)
def test_stablelm_qk_layernorm(attention: str, checkpointing: str, fields: dict[str, Any]) -> None:
    """StableLM-2-12B's per-head q/k LayerNorms (``qk_layernorm``), tiny widths: exact."""
    setup = stablelm(
        attention=attention, checkpointing=checkpointing, qk_norm=True, qk_norm_whole=True, **fields
    )
    check_exact(setup)


def test_stablelm_qk_layernorm_by_hand() -> None:
    """Tiny StableLM (a 4, kv 2, d 64), b 1, s 256, bf16, CPU: each head's layer_norm keeps a view of
    q_proj's output, so that output [1, 256, 256] (2·256·256 B) once, and its own mean and rstd
    [1, 1, 256, 1] in bf16 (512 B each): 4 heads for q, 2 for k."""
    rows = {r.name: r.bytes for r in estimate(stablelm(qk_norm=True, qk_norm_whole=True)).tensors}
    assert rows["attn.q_norm.input"] == 2 * 256 * 256 and rows["attn.k_norm.input"] == 2 * 256 * 128
    stats = sorted(
        n for n in rows if n.startswith(("attn.q_norm.m", "attn.q_norm.r", "attn.k_norm.m", "attn.k_norm.r"))
    )
    assert len(stats) == 2 * (4 + 2) and {rows[n] for n in stats} == {2 * 256}
