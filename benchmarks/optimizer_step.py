"""Measured seconds of one AdamW step by implementation on the GPU (issue #21: the optimizer step's time).

torch's AdamW runs as ``_single_tensor_adamw`` (``foreach=False``), ``_multi_tensor_adamw``
(``foreach=True``, torch's pick on CUDA) or ``_fused_adamw_`` (``fused=True``), and memplan's reference
optimizer (bf16-mixed: an fp32 master per parameter) one tensor at a time. Each steps the fp32 parameters
of a model preset's layers (its linear and norm weights, embedding and head; ``--layers`` of them, to stay
within the GPU's memory with the foreach path's temporaries) after two warm-up steps, timed between device
synchronisations (median of ``--repeat``). Written as JSON: seconds, parameters, and bytes/s against the
fused pass's traffic (read and write the parameter and both moments, read the gradient: 28 B per fp32
parameter).

    python benchmarks/optimizer_step.py --model llama-2-7b --layers 16 --out steps.json   # on a GPU
    python benchmarks/optimizer_step.py --model tiny --device cpu                          # a dry run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run as a script: the repository root on the path, for memplan
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from memplan.api import build_setup
from memplan.config import Optimizer, Precision
from memplan.measure.reference.optim import ReferenceOptimizer


def shapes(model: str, layers: int) -> list[tuple[int, ...]]:
    """The parameter shapes of ``layers`` layers of ``model`` (attention, MLP, two norms), its embedding
    and head."""
    m = build_setup(model).model
    h, d, a, kv, f = m.hidden_size, m.head_dim, m.num_heads, m.num_kv_heads, m.ffn_size
    layer = [(a * d, h), (kv * d, h), (kv * d, h), (h, a * d), (f, h), (f, h), (h, f), (h,), (h,)]
    return [(m.vocab_size, h), *(layer * layers), (h,), (m.vocab_size, h)]


def timed(step: Any, device: torch.device, repeat: int) -> float:
    for _ in range(2):
        step()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(model: str, layers: int, device: torch.device, repeat: int) -> list[dict[str, Any]]:
    rows = []
    sizes = shapes(model, layers)
    count = sum(torch.Size(s).numel() for s in sizes)
    kinds: list[tuple[str, dict[str, Any]]] = [
        ("for-loop", {"foreach": False}),
        ("foreach", {"foreach": True}),
        ("fused", {"fused": True}),
    ]
    for name, kw in kinds:
        params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in sizes]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = torch.optim.AdamW(params, lr=1e-4, **kw)
        seconds = timed(opt.step, device, repeat)
        rows.append({"implementation": name, "parameters": count, "seconds": seconds})
        del opt, params
        if device.type == "cuda":
            torch.cuda.empty_cache()
    # memplan's reference optimizer under bf16-mixed: bf16 parameters and gradients, an fp32 master each
    params = [torch.randn(s, device=device, dtype=torch.bfloat16) for s in sizes]
    for p in params:
        p.grad = torch.randn_like(p)
    ref = ReferenceOptimizer(params, Precision.BF16_MIXED, Optimizer.ADAMW)
    rows.append(
        {
            "implementation": "reference (bf16-mixed)",
            "parameters": count,
            "seconds": timed(ref.step, device, repeat),
        }
    )
    for r in rows:
        r["fused_pass_bytes_per_s"] = 28 * count / r["seconds"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-2-7b")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = measure(args.model, args.layers, torch.device(args.device), args.repeat)
    text = json.dumps(rows, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
