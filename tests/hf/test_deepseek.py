"""transformers' ``modeling_deepseek_v3.py`` and ``modeling_deepseek_v2.py`` against ``--impl hf``:
multi-head latent attention (the q and kv latents, their norms, q and k assembled by cat / copy, v a view of
``kv_b_proj``'s output), DeepSeek's routers (V3's sigmoid with group-limited top-k and renormalisation, V2's
softmax, greedy or group-limited), routed experts with shared ones, and the first layers dense. Small widths
under fake tensors (SDPA, which on CPU runs the math kernel for MLA, and eager; transformers' checkpointing
on and off; use_cache on and off; b = 1 and 2): every layer's bytes (dense and MoE layers apart), the total,
every tensor and the FLOPs per phase exact. The full-size imports are checked against transformers' own
parameter count, derived by hand here (DeepSeek-V3: 671B total, 37B activated)."""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

import pytest

from memplan.analytic.params import count_params
from memplan.api import build_setup
from memplan.blocks.inventory import Role
from memplan.config import (
    AttentionChoice,
    Device,
    Family,
    Impl,
    ImplConfig,
    ModelConfig,
    Parallel,
    Setup,
)
from memplan.engine import Result, estimate
from memplan.measure.compare.tensors import estimated_layers
from memplan.measure.frameworks.hf import measure_hf
from memplan.measure.frameworks.hf_config import keys_of
from memplan.measure.instruments.measured import Measured
from memplan.presets import load_model_preset
from memplan.presets.hf import model_from_hf_config
from tests.hf.harness import check_hf, hf_setup, with_experts

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from make_presets import PRESETS

V3_SMALL: dict[str, Any] = {
    "name": "deepseek-v3-small",
    "family": "deepseek_v3",
    "hidden_size": 64,
    "num_heads": 4,
    "num_kv_heads": 4,
    "head_dim": 8,
    "ffn_size": 32,
    "vocab_size": 128,
    "norm_eps": 1e-6,
    "mla": {
        "q_lora_rank": 24,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 12,
    },
    "moe": {
        "experts": 8,
        "top_k": 2,
        "shared_experts": 1,
        "dense_layers": 1,
        "dense_ffn": 96,
        "scoring": "sigmoid",
        "groups": 2,
        "topk_groups": 1,
        "norm_topk_prob": True,
    },
}
V2_MOE = {
    "experts": 8,
    "top_k": 2,
    "shared_experts": 2,
    "dense_layers": 1,
    "dense_ffn": 96,
    "norm_topk_prob": False,
}
SEQ = 64


def small(model: dict[str, Any], **kw: Any) -> Setup:
    return hf_setup(ModelConfig(**model, num_layers=3), layers=3, seq=SEQ, **kw)


def v2(moe: dict[str, Any], q_lora_rank: int | None = 24) -> dict[str, Any]:
    mla = {**V3_SMALL["mla"], "q_lora_rank": q_lora_rank}
    return {**V3_SMALL, "name": "deepseek-v2-small", "family": "deepseek_v2", "mla": mla, "moe": moe}


def exact(setup: Setup) -> tuple[Result, Measured]:
    """Bytes per layer, in total and per tensor (``check_hf``: a dense and an MoE layer), and FLOPs."""
    est, meas = check_hf(setup)
    f = est.flops
    assert (f.forward, f.backward, f.recompute) == tuple(
        meas.flops[k] for k in ("forward", "backward", "recompute")
    )
    return est, meas


@pytest.mark.parametrize(
    ("checkpointing", "use_cache"), [("none", True), ("none", False), ("full", True)]
)  # transformers' checkpointing runs the layers without a cache either way
@pytest.mark.parametrize("attention", ["flash", "eager"])
def test_deepseek_v3_exact(attention: str, checkpointing: str, use_cache: bool) -> None:
    setup = small(V3_SMALL, attention=attention, checkpointing=checkpointing, use_cache=use_cache)
    _, meas = exact(setup)
    if checkpointing == "none":  # the dense first layer keeps less than the MoE layers
        assert meas.layer_bytes(0) < meas.layer_bytes(1) == meas.layer_bytes(2)


@pytest.mark.parametrize("attention", ["flash", "eager"])
def test_deepseek_v3_batch_two_without_cache(attention: str) -> None:
    """b = 2: eager's matmul copies v (a strided view of kv_b_proj's output) instead of viewing it."""
    exact(small(V3_SMALL, attention=attention, batch=2, use_cache=False))


@pytest.mark.parametrize("experts", ["grouped_mm", "eager"])
def test_deepseek_v3_realised_routing(experts: str) -> None:
    """Real tensors, the random router's unbalanced group-limited choice (T·k = 128 slots per MoE layer):
    the bytes and FLOPs do not depend on it; transformers' eager experts loop keeps E pieces whose rows sum
    to the estimate's [S, ·] tensors (equal per layer and in total; they pair by bytes, not one to one)."""
    setup = small(V3_SMALL)
    setup = with_experts(setup, experts)
    if experts == "grouped_mm":
        est, meas = check_hf(setup, fake=False)
    else:
        est, meas = estimate(setup), measure_hf(setup, fake=False)
        assert estimated_layers(est) == [meas.layer_bytes(i) for i in range(3)]
        assert est.activations == meas.activations
    assert len(meas.routing) == 2 and all(sum(c) == SEQ * 2 and max(c) > min(c) for c in meas.routing)
    assert (est.flops.forward, est.flops.backward) == (meas.flops["forward"], meas.flops["backward"])


@pytest.mark.parametrize(
    ("moe", "q_lora_rank", "attention", "checkpointing"),
    [
        ({**V2_MOE, "groups": 4, "topk_groups": 2}, 24, "flash", "none"),  # group_limited_greedy
        (V2_MOE, 24, "eager", "none"),  # greedy
        (V2_MOE, None, "flash", "full"),  # V2-Lite's q_proj; the complex freqs_cis kept by the checkpoint
    ],
)
def test_deepseek_v2_exact(
    moe: dict[str, Any], q_lora_rank: int | None, attention: str, checkpointing: str
) -> None:
    exact(small(v2(moe, q_lora_rank), attention=attention, checkpointing=checkpointing))


@pytest.mark.parametrize(
    ("model", "freed"),
    [
        # V3, T = 64, G = 2, topk_group = 1, E = 8: topk(2) per group [64, 2, 2] int64 2,048 B, topk over
        # the group scores [64, 1] int64 512 B, masked_fill's bool mask [64, 8] 512 B: 3,072 B
        (V3_SMALL, [((64, 2, 2), 2048), ((64, 1), 512), ((64, 8), 512)]),
        # V2 group_limited_greedy, G = 4, topk_group = 2: max per group [64, 4] int64 2,048 B, topk over
        # the group scores [64, 2] int64 1,024 B: 3,072 B (its masked_fill mask feeds the kept topk)
        (v2({**V2_MOE, "groups": 4, "topk_groups": 2}), [((64, 4), 2048), ((64, 2), 1024)]),
    ],
)
def test_deepseek_group_routing_saves_are_freed(
    model: dict[str, Any], freed: list[tuple[tuple[int, ...], int]]
) -> None:
    """Why the estimate keeps none of the group choice's saves but V2's mask (``moe.deepseek_router_rules``
    NB): transformers' router, run alone on T = 64 tokens, saves them on nodes whose outputs are read for
    their indices or shape only; they are freed when the router returns, 3,072 B per MoE layer here, and
    the estimate's router keeps exactly the saves still alive."""
    torch = pytest.importorskip("torch")
    from torch.multiprocessing.reductions import StorageWeakRef

    from memplan.measure.frameworks.hf_config import hf_config

    setup = small(model)
    config = hf_config(setup)
    v3 = setup.model.code_family is Family.DEEPSEEK_V3
    if v3:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter as Router
    else:
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter as Router
    torch.manual_seed(0)
    router = Router(config)
    torch.nn.init.normal_(router.weight)
    saved: list[tuple[tuple[int, ...], int, Any]] = []

    def pack(t: Any) -> Any:
        storage = t.untyped_storage()
        saved.append((tuple(t.shape), storage.nbytes(), StorageWeakRef(storage)))
        return t

    hidden = torch.randn(1, SEQ, 64, dtype=torch.bfloat16, requires_grad=True)  # the setup's bf16
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, weights, _ = router(hidden)
    gc.collect()
    assert [(shape, n) for shape, n, ref in saved if ref.expired()] == freed
    assert sum(n for _, n in freed) == 3072
    weight = StorageWeakRef(router.weight.untyped_storage()).cdata  # F.linear's weight: a parameter
    alive = {ref.cdata: n for _, n, ref in saved if not ref.expired() and ref.cdata != weight}
    kept = [t for t in estimate(setup).tensors if t.role is Role.ROUTER]  # one MoE layer's each
    assert sum(t.bytes for t in kept) == sum(alive.values())  # storage-deduplicated
    assert weights.shape == (SEQ, 2)


def test_deepseek_v3_small_saves_by_hand() -> None:
    """The attention's saves of one layer (bf16, b 1, s 64, SDPA's math kernel), derived from the code:
    attn.input 64·64·2; q_a norm: fp32 x 64·24·4, rstd 64·4, normalised 64·24·2, q_b input 64·24·2; kv_a
    norm: 64·16·4, 64·4, 64·16·2, kv_b input 64·16·2; math kernel: q·√scale and k·√scale fp32 4·64·24·4
    each, v upcast 4·64·12·4, probabilities 4·64·64·4; o_proj input 64·4·12·2."""
    est = estimate(small(V3_SMALL))
    attn = {k.name: k.bytes for k in est.tensors if k.name.startswith("attn.")}
    assert attn == {
        "attn.input": 64 * 64 * 2,
        "attn.q_a_norm.input": 64 * 24 * 4,
        "attn.q_a_norm.rstd": 64 * 4,
        "attn.q_a_norm.normed": 64 * 24 * 2,
        "attn.q_b_input": 64 * 24 * 2,
        "attn.kv_a_norm.input": 64 * 16 * 4,
        "attn.kv_a_norm.rstd": 64 * 4,
        "attn.kv_a_norm.normed": 64 * 16 * 2,
        "attn.kv_b_input": 64 * 16 * 2,
        "attn.q": 4 * 64 * 24 * 4,
        "attn.k": 4 * 64 * 24 * 4,
        "attn.v": 4 * 64 * 12 * 4,
        "attn.probs": 4 * 64 * 64 * 4,
        "attn.out": 64 * 4 * 12 * 2,
    }


def test_deepseek_v3_flops_by_hand() -> None:
    """Forward FLOPs, T = 64 tokens, 3 layers (1 dense): per layer q_a 2·64·64·24, q_b 2·64·24·(4·24),
    kv_a 2·64·64·(16 + 8), kv_b 2·64·16·(4·28), o 2·64·48·64, QKᵀ 2·4·64²·24 and P·V 2·4·64²·12; the
    dense MLP 3·2·64·64·96; an MoE layer's router 2·64·64·8, 128 slots through 3·2·128·64·32 and the shared
    expert 3·2·64·64·32; the head 2·64·64·128."""
    t = 64
    attn = 2 * t * (64 * 24 + 24 * 96 + 64 * 24 + 16 * 112 + 48 * 64) + 2 * 4 * 64 * 64 * (24 + 12)
    dense = 3 * 2 * t * 64 * 96
    moe = 2 * t * 64 * 8 + 3 * 2 * (2 * t) * 64 * 32 + 3 * 2 * t * 64 * 32
    f = estimate(small(V3_SMALL)).flops
    assert f.forward == 3 * attn + dense + 2 * moe + 2 * t * 64 * 128


def test_deepseek_v3_import_and_count() -> None:
    """Per layer, MLA: q_a 7168·1536, q_a norm 1536, q_b 1536·128·192, kv_a 7168·576, kv_a norm 512,
    kv_b 512·128·256, o 128·128·7168 (187,107,328); two norms 2·7168. The first 3 layers' MLP
    3·7168·18432; the other 58 a router 256·7168, 256 experts of 3·7168·2048 and one shared expert
    3·7168·2048. Untied embedding and head 2·129,280·7168, final norm 7168: 671,026,404,352 (the card's
    671B). Active: less 58 · 248 unused experts · 3·7168·2048: 37,552,282,624 (the card's 37B)."""
    cfg = PRESETS["deepseek-v3"][4]
    m = model_from_hf_config(cfg, "deepseek-v3")
    attn = 7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256 + 128 * 128 * 7168
    assert attn == 187_107_328
    dense = attn + 2 * 7168 + 3 * 7168 * 18432
    moe = attn + 2 * 7168 + 256 * 7168 + 257 * 3 * 7168 * 2048
    total = 3 * dense + 58 * moe + 2 * 129_280 * 7168 + 7168
    assert count_params(m).total == total == 671_026_404_352
    assert count_params(m).active == total - 58 * 248 * 3 * 7168 * 2048 == 37_552_282_624
    assert m.code_family is Family.DEEPSEEK_V3 and m.moe is not None and m.mla is not None
    assert (m.moe.dense_layers, m.moe.groups, m.moe.topk_groups, m.moe.sigmoid) == (3, 8, 4, True)
    assert load_model_preset("deepseek-v3").model == m.model_copy(update={"name": "deepseek-v3"})
    assert "MTP" in (load_model_preset("deepseek-v3").notes or "")


def test_deepseek_v2_lite_import_and_count() -> None:
    """V2-Lite: q_proj 2048·16·192 (no q_lora_rank), kv_a 2048·576 + 512, kv_b 512·16·256, o 16·128·2048;
    the first layer's MLP 3·2048·10944, the other 26 a router 64·2048 and 66 experts (64 routed, 2 shared)
    of 3·2048·1408; untied 2·102,400·2048 and the final norm: 15,706,484,224 (the card's 15.7B)."""
    m = model_from_hf_config(PRESETS["deepseek-v2-lite"][4], "deepseek-v2-lite")
    attn = 2048 * 16 * 192 + 2048 * 576 + 512 + 512 * 16 * 256 + 16 * 128 * 2048
    dense = attn + 2 * 2048 + 3 * 2048 * 10944
    moe = attn + 2 * 2048 + 64 * 2048 + 66 * 3 * 2048 * 1408
    assert count_params(m).total == dense + 26 * moe + 2 * 102_400 * 2048 + 2048 == 15_706_484_224
    assert m.mla is not None and m.mla.q_lora_rank is None
    assert m.moe is not None and m.moe.groups is None and not m.moe.renormalises


def test_deepseek_v3_estimate_answers_at_full_size() -> None:
    """``memplan estimate -m deepseek-v3 --seq 4096 --impl hf --attention eager`` answers (torch-free); the
    default implementation and CUDA's SDPA are refused in one line naming the fix."""
    setup = build_setup(
        "deepseek-v3", seq=4096, impl=ImplConfig(impl=Impl.HF), attention=AttentionChoice.EAGER
    )
    assert estimate(setup).params.total == 671_026_404_352
    with pytest.raises(ValueError, match=r"mla: modelled for transformers' code only; add --impl hf"):
        estimate(build_setup("deepseek-v3", seq=4096))
    with pytest.raises(ValueError, match=r"^attention: torch's CUDA SDPA runs deepseek_v3's MLA"):
        estimate(build_setup("deepseek-v3", seq=4096, impl=ImplConfig(impl=Impl.HF), device=Device.CUDA))


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"parallel": Parallel(pp=2)}, r"impl: --impl hf with --pp is not modelled"),
        (
            {"checkpointing": "every-2"},
            r"^checkpointing: selective and every-K checkpointing of deepseek_v3's layers",
        ),
    ],
)
def test_deepseek_refuses_what_is_not_modelled(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        hf, eager = ImplConfig(impl=Impl.HF), AttentionChoice.EAGER
        estimate(build_setup("deepseek-v3", seq=4096, impl=hf, attention=eager, **kw))


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (
            {"topk_method": "noaux_tc"},
            r"topk_method: 'noaux_tc' is not in transformers' DeepseekV2TopkRouter",
        ),
        ({"mlp_bias": True}, r"mlp_bias: biases on the dense and shared MLPs only are not modelled"),
        (
            {"output_router_logits": True},
            r"output_router_logits: the router's auxiliary loss is not modelled",
        ),
        ({"num_key_value_heads": 16}, r"num_key_value_heads: MLA expands its latent to every head"),
    ],
)
def test_deepseek_import_refuses_what_is_not_modelled(keys: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        model_from_hf_config({**PRESETS["deepseek-v2"][4], **keys}, "x")


@pytest.mark.parametrize("model", [V3_SMALL, v2({**V2_MOE, "groups": 4, "topk_groups": 2}), v2(V2_MOE, None)])
def test_deepseek_keys_read_back(model: dict[str, Any]) -> None:
    """The config keys ``--impl hf`` passes transformers (``hf_config.deepseek_keys``) import back to the
    same model (``presets.hf.deepseek``): what the measurement runs is what the estimate reads."""
    setup = small(model)
    keys = keys_of(setup) | {"model_type": setup.model.code_family.value}
    back = model_from_hf_config(keys, setup.model.name)
    assert back == setup.model.model_copy(update={"max_positions": back.max_positions})


# A small DeepSeek-V3 config.json with every key the published one has (YaRN rope_scaling, scoring_func,
# topk_method, num_nextn_predict_layers: keys memplan does not read, kept as the file has them).
V3_FILE: dict[str, Any] = {
    "model_type": "deepseek_v3",
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "q_lora_rank": 24,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 12,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "vocab_size": 128,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "num_nextn_predict_layers": 1,
}


def test_deepseek_v3_from_its_config_file() -> None:
    """``trace --impl hf`` on a config.json builds transformers' model from the file itself: every key of
    it reaches transformers, and the run equals the estimate of memplan's import of the same file."""
    m = model_from_hf_config(V3_FILE, "v3-file")
    assert m.model_copy(update={"name": V3_SMALL["name"], "max_positions": 4096}) == ModelConfig(
        **V3_SMALL, num_layers=3
    )
    setup = hf_setup(m, layers=3, seq=SEQ)
    meas = measure_hf(setup, document=V3_FILE)
    est = estimate(setup)
    assert meas.activations == est.activations
    assert meas.flops["forward"] == est.flops.forward


def test_deepseek_v3_step_time_gemms() -> None:
    """The step-time model's GEMM shapes of an MoE layer (``time.gemm.layer_gemms``: MLA's five
    projections, the router, the experts' grouped launch, the shared expert) and of eager attention's core
    (QKᵀ over d_n + d_r = 24, P·V over d_v = 12) do the FLOPs the estimate counts."""
    from memplan.analytic.flops import layer_linear_flops
    from memplan.blocks.attention.flops import attention_core_flops
    from memplan.blocks.inventory import Dims
    from memplan.time.gemm import attention_core_gemms, layer_gemms

    setup = small(V3_SMALL, attention="eager")
    dims = Dims.of(setup)
    assert sum(g.flops for g in layer_gemms(setup)) == layer_linear_flops(setup, dims)
    assert (
        sum(g.flops for g in attention_core_gemms(setup))
        == attention_core_flops(dims)
        == 2 * 4 * 64 * 64 * 36
    )
