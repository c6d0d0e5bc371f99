"""``--impl megatron --fp8 tensorwise``: Megatron-core's layers under Transformer Engine's
Float8CurrentScaling (blocks/te_fp8.py), every expected figure derived here by hand from TE's code:

- ``_LayerNormLinear.forward`` / ``_Linear.forward`` save their input as the float8 columnwise copy
  (``update_usage(rowwise_usage=False)``), 1 byte an element, with a ``[1]`` fp32 ``_scale_inv`` (4 B);
  a column-parallel linear with sequence parallelism keeps the rowwise copy too;
- the norm's input and statistics, the attention core's tensors and the fused activation's input stay
  16-bit; W_O's float8 input sits beside flash's own 16-bit output;
- ``get_weight_workspace`` caches each linear's float8 weight and its transpose (2 bytes an element) and
  a [1] fp32 scale_inv; ``set_meta_tensor`` makes 5 quantizers a module (3 forward, 2 backward), each
  ``Float8CurrentScalingQuantizer`` a [1] fp32 ``scale`` and ``amax`` (8 B).

Korthikanti et al. 2022 (§4.1) count a GPT layer's 16-bit activations as sbh(34 + 5as/h): under TE's
float8 the QKV input (2sbh), the output-projection input (2sbh), the MLP input (2sbh) and the 4h→h input
(8sbh) halve, so eager attention keeps sbh(27 + 5as/h), plus four 4-byte scales.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memplan.blocks import fp8, te_fp8
from memplan.blocks.inventory import Dims
from memplan.blocks.mlp import down_backward_transient, mlp_backward_transient
from memplan.cli.app import app
from memplan.config import (
    Attention,
    Checkpointing,
    Fp8Recipe,
    Impl,
    ImplConfig,
    ModelConfig,
    Parallel,
    Precision,
    Setup,
    StrategyConfig,
    TrainingConfig,
)
from memplan.engine import estimate
from memplan.presets import load_model_preset
from memplan.time import fp8 as time_fp8
from memplan.time.published import gpt

from .layout import plan

runner = CliRunner()
TE = ImplConfig(impl=Impl.MEGATRON, fp8=Fp8Recipe.TENSORWISE)
BF16 = ImplConfig(impl=Impl.MEGATRON)
# Llama-3-8B: h 4096, 32 heads, 8 kv heads, d 128, f 14336, 32 layers; T = b·s = 4096.
T, H, A, KV, D, F, L = 4096, 4096, 32, 8, 128, 14336, 32


def llama(
    impl: ImplConfig = TE,
    seq: int = T,
    attention: Attention = Attention.FLASH,
    checkpointing: Checkpointing = Checkpointing.NONE,
    **kw: object,
) -> Setup:
    return Setup(
        model=load_model_preset("llama-3-8b").model,
        training=TrainingConfig(seq_len=seq, micro_batch=1, **kw),  # type: ignore[arg-type]
        strategy=StrategyConfig(attention=attention, checkpointing=checkpointing),
        impl=impl,
    )


def test_the_8b_layer_keeps_float8_linear_inputs_and_16_bit_attention_and_norms() -> None:
    got = {k.name: (k.dtype.value, k.bytes) for k in estimate(llama()).tensors if k.scope.value == "layer"}
    assert got == {
        "attn_norm.input": ("bf16", 2 * T * H),  # LayerNormLinear's inputmat, for the norm's backward
        "attn_norm.rstd": ("fp32", 4 * T),
        "attn.input": ("uint8", T * H),  # ln_out, float8 columnwise
        "attn.input_scale_inv": ("fp32", 4),
        "attn.q": ("bf16", 2 * T * A * D),
        "attn.k": ("bf16", 2 * T * KV * D),
        "attn.v": ("bf16", 2 * T * KV * D),
        "attn.lse": ("fp32", 4 * A * T),
        "attn.rng_state": ("int64", 16),
        "attn.out": ("bf16", 2 * T * A * D),  # the flash core's own output
        "attn.out_fp8": ("uint8", T * A * D),  # W_O's float8 input
        "attn.out_fp8_scale_inv": ("fp32", 4),
        "mlp_norm.input": ("bf16", 2 * T * H),
        "mlp_norm.rstd": ("fp32", 4 * T),
        "mlp.input": ("uint8", T * H),
        "mlp.input_scale_inv": ("fp32", 4),
        "mlp.fc1": ("bf16", 2 * T * 2 * F),  # SwiGLUFunction's input [T, 2f], 16-bit
        "mlp.down_input": ("uint8", T * F),  # W_fc2's float8 input
        "mlp.down_input_scale_inv": ("fp32", 4),
    }


def test_per_layer_falls_by_the_halved_linear_inputs() -> None:
    # bf16 keeps attn.input, attn.out (shared by flash and W_O), mlp.input 2·T·h each and the down input
    # 2·T·f; TE: T·h, T·h + 2·T·h (flash's out and W_O's float8 copy), T·h, T·f, plus 4 scales of 4 B.
    bf16 = 2 * T * H + 2 * T * H + 2 * T * H + 2 * T * F
    te = T * H + (2 * T * H + T * H) + T * H + T * F + 4 * 4
    assert estimate(llama()).per_layer - estimate(llama(BF16)).per_layer == te - bf16 == -75_497_456


def test_the_float8_weight_cache_and_quantizers_join_the_weights() -> None:
    # per layer: W_QKV h·(a + 2kv)·d, W_O a·d·h, W_fc1 h·2f, W_fc2 f·h — rowwise + transpose, 1 B each;
    # 4 modules × ([1] fp32 scale_inv + 5 quantizers × 8 B).
    elements = H * (A + 2 * KV) * D + A * D * H + H * 2 * F + F * H
    per_layer = 2 * elements + 4 * (4 + 5 * 8)
    assert per_layer == 436_207_792
    grown = estimate(llama()).device.states.weights - estimate(llama(BF16)).device.states.weights
    assert grown == L * per_layer


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_the_weight_cache_is_the_rank_s_layers_and_shards(tp: int, pp: int) -> None:
    # a tensor-parallel rank casts its 1/t of each linear (a/t heads, kv/t, f/t); a pipeline stage its L/p
    # layers; the per-module scale_inv and quantizers stay whole
    elements = (H * (A + 2 * KV) * D + A * D * H + H * 2 * F + F * H) // tp
    per_layer = 2 * elements + 4 * (4 + 5 * 8)
    te, bf16 = plan(llama(), Parallel(tp=tp, pp=pp)), plan(llama(BF16), Parallel(tp=tp, pp=pp))
    assert te.device.states.weights - bf16.device.states.weights == L // pp * per_layer


def test_sequence_parallel_keeps_the_rowwise_copy_of_column_parallel_inputs_only() -> None:
    tp = 2
    got = {
        k.name: k.bytes for k in plan(llama(), Parallel(tp=tp, sp=True)).tensors if k.scope.value == "layer"
    }
    shard = T // tp * H  # the rank's s/t tokens, 1 B an element
    assert got["attn.input"] == got["attn.input_rowwise"] == shard
    assert got["mlp.input"] == got["mlp.input_rowwise"] == shard
    assert got["attn.out_fp8"] == T * A * D // tp  # row-parallel: [T, a·d/t], no rowwise copy
    assert got["mlp.down_input"] == T * F // tp
    assert "attn.out_fp8_rowwise" not in got and "mlp.down_input_rowwise" not in got


@pytest.mark.parametrize("name", ["22B", "530B"])
def test_korthikanti_gpt_layer_is_sbh_27_plus_5as_over_h_under_te_float8(name: str) -> None:
    h, heads, layers = {"22B": (6144, 64, 48), "530B": (20480, 128, 105)}[name]
    m: ModelConfig = gpt(h, heads, layers)
    s = 2048
    setup = Setup(
        model=m,
        training=TrainingConfig(seq_len=s, micro_batch=1, precision=Precision.FP16_MIXED),
        strategy=StrategyConfig(attention=Attention.EAGER),
        impl=TE,
    )
    sbh = s * h
    # sbh(34 + 5as/h) with 2 + 2 + 2 + 8 → 1 + 1 + 1 + 4 (sbh·7 fewer), the fused LayerNorms' fp32 mean
    # and rstd (2 norms × 2 × 4·s, as for bf16), four fp32 scale_inv.
    assert estimate(setup).per_layer == sbh * 27 + 5 * heads * s * s + 16 * s + 4 * 4


def test_eager_attention_keeps_w_o_input_as_float8_only() -> None:
    got = {k.name: k.dtype.value for k in estimate(llama(attention=Attention.EAGER, seq=512)).tensors}
    assert got["attn.out"] == "uint8" and "attn.out_fp8" not in got


def test_selective_recompute_keeps_w_o_input_as_float8_only() -> None:
    # CheckpointFunction keeps the core's q, k, v; the re-run core's output is W_O's input alone: float8
    got = {
        k.name: k.dtype.value for k in estimate(llama(seq=512, checkpointing=Checkpointing.SELECTIVE)).tensors
    }
    assert got["attn.out"] == "uint8" and "attn.out_fp8" not in got


def test_te_down_projection_backward_adds_dy_rowwise_and_columnwise_casts() -> None:
    s = llama()
    assert not fp8.enabled(s)  # torchao's Float8Linear temporaries are not Megatron's
    g = s.training.precision.grad_bytes
    # dY [T, h] bf16, its float8 rowwise + columnwise (2·T·h) and scale_inv, d(down input) [T, f] bf16,
    # W_down's gradient f·h.
    assert down_backward_transient(s, Dims.of(s)) == 2 * T * H + 2 * T * H + 4 + 2 * T * F + F * H * g


def test_te_mlp_backward_peaks_at_w_fc1_s_float8_casts() -> None:
    s = llama()
    g = s.training.precision.grad_bytes
    # at the SwiGLU product's gradient: dY [T, h], three [T, f] bf16 buffers and W_down's gradient, with
    # the down projection's saved float8 input (T·f bytes and its 4-byte scale_inv) released
    later = 2 * T * H + 3 * 2 * T * F + F * H * g - (T * F + 4)
    # at W_fc1's backward: dY [T, h], W_down's gradient, d(fc1) [T, 2f] bf16 and its float8 rowwise and
    # columnwise casts (2·T·2f + 4), dgrad [T, h] bf16, W_fc1's gradient [h, 2f]; released: W_fc2's float8
    # input (T·f + 4) and SwiGLU's saved [T, 2f] bf16 input
    fc1 = (
        2 * T * H
        + F * H * g
        + 2 * T * 2 * F
        + (2 * T * 2 * F + 4)
        + 2 * T * H
        + 2 * F * H * g
        - (T * F + 4)
        - 2 * T * 2 * F
    )
    assert fc1 > later
    assert mlp_backward_transient(s, Dims.of(s)) == fc1


def test_te_casts_move_by_hand() -> None:
    e, per = 2, 2 * 2 + 2  # amax pass (e) + cast (e read, rowwise + columnwise written): 2e + 2
    # forward: the norm-fused inputs (QKV, fc1) e + 2, the others 2e + 2; the weights once a step (grad
    # accumulation 4: a quarter each micro-batch)
    x = T * H * (e + 2) * 2 + (T * A * D + T * F) * per
    w = (H * (A + 2 * KV) * D + A * D * H + H * 2 * F + F * H) * per // 4
    dy = (T * (A + 2 * KV) * D + T * H + T * 2 * F + T * H) * per
    assert time_fp8.te_cast_bytes(llama(grad_accum=4)) == (x + w, dy)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            "--impl megatron --fp8 rowwise",
            "error: fp8: Transformer Engine has no rowwise recipe (Megatron's --fp8-recipe: delayed, "
            "tensorwise, mxfp8, blockwise); use --fp8 tensorwise (Float8CurrentScaling) or delayed "
            "(DelayedScaling) with --impl megatron",
        ),
        (
            "--impl hf --fp8 tensorwise",
            "error: fp8: --impl hf runs transformers' bf16 linears (no float8 conversion of them is "
            "modelled); use --impl reference or torchtitan (torchao Float8Linear) or megatron (Transformer "
            "Engine)",
        ),
    ],
)
def test_unmodelled_fp8_is_a_one_line_error(args: str, message: str) -> None:
    r = runner.invoke(app, ["estimate", "-m", "llama-3-8b", *args.split()])
    assert r.exit_code == 2
    assert r.output.strip() == message


def test_the_note_names_the_megatron_recipe_and_the_cache() -> None:
    r = runner.invoke(
        app, ["estimate", "-m", "llama-3-8b", "--impl", "megatron", "--fp8", "tensorwise", "--json"]
    )
    assert r.exit_code == 0
    notes = json.loads(r.output)["notes"]
    assert any("--fp8-recipe tensorwise" in n and "436,207,792 bytes a layer" in n for n in notes)


def test_te_applies_to_megatron_float8_only() -> None:
    assert te_fp8.applies(llama()) and not te_fp8.applies(llama(BF16))
    assert not te_fp8.applies(llama(ImplConfig(fp8=Fp8Recipe.TENSORWISE)))
