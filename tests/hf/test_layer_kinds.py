"""Layers of two kinds, each layer's backward charged as its own kind, and transformers' Llama 4 MoE backward
replayed op by op (``blocks.moe.backward._llama4``), at the real widths under fake tensors: the highest point
measured (``measure.frameworks.hf_peak``) against the estimate's.

Before, every layer's backward was charged the MoE layer's transient and re-run working set
(``analytic.moments.layer_backward.layer_kind_terms``, ``pieces``' ``rerun_layers``): Llama 4 Maverick's dense
layer 0 below its MoE layer 1 (s 512) read a layer moment 22,834,438,144 B above the measured one, 2.2 GB
above under full checkpointing; DeepSeek-V2-Lite's dense first layer 972 MB above. And Llama 4's MoE
backward was the dense MLP's with [E·T, f] buffers: 403,755,008 B under at Scout's widths, 4.03 GB under at
Maverick's (every token through every expert, the experts' weight gradients beside [E, T, ·] buffers)."""

from __future__ import annotations

from typing import Any

import pytest

from memplan.analytic import activations as act
from memplan.analytic.moments import layer_backward as lb
from memplan.analytic.moments.layer_backward import layer_terms
from memplan.analytic.moments.layer_kinds import layer_kind_terms
from memplan.analytic.params import count_params
from memplan.blocks.inventory import Dims
from memplan.blocks.moe import backward as moe_backward
from memplan.config import Setup
from memplan.pieces import core_of, pieces
from tests.hf.harness import hf_setup, layer_difference

MAVERICK = "llama-4-maverick-17b-128e"
CASES = [
    # layer 0 dense (intermediate_size_mlp 16,384), layer 1 MoE (128 experts): the dense layer's own moment
    hf_setup(MAVERICK, seq=512),
    hf_setup(MAVERICK, seq=512, checkpointing="full"),
    # Scout: every layer MoE (16 experts), RoPE and NoPE kinds alike in their MLP
    hf_setup("llama-4-scout-17b-16e", seq=512),
    # narrow: the [E, T, ·] buffers against the weight gradients
    hf_setup("llama-4-scout-17b-16e", seq=256, hidden_size=256, ffn_size=192, num_heads=4, num_kv_heads=2),
]


@pytest.mark.parametrize(
    "setup",
    CASES,
    ids=lambda s: f"{s.model.name}-h{s.model.hidden_size}-{s.strategy.checkpointing.name.lower()}",
)
def test_each_layer_backward_is_its_kinds(setup: Setup) -> None:
    """Exact, with and without transformers' checkpointing (the int64 [s] position ids its checkpointed
    layers hold modelled: ``constants.checkpointed_position_ids``)."""
    kinds = act.layer_kind_setups(pieces(core_of(setup)).setup)
    assert kinds and all(moe_backward.applies(k) for k in kinds if k.model.moe is not None)
    assert layer_difference(setup) == 0


def test_a_dense_layer_is_charged_its_own_terms() -> None:
    """Maverick's dense layer 0 and MoE layer 1: each its kind's own (transient, working set), from its
    kind's setup and parameters; the MoE's the larger by its experts' weight gradients [128, ·, 5,120] and
    [E, T, ·] buffers."""
    p = pieces(core_of(CASES[0]))
    terms = layer_kind_terms(p.setup, p.kept)
    kinds = act.layer_kind_setups(p.setup)
    assert [k.model.moe is not None for k in kinds] == [False, True]
    assert terms == tuple(layer_terms(k, count_params(k.model), p.kept) for k in kinds)
    assert terms[0] is not None and terms[1] is not None and terms[0][0] < terms[1][0]


def narrow_mla(
    preset: str, layers: int, checkpointing: str, mla: dict[str, int], moe: dict[str, Any]
) -> Setup:
    """DeepSeek's code (``preset``'s) with narrow latents (its own widths' MLA attention backward tops the
    layer): h 128, four heads of 8 rotated dims, vocabulary 512, s 64, eager attention."""
    return hf_setup(
        preset,
        layers=layers,
        seq=64,
        attention="eager",
        checkpointing=checkpointing,
        hidden_size=128,
        ffn_size=96,
        num_heads=4,
        num_kv_heads=4,
        head_dim=8,
        vocab_size=512,
        mla={"kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, **mla},
        moe=moe,
    )


def deepseek(layers: int, dense: int, groups: int | None, checkpointing: str = "none") -> Setup:
    """DeepSeek-V2's code, narrow (``narrow_mla``), 16 experts, top-4, two shared experts; ``dense`` first
    layers dense; group-limited routing over ``groups``."""
    moe = {"experts": 16, "top_k": 4, "shared_experts": 2, "dense_layers": dense, "dense_ffn": 80}
    if groups:
        moe |= {"groups": groups, "topk_groups": 2}
    return narrow_mla("deepseek-v2-lite", layers, checkpointing, {}, {**moe, "norm_topk_prob": False})


def assert_moe_tops_at_the_fp32_routers(setup: Setup, dense: int, above: int) -> None:
    """The MoE's moment tops the layer, and transformers' step is above the estimate by the named
    differences alone: each MoE layer's router weight kept in fp32 (``_keep_in_fp32_modules_strict =
    ["gate.weight"]``), which memplan's model states count in the weights' dtype — E·h·2 B a MoE layer,
    and as much for each router gradient made above the moment's layer (``above`` MoE layers; the replay's
    own is fp32)."""
    p = pieces(core_of(setup))
    assert moe_backward.applies(p.setup)
    dims = Dims.of(p.setup)
    assert lb.mlp_moment(p.setup, dims) == lb.layer_backward_transient(p.setup, dims, p.params)
    moe = setup.model.moe
    assert moe is not None
    precision = setup.training.precision
    moe_layers = setup.model.num_layers - dense
    excess = (4 - precision.weight_bytes) * moe_layers + (4 - precision.grad_bytes) * above
    assert layer_difference(setup) == excess * moe.experts * setup.model.hidden_size


@pytest.mark.parametrize(
    ("layers", "dense", "groups", "checkpointing", "above"),
    [
        (1, 0, None, "none", 0),
        (1, 0, 4, "full", 0),
        (2, 1, None, "none", 0),
        (2, 1, 4, "full", 0),
        # the first MoE layer's backward, one MoE layer above it: the two dense layers' saves outweigh their
        # gradients, the MoE layers' gradients their saves (before: the ends 0 and 3 alone, both charged the
        # MoE's terms, 257,536 B over)
        (4, 2, None, "none", 1),
    ],
)
def test_deepseek_v2_moe_backward_is_transformers(
    layers: int, dense: int, groups: int | None, checkpointing: str, above: int
) -> None:
    """``DeepseekV2Moe``'s backward replayed (``blocks.moe.backward._deepseek``): exact but for the named
    differences (``assert_moe_tops_at_the_fp32_routers``). Before the replay: 142,400 B under (one layer, no
    checkpointing)."""
    assert_moe_tops_at_the_fp32_routers(deepseek(layers, dense, groups, checkpointing), dense, above)


def deepseek_v3(layers: int, dense: int, norm: bool, checkpointing: str) -> Setup:
    """DeepSeek-V3's code, narrow (``narrow_mla``, V3's q latent), 16 experts, top-4 in two of four groups,
    one shared expert, its sigmoid router (the correction bias for the choice; ``norm``: the top-k weights
    renormalised)."""
    moe = {"experts": 16, "top_k": 4, "shared_experts": 1, "dense_layers": dense, "dense_ffn": 80}
    moe |= {"scoring": "sigmoid", "groups": 4, "topk_groups": 2, "norm_topk_prob": norm}
    return narrow_mla("deepseek-v3", layers, checkpointing, {"q_lora_rank": 48}, moe)


@pytest.mark.parametrize(
    ("layers", "dense", "norm", "checkpointing", "above"),
    [
        (1, 0, True, "none", 0),
        (1, 0, True, "full", 0),
        (1, 0, False, "none", 0),
        (2, 1, True, "full", 0),
        (4, 2, True, "none", 1),  # the first MoE layer's backward, one MoE layer above it
    ],
)
def test_deepseek_v3_moe_backward_is_transformers(
    layers: int, dense: int, norm: bool, checkpointing: str, above: int
) -> None:
    """``DeepseekV3TopkRouter``'s backward replayed (``blocks.moe.backward._v3_choice``): the MoE's moment
    tops the layer, exact but for the named differences (``assert_moe_tops_at_the_fp32_routers``):
    the routers' fp32 weights and gradients above."""
    assert_moe_tops_at_the_fp32_routers(deepseek_v3(layers, dense, norm, checkpointing), dense, above)
