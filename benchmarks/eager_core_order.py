"""The reference's eager attention core under selective checkpointing, op by op: the bytes live after each
aten op of its forward and backward, on CPU (memplan's live-storage tracker) and on CUDA (the caching
allocator's ``memory_allocated``), side by side.

Why: on the H200 (docs/gpu-profile.md) Llama-2-7B's selective/eager step at s 3,072 peaked one
[32, s, s] bf16 tensor above the estimate — and above the same layers' CPU run — inside the core's
backward. This runs the core alone (``reference.model.Model.attention_core``'s ops, checkpointed as
``selective`` does: ``torch.utils.checkpoint``, non-reentrant) and prints, for every op, what it made and
the live bytes after it, so the op at which the two devices part is named.

    python benchmarks/eager_core_order.py [--device cuda] [--seq 3072] [--heads 32] [--json FILE]
    python benchmarks/eager_core_order.py --model llama-2-7b --layers 2 [--device cuda] [--seq 3072]

With ``--model`` it runs the reference model itself (``measure.runs.profile.StepRunner``, the model's first
``--layers`` layers, selective checkpointing, eager attention): one warm-up step, then one step with no
dispatch mode active (as ``profile`` measures on CUDA) whose allocator history (CUDA) lists every
allocation and free of an [a, s, s] block with the op that made or freed it, and one step under the op
recorder (as ``profile`` measures on CPU), the [a, s, s] storages alive after each op.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from memplan.measure.instruments.tracker import OpLiveTracker


def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``Model.attention_core``'s eager branch (no GQA, no dropout): scores, scale, causal fill, softmax,
    the product with V, the [b, s, a·d] copy."""
    b, a, s, d = q.shape
    scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(d))
    probs = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
    ctx = torch.matmul(probs, v)
    return ctx.transpose(1, 2).contiguous().view(b, s, a * d)


def run(device: str, seq: int, heads: int, dim: int, wrap: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    shape = (1, heads, seq, dim)
    q, k, v = (torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    mask = torch.ones(seq, seq, device=device, dtype=torch.bool).triu(1)
    grad = torch.randn(1, seq, heads * dim, device=device, dtype=torch.bfloat16)
    mode = OpLiveTracker(torch.cuda.memory_allocated if device.startswith("cuda") else None)
    base = torch.cuda.memory_allocated() if device.startswith("cuda") else 0
    with mode:
        out = checkpoint(core, q, k, v, mask, use_reentrant=False) if wrap else core(q, k, v, mask)
        forward_ops = len(mode.rows)
        out.backward(grad)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    unit = heads * seq * seq * 2  # one [a, s, s] bf16 tensor
    rows = [(name, (live - base) / unit) for name, live in mode.rows]
    peak = max(r[1] for r in rows)
    return dict(device=device, checkpoint=wrap, forward_ops=forward_ops, rows=rows, peak_units=peak)


def _frames(entry: dict[str, Any]) -> str:
    """The innermost autograd node or aten op, and the innermost Python line, of a history entry."""
    names = [f.get("name", "") for f in entry.get("frames", [])]
    node = next((n for n in names if "Backward" in n or "autograd::" in n), "")
    op = next((n for n in names if n.startswith("at::") or "aten" in n), "")
    lines = [f for f in entry.get("frames", []) if f["filename"].endswith(".py")]
    py = f"{lines[0]['filename'].rsplit('/', 1)[-1]}:{lines[0]['line']}" if lines else ""
    return f"{node[:60]} | {op[:60]} | {py}"


class Live(TorchDispatchMode):
    """After every op: how many storages of exactly ``nbytes`` are alive (weak references to op outputs)."""

    def __init__(self, nbytes: int) -> None:
        super().__init__()
        self.nbytes = nbytes
        self.alive: dict[int, Any] = {}
        self.rows: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        import weakref

        from torch.utils._pytree import tree_leaves

        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() == self.nbytes:
                st = t.untyped_storage()
                key = st._cdata
                if key not in self.alive:
                    self.alive[key] = True
                    weakref.finalize(st, self.alive.pop, key, None)
        self.rows.append((str(func), len(self.alive)))
        return out


def model_run(device: str, model: str, layers: int, seq: int) -> None:
    from memplan.api import build_setup
    from memplan.config import AttentionChoice, Device
    from memplan.measure.runs.profile import StepRunner

    setup = build_setup(
        model, seq=seq, checkpointing="selective", attention=AttentionChoice.EAGER,
        device=Device.CUDA if device.startswith("cuda") else Device.CPU,
    )  # fmt: skip
    setup = setup.model_copy(update={"model": setup.model.model_copy(update={"num_layers": layers})})
    m = setup.model
    unit = m.num_heads * seq * seq * 2
    runner = StepRunner(setup, device)
    runner.step(lambda _: None, {})
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=200_000)
        runner.step(lambda _: None, {})
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        peak = (torch.cuda.max_memory_allocated() - base) / unit
        print(f"== no mode: peak {peak:.3f} [a, s, s] above the step's start")
        live = 0
        for e in snap["device_traces"][0]:
            if e.get("size") != unit or e["action"] not in ("alloc", "free_requested"):
                continue
            live += 1 if e["action"] == "alloc" else -1
            print(f"  {e['action']:15s} {e['addr']:#x} live {live}  {_frames(e)}")
    mode = Live(unit)
    with mode:
        runner.step(lambda _: None, {})
    print("== under a dispatch mode: [a, s, s] storages alive after each op of the core's backward (±8 ops)")
    rows = mode.rows
    marks = [i for i, (name, _) in enumerate(rows) if "_softmax_backward_data" in name]
    for i in marks:
        for name, n in rows[max(0, i - 8) : i + 8]:
            print(f"  {n}  {name}")
        print("  --")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--seq", type=int, default=3072)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--json", default=None, help="write every run's rows here")
    p.add_argument("--model", default=None, help="run the reference model (a preset), not the core alone")
    p.add_argument("--layers", type=int, default=2, help="with --model: its first N layers")
    a = p.parse_args()
    if a.model:
        model_run(a.device, a.model, a.layers, a.seq)
        return
    runs = [run(a.device, a.seq, a.heads, a.dim, wrap) for wrap in (False, True)]
    for r in runs:
        print(f"== {r['device']} checkpoint={r['checkpoint']} peak {r['peak_units']:.3f} [a, s, s] tensors")
        for i, (name, units) in enumerate(r["rows"]):
            phase = "F" if i < r["forward_ops"] else "B"
            print(f"  {phase} {i:3d} {units:7.3f}  {name}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(runs, f)


if __name__ == "__main__":
    main()
