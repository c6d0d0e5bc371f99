"""How many estimates memplan evaluates per second, in-process, over a grid of setups.

The grid crosses every shipped model preset with sequence lengths, micro-batch sizes, checkpointing,
attention kernels, ZeRO stages and precisions (a planner sweeping a search space does this). Three rates:
building and validating the ``Setup`` (pydantic), ``estimate(setup)`` alone, and ``estimate(setup)
.to_json()`` (what ``--json`` prints). Each is timed over whole passes of the grid, repeated until at least
``--seconds`` have passed; the figure is the median pass.

    python benchmarks/bench_throughput.py [--seconds 3] [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from memplan.config import (
    Attention,
    Checkpointing,
    ModelConfig,
    PositionType,
    Precision,
    Setup,
    StrategyConfig,
    TrainingConfig,
    ZeroStage,
)
from memplan.contract import to_json
from memplan.engine import estimate
from memplan.presets import load_model_preset, model_names

SEQS = (512, 2048, 8192)
BATCHES = (1, 4)
CHECKPOINTING = (
    (Checkpointing.NONE, 1),
    (Checkpointing.SELECTIVE, 1),
    (Checkpointing.FULL, 1),
    (Checkpointing.EVERY_K, 4),
)
ATTENTION = (Attention.EAGER, Attention.FLASH)
ZERO = ((ZeroStage.NONE, 1), (ZeroStage.PARAMETERS, 8))
PRECISION = (Precision.BF16_MIXED, Precision.FP32)


def reference_runs(model: ModelConfig) -> bool:
    """Whether the default ``--impl reference`` estimates the preset: the structures only ``--impl hf``
    models (Gemma-2/3's post norms and layer types, GPT-NeoX's partial rotary and parallel residual,
    gpt-oss's sinks) are refused there, so those presets are left out of the grid."""
    return not any(model.hf_only.values()) and model.rotary_pct == 1 and not model.parallel_residual


def grid_points() -> list[dict[str, Any]]:
    """The grid as plain dicts (what a planner would validate into Setups)."""
    models = [m for m in (load_model_preset(name).model for name in model_names()) if reference_runs(m)]
    points: list[dict[str, Any]] = []
    for model, seq, batch, (ckpt, k), attention, (zero, dp), precision in itertools.product(
        models, SEQS, BATCHES, CHECKPOINTING, ATTENTION, ZERO, PRECISION
    ):
        if model.position is PositionType.LEARNED:
            seq = min(seq, model.max_positions)
        k = min(k, model.num_layers)
        points.append(
            {
                "model": model,
                "training": {"micro_batch": batch, "seq_len": seq, "precision": precision},
                "strategy": {
                    "checkpointing": ckpt,
                    "checkpoint_every": k,
                    "attention": attention,
                    "zero": zero,
                    "dp": dp,
                },
            }
        )
    return points


def build(points: list[dict[str, Any]]) -> list[Setup]:
    return [
        Setup(
            model=p["model"] if isinstance(p["model"], ModelConfig) else ModelConfig(**p["model"]),
            training=TrainingConfig(**p["training"]),
            strategy=StrategyConfig(**p["strategy"]),
        )
        for p in points
    ]


def passes(fn: Callable[[], object], seconds: float) -> list[float]:
    """Times of whole passes of ``fn`` (one warm-up pass first) until ``seconds`` have passed (≥ 3)."""
    fn()
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(times) < 3 or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def bench(seconds: float = 3.0) -> dict[str, Any]:
    points = grid_points()
    setups = build(points)
    n = len(setups)
    rates: dict[str, float] = {}
    for name, fn in (
        ("setup_validation", lambda: build(points)),
        ("estimate", lambda: [estimate(s) for s in setups]),
        ("estimate_to_json", lambda: [to_json(estimate(s)) for s in setups]),
    ):
        rates[name] = n / statistics.median(passes(fn, seconds))
    return {
        "grid": {
            "setups": n,
            "models": len(model_names()),
            "seq": list(SEQS),
            "batch": list(BATCHES),
            "checkpointing": ["none", "selective", "full", "every-4"],
            "attention": ["eager", "flash"],
            "zero_dp": ["0/1", "3/8"],
            "precision": [p.value for p in PRECISION],
        },
        "per_second": rates,
        "microseconds_each": {k: 1e6 / v for k, v in rates.items()},
    }


def render(r: dict[str, Any]) -> str:
    lines = [f"estimates per second over a grid of {r['grid']['setups']} setups (in-process, median pass)"]
    for name, rate in r["per_second"].items():
        lines.append(f"  {name:<18} {rate:>10,.0f} /s   {r['microseconds_each'][name]:8.1f} µs each")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="minimum time per measured rate")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    result = bench(args.seconds)
    print(json.dumps(result, indent=2) if args.json else render(result))


if __name__ == "__main__":
    main()
