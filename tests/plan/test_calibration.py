"""A calibrated GPU file (``memplan calibrate``, issue #21 item 5): what the step time does with it, by
hand, and the file's round trip. The measurement itself runs in tests/measure/test_calibrate.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from memplan.api import Options, build
from memplan.presets import Calibration, gpu_text, load_gpu
from memplan.time import efficiency as eff
from memplan.time.calibration import calibration, preset_text


def _write(tmp_path: Path, c: Calibration) -> str:
    path = tmp_path / "cal.toml"
    path.write_text(preset_text(gpu_text("h100-sxm"), "my-h100", c), encoding="utf-8")
    return str(path)


def _prediction(gpu: str) -> dict[str, float]:
    b = build(Options(model="llama-3-8b", seq=4096, gpu=gpu))
    assert b.timing is not None
    pr = b.timing.prediction
    return {"matmul": pr.matmul_s, "attention": pr.attention_s, "elementwise": pr.elementwise_s}


def test_the_file_round_trips(tmp_path: Path) -> None:
    c = Calibration(matmul=0.71, memory=0.9, attention=0.42, launch_us=4.5, device='NVIDIA "X"')
    gpu = load_gpu(_write(tmp_path, c))
    assert gpu.name == "my-h100"
    assert gpu.calibrated == c
    assert gpu.peak_tflops == load_gpu("h100-sxm").peak_tflops  # the rest is the base preset's


def test_the_step_uses_the_measured_fractions(tmp_path: Path) -> None:
    # matmul and memory both at half of the published 0.80: the GEMMs' ridge (MATMUL·peak)/(MEMORY·HBM) is
    # unchanged, so every GEMM and element-wise kernel takes 0.80/0.40 = 2× as long; the flash kernel runs
    # at the measured 0.25 of the peak, both ways, instead of FlashAttention-2's 0.35 forward and 0.32
    # backward on Hopper.
    base = _prediction("h100-sxm")
    cal = _prediction(_write(tmp_path, Calibration(matmul=0.4, memory=0.4, attention=0.25)))
    assert eff.MATMUL == eff.MEMORY == 0.8
    assert cal["matmul"] == pytest.approx(2 * base["matmul"], rel=1e-12)
    assert cal["elementwise"] == pytest.approx(2 * base["elementwise"], rel=1e-12)
    # forward 4 and backward 10 products per counted cell: base FlashAttention-2 on Hopper at s 4,096
    # on its grid of 7.76 query tiles per SM (0.35 × 0.274/0.351 forward, 0.32 × 0.231/0.327 backward:
    # time/efficiency.py FA2_HOPPER_BY_SEQUENCE and FA2_HOPPER_GRID), calibrated 14/0.25
    ratio = (14 / 0.25) / (4 / (0.35 * 0.274 / 0.351) + 10 / (0.32 * 0.231 / 0.327))
    assert cal["attention"] == pytest.approx(base["attention"] * ratio, rel=1e-12)


def test_fractions_from_rates_and_a_device_faster_than_its_preset() -> None:
    h100 = load_gpu("h100-sxm")
    # 494.75 TFLOP/s of 989.5, 1,675 GB/s of 3,350, 247.375 TFLOP/s of 989.5
    c = calibration(h100, 494.75e12, 1675e9, 247.375e12, 5e-6, "gpu")
    assert (c.matmul, c.memory, c.attention, c.launch_us) == pytest.approx((0.5, 0.5, 0.25, 5.0), rel=1e-12)
    with pytest.raises(ValueError, match=r"gpu: measured GEMM .* exceeds h100-sxm's"):
        calibration(h100, 2000e12, 1675e9, 247e12, 5e-6, "gpu")


def test_a_measured_all_reduce_sets_the_links_bandwidth(tmp_path: Path) -> None:
    # network_intra 0.335 = half of NETWORK_INTRA 0.67: the collectives run on 450 GB/s · 0.335/0.67 =
    # 225 GB/s of H100's NVLink, so NETWORK_INTRA × it is the measured 0.335 × 450 GB/s.
    gpu = _write(tmp_path, Calibration(matmul=0.8, memory=0.8, network_intra=0.335))
    b = build(Options(model="llama-3-8b", seq=4096, gpu=gpu, gpus=8, tp=8))
    assert b.timing is not None
    rows = b.timing.prediction.communication
    assert rows
    assert [r.link.gbps for r in rows] == pytest.approx([225.0] * len(rows), rel=1e-12)


def test_calibrated_chains_replace_the_h200s(tmp_path: Path) -> None:
    """A GPU file whose eager RMSNorm streams at 0.4 of HBM both ways (``[calibrated.elementwise]``, what
    ``memplan calibrate`` measures): Llama-3-8B at s 4,096 (T = 4,096, h 4,096, 32 layers) on an H100 moves
    its two norms' bytes (36 an element forward, 92 backward, time/elementwise.py) at 0.4 × 3,350 GB/s in
    place of the table's 0.584 and 0.664 (time/efficiency.py ELEMENTWISE_STREAM); memory at MEMORY, so
    nothing else changes."""
    base = _prediction(_write(tmp_path, Calibration(matmul=0.8, memory=0.8)))
    cal = _prediction(
        _write(tmp_path, Calibration(matmul=0.8, memory=0.8, elementwise={"rmsnorm": (0.4, 0.4)}))
    )
    norm_f, norm_b = 2 * 4096 * 4096 * 36, 2 * 4096 * 4096 * 92
    hbm = 3350e9
    more = 32 * (norm_f * (1 / 0.4 - 1 / 0.584) + norm_b * (1 / 0.4 - 1 / 0.664)) / hbm
    assert cal["elementwise"] - base["elementwise"] == pytest.approx(more, rel=1e-9)
    assert cal["matmul"] == base["matmul"] and cal["attention"] == base["attention"]


def test_the_chains_round_trip(tmp_path: Path) -> None:
    c = Calibration(matmul=0.7, memory=0.85, elementwise={"rmsnorm": (0.5, 0.6), "gelu": (0.7, 1.1)})
    assert load_gpu(_write(tmp_path, c)).calibrated == c


def test_a_calibrated_length_curve_sets_the_flash_kernel(tmp_path: Path) -> None:
    """``attention_curve`` (SDPA's causal pick by length, ``memplan calibrate``): Llama-3-8B at s 4,096 takes
    the curve's 4,096 row, 0.30 forward and 0.20 backward of the dense peak, in place of FlashAttention-2's
    length-factored figures; forward 4 and backward 10 products per counted cell, the causal kernel running
    half of them (as with the published figures)."""
    curve = ((2048, 0.25, 0.15), (4096, 0.30, 0.20), (8192, 0.40, 0.30))
    base = _prediction("h100-sxm")
    cal = _prediction(_write(tmp_path, Calibration(matmul=0.8, memory=0.8, attention_curve=curve)))
    ratio = (4 / 0.30 + 10 / 0.20) / (4 / (0.35 * 0.274 / 0.351) + 10 / (0.32 * 0.231 / 0.327))
    assert cal["attention"] == pytest.approx(base["attention"] * ratio, rel=1e-12)
    assert load_gpu(_write(tmp_path, Calibration(matmul=0.8, memory=0.8, attention_curve=curve))).calibrated


def test_the_intra_node_bus_bandwidth_calibrate_then_the_presets_then_network_intra() -> None:
    """The collectives inside a node run at: ``memplan calibrate``'s measured all-reduce fraction of the
    link; else the preset's NCCL ring bandwidth (H100: 370 GB/s, "an effective NVLink bandwidth of 370GB/s",
    NVIDIA/nccl-tests issue #212); else ``NETWORK_INTRA`` 0.67 × the link (A100's 300 GB/s: 201). The
    topology ``calibrated_topology`` returns carries each as ``intra_node_gbps`` × 0.67. ``--intra-node-bw``
    replaces the link, and the preset's figure of the old link goes with it."""
    from memplan.time.calibration import calibrated_topology

    h100, a100 = load_gpu("h100-sxm"), load_gpu("a100-80gb")
    assert (h100.topology.intra_node_busbw_gbps, a100.topology.intra_node_busbw_gbps) == (370, None)
    assert calibrated_topology(h100).intra_node_gbps * eff.NETWORK_INTRA == pytest.approx(370, rel=1e-12)
    assert calibrated_topology(a100).intra_node_gbps == 300
    measured = h100.model_copy(update={"calibrated": Calibration(matmul=0.8, memory=0.8, network_intra=0.5)})
    assert calibrated_topology(measured).intra_node_gbps * eff.NETWORK_INTRA == pytest.approx(450 * 0.5)
    overridden = h100.topology.with_overrides(None, 600, None)
    assert (overridden.intra_node_gbps, overridden.intra_node_busbw_gbps) == (600, None)
