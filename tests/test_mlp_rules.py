"""The MLP's saves, parameters, FLOPs and backward transients by hand (blocks/mlp.py), and how
analytic/activations.py composes a layer's and the model's inventory from the blocks; torch-free, in the
mutation selection (docs/mutation.md). tests/measure/ measures the same saves per tensor (torch).

What each MLP keeps (torch's derivatives.yaml; transformers' and Megatron-core's code as blocks/mlp.py cites):
- the first matrices' input x [b, s, h] for their dW = dYᵀ·x (one tensor: W_gate and W_up, or fc1, read it);
- SwiGLU down(silu(g)·u): silu keeps g, the product keeps silu(g) for du and u for d(silu(g)), W_down keeps
  its input silu(g)·u — four [b, s, f];
- GELU fc2(gelu(fc1(x))): gelu keeps its input (fc1's output), fc2 keeps its input — two [b, s, f];
  transformers' NewGELUActivation (gelu_new) 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))): pow keeps x, tanh
  its output, the last product both operands 0.5·x and 1 + tanh, then fc2's input — five [b, s, f];
- Megatron's fused SwiGLUFunction keeps W_fc1's [b, s, 2f] output alone, then W_down's input;
- Phi-3's fused gate_up_proj: the [b, s, 2f] output (its chunks, views, feed act and ·), act(g), W_down's
  input.

Sizes: h = 64, 4 heads of d = 16, f = 160, v = 1000, b = 2, s = 32 (T = 64 tokens), 4 layers, bf16-mixed
(activations and gradients 2 bytes).
"""

from __future__ import annotations

from typing import Any

import pytest
from tiny_setup import A, B, F, H, L, S, T, nbytes, tiny_setup

from memplan.analytic import activations as act
from memplan.blocks import mlp
from memplan.blocks.inventory import Block, Dims, Kept, Role, Scope
from memplan.config import (
    DType,
    Impl,
    ImplConfig,
    MoEConfig,
    Setup,
)
from memplan.config.impl import Family
from memplan.config.model import Gelu, MlpType, NormType
from memplan.config.strategy import Checkpointing

BF16, FP32, BOOL = DType.BF16, DType.FP32, DType.BOOL
R = Role


def setup(impl: Impl = Impl.REFERENCE, strategy: dict[str, Any] | None = None, **model: Any) -> Setup:
    return tiny_setup(model, strategy, impl=ImplConfig(impl=impl))


def saves(s: Setup) -> list[tuple[str, tuple[int, ...], DType, Role, Block]]:
    return [(r.name, r.shape, r.dtype, r.role, r.block) for r in mlp.mlp_rules(s, Dims.of(s))]


MLP_IN = ("mlp.input", (B, S, H), BF16, R.LINEAR_INPUT, Block.MLP)


def inner(name: str, width: int = F) -> tuple[str, tuple[int, ...], DType, Role, Block]:
    return ("mlp." + name, (B, S, width), BF16, R.MLP_INNER, Block.MLP)


# ----------------------------------------------------------------------------------------------------
# Parameters: W_gate, W_up [f, h] and W_down [h, f] (SwiGLU) or fc1 [f, h], fc2 [h, f] (GELU), biases
# [f] on the first matrices and [h] on the last when the model has them.
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("model", "params"),
    [
        ({}, 3 * H * F),  # 30,720
        ({"mlp": MlpType.SWIGLU, "mlp_bias": True}, 3 * H * F + 2 * F + H),
        ({"mlp": MlpType.GELU}, 2 * H * F),
        ({"mlp": MlpType.GELU, "mlp_bias": True}, 2 * H * F + F + H),  # 20,704
    ],
)
def test_mlp_parameters(model: dict[str, Any], params: int) -> None:
    assert mlp.mlp_params(setup(**model).model) == params


# ----------------------------------------------------------------------------------------------------
# Saves per implementation
# ----------------------------------------------------------------------------------------------------
def test_reference_swiglu_keeps_the_input_gate_act_up_and_the_down_input() -> None:
    assert saves(setup()) == [MLP_IN, inner("gate"), inner("act"), inner("up"), inner("down_input")]


def test_reference_gelu_keeps_the_input_fc1_output_and_fc2_input() -> None:
    assert saves(setup(mlp=MlpType.GELU)) == [MLP_IN, inner("up"), inner("down_input")]
    # the reference model applies F.gelu whichever GELU the config names
    assert saves(setup(mlp=MlpType.GELU, gelu=Gelu.GELU_NEW)) == [MLP_IN, inner("up"), inner("down_input")]


def test_transformers_gelu_new_keeps_the_python_gelus_four_operands() -> None:
    s = setup(Impl.HF, mlp=MlpType.GELU, gelu=Gelu.GELU_NEW, family=Family.GPT2, norm=NormType.LAYERNORM)
    names = ("up", "tanh", "half_x", "one_plus_tanh", "down_input")
    assert saves(s) == [MLP_IN, *(inner(n) for n in names)]
    # F.gelu (activation_function "gelu") keeps x alone
    s = setup(Impl.HF, mlp=MlpType.GELU, gelu=Gelu.GELU, family=Family.GPT2, norm=NormType.LAYERNORM)
    assert saves(s) == [MLP_IN, inner("up"), inner("down_input")]


def test_megatron_fused_swiglu_keeps_fc1s_double_width_output() -> None:
    assert saves(setup(Impl.MEGATRON)) == [MLP_IN, inner("fc1", 2 * F), inner("down_input")]


def test_megatron_gelu_keeps_fc1s_output_and_fc2s_input() -> None:
    """bias_gelu_impl (GeLUFunction) saves fc1's output (and the bias, a parameter); fc2 its input: the
    fused SwiGLU switch is for SwiGLU alone."""
    assert saves(setup(Impl.MEGATRON, mlp=MlpType.GELU)) == [MLP_IN, inner("up"), inner("down_input")]


def test_phi3_fused_gate_up_keeps_its_double_width_output_act_and_the_down_input() -> None:
    s = setup(Impl.HF, family=Family.PHI3)
    assert saves(s) == [MLP_IN, inner("gate_up", 2 * F), inner("act"), inner("down_input")]


@pytest.mark.parametrize(
    ("impl", "family", "inner_saves"),
    [
        (Impl.MEGATRON, None, [("e.fc1", (7, 3, 10)), ("e.down_input", (7, 3, 5))]),
        (
            Impl.HF,
            Family.PHI3,
            [("e.gate_up", (7, 3, 10)), ("e.act", (7, 3, 5)), ("e.down_input", (7, 3, 5))],
        ),
    ],
)
def test_fused_inner_saves_double_the_last_dimension_only(
    impl: Impl, family: Family | None, inner_saves: list[tuple[str, tuple[int, ...]]]
) -> None:
    """Any shape [·, f] (an MoE's expert rows): the fused buffers are [·, 2f], the rest [·, f]; ``part``
    prefixes the names and the dtype is the one passed."""
    s = setup(impl, family=family)
    rules = mlp.mlp_inner_rules(s, Block.MOE, "e.", (7, 3, 5), FP32)
    assert [(r.name, r.shape, r.dtype, r.role, r.block) for r in rules] == [
        ("moe." + n, shape, FP32, R.MLP_INNER, Block.MOE) for n, shape in inner_saves
    ]


# ----------------------------------------------------------------------------------------------------
# FLOPs: 2·T·h·f per matrix
# ----------------------------------------------------------------------------------------------------
def test_forward_flops_and_the_early_stop_skip() -> None:
    swiglu, gelu = setup(), setup(mlp=MlpType.GELU)
    assert mlp.mlp_flops(swiglu, Dims.of(swiglu)) == 3 * 2 * T * H * F  # 3,932,160
    assert mlp.mlp_flops(gelu, Dims.of(gelu)) == 2 * 2 * T * H * F
    # the re-run stops once W_down's input is saved: W_down's [T, f]·[f, h] is skipped
    assert mlp.early_stop_skip(swiglu, Dims.of(swiglu)) == 2 * T * F * H  # 1,310,720


# ----------------------------------------------------------------------------------------------------
# Backward transients (bf16-mixed: activations and gradients 2 bytes)
# ----------------------------------------------------------------------------------------------------
def transients(s: Setup) -> tuple[int, int]:
    dims = Dims.of(s)
    return mlp.mlp_backward_transient(s, dims), mlp.down_backward_transient(s, dims)


def test_swiglu_backward_peaks_at_the_product_gradient() -> None:
    # later: dY [T, h] + three [T, f] (d(down input), dg, du) + dW_down [h, f] − W_down's freed input [T, f]
    later = 2 * T * H + 3 * 2 * T * F + 2 * H * F - 2 * T * F  # 8,192 + 61,440 + 20,480 − 20,480 = 69,632
    # down's own backward: dY, d(down input) [T, f] and dW_down = 49,152
    down = 2 * T * H + 2 * T * F + 2 * H * F
    assert transients(setup()) == (later, down)


def test_gelu_backward_with_biases_and_residual_dropout_peaks_in_the_down_projection() -> None:
    s = setup(mlp=MlpType.GELU, mlp_bias=True, resid_dropout=0.1)
    grads = 2 * (H * F + H)  # dW_fc2 [h, f] and its bias [h]: 20,608
    later = 2 * T * H + 2 * 2 * T * F + grads - 2 * T * F  # 49,280
    # the residual dropout's input gradient [T, h] in bf16, its bool mask [T, h] freed: 8,192 − 4,096
    dropout = 2 * T * H - T * H
    down = 2 * T * H + dropout + 2 * T * F + grads  # 53,376
    assert down > later
    assert transients(s) == (down, down)


def test_gelu_backward_without_dropout() -> None:
    s = setup(mlp=MlpType.GELU, mlp_bias=True)
    grads = 2 * (H * F + H)
    later = 2 * T * H + 2 * 2 * T * F + grads - 2 * T * F  # 49,280
    assert transients(s) == (later, 2 * T * H + 2 * T * F + grads)


def test_a_checkpointed_segment_frees_its_input_before_the_bias_gradient() -> None:
    """Under segment checkpointing the down projection's peak is at its weight gradient's matmul, before
    the bias gradient [h] exists; the product's moment still holds the bias gradient."""
    s = setup(
        mlp=MlpType.GELU, mlp_bias=True, resid_dropout=0.1, strategy={"checkpointing": Checkpointing.FULL}
    )
    down = 2 * T * H + (2 * T * H - T * H) + 2 * T * F + 2 * H * F  # 53,248
    later = 2 * T * H + 2 * 2 * T * F + 2 * (H * F + H) - 2 * T * F  # 49,280
    assert transients(s) == (down, down)
    assert down > later


def test_swiglu_product_moment_with_dropout_and_biases() -> None:
    s = setup(mlp_bias=True, resid_dropout=0.1)
    grads = 2 * (H * F + H)
    later = 2 * T * H + 3 * 2 * T * F + grads - 2 * T * F  # 69,760
    down = 2 * T * H + (2 * T * H - T * H) + 2 * T * F + grads  # 53,376
    assert transients(s) == (later, down)


# ----------------------------------------------------------------------------------------------------
# analytic/activations.py: the layer and the model composed from the blocks
# ----------------------------------------------------------------------------------------------------
def entries(ks: Any) -> list[tuple[str, tuple[int, ...], str, Scope, int]]:
    return [(k.name, k.shape, k.dtype.value, k.scope, k.count) for k in ks]


D = H // A
# the reference Llama layer (RMSNorm, RoPE, flash attention, SwiGLU), one of each per layer
LAYER = [
    ("attn_norm.input", (B, S, H), "fp32"),
    ("attn_norm.rstd", (B, S, 1), "fp32"),
    ("attn_norm.normed", (B, S, H), "bf16"),
    ("attn.input", (B, S, H), "bf16"),
    ("attn.q", (B, A, S, D), "bf16"),
    ("attn.k", (B, A, S, D), "bf16"),
    ("attn.v", (B, S, H), "bf16"),
    ("attn.lse", (B, A, S), "fp32"),
    ("attn.philox_seed", (2,), "uint64"),
    ("attn.philox_offset", (), "uint64"),
    ("attn.out", (B, S, H), "bf16"),
    ("mlp_norm.input", (B, S, H), "fp32"),
    ("mlp_norm.rstd", (B, S, 1), "fp32"),
    ("mlp_norm.normed", (B, S, H), "bf16"),
    ("mlp.input", (B, S, H), "bf16"),
    ("mlp.gate", (B, S, F), "bf16"),
    ("mlp.act", (B, S, F), "bf16"),
    ("mlp.up", (B, S, F), "bf16"),
    ("mlp.down_input", (B, S, F), "bf16"),
]


def test_a_layer_keeps_its_norms_attention_and_mlp() -> None:
    s = setup()
    rules = act.layer_rules(s, Dims.of(s))
    assert [(r.name, r.shape, r.dtype.value) for r in rules] == LAYER
    out = next(r for r in rules if r.name == "attn.out")
    assert (out.block, out.role) == (Block.ATTN, R.ATTN_OUT)
    ws = act.layer_working_set(s)
    assert entries(ws) == [(n, sh, dt, Scope.LAYER, 1) for n, sh, dt in LAYER]
    assert act.total_bytes(ws) == nbytes(LAYER)


def test_residual_dropout_masks_follow_each_branch() -> None:
    """Dropout after W_O and after W_down (p > 0): native_dropout keeps a bool [b, s, h] mask each."""
    s = setup(resid_dropout=0.1)
    names = [(r.name, r.shape, r.dtype.value) for r in act.layer_rules(s, Dims.of(s))]
    attn_mask = ("attn.resid_dropout_mask", (B, S, H), "bool")
    mlp_mask = ("mlp.resid_dropout_mask", (B, S, H), "bool")
    assert names == [*LAYER[:11], attn_mask, *LAYER[11:], mlp_mask]


def test_the_inventory_counts_layer_saves_once_per_layer() -> None:
    s = setup()
    inv = act.inventory(s)
    layer = [k for k in inv if k.scope is Scope.LAYER]
    assert entries(layer) == [(n, sh, dt, Scope.LAYER, L) for n, sh, dt in LAYER]
    model = [k for k in inv if k.scope is Scope.MODEL]
    assert all(k.count == 1 for k in model)
    # the embedding's indices first, the loss's saves last
    assert (model[0].name, model[-1].name) == ("embed.ids", "loss.total_weight")
    assert act.per_layer_bytes(inv, L) == nbytes(LAYER)
    assert act.total_bytes(layer) == L * nbytes(LAYER)


def test_kept_copies_every_field_of_the_rules() -> None:
    s = setup()
    rules = act.layer_rules(s, Dims.of(s))
    ks = act.kept(rules, Scope.MODEL, 3)
    assert ks == [
        Kept(
            name=r.name,
            shape=r.shape,
            dtype=r.dtype,
            scope=Scope.MODEL,
            count=3,
            reason=r.reason,
            block=r.block,
            role=r.role,
        )
        for r in rules
    ]
    assert all(k.reason for k in ks)


def test_an_moe_layer_swaps_the_dense_mlp_inner_saves_once() -> None:
    """The dense MLP's inner saves (gate, act, up, down_input) are replaced by the MoE layer's, at the
    place of the first and with its count; the MLP's input and everything else stay."""
    from memplan.blocks.moe import moe_rules

    moe = MoEConfig(experts=4, top_k=2)
    s = setup(moe=moe)
    inv = act.inventory(s)
    layer = [k for k in inv if k.scope is Scope.LAYER]
    moe_saves = [(r.name, r.shape, r.dtype.value, Scope.LAYER, L) for r in moe_rules(s, moe)]
    dense = [(n, sh, dt, Scope.LAYER, L) for n, sh, dt in LAYER]
    assert entries(layer) == dense[:15] + moe_saves
    # a dense model's list passes through unchanged
    dense_setup = setup()
    ks = act.kept(act.layer_rules(dense_setup, Dims.of(dense_setup)), Scope.LAYER, L)
    assert act.with_moe(ks, dense_setup) == ks
