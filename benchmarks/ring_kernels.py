"""torch's ring attention as one context-parallel rank runs it, timed alone on a GPU (issue #21 item 3).

    python benchmarks/ring_kernels.py --out rows.jsonl         # on the GPU machine
    python benchmarks/ring_kernels.py --report rows.jsonl      # here: measured against memplan's model

``ring`` rows: torch's own ``_scaled_dot_product_ring_flash_attention`` and its backward (the functions
``context_parallel`` dispatches SDPA to; ``_templated_ring_attention``: the load-balanced causal split, one
flash call per ring step, the fp32 merge of each step's output and logsumexp, the backward's fp32 dQ/dK/dV
accumulators) for one rank of cp, in a process whose default group is torch's fake process group: its
collectives return at once, so the rank's compute is timed without its communication (the K/V a step
receives are the fake all-gather's unwritten buffer: the kernels' work does not depend on the values).
The shapes are torchtitan's Table 2 (docs/step-time.md's held-out CP rows): Llama 3.1 8B, 32 heads of 128,
32,768 tokens on every rank (s = 32,768 · cp), b 1; K/V with 32 heads (the runs' December-2024 model
repeated K/V to the query heads before SDPA, ``repeat_kv``) and with 8 (torchtitan 0.3.0's grouped
call). ``block`` rows time the flash kernel alone on each step's shape (the causal local block; half the
queries against all keys; all queries against half the keys), so ring − Σ blocks is the ring's own work.

``longkv`` rows: the flash kernel, not causal, with a short query block against long keys (Llama 3's
all-gather context parallelism: a rank's query chunk against the gathered K/V in one call), 16 heads of
128 (a tensor-parallel rank of 405B), b 1; ``smallgrid`` rows: the same on grids below 512 query tiles.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import hopper_kernels  # noqa: E402  (the timer, the device)

RING_CPS = (1, 2, 4, 8)
RING_LOCAL = 32768
"""Tokens on each rank in torchtitan's Table 2 (s = 32,768 · cp)."""
LONGKV = ((4096, (4096, 16384, 65536, 131072)), (8192, (8192, 32768, 131072)))
"""(query tokens, key lengths) of the ``longkv`` rows."""


class _World:
    """What the ring functions read of a DeviceMesh: ``get_group()``, here the default (fake) group."""

    def get_group(self) -> Any:
        import torch.distributed as dist

        return dist.group.WORLD


def _ring_module() -> Any:
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention
    except ImportError:  # torch before the package split
        from torch.distributed.tensor.experimental import _attention  # type: ignore[no-redef]
    return _attention


def _ring_calls(ring: Any, q: Any, k: Any, v: Any, cuda: bool) -> tuple[Any, Any]:
    """(forward, backward) callables of one rank's ring attention on q, k, v (causal)."""
    import torch

    aten = torch.ops.aten
    if cuda:
        fwd = functools.partial(
            ring._scaled_dot_product_ring_flash_attention, _World(), q, k, v, is_causal=True
        )
        out, lse, cq, ck, mq, mk, seed, offset, _ = fwd()
        dout = torch.randn_like(out)
        bwd = functools.partial(
            ring._scaled_dot_product_ring_flash_attention_backward,
            _World(), dout, q, k, v, out, lse, cq, ck, mq, mk, 0.0, True, seed, offset,
        )  # fmt: skip
        return fwd, bwd
    # CPU (a smoke run): the same templated ring with the CPU flash kernel and its backward
    group = _World().get_group()
    fwd = functools.partial(
        ring._templated_ring_attention, group, 2, aten._scaled_dot_product_flash_attention_for_cpu, q, k, v,
        is_causal=True,
    )  # fmt: skip
    out, lse = fwd()[:2]
    bwd = functools.partial(
        ring._templated_ring_attention_backward, group, 2,
        aten._scaled_dot_product_flash_attention_for_cpu_backward,
        grad_out=torch.randn_like(out), grad_out_name="grad_out", query=q, key=k, value=v, out=out,
        logsumexp=lse, is_causal=True, dropout_p=0.0,
    )  # fmt: skip
    return fwd, bwd


def ring_rows(reps: int) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    cuda = hopper_kernels.DEV == "cuda"
    local, heads, d = (RING_LOCAL, 32, 128) if cuda else (256, 4, 16)
    ring = _ring_module()
    rows: list[dict[str, Any]] = []
    layouts = (heads, heads // 4) if cuda else (heads // 4,)  # a CPU smoke run: the grouped K/V only
    for kv in layouts:
        for cp in RING_CPS if cuda else (2, 8):
            for rank in sorted({0, cp - 1}):
                row: dict[str, Any] = dict(
                    kind="ring", cp=cp, rank=rank, s_local=local, heads=heads, kv_heads=kv, d=d
                )
                dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=cp)
                try:
                    q = torch.randn(1, heads, local, d, device=hopper_kernels.DEV, dtype=torch.bfloat16)
                    k, v = (
                        torch.randn(1, kv, local, d, device=hopper_kernels.DEV, dtype=torch.bfloat16)
                        for _ in "kv"
                    )
                    fwd, bwd = _ring_calls(ring, q, k, v, cuda)
                    n = reps if cp <= 2 else 3
                    row["fwd_s"] = hopper_kernels._timer(fwd, n)
                    row["bwd_s"] = hopper_kernels._timer(bwd, n)
                except Exception as e:  # a kernel that refuses the shape (GQA): say so, go on
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                finally:
                    dist.destroy_process_group()
                rows.append(row)
                print(json.dumps(row), flush=True)
                if cuda:
                    torch.cuda.empty_cache()
    return rows


def _flash_rows(shapes: list[tuple[str, int, int, int, bool]], reps: int) -> list[dict[str, Any]]:
    """The SDPA flash kernel alone: (kind, heads, q tokens, k tokens, causal), b 1, heads of 128."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cuda = hopper_kernels.DEV == "cuda"
    rows: list[dict[str, Any]] = []
    for kind, heads, sq, sk, causal in shapes:
        d = 128 if cuda else 16
        q = torch.randn(1, heads, sq, d, device=hopper_kernels.DEV, dtype=torch.bfloat16, requires_grad=True)
        k, v = (
            torch.randn(1, heads, sk, d, device=hopper_kernels.DEV, dtype=torch.bfloat16, requires_grad=True)
            for _ in "kv"
        )
        cells = sq * sk // (2 if causal else 1)
        row: dict[str, Any] = dict(
            kind=kind, heads=heads, sq=sq, sk=sk, d=d, causal=causal, fwd_flops=4 * heads * d * cells
        )
        row["bwd_flops"] = int(2.5 * row["fwd_flops"])
        backends = [SDPBackend.FLASH_ATTENTION] if cuda else [SDPBackend.MATH]
        with sdpa_kernel(backends):
            fwd = functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=causal)
            row["fwd_s"] = hopper_kernels._timer(fwd, reps)
            out = fwd()
            bwd = functools.partial(
                torch.autograd.grad, out, (q, k, v), torch.randn_like(out), retain_graph=True
            )
            row["bwd_s"] = hopper_kernels._timer(bwd, reps)
        del q, k, v, out
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def block_rows(reps: int) -> list[dict[str, Any]]:
    """The ring's step shapes alone: the causal local block, half the queries against all keys, all the
    queries against half the keys (32 heads)."""
    s = RING_LOCAL if hopper_kernels.DEV == "cuda" else 256
    return _flash_rows(
        [("block", 32, s, s, True), ("block", 32, s // 2, s, False), ("block", 32, s, s // 2, False)], reps
    )


def longkv_rows(reps: int) -> list[dict[str, Any]]:
    cuda = hopper_kernels.DEV == "cuda"
    shapes = [("longkv", 16, sq, sq, True) for sq, _ in LONGKV]
    shapes += [("longkv", 16, sq, sk, False) for sq, keys in LONGKV for sk in keys]
    if not cuda:
        shapes = [(k, 2, sq // 64, sk // 64, c) for k, _, sq, sk, c in shapes[:3]]
    return _flash_rows(shapes, reps)


SMALL_GRID = ((8, 16, 32, 64), (256, 512, 1024, 2048), (8192, 65536))
"""(heads, query tokens, key tokens) of the ``smallgrid`` rows: non-causal calls on 16 to 1,024 query
tiles (a ``kv-gather`` chunk of a few hundred tokens on a tensor-parallel rank's heads)."""


def smallgrid_rows(reps: int) -> list[dict[str, Any]]:
    """The flash kernel, not causal, b 1, heads of 128, on grids of heads · sq/128 query tiles below the
    ``longkv`` rows' 512."""
    heads, queries, keys = SMALL_GRID
    shapes = [
        ("smallgrid", a, sq, sk, False) for a in heads for sq in queries for sk in keys if a * sq // 128 < 512
    ]
    if hopper_kernels.DEV != "cuda":
        shapes = [(k, 2, sq // 64, sk // 256, c) for k, _, sq, sk, c in shapes[:2]]
    return _flash_rows(shapes, reps)


def gather_rows(reps: int) -> list[dict[str, Any]]:
    """``--cp-rotate kv-gather``'s attention kernels on one rank (as Transformer Engine's
    ``AttnFuncWithCPAndKVAllGather`` calls them, with torch's flash kernel): its two local chunks of s/2c
    queries (chunks r and 2c − 1 − r), each against its gathered key prefix with the causal mask aligned
    to the bottom right (SDPA's ``causal_lower_right``), forward and backward of both, the kernels alone;
    torchtitan Table 2's shapes (32 heads of 128, 32,768 tokens a rank)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    cuda = hopper_kernels.DEV == "cuda"
    local, heads, d = (RING_LOCAL, 32, 128) if cuda else (64, 2, 16)
    backends = [SDPBackend.FLASH_ATTENTION] if cuda else [SDPBackend.MATH]
    rows: list[dict[str, Any]] = []
    for cp in RING_CPS[1:]:
        half = local // 2
        for rank in sorted({0, cp - 1}):
            row: dict[str, Any] = dict(kind="gather", cp=cp, rank=rank, s_local=local, heads=heads, d=d)
            calls = []
            for chunk in (rank, 2 * cp - 1 - rank):
                keys = (chunk + 1) * half
                q, k, v = (
                    torch.randn(
                        1, heads, n, d, device=hopper_kernels.DEV, dtype=torch.bfloat16, requires_grad=True
                    )
                    for n in (half, keys, keys)
                )
                calls.append((q, k, v, causal_lower_right(half, keys)))
            with sdpa_kernel(backends):

                def forward(calls: list[Any] = calls) -> list[Any]:
                    return [F.scaled_dot_product_attention(q, k, v, attn_mask=m) for q, k, v, m in calls]

                row["fwd_s"] = hopper_kernels._timer(forward, reps)
                outs = forward()
                grads = [torch.randn_like(o) for o in outs]
                inputs = [t for q, k, v, _ in calls for t in (q, k, v)]

                def backward(
                    outs: list[Any] = outs, grads: list[Any] = grads, inputs: list[Any] = inputs
                ) -> Any:
                    return torch.autograd.grad(outs, inputs, grads, retain_graph=True)

                row["bwd_s"] = hopper_kernels._timer(backward, reps)
            rows.append(row)
            print(json.dumps(row), flush=True)
            del calls, outs, grads, inputs
            if cuda:
                torch.cuda.empty_cache()
    return rows


MEMORY_CPS = (1, 2, 4, 8)
"""The ``memory`` rows' cp (1: the flash op alone, no ring)."""


def _op_memory(device: str) -> Any:
    """A dispatch mode that keeps, after every op, its name and the bytes live on ``device``: on CUDA the
    caching allocator's ``memory_allocated`` (its ``max_memory_allocated`` also sees a kernel's workspace
    freed inside the op), on CPU memplan's live-storage tracker (op outputs only)."""
    import torch

    from memplan.measure.instruments.tracker import OpLiveTracker

    return OpLiveTracker(torch.cuda.memory_allocated if device == "cuda" else None)


def _phase_memory(fn: Any, cuda: bool) -> tuple[Any, dict[str, Any]]:
    """Run ``fn`` under ``_op_memory``: its result and, relative to the bytes live before it, the highest
    bytes after any op, the allocator's own peak (CUDA), the bytes left after it, and every op's row."""
    import torch

    base = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    mode = _op_memory("cuda" if cuda else "cpu")
    with mode:
        out = fn()
    if cuda:
        torch.cuda.synchronize()
    rows = [(name, live - base) for name, live in mode.rows]
    stats = {
        "peak_ops": max((r[1] for r in rows), default=0),
        "peak_allocator": torch.cuda.max_memory_allocated() - base if cuda else None,
        "left": (torch.cuda.memory_allocated() - base) if cuda else mode.current,
        "ops": rows,
    }
    return out, stats


def _flash_op_memory(q: Any, k: Any, v: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``_phase_memory`` of the CUDA flash op and of its backward on q, k, v (causal, no dropout)."""
    import torch

    aten = torch.ops.aten
    res, forward = _phase_memory(lambda: aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True), True)
    out, lse, cq, ck, mq, mk, seed, offset = res[:8]
    dout = torch.randn_like(out)
    args = (dout, q, k, v, out, lse, cq, ck, mq, mk, 0.0, True, seed, offset)
    _, backward = _phase_memory(lambda: aten._scaled_dot_product_flash_attention_backward(*args), True)
    return forward, backward


def memory_rows(reps: int) -> list[dict[str, Any]]:
    """The bytes one rank's ring attention makes beyond its inputs, forward and backward, op by op (the
    transients ``analytic.peak`` must place: the gathered K/V, the fp32 merge, the backward's fp32
    accumulators and rotations), rank 0 and rank cp − 1, torchtitan Table 2's shapes with 8 K/V heads;
    cp 1 is the flash op and its backward alone (the kernel's own workspace)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    cuda = hopper_kernels.DEV == "cuda"
    local, heads, kv, d = (RING_LOCAL, 32, 8, 128) if cuda else (256, 4, 2, 16)
    ring = _ring_module()
    rows: list[dict[str, Any]] = []
    for cp in MEMORY_CPS:
        for rank in sorted({0, cp - 1}):
            row: dict[str, Any] = dict(
                kind="memory", cp=cp, rank=rank, s_local=local, heads=heads, kv_heads=kv, d=d
            )
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=max(cp, 2))
            try:
                q = torch.randn(1, heads, local, d, device=hopper_kernels.DEV, dtype=torch.bfloat16)
                k, v = (
                    torch.randn(1, kv, local, d, device=hopper_kernels.DEV, dtype=torch.bfloat16)
                    for _ in "kv"
                )
                if cp == 1 and cuda:
                    row["forward"], row["backward"] = _flash_op_memory(q, k, v)
                elif cp > 1:
                    fwd, bwd = _ring_calls(ring, q, k, v, cuda)  # one warm-up call of the forward inside
                    res, row["forward"] = _phase_memory(fwd, cuda)
                    del res
                    _, row["backward"] = _phase_memory(bwd, cuda)
                else:
                    continue
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            finally:
                dist.destroy_process_group()
            rows.append(row)
            brief = {key: val for key, val in row.items() if key not in ("forward", "backward")}
            print(json.dumps(brief), flush=True)
            if cuda:
                torch.cuda.empty_cache()
    return rows


def measure(args: argparse.Namespace) -> int:
    hopper_kernels.DEV = args.device
    reps = args.reps
    makers = {
        "block": lambda: block_rows(reps),
        "ring": lambda: ring_rows(reps),
        "longkv": lambda: longkv_rows(reps),
        "smallgrid": lambda: smallgrid_rows(reps),
        "gather": lambda: gather_rows(reps),
        "memory": lambda: memory_rows(reps),
    }
    return hopper_kernels.write_parts(Path(args.out), args.parts, makers)


def main(argv: list[str] | None = None) -> int:
    return hopper_kernels.command_line(argv, __doc__, "block,ring,longkv,smallgrid,gather", measure, report)


def attention_per_layer(cp: int, gpu_name: str, rotate: str = "allgather") -> float:
    """``memplan estimate``'s attention seconds over the layers (forward and backward, no checkpointing)
    for a rank of the rows' setup: Llama 3.1 8B, --impl torchtitan, RING_LOCAL tokens a rank, b 1."""
    from typer.testing import CliRunner

    from memplan.cli.app import app

    argv = f"estimate -m llama-3.1-8b --seq {RING_LOCAL * cp} --batch 1 --gpus {cp} --impl torchtitan"
    argv += f" --gpu {gpu_name} --checkpointing none --json"
    argv += f" --cp {cp} --cp-rotate {rotate}" if cp > 1 else ""
    predicted = json.loads(CliRunner().invoke(app, argv.split()).stdout)["time"]["predicted"]
    return float(predicted["attention_s"]) / int(predicted["stage_layers"])


def model_layer_seconds(cp: int, kv_heads: int, gpu_name: str) -> float:
    """memplan's seconds for one layer's ring attention, forward and backward, on a rank of the ``ring``
    rows' setup: ``memplan estimate``'s ``attention_s`` over the layers (without checkpointing) plus the
    ring's own element-wise bytes (``context_parallel.ring_bytes``, K/V with ``kv_heads``) at ``MEMORY`` ×
    the preset's HBM."""
    from memplan.api import build_setup
    from memplan.config import Parallel
    from memplan.presets import load_gpu
    from memplan.strategies.context_parallel import ring_bytes
    from memplan.time.compute import hbm_bytes_per_s

    setup = build_setup("llama-3.1-8b", seq=RING_LOCAL * cp, parallel=Parallel(cp=cp))
    setup = setup.model_copy(update={"model": setup.model.model_copy(update={"num_kv_heads": kv_heads})})
    ring = sum(ring_bytes(setup)) / hbm_bytes_per_s(load_gpu(gpu_name))
    return attention_per_layer(cp, gpu_name) + ring


def gather_table(rows: list[dict[str, Any]], gpu_name: str) -> list[str]:
    """Per cp: ``kv-gather``'s two chunk calls on a rank (both ranks' mean) against memplan's attention for
    ``--cp-rotate kv-gather`` (``estimate``'s ``attention_s`` over the layers, forward + backward, ms)."""
    out = [
        "| cp | forward ms | backward ms | memplan ms | measured / memplan |",
        "|---:|---:|---:|---:|---:|",
    ]
    for cp in sorted({r["cp"] for r in rows if r["kind"] == "gather"}):
        rs = [r for r in rows if r["kind"] == "gather" and r["cp"] == cp]
        fwd, bwd = (sum(r[w] for r in rs) / len(rs) for w in ("fwd_s", "bwd_s"))
        model = attention_per_layer(cp, gpu_name, "kv-gather")
        cells = (
            cp,
            f"{fwd * 1e3:.1f}",
            f"{bwd * 1e3:.1f}",
            f"{model * 1e3:.1f}",
            f"{(fwd + bwd) / model:.3f}",
        )
        out.append("| " + " | ".join(map(str, cells)) + " |")
    return out


def ring_table(rows: list[dict[str, Any]], gpu_name: str) -> list[str]:
    """Per cp and K/V heads: the ring (both ranks' mean) against Σ of its steps' kernels alone and against
    memplan's model (``model_layer_seconds``: forward + backward of one layer, ms)."""
    blocks = [r for r in rows if r["kind"] == "block"]
    causal = next(r for r in blocks if r["causal"])
    halves = [r for r in blocks if not r["causal"]]
    half = {w: sum(r[w] for r in halves) / len(halves) for w in ("fwd_s", "bwd_s")}
    out = [
        "| cp | K/V heads | ring forward ms | ring backward ms | Σ kernels alone ms | ring / Σ | memplan ms "
        "| measured / memplan |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    cps = sorted({r["cp"] for r in rows if r["kind"] == "ring"})
    for kv in sorted({r["kv_heads"] for r in rows if r["kind"] == "ring"}, reverse=True):
        for cp in cps:
            m = model_layer_seconds(cp, kv, gpu_name)
            rs = [
                r
                for r in rows
                if r["kind"] == "ring" and r["cp"] == cp and r["kv_heads"] == kv and "fwd_s" in r
            ]
            if not rs:
                continue
            fwd, bwd = (sum(r[w] for r in rs) / len(rs) for w in ("fwd_s", "bwd_s"))
            alone = sum(causal[w] + (cp - 1) * half[w] for w in ("fwd_s", "bwd_s"))
            cells = (
                cp,
                kv,
                f"{fwd * 1e3:.1f}",
                f"{bwd * 1e3:.1f}",
                f"{alone * 1e3:.1f}",
                f"{(fwd + bwd) / alone:.3f}",
            )
            out.append("| " + " | ".join(map(str, cells)) + f" | {m * 1e3:.1f} | {(fwd + bwd) / m:.3f} |")
    return out


def report(path: Path, gpu_name: str) -> int:
    """The ``ring`` rows against their kernels alone and memplan's model; every flash row's fraction of
    the preset's bf16 peak (Markdown)."""
    from memplan.presets import load_gpu

    peak = load_gpu(gpu_name).peak_tflops.bf16 * 1e12
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    env = rows[0]
    print(f"{env['device']}, torch {env['torch']}, CUDA {env['cuda']}\n")
    if any(r["kind"] == "ring" for r in rows):
        print("\n".join(ring_table(rows, gpu_name)) + "\n")
    if any(r["kind"] == "gather" for r in rows):
        print("\n".join(gather_table(rows, gpu_name)) + "\n")
    print("| kind | heads | q × k tokens | causal | forward of peak | backward of peak |")
    print("|---|---:|---|---|---:|---:|")
    for r in (r for r in rows if r["kind"] in ("block", "longkv", "smallgrid")):
        f, b = r["fwd_flops"] / r["fwd_s"] / peak, r["bwd_flops"] / r["bwd_s"] / peak
        print(
            f"| {r['kind']} | {r['heads']} | {r['sq']:,} × {r['sk']:,} | {r['causal']} | {f:.3f} | {b:.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
