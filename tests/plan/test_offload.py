"""Offload against the accounting of the papers and of DeepSpeed's implementation (strategies/offload.py).

ZeRO-Offload (Ren et al. 2021, §4.1 and Fig. 2): with mixed-precision Adam the device keeps the 16-bit
weights, 2Ψ bytes ("reduces GPU memory for model states from 16M to 2M"); the host holds the fp32 master
weights, momentum and variance, 12Ψ (ZeRO's K = 12), and the gradients: 16-bit in the paper (2Ψ), copied
into fp32 buffers by DeepSpeed (``async_inplace_copy_grad_to_fp32_buffer_from_gpu``: 4Ψ), which memplan
models. The paper trains a 13B model on one 32 GB V100.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memplan.api import Options, build
from memplan.cli.app import app

PSI = 13_015_864_320  # Llama-2-13B's parameters (its preset, tests/test_presets.py)


def host_and_device(**kw: object) -> tuple[dict[str, int], dict[str, int]]:
    b = build(Options(model="llama-2-13b", **kw))  # type: ignore[arg-type]
    dev, host = b.result.device.states, b.result.device.host
    return (
        {"weights": dev.weights, "gradients": dev.gradients, "optimizer": dev.optimizer},
        {"weights": host.weights, "gradients": host.gradients, "optimizer": host.optimizer},
    )


def test_zero_offload_moves_12_psi_of_optimizer_and_the_gradients_to_the_host() -> None:
    device, host = host_and_device(seq=1024, offload="optimizer")
    assert device == {"weights": 2 * PSI, "gradients": 0, "optimizer": 0}  # the paper's 2M
    assert host == {"weights": 0, "gradients": 4 * PSI, "optimizer": 12 * PSI}  # K = 12; DeepSpeed's fp32


def test_zero_offload_partitions_the_host_states_over_data_parallel_ranks() -> None:
    # ZeRO-Offload with ZeRO-2 over Nd ranks: each rank's host holds its partition, ⌈Ψ/Nd⌉ elements.
    _, host = host_and_device(seq=1024, offload="optimizer", zero=2, gpus=8)
    shard = -(-PSI // 8)
    assert host == {"weights": 0, "gradients": 4 * shard, "optimizer": 12 * shard}


def test_13b_fits_one_32gb_v100_with_zero_offload_only() -> None:
    # Ren et al. 2021: a 13B model trained on one 32 GB V100 (32 GiB HBM2), which plain training cannot.
    v100 = 32 * 2**30
    plain = build(Options(model="llama-2-13b", seq=1024, checkpointing="full")).result
    offload = build(Options(model="llama-2-13b", seq=1024, checkpointing="full", offload="optimizer")).result
    assert plain.peak.bytes > v100 >= offload.peak.bytes
    assert offload.peak.moments["optimizer step"]["transient"] == 0  # the step runs on the CPU


def test_parameter_offload_keeps_one_gathered_unit_on_the_device() -> None:
    b = build(Options(model="llama-2-13b", seq=1024, offload="optimizer,params", zero=3)).result
    assert b.device.states.weights == 0 and b.device.host.weights == 2 * PSI
    layer = b.params.layer.total * 2
    # The gathered unit is the largest of a layer, the embedding and the head (ZeRO-3's rule).
    unit = max(layer, b.params.embedding * 2, b.params.lm_head * 2)
    assert b.peak.moments["layer backward"]["weights"] == unit


def test_activation_offload_leaves_no_saved_activation_on_the_device() -> None:
    plain = build(Options(model="llama-2-13b", seq=1024)).result
    off = build(Options(model="llama-2-13b", seq=1024, offload="activations")).result
    assert off.activations == 0
    # The distinct saved storages and a copy of every weight but the embedding (13B untied: Ψ − v·h): a
    # lower bound of what save_on_cpu copies (tests/measure/test_offload.py).
    weights = 2 * (PSI - 32_000 * 5120)
    assert off.device.host.activations == plain.activations + weights
    for moment in ("loss backward", "layer backward"):  # a layer's saves brought back, not all layers'
        assert off.peak.moments[moment]["activations"] < plain.peak.moments[moment]["activations"]


def test_host_verdict_needs_zero_to_share_a_node() -> None:
    # Llama-2-70B, ZeRO-Offload on one 8-GPU node of 2 TiB: without ZeRO each of the 8 ranks holds
    # 16 bytes per parameter on the host (8 × 1.1 TB); ZeRO-1 partitions it (1.1 TB in all).
    kw = {"model": "llama-2-70b", "seq": 1024, "offload": "optimizer", "gpus": 8, "host_memory": 2048.0}
    replicated = build(Options(**kw)).host  # type: ignore[arg-type]
    sharded = build(Options(**kw, zero=1)).host  # type: ignore[arg-type]
    assert replicated is not None and sharded is not None
    assert not replicated.fits and sharded.fits
    assert replicated.need == 8 * replicated.per_device


def test_the_gpu_presets_node_gives_the_host_memory() -> None:
    b = build(Options(model="llama-2-13b", seq=1024, offload="optimizer", gpu="h100"))
    assert b.host is not None and b.host.host_memory_bytes == 2048 * 2**30  # DGX H100: 2 TB


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--offload", "optimizer", "--precision", "fp32"], "offload"),
        (["--offload", "params"], "offload"),
        (["--offload", "activations", "--checkpointing", "full"], "offload"),
        (["--offload", "gpu"], "offload"),
        (["--host-memory", "-1"], "host-memory"),
        (["--loss", "chunked:0"], "loss"),
        (["--loss", "fast"], "loss"),
    ],
)
def test_mistakes_are_one_line_errors(args: list[str], field: str) -> None:
    r = CliRunner().invoke(app, ["estimate", "-m", "tiny", *args])
    assert r.exit_code == 2
    assert field in r.output and "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1


def test_json_has_memory_host() -> None:
    r = CliRunner().invoke(app, ["estimate", "-m", "tiny", "--offload", "optimizer", "--json"])
    host = json.loads(r.stdout)["memory"]["host"]
    assert set(host) == {"weights", "gradients", "optimizer", "activations", "total"}
    # tiny, 106,816 parameters, bf16-mixed AdamW: the fp32 master weights, m and v (12 bytes each) and the
    # fp32 host gradient buffer (4 bytes) live on the host; the 16-bit weights and the saves stay
    p = 106_816
    assert (host["weights"], host["gradients"], host["optimizer"], host["activations"]) == (
        0,
        4 * p,
        12 * p,
        0,
    )
    assert host["total"] == 16 * p
