"""Transformer Engine's per-tensor float8 on a GPU whose float8 GEMMs take any operand layout (Blackwell:
``GpuPreset.fp8_any_layout``, TE's ``is_non_tn_fp8_gemm_supported``): one float8 copy of each tensor, no
transpose — the weight cache, the saved inputs, the output gradients' casts and the casts' traffic by hand
(blocks/te_fp8.py ``copies``), against the Hopper rule of tests/plan/test_te_fp8.py."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memplan.api import Options, setup_of
from memplan.blocks import te_fp8
from memplan.cli.app import app
from memplan.config import Fp8Recipe, Impl, ImplConfig, Parallel
from memplan.engine import estimate
from memplan.presets import load_gpu
from memplan.time import fp8 as time_fp8

from .layout import plan
from .test_te_fp8 import BF16, KV, A, D, F, H, L, T, llama

runner = CliRunner()
ANY = ImplConfig(impl=Impl.MEGATRON, fp8=Fp8Recipe.TENSORWISE, fp8_any_layout=True)
ELEMENTS = H * (A + 2 * KV) * D + A * D * H + H * 2 * F + F * H  # one layer's four linears


@pytest.mark.parametrize(("gpu", "any_layout"), [("b200", True), ("h100-sxm", False), ("h200", False)])
def test_the_gpus_rule_is_tes(gpu: str, any_layout: bool) -> None:
    """``is_non_tn_fp8_gemm_supported``: compute capability 10.x (or 13 and above); Hopper's 9.0 takes TN
    operands only."""
    assert load_gpu(gpu).fp8_any_layout is any_layout


def test_set_from_the_gpu_for_megatrons_per_tensor_recipes_only() -> None:
    def flag(**kw: object) -> bool:
        return setup_of(Options(model="llama-3-8b", **kw)).impl.fp8_any_layout  # type: ignore[arg-type]

    assert flag(impl="megatron", fp8="tensorwise", gpu="b200")
    assert flag(impl="megatron", fp8="delayed", gpu="b200")
    assert not flag(impl="megatron", fp8="tensorwise", gpu="h100-sxm")
    assert not flag(impl="megatron", fp8="tensorwise")  # no GPU: the Hopper rule (the default GPU's)
    assert not flag(impl="megatron", fp8="mxfp8", gpu="b200")  # MXFP8 keeps both copies (blocks/mxfp8.py)
    assert not flag(impl="torchtitan", fp8="tensorwise", gpu="b200")  # torchao's casts, not TE's
    assert not flag(impl="megatron", gpu="b200")


def test_the_weight_cache_is_one_copy() -> None:
    """Per layer: the four linears' float8 data, 1 B an element (Hopper: data and transpose, 2 B), plus
    4 modules × ([1] fp32 scale_inv + 5 quantizers × 8 B)."""
    per_layer = ELEMENTS + 4 * (4 + 5 * 8)
    grown = estimate(llama(ANY)).device.states.weights - estimate(llama(BF16)).device.states.weights
    assert grown == L * per_layer


def test_sequence_parallel_keeps_one_copy_of_column_parallel_inputs() -> None:
    """The column-parallel linears' float8 input on the rank's s/t shard serves the backward's all-gather
    and the wgrad GEMM alike: no rowwise copy beside it."""
    got = {
        k.name: k.bytes for k in plan(llama(ANY), Parallel(tp=2, sp=True)).tensors if k.scope.value == "layer"
    }
    assert got["attn.input"] == got["mlp.input"] == T // 2 * H
    assert not any(name.endswith("_rowwise") for name in got)


def test_the_output_gradients_cast_once() -> None:
    assert te_fp8.grad_output_casts(llama(ANY), T, H) == T * H + 4
    assert te_fp8.grad_output_casts(llama(), T, H) == 2 * T * H + 4


def test_the_casts_write_one_byte_an_element() -> None:
    """Current scaling: the norm-fused inputs (QKV, fc1) e + 1, the others' amax pass and cast 2e + 1, the
    weights once a step (a quarter a micro-batch at 4), dY 2e + 1 (Hopper: + 2 each)."""
    e, per = 2, 2 * 2 + 1
    x = T * H * (e + 1) * 2 + (T * A * D + T * F) * per
    w = ELEMENTS * per // 4
    dy = (T * (A + 2 * KV) * D + T * H + T * 2 * F + T * H) * per
    assert time_fp8.te_cast_bytes(llama(ANY, grad_accum=4)) == (x + w, dy)


def test_delayed_scalings_norm_writes_the_float8_copy_and_no_transpose() -> None:
    """Delayed scaling: the norm writes 1 byte an element where ``time.compute`` charged it e, and no
    ``nvte_transpose`` follows: 1 − e an element; the other casts e + 1."""
    delayed = ImplConfig(impl=Impl.MEGATRON, fp8=Fp8Recipe.DELAYED, fp8_any_layout=True)
    e, per = 2, 2 + 1
    x = T * H * (1 - e) * 2 + (T * A * D + T * F) * per
    w = ELEMENTS * per // 4
    dy = (T * (A + 2 * KV) * D + T * H + T * 2 * F + T * H) * per
    amax_f, amax_b = time_fp8.te_amax_bytes(llama(delayed))
    assert time_fp8.te_cast_bytes(llama(delayed, grad_accum=4)) == (x + w + amax_f, dy + amax_b)


def test_on_b200_the_estimate_holds_less_than_on_hopper_rules() -> None:
    """The same run on a B200, estimated with its rule and with Hopper's (``--gpu b200`` vs the flag
    cleared): the weights differ by one byte per layer-linear element of the rank's layers."""
    argv = "estimate -m llama-3-8b --seq 4096 --impl megatron --fp8 tensorwise --gpu b200 --json"
    r = runner.invoke(app, argv.split())
    assert r.exit_code == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["setup"]["fp8_any_layout"] is True
    hopper = estimate(llama()).device.states.weights
    assert hopper - got["memory"]["weights"] == L * ELEMENTS
