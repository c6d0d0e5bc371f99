"""Does a plan fit a GPU, and if not, which memory term overflows.

The most loaded device's terms are added in the order they are allocated — weights, optimizer states
(master copy included), gradients, activations, then the peak's transient on top — and the first sum to
pass the GPU's memory names the overflowing term: "weights" means the weights alone do not fit, and
"activations" that the model states fit but not with the activations. ``memory_bytes`` is the vendor's
capacity from the GPU preset; the CUDA context (0.3–1 GiB) and allocator fragmentation are not reserved
(see ``analytic.peak``): keep some headroom.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from memplan.plan.device import Plan, StagePlan
from memplan.presets import GpuPreset

TERMS = ("weights", "optimizer", "gradients", "activations", "transient")


class Verdict(BaseModel):
    model_config = ConfigDict(frozen=True)
    gpu: str
    memory_bytes: int
    peak: int
    stage: int
    fits: bool
    headroom: int
    """memory − peak (negative when it does not fit)."""
    phase: str
    """The peak's moment (``analytic.peak``)."""
    overflow: str | None
    """The term whose addition passes the memory (one of ``TERMS``); None when it fits."""

    def to_json(self) -> dict[str, object]:
        return self.model_dump()


def terms(sp: StagePlan) -> dict[str, int]:
    """The device's memory terms, in allocation order; ``transient``: what the peak adds on top."""
    st = sp.states
    values = {
        "weights": st.weights,
        "optimizer": st.optimizer,
        "gradients": st.gradients,
        "activations": sp.activations,
    }
    values["transient"] = max(0, sp.peak.bytes - sum(values.values()))
    return values


def verdict(p: Plan, gpu: GpuPreset) -> Verdict:
    dev = p.device
    memory, peak = gpu.memory_bytes, dev.peak.bytes
    overflow = None
    if peak > memory:
        total = 0
        for name, value in terms(dev).items():
            total += value
            if total > memory:
                overflow = name
                break
        overflow = overflow or "transient"
    return Verdict(
        gpu=gpu.name,
        memory_bytes=memory,
        peak=peak,
        stage=dev.stage.index,
        fits=peak <= memory,
        headroom=memory - peak,
        phase=dev.peak.phase,
        overflow=overflow,
    )
