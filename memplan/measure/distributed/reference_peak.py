"""The peak of one rank of memplan's reference model under FSDP2 (``parallelize.build``: ``fully_shard``
per layer and on the root), measured at each of the estimate's moments on torch's fake process group.

One forward and backward of rank ``rank`` of ``dp`` (real tensors; the collectives move nothing), under
``titan_peak.PeakTracker`` with FSDP2's storage resizes reported (``fsdp2_resizes``): every storage the
rank holds, the unsharded parameters included. The step's boundaries are noted as
``instruments.moments`` reads them; a layer's "backward i" is noted by a hook registered before FSDP2's
pre-backward hook on the same output (a forward hook with ``prepend=True`` runs before FSDP2's
``_post_forward``, which registers it), so the layer's copy-out and the prefetch it issues fall in its own
stretch, as the estimate's layer moment counts them (``analytic.fsdp.root``).

Known limitations (NB): no optimizer is built or stepped (``titan_peak.estimated_moments`` leaves the
optimizer's states and moment out); one micro-batch; the layouts ``analytic.fsdp.root.root_gathered``
models (dp only).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh

from memplan.config import Setup
from memplan.measure.distributed.parallelize import build
from memplan.measure.distributed.titan import fake_world
from memplan.measure.distributed.titan_peak import PeakRun, PeakTracker, fsdp2_resizes, grads_of
from memplan.measure.runs.run import make_batch


def _note_layers(model: Any, tracker: PeakTracker) -> list[Any]:
    """ "forward i" when layer i returns, "backward i" when its output's gradient is ready, before FSDP2's
    pre-backward hook (module docstring)."""

    def watch(i: int) -> Any:
        def after(_module: Any, _args: Any, out: torch.Tensor) -> None:
            tracker.note(f"forward {i}")
            if out.requires_grad:
                out.register_hook(lambda _grad: tracker.note(f"backward {i}"))

        return model.layers[i].register_forward_hook(after, prepend=True)

    return [watch(i) for i in range(len(model.layers))]


def measure_reference_rank(setup: Setup, rank: int = 0) -> PeakRun:
    """One forward and backward of the reference model's rank ``rank`` over ``setup.strategy.dp`` ranks
    (fake process group, real tensors), every storage tracked, the boundaries noted."""
    dp = setup.strategy.dp
    with fake_world(rank, dp), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FSDP2's and the fake group's notices
        mesh = init_device_mesh("cpu", (dp, 1, 1), mesh_dim_names=("dp", "pp", "tp"))
        model: Any = build(setup, mesh, "cpu")
        torch.manual_seed(1 + rank)
        batch = make_batch(setup, "cpu")
        tracker = PeakTracker()
        handles = _note_layers(model, tracker)
        model.on_note = tracker.note  # "backward lm_head", "backward final_norm", "backward embedding"
        states = [*model.parameters(), *model.buffers()]
        with fsdp2_resizes(tracker), tracker:
            tracker.track([*states, *batch])
            tracker.note("start")
            loss = model(*batch)
            tracker.phase = "backward"
            tracker.note("forward")
            loss.backward()
            del loss
            tracker.note("backward")
        for h in handles:
            h.remove()
        model.on_note = None
        return tracker.result(states, set(), grads_of(model))
