"""Importing Hugging Face config.json files (the official values, written out as dicts)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from memplan.analytic.params import count_params
from memplan.api import build_setup
from memplan.config import Gelu, Impl, ImplConfig, MlpType, NormType, PositionType
from memplan.presets import load_model_preset
from memplan.presets.hf import SUPPORTED_MODEL_TYPES, hf_notes, model_from_hf_config

# huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json
LLAMA_3_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 8192,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.40.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}

# huggingface.co/openai-community/gpt2/blob/main/config.json
GPT2: dict[str, Any] = {
    "activation_function": "gelu_new",
    "architectures": ["GPT2LMHeadModel"],
    "attn_pdrop": 0.1,
    "bos_token_id": 50256,
    "embd_pdrop": 0.1,
    "eos_token_id": 50256,
    "initializer_range": 0.02,
    "layer_norm_epsilon": 1e-05,
    "model_type": "gpt2",
    "n_ctx": 1024,
    "n_embd": 768,
    "n_head": 12,
    "n_layer": 12,
    "n_positions": 1024,
    "resid_pdrop": 0.1,
    "summary_activation": None,
    "summary_first_dropout": 0.1,
    "summary_proj_to_labels": True,
    "summary_type": "cls_index",
    "summary_use_proj": True,
    "task_specific_params": {"text-generation": {"do_sample": True, "max_length": 50}},
    "vocab_size": 50257,
}

# huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json
QWEN25_7B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_position_embeddings": 131072,
    "max_window_layers": 28,
    "model_type": "qwen2",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "vocab_size": 152064,
}

# huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json
MISTRAL_7B: dict[str, Any] = {
    "architectures": ["MistralForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mistral",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "vocab_size": 32000,
}

# huggingface.co/Qwen/Qwen3-8B/blob/main/config.json (the keys memplan reads)
QWEN3_8B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# huggingface.co/google/gemma-2b/blob/main/config.json (no tie_word_embeddings key: Gemma ties)
GEMMA_2B: dict[str, Any] = {
    "architectures": ["GemmaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "head_dim": 256,
    "hidden_act": "gelu",
    "hidden_size": 2048,
    "intermediate_size": 16384,
    "max_position_embeddings": 8192,
    "model_type": "gemma",
    "num_attention_heads": 8,
    "num_hidden_layers": 18,
    "num_key_value_heads": 1,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "vocab_size": 256000,
}

# huggingface.co/microsoft/Phi-3-mini-4k-instruct/blob/main/config.json (auto_map: remote code, never run)
PHI3_MINI: dict[str, Any] = {
    "architectures": ["Phi3ForCausalLM"],
    "attention_dropout": 0.0,
    "auto_map": {"AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"},
    "embd_pdrop": 0.0,
    "hidden_act": "silu",
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "max_position_embeddings": 4096,
    "model_type": "phi3",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "resid_pdrop": 0.0,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 2047,
    "tie_word_embeddings": False,
    "vocab_size": 32064,
}

# huggingface.co/EleutherAI/pythia-160m/blob/main/config.json
PYTHIA_160M: dict[str, Any] = {
    "architectures": ["GPTNeoXForCausalLM"],
    "hidden_act": "gelu",
    "hidden_size": 768,
    "intermediate_size": 3072,
    "layer_norm_eps": 1e-05,
    "max_position_embeddings": 2048,
    "model_type": "gpt_neox",
    "num_attention_heads": 12,
    "num_hidden_layers": 12,
    "rotary_emb_base": 10000,
    "rotary_pct": 0.25,
    "tie_word_embeddings": False,
    "use_parallel_residual": True,
    "vocab_size": 50304,
}


@pytest.mark.parametrize(
    ("cfg", "published"),
    [
        (LLAMA_3_8B, 8_030_261_248),  # HF model page, safetensors: 8.03B
        (GPT2, 124_439_808),  # transformers GPT2LMHeadModel.parameters(), tied head once
        (QWEN25_7B, 7_615_616_512),  # HF model page, safetensors: 7.62B
        (MISTRAL_7B, 7_241_732_096),  # HF model page, safetensors: 7.24B
        (GEMMA_2B, 2_506_172_416),  # HF model page, safetensors: 2.51B
        (PHI3_MINI, 3_821_079_552),  # HF model page, safetensors: 3.82B
        (PYTHIA_160M, 162_322_944),  # Pythia README model table, total params
    ],
    ids=lambda v: v["model_type"] if isinstance(v, dict) else None,
)
def test_hf_config_count_equals_published(cfg: dict[str, Any], published: int) -> None:
    assert count_params(model_from_hf_config(cfg, "x")).total == published


@pytest.mark.parametrize(
    ("cfg", "preset"),
    [
        (LLAMA_3_8B, "llama-3-8b"),
        (GPT2, "gpt2"),
        (QWEN25_7B, "qwen2.5-7b"),
        (MISTRAL_7B, "mistral-7b"),
        (QWEN3_8B, "qwen3-8b"),
    ],
)
def test_hf_import_matches_the_shipped_preset(cfg: dict[str, Any], preset: str) -> None:
    shipped = load_model_preset(preset).model
    assert model_from_hf_config(cfg, preset) == shipped


def test_family_layouts() -> None:
    gpt2 = model_from_hf_config(GPT2, "gpt2")
    assert (gpt2.norm, gpt2.mlp, gpt2.position) == (NormType.LAYERNORM, MlpType.GELU, PositionType.LEARNED)
    assert gpt2.ffn == 4 * 768 and gpt2.tied_embeddings and gpt2.embd_dropout == 0.1
    neox = model_from_hf_config(PYTHIA_160M, "pythia")
    assert neox.qkv_bias and neox.out_bias and neox.mlp_bias and not neox.tied_embeddings
    assert neox.norm is NormType.LAYERNORM and neox.position is PositionType.ROPE
    gemma = model_from_hf_config(GEMMA_2B, "gemma")
    assert gemma.tied_embeddings and gemma.mlp is MlpType.SWIGLU and gemma.q_width == 2048
    assert "GeGLU" in hf_notes(GEMMA_2B) and "fused" in hf_notes(PHI3_MINI)
    qwen = model_from_hf_config(QWEN25_7B, "q")
    assert qwen.qkv_bias and not qwen.out_bias


@pytest.mark.parametrize("kind", ["mamba", "bert"])
def test_unsupported_model_type_lists_supported(kind: str) -> None:
    with pytest.raises(ValueError, match=f"model_type: '{kind}' is not supported") as info:
        model_from_hf_config({**LLAMA_3_8B, "model_type": kind}, "x")
    assert all(t in str(info.value) for t in SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"model_type": None}, "hf config x: model_type: missing"),
        ({"model_type": ["llama"]}, "model_type: ['llama'] is not supported"),
        ({"hidden_size": None}, "hidden_size: missing"),
        ({"hidden_size": "4096"}, "hidden_size: expected a whole number"),
        ({"num_hidden_layers": True}, "num_hidden_layers: expected a whole number"),
        ({"rope_theta": "big"}, "rope_theta: expected a number"),
        ({"tie_word_embeddings": "no"}, "tie_word_embeddings: expected true or false"),
        ({"num_key_value_heads": 5}, "num_kv_heads: 5 must divide num_heads 32"),
        ({"vocab_size": 0}, "vocab_size: Input should be greater than 0"),
    ],
)
def test_bad_hf_values_give_one_line(change: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError) as info:
        model_from_hf_config({**LLAMA_3_8B, **change}, "x")
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_load_hf_config_json_by_path(tmp_path: Path) -> None:
    folder = tmp_path / "Meta-Llama-3-8B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_3_8B))
    preset = load_model_preset(str(folder / "config.json"))
    assert preset.name == preset.model.name == "Meta-Llama-3-8B"
    assert preset.published_params is None and "model_type llama" in preset.notes
    assert count_params(preset.model).total == 8_030_261_248
    with pytest.raises(ValueError, match=r"is a directory; pass a preset \.toml file or the config\.json"):
        load_model_preset(str(folder))


def test_unsupported_hf_file_by_path(tmp_path: Path) -> None:
    path = tmp_path / "bert.json"
    path.write_text(json.dumps({**MISTRAL_7B, "model_type": "bert"}))
    with pytest.raises(ValueError, match=r"^model file .*bert\.json: model_type: 'bert' is not supported"):
        load_model_preset(str(path))
    path.write_text(json.dumps({**MISTRAL_7B, "hidden_size": "4096"}))
    with pytest.raises(ValueError, match=r"^model file .*bert\.json: hidden_size: expected a whole number"):
        load_model_preset(str(path))
    path.write_text(json.dumps({**MISTRAL_7B, "num_key_value_heads": 3}))
    with pytest.raises(
        ValueError, match=r"^model file .*bert\.json \(mistral\): num_kv_heads: 3 must divide"
    ):
        load_model_preset(str(path))


def test_hub_cache_snapshot_is_named_after_the_repo(tmp_path: Path) -> None:
    snapshot = tmp_path / "models--mistralai--Mistral-7B-v0.1" / "snapshots" / ("ab" * 20)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(MISTRAL_7B))
    (tmp_path / "my-mistral.json").write_text(json.dumps(MISTRAL_7B))
    assert load_model_preset(str(snapshot / "config.json")).name == "Mistral-7B-v0.1"
    assert load_model_preset(str(tmp_path / "my-mistral.json")).name == "my-mistral"


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"hidden_act": "relu"}, "hidden_act"),  # a llama config with a ReGLU MLP: not silently SiLU
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_an_activation_memplan_does_not_model_is_an_error(change: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=rf"^hf config x: {key}: '{change[key]}' is not modelled") as err:
        model_from_hf_config({**LLAMA_3_8B, **change}, "x")
    assert "\n" not in str(err.value) and "silu" in str(err.value)


def test_gelu_families_take_the_gelu_variants_only() -> None:
    gpt2 = {
        "model_type": "gpt2",
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
        "vocab_size": 50257,
        "activation_function": "gelu_new",
    }
    assert model_from_hf_config(gpt2, "g").mlp is MlpType.GELU
    with pytest.raises(ValueError, match=r"activation_function: 'relu' is not modelled for model_type gpt2"):
        model_from_hf_config({**gpt2, "activation_function": "relu"}, "g")


def test_sliding_window_as_transformers_reads_it() -> None:
    """MistralConfig: sliding_window (default 4096, null: none); Qwen2/Qwen3: only with use_sliding_window,
    on layers ≥ max_window_layers (all: 0, none: ≥ the layers; some: the first ones full_layers)."""
    assert model_from_hf_config(MISTRAL_7B, "m").sliding_window == 4096
    assert model_from_hf_config({**MISTRAL_7B, "sliding_window": None}, "m").sliding_window is None
    no_key = {k: v for k, v in MISTRAL_7B.items() if k != "sliding_window"}
    assert model_from_hf_config(no_key, "m").sliding_window == 4096
    assert model_from_hf_config(QWEN25_7B, "q").sliding_window is None
    on = {**QWEN25_7B, "use_sliding_window": True, "sliding_window": 4096}
    assert model_from_hf_config(on, "q").sliding_window is None  # max_window_layers 28 = the layers
    assert model_from_hf_config({**on, "max_window_layers": 0}, "q").sliding_window == 4096
    some = model_from_hf_config({**on, "max_window_layers": 14}, "q")
    assert (some.sliding_window, some.full_layers) == (4096, 14)
    kinds = ["full_attention"] * 14 + ["sliding_attention"] * 14
    assert model_from_hf_config({**on, "max_window_layers": 14, "layer_types": kinds}, "q") == some
    with pytest.raises(ValueError, match="layer_types: only the layers from max_window_layers on sliding"):
        model_from_hf_config({**on, "max_window_layers": 14, "layer_types": kinds[::-1]}, "q")
    qwen3 = model_from_hf_config(QWEN3_8B, "q3")
    assert qwen3.qk_norm and qwen3.family == "qwen3" and not qwen3.qkv_bias


def test_gpt_neox_structure_is_read_and_refused_by_the_reference() -> None:
    """Pythia's partial rotary and parallel residual are read (the model's own structure); memplan's
    reference model implements neither, so only --impl hf estimates them."""
    neox = model_from_hf_config(PYTHIA_160M, "pythia")
    assert (neox.rotary_pct, neox.rotary_dims, neox.parallel_residual) == (0.25, 16, True)
    assert neox.gelu is Gelu.GELU and model_from_hf_config(GPT2, "gpt2").gelu is Gelu.GELU_NEW
    with pytest.raises(ValueError, match=r"impl: pythia's partial rotary .* --impl hf only"):
        build_setup(neox, seq=128)
    build_setup(neox, seq=128, impl=ImplConfig(impl=Impl.HF))
    with pytest.raises(ValueError, match=r"activation_function: 'gelu_fast' is not modelled"):
        model_from_hf_config({**GPT2, "activation_function": "gelu_fast"}, "g")
