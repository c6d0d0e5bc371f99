"""A memplan ``ModelConfig`` as the transformers config of its family (``ModelConfig.code_family``).

One function per family group (``KEYS``) gives the config keys of ``AutoConfig.for_model``; keys a family
does not take are never passed. When the model came from a config.json (a file or a Hub id),
``hf_config_of_file`` builds transformers' config from that file itself, every key of it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from memplan.config import Family, GateActivation, MlpType, Setup

INSTALL = "pip install 'memplan[hf]'"


def require_transformers() -> Any:
    """The ``transformers`` module, or a one-line ``ValueError`` saying how to install it."""
    try:
        import transformers
    except ImportError:
        raise ValueError(
            f"impl: --impl hf runs Hugging Face transformers, not installed; {INSTALL}"
        ) from None
    return transformers


def hf_config(setup: Setup) -> Any:
    """The transformers config of ``setup.model`` for its family."""
    transformers = require_transformers()
    return transformers.AutoConfig.for_model(setup.model.code_family.value, **keys_of(setup))


def keys_of(setup: Setup) -> dict[str, Any]:
    """Every config key ``hf_config`` passes for ``setup``."""
    m = setup.model
    common = {"vocab_size": m.vocab_size, "tie_word_embeddings": m.tied_embeddings}
    return common | {"use_cache": setup.impl.use_cache} | KEYS[m.code_family](setup)


RUN_KEYS = ("use_cache",)
"""Keys that are the run's, not the model's: always the setup's (``--use-cache / --no-use-cache``)."""


def hf_config_of_file(setup: Setup, document: Mapping[str, Any]) -> Any:
    """transformers' config of the user's own config.json (``AutoConfig.for_model`` on every key of the
    file, as ``from_pretrained`` reads it), with on top only the keys the run changes: those whose value for
    ``setup`` differs from their value for the model memplan read from the same file (an option such as
    ``--dropout``), and the run's own switches (``RUN_KEYS``). A key memplan does not read, or reads
    wrongly, keeps the file's value, so transformers' run differs from the estimate where memplan misreads
    the file.
    A multimodal Gemma-3 config gives its ``text_config`` (the text model memplan estimates)."""
    transformers = require_transformers()
    from memplan.presets.hf import model_from_hf_config, text_config

    doc = dict(text_config(document))
    read = model_from_hf_config(doc, setup.model.name)  # the ValueError of a bad file, as the estimate's
    theirs = keys_of(setup.model_copy(update={"model": read}))
    ours = keys_of(setup)
    changed = {k: v for k, v in ours.items() if k in RUN_KEYS or k not in theirs or theirs[k] != v}
    kind = doc.pop("model_type")
    return transformers.AutoConfig.for_model(kind, **(doc | changed))


def gpt2_keys(setup: Setup) -> dict[str, Any]:
    m = setup.model
    return {
        "n_embd": m.hidden_size,
        "n_layer": m.num_layers,
        "n_head": m.num_heads,
        "n_inner": m.ffn,
        "n_positions": m.max_positions,
        "layer_norm_epsilon": m.norm_eps,
        "attn_pdrop": m.attn_dropout,
        "resid_pdrop": m.resid_dropout,
        "embd_pdrop": m.embd_dropout,
        "activation_function": m.gelu.value,
    }


def gpt_neox_keys(setup: Setup) -> dict[str, Any]:
    """GPT-NeoX: one ``hidden_dropout`` after the attention, the MLP and the embedding (``emb_dropout``)."""
    m = setup.model
    if m.embd_dropout != m.resid_dropout:
        raise ValueError(
            f"embd_dropout: GPT-NeoX's embedding dropout is its hidden_dropout ({m.resid_dropout:g}); set "
            f"embd_dropout to resid_dropout, or use --dropout"
        )
    return {
        "hidden_size": m.hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "intermediate_size": m.ffn,
        "max_position_embeddings": m.max_positions,
        "layer_norm_eps": m.norm_eps,
        "rotary_emb_base": m.rope_theta,
        "attention_dropout": m.attn_dropout,
        "hidden_dropout": m.resid_dropout,
        "hidden_act": m.gelu.value,
        "rotary_pct": m.rotary_pct,
        "use_parallel_residual": m.parallel_residual,
    }


def llama_keys(setup: Setup) -> dict[str, Any]:
    """The Llama-style families (Llama, Mistral, Qwen2/3, Gemma, Phi-3, and the MoEs' common keys)."""
    m = setup.model
    return {
        "hidden_size": m.hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.dim,
        "intermediate_size": m.ffn,
        "max_position_embeddings": m.max_positions,
        "rms_norm_eps": m.norm_eps,
        "rope_theta": m.rope_theta,
        "attention_dropout": m.attn_dropout,
        "attention_bias": m.qkv_bias,
        "hidden_act": hidden_act(setup),
    }


def window_keys(setup: Setup) -> dict[str, Any]:
    """The sliding window as each family's config takes it: Mistral's ``sliding_window`` (None: full
    causal; MistralConfig's default is 4096, so None is passed explicitly); Qwen2/Qwen3's
    ``use_sliding_window`` with the layers i ≥ ``max_window_layers`` sliding (``full_layers``, 0 when
    every layer slides; configuration_qwen2.py's ``layer_types``)."""
    m = setup.model
    if m.code_family is Family.MISTRAL:
        return {"sliding_window": m.sliding_window}
    if m.code_family in (Family.QWEN2, Family.QWEN3):
        on = m.sliding_window is not None
        first = m.full_layers or 0
        return {"use_sliding_window": on, "sliding_window": m.sliding_window, "max_window_layers": first}
    return {}


def hidden_act(setup: Setup) -> str:
    """transformers' ``ACT2FN`` key of the MLP's activation (GeGLU: ``gelu_pytorch_tanh``, a
    ``GELUTanh``: ``gelu(x, approximate="tanh")``)."""
    m = setup.model
    if m.mlp is not MlpType.SWIGLU:
        return "gelu"
    return "gelu_pytorch_tanh" if m.gate_act is GateActivation.GELU_TANH else "silu"


def phi3_keys(setup: Setup) -> dict[str, Any]:
    """Phi-3: the Llama keys and its sliding window (``Phi3Config.sliding_window``)."""
    return llama_keys(setup) | {"sliding_window": setup.model.sliding_window}


def gemma2_keys(setup: Setup) -> dict[str, Any]:
    """Gemma-2 (``Gemma2Config``): the Llama keys, its activation key, softcaps, the query scalar and the
    layer types (every ``sliding_window_pattern``-th layer full, as ``Gemma2Config``'s default)."""
    m = setup.model
    keys = llama_keys(setup)
    keys["hidden_activation"] = keys.pop("hidden_act")
    every = m.sliding_window_pattern
    kinds = [
        "full_attention" if every and (i + 1) % every == 0 else "sliding_attention"
        for i in range(m.num_layers)
    ]
    return keys | {
        "query_pre_attn_scalar": m.query_pre_attn_scalar or m.dim,
        "attn_logit_softcapping": m.attn_softcap,
        "final_logit_softcapping": m.final_softcap,
        "sliding_window": m.sliding_window,
        "layer_types": kinds if m.sliding_window else ["full_attention"] * m.num_layers,
    }


def gemma3_keys(setup: Setup) -> dict[str, Any]:
    """Gemma-3 text (``Gemma3TextConfig``): Gemma-2's keys and the sliding layers' rotary base."""
    m = setup.model
    return gemma2_keys(setup) | {"rope_local_base_freq": m.rope_local_theta or m.rope_theta}


def moe_keys(setup: Setup) -> dict[str, Any]:
    """Mixtral / Qwen2-MoE / Qwen3-MoE: the Llama keys and the experts; no router auxiliary loss
    (``output_router_logits``, as both configs default) and no router jitter (Mixtral)."""
    m, moe = setup.model, setup.model.moe
    assert moe is not None  # NB: blocks.hf.moe.check refuses an MoE family without [model.moe]
    keys = llama_keys(setup) | {"num_experts_per_tok": moe.top_k, "output_router_logits": False}
    if m.code_family is Family.GPT_OSS:  # GptOssConfig: sliding layers alternating with full ones
        every = m.sliding_window_pattern
        kinds = [
            "full_attention" if every and (i + 1) % every == 0 else "sliding_attention"
            for i in range(m.num_layers)
        ]
        return keys | {
            "num_local_experts": moe.experts,
            "sliding_window": m.sliding_window,
            "layer_types": kinds if m.sliding_window else ["full_attention"] * m.num_layers,
        }
    if m.code_family is Family.PHIMOE:  # PhimoeConfig: sparsemixer's top-2, LayerNorm eps as rms_norm_eps
        return keys | {
            "num_local_experts": moe.experts,
            "input_jitter_noise": moe.input_jitter,
            "lm_head_bias": m.head_bias,
            "sliding_window": m.sliding_window,
        }
    if m.code_family is Family.QWEN3_MOE:  # Qwen3MoeConfig: no shared expert; its window on every layer
        return keys | {
            "num_experts": moe.experts,
            "moe_intermediate_size": m.ffn,
            "norm_topk_prob": moe.renormalises,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "use_sliding_window": m.sliding_window is not None,
            "sliding_window": m.sliding_window,
        }
    if m.code_family is Family.QWEN2_MOE:
        return keys | {
            "num_experts": moe.experts,
            "moe_intermediate_size": m.ffn,
            "shared_expert_intermediate_size": moe.shared_width(m),
            "norm_topk_prob": moe.renormalises,
            "decoder_sparse_step": 1,  # every layer an MoE, as memplan's model
            "mlp_only_layers": [],
        }
    # MixtralConfig.sliding_window (default None: full causal), honoured by create_sliding_window_causal_mask.
    return keys | {
        "num_local_experts": moe.experts,
        "router_jitter_noise": 0.0,
        "sliding_window": m.sliding_window,
    }


def llama4_keys(setup: Setup) -> dict[str, Any]:
    """Llama 4 (``Llama4TextConfig``): the Llama keys, the experts (one shared expert as wide as a routed
    one), the dense layers between MoE ones, the NoPE layers, the chunk, the q/k norm and the temperature."""
    m, moe = setup.model, setup.model.moe
    assert moe is not None  # NB: blocks.hf.llama4.check refuses Llama 4 without [model.moe]
    rope = [int(not m.is_nope_layer(i)) for i in range(m.num_layers)]
    kinds = ["chunked_attention" if r and m.attn_chunk else "full_attention" for r in rope]
    return llama_keys(setup) | {
        "num_local_experts": moe.experts,
        "num_experts_per_tok": moe.top_k,
        "output_router_logits": False,
        "interleave_moe_layer_step": m.moe_every or 1,
        "intermediate_size_mlp": m.dense_ffn_size or m.ffn,
        "no_rope_layers": rope,
        "attention_chunk_size": m.attn_chunk,
        "layer_types": kinds,
        "use_qk_norm": m.qk_l2_norm,
        "attn_temperature_tuning": m.attn_temperature,
    }


def starcoder2_keys(setup: Setup) -> dict[str, Any]:
    """StarCoder2 (``Starcoder2Config``): one ``use_bias`` for every linear, LayerNorm's ``norm_epsilon``,
    residual and embedding dropout, the sliding window (None: full causal)."""
    m = setup.model
    if not m.qkv_bias == m.out_bias == m.mlp_bias:
        raise ValueError(
            "qkv_bias: StarCoder2's use_bias sets every linear's bias; "
            "set qkv_bias, out_bias and mlp_bias alike"
        )
    keys = llama_keys(setup)  # the shapes, rope and attention dropout are the same keys
    keys["norm_epsilon"] = keys.pop("rms_norm_eps")
    del keys["attention_bias"]  # use_bias covers every linear
    return keys | {
        "residual_dropout": m.resid_dropout,
        "embedding_dropout": m.embd_dropout,
        "use_bias": m.qkv_bias,
        "hidden_act": m.gelu.value,
        "sliding_window": m.sliding_window,
    }


def cohere_keys(setup: Setup) -> dict[str, Any]:
    """Cohere (``CohereConfig``): the Llama keys with LayerNorm's ``layer_norm_eps``, the q/k norms, and the
    logit scale (a Python float: any value keeps the same tensors; CohereConfig's default)."""
    keys = llama_keys(setup)
    keys["layer_norm_eps"] = keys.pop("rms_norm_eps")
    return keys | {"use_qk_norm": setup.model.qk_norm}


def stablelm_keys(setup: Setup) -> dict[str, Any]:
    """StableLM (``StableLmConfig``): the Llama keys with LayerNorm's ``layer_norm_eps``, ``use_qkv_bias``,
    the partial rotary, the parallel layer, ``hidden_dropout`` (after the MLP) and the per-head q/k
    LayerNorms (``qk_layernorm``)."""
    m = setup.model
    if m.out_bias or m.mlp_bias or m.parallel_residual != m.shared_norm:
        raise ValueError(
            "out_bias: StableLM's o_proj and MLP have no bias and its parallel layer one norm; set out_bias "
            "and mlp_bias false, shared_norm = parallel_residual"
        )
    keys = llama_keys(setup)
    keys["layer_norm_eps"] = keys.pop("rms_norm_eps")
    del keys["attention_bias"]
    return keys | {
        "use_qkv_bias": m.qkv_bias,
        "partial_rotary_factor": m.rotary_pct,
        "use_parallel_residual": m.parallel_residual,
        "hidden_dropout": m.resid_dropout,
        "qk_layernorm": m.qk_norm,
    }


def glm_keys(setup: Setup) -> dict[str, Any]:
    """GLM-4 (``GlmConfig``): the Llama keys and the partial rotary; o_proj has no bias."""
    m = setup.model
    if m.out_bias or m.mlp_bias:
        raise ValueError("out_bias: GLM's o_proj and MLP have no bias; set out_bias and mlp_bias false")
    return llama_keys(setup) | {"partial_rotary_factor": m.rotary_pct}


def falcon_keys(setup: Setup) -> dict[str, Any]:
    """Falcon (``FalconConfig``): multi-query for one kv head with one norm (Falcon-7B), else the new
    decoder architecture with ``num_kv_heads`` and one or two norms (``num_ln_in_parallel_attn``); one
    ``bias`` for every linear; ``hidden_dropout`` once per layer; rotary, never ALiBi."""
    m = setup.model
    if not m.qkv_bias == m.out_bias == m.mlp_bias:
        raise ValueError(
            "qkv_bias: Falcon's bias sets every linear's; set qkv_bias, out_bias and mlp_bias alike"
        )
    multi_query = m.kv_heads == 1 and m.shared_norm
    return {
        "hidden_size": m.hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_heads,
        "num_kv_heads": m.kv_heads,
        "multi_query": multi_query,
        "new_decoder_architecture": not multi_query,
        "parallel_attn": True,
        "num_ln_in_parallel_attn": 1 if m.shared_norm else 2,
        "bias": m.qkv_bias,
        "ffn_hidden_size": m.ffn,
        "activation": m.gelu.value,
        "max_position_embeddings": m.max_positions,
        "layer_norm_epsilon": m.norm_eps,
        "rope_theta": m.rope_theta,
        "attention_dropout": m.attn_dropout,
        "hidden_dropout": m.resid_dropout,
        "alibi": False,
    }


WINDOWED = (Family.MISTRAL, Family.QWEN2, Family.QWEN3)
"""The Llama-style families whose config takes a sliding window (``window_keys``)."""


def deepseek_keys(setup: Setup) -> dict[str, Any]:
    """DeepseekV2Config / DeepseekV3Config: MLA's widths, the routed and shared experts, the dense first
    layers and the router (``presets.hf_deepseek`` reads them back)."""
    m, mla, moe = setup.model, setup.model.mla, setup.model.moe
    if mla is None or moe is None:  # every layer dense: DeepseekV3Config has no such model to build
        raise ValueError(
            "moe: DeepSeek's code is a mixture of experts with MLA; add [model.moe] and [model.mla]"
        )
    keys = llama_keys(setup) | {
        "intermediate_size": moe.dense_ffn or m.ffn,
        "moe_intermediate_size": m.ffn,
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "n_routed_experts": moe.experts,
        "num_experts_per_tok": moe.top_k,
        "n_shared_experts": moe.shared_experts,
        "first_k_dense_replace": moe.dense_layers,
        "n_group": moe.groups,
        "topk_group": moe.topk_groups,
        "output_router_logits": False,
    }
    keys.pop("head_dim")  # derived from qk_rope_head_dim by the config class
    if m.code_family is Family.DEEPSEEK_V3:
        return keys | {"norm_topk_prob": moe.renormalises}
    method = "group_limited_greedy" if moe.groups else "greedy"
    return keys | {"topk_method": method}


KEYS: dict[Family, Callable[[Setup], dict[str, Any]]] = {
    **{f: llama_keys for f in Family},
    **{f: lambda setup: llama_keys(setup) | window_keys(setup) for f in WINDOWED},
    Family.GPT2: gpt2_keys,
    Family.GPT_NEOX: gpt_neox_keys,
    Family.PHI3: phi3_keys,
    Family.STARCODER2: starcoder2_keys,
    Family.COHERE: cohere_keys,
    Family.STABLELM: stablelm_keys,
    Family.GLM: glm_keys,
    Family.FALCON: falcon_keys,
    Family.GEMMA2: gemma2_keys,
    Family.GEMMA3: gemma3_keys,
    Family.MIXTRAL: moe_keys,
    Family.QWEN2_MOE: moe_keys,
    Family.QWEN3_MOE: moe_keys,
    Family.GPT_OSS: moe_keys,
    Family.PHIMOE: moe_keys,
    Family.DEEPSEEK_V2: deepseek_keys,
    Family.DEEPSEEK_V3: deepseek_keys,
    Family.LLAMA4: llama4_keys,
}
