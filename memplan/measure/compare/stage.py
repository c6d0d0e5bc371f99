"""``trace --impl torchtitan --pp P [--vpp M]``: one pipeline rank's run (``distributed.titan_pp`` /
``titan_vpp``) beside the estimate of that rank (pure data, the ``trace --json`` shape).

Compared to the byte: each of the rank's layers (the estimate's per-layer saves times its chunk's forwards
in flight, plus the layer's RoPE buffer), the schedule's holds by name (``pp.output``, ``pp.grad_send``,
``pp.recv``, ``pp.grad_recv``, ``pp.logits``), the total, and the rank's parameter bytes (under ZeRO-2
over dp FSDP2 holds ZeRO-3's shard at rest: ``compare.ranks.fsdp2_zero2_weights``).

NB: FLOPs are not counted per rank (``measured.flops`` is absent, ``diff.flops`` empty).
"""

from __future__ import annotations

from typing import Any

from memplan.analytic.fsdp.moments import pipeline_unsharded_gradients, titan_fsdp2
from memplan.blocks.inventory import Scope
from memplan.config import ZeroStage
from memplan.contract import to_json
from memplan.engine import Result, at_stage, estimate
from memplan.measure.compare.tensors import layer_groups
from memplan.measure.instruments.record import SavedRecord
from memplan.stage_plan import partial_grads
from memplan.strategies.pipeline_parallel import stage_layers

ROPE_BUFFER = "attn.rope_cache"
"""torchtitan's per-layer RoPE cache: a module buffer, saved once per layer whatever is in flight."""


def layer_chunks(est: Result, index: int) -> dict[int, int]:
    """Layer → local chunk of pipeline rank ``index`` (virtual stage k·p + index is chunk k)."""
    par, layers = est.setup.parallel, est.setup.model.num_layers
    virtual = par.pp_layers if par.vpp > 1 and par.pp_layers else stage_layers(layers, par)
    out: dict[int, int] = {}
    start = 0
    for v, count in enumerate(virtual):
        if v % par.pp == index:
            out |= {j: v // par.pp for j in range(start, start + count)}
        start += count
    return out


def estimated_stage_layers(e: Result) -> dict[int, int]:
    """Bytes each layer of ``e``'s one stage keeps (``at_stage``): one forward's saves times the forwards
    of its chunk in flight, plus its RoPE buffer."""
    plan = e.stages[0]
    st = plan.stage
    ids = st.chunk_ids if st.chunk_ids is not None else (0,) * st.chunks
    kept = [k for k in e.tensors if k.scope is Scope.LAYER]
    buffers = sum(k.bytes * k.count for k in kept if k.name == ROPE_BUFFER)
    instances = sum(k.bytes * k.count for k in kept) - buffers
    one = instances // max(st.in_flight_layers, 1)
    rope = buffers // max(st.layers, 1)
    return {i: ids.count(k) * one + rope for i, k in layer_chunks(e, st.index).items()}


def _rows(e: Result, records: list[SavedRecord]) -> list[dict[str, Any]]:
    """Saves of the layers, of the model, and each schedule hold by name: estimated beside measured."""

    def est_of(pred: Any) -> tuple[int, int]:
        ks = [k for k in e.tensors if pred(k.name, k.scope is Scope.LAYER)]
        return sum(k.count for k in ks), sum(k.bytes * k.count for k in ks)

    def meas_of(pred: Any) -> tuple[int, int]:
        rs = [r for r in records if pred(r.name, r.layer is not None)]
        return len(rs), sum(r.bytes for r in rs)

    groups: dict[str, Any] = {
        "saved by the layers": lambda name, layer: layer and not name.startswith("pp."),
        "saved by the embedding and head": lambda name, layer: not layer and not name.startswith("pp."),
    }
    names = sorted({k.name for k in e.tensors if k.name.startswith("pp.")} | {r.name for r in records})
    groups |= {n: (lambda name, _l, n=n: name == n) for n in names if n.startswith("pp.")}
    rows = []
    for label, pred in groups.items():
        (ec, eb), (mc, mb) = est_of(pred), meas_of(pred)
        rows.append(
            {
                "name": label,
                "estimated_count": ec,
                "estimated_bytes": eb,
                "measured_count": mc,
                "measured_bytes": mb,
                "delta_bytes": mb - eb,
            }
        )
    return rows


def fsdp2_held_json(e: Result, shards: int, run: Any) -> dict[str, dict[str, Any]]:
    """torchtitan's FSDP2 on the pipeline rank (``analytic.fsdp.moments``), estimated beside measured
    (``titan_vpp.Fsdp2Held``): the most unsharded parameter bytes at once (the layer backward moment's
    weights less the ``shards`` at rest), the unsharded gradients held to the reduction, the sharded
    gradients after it; {} off such a rank."""
    setup = e.setup
    if not (titan_fsdp2(setup) and setup.parallel.pp > 1):
        return {}
    device = e.device
    pairs = {
        "unsharded_weights": (
            device.peak.moments["layer backward"]["weights"] - shards,
            run.unsharded_weights,
        ),
        "unsharded_gradients": (
            pipeline_unsharded_gradients(setup, device.params, partial_grads(setup, device.stage)),
            run.unsharded_grads,
        ),
        "gradients": (device.states.gradients, run.grad_bytes),
    }
    return {k: {"estimated": a, "measured": b, "equal": a == b} for k, (a, b) in pairs.items()}


def stage_comparison_json(est: Result, index: int, run: Any) -> dict[str, Any]:
    """One rank (``titan_pp.StageRun``) beside ``at_stage(est, index)``, in ``trace --json``'s shape plus
    ``stage``: exact per layer, per hold, in total and in the rank's parameter bytes."""
    e = at_stage(est, index)
    est_by_layer = estimated_stage_layers(e)
    layers = list(run.layers)
    est_layers = [est_by_layer[i] for i in layers]
    meas_layers = [run.layer_bytes(i) for i in layers]
    rows = _rows(e, run.records)
    weights = e.device.states.weights
    s = est.setup.strategy
    if s.zero is ZeroStage.GRADIENTS and s.dp > 1:  # FSDP2 holds ZeRO-3's shard at rest (compare.ranks)
        zero3 = est.setup.model_copy(update={"strategy": s.model_copy(update={"zero": ZeroStage.PARAMETERS})})
        weights = at_stage(estimate(zero3), index).device.states.weights
    fsdp2 = fsdp2_held_json(e, weights, run)
    exact = (
        est_layers == meas_layers
        and e.activations == run.activations
        and all(r["delta_bytes"] == 0 and r["estimated_count"] == r["measured_count"] for r in rows[2:])
        and weights == run.param_bytes
        and all(v["equal"] for v in fsdp2.values())
    )
    per_layer = sum(meas_layers) // max(len(layers), 1)
    par = est.setup.parallel
    return {
        "estimated": to_json(e),
        "measured": {
            "memory": {"activations": run.activations},
            "activations": {
                "total": run.activations,
                "per_layer": per_layer,
                "tensors": [
                    {"name": r["name"], "bytes": r["measured_bytes"] // max(r["measured_count"], 1)}
                    | {"count": r["measured_count"], "total_bytes": r["measured_bytes"]}
                    for r in rows
                ],
            },
        },
        "diff": {
            "equal": exact,
            "exact": exact,
            "tolerance": 0,
            "total": {
                "estimated": e.activations,
                "measured": run.activations,
                "ratio": round(run.activations / max(e.activations, 1), 6),
            },
            "tensors": rows,
            "flops": [],
            "layers": [
                {"layers": [layers[j] for j in group], "estimated": a, "measured": b}
                | {"ratio": round(b / max(a, 1), 6)}
                for group, a, b in layer_groups(est_layers, meas_layers)
            ],
            "weights": {
                "estimated": weights,
                "measured": run.param_bytes,
                "equal": weights == run.param_bytes,
            },
        }
        | ({"fsdp2": fsdp2} if fsdp2 else {}),
        "stage": {
            "index": index,
            "pp": par.pp,
            "vpp": par.vpp,
            "virtual_stages": [k * par.pp + index for k in range(par.vpp)],
            "layers": layers,
        },
    }
