"""benchmarks/ring_kernels.py runs torch's private ring attention
(``_scaled_dot_product_ring_flash_attention``, ``_templated_ring_attention``) on torch's fake process group:
a CPU smoke run of its ring and ``kv-gather`` parts keeps it runnable on the installed torch (the GPU run
is benchmarks/gpu_session.sh's)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import ring_kernels


def test_the_ring_benchmark_runs_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    assert (
        ring_kernels.main(["--device", "cpu", "--out", str(out), "--parts", "ring,gather", "--reps", "1"])
        == 0
    )
    rows = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert rows[0]["kind"] == "env"
    ring = [r for r in rows if r["kind"] == "ring"]
    # on CPU the grouped K/V at cp 2 and 8, ranks 0 and c − 1 (the GPU run: both layouts, cp 1, 2, 4, 8)
    assert [(r["cp"], r["rank"]) for r in ring] == [(2, 0), (2, 1), (8, 0), (8, 7)]
    assert all("fwd_s" in r and "bwd_s" in r for r in ring)
    assert [(r["cp"], r["rank"]) for r in rows if r["kind"] == "gather"] == [
        (2, 0),
        (2, 1),
        (4, 0),
        (4, 3),
        (8, 0),
        (8, 7),
    ]
