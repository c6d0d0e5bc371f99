"""The estimate's CUDA rules checked without a GPU: the reference model's CUDA code path on the meta device.

The meta device's kernels return what the CUDA kernels return (torch/_meta_registrations.py): the flash
kernel's RNG state as a [2] uint64 and an unused [] uint64, whatever the dropout (PyTorch's flash_api.cpp
``mha_fwd`` allocates both on the GPU); ``native_layer_norm``'s mean and rstd in fp32 under 16-bit inputs
(CUDA accumulates in fp32); ``native_dropout``'s bool mask. Each case compares ``estimate --device cuda``
with that run per tensor, per layer and in FLOPs, and checks the CUDA-only tensors' dtype and shape as the
kernels report them (not as the estimate says), so a wrong rule on either side fails here.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

from memplan.api import Options, setup_of
from memplan.cli.app import app
from memplan.config import Device, Setup
from memplan.engine import estimate
from memplan.measure.compare.tensors import compare
from memplan.measure.instruments.measured import Measured
from memplan.measure.runs.run import measure, trace_device

CASES: dict[str, dict[str, Any]] = {
    "flash": {"model": "tiny", "attention": "flash"},
    "flash+dropout": {"model": "tiny", "attention": "flash", "dropout": 0.1},
    "eager+dropout": {"model": "tiny", "attention": "eager", "dropout": 0.1},
    "gpt2 (LayerNorm, flash, dropout)": {"model": "gpt2", "precision": "bf16-mixed"},
    "gpt2 fp32 eager": {"model": "gpt2", "precision": "fp32", "attention": "eager"},
    "full checkpointing": {"model": "tiny", "checkpointing": "full", "dropout": 0.1},
    "selective": {"model": "gpt2", "checkpointing": "selective"},
    "every-2": {"model": "tiny", "checkpointing": "every-2"},
    "mixture of experts": {"model": "mixtral-8x7b", "seq": 32},
}


pytestmark = pytest.mark.xdist_group("cuda_semantics")  # one worker runs each setup once (``on_meta``)


def cuda_setup(options: dict[str, Any]) -> Setup:
    return setup_of(Options(**{"seq": 64, **options, "device": Device.CUDA}))


def on_meta(setup: Setup) -> Measured:
    """The run of ``setup`` on the meta device (the CUDA kernels' outputs), once per setup in a process:
    several tests read the same run (the cases above and the RNG-state, LayerNorm and mask checks)."""
    key = setup.model_dump_json()
    if key not in _RUNS:
        _RUNS[key] = measure(setup, fake=True, device="meta")
    return _RUNS[key]


_RUNS: dict[str, Measured] = {}


def records(meas: Measured, name: str) -> list[tuple[tuple[int, ...], str, int]]:
    return [(r.shape, r.dtype, r.bytes) for r in meas.records if r.name == name]


@pytest.mark.parametrize("options", CASES.values(), ids=list(CASES))
def test_cuda_estimate_equals_the_cuda_kernels(options: dict[str, Any]) -> None:
    setup = cuda_setup(options)
    assert trace_device(setup.device) == "meta"
    meas = on_meta(setup)
    c = compare(estimate(setup), meas)
    assert c.equal, [r for r in c.tensors if not r.equal] or (c.est_layers, c.meas_layers, c.flops)


def test_flash_rng_state_is_a_two_element_uint64_and_an_unused_scalar() -> None:
    """One [2] uint64 (16 B) and one [] uint64 (8 B) per layer, with or without dropout (24 B, where two
    int64 scalars would be 16 B): the meta kernel's outputs, which autograd saves for the backward."""
    for p in (0.0, 0.1):
        setup = cuda_setup({"model": "tiny", "attention": "flash", "dropout": p})
        meas = on_meta(setup)
        layers = setup.model.num_layers
        assert records(meas, "attn.philox_seed") == [((2,), "uint64", 16)] * layers
        assert records(meas, "attn.philox_offset") == [((), "uint64", 8)] * layers


def test_layer_norm_statistics_are_fp32_on_cuda_and_16_bit_on_cpu() -> None:
    """native_layer_norm under bf16 inputs: mean and rstd [b, s, 1] in fp32 on CUDA (meta), bf16 on CPU."""
    options = {"model": "gpt2", "precision": "bf16-mixed", "attention": "eager", "dropout": 0.0}
    cuda = on_meta(cuda_setup(options))
    cpu = measure(setup_of(Options(seq=64, **options, device=Device.CPU)), fake=True, device="cpu")
    for name in ("attn_norm.mean", "attn_norm.rstd", "final_norm.rstd"):
        assert {r[:2] for r in records(cuda, name)} == {((1, 64, 1), "fp32")}, name
        assert {r[:2] for r in records(cpu, name)} == {((1, 64, 1), "bf16")}, name


def test_cuda_dropout_masks_are_bool() -> None:
    meas = on_meta(cuda_setup({"model": "gpt2", "attention": "eager"}))
    for name in ("attn.dropout_mask", "attn.resid_dropout_mask", "mlp.resid_dropout_mask"):
        kept = records(meas, name)
        assert kept and {dtype for _, dtype, _ in kept} == {"bool"}, name


@pytest.mark.parametrize("model", ["tiny", "gpt2"])
def test_the_cpu_rules_do_not_describe_the_cuda_kernels(model: str) -> None:
    """The check has teeth: the cpu estimate (no RNG state; LayerNorm statistics in the input dtype)
    differs from the CUDA kernels' run, so a CUDA rule dropped from the estimate fails the cases above."""
    options = {"model": model, "attention": "flash", "precision": "bf16-mixed"}
    meas = on_meta(cuda_setup(options))
    cpu = estimate(setup_of(Options(seq=64, **options, device=Device.CPU)))
    assert not compare(cpu, meas).equal


def test_trace_device_cuda_cli() -> None:
    runner = CliRunner()
    args = ["trace", "--model", "gpt2", "--seq", "64", "--device", "cuda", "--json"]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["ran_on"] == "meta" and data["diff"]["equal"]
    assert data["estimated"]["setup"]["device"] == "cuda"
    # Without --device the trace runs the cpu kernels, where gpt2's attention dropout has no flash kernel.
    res = runner.invoke(app, args[:-3])
    assert res.exit_code == 2 and "--device cuda" in res.stderr
