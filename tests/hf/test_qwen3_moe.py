"""transformers' ``modeling_qwen3_moe.py`` against ``--impl hf``: Qwen2-MoE's router and grouped experts
without the shared expert, Qwen3's q/k norms, a sliding window on every layer. Small widths, under fake
tensors (SDPA and eager, transformers' checkpointing on and off, use_cache on and off) and on real tensors
with the routing the random router chose; every layer's bytes, the total and the FLOPs exact. The full-size
import is checked against the published count (Qwen3-30B-A3B: 30.5B total, 3.3B active)."""

from __future__ import annotations

from typing import Any

import pytest

from memplan.analytic.params import count_params
from memplan.config import Family
from memplan.engine import estimate
from memplan.measure.frameworks.hf import measure_hf
from memplan.presets import load_model_preset
from memplan.presets.hf import model_from_hf_config
from tests.grids import pairwise_cases
from tests.hf.harness import MOE_WIDTHS, exact_realised_routing, hf_setup
from tests.hf.harness import exact_moe as exact

# huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json (the keys memplan reads)
QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

SMALL = {
    **MOE_WIDTHS,
    "moe": {"experts": 8, "top_k": 2, "norm_topk_prob": True},
}
SEQ = 64


def test_qwen3_moe_import_and_count() -> None:
    """Per layer: q 2048·4096, k and v 2048·512 each, o 4096·2048 (18,874,368); q/k norms 2·128; two
    norms 2·2048; router 128·2048 (262,144); 128 experts of 3·2048·768 (603,979,776): 623,120,640.
    48 layers, untied embedding and head 2·151,936·2048 and the final norm 2048: 30,532,122,624 (the
    page's 30.5B). Active: less 120 of 128 experts per layer, 48·120·3·2048·768 = 27,179,089,920:
    3,353,032,704 (the page's 3.3B activated)."""
    m = model_from_hf_config(QWEN3_30B_A3B, "qwen3-30b-a3b")
    layer = (
        2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048 + 2 * 128 + 2 * 2048 + 128 * 2048 + 128 * 3 * 2048 * 768
    )
    assert layer == 623_120_640
    total = 48 * layer + 2 * 151_936 * 2048 + 2048
    assert count_params(m).total == total == 30_532_122_624
    assert count_params(m).active == total - 48 * 120 * 3 * 2048 * 768 == 3_353_032_704
    assert m.code_family is Family.QWEN3_MOE and m.qk_norm and m.moe is not None
    assert (m.moe.experts, m.moe.top_k, m.moe.shared_experts, m.moe.renormalises) == (128, 8, 0, True)
    assert m.sliding_window is None
    assert load_model_preset("qwen3-30b-a3b").model == m.model_copy(update={"name": "qwen3-30b-a3b"})


def test_qwen3_moe_window_covers_every_layer() -> None:
    """``Qwen3MoeConfig.__post_init__``: sliding_window if use_sliding_window, on every layer
    (no max_window_layers, unlike Qwen2/Qwen3 dense)."""
    m = model_from_hf_config({**QWEN3_30B_A3B, "use_sliding_window": True, "sliding_window": 4096}, "q")
    assert m.sliding_window == 4096


def small(**kw: Any) -> Any:
    base = load_model_preset("qwen3-30b-a3b").model
    return hf_setup(base, seq=SEQ, **(SMALL | kw))


@pairwise_cases("attention, checkpointing, use_cache", ["flash", "eager"], ["none", "full"], [True, False])
def test_qwen3_moe_exact(attention: str, checkpointing: str, use_cache: bool) -> None:
    setup = small(attention=attention, checkpointing=checkpointing, use_cache=use_cache)
    exact(estimate(setup), measure_hf(setup))


@pytest.mark.parametrize("attention", ["flash", "eager"])
def test_qwen3_moe_sliding_window(attention: str) -> None:
    """A window shorter than the sequence: transformers builds the sliding-window mask on every layer."""
    setup = small(attention=attention, sliding_window=16)
    exact(estimate(setup), measure_hf(setup))


@pytest.mark.parametrize("experts", ["grouped_mm", "eager"])
def test_qwen3_moe_realised_routing(experts: str) -> None:
    """Real tensors, the random router's unbalanced choice: the bytes and FLOPs do not depend on it."""
    exact_realised_routing(small(), experts, routed=SEQ * 2)


def test_qwen3_moe_refuses_a_shared_expert() -> None:
    with pytest.raises(ValueError, match=r"^shared_experts: qwen3_moe has none"):
        estimate(small(moe={"experts": 8, "top_k": 2, "shared_experts": 1, "shared_ffn": 32}))
