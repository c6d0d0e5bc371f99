"""transformers' Cohere (``modeling_cohere.py``, Command R) against ``--impl hf``: a parallel layer with one
bias-free LayerNorm written in Python (fp32 ops), interleaved rotary, a logit scale. Built from Command R's
config.json through the importer and cut to tiny widths (transformers' own ``CohereConfig`` and code under
fake tensors): SDPA and eager, without and with gradient checkpointing (reentrant and not), the cache on
and off; exact per layer, in total and FLOPs per phase."""

from __future__ import annotations

from typing import Any

from memplan.analytic.params import count_params
from memplan.engine import estimate
from memplan.presets.hf import hf_notes, model_from_hf_config
from tests.grids import pairwise_cases
from tests.hf.harness import check_exact, each_case, tiny_hf

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


def cohere(**fields: Any) -> Any:
    return tiny_hf(COMMAND_R, "command-r", **fields)


def test_cohere_parameters() -> None:
    """Command R, 35B on its model page: tied embedding 256000·8192; per layer W_Q/K/V/O 4·8192², the MLP
    3·8192·22528 and one bias-free LayerNorm 8192; 40 layers and the final norm."""
    per_layer = 4 * 8192**2 + 3 * 8192 * 22528 + 8192
    expected = 256000 * 8192 + 40 * per_layer + 8192
    assert count_params(model_from_hf_config(COMMAND_R, "c")).total == expected == 34_980_831_232


@each_case
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
    plus = model_from_hf_config(COMMAND_R_PLUS, "c")
    assert (plus.qk_norm, plus.qk_norm_whole, plus.kv_heads) == (True, True, 8)


# huggingface.co/CohereForAI/c4ai-command-r-plus/blob/main/config.json (the keys memplan reads)
COMMAND_R_PLUS: dict[str, Any] = {
    **COMMAND_R,
    "hidden_size": 12288,
    "intermediate_size": 33792,
    "logit_scale": 0.8333333333333334,
    "max_position_embeddings": 131072,
    "num_attention_heads": 96,
    "num_hidden_layers": 64,
    "num_key_value_heads": 8,
    "rope_theta": 75000000.0,
    "use_qk_norm": True,
}


def test_cohere_plus_parameters() -> None:
    """Command R+, 104B on its model page: tied embedding 256000·12288; per layer W_Q and W_O 12288², W_K
    and W_V 12288·1024 (8 kv heads of 128), the MLP 3·12288·33792, one LayerNorm 12288 and the q/k norms'
    [96, 128] and [8, 128] weights; 64 layers and the final norm."""
    per_layer = 2 * 12288**2 + 2 * 12288 * 1024 + 3 * 12288 * 33792 + 12288 + (96 + 8) * 128
    expected = 256000 * 12288 + 64 * per_layer + 12288
    assert count_params(model_from_hf_config(COMMAND_R_PLUS, "c")).total == expected
    assert round(expected / 1e9) == 104


@pairwise_cases("attention, checkpointing, use_cache", ["flash", "eager"], ["none", "full"], [True, False])
def test_cohere_qk_norm(attention: str, checkpointing: str, use_cache: bool) -> None:
    """Command R+'s q/k LayerNorms (``use_qk_norm``), tiny widths: exact."""
    fields = {"qk_norm": True, "qk_norm_whole": True, "use_cache": use_cache}
    check_exact(cohere(attention=attention, checkpointing=checkpointing, **fields))


def test_cohere_qk_norm_by_hand() -> None:
    """Tiny Command R+ (a 4, kv 2, d 64), b 1, s 256, bf16: q_norm keeps x − mean twice and the normalised
    q in fp32 [1, 256, 4, 64] (4·256·256 B each), rstd per head [1, 256, 4, 1] fp32 and the fp32 copy of
    its [4, 64] weight; k_norm the same over 2 kv heads."""
    rows = {r.name: r.bytes for r in estimate(cohere(qk_norm=True, qk_norm_whole=True)).tensors}
    q = {n.removeprefix("attn.q_norm."): b for n, b in rows.items() if n.startswith("attn.q_norm.")}
    k = {n.removeprefix("attn.k_norm."): b for n, b in rows.items() if n.startswith("attn.k_norm.")}
    big = 4 * 256 * 4 * 64
    assert q == {"input": big, "centered": big, "rstd": 4 * 256 * 4, "normed": big, "weight_fp32": 4 * 4 * 64}
    assert k == {n: b // 2 for n, b in q.items()}
