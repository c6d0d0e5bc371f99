"""torch's ring attention backward, measured on CPU against ``blocks.attention.ring_memory`` (memplan's
tracker: every storage the reference's ``RingFlash`` backward makes, torch's own ring functions with the CPU
flash kernel, one rank of a fake process group), and the whole step's peak of a context-parallel rank
against the estimate's where a layer's backward is the highest moment."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from memplan.api import build_setup
from memplan.blocks.attention.ring_memory import RingSizes, backward_peak
from memplan.cli.app import app
from memplan.config import AttentionChoice, CpRotate, Device, ModelConfig, Parallel, Setup
from memplan.engine import estimate
from memplan.measure.instruments.tracker import OpLiveTracker
from memplan.measure.reference.context import rotate_method
from memplan.measure.reference.model import Reference
from memplan.measure.runs.run import make_batch, ring


def cp_setup(cp: int, seq: int, b: int = 1, kv: int = 2, layers: int = 1) -> Setup:
    """h 64, 4 heads of 16 over ``kv`` K/V heads, a vocabulary of 32, pure bf16 SGD (no optimizer state)."""
    model = ModelConfig(
        hidden_size=64, num_layers=layers, num_heads=4, num_kv_heads=kv, ffn_size=160, vocab_size=32,
        max_positions=8192,
    )  # fmt: skip
    return build_setup(
        model, seq=seq, batch=b, attention=AttentionChoice.FLASH, device=Device.CPU, parallel=Parallel(cp=cp),
        precision="bf16", optimizer="sgd",
    )  # fmt: skip


def run_rank(setup: Setup, rank: int, rotate: str = "allgather") -> tuple[OpLiveTracker, int]:
    """One forward and backward of rank ``rank``'s sequence chunks under the tracker: (tracker, the index of
    the first backward op)."""
    torch.manual_seed(0)
    cp = setup.parallel.cp
    with ring(cp, rank, "cpu") as group, rotate_method(rotate):
        model = Reference(setup, device="cpu")
        model.ring = group
        ids, labels = make_batch(setup, "cpu")
        mine = model.positions(ids.shape[1] // cp, ids.device)
        ids, labels = ids[:, mine], labels[:, mine]
        tracker = OpLiveTracker()
        with tracker:
            tracker.track([*model.parameters(), ids, labels])
            loss = model(ids, labels)
            forward = len(tracker.rows)
            loss.backward()
    return tracker, forward


def ring_backward_measured(setup: Setup, rank: int, rotate: str) -> int:
    """The highest live bytes of the (one) layer's ring backward above those before it: from its first fp32
    accumulator (three ``zeros_like`` in a row) to the cast of the received dK/dV (its second ``_to_copy``
    after the last block's kernel)."""
    tracker, forward = run_rank(setup, rank, rotate)
    rows = tracker.rows
    kernels = [i for i, (n, _) in enumerate(rows) if i > forward and "flash_attention_for_cpu_backward" in n]
    zeros = "aten.zeros_like.default"
    first = min(i for i in range(forward, kernels[0]) if all(rows[j][0] == zeros for j in range(i, i + 3)))
    end = [i for i in range(kernels[-1], len(rows)) if rows[i][0] == "aten._to_copy.default"][1]
    return max(live for _, live in rows[first : end + 1]) - rows[first - 1][1]


CASES = [
    # (cp, rank, b, kv heads): ranks at both ends and inside, MHA, GQA and MQA, b 1 to 3
    (2, 0, 1, 2),
    (2, 1, 3, 4),
    (3, 1, 1, 2),
    (4, 0, 2, 4),
    (4, 3, 1, 2),
    (5, 2, 2, 1),
    (8, 7, 1, 1),
]


@pytest.mark.parametrize("rotate", [CpRotate.ALLGATHER, CpRotate.ALLTOALL], ids=str)
@pytest.mark.parametrize(("cp", "rank", "b", "kv"), CASES)
def test_the_ring_backward_ledger_is_every_storage_torch_makes(
    cp: int, rank: int, b: int, kv: int, rotate: CpRotate
) -> None:
    """The ledger (``backward_peak``, views: the model's k and v are [b, kv, s, d] views of its projections)
    against every storage the CPU run makes, byte for byte."""
    setup = cp_setup(cp, seq=2 * cp * 64, b=b, kv=kv)
    s = setup.training.seq_len // cp
    size = RingSizes(q=b * 4 * s * 16, k=b * kv * s * 16, lse=b * 4 * s, e=2)
    assert ring_backward_measured(setup, rank, rotate.value) == backward_peak(cp, rank, size, rotate)


@pytest.mark.parametrize(("cp", "kv"), [(3, 4), (4, 4), (8, 4), (16, 2)])
def test_a_context_parallel_ranks_peak_is_the_estimates_at_its_layer_backward(cp: int, kv: int) -> None:
    """Three layers, s/c = 256 tokens: the top layer's attention backward — the ring's accumulators, the
    K/V in flight, dq, dk, dv beside every layer's saves — is the step's peak, on rank 0 (one of the most
    loaded: every rank but the last merges a head-major output, whose W_O copy the backward frees)."""
    setup = cp_setup(cp, seq=cp * 256, kv=kv, layers=3)
    est = estimate(setup)
    assert est.peak.phase == "layer backward"
    tracker, _ = run_rank(setup, 0)
    assert tracker.peak == est.peak.bytes


def test_at_cp_2_the_last_ranks_larger_ring_is_an_upper_bound() -> None:
    """At cp 2 the last rank's ring holds more than rank 0's (its blocks keep whole queries) while it saves
    one head-major output less per layer: without ``--cp-rank`` the estimate takes the larger ring with the
    larger saves, above both ranks' measured peaks (here by 57,344 B of 11.2 MB); with it, each rank's
    estimate is that rank's peak."""
    setup = cp_setup(2, seq=2048, kv=4, layers=3)
    est = estimate(setup).peak.bytes
    peaks = [run_rank(setup, r)[0].peak for r in range(2)]
    assert max(peaks) <= est <= max(peaks) + 2 * 1024 * 64  # within one rank's [T, a·d] output
    for r, peak in enumerate(peaks):
        ranked = setup.model_copy(update={"parallel": setup.parallel.model_copy(update={"cp_rank": r})})
        assert estimate(ranked).peak.bytes == peak


runner = CliRunner(env={"COLUMNS": "120", "NO_COLOR": "1"})


@pytest.mark.parametrize("rank", [0, 3])
def test_profile_runs_one_context_parallel_rank_and_matches_its_estimate(rank: int) -> None:
    """``memplan profile --cp 4 --cp-rank R``: that rank of the ring in this process (CPU, a fake process
    group), its saves, FLOPs (× cp) and peak equal to the estimate of that rank (the last keeps its
    merged output as W_O's input, no copy)."""
    args = ["profile", "-m", "tiny", "--device", "cpu", "--seq", "512", "--cp", "4", "--steps", "1"]
    r = runner.invoke(app, [*args, "--cp-rank", str(rank), "--warmup", "0", "--json"])
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    assert result["diff"]["equal"]
    assert result["measured"]["memory"]["peak"] == result["estimated"]["memory"]["peak"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--cp-rank", "4"], "cp_rank: rank 4 is not a context-parallel rank of --cp 4"),
        (["--nproc", "2"], "cp: profile --cp runs one context-parallel rank in this process"),
        (["--cp-rotate", "kv-gather"], "cp-rotate: kv-gather"),
    ],
)
def test_profile_cp_refuses_what_it_cannot_run_in_one_line(extra: list[str], message: str) -> None:
    r = runner.invoke(app, ["profile", "-m", "tiny", "--seq", "512", "--cp", "4", "--device", "cpu", *extra])
    assert r.exit_code == 2, r.output
    assert message in r.output
    assert "Traceback" not in r.output


@pytest.mark.parametrize("rank", [0, 3])
def test_trace_cp_on_cuda_runs_torchs_cuda_ring_entry_points_on_the_meta_device(rank: int) -> None:
    """``trace --cp --device cuda``: torch's ``_scaled_dot_product_ring_flash_attention`` and its backward
    (``reference.context.RingCuda``) with the CUDA flash kernel's meta outputs, over the fake process
    group: the saves (the philox seed and offset among them) and FLOPs equal the CUDA estimate's."""
    args = ["trace", "-m", "tiny", "--seq", "512", "--cp", "4", "--cp-rank", str(rank), "--device", "cuda"]
    r = runner.invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["diff"]["equal"]
