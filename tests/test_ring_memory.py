"""``blocks.attention.ring_memory``: torch's ring backward on one rank, by hand and against the H200's
allocator (tests/measure/test_ring_memory.py measures it on CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memplan.analytic.moments import layer_backward as lb
from memplan.analytic.params import count_params
from memplan.blocks.attention.ring_memory import (
    KEY_HALF,
    QUERY_HALF,
    RingSizes,
    backward_peak,
    ring_backward_transient,
)
from memplan.blocks.attention.workspace import fa2_backward_workspace
from memplan.blocks.inventory import Dims
from memplan.config import CpRotate, Device, ModelConfig, Parallel, Setup, TrainingConfig

H200_ROWS = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "h200-ring-memory.jsonl"


def test_cp_2_last_rank_by_hand() -> None:
    """c 2, rank 1, all-gather, k and v non-contiguous views; Q, K elements, bf16 (Qa = 2Q, Ka = 2K bytes;
    fp32 Q32 = 4Q, K32 = 4K). Block 0: dQ, dK, dV fp32 zeros, the k and v copies, the K/V ``cat`` and
    the gathered 2·(2Ka), the kernel's dq, dk, dv: Q32 + 2K32 + Qa + 10Ka; ``flatten`` copies the two
    non-contiguous accumulators (2K32) before their ``cat`` (2K32): + 4K32 inside that op; then the cat
    and the permuted buffer stay (Q32 + 6K32 + Qa + 10Ka). Block 1 (i ≤ r: half the keys): the copies go
    (−2Ka) before its dq and half dk, dv (Qa + Ka) appear beside block 0's: Q32 + 6K32 + 2Qa + 9Ka; then
    block 0's freed, the received dK/dV taken (its cat and the zeros freed: −4K32) and added into by
    ``_partial_update``'s two cats (+2K32), the new cat and its permuted copy (+4K32): Q32 + 8K32 + Qa +
    7Ka, the previous permuted buffer freed after. The highest of the three."""
    q, k = 1000, 300
    qa, ka, q32, k32 = 2 * q, 2 * k, 4 * q, 4 * k
    by_hand = max(q32 + 6 * k32 + qa + 10 * ka, q32 + 6 * k32 + 2 * qa + 9 * ka, q32 + 8 * k32 + qa + 7 * ka)
    assert backward_peak(2, 1, RingSizes(q=q, k=k, lse=10, e=2)) == by_hand


def _h200_rows() -> list[dict[str, object]]:
    rows = [json.loads(line) for line in H200_ROWS.read_text().splitlines()]
    return [r for r in rows if r.get("kind") == "memory" and r["cp"] > 1]


@pytest.mark.parametrize("row", _h200_rows(), ids=lambda r: f"cp{r['cp']}-rank{r['rank']}")
def test_the_ledger_is_the_h200s_allocator_peak(row: dict[str, object]) -> None:
    """benchmarks/ring_kernels.py ``memory`` on an H200: q, k, v made [b, a, s, d]-contiguous (no k, v
    copies; ``zeros_like`` contiguous, so no ``flatten`` copies); inside each block's kernel backward,
    FlashAttention-2's workspace for the block's shape and ``_flash_attention_backward``'s
    ``contiguous()`` of ``out`` and ``grad_out`` (head-major here, [b, s, a, d] in a model)."""
    b, a, kv, s, d = 1, int(row["heads"]), int(row["kv_heads"]), int(row["s_local"]), int(row["d"])
    c, r = int(row["cp"]), int(row["rank"])

    def extra(shape: str) -> int:
        sq = s // 2 if shape == QUERY_HALF else s
        sk = s // 2 if shape == KEY_HALF else s
        return fa2_backward_workspace(b, a, kv, sq, sk, d, d, 2) + 2 * b * a * sq * d * 2

    size = RingSizes(q=b * a * s * d, k=b * kv * s * d, lse=b * a * s, e=2)
    measured = row["backward"]["peak_allocator"]  # type: ignore[index]
    assert backward_peak(c, r, size, CpRotate.ALLGATHER, views=False, cuda_extra=extra) == measured


def cp_setup(cp: int, rotate: CpRotate = CpRotate.ALLGATHER, device: Device = Device.CPU) -> Setup:
    model = ModelConfig(
        hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_size=160, vocab_size=32
    )
    return Setup(
        model=model,
        training=TrainingConfig(micro_batch=1, seq_len=512),
        parallel=Parallel(cp=cp, cp_rotate=rotate),
        device=device,
    )


def test_the_attention_backward_holds_the_ring_under_context_parallelism_but_not_kv_gather() -> None:
    """Flash attention's backward holds dO [T, a·d] and dq, dk, dv; under torch's ring dO and the ring's
    own peak on the most loaded rank (with the reference's zero logsumexp gradient, [b, a, s] fp32); under
    ``kv-gather`` (not torch's ring) the plain kernel's buffers."""
    params = count_params(cp_setup(1).model)
    ring = cp_setup(4)
    dims = Dims.of(ring)
    t, qa = dims.tokens, dims.tokens * 4 * 16 * 2
    size = RingSizes(q=t * 64, k=t * 32, lse=t * 4, e=2)
    worst = max(backward_peak(4, r, size) for r in range(4))
    assert ring_backward_transient(ring, dims) == worst + t * 4 * 4
    gather = cp_setup(4, CpRotate.KV_GATHER)
    plain = lb.attention_backward_transient(gather, dims, params)
    assert lb.attention_backward_transient(ring, dims, params) - plain == qa + worst + t * 16 - (
        2 * qa + t * 64 * 2
    )
    assert ring_backward_transient(cp_setup(1), Dims.of(cp_setup(1))) == 0


def test_the_memo_keeps_ranks_and_rotate_methods_apart() -> None:
    """The rank and the rotate method change the ring's ledger: estimates of the same layout one after the
    other (memoised pieces, ``pieces.pieces_key``) equal each made cold."""
    from memplan.engine import clear_caches, estimate

    variants = [
        cp_setup(2, rotate, Device.CUDA).model_copy(
            update={"parallel": Parallel(cp=2, cp_rotate=rotate, cp_rank=rank)}
        )
        for rotate in (CpRotate.ALLGATHER, CpRotate.ALLTOALL)
        for rank in (None, 0, 1)
    ]
    warm = [estimate(v).peak.phases["layer backward"] for v in variants]
    cold = []
    for v in variants:
        clear_caches()
        cold.append(estimate(v).peak.phases["layer backward"])
    assert warm == cold
    assert len(set(cold)) > 1
