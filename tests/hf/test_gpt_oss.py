"""transformers' ``modeling_gpt_oss.py`` against ``--impl hf``: attention sinks (eager only), sliding-window
layers alternating with full ones, a biased router with a softmax over the top-k logits, grouped experts
with biases and the clamped SwiGLU, an RMSNorm whose product is fp32. Small widths under fake tensors,
with and without transformers' checkpointing, use_cache on and off; real tensors with the routing the
random router chose; each layer's bytes, the total and the FLOPs exact. The full-size import against
transformers' own parameter count (gpt-oss-20b: 20.9B; gpt-oss-120b: 116.8B)."""

from __future__ import annotations

from typing import Any

import pytest

from memplan.analytic.params import count_params
from memplan.config import Family
from memplan.engine import estimate
from memplan.measure.compare.tensors import estimated_layers
from memplan.measure.frameworks.hf import measure_hf
from memplan.presets.hf import model_from_hf_config
from tests.hf.harness import hf_setup, with_experts

# huggingface.co/openai/gpt-oss-20b/blob/main/config.json (the keys that size it)
GPT_OSS_20B: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "num_local_experts": 32,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 150000,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "vocab_size": 201088,
}
SEQ, LAYERS = 64, 2
TINY = {
    **GPT_OSS_20B,
    "hidden_size": 64,
    "intermediate_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": LAYERS,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 128,
    "sliding_window": 16,
    "max_position_embeddings": 256,
}


def test_gpt_oss_20b_count() -> None:
    """Per layer: two RMSNorms 2·2880; q 2880·4096 + 4096, k and v 2880·512 + 512 each, o 4096·2880 + 2880;
    64 sinks; router 2880·32 + 32; 32 experts of gate_up 2880·5760 + 5760 and down 2880·2880 + 2880.
    24 layers, embedding and head 2·201,088·2880, final norm 2880: 20,914,757,184 (transformers' own
    sum(p.numel()) of GptOssForCausalLM on this config; the model card's 21B). Active: less 28 of 32
    experts per layer; the card's 3.6B leaves out the 579,133,440-parameter input embedding."""
    h, f, e = 2880, 2880, 32
    expert = h * 2 * f + 2 * f + f * h + h
    layer = 2 * h + (h * 4096 + 4096) + 2 * (h * 512 + 512) + (4096 * h + h) + 64 + (h * e + e) + e * expert
    total = 24 * layer + 2 * 201_088 * h + h
    m = model_from_hf_config(GPT_OSS_20B, "gpt-oss-20b")
    assert m.code_family is Family.GPT_OSS and m.attn_sinks and m.sliding_window_pattern == 2
    assert count_params(m).total == total == 20_914_757_184
    active = total - 24 * (e - 4) * expert
    assert count_params(m).active == active and active - 201_088 * h == 3_608_307_264


def setup_of(**kw: Any) -> Any:
    return hf_setup(
        model_from_hf_config(TINY, "tiny-gpt-oss"), layers=LAYERS, seq=SEQ, attention="eager", **kw
    )


def same_flops(est: Any, meas: Any) -> None:
    f = est.flops
    assert (f.forward, f.backward, f.recompute) == tuple(
        meas.flops[k] for k in ("forward", "backward", "recompute")
    )


@pytest.mark.parametrize("checkpointing", ["none", "full"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_gpt_oss_exact(checkpointing: str, use_cache: bool) -> None:
    setup = setup_of(checkpointing=checkpointing, use_cache=use_cache)
    est, meas = estimate(setup), measure_hf(setup)
    layers = [meas.layer_bytes(i) for i in range(LAYERS)]
    if checkpointing == "full":
        # The recorder names a storage after the first layer that keeps it: layer 0's checkpoint binds the
        # sliding layers' additive mask, layer 1's the full layers' ([1, 1, 64, 64] bf16, 2·64·64 = 8,192 B
        # each); the estimate counts them once each at model level (attn.mask, attn.full_mask).
        layers = [b - 2 * SEQ * SEQ for b in layers]
    assert estimated_layers(est) == layers, (estimated_layers(est), layers)
    assert est.activations == meas.activations, (est.activations, meas.activations)
    same_flops(est, meas)


def test_gpt_oss_layer_by_hand() -> None:
    """One layer, T = 64 tokens, S = T·k = 128 slots, f = 32, bf16 unless said: the norms' fp32 input,
    rstd and fp32 product (2·(16,384 + 256 + 16,384)); q/k/v input 8,192; q [4, 64, 16] and k, v repeated
    [4, 64, 16] (3·8,192); the sinks' max indices [1, 4, 64, 1] int64 (2,048) and the softmax [1, 4, 64, 65]
    (33,280); W_O's input 8,192; router input 8,192, top-k indices [64, 2] int64 (1,024) and softmax
    [64, 2] (256); four [S] int64 indices (slot weight, token, bias, inverse: 4·1,024) and the offsets [8]
    int32 (32); expert input [S, 64] (16,384); gate_up [S, 64] (16,384); gate clamped, sigmoid, up + 1,
    glu and W_down's input [S, 32] (5·8,192); routing weights [S, 1] (256) and expert output [S, 64]
    (16,384)."""
    norms = 2 * (16_384 + 256 + 16_384)
    attention = 8_192 + 3 * 8_192 + 2_048 + 33_280 + 8_192
    moe = 8_192 + 1_024 + 256 + 4 * 1_024 + 32 + 16_384 + 16_384 + 5 * 8_192 + 256 + 16_384
    assert estimated_layers(estimate(setup_of())) == [norms + attention + moe] * LAYERS == [246_304] * LAYERS


@pytest.mark.parametrize("experts", ["grouped_mm", "eager"])
def test_gpt_oss_realised_routing(experts: str) -> None:
    """Real tensors: the random router's unbalanced choice does not change the bytes or the FLOPs."""
    setup = setup_of()
    setup = with_experts(setup, experts)
    meas = measure_hf(setup, fake=False)
    est = estimate(setup)
    if experts == "grouped_mm":
        assert est.activations == meas.activations
    same_flops(est, meas)


def test_gpt_oss_refusals() -> None:
    """Setup validation refuses what transformers' gpt-oss code does not run (the CLI prints its line)."""
    with pytest.raises(ValueError, match=r"attention: transformers has no SDPA path with attention sinks"):
        estimate(hf_setup(model_from_hf_config(TINY, "t"), layers=LAYERS, seq=SEQ))
    with pytest.raises(ValueError, match=r"modelled for transformers' code only; add --impl hf"):
        from memplan.config import Impl

        estimate(
            hf_setup(
                model_from_hf_config(TINY, "t"),
                layers=LAYERS,
                seq=SEQ,
                attention="eager",
                impl=Impl.REFERENCE,
            )
        )
    with pytest.raises(ValueError, match=r"layer_types: only every 2nd layer full"):
        model_from_hf_config({**TINY, "layer_types": ["full_attention", "sliding_attention"]}, "t")
