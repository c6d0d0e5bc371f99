"""Transformer Engine's float8 with Megatron-core's mixture of experts (``--impl megatron --fp8`` with a MoE
model: blocks/te_fp8.py ``expert_casts``, ``gemm_shapes``; blocks/moe/megatron.py; time/fp8.py
``te_gemms``), every figure by hand from TE's ``GroupedLinear``: each local expert's input cast, its
columnwise copy kept; each expert's weight cast and quantizers; the router left 16-bit.

The layout: Qwen3 30B-A3B (h 2048, 32 heads and 4 KV heads of 128, 48 layers, 128 experts top-8 of width
768) at s 4,096, micro-batch 1, on 16 GPUs with ep 8 (dp 16: each rank holds E/ep = 16 experts, its S =
T·k = 32,768 slots, 2,048 an expert; the expert-data-parallel group dp/ep = 2)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

from memplan.api import Options, setup_of
from memplan.blocks import te_fp8
from memplan.blocks.moe import megatron as megatron_moe
from memplan.cli.app import app
from memplan.time import fp8 as time_fp8

runner = CliRunner()

H, F, E, K, L, T = 2048, 768, 128, 8, 48, 4096
LOCAL = E // 8  # experts a rank holds at ep 8
S = T * K  # the rank's slots (dropless, balanced)
ATTN = H * (32 * 128 + 2 * 4 * 128) + 32 * 128 * H  # W_QKV and W_O
EXPERTS = LOCAL * (2 * F * H + H * F)  # the local experts' fc1 [2f, h] and fc2 [h, f]
DENSE = (
    2 * 151_936 * H + L * (ATTN + 2 * H + 2 * 128 + H * E) + H
)  # embedding, head, attention, norms, router
ARGV = (
    "estimate -m qwen3-30b-a3b --seq 4096 --batch 1 --global-batch 128 --gpus 16 --impl megatron --zero 1 "
    "--overlap-grad-reduce --overlap-param-gather --reduce-dtype bf16 --ep 8 --json"
)


def _run(extra: str, gpu: str = "h100-sxm") -> dict[str, Any]:
    r = runner.invoke(app, [*(ARGV + f" --gpu {gpu} " + extra).split()])
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def _tensors(out: dict[str, Any]) -> dict[str, tuple[list[int], str]]:
    return {t["name"]: (t["shape"], t["dtype"]) for t in out["activations"]["tensors"]}


def test_the_grouped_linears_keep_float8_inputs_one_scale_per_expert() -> None:
    """Current scaling on Hopper: fc1's dispatched tokens [S, h] and fc2's weighted activation [S, f] as
    1-byte columnwise copies with 16 fp32 scale_invs each; the router's input (the MLP input) and the
    weighted SwiGLU's [S, 2f] input stay bf16; nothing of the dense MLP's casts is left."""
    saves = _tensors(_run("--fp8 tensorwise"))
    assert saves["moe.expert_input"] == ([S, H], "uint8")
    assert saves["moe.expert_input_scale_inv"] == ([LOCAL], "fp32")
    assert saves["moe.down_input"] == ([S, F], "uint8")
    assert saves["moe.down_input_scale_inv"] == ([LOCAL], "fp32")
    assert saves["mlp.input"] == ([1, T, H], "bf16")
    assert saves["moe.fc1"] == ([S, 2 * F], "bf16")
    assert saves["attn.input"] == ([1, T, H], "uint8")  # W_QKV's LayerNormLinear: as in a dense layer
    assert not [n for n in saves if n.startswith("mlp.") and n != "mlp.input"]


def test_mxfp8_keeps_each_experts_grid_of_columnwise_scales() -> None:
    """MXFP8 on Blackwell: each expert's [2048, in] columnwise copy has a [2048/32, in] grid of E8M0
    scales (64 rows, a multiple of 4; 2048 and 768 columns, multiples of 128: no padding)."""
    saves = _tensors(_run("--fp8 mxfp8", gpu="b200"))
    assert saves["moe.expert_input"] == ([S, H], "uint8")
    assert saves["moe.expert_input_scale_inv"] == ([LOCAL, S // LOCAL // 32, H], "uint8")
    assert saves["moe.down_input_scale_inv"] == ([LOCAL, S // LOCAL // 32, F], "uint8")


def test_weights_hold_the_float8_primary_weights_and_their_transposes() -> None:
    """--fp8-param-gather on Hopper: every TE weight (W_QKV, W_O, 16 experts' fc1 and fc2) has no bf16 copy
    and 1 byte of data plus 1 of transpose; each of the 34 weights a ``[1]`` fp32 scale_inv and 5
    current-scaling quantizers of 8 bytes; the router, the norms, the embedding and the head stay bf16."""
    primary = ATTN + EXPERTS
    resident = 2 * primary + 34 * 4 + 34 * 5 * 8
    weights = 2 * (DENSE + L * EXPERTS) - L * 2 * primary + L * resident
    assert _run("--fp8 tensorwise --fp8-param-gather")["memory"]["weights"] == weights == 10_330_015_872


def test_the_two_data_parallel_groups_gather_their_float8_weights() -> None:
    """The distributed optimizer over dp 16 gathers the dense parameters, the attention's linears in
    float8 (1 byte, not 2); over the expert-data-parallel group (2 ranks) the local experts', all float8.
    The gradients' reduce-scatters stay bf16 (--reduce-dtype bf16)."""
    rows = {
        (r["dimension"], r["collective"]): r["bytes"]
        for r in _run("--fp8 tensorwise --fp8-param-gather")["time"]["communication"]
        if r["dimension"].startswith("dp")
    }
    assert rows["dp", "reduce-scatter"] == 2 * DENSE
    assert rows["dp", "all-gather"] == 2 * DENSE - L * ATTN
    assert rows["dp experts", "reduce-scatter"] == 2 * L * EXPERTS
    assert rows["dp experts", "all-gather"] == L * EXPERTS


def test_casts_of_one_layer_by_hand() -> None:
    """Current scaling on Hopper (e = 2, two copies written): the norm's W_QKV input e + 2 an element, every
    other input 2e + 2 (the experts' too: the pre-MLP norm is a TENorm of its own), each weight once a
    step (÷ 8 micro-batches), each output gradient 2e + 2; an expert GEMM 2,048 rows of its 16."""
    setup = setup_of(
        Options(
            model="qwen3-30b-a3b", seq=T, batch=1, global_batch=128, gpus=16, impl="megatron", zero=1,
            ep=8, fp8="tensorwise",
        )
    )  # fmt: skip
    rows, n = S // LOCAL, LOCAL
    q = 32 * 128 + 2 * 4 * 128
    forward = T * H * 4 + H * q * 6 // 8  # W_QKV
    forward += T * 4096 * 6 + 4096 * H * 6 // 8  # W_O
    forward += n * rows * H * 6 + n * H * 2 * F * 6 // 8  # the experts' fc1
    forward += n * rows * F * 6 + n * F * H * 6 // 8  # the experts' fc2
    backward = (T * q + T * H + n * rows * 2 * F + n * rows * H) * 6
    assert time_fp8.te_cast_bytes(setup) == (forward, backward)


def test_fc1_backward_grows_by_the_slots_casts() -> None:
    """d(fc1) over S slots, not T tokens: its rowwise and columnwise casts (2 bytes an element of [·, 2f])
    grow by (S − T)·2f·2, fc2's released float8 input by (S − T)·f: 3f·(S − T) more at fc1's backward."""
    setup = setup_of(Options(model="qwen3-30b-a3b", seq=T, batch=1, impl="megatron", fp8="tensorwise"))
    assert megatron_moe.fp8_backward_extra(setup, T, S, F) == 3 * F * (S - T)
    plain = setup_of(Options(model="qwen3-30b-a3b", seq=T, batch=1, impl="megatron"))
    assert megatron_moe.fp8_backward_extra(plain, T, S, F) == 0


def test_gemm_shapes_of_a_moe_layer() -> None:
    setup = setup_of(Options(model="qwen3-30b-a3b", seq=T, impl="megatron", fp8="tensorwise"))
    m = setup.model
    assert te_fp8.gemm_shapes(m, ep=8) == [(5120, H, 1), (H, 4096, 1), (2 * F, H, LOCAL), (H, F, LOCAL)]
    assert te_fp8.gemm_weights(m, ep=8) == 34
    assert te_fp8.routed_elements(m, ep=8) == EXPERTS


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        ("-m qwen3-30b-a3b --impl megatron --fp8 delayed", "with --fp8 tensorwise or mxfp8"),
        ("-m qwen1.5-moe-a2.7b --impl megatron --fp8 tensorwise", "without shared experts"),
        ("-m qwen3-30b-a3b --impl megatron --fp8 tensorwise --zero 3 --dp 2", "without Megatron FSDP"),
        ("-m deepseek-v3 --impl megatron --fp8 tensorwise", "with MLA is not modelled"),
    ],
)
def test_refused_where_not_modelled_in_one_line(argv: str, why: str) -> None:
    r = runner.invoke(app, ["estimate", *argv.split(), "--seq", "1024", "--gpu", "h100-sxm"])
    assert r.exit_code == 2
    assert why in r.stderr and len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("error: fp8:")


def test_the_verdict_names_why_zero3_cannot_be_counted() -> None:
    """The verdict's GPU count tries --zero 3 with the user's other options: with float8 experts under
    --fp8-param-gather it is refused, and the count says why instead of a peak it never estimated."""
    argv = ARGV.replace("--batch 1 --global-batch 128 --gpus 16", "--batch 8 --global-batch 64 --gpus 8")
    r = runner.invoke(app, [*argv.split(), "--gpu", "b200", "--fp8", "mxfp8", "--fp8-param-gather"])
    assert r.exit_code == 0, r.stderr
    verdict = json.loads(r.stdout)["verdict"]
    assert not verdict["fits"] and verdict["counts"]
    for count in verdict["counts"]:
        assert count["devices"] is None and count["refused"].startswith(
            "fp8_param_gather: --fp8-param-gather"
        )


def test_the_verdict_panel_says_the_refusal() -> None:
    """The panel's count line says ZeRO-3 is refused and why, where it said "the peak stays 0 B"."""
    argv = ARGV.replace("--batch 1 --global-batch 128 --gpus 16", "--batch 8 --global-batch 64 --gpus 8")
    argv = argv.replace(" --json", "")
    r = runner.invoke(app, [*argv.split(), "--gpu", "b200", "--fp8", "mxfp8", "--fp8-param-gather"])
    assert r.exit_code == 0, r.stderr
    text = " ".join(r.stdout.replace("│", " ").split())
    assert "no data-parallel count on b200: --zero 3 is refused with these options (fp8_param_gather:" in text
    assert "the peak stays 0 B" not in text
