"""Does a plan fit a GPU, and if not, which memory term overflows.

The plan fits when what torch's caching allocator reserves at the step's peak (``reserved.replay_device``: the
estimate's allocations replayed through ``analytic.allocator``, cuBLAS's workspaces included) fits the memory
left to it: the memory the driver reports (``GpuPreset.device_bytes``: CUDA's measured total or nvidia-smi's
where the preset states them, e.g. 81,559 MiB on an H100 SXM, else the vendor's figure) less the CUDA context
(``reserved.CUDA_CONTEXT``, outside the allocator), less NCCL's buffers of the layout's communicators
(``time.comm.buffers.nccl_bytes``, outside the allocator too), less the communication buffers held beside the
step's replay (``time.comm.buffers.comm_buffer_bytes``: FSDP2's all-gather stream, its own pool whose reserved
peak is reached in the forward and held through the backward's peak; DDP's gradient buckets, held for the
whole run) and less ``--reserve`` (default 0: what memplan does not model, e.g. FSDP2's reduce-scatter buffers
outside its mixed precision, ``reserved``'s NB). When the reserved
peak of an unlimited replay passes it, the replay is run again with that capacity, as the allocator runs:
it releases its wholly free cached segments before it gives up, and the plan fits if no request is then
refused.
NB: the all-gather stream's reserved peak is kept back whole: at the default stream's peak one of its
segments may be wholly free (at the loss backward it holds only the forward's last buffer), and the
allocator's out-of-memory path would release it (``release_cached_blocks`` frees every stream's); the
two streams are not replayed together, so the judgement is conservative by at most that segment.
NB: FSDP2's reduce-scatter stream (under its mixed precision: ``analytic.fsdp.buffers``) is not kept
back. Its blocks are the sharded gradients, one per unit, each in its own segments (every output over
1 MiB is a large-pool request and the pool holds nothing else): at a moment without gradients (the
forward and the loss backward of every step after the first, after ``zero_grad(set_to_none=True)``; the
first step's, before any reduce) its segments are wholly free (a freed block merges with its free
split-off rest), and "if the cudaMalloc fails, the allocator will free all cached blocks that are not
split and retry the allocation" (c10/cuda/CUDACachingAllocator.cpp, its header; ``release_cached_blocks``,
every stream's). At a moment with
gradients their bytes are in the estimate's moments, judged by ``peak ≤ usable`` (not by the replay at
capacity, which holds no gradients): their segments' rounding (under 2 MiB a unit) and the two pools'
segments together at such a moment are not judged.

The overflowing term: the most loaded device's terms are added in the order they are allocated — weights,
optimizer states (master copy included), gradients, activations, then the peak's transient on top — and
the first sum to pass the usable memory names it ("weights": the weights alone do not fit; "activations":
the model states fit but not with the activations); ``allocator`` when the peak itself fits and only the
allocator's rounding, segments and cuBLAS workspace do not.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict

from memplan.config import Offload
from memplan.engine import Result
from memplan.presets import GpuPreset
from memplan.presets.topology import HGX_NODE_GPUS
from memplan.reserved import (
    CUDA_CONTEXT,
    Reserved,
    cublas_workspaces,
    fits_reserved,
    refuses,
    replay_device,
)
from memplan.stage_plan import StagePlan

DEFAULT_RESERVE_GIB = 0.0
"""Memory kept back per GPU by default, in GiB (2³⁰ bytes), beyond what memplan models (module docstring)."""
DEFAULT_RESERVE = int(DEFAULT_RESERVE_GIB * 2**30)


def reserve_bytes(gib: float, gpu: GpuPreset) -> int:
    """``--reserve`` GiB → bytes; a one-line ``ValueError`` unless 0 ≤ reserve < the GPU's memory."""
    total = gpu.device_bytes / 2**30
    if not (math.isfinite(gib) and 0 <= gib < total):
        raise ValueError(
            f"reserve: must be 0 ≤ GiB < the {gpu.name}'s {total:g} GiB, got {gib}; e.g. --reserve 1 "
            "(what memplan does not model: e.g. FSDP2's reduce-scatter buffers without --precision "
            "fsdp2-mixed), --reserve 0 for none"
        )
    return int(gib * 2**30)


def allocator_memory(gpu: GpuPreset, reserve: int, held: int = 0) -> int:
    """Bytes torch's caching allocator may reserve on ``gpu`` for the step's default stream: the driver's
    memory less the CUDA context, the buffers ``held`` beside it (NCCL's, FSDP2's all-gather stream, DDP's
    buckets) and ``reserve`` (never below 0)."""
    return max(0, gpu.device_bytes - CUDA_CONTEXT - held - reserve)


class Verdict(BaseModel):
    model_config = ConfigDict(frozen=True, defer_build=True)  # built on first use (start-up)
    gpu: str
    memory_bytes: int
    """The vendor's capacity."""
    device_bytes: int
    """What the driver reports (nvidia-smi's total; the vendor's capacity when the preset states none)."""
    cuda_context: int
    """Held outside torch's allocator (``reserved.CUDA_CONTEXT``)."""
    nccl: int = 0
    """NCCL's buffers, outside torch's allocator (``time.comm.buffers.nccl_bytes``)."""
    fsdp_all_gather_stream: int = 0
    """FSDP2's all-gather stream's reserved bytes, its own pool (``time.comm.buffers.fsdp_stream_bytes``)."""
    ddp_buckets: int = 0
    """torch DDP's gradient buckets (``time.comm.buffers.ddp_bucket_bytes``)."""
    userbuffers: int = 0
    """Transformer Engine's userbuffers under ``--tp-comm-overlap``, outside torch's allocator
    (``time.tp_overlap.userbuffer_bytes``)."""
    symm_mem: int = 0
    """torch's symmetric-memory workspace under ``--async-tp``, outside torch's allocator
    (``time.async_tp.workspace_bytes``)."""
    reserve: int
    """Kept back for what memplan does not model (``--reserve``)."""
    usable_bytes: int
    """device_bytes − cuda_context − nccl − fsdp_all_gather_stream − ddp_buckets − userbuffers − symm_mem −
    reserve:
    what the allocator may reserve for the step's default stream."""
    peak: int
    """The peak of the most loaded device's tensors (``memory.peak``); when ``exact`` is false, a lower
    bound of it that already exceeds the memory (the peak itself was not needed to say so)."""
    allocated_peak: int | None
    """The allocator's ``allocated_bytes.all.peak`` (None when not exact)."""
    reserved_peak: int | None
    """The allocator's ``reserved_bytes.all.peak``, the judged figure (None when not exact)."""
    capped: bool = False
    """The reserved peak is the replay at the usable memory's capacity (the allocator released cached
    segments to fit); otherwise the unlimited replay's."""
    exact: bool
    stage: int
    phase: str
    """The peak's moment (``analytic.peak``); ``lower bound`` when not exact."""
    fits: bool
    headroom: int
    """usable − reserved peak (− peak when not exact; negative when it does not fit)."""
    overflow: str | None
    """The term whose addition passes the usable memory (one of ``TERMS`` or ``allocator``); None when it
    fits."""

    def held(self) -> dict[str, int]:
        """What is kept off the allocator's share (``usable_bytes``), by field, those above 0, the largest
        first."""
        parts = {
            "cuda_context": self.cuda_context,
            "nccl": self.nccl,
            "fsdp_all_gather_stream": self.fsdp_all_gather_stream,
            "ddp_buckets": self.ddp_buckets,
            "userbuffers": self.userbuffers,
            "symm_mem": self.symm_mem,
            "reserve": self.reserve,
        }
        return dict(sorted(((k, b) for k, b in parts.items() if b > 0), key=lambda kb: -kb[1]))

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


def judged(p: Result, gpu: GpuPreset, memory: int, expandable: bool = False) -> tuple[Reserved, bool]:
    """The reserved replay on ``gpu`` and whether it fits ``memory`` (re-run at that capacity when the
    unlimited replay passes it: the allocator releases its free cached segments first)."""
    found = replay_device(p, gpu, expandable=expandable)
    if found.reserved_peak <= memory:
        return found, True
    at_capacity = fits_reserved(p, gpu, memory, expandable=expandable)
    return (found, False) if at_capacity is None else (at_capacity, True)


def verdict(
    p: Result, gpu: GpuPreset, *, exact: bool = True, reserve: int = DEFAULT_RESERVE, expandable: bool = False
) -> Verdict:
    """Fit or not on ``gpu`` with ``reserve`` bytes kept back (``expandable``: the allocator with
    expandable segments). With ``exact=False`` (the fit search) the peak is computed only when the stages'
    lower bounds do not already exceed the usable memory."""
    from memplan.time.async_tp import workspace_bytes
    from memplan.time.comm.buffers import ddp_bucket_bytes, fsdp_stream_bytes, nccl_bytes  # with a GPU
    from memplan.time.tp_overlap import userbuffer_bytes

    bound = max(p.stages, key=lambda sp: sp.lower_bound)
    allocated = reserved = None
    capped = False

    def held(sp: StagePlan) -> tuple[int, int, int]:
        # outside the allocator (NCCL) and beside the default stream (FSDP2's stream, DDP's buckets) on
        # a rank of ``sp``: the bound's when the bound decides (the most loaded device is then never
        # computed), else the most loaded device's
        return nccl_bytes(p, gpu, sp.stage.index), fsdp_stream_bytes(p, sp) or 0, ddp_bucket_bytes(p, sp)

    # TE's userbuffers, the symmetric-memory workspace: outside the allocator, the same on every rank
    ub, symm = userbuffer_bytes(p.setup), workspace_bytes(p.setup)
    nccl, stream, ddp = held(bound)
    memory = allocator_memory(gpu, reserve, nccl + stream + ddp + ub + symm)
    if not exact and bound.lower_bound > memory:
        dev, peak, exact, phase = bound, bound.lower_bound, False, "lower bound"
        stream_peak = peak
        fit, headroom = False, memory - peak
    else:
        dev = p.device
        if dev.stage.index != bound.stage.index:
            nccl, stream, ddp = held(dev)
            memory = allocator_memory(gpu, reserve, nccl + stream + ddp + ub + symm)
        peak, exact, phase = dev.peak.bytes, True, dev.peak.phase
        # judged on the default stream's peak: FSDP2's all-gather outputs are kept back with their stream
        stream_peak = dev.peak.default_stream_bytes
        unlimited = replay_device(p, gpu, expandable=expandable)
        found, fit = judged(p, gpu, memory, expandable) if stream_peak <= memory else (unlimited, False)
        allocated, reserved = found.allocated_peak, found.reserved_peak
        capped = fit and reserved < unlimited.reserved_peak
        headroom = memory - reserved
    why = None
    if not fit:
        why = (
            overflow(peak_terms(dev) if exact else terms(dev), memory)
            if stream_peak > memory
            else "allocator"
        )
    return Verdict(
        gpu=gpu.name,
        memory_bytes=gpu.memory_bytes,
        device_bytes=gpu.device_bytes,
        cuda_context=CUDA_CONTEXT,
        nccl=nccl,
        fsdp_all_gather_stream=stream,
        ddp_buckets=ddp,
        userbuffers=ub,
        symm_mem=symm,
        reserve=reserve,
        usable_bytes=memory,
        peak=peak,
        allocated_peak=allocated,
        reserved_peak=reserved,
        capped=capped,
        exact=exact,
        stage=dev.stage.index,
        phase=phase,
        fits=fit,
        headroom=headroom,
        overflow=why,
    )


# ----------------------------------------------------------------------------------------------------
# Host memory (offload)
# ----------------------------------------------------------------------------------------------------
NODE_GPUS = HGX_NODE_GPUS
"""GPUs sharing one node's host memory where no GPU is given (``presets.topology.HGX_NODE_GPUS``); a
smaller job shares it among its own devices only."""


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


def fits(p: Result, memory: int, gpu: GpuPreset | None = None, expandable: bool = False) -> bool:
    """Every computed stage fits: the lower bound first, the peak only when needed, then (with ``gpu``)
    what the allocator reserves in ``memory`` less the layout's NCCL buffers, FSDP2's all-gather stream and
    DDP's buckets (``verdict``) — the same answer as ``judged``, sooner:

    - the requested peak (the estimate's peak plus cuBLAS's workspaces: the stream reaches it,
      ``reserved``'s docstring) above ``memory`` cannot fit: reserved ≥ allocated ≥ requested, at every
      capacity;
    - else one replay at the capacity ``memory`` decides: when the unlimited replay's reserved peak is
      within it, the capped replay never reaches the capacity, so runs the same and refuses nothing; when
      it is not, ``judged`` asks the capped replay itself. It stops once the rest of the stream cannot
      pass the capacity (``reserved.refuses``); memoised on the stream. With ``expandable`` (the
      allocator under ``expandable_segments:True``) the replay at that capacity decides whole
      (``reserved.fits_reserved``, in Python: the compiled replay is the default allocator's).

    NB: no upper bound of reserved replaces the replay. Any allocator that never moves blocks can be
    driven to about M·log₂(n)/2 bytes for M live bytes in blocks of 1 … n units (Robson, J. ACM 21(3),
    1974), so the documented rules give no useful bound; and measured, the 3,256 replays of the Llama 3
    405B search on 16,384 H100s reserved 1.00× to 1.51× the requested peak (median 1.02×; 4 MiB to 6.5
    GiB more): a bound sound for all of them would leave most of that range to the replay anyway."""
    if not (
        all(sp.lower_bound <= memory for sp in p.stages) and p.device.peak.default_stream_bytes <= memory
    ):
        return False
    if gpu is None:
        return True
    from memplan.time.comm.buffers import comm_buffer_bytes, nccl_bytes  # with a GPU only (start-up)

    # the layout's NCCL buffers (outside the allocator) and FSDP2's / DDP's buffers beside the replay
    memory -= nccl_bytes(p, gpu) + comm_buffer_bytes(p)  # as ``verdict``
    if p.device.peak.default_stream_bytes + cublas_workspaces(gpu) > memory:
        return False
    if expandable:
        return fits_reserved(p, gpu, memory, expandable=True) is not None
    return not refuses(p, gpu, memory)
