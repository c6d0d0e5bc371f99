"""``memplan profile --nproc 4 --tp 2 --pp 2``: tensor parallelism inside each pipeline stage (the tiny
model, 1F1B over 4 micro-batches), every rank against its stage's estimate.

Its ranks run in the 4-rank spawn of tests/measure/spawned.py, beside test_distributed*.py's 4-rank layouts.
"""

from __future__ import annotations

import pytest

from memplan.engine import at_stage, estimate
from memplan.measure.compare.ranks import comparison
from memplan.measure.compare.tensors import estimated_by_name
from memplan.presets import load_gpu
from memplan.time.comm.collectives import communication
from tests.measure.spawned import N, Runs, tiny


@pytest.mark.xdist_group("nproc4")  # one worker spawns the 4-rank layouts once (spawned.py)
def test_tp2_by_pp2_each_rank_equals_its_stage(nproc_runs: Runs) -> None:
    """Saves and states equal the stage's tp-rank estimate; the tp all-reduces are Megatron's forward ones
    (2 per layer + the embedding's + the vocabulary-parallel loss's 3) and DTensor's backward ones (one per
    column-parallel linear + the lm head's: docs/distributed.md) per micro-batch. Each tp rank sends the
    whole replicated [b, s, h] to the next stage: t times the table's pp row, which models Megatron's
    scatter/gather (send 1/t, all-gather after the receive; Narayanan et al. 2021 §4.1), not done here."""
    setup = tiny(gpus=4, tp=2, pp=2, grad_accum=N)
    est = estimate(setup)
    result = comparison(nproc_runs.reports(setup, 4), est, "spawn")
    assert result["equal"] is True
    coords = [(r["coords"]["pp"], r["coords"]["tp"]) for r in result["ranks"]]
    assert coords == [(0, 0), (0, 1), (1, 0), (1, 1)]  # tp inside pp
    rows = communication(est, load_gpu("h100-sxm").topology)[1]
    send = next(r for r in rows if r.dimension == "pp" and r.phase.value == "forward")
    layers, t = est.setup.model.num_layers // 2, 2
    for rank in result["ranks"]:
        stage = rank["coords"]["pp"]
        expected = {
            n: {"count": c, "bytes": b} for n, (c, b) in estimated_by_name(at_stage(est, stage)).items()
        }
        assert rank["measured"]["tensors"] == expected
        assert rank["measured"]["unlabelled"] == []
        assert rank["diff"]["states_equal"] is True
        calls = {(c["dimension"], c["collective"], c["phase"]): c["count"] for c in rank["collectives"]}
        last = stage == 1
        assert calls[("tp", "all_reduce", "forward")] == N * (2 * layers + (3 if last else 1))
        assert calls[("tp", "all_reduce", "backward")] == N * (5 * layers + (1 if last else 0))
        p2p = {c["phase"]: c for c in rank["collectives"] if c["dimension"] == "pp"}
        assert p2p["forward"]["count"] == send.count == N
        assert p2p["forward"]["bytes"] == t * send.bytes * send.count  # the whole X, not X/t
        assert ("tp", "all_gather", "forward") not in calls
