"""A calibrated GPU file from ``memplan calibrate``'s measurements (``measure.calibrate``): the base
preset's text with a new name and a ``[calibrated]`` table, which ``--gpu FILE`` reads and the step-time
prediction uses in place of ``efficiency``'s published fractions (``efficiency.matmul``, ``memory``, the
flash kernel's fraction in ``attention``).

Fractions: the best GEMM's FLOP/s over the preset's dense peak for the recipe's dtype (bf16), a device
copy's bytes read and written over its HBM bandwidth, SDPA's forward and backward over the dense peak,
and with ``--nproc`` an all-reduce's bus bandwidth over the node's ranks over ``intra_node_gbps`` (the
collectives then run on ``calibrated_topology``).
A fraction above 1 means the base preset is not this device: refused with that fix.
"""

from __future__ import annotations

import json
import re

from memplan.presets import Calibration, GpuPreset, Topology
from memplan.time.efficiency import NETWORK_INTRA


def fraction(what: str, achieved: float, peak: float, gpu: GpuPreset, unit: str) -> float:
    if not achieved > 0:
        raise ValueError(f"calibrate: measured no {what} rate on the device; run it again")
    value = achieved / peak
    if value > 1:
        raise ValueError(
            f"gpu: measured {what} {achieved:.4g} {unit} exceeds {gpu.name}'s {peak:.4g}; give --gpu the "
            "preset of the device it runs on"
        )
    return value


def calibration(
    gpu: GpuPreset,
    matmul_flops: float,
    copy_bytes: float,
    attention_flops: float,
    launch_s: float,
    device: str,
    busbw: float | None = None,
    chains: dict[str, tuple[float, float]] | None = None,
    attention_curve: tuple[tuple[int, float, float], ...] = (),
) -> Calibration:
    """The fractions of ``gpu``'s figures the rates reach; ``busbw``: an all-reduce's bus bandwidth over
    the node's ranks (``--nproc``), against ``intra_node_gbps``; ``chains``: the eager element-wise chains'
    bytes/s forward and backward, against the HBM bandwidth (not capped at 1: a count may exceed what a
    chain moves); ``attention_curve``: SDPA's causal (s, forward, backward) FLOP/s, against the peak."""
    peak = gpu.peak_tflops.bf16 * 1e12
    hbm = gpu.hbm_bandwidth_gbps * 1e9
    link = gpu.topology.intra_node_gbps * 1e9
    return Calibration(
        matmul=fraction("GEMM", matmul_flops, peak, gpu, "FLOP/s"),
        memory=fraction("copy", copy_bytes, hbm, gpu, "B/s"),
        attention=fraction("attention", attention_flops, peak, gpu, "FLOP/s"),
        launch_us=launch_s * 1e6 if launch_s > 0 else None,
        network_intra=fraction("all-reduce bus bandwidth", busbw, link, gpu, "B/s") if busbw else None,
        device=device,
        elementwise={k: (f / hbm, b / hbm) for k, (f, b) in chains.items()} if chains else None,
        attention_curve=tuple(
            (s, fraction("attention", f, peak, gpu, "FLOP/s"), fraction("attention", b, peak, gpu, "FLOP/s"))
            for s, f, b in attention_curve
        )
        or None,
    )


_TOPOLOGIES: dict[int, tuple[GpuPreset, Topology]] = {}
"""``calibrated_topology``'s answers by the preset's identity (the preset held, so its id is not reused):
the step-time prediction asks it several times per configuration, and ``fit`` times thousands."""


def calibrated_topology(gpu: GpuPreset) -> Topology:
    """The topology the collectives run on: a measured intra-node bus bandwidth — ``memplan calibrate``'s
    fraction, else the preset's sourced ``intra_node_busbw_gbps`` — scales ``intra_node_gbps`` so that
    ``comm``'s ``NETWORK_INTRA`` × it is that bus bandwidth. Made once per preset object (a frozen model)."""
    held = _TOPOLOGIES.get(id(gpu))
    if held is not None and held[0] is gpu:
        return held[1]
    if len(_TOPOLOGIES) >= 64:  # a long process building many presets (the tests) keeps a bounded memo
        _TOPOLOGIES.clear()
    topo = _scaled_topology(gpu)
    _TOPOLOGIES[id(gpu)] = (gpu, topo)
    return topo


def _scaled_topology(gpu: GpuPreset) -> Topology:
    """``calibrated_topology``, made."""
    c, topo = gpu.calibrated, gpu.topology
    if c is not None and c.network_intra is not None:
        scaled = topo.intra_node_gbps * c.network_intra / NETWORK_INTRA
    elif topo.intra_node_busbw_gbps is not None:
        scaled = topo.intra_node_busbw_gbps / NETWORK_INTRA
    else:
        return topo
    return topo.model_copy(update={"intra_node_gbps": scaled})


def preset_text(base: str, name: str, c: Calibration) -> str:
    """``base`` (a GPU preset's TOML) renamed ``name``, without aliases, with ``[calibrated]`` appended."""
    text = re.sub(r'(?m)^name = ".*"$', f'name = "{name}"', base, count=1)
    text = re.sub(r"(?m)^aliases = \[.*\]$", "aliases = []", text, count=1)
    lines = [
        "",
        "[calibrated]  # memplan calibrate: measured on the device; the step time uses these fractions",
        f"matmul = {c.matmul!r}",
        f"memory = {c.memory!r}",
    ]
    if c.attention is not None:
        lines.append(f"attention = {c.attention!r}")
    if c.launch_us is not None:
        lines.append(f"launch_us = {c.launch_us!r}")
    if c.network_intra is not None:
        lines.append(f"network_intra = {c.network_intra!r}")
    lines.append(f"device = {json.dumps(c.device)}")  # a JSON string is a TOML basic string
    if c.attention_curve:
        rows = ", ".join(f"[{s}, {f!r}, {b!r}]" for s, f, b in c.attention_curve)
        lines.append(f"attention_curve = [{rows}]  # s, forward, backward")
    if c.elementwise:
        lines += ["", "[calibrated.elementwise]  # forward, backward: each chain's counted bytes / HBM"]
        lines += [f"{k} = [{f!r}, {b!r}]" for k, (f, b) in c.elementwise.items()]
    return text.rstrip("\n") + "\n" + "\n".join(lines) + "\n"
