"""Small architectures shared by the tests that run real steps and the benchmarks that tabulate them
(torch-free data; ``ModelConfig`` fields): GPT-2's layout, and the two three-layer models of the measured
peak (tests/measure/test_peak.py holds docs/peak-accuracy.md's table, benchmarks/bench_peak_accuracy.py
writes it; benchmarks/bench_fp8_peak.py draws its GPT widths on the same layout).

Known limitations: none; a new shared layout belongs here only when two files run it.
"""

from __future__ import annotations

from typing import Any

GPT_LAYOUT: dict[str, Any] = {
    "norm": "layernorm",
    "mlp": "gelu",
    "position": "learned",
    "tied_embeddings": True,
    "qkv_bias": True,
    "out_bias": True,
    "mlp_bias": True,
}
"""GPT-2's layout: LayerNorm with bias, a GELU MLP, learned positions, a tied head, a bias on every linear."""

PEAK_LLAMA: dict[str, Any] = {
    "hidden_size": 64,
    "num_layers": 3,
    "num_heads": 4,
    "num_kv_heads": 2,
    "ffn_size": 160,
}
"""The measured peak's Llama-style model: h 64, 3 layers, 4 heads over 2 kv heads, SwiGLU 160 wide."""
PEAK_GPT: dict[str, Any] = {
    "hidden_size": 64,
    "num_layers": 3,
    "num_heads": 4,
    "ffn_size": 256,
    **GPT_LAYOUT,
    "resid_dropout": 0.1,
    "embd_dropout": 0.1,
}
"""The measured peak's GPT-style model: GPT-2's layout at h 64, 3 layers, 4 heads, GELU 256 wide, with the
residual and embedding dropouts (0.1)."""
