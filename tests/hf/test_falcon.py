"""transformers' Falcon (``modeling_falcon.py``) against ``--impl hf``: one fused ``query_key_value`` whose
q, k and v are views, multi-query (Falcon-7B, one norm per parallel layer) and the new decoder architecture
(Falcon-40B: grouped kv heads, ``ln_attn`` and ``ln_mlp``), SDPA always given an explicit mask
(``allow_is_causal_skip=False``), a GELU MLP, one hidden dropout per layer. Built from both config.json
files through the importer and cut to tiny widths (transformers' own ``FalconConfig`` and code under fake
tensors): SDPA and eager, without and with gradient checkpointing (reentrant and not), the cache on and
off, b = 2, dropout; exact per layer, in total and FLOPs per phase."""

from __future__ import annotations

from typing import Any

import pytest

from memplan.analytic.params import count_params
from memplan.engine import estimate
from memplan.presets.hf import model_from_hf_config
from tests.grids import pairwise_cases
from tests.hf.harness import check_exact, each_case, tiny_hf

# huggingface.co/tiiuae/falcon-7b/blob/main/config.json (the keys memplan reads)
FALCON_7B: dict[str, Any] = {
    "alibi": False,
    "architectures": ["FalconForCausalLM"],
    "attention_dropout": 0.0,
    "bias": False,
    "hidden_dropout": 0.0,
    "hidden_size": 4544,
    "layer_norm_epsilon": 1e-05,
    "model_type": "falcon",
    "multi_query": True,
    "new_decoder_architecture": False,
    "num_attention_heads": 71,
    "num_hidden_layers": 32,
    "parallel_attn": True,
    "vocab_size": 65024,
}
# huggingface.co/tiiuae/falcon-40b/blob/main/config.json (the keys memplan reads)
FALCON_40B: dict[str, Any] = {
    "alibi": False,
    "architectures": ["FalconForCausalLM"],
    "attention_dropout": 0.0,
    "bias": False,
    "hidden_dropout": 0.0,
    "hidden_size": 8192,
    "layer_norm_epsilon": 1e-05,
    "model_type": "falcon",
    "multi_query": True,
    "new_decoder_architecture": True,
    "num_attention_heads": 128,
    "num_hidden_layers": 60,
    "num_kv_heads": 8,
    "parallel_attn": True,
    "vocab_size": 65024,
}
CONFIGS = {"falcon-7b": (FALCON_7B, 1), "falcon-40b": (FALCON_40B, 2)}


def falcon(name: str, **fields: Any) -> Any:
    cfg, kv = CONFIGS[name]
    return tiny_hf(cfg, name, **({"num_kv_heads": kv, "ffn_size": 1024} | fields))


def test_falcon_parameters() -> None:
    """Falcon-7B (7B on its model card; 71 heads of 64, one kv head): tied embedding 65024·4544; per layer
    query_key_value 4544·(4544 + 2·64), dense 4544², the MLP 2·4544·18176 (4h), one LayerNorm 2·4544; 32
    layers and ln_f. Falcon-40B (two LayerNorms, 8 kv heads of 64): 8192·(8192 + 2·512) + 8192² +
    2·8192·32768 + 2·2·8192 per layer, 60 layers."""
    per_layer = 4544 * (4544 + 128) + 4544**2 + 2 * 4544 * 18176 + 2 * 4544
    expected = 65024 * 4544 + 32 * per_layer + 2 * 4544
    assert count_params(model_from_hf_config(FALCON_7B, "f")).total == expected == 6_921_720_704
    per_layer = 8192 * (8192 + 1024) + 8192**2 + 2 * 8192 * 32768 + 4 * 8192
    expected = 65024 * 8192 + 60 * per_layer + 2 * 8192
    assert count_params(model_from_hf_config(FALCON_40B, "f")).total == expected == 41_303_293_952


@each_case(name=CONFIGS)
def test_falcon(name: str, attention: str, checkpointing: str, reentrant: bool, use_cache: bool) -> None:
    setup = falcon(
        name, attention=attention, checkpointing=checkpointing, reentrant=reentrant, use_cache=use_cache
    )
    check_exact(setup)


@pairwise_cases(
    "name, attention, fields",
    list(CONFIGS),
    ["flash", "eager"],
    [{"batch": 2}, {"attn_dropout": 0.1, "resid_dropout": 0.1}],
)
def test_falcon_switches(name: str, attention: str, fields: dict[str, Any]) -> None:
    check_exact(falcon(name, attention=attention, **fields))


def test_falcon_by_hand() -> None:
    """Tiny Falcon-7B, b 1, s 256, bf16, SDPA, cache off: v is a view of query_key_value's output, so the
    kernel keeps all of it, [1, 256, (4 + 2)·64]·2 B = 196,608 B; the explicit mask, converted to bf16,
    [1, 1, 256, 256]·2 B = 131,072 B per layer; one LayerNorm per layer, its output read by both branches."""
    rows = {r.name: r.bytes for r in estimate(falcon("falcon-7b", use_cache=False)).tensors}
    assert rows["attn.qkv"] == 256 * 6 * 64 * 2 == 196_608
    assert rows["attn.window_mask"] == 256 * 256 * 2
    assert not [n for n in rows if n.startswith("mlp_norm.") or n in ("mlp.input", "attn.v")]


@pytest.mark.parametrize(
    ("key", "value", "error"),
    [
        ("alibi", True, "alibi: Falcon's ALiBi"),
        ("parallel_attn", False, "parallel_attn: Falcon's sequential"),
    ],
)
def test_falcon_refused(key: str, value: bool, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        model_from_hf_config({**FALCON_7B, key: value}, "f")
