"""The small model the by-hand rule tests share (tests/test_lora_flow.py, tests/test_mlp_rules.py): small
enough to write every expected shape out, torch-free (both judge the mutation run)."""

from __future__ import annotations

from typing import Any

from memplan.config import FineTune, ImplConfig, ModelConfig, Setup, StrategyConfig, TrainingConfig

H, A, F, V, B, S, L = 64, 4, 160, 1000, 2, 32, 4
"""hidden, heads, MLP width, vocabulary, micro-batch, sequence, layers."""
T = B * S
SIZE = {"bf16": 2, "fp32": 4, "bool": 1, "int64": 8, "uint64": 8}
"""Bytes per element of each dtype name."""


def tiny_setup(
    model: dict[str, Any] | None = None,
    strategy: dict[str, Any] | None = None,
    impl: ImplConfig | None = None,
    finetune: FineTune | None = None,
) -> Setup:
    """The tiny model with ``model``'s fields on top, and the given strategy, implementation and method."""
    fields: dict[str, Any] = {"hidden_size": H, "num_layers": L, "num_heads": A, "ffn_size": F}
    m = ModelConfig(**{**fields, "vocab_size": V, "max_positions": S, **(model or {})})
    return Setup(
        model=m,
        training=TrainingConfig(micro_batch=B, seq_len=S),
        strategy=StrategyConfig(**(strategy or {})),
        impl=impl or ImplConfig(),
        finetune=finetune or FineTune(),
    )


def nbytes(rows: list[tuple[str, tuple[int, ...], str]]) -> int:
    """Bytes of (name, shape, dtype name) rows: each shape's product times its dtype's size."""
    total = 0
    for _, shape, dtype in rows:
        n = SIZE[dtype]
        for x in shape:
            n *= x
        total += n
    return total
