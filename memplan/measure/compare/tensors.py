"""Set the estimate beside the measurement: per tensor name, per layer, in total, and FLOPs per phase.

Used by ``memplan trace`` and ``memplan profile`` and by the tests; pure data, no rendering. The measurement
of one process is compared with ``engine.estimate(setup)`` on its one device, dense or a mixture of experts.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from memplan.blocks.inventory import Scope
from memplan.contract import to_json
from memplan.engine import Result
from memplan.measure.instruments.measured import Measured

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
    est_layers: list[int]
    """Bytes each transformer layer is estimated to keep (layer-scope entries, by layer index)."""
    meas_layers: list[int]
    """Bytes each layer was measured to keep (layer-scope records by layer index)."""

    @property
    def equal(self) -> bool:
        layers_ok = self.est_layers == self.meas_layers
        return layers_ok and all(r.equal for r in self.tensors) and all(r.equal for r in self.flops)


def estimated_by_name(est: Result) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    for k in est.tensors:
        count, nbytes = out.get(k.name, (0, 0))
        out[k.name] = (count + k.count, nbytes + k.total_bytes)
    return out


def estimated_layers(est: Result) -> list[int]:
    """What each layer keeps: all of its saves; under every-k / full checkpointing the input of each
    segment's first layer (nothing in the others); with reversible layers nothing (the stack's outputs
    are model-level); under fine-tuning each layer's own (``strategies.lora.layer_bytes``)."""
    s, n = est.setup.strategy, est.setup.model.num_layers
    if est.pieces.layer_bytes:  # fine-tuning: layers differ along the gradient flow
        return list(est.pieces.layer_bytes)
    one = sum(k.bytes for k in est.tensors if k.scope is Scope.LAYER)
    if s.reversible:
        return [0] * n
    if est.pieces.alone_layers:  # transformers' every-K: each K-th layer its input, the others their saves
        return list(est.pieces.alone_layers)
    if s.segment:
        return [one if i % s.segment == 0 else 0 for i in range(n)]
    return [one] * n


def layer_groups(est_layers: list[int], meas_layers: list[int]) -> list[tuple[list[int], int, int]]:
    """Layers grouped by their (estimated, measured) bytes, in order of first appearance."""
    groups: dict[tuple[int, int], list[int]] = {}
    for i, pair in enumerate(zip(est_layers, meas_layers, strict=True)):
        groups.setdefault(pair, []).append(i)
    return [(layers, e, m) for (e, m), layers in groups.items()]


def whole_model_flops(est: Result, meas: Measured) -> dict[str, int]:
    """The measured FLOPs of the whole model: with context parallelism the run is one rank of cp, each of
    which runs the same FLOPs (its causal step and cp−1 half steps, whichever rank), so × cp."""
    cp = est.parallel.cp
    return {phase: n * cp for phase, n in meas.flops.items()}


def compare(est: Result, meas: Measured) -> Comparison:
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
    whole = whole_model_flops(est, meas)
    flops = [
        Row(name=p, est_count=1, est_bytes=est_flops[p], meas_count=1, meas_bytes=whole.get(p, 0))
        for p in PHASES
    ]
    layers = range(est.setup.model.num_layers)
    return Comparison(
        tensors=rows,
        flops=flops,
        est_layers=estimated_layers(est),
        meas_layers=[meas.layer_bytes(i) for i in layers],
    )


def measured_json(est: Result, meas: Measured) -> dict[str, Any]:
    """The measurement in the estimate's JSON shape (the keys a measurement can fill)."""
    f = whole_model_flops(est, meas)
    total = f["forward"] + f["backward"] + f["recompute"]
    layers = est.setup.model.num_layers
    layer_total = sum(meas.layer_bytes(i) for i in range(layers))
    return {
        "memory": {"activations": meas.activations},
        "activations": {
            "total": meas.activations,
            "per_layer": layer_total // layers,  # as the estimate: layer-scope bytes spread over layers
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


def comparison_json(est: Result, meas: Measured) -> dict[str, Any]:
    c = compare(est, meas)
    return {
        "estimated": to_json(est),
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
            "layers": [
                {"layers": layers, "estimated": e, "measured": m}
                for layers, e, m in layer_groups(c.est_layers, c.meas_layers)
            ],
        },
    }
