"""transformers' StarCoder2 (``modeling_starcoder2.py``) against ``--impl hf``: LayerNorm with bias, a GELU
(tanh) MLP with biases, dropout on the attention, the residual branches and the embedding, and a sliding
window. Built from StarCoder2-3B's config.json through the importer (its dropouts 0.1 included) and cut to
tiny widths (transformers' own ``Starcoder2Config`` and code under fake tensors): SDPA and eager, without
and with gradient checkpointing (reentrant and not), the cache on and off, the window below the sequence;
exact per layer, in total and FLOPs per phase."""

from __future__ import annotations

from typing import Any

import pytest

from memplan.analytic.params import count_params
from memplan.config import Gelu, NormType
from memplan.engine import estimate
from memplan.presets.hf import model_from_hf_config
from tests.hf.harness import check_exact, each_case, tiny_hf

# huggingface.co/bigcode/starcoder2-3b/blob/main/config.json (the keys memplan reads)
STARCODER2_3B: dict[str, Any] = {
    "architectures": ["Starcoder2ForCausalLM"],
    "attention_dropout": 0.1,
    "embedding_dropout": 0.1,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 3072,
    "intermediate_size": 12288,
    "max_position_embeddings": 16384,
    "model_type": "starcoder2",
    "norm_epsilon": 1e-05,
    "num_attention_heads": 24,
    "num_hidden_layers": 30,
    "num_key_value_heads": 2,
    "residual_dropout": 0.1,
    "rope_theta": 999999.4420358813,
    "sliding_window": 4096,
    "use_bias": True,
    "vocab_size": 49152,
}
NO_DROPOUT = {"attn_dropout": 0.0, "resid_dropout": 0.0, "embd_dropout": 0.0}


def starcoder2(**fields: Any) -> Any:
    return tiny_hf(STARCODER2_3B, "starcoder2-3b", **({"ffn_size": 1024} | fields))


def test_starcoder2_parameters() -> None:
    """StarCoder2-3B, 3.03B on its model page: tied embedding 49152·3072; per layer W_Q and W_O
    3072² + 3072 each, W_K and W_V 3072·256 + 256 each (2 kv heads of 128), c_fc 3072·12288 + 12288, c_proj
    12288·3072 + 3072, two LayerNorms 2·2·3072; 30 layers and the final LayerNorm 2·3072."""
    per_layer = 2 * (3072**2 + 3072) + 2 * (3072 * 256 + 256) + 3072 * 12288 + 12288
    per_layer += 12288 * 3072 + 3072 + 4 * 3072
    expected = 49152 * 3072 + 30 * per_layer + 2 * 3072
    assert count_params(model_from_hf_config(STARCODER2_3B, "s")).total == expected == 3_030_371_328


@each_case
def test_starcoder2(attention: str, checkpointing: str, reentrant: bool, use_cache: bool) -> None:
    """StarCoder2-3B's dropouts (0.1: CPU SDPA's math kernel, F.dropout's noise) and a window of 128."""
    setup = starcoder2(
        attention=attention,
        checkpointing=checkpointing,
        reentrant=reentrant,
        use_cache=use_cache,
        sliding_window=128,
    )
    check_exact(setup)


@pytest.mark.parametrize("attention", ["flash", "eager"])
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_starcoder2_without_dropout(attention: str, checkpointing: str) -> None:
    """No dropout: the flash kernel, with the window's mask and k, v repeated (window 128 < 256)."""
    check_exact(
        starcoder2(attention=attention, checkpointing=checkpointing, sliding_window=128, **NO_DROPOUT)
    )


def test_starcoder2_dropouts_by_hand() -> None:
    """Tiny StarCoder2, b 1, s 256, bf16, CPU: F.dropout after W_O, after c_proj and after the embedding
    keeps its noise [1, 256, 256] in bf16 (2·256·256 B each); the attention's (SDPA's math kernel) its
    fp32 noise [1, 4, 256, 256] (4·4·256·256 B)."""
    rows = {r.name: r.bytes for r in estimate(starcoder2()).tensors if "dropout" in r.name}
    assert rows == {
        "embed.dropout_mask": 2 * 256 * 256,
        "attn.dropout_noise": 4 * 4 * 256 * 256,
        "attn.resid_dropout_mask": 2 * 256 * 256,
        "mlp.resid_dropout_mask": 2 * 256 * 256,
    }


def test_starcoder2_import() -> None:
    m = model_from_hf_config(STARCODER2_3B, "s")
    assert (m.norm, m.gelu, m.qkv_bias, m.out_bias, m.mlp_bias) == (
        NormType.LAYERNORM,
        Gelu.GELU_PYTORCH_TANH,
        True,
        True,
        True,
    )
    assert (m.sliding_window, m.resid_dropout, m.embd_dropout, m.tied_embeddings) == (4096, 0.1, 0.1, True)
    assert m.code_family.value == "starcoder2"
