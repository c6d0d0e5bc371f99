"""Async TP's speed-up, published against memplan's (``--async-tp``, time/async_tp.py).

    python benchmarks/async_tp.py            # print the Markdown table and its summary
    python benchmarks/async_tp.py --write    # and replace docs/step-time.md's section

Source: pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (June 2025; torch 38410cf9,
torchtitan 820504e): tokens/s per GPU of vanilla and async TP on the Grand Teton H100s (96 GB HBM2e at
2.4 TB/s, 500 W), each pair's commands identical but for ``--parallelism.enable_async_tensor_parallel``.
The GPUs' 500 W limit, which no preset models (docs/step-time.md: every Teton row reads 15-70 % fast), is
in both runs of a pair, so the ratio is what is compared here.

Typing, from the commands: Llama 3.1 70B on 256 GPUs (FSDP 32 × TP 8, local batch 16, full AC) and Llama
3.1 8B on 64 (FSDP 8 × TP 8, local batch 12, per-op selective AC), ``--training.compile``, at the
train_configs' seq_len 8,192, torchtitan's code (``--impl torchtitan``: 0.3.0's FSDP2 units, its compiled
loss), gradients reduced in fp32, AdamW by foreach, clipping at 1.0 (``heldout._titan``'s typing). Float8
tensorwise lays its blocks out with torchao's float8 TP plan (torchtitan's ``enable_float8_tensorwise_tp``:
``--fp8-tp``); rowwise has none (``--fp8 rowwise``, bf16 gathers). The 8B float8 tensorwise pair cannot be
typed: ``--fp8-tp`` with ``--compile`` is modelled under full AC only. Not a held-out row: the pairs are read
for their ratio, and their throughputs share the Teton rows' unmodelled power limit.
"""

from __future__ import annotations

import json
import shlex
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from typer.testing import CliRunner

if __name__ == "__main__":  # run as a script: the repository root on the path, for benchmarks.sections
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.sections import section_main
from memplan.cli.app import app

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "step-time.md"
START, END = "<!-- async-tp:start -->", "<!-- async-tp:end -->"

_70B = "-m llama-3.1-70b --seq 8192 --batch 16 --global-batch 512 --gpus 256 --tp 8 --sp --checkpointing full"
_8B = (
    "-m llama-3.1-8b --seq 8192 --batch 12 --global-batch 96 --gpus 64 --tp 8 --sp --checkpointing selective"
)
COMMON = (
    "--zero 3 --gpu h100-teton --reduce-dtype fp32 --clip-grad --compile --impl torchtitan --optimizer-impl "
    "foreach"
)


@dataclass(frozen=True)
class Pair:
    """One row of the benchmark: a configuration, vanilla and async TP's published tokens/s per GPU."""

    model: str
    quantization: str
    typed: str
    vanilla: float
    asynchronous: float


PAIRS: tuple[Pair, ...] = (
    Pair("Llama 3.1 70B", "bfloat16", _70B, 597.3, 652.4),
    Pair("Llama 3.1 70B", "float8 tensorwise", f"{_70B} --fp8 tensorwise --fp8-tp", 809.8, 942.4),
    Pair("Llama 3.1 70B", "float8 rowwise", f"{_70B} --fp8 rowwise", 599.6, 624.8),
    Pair("Llama 3.1 8B", "bfloat16", _8B, 4378, 4809.4),
    Pair("Llama 3.1 8B", "float8 rowwise", f"{_8B} --fp8 rowwise", 3708.5, 3914.9),
)
"""The benchmark's pairs but the 8B float8 tensorwise one (module docstring)."""

_runner = CliRunner()


def tokens_per_gpu(argv: str) -> float:
    """``memplan estimate <argv> --json``'s tokens/s per GPU."""
    res = _runner.invoke(app, ["estimate", *shlex.split(argv), "--json"])
    if res.exit_code != 0:
        raise RuntimeError(f"{argv}: {res.output.strip()}")
    t = json.loads(res.stdout)["time"]
    return float(t["tokens_per_s"]) / int(t["devices"])


def speedups(pair: Pair) -> tuple[float, float, float, float]:
    """memplan's vanilla and async tokens/s per GPU, the published speed-up and memplan's."""
    plain = tokens_per_gpu(f"{pair.typed} {COMMON}")
    fused = tokens_per_gpu(f"{pair.typed} {COMMON} --async-tp")
    return plain, fused, pair.asynchronous / pair.vanilla, fused / plain


HEADER = (
    "model",
    "quantization",
    "published vanilla → async tok/s/GPU",
    "published speed-up",
    "memplan vanilla → async",
    "memplan speed-up",
)


def markdown() -> str:
    """The table and a summary line, as docs/step-time.md holds them."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    errors = []
    for p in PAIRS:
        plain, fused, published, predicted = speedups(p)
        errors.append(predicted / published - 1)
        lines.append(
            f"| {p.model} | {p.quantization} | {p.vanilla:,.1f} → {p.asynchronous:,.1f} | {published:.3f}× | "
            f"{plain:,.0f} → {fused:,.0f} | {predicted:.3f}× |"
        )
    worst = max(errors, key=abs)
    summary = (
        f"{len(PAIRS)} pairs: memplan's speed-up / the published one − 1, median "
        f"{statistics.median(errors):+.1%}, worst {worst:+.1%}."
    )
    return "\n".join(lines) + "\n\n" + summary + "\n"


def main(argv: list[str] | None = None) -> int:
    return section_main(argv, (__doc__ or "").splitlines()[0], DOC, START, END, markdown)


if __name__ == "__main__":
    sys.exit(main())
