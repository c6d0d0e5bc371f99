"""Mixture of experts: parameter counts (total and active), inventory, FLOPs, expert parallelism, presets
and Hugging Face imports.

Golden counts: Mixtral-8x7B-v0.1, 46,702,792,704 parameters (the safetensors count on
huggingface.co/mistralai/Mixtral-8x7B-v0.1, "46.7B") and 12,879,925,248 active ("12.9B", Jiang et al. 2024:
2 of 8 experts per token); Qwen1.5-MoE-A2.7B, 14,315,784,192 (safetensors count on
huggingface.co/Qwen/Qwen1.5-MoE-A2.7B, "14.3B") and 2,689,173,504 active (4 of 60 experts + the shared
expert; the model card's "2.7B").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.analytic.params import count_params
from memplan.config import (
    Attention,
    Checkpointing,
    MoEConfig,
    Parallel,
    Setup,
    StrategyConfig,
    TrainingConfig,
    ZeroStage,
)
from memplan.contract import to_json
from memplan.presets import load_model_preset, model_names

from .layout import plan

MIXTRAL_TOTAL, MIXTRAL_ACTIVE = 46_702_792_704, 12_879_925_248
QWEN_TOTAL, QWEN_ACTIVE = 14_315_784_192, 2_689_173_504

MIXTRAL_HF = {  # huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json (also tests/hf's)
    "architectures": ["MixtralForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mixtral",
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "vocab_size": 32000,
}
QWEN_HF = {  # huggingface.co/Qwen/Qwen1.5-MoE-A2.7B/blob/main/config.json
    "model_type": "qwen2_moe",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "max_position_embeddings": 8192,
    "num_attention_heads": 16,
    "num_hidden_layers": 24,
    "num_key_value_heads": 16,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "vocab_size": 151936,
    "decoder_sparse_step": 1,
    "moe_intermediate_size": 1408,
    "shared_expert_intermediate_size": 5632,
    "num_experts_per_tok": 4,
    "num_experts": 60,
    "norm_topk_prob": False,
}


@pytest.mark.parametrize(
    ("name", "total", "active"),
    [("mixtral-8x7b", MIXTRAL_TOTAL, MIXTRAL_ACTIVE), ("qwen1.5-moe-a2.7b", QWEN_TOTAL, QWEN_ACTIVE)],
)
def test_published_total_and_active(name: str, total: int, active: int) -> None:
    pm = load_model_preset(name)
    assert pm.model.moe is not None
    counts = count_params(pm.model)
    assert (counts.total, counts.active) == (total, active)
    assert (pm.published_params, pm.published_active_params) == (total, active)


def test_mixtral_layer_breakdown() -> None:
    layer = count_params(load_model_preset("mixtral").model).moe
    assert layer is not None
    assert layer.router == 4096 * 8  # router h×8 per layer
    assert layer.expert == 3 * 4096 * 14336  # w1, w3: h×ffn; w2: ffn×h
    assert layer.shared == 0


def test_shipped_moe_presets_and_aliases() -> None:
    moe = [n for n in model_names() if load_model_preset(n).model.moe is not None]
    assert moe == [
        "deepseek-v2",
        "deepseek-v2-lite",
        "deepseek-v3",
        "gpt-oss-120b",
        "gpt-oss-20b",
        "llama-4-maverick-17b-128e",
        "llama-4-scout-17b-16e",
        "mixtral-8x22b",
        "mixtral-8x7b",
        "phi-3.5-moe",
        "qwen1.5-moe-a2.7b",
        "qwen3-235b-a22b",
        "qwen3-30b-a3b",
    ]
    assert load_model_preset("Mixtral").name == "mixtral-8x7b"
    assert load_model_preset("qwen-moe").name == "qwen1.5-moe-a2.7b"
    assert load_model_preset("70b").model.moe is None  # dense presets in the same world
    with pytest.raises(ValueError, match=r"did you mean mixtral-8x7b"):
        load_model_preset("mixtral-8x7")


def mixtral_setup(**strategy: object) -> Setup:
    return Setup(
        model=load_model_preset("mixtral").model,
        training=TrainingConfig(seq_len=4096),
        strategy=StrategyConfig(**strategy),  # type: ignore[arg-type]
    )


def test_six_n_counts_active_parameters() -> None:
    p = plan(mixtral_setup())
    assert p.six_n == 6 * MIXTRAL_ACTIVE * 4096
    assert to_json(p)["params"]["active"] == MIXTRAL_ACTIVE


def test_forward_flops_are_2_active_matmul_params_per_token() -> None:
    # Every active parameter but the embedding gather and the norms is a matmul weight used once per
    # token (×2 multiply-add); attention's QKᵀ and P·V come on top.
    p = plan(mixtral_setup())
    t, h, layers, heads, d = 4096, 4096, 32, 32, 128
    matmul_params = MIXTRAL_ACTIVE - 32000 * h - (2 * layers + 1) * h
    # QKᵀ and P·V per layer: 2 products of [s, d]·[d, s] (or [s, s]·[s, d]) per head, 2·s·s·d FLOPs each.
    core = layers * 2 * heads * (2 * t * t * d)
    assert p.flops.forward == 2 * t * matmul_params + core
    # Backward: 2× every matmul; the flash kernel's five s×s products = 2.5× the core's forward.
    assert p.flops.backward == 2 * (p.flops.forward - core) + 5 * core // 2


def test_inventory_routes_t_times_k_slots() -> None:
    kept = {k.name: k for k in plan(mixtral_setup()).pieces.kept}
    assert "mlp.gate" not in kept and "mlp.input" in kept
    t = 4096
    assert kept["moe.gate"].shape == (2 * t, 14336)  # top-2: every token in two experts
    assert kept["moe.expert_input"].shape == (2 * t, 4096)
    assert kept["moe.router_probs"].shape == (t, 8) and kept["moe.router_probs"].dtype.value == "fp32"
    assert kept["moe.gate"].count == 32


def test_capacity_factor_pads_every_expert_to_capacity() -> None:
    # Megatron-Core get_capacity: ceil(T·k/E · c) slots per expert.
    moe = MoEConfig(experts=8, top_k=2, capacity_factor=1.25)
    assert moe.slots(4096) == 8 * 1280
    assert MoEConfig(experts=60, top_k=4, capacity_factor=1.0).slots(1000) == 60 * 67  # ceil(66.67)


def test_expert_parallel_holds_e_over_ep_experts_sharded_over_dp_over_ep() -> None:
    one_expert = 3 * 4096 * 14336
    whole = plan(mixtral_setup(dp=8)).device
    split = plan(mixtral_setup(dp=8), Parallel(ep=8)).device
    assert whole.params.total - split.params.total == 32 * 7 * one_expert
    # ZeRO-1 over dp = 8: dense states /8, expert states over dp/ep = 1 (each rank owns its experts).
    z1 = plan(mixtral_setup(dp=8, zero=ZeroStage.OPTIMIZER), Parallel(ep=8)).device
    dense = z1.params.total - 32 * one_expert
    assert z1.states.optimizer == 12 * (-(-dense // 8) + 32 * one_expert)


def test_expert_parallel_mistakes() -> None:
    with pytest.raises(
        ValueError, match=r"^ep: 3 does not divide the 8 experts of mixtral-8x7b; use --ep 1, 2, 4, 8$"
    ):
        plan(mixtral_setup(dp=3), Parallel(ep=3))
    with pytest.raises(ValueError, match=r"^ep: expert parallelism takes its 4 ranks from data parallelism"):
        plan(mixtral_setup(dp=2), Parallel(ep=4))


def test_moe_tensor_parallel_and_checkpointing_run() -> None:
    pm = load_model_preset("qwen1.5-moe-a2.7b")
    setup = Setup(
        model=pm.model,
        training=TrainingConfig(seq_len=4096, grad_accum=4),
        strategy=StrategyConfig(checkpointing=Checkpointing.SELECTIVE, attention=Attention.FLASH, dp=4),
    )
    one = plan(setup).device
    split = plan(setup, Parallel(tp=2, sp=True, pp=2, ep=4)).device
    assert split.peak.bytes < one.peak.bytes and split.activations < one.activations


# ----------------------------------------------------------------------------------------------------
# Hugging Face config.json
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("cfg", "preset"), [(MIXTRAL_HF, "mixtral-8x7b"), (QWEN_HF, "qwen1.5-moe-a2.7b")])
def test_hf_moe_config_imports_to_the_preset(tmp_path: Path, cfg: dict[str, object], preset: str) -> None:
    folder = tmp_path / "Some-MoE"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    imported, shipped = load_model_preset(str(folder / "config.json")), load_model_preset(preset)
    assert imported.name == "Some-MoE" and imported.model.moe == shipped.model.moe
    assert imported.model.model_dump(exclude={"name"}) == shipped.model.model_dump(exclude={"name"})
    assert imported.published_params is None


def test_hf_moe_with_dense_layers_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**QWEN_HF, "decoder_sparse_step": 2}))
    with pytest.raises(
        ValueError, match=r"decoder_sparse_step: dense layers between MoE layers are not modelled"
    ):
        load_model_preset(str(path))


def test_moe_preset_file_by_path_and_its_errors(tmp_path: Path) -> None:
    text = (Path(__file__).parents[2] / "presets/models/mixtral-8x7b.toml").read_text()
    good = tmp_path / "mine.toml"
    good.write_text(text.replace('name = "mixtral-8x7b"', 'name = "mine"'))
    assert load_model_preset(str(good)).model.moe == load_model_preset("mixtral").model.moe
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace("top_k = 2 ", "top_k = 9 "))
    with pytest.raises(
        ValueError, match=r"bad\.toml: model\.moe: top_k: 9 exceeds the 8 experts; use top_k ≤ experts$"
    ):
        load_model_preset(str(bad))
