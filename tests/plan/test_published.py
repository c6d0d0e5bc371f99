"""docs/step-time.md's predicted-against-published table is the code's output (memplan/time/published.py),
and the runs are built as their papers describe them."""

from __future__ import annotations

from pathlib import Path

import pytest

from memplan.strategies.pipeline_parallel import chunk_layers, stage_layers
from memplan.time.published import RUNS, markdown, narayanan_flops, predicted_timing

DOC = Path(__file__).resolve().parents[2] / "docs" / "step-time.md"


def test_the_docs_table_is_the_codes_output() -> None:
    text = DOC.read_text(encoding="utf-8")
    table = text.split("<!-- published:start -->\n", 1)[1].split("<!-- published:end -->", 1)[0]
    assert table == markdown()


def test_the_runs_have_their_papers_layouts() -> None:
    """GPU counts and global batches as the papers state them (Korthikanti Table 5, Narayanan Table 1,
    Llama 3 Table 4: 16M tokens per step, at s 8192 and, with CP 16 on 16,384 GPUs, at s 131,072)."""
    layouts = [(t.devices, t.global_batch, t.tokens_per_step) for t in (predicted_timing(r) for r in RUNS)]
    assert layouts == [
        (8, 4, 4 * 2048),
        (64, 64, 64 * 2048),
        (280, 280, 280 * 2048),
        (512, 512, 512 * 2048),
        (3072, 3072, 3072 * 2048),
        (8192, 2048, 16 * 2**20),
        (16384, 2048, 16 * 2**20),
        (16384, 128, 16 * 2**20),  # TP 8 · CP 16 · PP 16 · DP 8; 128 sequences of 131,072 tokens
    ]


def test_narayanan_flops_of_the_1t_run() -> None:
    """F = 96·B·s·l·h²(1 + s/(6h) + V/(16lh)) for their 1T row: 3072 × 2048 tokens, l 128, h 25600."""
    (run,) = [r for r in RUNS if r.source.startswith("Narayanan")]
    b, s, layers, h, v = 3072, 2048, 128, 25600, 51200
    assert narayanan_flops(run.setup) == pytest.approx(
        96 * b * s * layers * h**2 * (1 + s / (6 * h) + v / (16 * layers * h))
    )


def test_llama_runs_use_the_papers_interleaved_placement() -> None:
    """Dubey et al. 2024 §3.3.2: 126 layers over 16 ranks, one fewer on the first and last, interleaved with
    the first chunk the embedding alone and the last the head alone — one layer per chunk, 8 per rank."""
    for run in [r for r in RUNS if r.source.startswith("Dubey")]:
        par = run.parallel
        assert (par.tp, par.sp, par.pp, par.vpp) == (8, True, 16, 8)
        assert stage_layers(126, par) == (7, *[8] * 14, 7)
        chunks = chunk_layers(126, par)
        assert chunks[0] == (0, *[1] * 7) and chunks[-1] == (*[1] * 7, 0)
        assert all(c == (1,) * 8 for c in chunks[1:-1])
