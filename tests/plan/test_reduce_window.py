"""ZeRO 2's per-micro-batch gradient reduce-scatter: what it hides behind (memplan/time/predict.py
``reduce_window``), derived by hand.

FSDP keeps one reduce-scatter buffer in flight: the compute stream waits for a layer's reduce-scatter at
the next layer's copy-in (torch's ``set_reduce_scatter_max_input_buffers`` docs). So the reduce-scatters
hide behind every backward, and a forward chunk that the schedule runs between two backwards hides at most
one more layer's reduce-scatter. Forwards between backwards: under Megatron's schedules the rank runs W
warm-up forwards, then m·n − W one-forward-one-backward pairs, then the cool-down's backwards, so m·n − W − 1
backwards are followed by a forward (W = p − i − 1 under 1F1B, 2(p − i − 1) + (m − 1)·p interleaved,
at most m·n; Megatron-LM ``get_num_warmup_microbatches``). Without a pipeline W = 0: every micro-batch's
backward but the last is followed by the next forward.

    exposed(dp) = max(0, Σ RS − n·B − F_count · min(F/m, Σ RS / (n·L)))   + the weight all-gather's own

with B, F one micro-batch's backward and forward on the stage, L the stage's layers.
"""

from __future__ import annotations

import pytest

from memplan.config import Parallel, ReduceDtype, Setup, StrategyConfig, TrainingConfig, ZeroStage
from memplan.engine import estimate
from memplan.presets import load_gpu, load_model_preset
from memplan.strategies.pipeline_parallel import warmup_forwards
from memplan.time.comm.collectives import communication
from memplan.time.comm.rows import Overlap
from memplan.time.compute import kernel_times
from memplan.time.timing import peak_flops, timing

H100 = load_gpu("h100")
LLAMA8 = load_model_preset("llama-3-8b").model


def setup(pp: int, vpp: int, n: int, dtype: ReduceDtype | None = ReduceDtype.FP32) -> Setup:
    return Setup(
        model=LLAMA8,
        training=TrainingConfig(seq_len=4096, grad_accum=n),
        strategy=StrategyConfig(zero=ZeroStage.GRADIENTS, dp=256, reduce_dtype=dtype),
        parallel=Parallel(tp=8, sp=True, pp=pp, vpp=vpp),
    )


@pytest.mark.parametrize(
    ("p", "m", "i", "n", "warm"),
    [
        (4, 1, 0, 8, 3),  # 1F1B: p − i − 1
        (4, 1, 3, 8, 0),
        (4, 2, 0, 8, 2 * 3 + 4),  # interleaved: 2(p − i − 1) + (m − 1)·p = 10
        (4, 2, 3, 8, 4),
        (16, 8, 14, 16, 2 + 7 * 16),  # Llama 3 405B's busiest rank, 16 micro-batches: 114 of 128
        (16, 8, 0, 16, 128),  # 2·15 + 112 = 142 > 128 chunk-forwards: all of them
    ],
)
def test_warmup_is_megatrons(p: int, m: int, i: int, n: int, warm: int) -> None:
    assert warmup_forwards(Parallel(tp=1, pp=p, vpp=m), i, n) == warm


@pytest.mark.parametrize(("pp", "vpp", "n"), [(1, 1, 4), (4, 1, 8), (4, 2, 8)])
def test_reduce_scatter_hides_behind_backwards_and_a_layer_per_forward(pp: int, vpp: int, n: int) -> None:
    s = setup(pp, vpp, n)
    result = estimate(s)
    crit, rows = communication(result, H100.topology)
    fwd, bwd = kernel_times(crit, H100, peak_flops(H100, s.training.precision))
    dp = [r for r in rows if r.dimension == "dp"]
    rs = sum(r.time_s for r in dp if r.overlap is Overlap.BACKWARD_THEN_FORWARD)
    # by hand: 32 layers split evenly, the busiest stage is the last (it has the head); its warm-up is
    # p − i − 1 = 0 under 1F1B, 2·0 + (m − 1)·p = 4 interleaved (m = 2, p = 4)
    assert crit.index == pp - 1
    warm = (vpp - 1) * pp
    followed = vpp * n - warm - 1
    layers = 32 // pp
    extra = followed * min(fwd.total_s / vpp, rs / (n * layers))
    gather = sum(r.time_s for r in dp if r.overlap is Overlap.FIRST_FORWARD)
    expected = max(0.0, rs - n * bwd.total_s - extra) + max(0.0, gather - fwd.total_s)
    got = timing(result, H100).prediction.exposed_s["dp"]
    assert got == pytest.approx(expected, rel=1e-12)
    assert rs > n * bwd.total_s  # fp32 over 256 ranks on one NIC each outlasts the backwards: exposed
    assert got < rs - n * bwd.total_s + max(0.0, gather - fwd.total_s)  # and the forwards hide some


def test_bf16_reduce_scatter_is_hidden_and_fp32_doubles_its_bytes() -> None:
    """--reduce-dtype fp32 moves 4 bytes per gradient element where bf16 moves 2."""
    fp32 = communication(estimate(setup(4, 2, 8)), H100.topology)[1]
    bf16 = communication(estimate(setup(4, 2, 8, ReduceDtype.BF16)), H100.topology)[1]

    def rs_bytes(rows: list) -> int:
        return next(r.bytes for r in rows if r.overlap is Overlap.BACKWARD_THEN_FORWARD)

    assert rs_bytes(fp32) == 2 * rs_bytes(bf16)
