"""Estimated vs measured peak memory of real CPU training steps, over a strategy grid.

Runs ``memplan.measure.runs.profile`` (every storage alive, exact) beside ``memplan.estimate`` for two small
architectures (Llama-style and GPT-style) × attention × checkpointing × reversible × precision, with a small
vocabulary (so a layer's backward, the approximated moment, is often the peak) and a large one (so the
loss backward, an exact moment, is). Prints a markdown table; ``--write`` puts it in docs/peak-accuracy.md.

    python benchmarks/bench_peak_accuracy.py [--write]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

from memplan.config import (
    Attention,
    Device,
    ModelConfig,
    Setup,
    StrategyConfig,
    TrainingConfig,
    parse_checkpointing,
)
from memplan.engine import estimate
from memplan.measure.runs.profile import profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # run as a script: benchmarks/
from layouts import PEAK_GPT, PEAK_LLAMA

LLAMA, GPT = PEAK_LLAMA, PEAK_GPT  # tests/measure/test_peak.py's two models
DOC = Path(__file__).resolve().parent.parent / "docs" / "peak-accuracy.md"


def setups() -> list[tuple[str, Setup]]:
    out = []
    for arch_name, arch in (("llama", LLAMA), ("gpt", GPT)):
        for vocab in (32, 4096):
            for attention in ("flash", "eager"):
                for ckpt in ("none", "selective", "full", "every-2", "reversible"):
                    for precision in ("bf16-mixed", "fp32"):
                        mode, k = parse_checkpointing("none" if ckpt == "reversible" else ckpt)
                        model = ModelConfig(
                            **arch,
                            vocab_size=vocab,
                            max_positions=512,
                            attn_dropout=0.1 if arch is GPT and attention == "eager" else 0.0,
                        )
                        setup = Setup(
                            model=model,
                            training=TrainingConfig(micro_batch=4, seq_len=128, precision=precision),
                            strategy=StrategyConfig(
                                attention=Attention[attention.upper()],
                                checkpointing=mode,
                                checkpoint_every=k,
                                reversible=ckpt == "reversible",
                            ),
                            device=Device.CPU,
                        )
                        out.append((f"{arch_name} v{vocab} {attention} {ckpt} {precision}", setup))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write the table to {DOC}")
    parser.add_argument("--json", action="store_true", help="print one JSON object (for run_all.py)")
    args = parser.parse_args()
    rows = ["| setup | estimated peak moment | estimated (B) | measured (B) | measured / estimated − 1 |"]
    rows.append("|---|---|---:|---:|---:|")
    errors: dict[str, list[float]] = {}
    for name, setup in setups():
        est = estimate(setup)
        meas = profile(setup, steps=1).peak
        error = meas / est.peak.bytes - 1
        errors.setdefault(est.peak.phase, []).append(error)
        rows.append(f"| {name} | {est.peak.phase} | {est.peak.bytes:,} | {meas:,} | {error:+.2%} |")
        if not args.json:
            print(rows[-1], flush=True)
    summary = [
        f"- **{phase}** is the peak in {len(e)} setups: error {min(e):+.2%} … {max(e):+.2%}"
        f" (median {statistics.median(e):+.2%})"
        for phase, e in sorted(errors.items())
    ]
    text = "\n".join(
        [
            "# Peak memory: estimate vs measurement on CPU",
            "",
            "`python benchmarks/bench_peak_accuracy.py --write`: real training steps of the reference model "
            "(memplan/measure), every storage alive tracked exactly (`LiveMemoryTracker`), against "
            "`memplan estimate --device cpu`. b = 4, s = 128, h = 64, 3 layers; machine: "
            f"{platform.machine()}, Python {platform.python_version()}.",
            "",
            *summary,
            "",
            *rows,
            "",
        ]
    )
    if args.json:
        stats = {
            phase: {"setups": len(e), "min": min(e), "max": max(e), "median": statistics.median(e)}
            for phase, e in sorted(errors.items())
        }
        print(json.dumps({"measured_over_estimated_minus_1": stats}))
    else:
        print("\n".join(summary))
    if args.write:
        DOC.write_text(text)


if __name__ == "__main__":
    main()
