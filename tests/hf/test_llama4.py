"""transformers' ``modeling_llama4.py`` (``Llama4ForCausalLM``, the text model of Scout and Maverick) against
``--impl hf``: sigmoid-scaled experts that every token runs through, a shared expert, dense layers between
MoE ones (Maverick), NoPE layers with temperature tuning, chunked attention and weightless q/k norms on the
RoPE layers. Small widths under fake tensors (SDPA and eager, checkpointing on and off, use_cache on and
off): every layer's bytes, the total and the FLOPs exact. The full-size imports are checked against
transformers' own count of the published configs."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from memplan.analytic.activations import layer_rules
from memplan.analytic.params import count_params
from memplan.blocks.inventory import Dims, Scope
from memplan.blocks.llama4 import kind_of_layers
from memplan.config import Family, ModelConfig, Setup
from memplan.engine import estimate
from memplan.measure.compare.tensors import estimated_layers
from memplan.measure.frameworks.hf import measure_hf
from memplan.presets import load_model_preset
from memplan.presets.hf import model_from_hf_config
from tests.grids import pairwise_cases
from tests.hf.harness import MOE_WIDTHS, hf_setup

# huggingface.co/meta-llama/Llama-4-Scout-17B-16E/blob/main/config.json, its text_config (the keys memplan
# reads; attn_temperature_tuning true where the early file wrote 4: transformers 5's config is strict)
_LLAMA4: dict[str, Any] = {
    "model_type": "llama4_text",
    "attention_bias": False,
    "attention_chunk_size": 8192,
    "attn_scale": 0.1,
    "attn_temperature_tuning": True,
    "floor_scale": 8192,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 5120,
    "intermediate_size": 8192,
    "intermediate_size_mlp": 16384,
    "no_rope_layers": [],
    "num_attention_heads": 40,
    "num_experts_per_tok": 1,
    "num_hidden_layers": 48,
    "num_key_value_heads": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "vocab_size": 202048,
}
SCOUT: dict[str, Any] = {
    **_LLAMA4,
    "interleave_moe_layer_step": 1,
    "max_position_embeddings": 10485760,
    "moe_layers": list(range(48)),
    "num_local_experts": 16,
    "rope_scaling": {
        "factor": 16.0,
        "high_freq_factor": 1.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "use_qk_norm": True,
}
# huggingface.co/meta-llama/Llama-4-Maverick-17B-128E/blob/main/config.json, its text_config
MAVERICK: dict[str, Any] = {
    **_LLAMA4,
    "interleave_moe_layer_step": 2,
    "max_position_embeddings": 1048576,
    "moe_layers": list(range(1, 48, 2)),
    "num_local_experts": 128,
    "rope_scaling": None,
    "use_qk_norm": False,
}

# Attention per layer: q 5120·5120, k and v 5120·1024 each, o 5120·5120; two norms 2·5120.
_ATTN = 2 * 5120 * 5120 + 2 * 5120 * 1024 + 2 * 5120
_EXPERT = 3 * 5120 * 8192  # gate, up and down of one expert (and of the shared one)
_EMBED = 2 * 202048 * 5120 + 5120  # untied embedding and lm head, final norm


def test_scout_import_and_count() -> None:
    """Scout: 48 MoE layers of attention, router 5120·16, 16 experts and the shared one (17 · 3·5120·8192)
    = 62,924,800 + 81,920 + 2,139,095,040 = 2,202,101,760 each; the weightless q/k norm has none.
    48 · that + 2·202,048·5120 + 5120 = 107,769,861,120, transformers' count of the file (the page's
    109B counts the vision tower too).
    Active: less 15 of 16 experts per layer, 48·15·3·5120·8192 = 90,596,966,400: 17,172,894,720 (17B)."""
    m = model_from_hf_config(SCOUT, "llama-4-scout-17b-16e")
    layer = _ATTN + 5120 * 16 + 17 * _EXPERT
    assert layer == 2_202_101_760
    p = count_params(m)
    assert p.total == 48 * layer + _EMBED == 107_769_861_120
    assert p.active == p.total - 48 * 15 * _EXPERT == 17_172_894_720
    assert m.code_family is Family.LLAMA4 and m.moe is not None and m.moe.router_sigmoid
    assert (m.moe.experts, m.moe.top_k, m.moe.shared_experts, m.moe_every) == (16, 1, 1, None)
    assert (m.nope_every, m.attn_chunk, m.qk_l2_norm, m.attn_temperature) == (4, 8192, True, True)
    assert [i for i in range(48) if m.is_nope_layer(i)] == list(range(3, 48, 4))


def test_maverick_import_and_count() -> None:
    """Maverick: 24 dense layers (attention + 3·5120·16384) and 24 MoE layers (attention + router
    5120·128 + 129 · 3·5120·8192): 24·(_ATTN + 251,658,240) + 24·(_ATTN + 655,360 + 16,233,005,056) + the
    embeddings = 400,711,848,960, transformers' count (the page's 400B). Active: less 127 of 128 experts in
    each MoE layer, 24·127·3·5120·8192: 17,184,691,200 (17B)."""
    m = model_from_hf_config(MAVERICK, "llama-4-maverick-17b-128e")
    dense, moe = _ATTN + 3 * 5120 * 16384, _ATTN + 5120 * 128 + 129 * _EXPERT
    p = count_params(m)
    assert p.total == 24 * dense + 24 * moe + _EMBED == 400_711_848_960
    assert p.active == p.total - 24 * 127 * _EXPERT == 17_184_691_200
    assert (m.moe_every, m.dense_ffn_size, m.qk_l2_norm) == (2, 16384, False)
    assert [i for i in range(48) if m.is_moe_layer(i)] == list(range(1, 48, 2))
    # the layers above layer i (the peak's gradients so far): 47 is MoE, 46 dense
    assert (p.layers_from(47), p.layers_from(46), p.layers_from(0)) == (moe, moe + dense, p.layers)


def test_multimodal_config_reads_its_text_config() -> None:
    """A ``llama4`` (multimodal) config.json is its ``text_config``'s text model."""
    doc = {"model_type": "llama4", "text_config": {k: v for k, v in SCOUT.items() if k != "model_type"}}
    assert count_params(model_from_hf_config(doc, "scout")).total == 107_769_861_120


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("moe_layers", [0, 2]),
        ("no_rope_layers", [0] * 48),
        ("layer_types", ["full_attention"] * 48),
        ("output_router_logits", True),
        ("attn_temperature_tuning", 4),
    ],
)
def test_unmodelled_keys_are_refused(key: str, value: Any) -> None:
    """A pattern other than the defaults, or the auxiliary loss: one line naming the key."""
    with pytest.raises(ValueError, match=f"^hf config x: {key}: "):
        model_from_hf_config({**SCOUT, key: value}, "x")


# ----------------------------------------------------------------------------------------------------
# --impl hf against modeling_llama4.py
# ----------------------------------------------------------------------------------------------------
SEQ = 64
SMALL: dict[str, Any] = {
    **MOE_WIDTHS,
    "moe": {"experts": 4, "top_k": 1, "shared_experts": 1, "router_sigmoid": True, "norm_topk_prob": False},
    "attn_chunk": 16,  # < SEQ: the RoPE layers' chunked mask reaches SDPA
}
MAVERICK_SMALL = {**SMALL, "moe_every": 2, "dense_ffn_size": 48, "qk_l2_norm": False}


def small(preset: str, layers: int = 8, **kw: Any) -> Setup:
    """The preset at small widths, 8 layers: layers 3 and 7 NoPE, every kind of layer twice or more (a
    constant one layer alone keeps is that layer's in the measurement, not the model's)."""
    fields = MAVERICK_SMALL if "maverick" in preset else SMALL
    run = {k: kw.pop(k) for k in ("attention", "checkpointing", "use_cache", "batch", "seq") if k in kw}
    return hf_setup(
        load_model_preset(preset).model, layers=layers, seq=run.pop("seq", SEQ), **run, **(fields | kw)
    )


def exact(setup: Setup, fake: bool = True) -> None:
    """transformers' run equals the estimate: every layer's bytes, the total, the FLOPs per phase, and
    tensor by tensor (dtype and bytes) in each layer against its kind's saves and at the model's level."""
    meas, est = measure_hf(setup, fake=fake), estimate(setup)
    layers = [meas.layer_bytes(i) for i in range(setup.model.num_layers)]
    assert estimated_layers(est) == layers, (estimated_layers(est), layers)
    assert est.activations == meas.activations
    f = est.flops
    assert (f.forward, f.backward, f.recompute) == tuple(
        meas.flops[k] for k in ("forward", "backward", "recompute")
    )
    for i, kind in enumerate(kind_of_layers(setup)):
        theirs = Counter((r.dtype, r.bytes) for r in meas.records if r.layer == i)
        if setup.strategy.segment:  # the layer's input, its checkpoint's only save
            ours = Counter(
                [(setup.training.precision.activation_dtype.value, Dims.of(setup).tokens * 64 * 2)]
            )
        else:
            ours = Counter((r.dtype.value, r.bytes) for r in layer_rules(kind, Dims.of(kind)))
        assert ours == theirs, (i, ours - theirs, theirs - ours)
    model = Counter((k.dtype.value, k.bytes) for k in est.tensors if k.scope is Scope.MODEL)
    assert model == Counter((r.dtype, r.bytes) for r in meas.records if r.layer is None)


@pairwise_cases(
    "preset, attention, checkpointing, use_cache",
    ["llama-4-scout-17b-16e", "llama-4-maverick-17b-128e"],
    ["flash", "eager"],
    ["none", "full"],
    [True, False],
)
def test_llama4_exact(preset: str, attention: str, checkpointing: str, use_cache: bool) -> None:
    exact(small(preset, attention=attention, checkpointing=checkpointing, use_cache=use_cache))


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_llama4_batch_of_two(checkpointing: str) -> None:
    """b = 2: the chunked mask is [b, 1, s, s] (SDPA's converted one, and the bool one a checkpoint keeps)."""
    exact(small("llama-4-scout-17b-16e", batch=2, checkpointing=checkpointing))


@pytest.mark.parametrize("attention", ["flash", "eager"])
def test_llama4_chunk_covers_the_sequence(attention: str) -> None:
    """s < C: every causal cell lies in its chunk; SDPA gets no mask (``is_causal``), k and v unrepeated;
    s = C still passes it (``_ignore_causal_mask_sdpa`` skips it only while s < C)."""
    exact(small("llama-4-scout-17b-16e", attention=attention, checkpointing="full", attn_chunk=2 * SEQ))
    exact(small("llama-4-scout-17b-16e", attention=attention, attn_chunk=2 * SEQ))


def test_llama4_chunk_equal_to_the_sequence() -> None:
    exact(small("llama-4-scout-17b-16e", attn_chunk=SEQ))
    exact(small("llama-4-scout-17b-16e", checkpointing="full", attn_chunk=SEQ))


def test_llama4_real_tensors() -> None:
    """Real tensors (the random router's choice): the same bytes and FLOPs as under fake tensors, every
    token running through every expert whatever the router chose."""
    exact(small("llama-4-maverick-17b-128e", layers=4, attention="eager"), fake=False)


def test_llama4_moe_layer_by_hand() -> None:
    """One Scout-like MoE RoPE layer under SDPA, b 1, s 64 > C 16, h 64, a 4, kv 2, d 16, f 32, E 4, bf16:
    norms 2·(64·64·4 + 64·4 + 64·64·2) = 49,664; W_Q/K/V input 64·64·2 = 8,192; q/k norm inputs and rstd
    64·4·16·4 + 64·4·4 + 64·2·16·4 + 64·2·4 = 26,112; SDPA: mask 64·64·2, q, k, v (repeated), out 4·64·16·2
    each, lse 4·64·4: 8,192 + 4·8,192 + 1,024 = 41,984; MoE: its input 8,192, indices 64·8, sigmoid 64·4·4,
    scores 256·2, routed_in and the scaled tokens 2·256·64·2, gate_up 256·64·2, act and product 2·256·32·2,
    the shared expert 4·64·32·2: 8,192 + 512 + 1,024 + 512 + 65,536 + 32,768 + 32,768 + 16,384 = 157,696.
    Total 49,664 + 8,192 + 26,112 + 41,984 + 157,696 = 283,648. The NoPE layers keep no q/k norm, no mask
    (8,192), k and v over the 2 kv heads (2·4,096 fewer) and their fp32 temperature [1, 64, 1, 1] (256)."""
    per_layer = estimated_layers(estimate(small("llama-4-scout-17b-16e")))
    assert per_layer[0] == 49_664 + 8_192 + 26_112 + 41_984 + 157_696 == 283_648
    nope = 283_648 - 26_112 - 8_192 - 2 * 4_096 + 256
    assert [i for i, b in enumerate(per_layer) if b == nope] == [3, 7]


def test_llama4_full_size_flops() -> None:
    """Scout at its real widths, seq 4096, b 1: every token through all 16 experts, so the MoE's forward is
    2·T·h·E (router) + 2·(E·T)·h·2f + 2·(E·T)·f·h + 3·2·T·h·f (shared), with T 4096, h 5120, f 8192, E 16;
    the projections 2·T·h·(2·5120 + 2·1024); the attention core 4·a·s²·d; the head 2·T·h·v."""
    setup = hf_setup("llama-4-scout-17b-16e", layers=48, seq=4096)
    t, h, f, e = 4096, 5120, 8192, 16
    moe = 2 * t * h * e + 2 * (e * t) * h * 2 * f + 2 * (e * t) * f * h + 3 * 2 * t * h * f
    proj = 2 * t * h * (2 * 5120 + 2 * 1024)
    core = 4 * 40 * 4096 * 4096 * 128
    assert estimate(setup).flops.forward == 48 * (moe + proj + core) + 2 * t * h * 202048


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"attn_dropout": 0.1}, "^attn_dropout: attention dropout is not modelled for llama4_text"),
        ({"checkpointing": "every-2"}, "^checkpointing: llama4_text is modelled with"),
        ({"moe": {**SMALL["moe"], "router_sigmoid": False}}, "^moe: llama4_text's MoE is a sigmoid router"),
    ],
)
def test_llama4_unmodelled_is_refused(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        estimate(small("llama-4-scout-17b-16e", **kw))


def test_llama4_has_no_flash_attention_2() -> None:
    """``Llama4PreTrainedModel._supports_flash_attn = False``: --flash-attn is refused in one line."""
    setup = small("llama-4-scout-17b-16e")
    setup = setup.model_copy(update={"impl": setup.impl.model_copy(update={"flash_attn": True})})
    with pytest.raises(ValueError, match=r"^flash_attn: transformers' Llama 4 has no flash_attention_2 path"):
        estimate(setup)


def test_llama4_needs_impl_hf() -> None:
    """The reference model has none of Llama 4's structure: one line naming a field and --impl hf."""
    m: ModelConfig = load_model_preset("llama-4-scout-17b-16e").model
    with pytest.raises(ValueError, match=r"modelled for transformers' code only; add --impl hf"):
        estimate(hf_setup(m, layers=4, impl=__import__("memplan.config", fromlist=["Impl"]).Impl.REFERENCE))


def test_llama4_from_the_users_config_json() -> None:
    """``trace --impl hf -m config.json``: transformers builds the model from every key of the user's own
    (multimodal) file, memplan reads the same file; a key memplan misread would differ here."""
    text = {
        **MAVERICK,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 32,
        "intermediate_size_mlp": 48,
        "num_hidden_layers": 8,
        "moe_layers": [1, 3, 5, 7],
        "num_local_experts": 4,
        "vocab_size": 128,
        "attention_chunk_size": 16,
    }
    doc = {"model_type": "llama4", "text_config": {k: v for k, v in text.items() if k != "model_type"}}
    setup = hf_setup(model_from_hf_config(doc, "maverick-small"), layers=8, seq=SEQ)
    meas, est = measure_hf(setup, document=doc), estimate(setup)
    assert estimated_layers(est) == [meas.layer_bytes(i) for i in range(8)]
    assert (est.activations, est.flops.forward) == (meas.activations, meas.flops["forward"])
