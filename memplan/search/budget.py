"""Does a plan fit a GPU, and if not, which memory term overflows.

The most loaded device's terms are added in the order they are allocated — weights, optimizer states
(master copy included), gradients, activations, then the peak's transient on top — and the first sum to
pass the GPU's usable memory names the overflowing term: "weights" means the weights alone do not fit, and
"activations" that the model states fit but not with the activations.

Usable memory = the vendor's capacity (``memory_bytes`` of the GPU preset) − a reserve (``--reserve``,
default ``DEFAULT_RESERVE_GIB`` = 1 GiB) for what the estimate does not count (``analytic.peak``): the CUDA
context with the kernels of torch, cuBLAS and cuDNN loaded (about 0.3–0.6 GiB on an H100 with CUDA 12's
lazy loading; PyTorch's CUDA semantics notes say this memory is not reported by ``memory_allocated``),
cuBLAS workspaces, NCCL's communicator buffers, and the caching allocator's rounding (2 MiB blocks, 20 MiB
segments) and fragmentation. 1 GiB is a floor, not a bound: a fragmented allocator can hold several GiB more.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict

from memplan.config import Offload
from memplan.engine import Result, StagePlan
from memplan.presets import GpuPreset

DEFAULT_RESERVE_GIB = 1.0
"""Memory kept back per GPU by default, in GiB (2³⁰ bytes): CUDA context and allocator (module docstring)."""
DEFAULT_RESERVE = int(DEFAULT_RESERVE_GIB * 2**30)


def reserve_bytes(gib: float, gpu: GpuPreset) -> int:
    """``--reserve`` GiB → bytes; a one-line ``ValueError`` unless 0 ≤ reserve < the GPU's memory."""
    total = gpu.memory_bytes / 2**30
    if not (math.isfinite(gib) and 0 <= gib < total):
        raise ValueError(
            f"reserve: must be 0 ≤ GiB < the {gpu.name}'s {total:g} GiB, got {gib}; e.g. --reserve 1 "
            "(CUDA context and allocator), --reserve 0 for the vendor's full capacity"
        )
    return int(gib * 2**30)


class Verdict(BaseModel):
    model_config = ConfigDict(frozen=True, defer_build=True)  # built on first use (start-up)
    gpu: str
    memory_bytes: int
    """The vendor's capacity."""
    reserve: int
    """Kept back for the CUDA context and the allocator (``--reserve``)."""
    usable_bytes: int
    """memory_bytes − reserve: what the plan must fit in."""
    peak: int
    """The peak of the most loaded device; when ``exact`` is false, a lower bound of it that already
    exceeds the memory (the peak itself was not needed to say so)."""
    exact: bool
    stage: int
    phase: str
    """The peak's moment (``analytic.peak``); ``lower bound`` when not exact."""
    fits: bool
    headroom: int
    """usable − peak (negative when it does not fit)."""
    overflow: str | None
    """The term whose addition passes the usable memory (one of ``TERMS``); None when it fits."""

    def to_json(self) -> dict[str, object]:
        return self.model_dump()


def terms(sp: StagePlan, peak: int | None = None) -> dict[str, int]:
    """The device's memory terms, in allocation order; ``transient``: what the peak adds on top (0 when
    the peak is not given)."""
    st = sp.states
    values = {
        "weights": st.weights,
        "optimizer": st.optimizer,
        "gradients": st.gradients,
        "activations": sp.activations,
    }
    values["transient"] = max(0, peak - sum(values.values())) if peak is not None else 0
    return values


def peak_terms(sp: StagePlan) -> dict[str, int]:
    """The terms alive at the device's peak moment (``analytic.peak``): at the optimizer step the
    activations are gone, so an overflow there is the states' or the step's, never the activations'."""
    return sp.peak.moments[sp.peak.phase]


def overflow(values: dict[str, int], memory: int) -> str:
    """The first term whose running sum passes ``memory`` (the transient if none of the others does)."""
    total = 0
    for name, value in values.items():
        total += value
        if total > memory:
            return name
    return "transient"


def verdict(p: Result, gpu: GpuPreset, *, exact: bool = True, reserve: int = DEFAULT_RESERVE) -> Verdict:
    """Fit or not on ``gpu`` with ``reserve`` bytes kept back. With ``exact=False`` (the fit search) the peak
    is computed only when the stages' lower bounds do not already exceed the usable memory."""
    memory = gpu.memory_bytes - reserve
    bound = max(p.stages, key=lambda sp: sp.lower_bound)
    if not exact and bound.lower_bound > memory:
        dev, peak, exact, phase = bound, bound.lower_bound, False, "lower bound"
    else:
        dev = p.device
        peak, exact, phase = dev.peak.bytes, True, dev.peak.phase
    return Verdict(
        gpu=gpu.name,
        memory_bytes=gpu.memory_bytes,
        reserve=reserve,
        usable_bytes=memory,
        peak=peak,
        exact=exact,
        stage=dev.stage.index,
        phase=phase,
        fits=peak <= memory,
        headroom=memory - peak,
        overflow=None if peak <= memory else overflow(peak_terms(dev) if exact else terms(dev), memory),
    )


# ----------------------------------------------------------------------------------------------------
# Host memory (offload)
# ----------------------------------------------------------------------------------------------------
NODE_GPUS = 8
"""GPUs sharing one node's host memory: the 8 of an HGX / DGX board (DGX A100, H100, H200, B200). NB: the
GPU presets do not state it yet; a smaller job shares it among its own devices only."""


class HostVerdict(BaseModel):
    """Do one node's devices' offloaded tensors fit in its host memory?"""

    model_config = ConfigDict(frozen=True)
    host_memory_bytes: int
    """Host memory of one node (``--host-memory`` or the GPU preset's node)."""
    per_device: int
    """Host bytes of the most loaded device's offloaded tensors."""
    devices: int
    """Devices of the job on one node: min(devices, GPUs per node (the preset's topology, else 8))."""
    need: int
    fits: bool
    headroom: int

    def to_json(self) -> dict[str, object]:
        return self.model_dump()


def host_bytes(gib: float) -> int:
    """``--host-memory`` GiB → bytes; a one-line ``ValueError`` unless positive and finite."""
    if not (math.isfinite(gib) and gib > 0):
        raise ValueError(f"host-memory: must be a positive number of GiB per node, got {gib}; e.g. 2048")
    return int(gib * 2**30)


def host_fit(p: Result, gib: float | None, gpus_per_node: int = NODE_GPUS) -> HostVerdict | None:
    """``host_verdict`` for ``gib`` GiB per node of ``gpus_per_node`` GPUs (None without it)."""
    return None if gib is None else host_verdict(p, host_bytes(gib), gpus_per_node)


def host_verdict(p: Result, memory: int, gpus_per_node: int = NODE_GPUS) -> HostVerdict:
    """Whether ``memory`` bytes of one node's host memory hold the offloaded tensors of its devices (each
    as much as the most loaded device's, an upper bound for pipeline stages)."""
    per_device = max(sp.host.total for sp in p.stages)
    devices = min(p.devices, gpus_per_node)
    need = per_device * devices
    return HostVerdict(
        host_memory_bytes=memory,
        per_device=per_device,
        devices=devices,
        need=need,
        fits=need <= memory,
        headroom=memory - need,
    )


def host_fits(p: Result, gpu: GpuPreset) -> bool:
    """With offload, the node's host memory (the preset's) holds its devices' offloaded tensors."""
    if p.setup.offload is Offload.NONE or gpu.host_memory_gib is None:
        return True
    host = host_fit(p, gpu.host_memory_gib, gpu.topology.gpus_per_node)
    return host is None or host.fits


def fits(p: Result, memory: int) -> bool:
    """Every computed stage fits: the lower bound first, the peak only when needed."""
    return all(sp.lower_bound <= memory for sp in p.stages) and p.device.peak.bytes <= memory
