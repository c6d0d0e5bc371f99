"""Offload measured on one CPU, with two labelled pools (``host`` and ``device``).

On a CPU run the host and the "device" are the same RAM, so each byte is attributed to the pool the real
system would hold it in: a tensor the offload machinery made for the host (a ``save_on_cpu`` copy, the
optimizer's fp32 master weights, states and gradient buffers) counts in ``host``; every other live storage
(parameters, their gradients before they are moved, saved activations left behind) in ``device``.

- ``activation_offload(setup)``: the reference model's forward under torch's own
  ``torch.autograd.graph.save_on_cpu(pin_memory=True)`` (its pack hook wrapped only to count what it
  returns; with ``pin_memory=True`` it copies even on a CPU — ``torch.empty(size)`` + ``copy_`` — while
  ``pin_memory=False`` would return the CPU tensor itself). ``device`` is what stays alive after forward
  beyond the parameters, the batch, the host copies and the loss; then the backward runs (unpacking).
- ``OffloadedOptimizer``: ZeRO-Offload's step as DeepSpeed runs it (strategies/offload.py): each 16-bit
  gradient is copied, upcast, into an fp32 host buffer and freed on the device; the reference optimizer
  (measure/reference/optim.py) steps the fp32 master weights on the host; the 16-bit weights are copied back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from memplan.config import Precision, Setup
from memplan.measure.instruments.record import storage_ref
from memplan.measure.instruments.tracker import LiveMemoryTracker
from memplan.measure.reference.model import Reference
from memplan.measure.reference.optim import ReferenceOptimizer
from memplan.measure.runs.run import make_batch


def pool_bytes(tensors: list[Tensor]) -> int:
    """Bytes of the distinct storages of ``tensors``."""
    seen: dict[int, int] = {}
    for t in tensors:
        seen.setdefault(storage_ref(t).cdata, t.untyped_storage().nbytes())
    return sum(seen.values())


@dataclass(frozen=True)
class Pools:
    """Bytes attributed to each pool (module docstring: both are host RAM on a CPU run)."""

    device: int
    host: int
    host_weights: int = 0
    """Of ``host``: the copies of parameters (save_on_cpu copies the weights the forward saves)."""


class CountingSaveOnCpu(torch.autograd.graph.save_on_cpu):
    """torch's ``save_on_cpu``; its pack hook wrapped to add each copy it makes to ``copies`` (and to
    ``weight_copies`` when it copies one of ``params``)."""

    def __init__(self, params: list[Tensor]) -> None:
        super().__init__(pin_memory=True)
        self.copies: list[Tensor] = []
        self.weight_copies: list[Tensor] = []
        weights = {storage_ref(p).cdata for p in params}
        pack = self.pack_hook

        def counted(t: Tensor) -> Any:
            device, copy = pack(t)
            self.copies.append(copy)
            if storage_ref(t).cdata in weights:
                self.weight_copies.append(copy)
            return device, copy

        self.pack_hook = counted


def activation_offload(setup: Setup, seed: int = 0) -> Pools:
    """Saved activations after the forward under ``save_on_cpu``: left on the device, copied to the host."""
    torch.manual_seed(seed)
    model = Reference(setup)
    ids, labels = make_batch(setup, "cpu")
    tracker, offload = LiveMemoryTracker(), CountingSaveOnCpu(list(model.parameters()))
    with tracker:
        tracker.track([*model.parameters(), ids, labels])
        before = tracker.current
        with offload:
            loss = model(ids, labels)
        host = pool_bytes(offload.copies)
        device = tracker.current - before - host - pool_bytes([loss])
    loss.backward()
    return Pools(device=device, host=host, host_weights=pool_bytes(offload.weight_copies))


class OffloadedOptimizer:
    """ZeRO-Offload's optimizer: fp32 master weights, states and gradient buffers in the host pool."""

    def __init__(self, params: list[Tensor], precision: Precision, optimizer: Any) -> None:
        self.params = params
        self.master = [p.detach().float().clone() for p in params]
        for m in self.master:
            m.grad = torch.zeros_like(m)  # DeepSpeed's fp32 host gradient buffer (pinned on a GPU host)
        # The reference optimizer over the fp32 master copies: fp32 states, no second master copy.
        self.inner = ReferenceOptimizer(self.master, Precision.FP32, optimizer)

    def host_tensors(self) -> list[Tensor]:
        grads = [m.grad for m in self.master if m.grad is not None]
        return [*self.master, *grads, *(s for states in self.inner.states for s in states)]

    def offload_gradients(self) -> None:
        """Each 16-bit gradient copied, upcast, into its fp32 host buffer, then freed on the device."""
        for p, m in zip(self.params, self.master, strict=True):
            if p.grad is not None and m.grad is not None:
                m.grad.copy_(p.grad)
                p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.offload_gradients()
        self.inner.step()
        for p, m in zip(self.params, self.master, strict=True):
            p.copy_(m)  # the updated fp32 master back to the device's 16-bit weights


def optimizer_offload(setup: Setup, seed: int = 0) -> tuple[Pools, Pools]:
    """One real step of the reference model with ZeRO-Offload: the pools' model states after the backward
    (gradients moved to the host) and after the step."""
    torch.manual_seed(seed)
    model = Reference(setup)
    params: list[Tensor] = list(model.parameters())
    opt = OffloadedOptimizer(params, setup.training.precision, setup.training.optimizer)
    ids, labels = make_batch(setup, "cpu")
    model(ids, labels).backward()
    opt.offload_gradients()
    device = [*params, *(p.grad for p in params if p.grad is not None)]
    moved = Pools(device=pool_bytes(device), host=pool_bytes(opt.host_tensors()))
    opt.step()
    device = [*params, *(p.grad for p in params if p.grad is not None)]
    return moved, Pools(device=pool_bytes(device), host=pool_bytes(opt.host_tensors()))
