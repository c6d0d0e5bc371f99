"""``--impl megatron --fp8 mxfp8``: Megatron-core's layers under Transformer Engine's MXFP8BlockScaling
(blocks/te_fp8.py, blocks/mxfp8.py, time/fp8.py), every expected figure derived here by hand from TE's
code (transformer_engine/pytorch/tensor/mxfp8_tensor.py, ``MXFP8Quantizer.make_empty``):

- an [M, K] MXFP8 tensor's rowwise scales are [round_up(M, 128), round_up(K/32, 4)] uint8, its
  columnwise ones [round_up(M/32, 4), round_up(K, 128)] uint8; its columnwise data is [M, K] uint8;
- a linear saves its input's columnwise copy with the columnwise scales — under sequence parallelism too
  (MXFP8 all-gathers the columnwise data: ``update_usage(rowwise_usage=False)`` for MXFP8TensorStorage);
- the cached weight keeps both copies and both scale grids; MXFP8BlockScalingRecipeState holds nothing;
- Blackwell only (TE: compute capability 10.x).
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memplan.blocks.inventory import Dims
from memplan.blocks.mlp import down_backward_transient
from memplan.cli.app import app
from memplan.config import Fp8Recipe, Impl, ImplConfig, Parallel, Setup, StrategyConfig, TrainingConfig
from memplan.engine import estimate
from memplan.presets import load_gpu, load_model_preset
from memplan.time import fp8 as time_fp8
from memplan.time.comm.collectives import communication

from .layout import plan

runner = CliRunner()
MX = ImplConfig(impl=Impl.MEGATRON, fp8=Fp8Recipe.MXFP8)
CURRENT = ImplConfig(impl=Impl.MEGATRON, fp8=Fp8Recipe.TENSORWISE)
BF16 = ImplConfig(impl=Impl.MEGATRON)
# Llama-3-8B: h 4096, 32 heads, 8 kv heads, d 128, f 14336, 32 layers; T = b·s = 4096.
T, H, A, KV, D, F, L = 4096, 4096, 32, 8, 128, 14336, 32


def llama(impl: ImplConfig = MX, seq: int = T, dp: int = 1, grad_accum: int = 1) -> Setup:
    return Setup(
        model=load_model_preset("llama-3-8b").model,
        training=TrainingConfig(seq_len=seq, micro_batch=1, grad_accum=grad_accum),
        strategy=StrategyConfig(dp=dp),
        impl=impl,
    )


def test_the_8b_layer_keeps_mxfp8_columnwise_inputs_with_their_scale_grids() -> None:
    got = {k.name: (k.dtype.value, k.bytes) for k in estimate(llama()).tensors if k.scope.value == "layer"}
    # columnwise scales of [T, K]: [T/32 = 128 (a multiple of 4), K (a multiple of 128)], 1 byte each
    assert {n: v for n, v in got.items() if "input" in n or "out" in n} == {
        "attn_norm.input": ("bf16", 2 * T * H),
        "attn.input": ("uint8", T * H),
        "attn.input_scale_inv": ("uint8", T // 32 * H),
        "attn.out": ("bf16", 2 * T * A * D),  # the flash core's own output
        "attn.out_fp8": ("uint8", T * A * D),
        "attn.out_fp8_scale_inv": ("uint8", T // 32 * A * D),
        "mlp_norm.input": ("bf16", 2 * T * H),
        "mlp.input": ("uint8", T * H),
        "mlp.input_scale_inv": ("uint8", T // 32 * H),
        "mlp.down_input": ("uint8", T * F),
        "mlp.down_input_scale_inv": ("uint8", T // 32 * F),
    }


def test_per_layer_is_current_scaling_s_with_scale_grids_for_scalars() -> None:
    # current scaling keeps four [1] fp32 scale_inv; MXFP8 four grids of T/32 rows
    grids = T // 32 * (H + A * D + H + F)
    assert grids == 3_407_872
    assert estimate(llama()).per_layer - estimate(llama(CURRENT)).per_layer == grids - 4 * 4


def test_the_scale_grids_pad_to_four_rows() -> None:
    # 96 tokens: 3 blocks of 32 rows, padded to 4: [4, 4096] for the QKV input
    got = {k.name: k.bytes for k in estimate(llama(seq=96)).tensors if k.scope.value == "layer"}
    assert got["attn.input_scale_inv"] == 4 * H


def test_the_weight_cache_keeps_both_copies_and_both_grids_and_no_quantizer_state() -> None:
    def scales(out: int, inp: int) -> int:
        # rowwise [round_up(out, 128), round_up(in/32, 4)] + columnwise [round_up(out/32, 4),
        # round_up(in, 128)] — every dimension of Llama-3-8B already a multiple: out·in/32 each
        return out * (inp // 32) + (out // 32) * inp

    shapes = [((A + 2 * KV) * D, H), (H, A * D), (2 * F, H), (H, F)]  # [out, in]: QKV, O, fc1, fc2
    per_layer = sum(2 * o * i + scales(o, i) for o, i in shapes)
    assert per_layer == 449_839_104
    grown = estimate(llama()).device.states.weights - estimate(llama(BF16)).device.states.weights
    assert grown == L * per_layer


def test_sequence_parallel_keeps_the_columnwise_shard_only() -> None:
    tp = 2
    got = {
        k.name: k.bytes for k in plan(llama(), Parallel(tp=tp, sp=True)).tensors if k.scope.value == "layer"
    }
    shard = T // tp  # the rank's s/t tokens
    assert got["attn.input"] == got["mlp.input"] == shard * H
    assert got["attn.input_scale_inv"] == shard // 32 * H
    assert not [n for n in got if n.endswith("_rowwise")]


def test_the_down_projection_backward_casts_dy_with_both_grids() -> None:
    s = llama()
    g = s.training.precision.grad_bytes
    # dY [T, h] bf16; its rowwise + columnwise MXFP8 copies (2·T·h) with scales [T, h/32] and [T/32, h];
    # d(down input) [T, f] bf16; W_down's gradient f·h
    casts = 2 * T * H + T * (H // 32) + (T // 32) * H
    assert down_backward_transient(s, Dims.of(s)) == 2 * T * H + casts + 2 * T * F + F * H * g


def test_mxfp8_casts_move_by_hand() -> None:
    e, n = 2, 4

    def cast(rows: int, cols: int) -> int:  # read e, write both copies and both scale grids
        return e * rows * cols + 2 * rows * cols + rows * (cols // 32) + (rows // 32) * cols

    q = (A + 2 * KV) * D
    x = cast(T, H) + cast(T, A * D) + cast(T, H) + cast(T, F)  # QKV, O, fc1, fc2 inputs
    w = (cast(q, H) + cast(H, A * D) + cast(2 * F, H) + cast(H, F)) // n  # W [out, in], once a step
    dy = cast(T, q) + cast(T, H) + cast(T, 2 * F) + cast(T, H)
    got_f, got_b = time_fp8.te_cast_bytes(llama(grad_accum=n))
    # the weights' per-linear floor division: each term is a multiple of 4 here
    assert (got_f, got_b) == (x + w, dy)


def test_mxfp8_keeps_no_amax_and_reduces_none() -> None:
    rows = [r for r in communication(plan(llama(dp=8)), load_gpu("b200").topology)[1] if r.dimension == "fp8"]
    assert rows == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            "--impl megatron --fp8 mxfp8 --gpu h100-sxm",
            "error: fp8: --fp8 mxfp8 needs a Blackwell GPU (Transformer Engine: compute capability 10.x); "
            "h100-sxm has 9.0; use --fp8 tensorwise or delayed, or --gpu b200",
        ),
        (
            "--impl megatron --fp8 blockwise",
            "error: fp8: --impl megatron --fp8 blockwise (Transformer Engine Float8BlockScaling: 1×128 and "
            "128×128 blocks, fp32 scales) is not modelled; use --fp8 tensorwise, delayed or mxfp8",
        ),
        (
            "--impl torchtitan --fp8 mxfp8",
            "error: fp8: --fp8 mxfp8 is a Transformer Engine recipe (torchao's Float8Linear has tensorwise "
            "and rowwise only); use --impl megatron, or --fp8 tensorwise or rowwise",
        ),
    ],
)
def test_unmodelled_mxfp8_and_blockwise_are_one_line_errors(args: str, message: str) -> None:
    r = runner.invoke(app, ["estimate", "-m", "llama-3-8b", *args.split()])
    assert r.exit_code == 2
    assert r.output.strip() == message


def test_mxfp8_runs_on_b200() -> None:
    r = runner.invoke(
        app, ["estimate", "-m", "llama-3-8b", "--impl", "megatron", "--fp8", "mxfp8", "--gpu", "b200"]
    )
    assert r.exit_code == 0


def test_the_note_names_mxfp8_block_scaling() -> None:
    r = runner.invoke(app, ["estimate", "-m", "llama-3-8b", "--impl", "megatron", "--fp8", "mxfp8", "--json"])
    notes = [n for n in json.loads(r.output)["notes"] if n.startswith("fp8:")]
    assert len(notes) == 1 and "MXFP8BlockScaling" in notes[0] and "449,839,104 bytes a layer" in notes[0]
