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

from memplan.engine import Result, StagePlan
from memplan.presets import GpuPreset

TERMS = ("weights", "optimizer", "gradients", "activations", "transient")


class Verdict(BaseModel):
    model_config = ConfigDict(frozen=True)
    gpu: str
    memory_bytes: int
    peak: int
    """The peak of the most loaded device; when ``exact`` is false, a lower bound of it that already
    exceeds the memory (the peak itself was not needed to say so)."""
    exact: bool
    stage: int
    phase: str
    """The peak's moment (``analytic.peak``); ``lower bound`` when not exact."""
    fits: bool
    headroom: int
    """memory − peak (negative when it does not fit)."""
    overflow: str | None
    """The term whose addition passes the memory (one of ``TERMS``); None when it fits."""

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


def overflow(values: dict[str, int], memory: int) -> str:
    """The first term whose running sum passes ``memory`` (the transient if none of the others does)."""
    total = 0
    for name, value in values.items():
        total += value
        if total > memory:
            return name
    return "transient"


def verdict(p: Result, gpu: GpuPreset, *, exact: bool = True) -> Verdict:
    """Fit or not on ``gpu``. With ``exact=False`` (the fit search) the peak is computed only when the
    stages' lower bounds do not already exceed the memory."""
    memory = gpu.memory_bytes
    bound = max(p.stages, key=lambda sp: sp.lower_bound)
    if not exact and bound.lower_bound > memory:
        dev, peak, exact, phase = bound, bound.lower_bound, False, "lower bound"
    else:
        dev = p.device
        peak, exact, phase = dev.peak.bytes, True, dev.peak.phase
    return Verdict(
        gpu=gpu.name,
        memory_bytes=memory,
        peak=peak,
        exact=exact,
        stage=dev.stage.index,
        phase=phase,
        fits=peak <= memory,
        headroom=memory - peak,
        overflow=None if peak <= memory else overflow(terms(dev, peak if exact else None), memory),
    )
