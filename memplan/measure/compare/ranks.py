"""Every rank of ``memplan profile --nproc`` beside the engine's estimate of that layout (pure data).

Compared per rank, exactly: the model states (the local storages of weights, gradients, master copies and
optimizer states against ``engine.estimate``'s ``ModelStates`` for the same tp, dp and ZeRO stage) and the
saved activations, name by name. The peak is reported with its relative error, not required to be equal
(the CPU tracker's blind spots: dist_instruments.py).

What PyTorch's parallel APIs keep that the estimate (Megatron-LM's layout) does not, stated here once and
checked by tests/measure/test_distributed.py (docs/distributed.md explains them):

- Sequence parallelism (``sequence_parallel_gathers``): DTensor's ``ColwiseParallel(input_layouts=
  Shard(1))`` all-gathers the input of each column-parallel linear (W_Q, W_K, W_V, the MLP's gate and up)
  and of the lm head by itself, and autograd keeps the gathered [b, s, h] tensor; Megatron keeps the
  [b, s/t, h] shard (``attn.input``, ``mlp.input``, ``lm_head.input``) and gathers again in backward.
  So per rank: those names are not saved, and L·c + 1 unnamed [b, s, h] tensors are, c the
  column-parallel linears of a layer.
- ZeRO-2 through FSDP2 (``fsdp2_zero2_weights``): ``reshard_after_forward=False`` keeps the gathered
  parameters from forward to backward and no re-gather, but FSDP2 reshards after backward, so at rest the
  rank holds Ψ/N_d of the weights (ZeRO-3's), not ZeRO-2's replicated Ψ.
"""

from __future__ import annotations

from typing import Any

from memplan.config import MlpType, Setup, ZeroStage
from memplan.engine import Result, at_stage, estimate
from memplan.measure.compare.tensors import estimated_by_name

GATHERED_NAMES = ("attn.input", "mlp.input", "lm_head.input")
"""The sequence-parallel shards Megatron keeps and DTensor's column-parallel linears do not."""

UNLABELLED = "unlabelled"


def column_linears(setup: Setup) -> int:
    """Column-parallel linears of one layer: W_Q, W_K, W_V and the MLP's up (and gate, SwiGLU)."""
    return 3 + (2 if setup.model.mlp is MlpType.SWIGLU else 1)


def sequence_parallel_gathers(est: Result) -> dict[str, tuple[int, int]]:
    """What DTensor sequence parallelism keeps instead of the estimate's sequence shards, as (count, bytes)
    per name: the shards' names absent (0, 0), and ``unlabelled``: a gathered [b, s, h] tensor, t times
    the shard, for each column-parallel linear each shard feeds — ``attn.input`` W_Q, W_K and W_V, the
    MLP's input its up (and gate) matrices, ``lm_head.input`` the head: L·c + 1 over the whole model, a
    pipeline stage's own layers and micro-batches in flight on a stage (``at_stage``)."""
    setup = est.setup
    if not setup.parallel.sp:
        return {}
    kept = estimated_by_name(est)
    feeds = {"attn.input": 3, "mlp.input": column_linears(setup) - 3, "lm_head.input": 1}
    count = sum(kept.get(n, (0, 0))[0] * k for n, k in feeds.items())
    shards = sum(kept.get(n, (0, 0))[1] * k for n, k in feeds.items())
    return {**{n: (0, 0) for n in GATHERED_NAMES}, UNLABELLED: (count, shards * setup.parallel.tp)}


def fsdp2_zero2_weights(est: Result) -> dict[str, int]:
    """Under ZeRO-2 over dp > 1, the weights FSDP2 holds at rest: those of the same layout under ZeRO-3."""
    s = est.setup.strategy
    if s.zero is not ZeroStage.GRADIENTS or s.dp == 1:
        return {}
    zero3 = est.setup.model_copy(update={"strategy": s.model_copy(update={"zero": ZeroStage.PARAMETERS})})
    return {"weights": estimate(zero3).states.weights}


def expected_tensors(est: Result) -> dict[str, tuple[int, int]]:
    """(count, bytes) per name one rank keeps: the estimate, with PyTorch's known differences applied."""
    expected = {**estimated_by_name(est), **sequence_parallel_gathers(est)}
    return {n: v for n, v in expected.items() if v != (0, 0)}


def estimated_memory(est: Result) -> dict[str, int]:
    st = est.states
    return {
        "weights": st.weights,
        "gradients": st.gradients,
        "optimizer": st.optimizer,
        "activations": est.activations,
        "peak": est.peak.bytes,
    }


def rank_diff(report: dict[str, Any], est: Result) -> dict[str, Any]:
    """One rank's measurement against the estimate: per-name rows that differ (from the estimate and from
    the estimate with the known differences), states, activations, the peak's relative error."""
    mem = report["memory"]
    measured = {
        "weights": mem["weights"],
        "gradients": mem["gradients"],
        "optimizer": mem["master_weights"] + mem["optimizer_states"],
        "activations": mem["activations"],
        "peak": mem["peak"],
    }
    estimated = estimated_memory(est)
    meas_tensors = {n: (t["count"], t["bytes"]) for n, t in report["tensors"].items()}
    expected = expected_tensors(est)
    plain = estimated_by_name(est)
    rows = [
        {
            "name": n,
            "est_count": plain.get(n, (0, 0))[0],
            "est_bytes": plain.get(n, (0, 0))[1],
            "meas_count": meas_tensors.get(n, (0, 0))[0],
            "meas_bytes": meas_tensors.get(n, (0, 0))[1],
            "explained": meas_tensors.get(n, (0, 0)) == expected.get(n, (0, 0)),
        }
        for n in {**plain, **meas_tensors}
        if plain.get(n, (0, 0)) != meas_tensors.get(n, (0, 0))
    ]
    states = ("weights", "gradients", "optimizer")
    states_equal = all(measured[k] == estimated[k] for k in states)
    expected_states = {**estimated, **fsdp2_zero2_weights(est)}
    return {
        "memory": {k: measured[k] - estimated[k] for k in estimated},
        "tensors": rows,
        "states_equal": states_equal,
        "states_explained": all(measured[k] == expected_states[k] for k in states),
        "activations_equal": not rows,
        "activations_explained": meas_tensors == expected,
        "peak_relative_error": measured["peak"] / estimated["peak"] - 1,
        "measured_memory": measured,
    }


def rank_estimate(est: Result, report: dict[str, Any]) -> Result:
    """The estimate of what ``report``'s rank holds: its pipeline stage's (every rank's without pp)."""
    if est.setup.parallel.pp == 1:
        return est
    return at_stage(est, report["coords"]["pp"])


def comparison(reports: list[dict[str, Any]], est: Result, launcher: str) -> dict[str, Any]:
    """The ``--json`` object of ``profile --nproc``: the layout, the estimate, every rank and the verdict
    (``equal``: every rank's states equal and its saves equal to the estimate with the known differences)."""
    setup = est.setup
    ranks = []
    for r in reports:
        diff = rank_diff(r, rank_estimate(est, r))
        ranks.append(
            {
                "rank": r["rank"],
                "coords": r["coords"],
                "measured": {
                    "memory": diff.pop("measured_memory"),
                    "tensors": r["tensors"],
                    "unlabelled": r["unlabelled"],
                },
                "diff": diff,
                "collectives": r["collectives"],
            }
        )
    equal = all(r["diff"]["states_explained"] and r["diff"]["activations_explained"] for r in ranks)
    return {
        "model": setup.model.name,
        "nproc": len(reports),
        "launcher": launcher,
        "layout": {
            "tp": setup.parallel.tp,
            "sp": setup.parallel.sp,
            "pp": setup.parallel.pp,
            "dp": setup.strategy.dp,
            "zero": int(setup.strategy.zero),
        },
        "estimated": {
            "memory": estimated_memory(est),
            "stages": [
                {"stage": i, "memory": estimated_memory(at_stage(est, i))} for i in range(setup.parallel.pp)
            ]
            if setup.parallel.pp > 1
            else [],
            "tensors": {n: {"count": c, "bytes": b} for n, (c, b) in estimated_by_name(est).items()},
            "known_differences": {
                "tensors": {
                    n: {"count": c, "bytes": b} for n, (c, b) in sequence_parallel_gathers(est).items()
                },
                "memory": fsdp2_zero2_weights(est),
            },
        },
        "ranks": ranks,
        "equal": equal,
    }
