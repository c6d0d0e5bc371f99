"""Set an implementation profile's estimate (``--impl hf``) beside a framework's own run.

The framework names what it saves by module path and op (``self_attn · Softmax``), memplan by its
inventory names (``attn.probs``): tensors are paired by where they live (one layer, or the model), dtype
and bytes, and what pairs with nothing on either side is the difference. The verdict is the issue's bar:
every layer and the total within ``TOLERANCE`` of the measurement, with the exact bytes reported.
"""

from __future__ import annotations

from typing import Any

from memplan.blocks.inventory import Block, Kept, Role, Scope
from memplan.contract import to_json
from memplan.engine import Result
from memplan.measure.compare.tensors import (
    PHASES,
    estimated_layers,
    layer_groups,
    measured_json,
    whole_model_flops,
)
from memplan.measure.instruments.measured import Measured

TOLERANCE = 0.01
"""Largest relative difference per layer and in total that still counts as a match (1 %)."""


def within(estimated: int, measured: int, tolerance: float = TOLERANCE) -> bool:
    return abs(estimated - measured) <= tolerance * max(measured, 1)


def paired_tensors(est: Result, meas: Measured, layer: int = 0) -> list[dict[str, Any]]:
    """Estimated and measured tensors of layer ``layer`` and of the model, paired by (scope, dtype,
    bytes) in order; one row per pair, or per tensor without a partner."""
    estimated = [
        (k.scope is Scope.LAYER, k.dtype.value, k.bytes, k.name)
        for k in est.tensors
        if k.count and (k.scope is Scope.MODEL or k.bytes) and in_layer_kind(est, k, layer)
    ]
    measured = [
        (r.layer is not None, r.dtype, r.bytes, r.name) for r in meas.records if r.layer in (None, layer)
    ]
    rows: list[dict[str, Any]] = []
    left = list(measured)
    for in_layer, dtype, nbytes, name in estimated:
        match = next((m for m in left if m[:3] == (in_layer, dtype, nbytes)), None)
        if match is not None:
            left.remove(match)
        rows.append(_row(name, match[3] if match else "—", nbytes, nbytes if match else 0, in_layer))
    rows += [_row("—", m[3], 0, m[2], m[0]) for m in left]
    return rows


def in_layer_kind(est: Result, k: Kept, layer: int) -> bool:
    """Whether ``k`` is kept by layer ``layer``: with DeepSeek's dense first layers (``moe.dense_layers``)
    the MoE's saves belong to the later layers, the dense MLP's inner saves to the first ones."""
    moe = est.setup.model.moe
    if moe is None or not moe.dense_layers or k.scope is not Scope.LAYER:
        return True
    if k.block is Block.MOE:
        return layer >= moe.dense_layers
    if k.block is Block.MLP and k.role is Role.MLP_INNER:
        return layer < moe.dense_layers
    return True


def _row(est_name: str, meas_name: str, est_bytes: int, meas_bytes: int, in_layer: bool) -> dict[str, Any]:
    where = "layer" if in_layer else "model"
    return {
        "name": f"{est_name} ↔ {meas_name}",
        "scope": where,
        "estimated_count": int(est_bytes > 0),
        "estimated_bytes": est_bytes,
        "measured_count": int(meas_bytes > 0),
        "measured_bytes": meas_bytes,
        "delta_bytes": meas_bytes - est_bytes,
    }


def impl_comparison_json(est: Result, meas: Measured) -> dict[str, Any]:
    """``trace --impl`` output: estimate and measurement in the estimate's JSON shape, and the diff: per
    layer and in total (exact bytes, ratio, within 1 %), FLOPs per phase, tensors paired (layer 0)."""
    n = est.setup.model.num_layers
    est_layers, meas_layers = estimated_layers(est), [meas.layer_bytes(i) for i in range(n)]
    est_flops = {
        "forward": est.flops.forward,
        "backward": est.flops.backward,
        "recompute": est.flops.recompute,
    }
    whole = whole_model_flops(est, meas)
    layers_ok = all(within(e, m) for e, m in zip(est_layers, meas_layers, strict=True))
    total_ok = within(est.activations, meas.activations)
    return {
        "estimated": to_json(est),
        "measured": measured_json(est, meas),
        "diff": {
            "equal": layers_ok and total_ok,
            "exact": est_layers == meas_layers and est.activations == meas.activations,
            "tolerance": TOLERANCE,
            "total": {
                "estimated": est.activations,
                "measured": meas.activations,
                "ratio": round(meas.activations / max(est.activations, 1), 6),
            },
            "tensors": paired_tensors(est, meas),
            "flops": [  # a ring rank's × cp (every rank runs the same), as the reference's comparison
                {"phase": p, "estimated": est_flops[p], "measured": whole.get(p, 0)}
                | {"delta": whole.get(p, 0) - est_flops[p]}
                for p in PHASES
            ],
            "layers": [
                {"layers": layers, "estimated": e, "measured": m, "ratio": round(m / max(e, 1), 6)}
                for layers, e, m in layer_groups(est_layers, meas_layers)
            ],
        },
    }
