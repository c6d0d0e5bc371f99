"""Offload in time: the host link's transfers and the CPU optimizer step (``--offload``).

One device of the busiest stage, n micro-batches per step; bytes from the same states and saves the
memory counts (``strategies.offload``), at ``HOST_LINK`` × the GPU's host link (``host_link_gbps``, PCIe,
per direction; the two directions run at once) and ``HOST_MEMORY`` × the node's host memory bandwidth
shared by its GPUs (``host_memory_gbps`` / GPUs per node).

- ``optimizer`` (ZeRO-Offload, Ren et al. 2021 §4.2 and DeepSpeed's ``stage_1_and_2.py``): each
  micro-batch's gradients of the rank's partition go to the host as the backward makes them (DeepSpeed's
  asynchronous copy into the fp32 host buffer, where micro-batches accumulate), hidden behind that
  backward; the CPU then steps the partition (DeepSpeed's CPU Adam: it reads the fp32 master weights, the
  optimizer states and the fp32 gradients, writes the weights and states and the 16-bit copy — memory-bound,
  as the GPU step is), and the updated 16-bit weights come back before the next forward, exposed (the
  one-step delayed update, off by default, is not modelled).
- ``params`` (ZeRO-Infinity / FSDP2 ``CPUOffloadPolicy``): the device's 16-bit weight shard is copied to
  the device for every forward and again for every backward, prefetched as FSDP2 does, so it hides
  behind that forward or backward; with it the updated weights stay on the host (no copy after the step).
- ``activations`` (``torch.autograd.graph.save_on_cpu``): the pack hook copies each saved tensor into pinned
  host memory with a plain ``copy_`` on the compute stream, and the unpack hook copies it back on the same
  stream: both directions are serial with the compute, exposed, once per micro-batch each.

Exposure as for the collectives (``predict``): per direction, the transfers that hide behind the same
compute cost what they take beyond it; per-micro-batch transfers stretch every micro-batch (and so the
bubble), the once-per-step ones are added once.

Known limitations (NB): PCIe switches shared by two GPUs (or a GPU and a NIC) are not modelled; the host
link's transfers slow no compute they overlap; the activation bytes per micro-batch are the host's
activations over the micro-batches in flight (``Stage.in_flight_layers``); the CPU step is taken as
memory-bound at every core count (DeepSpeed's CPU Adam vectorises it with AVX; a host with few cores per
GPU may be compute-bound).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from enum import StrEnum

from memplan.config import Offload
from memplan.engine import Result
from memplan.presets import GpuPreset
from memplan.strategies.offload import HOST_GRADIENT_BYTES
from memplan.time import efficiency, optimizer
from memplan.time.comm.rows import Critical, Overlap
from memplan.time.compute import owned_params


class Direction(StrEnum):
    TO_HOST = "to host"
    TO_DEVICE = "to device"


@dataclass(frozen=True)
class Transfer:
    """``count`` copies of ``bytes`` each over the host link per step."""

    what: str
    direction: Direction
    bytes: int
    count: int
    overlap: Overlap
    per_micro_batch: bool
    """Part of every micro-batch's work (it stretches the pipeline's busy time)."""

    def seconds(self, gpu: GpuPreset) -> float:
        return self.count * self.bytes / host_link_bytes_per_s(gpu)


def _missing(gpu: GpuPreset, field: str) -> str:
    return (
        f"gpu: {gpu.name} states no {field}, which times --offload; add {field} = GB/s to the GPU "
        "file (docs/step-time.md)"
    )


def _need(gpu: GpuPreset, field: str) -> float:
    value = getattr(gpu, field)
    if value is None:
        raise ValueError(_missing(gpu, field))
    return float(value)


def untimed(o: Offload, gpu: GpuPreset) -> str | None:
    """Why ``gpu`` cannot time offload ``o`` (the one line ``_need`` raises: a field the GPU preset does
    not state), else None: every copy needs the host link, the CPU optimizer step the host memory's
    bandwidth. ``estimate`` then gives the memory without a time, ``fit`` leaves offload's levels out."""
    if o is Offload.NONE:
        return None
    if gpu.host_link_gbps is None:
        return _missing(gpu, "host_link_gbps")
    if Offload.OPTIMIZER in o and gpu.host_memory_gbps is None:
        return _missing(gpu, "host_memory_gbps")
    return None


def host_link_bytes_per_s(gpu: GpuPreset) -> float:
    """``HOST_LINK`` × the host link's bandwidth per direction."""
    return _need(gpu, "host_link_gbps") * 1e9 * efficiency.HOST_LINK


def host_memory_bytes_per_s(gpu: GpuPreset) -> float:
    """One GPU's share of the node's host memory bandwidth at ``HOST_MEMORY``: every GPU of the node runs
    its CPU step at once."""
    node = _need(gpu, "host_memory_gbps") * 1e9 * efficiency.HOST_MEMORY
    return node / gpu.topology.gpus_per_node


def host_step_bytes(c: Critical) -> int:
    """Bytes the CPU optimizer step moves for one device's partition: the master weights and optimizer
    states read and written, the fp32 host gradients (``HOST_GRADIENT_BYTES``) read, the 16-bit weights
    written."""
    return owned_params(c) * optimizer.one_pass_bytes(c.setup, HOST_GRADIENT_BYTES)


def host_optimizer_seconds(c: Critical, gpu: GpuPreset) -> float:
    """The CPU step of optimizer offload, exposed; 0 without it."""
    if Offload.OPTIMIZER not in c.setup.offload:
        return 0.0
    return host_step_bytes(c) / host_memory_bytes_per_s(gpu)


def activation_bytes(p: Result) -> int:
    """What ``save_on_cpu`` copies out for one micro-batch: the host's activations over the micro-batches
    in flight."""
    sp = p.device
    flight = max(sp.stage.in_flight_layers, sp.stage.layers, 1)
    return sp.host.activations * max(sp.stage.layers, 1) // flight


def reads_device(o: Offload) -> bool:
    """Whether ``transfers`` reads the plan's most loaded device (its host weights and activations: the
    parameter and activation offloads), so that a step is timed from an estimate with stage plans; the
    rest of the prediction reads the setup, the pieces, the FLOPs and the parameters only."""
    return Offload.PARAMS in o or Offload.ACTIVATIONS in o


def transfers(c: Critical, p: Result) -> list[Transfer]:
    """Every host-link copy of one step on one device of the busiest stage (module docstring)."""
    o, n = c.setup.offload, p.micro_batches
    prec = c.setup.training.precision
    out: list[Transfer] = []
    if Offload.OPTIMIZER in o:
        owned = owned_params(c)
        out.append(
            Transfer("gradients", Direction.TO_HOST, owned * prec.grad_bytes, n, Overlap.BACKWARD, True)
        )
        if Offload.PARAMS not in o:
            out.append(
                Transfer(
                    "updated weights", Direction.TO_DEVICE, owned * prec.weight_bytes, 1, Overlap.NONE, False
                )
            )
    if Offload.PARAMS in o:
        shard = p.device.host.weights
        out.append(Transfer("weights (forward)", Direction.TO_DEVICE, shard, n, Overlap.FORWARD, True))
        out.append(Transfer("weights (backward)", Direction.TO_DEVICE, shard, n, Overlap.BACKWARD, True))
    if Offload.ACTIVATIONS in o:
        saved = activation_bytes(p)
        out.append(Transfer("activations", Direction.TO_HOST, saved, n, Overlap.NONE, True))
        out.append(Transfer("activations", Direction.TO_DEVICE, saved, n, Overlap.NONE, True))
    return out


def exposed_transfers(ts: list[Transfer], hide: dict[Overlap, float], gpu: GpuPreset) -> tuple[float, float]:
    """(per micro-batch work, once per step): the seconds of host-link copies no compute hides, per
    direction and overlap max(0, Σ − the compute they hide behind)."""
    per: dict[tuple[Direction, Overlap, bool], float] = defaultdict(float)
    for t in ts:
        per[(t.direction, t.overlap, t.per_micro_batch)] += t.seconds(gpu)
    stage = step = 0.0
    for (_, overlap, in_stage), seconds in per.items():
        left = max(0.0, seconds - hide[overlap])
        if in_stage:
            stage += left
        else:
            step += left
    return stage, step
