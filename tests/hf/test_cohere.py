"""transformers' Cohere (``modeling_cohere.py``, Command R) against ``--impl hf``: a parallel layer with one
bias-free LayerNorm written in Python (fp32 ops), interleaved rotary, a logit scale. Built from Command R's
config.json through the importer and cut to tiny widths (transformers' own ``CohereConfig`` and code under
fake tensors): SDPA and eager, without and with gradient checkpointing (reentrant and not), the cache on
and off; exact per layer, in total and FLOPs per phase."""

from __future__ import annotations

from typing import Any

import pytest

from memplan.analytic.params import count_params
from memplan.engine import estimate
from memplan.presets.hf import hf_notes, model_from_hf_config
from tests.hf.harness import hf_setup
from tests.hf.test_llama import CHECKPOINTING, check_exact

# huggingface.co/CohereForAI/c4ai-command-r-v01/blob/main/config.json (the keys memplan reads; no
# tie_word_embeddings key: CohereConfig ties)
COMMAND_R: dict[str, Any] = {
    "architectures": ["CohereForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "hidden_size": 8192,
    "intermediate_size": 22528,
    "layer_norm_eps": 1e-05,
    "logit_scale": 0.0625,
    "max_position_embeddings": 8192,
    "model_type": "cohere",
    "num_attention_heads": 64,
    "num_hidden_layers": 40,
    "num_key_value_heads": 64,
    "rope_theta": 8000000.0,
    "use_qk_norm": False,
    "vocab_size": 256000,
}
TINY = {
    "hidden_size": 256,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 64,
    "ffn_size": 512,
    "vocab_size": 1000,
}


def cohere(**fields: Any) -> Any:
    return hf_setup(model_from_hf_config(COMMAND_R, "command-r"), seq=256, **(TINY | fields))


def test_cohere_parameters() -> None:
    """Command R, 35B on its model page: tied embedding 256000·8192; per layer W_Q/K/V/O 4·8192², the MLP
    3·8192·22528 and one bias-free LayerNorm 8192; 40 layers and the final norm."""
    per_layer = 4 * 8192**2 + 3 * 8192 * 22528 + 8192
    expected = 256000 * 8192 + 40 * per_layer + 8192
    assert count_params(model_from_hf_config(COMMAND_R, "c")).total == expected == 34_980_831_232


@pytest.mark.parametrize("attention", ["flash", "eager"])
@pytest.mark.parametrize(("checkpointing", "reentrant"), CHECKPOINTING)
@pytest.mark.parametrize("use_cache", [True, False])
def test_cohere(attention: str, checkpointing: str, reentrant: bool, use_cache: bool) -> None:
    check_exact(
        cohere(attention=attention, checkpointing=checkpointing, reentrant=reentrant, use_cache=use_cache)
    )


def test_cohere_switches() -> None:
    check_exact(cohere(batch=2, attention="eager", attn_dropout=0.1))
    check_exact(cohere(layers=4, checkpointing="every-2"))


def test_cohere_norm_by_hand() -> None:
    """Tiny Command R, b 1, s 256, bf16, per layer: CohereLayerNorm keeps x − mean twice, the normalised x
    (fp32 [1, 256, 256]: 4·256·256 B each), rstd [1, 256, 1] fp32 and the fp32 weight copy [256]; no MLP
    norm and no separate MLP input (the one norm's output, attn.input, 2·256·256 B)."""
    rows = {r.name: r.bytes for r in estimate(cohere()).tensors}
    norm = {n: b for n, b in rows.items() if n.startswith("attn_norm.")}
    assert norm == {
        "attn_norm.input": 4 * 256 * 256,
        "attn_norm.centered": 4 * 256 * 256,
        "attn_norm.rstd": 4 * 256,
        "attn_norm.normed": 4 * 256 * 256,
        "attn_norm.weight_fp32": 4 * 256,
    }
    assert rows["attn.input"] == 2 * 256 * 256
    assert not [n for n in rows if n.startswith("mlp_norm.") or n == "mlp.input"]


def test_cohere_import() -> None:
    m = model_from_hf_config(COMMAND_R, "c")
    assert (m.parallel_residual, m.shared_norm, m.norm_bias, m.tied_embeddings) == (True, True, False, True)
    assert "logits ×0.0625" in hf_notes(COMMAND_R)
    with pytest.raises(ValueError, match="use_qk_norm: Cohere's per-head"):
        model_from_hf_config({**COMMAND_R, "use_qk_norm": True}, "c")
