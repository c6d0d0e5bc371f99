"""Set the estimate beside the measurement: per tensor name, per layer, in total, and FLOPs per phase.

Used by ``memplan trace`` and ``memplan profile`` and by the tests; pure data, no rendering.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from memplan.analytic.inventory import Scope
from memplan.estimate import Estimate
from memplan.measure.run import Measured

PHASES = ("forward", "backward", "recompute")


class Row(BaseModel):
    """One tensor name (or FLOP phase): estimated vs measured count and bytes."""

    model_config = ConfigDict(frozen=True)
    name: str
    est_count: int
    est_bytes: int
    meas_count: int
    meas_bytes: int

    @property
    def delta(self) -> int:
        return self.meas_bytes - self.est_bytes

    @property
    def equal(self) -> bool:
        return self.est_count == self.meas_count and self.est_bytes == self.meas_bytes


class Comparison(BaseModel):
    model_config = ConfigDict(frozen=True)
    tensors: list[Row]
    flops: list[Row]
    est_layer_bytes: int
    meas_layer_bytes: list[int]
    """Bytes each layer was measured to keep (layer-scope records by layer index)."""

    @property
    def equal(self) -> bool:
        layers_ok = all(b == self.est_layer_bytes for b in self.meas_layer_bytes)
        return layers_ok and all(r.equal for r in self.tensors) and all(r.equal for r in self.flops)


def estimated_by_name(est: Estimate) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    for k in est.tensors:
        count, nbytes = out.get(k.name, (0, 0))
        out[k.name] = (count + k.count, nbytes + k.total_bytes)
    return out


def layer_bytes(est: Estimate, meas: Measured) -> tuple[int, list[int]]:
    """Estimated bytes per layer and the measured bytes of each layer that kept anything.

    Checkpointed models keep one input per segment: the estimate's per-layer figure is then spread over the
    layers, so only the totals compare; layer-by-layer comparison applies to un-checkpointed models.
    """
    s = est.setup.strategy
    if s.segment or s.reversible:
        return 0, []
    per = sum(k.bytes for k in est.tensors if k.scope is Scope.LAYER)
    return per, [meas.layer_bytes(i) for i in range(est.setup.model.num_layers)]


def compare(est: Estimate, meas: Measured) -> Comparison:
    e = estimated_by_name(est)
    m = {name: (t.count, t.bytes) for name, t in meas.by_name().items()}
    rows = [
        Row(
            name=n,
            est_count=e.get(n, (0, 0))[0],
            est_bytes=e.get(n, (0, 0))[1],
            meas_count=m.get(n, (0, 0))[0],
            meas_bytes=m.get(n, (0, 0))[1],
        )
        for n in [*e, *(n for n in m if n not in e)]
    ]
    est_flops = {
        "forward": est.flops.forward,
        "backward": est.flops.backward,
        "recompute": est.flops.recompute,
    }
    flops = [
        Row(name=p, est_count=1, est_bytes=est_flops[p], meas_count=1, meas_bytes=meas.flops.get(p, 0))
        for p in PHASES
    ]
    per, measured_layers = layer_bytes(est, meas)
    return Comparison(tensors=rows, flops=flops, est_layer_bytes=per, meas_layer_bytes=measured_layers)


def measured_json(est: Estimate, meas: Measured) -> dict[str, Any]:
    """The measurement in the estimate's JSON shape (the keys a measurement can fill)."""
    f = meas.flops
    total = f["forward"] + f["backward"] + f["recompute"]
    _per, layers = layer_bytes(est, meas)
    return {
        "memory": {"activations": meas.activations},
        "activations": {
            "total": meas.activations,
            "per_layer": layers[0] if layers else None,
            "tensors": [
                {
                    "name": n,
                    "bytes": t.bytes // t.count if t.count else 0,
                    "count": t.count,
                    "total_bytes": t.bytes,
                }
                for n, t in meas.by_name().items()
            ],
        },
        "flops": {**f, "total": total, "model": f["forward"] + f["backward"], "hardware": total},
    }


def comparison_json(est: Estimate, meas: Measured) -> dict[str, Any]:
    c = compare(est, meas)
    return {
        "estimated": est.to_json(),
        "measured": measured_json(est, meas),
        "diff": {
            "equal": c.equal,
            "tensors": [
                {
                    "name": r.name,
                    "estimated_count": r.est_count,
                    "estimated_bytes": r.est_bytes,
                    "measured_count": r.meas_count,
                    "measured_bytes": r.meas_bytes,
                    "delta_bytes": r.delta,
                }
                for r in c.tensors
            ],
            "flops": [
                {"phase": r.name, "estimated": r.est_bytes, "measured": r.meas_bytes, "delta": r.delta}
                for r in c.flops
            ],
        },
    }
