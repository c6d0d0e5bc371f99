"""torchtitan's published Memory(GiB) against memplan's reserved bytes over all streams
(benchmarks/published_reserved.py, docs/published-memory.md "torchtitan's published allocator peaks"): each
typed row is what its table states, the reduce-scatter pool is what torch reserves for it, and the doc holds
the code's output. No error bound is asserted (issue #22's ±5 % is reported, not fitted)."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.heldout import predict
from benchmarks.published_reserved import DOC, END, READINGS, START, Reading, held_out, markdown, pools

MIB = 2**20

# pytorch/torchtitan docs/performance.md (eaea6f6), by hand from its table captions and rows:
# table: (GPUs, local batch, global batch, activation checkpointing, tp)
CAPTIONS = {
    "T1": (
        8,
        2,
        16,
        "selective",
        1,
    ),  # "Llama 3.1 8B model. 8 GPUs. Local batch size 2, global batch size 16."
    "T2": (8, 1, None, "full", 1),  # "8 GPUs. Local batch size 1. Full activation checkpointing."
    "T3": (128, 2, 256, "selective", 1),  # "128 GPUs. Local batch size 2, global batch size 256."
    "T4": (
        256,
        16,
        512,
        "full",
        8,
    ),  # "256 GPUs (FSDP 32, TP 8). Local batch size 16, global batch size 512."
    "T5": (512, 32, 256, "full", 8),  # "512 GPUs (FSDP 8, TP 8, PP8). Local batch size 32, global ... 256."
    "T6": (512, 8, None, "full", 8),  # "512 GPUs (TP 8, PP8). Local batch size 8."
}
# the models: Tables 1-3 Llama 3.1 8B, Table 4 Llama 3.1 70B, Tables 5-6 Llama 3.1 405B
MODELS = {
    "T1": "llama-3.1-8b",
    "T2": "llama-3.1-8b",
    "T3": "llama-3.1-8b",
    "T4": "llama-3.1-70b",
    "T5": "llama-3.1-405b",
    "T6": "llama-3.1-405b",
}
PIPELINED = ("T5", "T6")
"""PP 8: the local batch split into the schedule's micro-batches (torchtitan's default count, the total
number of stages: benchmarks/heldout.py ``_titan_pp``), interleaved over 2 stages a rank where the row says
so."""
# each row's memory as printed (Memory(GiB) column), in the tables' order
PUBLISHED = {
    "T1": (82.4, 77.0, 76.8),
    "T2": (83.9, 84.2, 84.0, 84.5),
    "T3": (67.0, 62.0, 61.8),
    "T4": (71.9, 67.6),
    "T5": (82.5, 72.7),
    "T6": (75.3, 75.9, 77.1, 84.9),
}


def typed() -> list[Reading]:
    return [r for r in READINGS if r.run is not None]


def test_every_published_memory_figure_is_a_row() -> None:
    got: dict[str, tuple[float, ...]] = {}
    for r in READINGS:
        got[r.table] = (*got.get(r.table, ()), r.gib)
    assert got == PUBLISHED
    assert all(r.why for r in READINGS if r.run is None)


@pytest.mark.parametrize("reading", typed(), ids=lambda r: f"{r.table} {r.row}")
def test_each_typed_row_is_what_its_table_states(reading: Reading) -> None:
    s: dict[str, Any] = predict(held_out(reading))["setup"]
    gpus, local, global_batch, ckpt, tp = CAPTIONS[reading.table]
    assert predict(held_out(reading))["model"] == MODELS[reading.table]
    n = s["micro_batches"]
    assert (s["devices"], s["micro_batch"] * n, s["checkpointing"], s["tp"]) == (gpus, local, ckpt, tp)
    if reading.table in PIPELINED:  # the schedule's micro-batches: one per (virtual) stage
        vpp = 2 if reading.row.startswith("Interleaved") else 1
        assert (s["pp"], s["vpp"], n) == (8, vpp, 8 * vpp)
    assert s["zero"] == 3 and (n == 1 or reading.table in PIPELINED)  # FSDP; local batch = micro-batch
    # torchtitan's own code, float8 rows included (torchao tensorwise: heldout.py's notes)
    assert s["impl"] == "torchtitan"
    # the row's label names compile and float8; Tables 2 and 4 caption "torch.compile + Float8" for all
    label = reading.row
    compiled = "compile" in label or reading.table in ("T2", "T4", "T5", "T6")
    float8 = "Float8" in label or reading.table in ("T2", "T4", "T5", "T6")
    assert (s["compile"], s["fp8"] != "none") == (compiled, float8)
    # AsyncTP: Table 4's second row; Tables 5 and 6 caption it for all
    assert s["async_tp"] == ("AsyncTP" in label or reading.table in PIPELINED)
    if reading.table in ("T2", "T6"):
        # "FSDP d, CP c | Sequence Length L": c ranks of context parallelism, global batch d sequences
        fsdp, cp = (int(part.split()[1]) for part in label.split(", s ")[0].split(", "))
        # (Table 6: local batch 8 on each of the d data-parallel ranks)
        assert (s["cp"], s["seq_len"], s["global_batch"]) == (cp, int(label.split(", s ")[1]), fsdp * local)
    else:
        # Tables 1, 3, 4: torchtitan's train_configs' seq_len 8192 (Llama 3.1)
        assert (s["cp"], s["seq_len"], s["global_batch"]) == (1, 8192, global_batch)


def test_t1_reduce_scatter_pool_is_one_segment_per_unit_of_fp32_shards() -> None:
    """Table 1's FSDP row: FSDP2's reduce-scatter stream holds each unit's fp32 sharded gradient (reduce
    fp32, fp32 parameters) from its reduce to ``zero_grad``, one large block each; a block over 10 MiB is a
    segment of its own, rounded up to 2 MiB (CUDACachingAllocator's kLargeBuffer / kRoundLarge)."""
    p = pools(predict(held_out(READINGS[0])))

    def segment(numel: int) -> int:
        nbytes = numel // 8 * 4  # the rank's shard of 8, fp32
        return -(-nbytes // (2 * MIB)) * (2 * MIB)

    # Llama 3.1 8B's layer: wq, wo (2·h²) + wk, wv (2·h·1024: 8 kv heads of 128) + w1, w2, w3 (3·h·ffn)
    # + two norms (2·h), h 4096, ffn 14,336
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    assert layer == 218_112_000
    # the run's 2024 wrapping (typed --fsdp-wrap root): 32 blocks and the root, tok_embeddings, norm and
    # output in one unit (0.3.0 would have two: tok_embeddings, 252 MiB, and [norm, output], 252 MiB)
    root = 128_256 * 4096 + 4096 + 128_256 * 4096
    assert segment(layer) == 106 * MIB and segment(root) == 502 * MIB
    assert p.reduce_scatter == 32 * segment(layer) + segment(root)


def test_the_total_is_every_pool_the_allocator_reserves() -> None:
    # reserved_bytes.all sums the default stream's, the all-gather stream's and the reduce-scatter
    # stream's segments: Table 1's FSDP row, from the JSON's own fields
    j = predict(held_out(READINGS[0]))["memory"]
    want = j["allocator"]["reserved_peak"] + j["fsdp_all_gather_stream"] + j["fsdp_reduce_scatter_stream"]
    assert pools(predict(held_out(READINGS[0]))).total == want


def test_the_doc_holds_this_table() -> None:
    text = DOC.read_text(encoding="utf-8")
    assert text.split(START + "\n", 1)[1].split(END, 1)[0] == markdown()
