"""transformers' OLMo-2 (``modeling_olmo2.py``) against ``--impl hf``: no pre-norms, a norm on the attention's
and the MLP's outputs before each residual add, q_norm / k_norm over q_proj's and k_proj's whole outputs,
fp32 weight products in every norm and fp32 rotary tables. Built from OLMo-2-7B's config.json through the
importer and cut to tiny widths (transformers' own ``Olmo2Config`` and code under fake tensors): SDPA and
eager, without and with gradient checkpointing (reentrant and not), the cache on and off; exact per layer,
in total and FLOPs per phase."""

from __future__ import annotations

from typing import Any

import pytest

from memplan.analytic.params import count_params
from memplan.api import build_setup
from memplan.config import ImplConfig
from memplan.engine import estimate
from memplan.presets.hf import hf_notes, model_from_hf_config
from tests.hf.harness import check_exact, each_case, tiny_hf

# huggingface.co/allenai/OLMo-2-1124-7B/blob/main/config.json (the keys memplan reads)
OLMO2_7B: dict[str, Any] = {
    "architectures": ["Olmo2ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "max_position_embeddings": 4096,
    "model_type": "olmo2",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 500000,
    "tie_word_embeddings": False,
    "vocab_size": 100352,
}


def olmo2(**fields: Any) -> Any:
    return tiny_hf(OLMO2_7B, "olmo-2-7b", **fields)


def test_olmo2_parameters() -> None:
    """OLMo-2-7B, 7.3B on its model page (OLMo 2 paper, Table 1: 7B): embedding and head 2·100352·4096 =
    822,083,584; per layer W_Q/K/V/O 4·4096² = 67,108,864, MLP 3·4096·11008 = 135,266,304, two post norms
    and the q/k norms (4096 + 4096) 4·4096 = 16,384 (no pre-norms); 32 layers and the final norm 4096."""
    per_layer = 4 * 4096**2 + 3 * 4096 * 11008 + 4 * 4096
    expected = 2 * 100352 * 4096 + 32 * per_layer + 4096
    assert count_params(model_from_hf_config(OLMO2_7B, "olmo-2-7b")).total == expected == 7_298_617_344


@each_case
def test_olmo2(attention: str, checkpointing: str, reentrant: bool, use_cache: bool) -> None:
    check_exact(
        olmo2(attention=attention, checkpointing=checkpointing, reentrant=reentrant, use_cache=use_cache)
    )


@pytest.mark.parametrize(
    "fields",
    [
        {"batch": 2, "attention": "eager"},
        {"attn_dropout": 0.1},
        {"num_layers": 4, "checkpointing": "every-2"},
        {"num_kv_heads": 4, "qkv_bias": True, "out_bias": True},
    ],
    ids=["batch-2-eager", "dropout", "every-2", "mha-bias"],
)
def test_olmo2_switches(fields: dict[str, Any]) -> None:
    layers = fields.pop("num_layers", 2)
    check_exact(olmo2(layers=layers, **fields))


def test_olmo2_norms_by_hand() -> None:
    """Tiny OLMo-2, b 1, s 256, bf16, per layer: q_norm over q_proj's [1, 256, 4·64] keeps x32 (4·256·256
    B), rstd [1, 256, 1] fp32 (1 KiB) and the fp32 product's normed x (4·256·256 B); k_norm the same over
    kv·d = 128; no attn_norm / mlp_norm saves; the rotary tables [256, 64] in fp32."""
    rows = {r.name: r.bytes for r in estimate(olmo2()).tensors}
    assert rows["attn.q_norm.input"] == rows["attn.q_norm.normed"] == 4 * 256 * 256
    assert rows["attn.k_norm.input"] == rows["attn.k_norm.normed"] == 4 * 256 * 128
    assert rows["attn.q_norm.rstd"] == rows["attn.k_norm.rstd"] == 4 * 256
    assert not [n for n in rows if n.startswith(("attn_norm.", "mlp_norm."))]
    assert rows["post_attn_norm.normed"] == rows["post_mlp_norm.normed"] == 4 * 256 * 256
    assert rows["rope.cos"] == rows["rope.sin"] == 4 * 256 * 64


def test_olmo2_import() -> None:
    m = model_from_hf_config(OLMO2_7B, "olmo-2-7b")
    assert (m.post_norms, m.pre_norms, m.qk_norm, m.qk_norm_whole) == (True, False, True, True)
    assert m.code_family.value == "olmo2" and "post norms only" in hf_notes(OLMO2_7B)


def test_olmo2_structure_needs_its_code() -> None:
    """The post-norm-only layout is transformers' OLMo-2 code: refused under the reference model, and a
    model_type olmo2 without it is refused."""
    m = model_from_hf_config(OLMO2_7B, "olmo-2-7b")
    with pytest.raises(ValueError, match="post_norms: modelled for transformers' code only"):
        build_setup(m, seq=256)
    flat = m.model_copy(update={"pre_norms": True})
    with pytest.raises(ValueError, match="post_norms: OLMo-2's code"):
        build_setup(flat, seq=256, impl=ImplConfig(impl="hf"))
