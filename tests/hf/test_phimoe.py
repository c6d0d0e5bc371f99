"""transformers' ``modeling_phimoe.py`` against ``--impl hf``: LayerNorms with bias, biased q/k/v/o and lm
head, the sparsemixer router in training (two masked softmaxes, two Gumbel-sampled experts, the custom
``PhimoeMultiplier``), input jitter, Mixtral's grouped experts and sliding-window mask. Small widths, under
fake tensors (SDPA and eager, transformers' checkpointing on and off, use_cache on and off) and on real
tensors with the routing the sampler chose; every layer's bytes, the total and the FLOPs exact. The
full-size import is checked against the published count (Phi-3.5-MoE: 41.9B total, 6.6B active)."""

from __future__ import annotations

import gc
import json
from typing import Any

import pytest

from memplan.analytic.params import count_params
from memplan.config import Family, NormType
from memplan.engine import estimate
from memplan.measure.frameworks.hf import measure_hf
from memplan.presets import load_model_preset
from memplan.presets.hf import hf_notes, model_from_hf_config
from tests.grids import pairwise_cases
from tests.hf.harness import MOE_WIDTHS, exact_realised_routing, hf_setup
from tests.hf.harness import exact_moe as exact

# huggingface.co/microsoft/Phi-3.5-MoE-instruct/blob/main/config.json (the keys memplan reads; the longrope
# factor lists left out: values only)
PHI35_MOE: dict[str, Any] = {
    "architectures": ["PhiMoEForCausalLM"],
    "attention_bias": True,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "input_jitter_noise": 0.01,
    "intermediate_size": 6400,
    "lm_head_bias": True,
    "max_position_embeddings": 131072,
    "model_type": "phimoe",
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 16,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"type": "longrope", "original_max_position_embeddings": 4096},
    "rope_theta": 10000.0,
    "router_jitter_noise": 0.01,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "vocab_size": 32064,
}

SMALL = {
    **MOE_WIDTHS,
    "moe": {"experts": 8, "top_k": 2, "input_jitter": 0.01},
}
SEQ = 64


def test_phimoe_import_and_count() -> None:
    """Per layer: q and o 4096·4096 + 4096 each, k and v 4096·1024 + 1024 each (attention_bias on all
    four): 41,953,280; two LayerNorms 2·2·4096; router 16·4096 (no bias); 16 experts of gate_up
    2·6400·4096 and down 4096·6400 (1,258,291,200): 1,300,326,400. 32 layers, untied embedding and head
    2·32,064·4096, the head's bias 32,064 and the final LayerNorm 2·4096: 41,873,153,344 (the page's
    41.9B). Active: less 14 of 16 experts per layer, 32·14·3·4096·6400 = 35,232,153,600: 6,640,999,744
    (the page's 6.6B)."""
    m = model_from_hf_config(PHI35_MOE, "phi-3.5-moe")
    attn = 2 * (4096 * 4096 + 4096) + 2 * (4096 * 1024 + 1024)
    assert attn == 41_953_280
    layer = attn + 2 * 2 * 4096 + 16 * 4096 + 16 * 3 * 4096 * 6400
    assert layer == 1_300_326_400
    total = 32 * layer + 2 * 32_064 * 4096 + 32_064 + 2 * 4096
    assert count_params(m).total == total == 41_873_153_344
    assert count_params(m).active == total - 32 * 14 * 3 * 4096 * 6400 == 6_640_999_744
    assert m.code_family is Family.PHIMOE and m.norm is NormType.LAYERNORM and m.norm_bias
    assert (m.qkv_bias, m.out_bias, m.mlp_bias, m.head_bias) == (True, True, False, True)
    assert m.moe is not None
    assert (m.moe.experts, m.moe.top_k, m.moe.shared_experts, m.moe.input_jitter) == (16, 2, 0, 0.01)
    assert m.sliding_window == 131072
    assert load_model_preset("phi-3.5-moe").model == m.model_copy(update={"name": "phi-3.5-moe"})


def test_phimoe_notes_name_longrope() -> None:
    """The longrope scaling is named, not silently dropped: ``PhimoeRotaryEmbedding`` scales the same
    [s, d] cos/sin by short/long_mscale (no grad): values only."""
    assert "longrope rope_scaling: the rotary tables' values only" in hf_notes(PHI35_MOE)
    assert "longrope" in load_model_preset("phi-3.5-moe").notes


def test_phimoe_refuses_other_top_k() -> None:
    """``sparsemixer`` returns two experts whatever ``num_experts_per_tok``: another k is an error."""
    with pytest.raises(ValueError, match=r"num_experts_per_tok: 4, but PhiMoE's sparsemixer always routes"):
        model_from_hf_config({**PHI35_MOE, "num_experts_per_tok": 4}, "p")
    with pytest.raises(ValueError, match=r"^moe.top_k: PhiMoE's sparsemixer always routes to 2 experts"):
        estimate(small(moe={"experts": 8, "top_k": 4}))


def test_phimoe_structure_needs_hf() -> None:
    """The lm head's bias and the input jitter exist in transformers' PhiMoE only."""
    from memplan.config import Impl

    with pytest.raises(ValueError, match=r"moe.input_jitter: modelled for transformers' code only"):
        estimate(small(impl=Impl.REFERENCE))
    with pytest.raises(ValueError, match=r"head_bias: modelled for transformers' code only"):
        estimate(small(impl=Impl.REFERENCE, moe={"experts": 8, "top_k": 2}))


def small(**kw: Any) -> Any:
    base = load_model_preset("phi-3.5-moe").model
    return hf_setup(base, seq=SEQ, **(SMALL | kw))


@pairwise_cases("attention, checkpointing, use_cache", ["flash", "eager"], ["none", "full"], [True, False])
def test_phimoe_exact(attention: str, checkpointing: str, use_cache: bool) -> None:
    setup = small(attention=attention, checkpointing=checkpointing, use_cache=use_cache)
    exact(estimate(setup), measure_hf(setup))


def test_phimoe_sparsemixer_by_hand() -> None:
    """One layer's router and MLP-side saves, by hand (T = 64 tokens, E = 8, h = 64, bf16): per round the
    bool mask T·E = 512, the softmax T·E·2 = 1,024, the sampled index T·8 = 512 and the multiplier T·2 =
    128 (2,176, twice: 4,352), and the two jitter noises T·h·2 = 8,192 each (16,384): 20,736 bytes; without
    jitter the layer is 16,384 bytes smaller, measured."""
    on, off = small(), small(moe={"experts": 8, "top_k": 2})
    est_on, est_off = estimate(on), estimate(off)
    meas_on, meas_off = measure_hf(on), measure_hf(off)
    exact(est_on, meas_on)
    exact(est_off, meas_off)
    assert meas_on.layer_bytes(0) - meas_off.layer_bytes(0) == 2 * 64 * 64 * 2
    sparsemixer = [
        r for r in meas_off.records if r.layer == 0 and r.name.startswith("mlp.router") and "Mm" not in r.name
    ]
    assert sorted(r.bytes for r in sparsemixer) == sorted([512, 1024, 512, 128] * 2)


@pytest.mark.parametrize("attention", ["flash", "eager"])
def test_phimoe_sliding_window(attention: str) -> None:
    """A window shorter than the sequence: ``create_sliding_window_causal_mask`` on every layer."""
    setup = small(attention=attention, sliding_window=16)
    exact(estimate(setup), measure_hf(setup))


@pytest.mark.parametrize("experts", ["grouped_mm", "eager"])
def test_phimoe_realised_routing(experts: str) -> None:
    """Real tensors, the Gumbel sampler's unbalanced choice: the bytes and FLOPs do not depend on it."""
    exact_realised_routing(small(), experts, routed=SEQ * 2)


def test_sparsemixer_midpoint_indices_are_freed() -> None:
    """Why the recorder forgets freed saves (``SavedTensorRecorder.forget_freed``): sparsemixer's
    ``max_scores, max_ind = masked_gates.max(dim=-1, keepdim=True)`` saves its [T, 1] indices on a
    ``MaxBackward0`` node that only the local ``max_scores`` holds; ``rand_like`` reads its shape, so the
    node and its indices are freed when sparsemixer returns: one [T, 1] int64 per round that is saved but
    never kept. Every other save stays alive."""
    torch = pytest.importorskip("torch")
    from torch.multiprocessing.reductions import StorageWeakRef
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    saved: list[tuple[tuple[int, ...], Any]] = []

    def pack(t: Any) -> Any:
        saved.append((tuple(t.shape), StorageWeakRef(t.untyped_storage())))
        return t

    scores = torch.randn(64, 8, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        multiplier, _ = sparsemixer(scores * 1.0, jitter_eps=0.01, training=True)
    gc.collect()
    freed = [shape for shape, ref in saved if ref.expired()]
    assert freed == [(64, 1), (64, 1)]
    assert multiplier.shape == (64, 2)


def tiny_file(original: int) -> dict[str, Any]:
    """A 2-layer PhiMoE config.json at SMALL's widths with a longrope ``rope_scaling`` switching from the
    short to the long factors past ``original`` positions (one factor per rotated pair: d/2 = 8)."""
    rope = {
        "type": "longrope",
        "original_max_position_embeddings": original,
        "short_factor": [1.0] * 8,
        "long_factor": [2.0] * 8,
        "short_mscale": 1.0,
        "long_mscale": 1.2,
    }
    widths = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 32}
    return {
        **PHI35_MOE,
        **widths,
        "vocab_size": 128,
        "num_local_experts": 8,
        "num_hidden_layers": 2,
        "max_position_embeddings": 4 * original,
        "rope_scaling": rope,
    }


@pytest.mark.parametrize("original", [1024, 32])
def test_phimoe_longrope_keeps_the_same_bytes(original: int) -> None:
    """transformers built from the file itself, longrope and all, on real tensors (the short factors for
    s = 64 ≤ 1024, the long ones past 32): the same bytes and FLOPs as the estimate, which names it."""
    document = tiny_file(original)
    m = model_from_hf_config(document, "tiny-phimoe")
    assert m.rope_scaling == "longrope"
    setup = hf_setup(m, seq=SEQ, layers=2)
    exact(estimate(setup), measure_hf(setup, fake=False, document=document))


def test_phimoe_longrope_refused_under_fake_tensors() -> None:
    """Under fake tensors ``PhimoeRotaryEmbedding.forward`` cannot compare ``torch.max(position_ids) + 1``
    with original_max_position_embeddings: a one-line error, not a traceback."""
    document = tiny_file(1024)
    setup = hf_setup(model_from_hf_config(document, "tiny-phimoe"), seq=SEQ, layers=2)
    with pytest.raises(ValueError, match=r"^rope_scaling: longrope reads the positions' values"):
        measure_hf(setup, document=document)


def test_phimoe_estimate_notes_name_longrope() -> None:
    from typer.testing import CliRunner

    from memplan.cli.app import app

    out = CliRunner().invoke(app, ["estimate", "-m", "phi-3.5-moe", "--impl", "hf", "--json"])
    assert out.exit_code == 0, out.output
    notes = json.loads(out.stdout)["notes"]
    assert any(n.startswith("rope_scaling longrope: it changes the rotary tables' values") for n in notes)


def test_phimoe_real_widths() -> None:
    """Phi-3.5-MoE's own widths (h 4096, 32/8 heads, 16 experts of 6400), two layers, under fake tensors."""
    setup = hf_setup("phi-3.5-moe", layers=2, seq=256)
    exact(estimate(setup), measure_hf(setup))


@pytest.mark.parametrize(
    "kw", [{"checkpointing": "every-2", "layers": 4}, {"checkpointing": "full", "reentrant": True}]
)
def test_phimoe_checkpointing_variants(kw: dict[str, Any]) -> None:
    """transformers' ``every_n_layers`` (every 2nd layer checkpointed alone) and ``use_reentrant=True``
    (whole layers re-run, the sampler's RNG state restored): every layer's bytes, the total and the
    FLOPs. Under every-K the estimate's tensor list is an unchecked layer's while layer 0 is checkpointed
    (its input only), so tensors pair by bytes per layer there, not by name."""
    setup = small(**kw)
    exact(estimate(setup), measure_hf(setup), paired=setup.strategy.checkpoint_every == 1)
