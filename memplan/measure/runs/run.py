"""Run the reference model's forward and backward once and measure it.

``measure(setup, fake=True)`` builds the model under ``FakeTensorMode`` (CPU fake tensors: no memory, no
GPU, any size) and records what autograd saves (named, storage-deduplicated) and the FLOPs per phase.
``fake=False`` runs real tensors (tiny shapes in tests; the same records byte for byte). A model with
``moe`` has a mixture-of-experts block for every MLP (memplan/measure/reference/moe.py).

``device="meta"`` runs the CUDA code path of the reference model on the meta device (no FakeTensorMode
needed: meta tensors own no memory either), whose kernels return what CUDA's return: ``trace --device
cuda`` checks the CUDA rules of the estimate on CPU (``trace_device``). NB: FakeTensorMode with a fake
``cuda`` device is not usable on a CPU-only torch build: the first tensor requiring grad aborts the process
("PyTorch is not linked with support for cuda devices", from autograd's InputMetadata).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan.config import Device, Setup
from memplan.measure.instruments.measured import Measured
from memplan.measure.instruments.record import (
    FlopMeter,
    SavedTensorRecorder,
)
from memplan.measure.reference.model import Reference
from memplan.measure.reference.moe import check_moe
from memplan.strategies.context_parallel import check_torch_ring


def make_batch(setup: Setup, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    t, v = setup.training, setup.model.vocab_size
    ids = torch.randint(0, v, (t.micro_batch, t.seq_len), device=device)
    labels = torch.randint(0, v, (t.micro_batch, t.seq_len), device=device)
    return ids, labels


def trace_device(kernels: Device) -> str:
    """Where a fake trace runs ``kernels``: CPU fake tensors for cpu, the meta device for cuda."""
    return "meta" if kernels is Device.CUDA else "cpu"


@contextmanager
def fake_mode(fake: bool, device: str = "cpu") -> Iterator[None]:
    with FakeTensorMode(allow_non_fake_inputs=False) if fake and device != "meta" else nullcontext():
        yield


def run_step(
    model: Reference,
    ids: torch.Tensor,
    labels: torch.Tensor,
) -> Measured:
    """Forward under the saved-tensor recorder and the FLOP meter, then backward (recorder paused); the saves
    freed before the forward ends are not kept (``SavedTensorRecorder.forget_freed``), as for
    ``--impl hf``."""
    meter = FlopMeter()
    recorder = SavedTensorRecorder(model.parameters())

    def recompute() -> AbstractContextManager[Any]:
        return meter.phase("recompute")

    model.recompute_phase = recompute
    with ExitStack() as stack:
        stack.enter_context(meter)
        stack.enter_context(recorder)
        with meter.phase("forward"):
            loss = model(ids, labels)
        recorder.forget_freed()  # the one rule of every recorder: only the saves alive for backward
        with recorder.pause(), meter.phase("backward"):
            loss.backward()
    model.recompute_phase = nullcontext
    totals = {k: meter.totals.get(k, 0) for k in ("forward", "backward", "recompute")}
    # FLOPs of the recompute are nested inside backward's window: report them apart.
    return Measured(records=recorder.records, flops=totals, by_op=meter.by_op)


def measure(
    setup: Setup,
    fake: bool = True,
    device: str = "cpu",
    seed: int = 0,
    on_layer: Callable[[str, int], None] | None = None,
    cp_rank: int = 0,
) -> Measured:
    """Build the reference model for ``setup`` (every MLP an MoE block for a mixture of experts) and
    measure one forward + backward.

    With context parallelism (``setup.parallel.cp`` > 1) the run is rank ``cp_rank`` of the ring: its s/cp
    tokens, torch's ring attention (``measure.context``); its FLOPs are one rank's (the estimate's / cp).

    ``on_layer(phase, i)`` is called after each layer's forward and backward (a progress bar). Raises a
    one-line ``ValueError`` for an MoE it cannot run (``measure.moe.check_moe``).
    """
    check_moe(setup.model.moe)
    check_torch_ring(setup)
    torch.manual_seed(seed)
    cp = setup.parallel.cp
    with ring(cp, cp_rank, device) as group, fake_mode(fake, device):
        model = Reference(setup, device=device)
        model.on_layer = on_layer
        model.ring = group
        ids, labels = make_batch(setup, device)
        if group is not None:  # the rank's head-tail chunks of the sequence
            mine = model.positions(ids.shape[1] // cp, ids.device)
            ids, labels = ids[:, mine], labels[:, mine]
        return run_step(model, ids, labels)


@contextmanager
def ring(cp: int, rank: int, device: str) -> Iterator[Any]:
    """With context parallelism, rank ``rank`` of a fake ``cp``-rank process group (``measure.context``);
    else None. A one-line ``ValueError`` where the simulation cannot run."""
    if cp == 1:
        yield None
        return
    if torch.device(device).type not in ("cpu", "cuda", "meta") or not 0 <= rank < cp:
        raise ValueError(
            f"cp: one context-parallel rank (0 ≤ rank < {cp}) is simulated with torch's ring attention on "
            "the CPU or CUDA flash kernel; use --device cpu or cuda"
        )
    from memplan.measure.reference.context import ring_group

    with ring_group(cp, rank) as group:
        yield group
