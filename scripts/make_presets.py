"""Write presets/models/<name>.toml from published Hugging Face config.json files (the keys memplan reads,
copied from each model's page), and print transformers' own parameter count of each for tests/test_presets.py.

    python scripts/make_presets.py            # write the .toml files
    python scripts/make_presets.py --count    # transformers' count: AutoModelForCausalLM on the meta device

The count printed by ``--count`` is transformers' ``sum(p.numel() for p in model.parameters())`` (tied
weights once), independent of memplan's ``count_params``; the tests compare the two.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

_LLAMA3 = {
    "model_type": "llama",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "vocab_size": 128256,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0},
}
_L8B = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "tie_word_embeddings": False,
}
_L70B = {
    "hidden_size": 8192,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "intermediate_size": 28672,
    "tie_word_embeddings": False,
}
_QWEN3 = {
    "model_type": "qwen3",
    "hidden_act": "silu",
    "head_dim": 128,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "max_position_embeddings": 40960,
    "vocab_size": 151936,
    "use_sliding_window": False,
    "attention_bias": False,
}
_QWEN3_MOE = {
    "model_type": "qwen3_moe",
    "attention_bias": False,
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
_GPT_OSS = {
    "model_type": "gpt_oss",
    "attention_bias": True,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "max_position_embeddings": 131072,
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_key_value_heads": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096},
    "rope_theta": 150000,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "vocab_size": 201088,
}
_YARN = {
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 40,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 4096,
    "type": "yarn",
}
_DEEPSEEK = {
    "attention_bias": False,
    "hidden_act": "silu",
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "tie_word_embeddings": False,
    "v_head_dim": 128,
}
_PHI3 = {"model_type": "phi3", "hidden_act": "silu", "rms_norm_eps": 1e-05, "tie_word_embeddings": False}
_GEMMA2 = {
    "model_type": "gemma2",
    "hidden_activation": "gelu_pytorch_tanh",
    "vocab_size": 256000,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "max_position_embeddings": 8192,
}

# name → (aliases, source page, page's rounded count, note, config.json keys)
PRESETS: dict[str, tuple[tuple[str, ...], str, str, str, dict[str, Any]]] = {
    "llama-3.1-8b": (
        ("llama3.1-8b", "meta-llama-3.1-8b"),
        "meta-llama/Llama-3.1-8B",
        "8.03B",
        "",
        {**_LLAMA3, **_L8B},
    ),
    "llama-3.1-70b": (
        ("llama3.1-70b", "meta-llama-3.1-70b"),
        "meta-llama/Llama-3.1-70B",
        "70.6B",
        "",
        {**_LLAMA3, **_L70B},
    ),
    "llama-3.3-70b": (
        ("llama3.3-70b", "llama-3.3-70b-instruct"),
        "meta-llama/Llama-3.3-70B-Instruct",
        "70.6B",
        "",
        {**_LLAMA3, **_L70B},
    ),
    "llama-3.2-1b": (
        ("llama3.2-1b",),
        "meta-llama/Llama-3.2-1B",
        "1.24B",
        "",
        {
            **_LLAMA3,
            "rope_scaling": {"rope_type": "llama3", "factor": 32.0},
            "hidden_size": 2048,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "intermediate_size": 8192,
            "tie_word_embeddings": True,
        },
    ),
    "llama-3.2-3b": (
        ("llama3.2-3b",),
        "meta-llama/Llama-3.2-3B",
        "3.21B",
        "",
        {
            **_LLAMA3,
            "rope_scaling": {"rope_type": "llama3", "factor": 32.0},
            "hidden_size": 3072,
            "num_hidden_layers": 28,
            "num_attention_heads": 24,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "intermediate_size": 8192,
            "tie_word_embeddings": True,
        },
    ),
    "qwen3-0.6b": (
        (),
        "Qwen/Qwen3-0.6B",
        "0.6B",
        "",
        {
            **_QWEN3,
            "hidden_size": 1024,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "intermediate_size": 3072,
            "tie_word_embeddings": True,
        },
    ),
    "qwen3-1.7b": (
        (),
        "Qwen/Qwen3-1.7B",
        "1.7B",
        "",
        {
            **_QWEN3,
            "hidden_size": 2048,
            "num_hidden_layers": 28,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "intermediate_size": 6144,
            "tie_word_embeddings": True,
        },
    ),
    "qwen3-4b": (
        (),
        "Qwen/Qwen3-4B",
        "4.0B",
        "",
        {
            **_QWEN3,
            "hidden_size": 2560,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "intermediate_size": 9728,
            "tie_word_embeddings": True,
        },
    ),
    "qwen3-14b": (
        (),
        "Qwen/Qwen3-14B",
        "14.8B",
        "",
        {
            **_QWEN3,
            "hidden_size": 5120,
            "num_hidden_layers": 40,
            "num_attention_heads": 40,
            "num_key_value_heads": 8,
            "intermediate_size": 17408,
            "tie_word_embeddings": False,
        },
    ),
    "qwen3-32b": (
        (),
        "Qwen/Qwen3-32B",
        "32.8B",
        "",
        {
            **_QWEN3,
            "hidden_size": 5120,
            "num_hidden_layers": 64,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "intermediate_size": 25600,
            "tie_word_embeddings": False,
        },
    ),
    "gemma-2b": (
        (),
        "google/gemma-2b",
        "2.51B",
        "",
        {
            "model_type": "gemma",
            "hidden_act": "gelu",
            "head_dim": 256,
            "hidden_size": 2048,
            "intermediate_size": 16384,
            "max_position_embeddings": 8192,
            "num_attention_heads": 8,
            "num_hidden_layers": 18,
            "num_key_value_heads": 1,
            "rms_norm_eps": 1e-06,
            "rope_theta": 10000.0,
            "vocab_size": 256000,
        },
    ),
    "gemma-7b": (
        (),
        "google/gemma-7b",
        "8.54B",
        "",
        {
            "model_type": "gemma",
            "hidden_act": "gelu",
            "head_dim": 256,
            "hidden_size": 3072,
            "intermediate_size": 24576,
            "max_position_embeddings": 8192,
            "num_attention_heads": 16,
            "num_hidden_layers": 28,
            "num_key_value_heads": 16,
            "rms_norm_eps": 1e-06,
            "rope_theta": 10000.0,
            "vocab_size": 256000,
        },
    ),
    "gemma-2-2b": (
        (),
        "google/gemma-2-2b",
        "2.61B",
        "",
        {
            **_GEMMA2,
            "head_dim": 256,
            "hidden_size": 2304,
            "intermediate_size": 9216,
            "num_attention_heads": 8,
            "num_hidden_layers": 26,
            "num_key_value_heads": 4,
            "query_pre_attn_scalar": 256,
        },
    ),
    "gemma-2-9b": (
        (),
        "google/gemma-2-9b",
        "9.24B",
        "",
        {
            **_GEMMA2,
            "head_dim": 256,
            "hidden_size": 3584,
            "intermediate_size": 14336,
            "num_attention_heads": 16,
            "num_hidden_layers": 42,
            "num_key_value_heads": 8,
            "query_pre_attn_scalar": 256,
        },
    ),
    "gemma-2-27b": (
        (),
        "google/gemma-2-27b",
        "27.2B",
        "",
        {
            **_GEMMA2,
            "head_dim": 128,
            "hidden_size": 4608,
            "intermediate_size": 36864,
            "num_attention_heads": 32,
            "num_hidden_layers": 46,
            "num_key_value_heads": 16,
            "query_pre_attn_scalar": 144,
        },
    ),
    "gemma-3-1b": (
        (),
        "google/gemma-3-1b-pt",
        "1B",
        "",
        {
            "model_type": "gemma3_text",
            "hidden_activation": "gelu_pytorch_tanh",
            "head_dim": 256,
            "hidden_size": 1152,
            "intermediate_size": 6912,
            "max_position_embeddings": 32768,
            "num_attention_heads": 4,
            "num_hidden_layers": 26,
            "num_key_value_heads": 1,
            "query_pre_attn_scalar": 256,
            "rms_norm_eps": 1e-06,
            "rope_local_base_freq": 10000,
            "rope_theta": 1000000,
            "sliding_window": 512,
            "sliding_window_pattern": 6,
            "vocab_size": 262144,
        },
    ),
    "gemma-3-4b": (
        (),
        "google/gemma-3-4b-pt",
        "4.3B with the vision tower",
        "the text model only (text_config): the page's 4.3B adds the SigLIP vision tower and its projector",
        {
            "model_type": "gemma3_text",
            "hidden_activation": "gelu_pytorch_tanh",
            "head_dim": 256,
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "max_position_embeddings": 131072,
            "num_attention_heads": 8,
            "num_hidden_layers": 34,
            "num_key_value_heads": 4,
            "query_pre_attn_scalar": 256,
            "rms_norm_eps": 1e-06,
            "rope_local_base_freq": 10000.0,
            "rope_theta": 1000000.0,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
            "vocab_size": 262208,
        },
    ),
    "phi-3-mini": (
        ("phi-3-mini-4k",),
        "microsoft/Phi-3-mini-4k-instruct",
        "3.82B",
        "",
        {
            **_PHI3,
            "hidden_size": 3072,
            "intermediate_size": 8192,
            "max_position_embeddings": 4096,
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 32,
            "rope_theta": 10000.0,
            "sliding_window": 2047,
            "vocab_size": 32064,
        },
    ),
    "phi-3.5-mini": (
        (),
        "microsoft/Phi-3.5-mini-instruct",
        "3.82B",
        "",
        {
            **_PHI3,
            "hidden_size": 3072,
            "intermediate_size": 8192,
            "max_position_embeddings": 131072,
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 32,
            "rope_theta": 10000.0,
            "rope_scaling": {"type": "longrope"},
            "sliding_window": 262144,
            "vocab_size": 32064,
        },
    ),
    "phi-3-medium": (
        ("phi-3-medium-4k",),
        "microsoft/Phi-3-medium-4k-instruct",
        "14B",
        "",
        {
            **_PHI3,
            "hidden_size": 5120,
            "intermediate_size": 17920,
            "max_position_embeddings": 4096,
            "num_attention_heads": 40,
            "num_hidden_layers": 40,
            "num_key_value_heads": 10,
            "rope_theta": 10000.0,
            "sliding_window": 2047,
            "vocab_size": 32064,
        },
    ),
    "phi-4": (
        (),
        "microsoft/phi-4",
        "14.7B",
        "",
        {
            **_PHI3,
            "hidden_size": 5120,
            "intermediate_size": 17920,
            "max_position_embeddings": 16384,
            "num_attention_heads": 40,
            "num_hidden_layers": 40,
            "num_key_value_heads": 10,
            "rope_theta": 250000,
            "sliding_window": None,
            "vocab_size": 100352,
        },
    ),
    "pythia-160m": (
        (),
        "EleutherAI/pythia-160m",
        "162M",
        "",
        {
            "model_type": "gpt_neox",
            "hidden_act": "gelu",
            "hidden_size": 768,
            "intermediate_size": 3072,
            "layer_norm_eps": 1e-05,
            "max_position_embeddings": 2048,
            "num_attention_heads": 12,
            "num_hidden_layers": 12,
            "rotary_emb_base": 10000,
            "rotary_pct": 0.25,
            "tie_word_embeddings": False,
            "use_parallel_residual": True,
            "vocab_size": 50304,
        },
    ),
    "qwen3-30b-a3b": (
        (),
        "Qwen/Qwen3-30B-A3B",
        "30.5B, 3.3B activated",
        "",
        {
            **_QWEN3_MOE,
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "max_window_layers": 48,
            "moe_intermediate_size": 768,
            "num_attention_heads": 32,
            "num_hidden_layers": 48,
        },
    ),
    "qwen3-235b-a22b": (
        (),
        "Qwen/Qwen3-235B-A22B",
        "235B, 22B activated",
        "",
        {
            **_QWEN3_MOE,
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "max_window_layers": 94,
            "moe_intermediate_size": 1536,
            "num_attention_heads": 64,
            "num_hidden_layers": 94,
        },
    ),
    "gpt-oss-20b": (
        (),
        "openai/gpt-oss-20b",
        "21B, 3.6B active (the card's active count leaves out the input embedding)",
        "",
        {**_GPT_OSS, "num_hidden_layers": 24, "num_local_experts": 32},
    ),
    "gpt-oss-120b": (
        (),
        "openai/gpt-oss-120b",
        "117B, 5.1B active (the card's active count leaves out the input embedding)",
        "",
        {**_GPT_OSS, "num_hidden_layers": 36, "num_local_experts": 128},
    ),
    "deepseek-v3": (
        (),
        "deepseek-ai/DeepSeek-V3",
        "671B total, 37B activated (the MTP module's 14B apart)",
        "",
        {
            **_DEEPSEEK,
            "model_type": "deepseek_v3",
            "first_k_dense_replace": 3,
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "n_group": 8,
            "n_routed_experts": 256,
            "n_shared_experts": 1,
            "norm_topk_prob": True,
            "num_attention_heads": 128,
            "num_experts_per_tok": 8,
            "num_hidden_layers": 61,
            "num_key_value_heads": 128,
            "num_nextn_predict_layers": 1,
            "q_lora_rank": 1536,
            "rope_scaling": _YARN,
            "routed_scaling_factor": 2.5,
            "scoring_func": "sigmoid",
            "topk_group": 4,
            "topk_method": "noaux_tc",
            "vocab_size": 129280,
        },
    ),
    "deepseek-v2": (
        (),
        "deepseek-ai/DeepSeek-V2",
        "236B total, 21B activated",
        "",
        {
            **_DEEPSEEK,
            "model_type": "deepseek_v2",
            "first_k_dense_replace": 1,
            "hidden_size": 5120,
            "intermediate_size": 12288,
            "moe_intermediate_size": 1536,
            "n_group": 8,
            "n_routed_experts": 160,
            "n_shared_experts": 2,
            "norm_topk_prob": False,
            "num_attention_heads": 128,
            "num_experts_per_tok": 6,
            "num_hidden_layers": 60,
            "num_key_value_heads": 128,
            "q_lora_rank": 1536,
            "rope_scaling": _YARN,
            "routed_scaling_factor": 16.0,
            "topk_group": 3,
            "topk_method": "group_limited_greedy",
            "vocab_size": 102400,
        },
    ),
    "deepseek-v2-lite": (
        (),
        "deepseek-ai/DeepSeek-V2-Lite",
        "15.7B total, 2.4B activated",
        "",
        {
            **_DEEPSEEK,
            "model_type": "deepseek_v2",
            "first_k_dense_replace": 1,
            "hidden_size": 2048,
            "intermediate_size": 10944,
            "moe_intermediate_size": 1408,
            "n_group": 1,
            "n_routed_experts": 64,
            "n_shared_experts": 2,
            "norm_topk_prob": False,
            "num_attention_heads": 16,
            "num_experts_per_tok": 6,
            "num_hidden_layers": 27,
            "num_key_value_heads": 16,
            "q_lora_rank": None,
            "rope_scaling": _YARN,
            "routed_scaling_factor": 1.0,
            "topk_group": 1,
            "topk_method": "greedy",
            "vocab_size": 102400,
        },
    ),
    "mixtral-8x22b": (
        (),
        "mistralai/Mixtral-8x22B-v0.1",
        "141B",
        "",
        {
            "model_type": "mixtral",
            "hidden_act": "silu",
            "hidden_size": 6144,
            "intermediate_size": 16384,
            "max_position_embeddings": 65536,
            "num_attention_heads": 48,
            "num_hidden_layers": 56,
            "num_key_value_heads": 8,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "rms_norm_eps": 1e-05,
            "rope_theta": 1000000.0,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "vocab_size": 32768,
        },
    ),
    "phi-3.5-moe": (
        ("phi-3.5-moe-instruct",),
        "microsoft/Phi-3.5-MoE-instruct",
        "41.9B, 6.6B active",
        "",
        {
            "model_type": "phimoe",
            "attention_bias": True,
            "hidden_act": "silu",
            "hidden_size": 4096,
            "input_jitter_noise": 0.01,
            "intermediate_size": 6400,
            "lm_head_bias": True,
            "max_position_embeddings": 131072,
            "num_attention_heads": 32,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "num_local_experts": 16,
            "output_router_logits": False,
            "rms_norm_eps": 1e-05,
            "rope_theta": 10000.0,
            "router_jitter_noise": 0.01,
            "sliding_window": 131072,
            "tie_word_embeddings": False,
            "vocab_size": 32064,
            # the page's longrope: its short/long factor lists change the tables' values only
            "rope_scaling": {"type": "longrope", "original_max_position_embeddings": 4096},
        },
    ),
}


def _dense_families() -> dict[str, tuple[tuple[str, ...], str, str, str, dict[str, Any]]]:
    """The families modelled in blocks/hf/ for issue #23 (OLMo-2, Granite, StarCoder2, Cohere, StableLM,
    GLM-4, Falcon): their config.json keys as tests/hf/ copies them from each model's page."""
    sys.path.insert(0, str(ROOT))
    from tests.hf.test_cohere import COMMAND_R
    from tests.hf.test_falcon import FALCON_7B, FALCON_40B
    from tests.hf.test_glm import GLM4_9B
    from tests.hf.test_granite import GRANITE_3_8B
    from tests.hf.test_olmo2 import OLMO2_7B
    from tests.hf.test_stablelm import STABLELM_2_1_6B
    from tests.hf.test_starcoder2 import STARCODER2_3B

    return {
        "olmo-2-7b": (("olmo2-7b",), "allenai/OLMo-2-1124-7B", "7.3B", "", OLMO2_7B),
        "granite-3.0-8b": (("granite-3-8b",), "ibm-granite/granite-3.0-8b-base", "8.17B", "", GRANITE_3_8B),
        "starcoder2-3b": ((), "bigcode/starcoder2-3b", "3.03B", "", STARCODER2_3B),
        "command-r": (("c4ai-command-r",), "CohereForAI/c4ai-command-r-v01", "35B", "", COMMAND_R),
        "stablelm-2-1.6b": ((), "stabilityai/stablelm-2-1_6b", "1.64B", "", STABLELM_2_1_6B),
        "glm-4-9b": ((), "THUDM/glm-4-9b-hf", "9.4B", "", GLM4_9B),
        "falcon-7b": ((), "tiiuae/falcon-7b", "7B", "", FALCON_7B),
        "falcon-40b": ((), "tiiuae/falcon-40b", "40B", "", FALCON_40B),
    }


def _llama4() -> dict[str, tuple[tuple[str, ...], str, str, str, dict[str, Any]]]:
    """Llama 4's text models (issue #23): their config.json keys as tests/hf/test_llama4.py copies them."""
    sys.path.insert(0, str(ROOT))
    from tests.hf.test_llama4 import MAVERICK, SCOUT

    vision = "the text model (the page's count includes the vision tower)"
    return {
        "llama-4-scout-17b-16e": (
            ("llama-4-scout",),
            "meta-llama/Llama-4-Scout-17B-16E",
            "109B total, 17B active",
            vision,
            SCOUT,
        ),
        "llama-4-maverick-17b-128e": (
            ("llama-4-maverick",),
            "meta-llama/Llama-4-Maverick-17B-128E",
            "400B total, 17B active",
            vision,
            MAVERICK,
        ),
    }


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, float):
        return repr(value)
    return str(value)


def preset_text(name: str) -> str:
    """The preset file of ``name``: its header and the ``[model]`` table memplan's importer reads from the
    config (fields at their ModelConfig default left out)."""
    from memplan.presets.hf import hf_notes, model_from_hf_config

    aliases, repo, rounded, note, cfg = PRESETS[name]
    model = model_from_hf_config(cfg, name)
    total, active = transformers_count(cfg)
    if model.moe is None:
        assert active == total
    fields = model.model_dump(mode="json", exclude_defaults=True, exclude={"name", "moe", "mla"})
    imported = hf_notes(cfg).replace("imported from a Hugging Face config.json (model_type ", "model_type ")
    imported = imported.replace(")", "", 1)  # "model_type X; …"
    notes = "; ".join(n for n in (note, imported) if n)
    lines = [f'name = "{name}"']
    if aliases:
        lines.append("aliases = [" + ", ".join(f'"{a}"' for a in aliases) + "]")
    lines.append(f'source = "https://huggingface.co/{repo}/blob/main/config.json"')
    lines.append(f'notes = "{notes}"')
    lines.append(
        f"# {total:,}: transformers' own count (AutoModelForCausalLM on the published config.json, "
        f"scripts/make_presets.py); the model page says {rounded}"
    )
    lines.append(f"published_params = {total}")
    if model.moe is not None:
        lines.append(f"# {active:,}: the same less the (E - top_k) / E of each layer's experts a token skips")
        lines.append(f"published_active_params = {active}")
    lines += ["", "[model]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in fields.items()]
    if model.mla is not None:
        lines += ["", "[model.mla]"]
        mla = model.mla.model_dump(mode="json", exclude_none=True)
        lines += [f"{k} = {_toml_value(v)}" for k, v in mla.items()]
    if model.moe is not None:
        lines += ["", "[model.moe]"]
        moe = model.moe.model_dump(mode="json", exclude_defaults=True)
        lines += [f"{k} = {_toml_value(v)}" for k, v in moe.items()]
    return "\n".join(lines) + "\n"


def transformers_count(cfg: dict[str, Any]) -> tuple[int, int]:
    """transformers' parameter count of the config: all, and active (a mixture of experts: less the
    fraction (E - k) / E of the routed experts' parameters, ``.experts.`` in their names)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    # rope_scaling has no parameters (and transformers' validation of it wants every key of the file)
    cfg = {k: v for k, v in cfg.items() if k != "rope_scaling"}
    config = AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    e = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts")
    k = cfg.get("num_experts_per_tok")
    skipped = experts * (e - k) // e if e else 0
    assert not e or experts * (e - k) % e == 0
    return total, total - skipped


def main() -> None:
    sys.path.insert(0, str(ROOT))
    PRESETS.update(_dense_families())
    PRESETS.update(_llama4())
    if "--count" in sys.argv:
        for name, (*_, cfg) in PRESETS.items():
            print(f'"{name}": {transformers_count(dict(cfg))},')
        return
    for name in sys.argv[1:] or PRESETS:
        (ROOT / "presets/models" / f"{name}.toml").write_text(preset_text(name))


if __name__ == "__main__":
    main()
