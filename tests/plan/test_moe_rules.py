"""One MoE layer's saves, FLOPs and routing, by hand from the ops blocks/moe.py's docstring lists.

tests/measure/test_moe.py and tests/hf/test_moe.py measure these per tensor name against autograd (torch);
this file pins them in the fast, torch-free suite the mutation run uses (docs/mutation.md), calling the
rules directly (the estimate memoises them, so a per-test coverage run would credit one test only).
Mixtral-8x7B (config.json: h 4096, intermediate 14336, 8 experts, top-2, renormalised) and Qwen1.5-MoE-A2.7B
(h 2048, moe_intermediate 1408, 60 experts, top-4, one shared expert of 5632 behind a sigmoid gate, not
renormalised); b = 1, s = 16: T = 16 tokens, S = T·k slots (dropless).
"""

from __future__ import annotations

from typing import Any

import pytest

from memplan.blocks import moe as mx
from memplan.blocks.inventory import Dims, Role
from memplan.blocks.moe.params import moe_layer_params
from memplan.config import DType, ExpertsImpl, Impl, ImplConfig, ModelConfig, MoEConfig, Setup, TrainingConfig
from memplan.presets import load_model_preset

T = 16
BF16, FP32, INT32, INT64 = DType.BF16, DType.FP32, DType.INT32, DType.INT64
R = Role


def setup(preset: str | ModelConfig, **impl: Any) -> Setup:
    model = load_model_preset(preset).model if isinstance(preset, str) else preset
    return Setup(model=model, training=TrainingConfig(micro_batch=1, seq_len=T), impl=ImplConfig(**impl))


def saves(s: Setup) -> list[tuple[str, tuple[int, ...], DType, Role]]:
    assert s.model.moe is not None
    return [(r.name, r.shape, r.dtype, r.role) for r in mx.moe_rules(s, s.model.moe)]


def swiglu_inner(prefix: str, rows: int, f: int) -> list[tuple[str, tuple[int, ...], DType, Role]]:
    return [(f"moe.{prefix}{n}", (rows, f), BF16, R.MLP_INNER) for n in ("gate", "act", "up", "down_input")]


def test_mixtral_reference_layer_keeps_router_dispatch_experts_and_combine() -> None:
    h, f, e, k = 4096, 14336, 8, 2
    s = T * k
    assert saves(setup("mixtral-8x7b")) == [
        ("moe.router_probs", (T, e), FP32, R.ROUTER),  # fp32 softmax output
        ("moe.topk_indices", (T, k), INT64, R.ROUTER),
        ("moe.topk_sum", (T, 1), FP32, R.ROUTER),  # renormalised: the divisor
        ("moe.topk_weights", (T, k), FP32, R.ROUTER),  # and the dividend
        ("moe.weight_index", (s,), INT64, R.DISPATCH_INDEX),
        ("moe.dispatch_index", (s,), INT64, R.DISPATCH_INDEX),
        ("moe.expert_input", (s, h), BF16, R.EXPERT_TOKENS),
        *swiglu_inner("", s, f),
        ("moe.expert_output", (s, h), BF16, R.EXPERT_TOKENS),
        ("moe.routing_weights", (s, 1), BF16, R.EXPERT_TOKENS),
        ("moe.weighted_output", (s, h), BF16, R.EXPERT_TOKENS),  # index_add_'s source
    ]


@pytest.mark.parametrize(("ep", "local_experts"), [(1, 8), (4, 2), (8, 1)])
def test_megatron_layer_keeps_te_maps_the_grouped_gemms_inputs_and_the_probs(
    ep: int, local_experts: int
) -> None:
    """Megatron-core's MoELayer (blocks/moe/megatron.py) at Mixtral's shapes: TE's fused top-k keeps the
    routing map [T, E] bool and its scores [T, E] (bf16: the logits' dtype), TE's permutation (before the
    all-to-all, on the rank's own tokens: split by sp as the router's) its row_id_map [T, 2E + 1] int32,
    the chunk sort and its restore a [S] int32 map each when a rank holds
    more than one expert (E/ep > 1), GroupedLinear fc1 the dispatched tokens [S, h], the weighted SwiGLU
    fc1's [S, 2f] output and the probabilities [S, 1], fc2 its input [S, f]; the combine nothing."""
    from memplan.config import Parallel

    h, f, e, k = 4096, 14336, 8, 2
    s = T * k
    base = setup("mixtral-8x7b", impl=Impl.MEGATRON)
    at = base.replaced(parallel=Parallel(ep=ep))
    assert e // ep == local_experts
    chunks = [
        ("moe.chunk_sort_map", (s,), INT32, R.DISPATCH_INDEX),
        ("moe.chunk_restore_map", (s,), INT32, R.DISPATCH_INDEX),
    ]
    assert saves(at) == [
        ("moe.routing_map", (T, e), DType.BOOL, R.ROUTER),
        ("moe.router_scores", (T, e), BF16, R.ROUTER),
        ("moe.row_id_map", (T, 2 * e + 1), INT32, R.ROUTER),  # the rank's own tokens, as the router's
        *(chunks if local_experts > 1 else []),
        ("moe.expert_input", (s, h), BF16, R.EXPERT_TOKENS),
        ("moe.fc1", (s, 2 * f), BF16, R.MLP_INNER),
        ("moe.down_input", (s, f), BF16, R.MLP_INNER),
        ("moe.probs", (s, 1), BF16, R.EXPERT_TOKENS),
    ]


def test_qwen_reference_layer_adds_the_gated_shared_expert() -> None:
    h, f, e, k, shared = 2048, 1408, 60, 4, 5632
    s = T * k
    assert saves(setup("qwen1.5-moe-a2.7b")) == [
        ("moe.router_probs", (T, e), FP32, R.ROUTER),
        ("moe.topk_indices", (T, k), INT64, R.ROUTER),  # not renormalised: no sum, no kept weights
        ("moe.weight_index", (s,), INT64, R.DISPATCH_INDEX),
        ("moe.dispatch_index", (s,), INT64, R.DISPATCH_INDEX),
        ("moe.expert_input", (s, h), BF16, R.EXPERT_TOKENS),
        *swiglu_inner("", s, f),
        ("moe.expert_output", (s, h), BF16, R.EXPERT_TOKENS),
        ("moe.routing_weights", (s, 1), BF16, R.EXPERT_TOKENS),
        ("moe.weighted_output", (s, h), BF16, R.EXPERT_TOKENS),
        *swiglu_inner("shared.", T, shared),  # a dense MLP of width 1 × 5632 on every token
        ("moe.shared_gate", (T, 1), BF16, R.SHARED_GATE),  # sigmoid(x·w_g)
        ("moe.shared_output", (T, h), BF16, R.SHARED_GATE),
    ]


@pytest.mark.parametrize(("preset", "weights"), [("mixtral-8x7b", FP32), ("qwen1.5-moe-a2.7b", BF16)])
def test_transformers_grouped_mm_experts_keep_gate_up_offsets_and_the_inverse_permutation(
    preset: str, weights: DType
) -> None:
    """transformers' ``grouped_mm_experts_forward``: ``gate_up_proj``'s [S, 2f] output kept whole, the
    grouped GEMM's E group ends (int32) and ``weighted_out[inv_perm]``'s index; Mixtral's router returns
    fp32 weights, Qwen2-MoE's casts them to bf16."""
    m = load_model_preset(preset).model
    assert m.moe is not None and m.ffn_size is not None
    s, f, e = T * m.moe.top_k, m.ffn_size, m.moe.experts
    kept = saves(setup(preset, impl=Impl.HF))
    experts = [r for r in kept if r[0] in ("moe.gate_up", "moe.gate", "moe.up", "moe.act", "moe.down_input")]
    assert experts == [
        ("moe.gate_up", (s, 2 * f), BF16, R.MLP_INNER),
        ("moe.act", (s, f), BF16, R.MLP_INNER),
        ("moe.down_input", (s, f), BF16, R.MLP_INNER),
    ]
    end = kept.index(("moe.expert_output", (s, m.hidden_size), BF16, R.EXPERT_TOKENS)) + 1
    assert kept[end : end + 3] == [
        ("moe.routing_weights", (s, 1), weights, R.EXPERT_TOKENS),
        ("moe.offsets", (e,), INT32, R.DISPATCH_INDEX),
        ("moe.inverse_index", (s,), INT64, R.DISPATCH_INDEX),
    ]
    eager = saves(setup(preset, impl=Impl.HF, experts=ExpertsImpl.EAGER))
    assert ("moe.weighted_output", (s, m.hidden_size), BF16, R.EXPERT_TOKENS) in eager
    assert not any(r[0] in ("moe.offsets", "moe.inverse_index") for r in eager)


def tiny(mlp: str = "swiglu", **moe: Any) -> ModelConfig:
    return ModelConfig(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        ffn_size=96,
        vocab_size=100,
        mlp=mlp,
        moe=MoEConfig(experts=4, top_k=2, **moe),
        max_positions=T,
    )


@pytest.mark.parametrize(
    ("mlp", "moe"),
    [
        # router 2·T·h·E + 3 matrices over S = 2T slots + shared width 1·48 (3 matrices) + gate h→1
        ("swiglu", {"shared_experts": 1, "shared_ffn": 48, "shared_gate": True}),
        ("gelu", {"shared_experts": 2, "shared_ffn": 48}),
        ("swiglu", {}),
    ],
)
def test_forward_flops_of_one_moe_mlp(mlp: str, moe: dict[str, Any]) -> None:
    h, f, e, k = 64, 96, 4, 2
    mats = 3 if mlp == "swiglu" else 2  # W_gate, W_up, W_down or fc1, fc2
    width = moe.get("shared_experts", 0) * moe.get("shared_ffn", 0)
    by_hand = 2 * T * h * e + mats * 2 * (T * k) * h * f + mats * 2 * T * h * width
    by_hand += 2 * T * h * 1 if moe.get("shared_gate") else 0
    s = setup(tiny(mlp, **moe))
    assert mx.mlp_flops(s, Dims.of(s)) == by_hand


@pytest.mark.parametrize(
    ("moe", "skipped"),
    [
        ({"shared_experts": 2, "shared_ffn": 48}, 2 * T * 96 * 64),  # shared W_down: [T, 2·48]·[96, h]
        ({"shared_experts": 1, "shared_ffn": 48, "shared_gate": True}, 0),  # the gate's product is last
        ({}, 0),  # the routed combine is last
    ],
)
def test_a_checkpointed_segment_skips_the_shared_down_projection_only_without_a_gate(
    moe: dict[str, Any], skipped: int
) -> None:
    s = setup(tiny(**moe))
    assert mx.early_stop_skip(s, Dims.of(s)) == skipped


def test_routing_reports_tokens_slots_and_the_assumption() -> None:
    dropless = mx.routing(setup(tiny()), MoEConfig(experts=4, top_k=2))
    assert (dropless["tokens"], dropless["slots"]) == (T, 2 * T)
    assert str(dropless["assumption"]).startswith("dropless top-2")
    # Capacity c = 1.25: each of 4 experts padded to ⌈1.25·16·2/4⌉ = 10 slots.
    capped = mx.routing(setup(tiny()), MoEConfig(experts=4, top_k=2, capacity_factor=1.25))
    assert (capped["tokens"], capped["slots"]) == (T, 4 * 10)
    assert str(capped["assumption"]).startswith("capacity factor 1.25")


def test_no_shared_experts_no_shared_parameters() -> None:
    """With biased MLPs, an MLP of width 0 would still count W_down's bias [h]: none when there is none."""
    m = tiny(mlp="gelu").model_copy(update={"mlp_bias": True})
    assert m.moe is not None
    assert moe_layer_params(m, m.moe).shared == 0


@pytest.mark.parametrize(
    ("mlp", "moe", "extra"),
    [
        # The MLP backward's [T, f] gradient buffers (gate, up and the product's for SwiGLU; fc1's and the
        # activation's for GELU) cover S expert slots instead of T tokens: (S − T) more rows each, f = 96,
        # bf16. Dropless top-2: S = 2T.
        ("swiglu", {}, 3 * (2 * T - T) * 96 * 2),
        ("gelu", {}, 2 * (2 * T - T) * 96 * 2),
        # Capacity factor 1.5: S = E·⌈(T·k/E)·c⌉ = 4·⌈(2T/4)·1.5⌉ = 3T slots.
        ("swiglu", {"capacity_factor": 1.5}, 3 * (3 * T - T) * 96 * 2),
    ],
)
def test_the_mlp_backward_buffers_grow_with_the_expert_slots(
    mlp: str, moe: dict[str, Any], extra: int
) -> None:
    m = tiny(mlp, **moe)
    s = Setup(model=m, training=TrainingConfig(seq_len=T))
    assert mx.mlp_backward_extra(s, m.moe) == extra
    assert mx.mlp_backward_extra(s, None) == 0


@pytest.mark.parametrize(
    "argv", ["-m mixtral-8x7b --impl megatron", "-m mixtral-8x7b", "-m llama-3-8b --impl hf"]
)
def test_eager_experts_outside_transformers_moe_is_one_line(argv: str) -> None:
    """``--experts eager`` is read by transformers' MoE blocks only; anywhere else it would change nothing."""
    from typer.testing import CliRunner

    from memplan.cli.app import app

    r = CliRunner().invoke(app, ["estimate", *argv.split(), "--experts", "eager"])
    assert r.exit_code == 2 and r.stderr.startswith("error: experts: --experts eager is transformers'")
    assert r.stderr.count("\n") == 1
