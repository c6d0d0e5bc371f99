"""``--impl megatron --fp8 delayed``: Megatron-core's layers under Transformer Engine's DelayedScaling
(blocks/te_fp8.py, time/fp8.py, time/comm/collectives.py ``fp8_rows``), every expected figure derived here by
hand from TE's and Megatron's code:

- the saved activations and the float8 weight cache are current scaling's: both recipes make the same
  ``Float8Tensor`` and ``_LayerNormLinear`` / ``_Linear`` keep the same copies of it (only MXFP8 and
  block scaling change what is kept);
- ``DelayedScalingRecipeState``: per module and direction ``scale`` [n] and ``amax_history`` [len, n],
  fp32, n = 3 forward (input, weight, output), 2 backward (grad output, grad input); the quantizers are
  views. Megatron's ``--fp8-amax-history-len`` defaults to 1;
- ``reduce_and_update_fp8_tensors``: ``torch.cat`` of every module's ``amax_history[0]`` (3 fp32 forward,
  2 backward), one all-reduce (MAX) over tp × dp × cp per forward and per backward of a model chunk;
- the casts: the scale is known before the cast, which records the amax in the same pass: read e, write
  the rowwise and columnwise copies (e + 2 per element, against current scaling's 2e + 2); after the
  norm the fused norm kernel writes the float8 copy (1 byte instead of its e-byte output) and a transpose
  reads it and writes the columnwise copy (+2).
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memplan.blocks import te_fp8
from memplan.cli.app import app
from memplan.config import (
    Fp8Recipe,
    Impl,
    ImplConfig,
    Parallel,
    Setup,
    StrategyConfig,
    TrainingConfig,
)
from memplan.engine import estimate
from memplan.presets import load_gpu, load_model_preset
from memplan.time import fp8 as time_fp8
from memplan.time.comm.buffers import communicators
from memplan.time.comm.collectives import communication
from memplan.time.comm.fabric import Collective
from memplan.time.comm.rows import Overlap, Phase

from .layout import plan

runner = CliRunner()
DELAYED = ImplConfig(impl=Impl.MEGATRON, fp8=Fp8Recipe.DELAYED)
CURRENT = ImplConfig(impl=Impl.MEGATRON, fp8=Fp8Recipe.TENSORWISE)
BF16 = ImplConfig(impl=Impl.MEGATRON)
H100 = load_gpu("h100")
# Llama-3-8B: h 4096, 32 heads, 8 kv heads, d 128, f 14336, 32 layers; T = b·s = 4096.
T, H, A, KV, D, F, L = 4096, 4096, 32, 8, 128, 14336, 32
ELEMENTS = H * (A + 2 * KV) * D + A * D * H + H * 2 * F + F * H  # W_QKV, W_O, W_fc1 (SwiGLU), W_fc2


def llama(impl: ImplConfig = DELAYED, dp: int = 1, grad_accum: int = 1) -> Setup:
    return Setup(
        model=load_model_preset("llama-3-8b").model,
        training=TrainingConfig(seq_len=T, micro_batch=1, grad_accum=grad_accum),
        strategy=StrategyConfig(dp=dp),
        impl=impl,
    )


def test_saved_activations_are_current_scaling_s() -> None:
    # bf16 keeps attn.input, attn.out, mlp.input 2·T·h each and the down input 2·T·f; TE keeps them as
    # float8 columnwise copies (T·h, T·h beside flash's own 2·T·h, T·h, T·f) plus four fp32 scale_inv.
    bf16 = 2 * T * H + 2 * T * H + 2 * T * H + 2 * T * F
    te = T * H + (2 * T * H + T * H) + T * H + T * F + 4 * 4
    assert estimate(llama()).per_layer - estimate(llama(BF16)).per_layer == te - bf16


def test_weights_grow_by_the_cache_and_the_amax_histories() -> None:
    # per module: scale_inv of the cached weight [1] (4 B); forward scale [3] + amax_history [1, 3],
    # backward scale [2] + amax_history [1, 2], fp32: 4·(3 + 3 + 2 + 2) = 40 B.
    per_module = 4 + 4 * (3 + 1 * 3 + 2 + 1 * 2)
    per_layer = 2 * ELEMENTS + 4 * per_module
    assert per_layer == 436_207_792
    grown = estimate(llama()).device.states.weights - estimate(llama(BF16)).device.states.weights
    assert grown == L * per_layer


def test_a_longer_history_grows_the_state_by_its_rows() -> None:
    # TE's own DelayedScaling default, 1024 rows: 4 modules × (3 + 2) × (1 scale + 1024 rows) × 4 B
    assert te_fp8.meta_bytes(Fp8Recipe.DELAYED, history=1024) == 4 * 5 * 1025 * 4 == 82_000
    assert te_fp8.meta_bytes(Fp8Recipe.TENSORWISE) == 4 * 5 * (4 + 4)  # scale + amax, no history


def test_the_amax_buffer_is_three_and_two_fp32_a_module() -> None:
    assert te_fp8.amax_buffer_bytes(L, forward=True) == L * 4 * 3 * 4 == 1536
    assert te_fp8.amax_buffer_bytes(L, forward=False) == L * 4 * 2 * 4 == 1024
    assert te_fp8.amax_buffer_bytes(0, forward=True) == 0


def test_delayed_casts_move_by_hand() -> None:
    e, n = 2, 4
    cast = e + 2  # read e, write rowwise + columnwise; the amax in the same pass
    norm = 1 + 2 - e  # the norm writes 1 B float8 for its e-byte output; the transpose reads 1, writes 1
    x = T * H * norm * 2 + (T * A * D + T * F) * cast  # QKV and fc1 after the norms; W_O, W_fc2
    w = ELEMENTS * cast // n  # the weights once a step, grad accumulation 4
    dy = (T * (A + 2 * KV) * D + T * H + T * 2 * F + T * H) * cast
    # the amax reduction's kernels per layer: cat (read + write 4 B) and the update (read the reduced
    # amax, read and write the 1-row history, write the scale: 4·4 B) per quantizer, 4 modules × 3 | 2
    amax_f, amax_b = 4 * 3 * (8 + 16), 4 * 2 * (8 + 16)
    assert time_fp8.te_cast_bytes(llama(grad_accum=n)) == (x + w + amax_f, dy + amax_b)


def test_delayed_casts_move_less_than_current_scaling() -> None:
    # per element e fewer on every unfused cast (no amax pass), 2e − 1 fewer after the norms (2e − 1 = 3
    # for bf16: e + 2 → 3 − e), the amax kernels' bytes more
    e, n = 2, 4
    x_norm, x_other = 2 * T * H, T * A * D + T * F
    w, dy = ELEMENTS, T * (A + 2 * KV) * D + T * H + T * 2 * F + T * H
    fewer_f = x_norm * (2 * e - 1) + x_other * e + w * e // n - 4 * 3 * 24
    fewer_b = dy * e - 4 * 2 * 24
    current, delayed = (
        time_fp8.te_cast_bytes(llama(CURRENT, grad_accum=n)),
        time_fp8.te_cast_bytes(llama(grad_accum=n)),
    )
    assert (current[0] - delayed[0], current[1] - delayed[1]) == (fewer_f, fewer_b)


@pytest.mark.parametrize(("tp", "dp", "pp", "vpp"), [(2, 8, 1, 1), (1, 4, 2, 1), (2, 2, 2, 2)])
def test_one_amax_all_reduce_per_chunk_forward_and_backward(tp: int, dp: int, pp: int, vpp: int) -> None:
    n = 4
    r = plan(llama(dp=dp, grad_accum=n), Parallel(tp=tp, pp=pp, vpp=vpp))
    rows = [x for x in communication(r, H100.topology)[1] if x.dimension == "fp8"]
    chunk = L // (pp * vpp)  # the layers of one model chunk
    assert [(x.phase, x.collective, x.bytes, x.count, x.group, x.overlap) for x in rows] == [
        (Phase.FORWARD, Collective.ALL_REDUCE, chunk * 4 * 3 * 4, n * vpp, tp * dp, Overlap.NONE),
        (Phase.BACKWARD, Collective.ALL_REDUCE, chunk * 4 * 2 * 4, n * vpp, tp * dp, Overlap.NONE),
    ]


def test_the_amax_group_spans_tp_and_dp_across_nodes() -> None:
    # tp 2 × dp 8 = 16 ranks, 8 GPUs a node: two nodes
    r = plan(llama(dp=8), Parallel(tp=2))
    (fwd, _) = [x for x in communication(r, H100.topology)[1] if x.dimension == "fp8"]
    assert (fwd.link.level, fwd.link.nodes) == ("inter-node", 2)


def test_no_amax_all_reduce_alone_or_under_current_scaling() -> None:
    # one rank: ``get_world_size(group) > 1`` fails, no all-reduce; current scaling keeps no global buffer
    alone = [x for x in communication(estimate(llama()), H100.topology)[1] if x.dimension == "fp8"]
    current = [x for x in communication(plan(llama(CURRENT, dp=8)), H100.topology)[1] if x.dimension == "fp8"]
    assert alone == current == []


@pytest.mark.parametrize(
    ("impl", "message"),
    [
        (
            "torchtitan",
            "error: fp8: --impl torchtitan runs torchao's Float8Linear, which has no delayed scaling since "
            "torchao 0.10; use --fp8 tensorwise or rowwise, or --impl megatron (Transformer Engine)",
        ),
        (
            "reference",
            "error: fp8: --impl reference runs torchao's Float8Linear, which has no delayed scaling since "
            "torchao 0.10; use --fp8 tensorwise or rowwise, or --impl megatron (Transformer Engine)",
        ),
    ],
)
def test_delayed_outside_megatron_is_a_one_line_error(impl: str, message: str) -> None:
    r = runner.invoke(app, ["estimate", "-m", "llama-3-8b", "--impl", impl, "--fp8", "delayed"])
    assert r.exit_code == 2
    assert r.output.strip() == message


def test_the_note_names_delayed_scaling_and_its_history() -> None:
    r = runner.invoke(
        app, ["estimate", "-m", "llama-3-8b", "--impl", "megatron", "--fp8", "delayed", "--json"]
    )
    assert r.exit_code == 0
    notes = [n for n in json.loads(r.output)["notes"] if n.startswith("fp8:")]
    assert len(notes) == 1
    assert "--fp8-recipe delayed" in notes[0] and "DelayedScaling" in notes[0]
    assert "436,207,792 bytes a layer" in notes[0] and "amax histories of 1 row (" in notes[0]


def test_delayed_applies_to_megatron_only() -> None:
    assert te_fp8.delayed(llama()) and not te_fp8.delayed(llama(CURRENT)) and not te_fp8.delayed(llama(BF16))


def test_a_1024_row_history_adds_its_rows_to_the_weights() -> None:
    # TE's own default history: 1023 rows more than Megatron's 1, per module × (3 + 2) quantizers × 4 B
    rows = 1024
    longer = llama(DELAYED.model_copy(update={"fp8_amax_history_len": rows}))
    grown = estimate(longer).device.states.weights - estimate(llama()).device.states.weights
    assert grown == L * 4 * (3 + 2) * (rows - 1) * 4 == 2_618_880


def test_a_1024_row_history_moves_its_rows_twice_in_each_update() -> None:
    rows, n = 1024, 4
    longer = llama(DELAYED.model_copy(update={"fp8_amax_history_len": rows}), grad_accum=n)
    # per quantizer 4·(2 + 2·rows + 2) B: the cat, the reduced amax read, the history read and written, the
    # scale written; 4 modules × 3 forward, × 2 backward
    f, b = time_fp8.te_cast_bytes(longer)
    f1, b1 = time_fp8.te_cast_bytes(llama(grad_accum=n))
    assert (f - f1, b - b1) == (4 * 3 * 4 * 2 * (rows - 1), 4 * 2 * 4 * 2 * (rows - 1))


@pytest.mark.parametrize(
    "args", ["--fp8-amax-history-len 16", "--impl megatron --fp8 tensorwise --fp8-amax-history-len 16"]
)
def test_a_history_without_delayed_scaling_is_a_one_line_error(args: str) -> None:
    r = runner.invoke(app, ["estimate", "-m", "llama-3-8b", *args.split()])
    assert r.exit_code == 2
    assert r.output.strip() == (
        "error: fp8_amax_history_len: the amax history is Transformer Engine's delayed scaling; add --impl "
        "megatron --fp8 delayed or drop --fp8-amax-history-len"
    )


def test_the_amax_group_is_a_communicator_of_its_own() -> None:
    # tp 2 × dp 8: Megatron's _TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP, 16 ranks over two 8-GPU nodes, a ring
    delayed = plan(llama(dp=8), Parallel(tp=2)).setup
    current = plan(llama(CURRENT, dp=8), Parallel(tp=2)).setup
    got = [(c.name, c.ranks, c.peers, c.inter_node) for c in communicators(delayed, 0, H100.topology)]
    assert got == [("tp", 2, 0, False), ("dp", 8, 0, True), ("fp8 amax", 16, 0, True)]
    assert [c.name for c in communicators(current, 0, H100.topology)] == ["tp", "dp"]
