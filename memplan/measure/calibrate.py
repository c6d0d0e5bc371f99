"""``memplan calibrate``'s microbenchmarks on the user's device (torch; the only place they run).

Each is timed after two warm-up calls, between device synchronisations, best of the sweep:
- GEMMs: ``a @ b`` for a sweep of shapes [m, k]·[k, n] in the compute dtype: 2·m·k·n FLOPs per call;
- element-wise bandwidth: ``y.copy_(x)`` of a large tensor: 2·n·e bytes (read and written) per call;
- attention: ``F.scaled_dot_product_attention`` forward and backward (whichever kernel SDPA picks on the
  device), counted as memplan counts the flash kernel: 4·b·a·s²·d forward + 10·b·a·s²·d backward; and
  causal, forward and backward apart, by sequence length (``attention_by_length``);
- launch gap: a queue of in-place adds on a one-element tensor, seconds per kernel;
- the eager element-wise chains of memplan's reference layer (``chain_rates``: its RMSNorm, LayerNorm,
  rotary, SwiGLU, GELU and eager attention core, forward and backward), as bytes/s of the bytes
  ``time.elementwise`` counts for each: the step time's ``ELEMENTWISE_STREAM`` on this device.

On a CUDA device in bf16 at training sizes; on CPU in fp32 at small sizes (a few seconds, what the test
runs): a CPU's figures against a GPU preset's peak are not a GPU's, only the code path.

With ``--nproc N``: an all-reduce of fp32 values over N spawned local ranks (gloo on CPU, NCCL on CUDA),
its bus bandwidth 2(N − 1)/N · bytes / seconds as nccl-tests reports it.

Known limitations (NB): one node's link only (no inter-node collective); the GEMM sweep is a handful of
shapes, not cuBLAS's whole heuristic space; the attention figure is SDPA's default kernel on the device.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from memplan.measure.reference.model import apply_rope, layer_norm, rms_norm
from memplan.time import elementwise as ew

GEMMS_FULL = ((8192, 8192, 8192), (4096, 4096, 4096), (8192, 4096, 14336), (8192, 14336, 4096))
GEMMS_SMALL = ((256, 256, 256), (512, 512, 512))


@dataclass(frozen=True)
class Measured:
    """Achieved rates on the device."""

    matmul_flops: float
    """FLOP/s of the sweep's best GEMM."""
    copy_bytes: float
    """Bytes/s read and written by a device copy."""
    attention_flops: float
    """FLOP/s of SDPA forward + backward (memplan's flash count)."""
    launch_s: float
    """Seconds per tiny kernel in a queue."""
    device: str
    chains: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Per eager chain, bytes/s forward and backward (``chain_rates``)."""
    attention_curve: tuple[tuple[int, float, float], ...] = ()
    """(s, forward FLOP/s, backward FLOP/s) of SDPA's causal pick by length (``attention_by_length``)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds(fn: Callable[[], object], device: torch.device, repeat: int) -> float:
    """Mean seconds of ``fn`` over ``repeat`` calls after two warm-ups."""
    for _ in range(2):
        fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / repeat


def gemm_flops(
    device: torch.device, dtype: torch.dtype, shapes: tuple[tuple[int, int, int], ...], repeat: int
) -> float:
    best = 0.0
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        best = max(best, 2 * m * k * n / seconds(functools.partial(torch.matmul, a, b), device, repeat))
    return best


def copy_bandwidth(device: torch.device, dtype: torch.dtype, elements: int, repeat: int) -> float:
    x = torch.randn(elements, device=device, dtype=dtype)
    y = torch.empty_like(x)
    return 2 * elements * x.element_size() / seconds(lambda: y.copy_(x), device, repeat)


def attention_flops(
    device: torch.device, dtype: torch.dtype, shape: tuple[int, int, int, int], repeat: int
) -> float:
    b, a, s, d = shape
    q, k, v = (torch.randn(b, a, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, a, s, d, device=device, dtype=dtype)

    def step() -> None:
        F.scaled_dot_product_attention(q, k, v).backward(grad)

    return 14 * b * a * s * s * d / seconds(step, device, repeat)


def attention_by_length(
    device: torch.device, dtype: torch.dtype, small: bool, repeat: int
) -> tuple[tuple[int, float, float], ...]:
    """SDPA's causal pick on the device, forward and backward apart, at several lengths with b·s tokens
    fixed (16,384; small: 512), 32 heads of 128 (small: 4 of 32), FLOPs counted as the step time counts a
    causal flash kernel (``time.attention``: 4·b·a·s²·d forward, half of it run, backward 2.5×): the
    length curve ``time.attention`` uses in place of ``efficiency.FA2_HOPPER_BY_SEQUENCE``."""
    tokens, heads, d = (512, 4, 32) if small else (16384, 32, 128)
    lengths = (128, 256, 512) if small else (1024, 2048, 4096, 8192, 16384)
    rows = []
    for s in lengths:
        b = max(1, tokens // s)
        q, k, v = (
            torch.randn(b, heads, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3)
        )
        fwd = functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=True)
        forward = seconds(fwd, device, repeat)
        out = fwd()
        grad = torch.randn_like(out)
        backward = seconds(
            functools.partial(torch.autograd.grad, out, (q, k, v), grad, retain_graph=True), device, repeat
        )
        flops = 4 * b * heads * s * s * d // 2
        rows.append((s, flops / forward, 2.5 * flops / backward))
    return tuple(rows)


def launch_seconds(device: torch.device, kernels: int) -> float:
    x = torch.zeros(1, device=device)
    return seconds(lambda: [x.add_(1) for _ in range(kernels)], device, 1) / kernels


def chain_rates(
    device: torch.device, dtype: torch.dtype, small: bool, repeat: int
) -> dict[str, tuple[float, float]]:
    """Bytes/s of each eager element-wise chain, forward and backward (``autograd.grad`` of its output,
    the weights included), memplan's reference layer's own functions (measure/reference/model.py) on
    Llama 3 8B's shapes (16,384 tokens of 4,096, SwiGLU 14,336, 32 heads over 8 of 128; the eager core on
    [1, 32, 2,048, 2,048] scores), or small ones: ``time.elementwise``'s bytes for each over its seconds."""
    tokens, h, ffn, heads, kv, s = (256, 64, 256, 4, 2, 128) if small else (16384, 4096, 14336, 32, 8, 2048)
    d, b = h // heads, 2
    e = torch.tensor([], dtype=dtype).element_size()

    def rand(*shape: int, grad: bool = True) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=grad)

    x, w, bias = rand(tokens, h), rand(h), rand(h)
    gate, up = rand(tokens, ffn), rand(tokens, ffn)
    q, k = rand(b, tokens // b, heads * d), rand(b, tokens // b, kv * d)
    cos, sin = rand(tokens // b, d, grad=False), rand(tokens // b, d, grad=False)
    scores = rand(1, heads, s, s)
    mask = torch.ones(s, s, device=device, dtype=torch.bool).triu(1)

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, w, 1e-5, "rmsnorm")

    def rope(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def one(z: torch.Tensor) -> torch.Tensor:
            return apply_rope(z.view(b, tokens // b, -1, d).transpose(1, 2), cos, sin)

        return one(q), one(k)

    def core(scores: torch.Tensor) -> torch.Tensor:
        return torch.softmax((scores * d**-0.5).masked_fill(mask, float("-inf")), dim=-1)

    Chain = tuple[Callable[..., Any], tuple[torch.Tensor, ...], int, tuple[int, int]]
    chains: dict[str, Chain] = {  # name: (fn, inputs, elements, (forward, backward) bytes an element)
        "rmsnorm": (rms, (x, w), tokens * h, (ew.rmsnorm(e, False), ew.rmsnorm_backward(e))),
        "layernorm": (
            lambda x, w, bias: layer_norm(x, w, bias, 1e-5, "layernorm"),
            (x, w, bias),
            tokens * h,
            (2 * e, 4 * e),
        ),
        "rotary": (rope, (q, k), tokens * (heads + kv) * d, (10 * e, 17 * e)),
        "swiglu": (lambda g, u: F.silu(g) * u, (gate, up), tokens * ffn, (5 * e, 9 * e)),
        "gelu": (functools.partial(F.gelu, approximate="tanh"), (up,), tokens * ffn, (2 * e, 4 * e)),
        "eager_core": (core, (scores,), heads * s * s, (6 * e, 7 * e)),
    }
    rates: dict[str, tuple[float, float]] = {}
    for name, (fn, inputs, elements, (fwd, bwd)) in chains.items():
        forward = seconds(functools.partial(fn, *inputs), device, repeat)
        out = fn(*inputs)
        outs = out if isinstance(out, tuple) else (out,)
        grads = tuple(torch.randn_like(o) for o in outs)
        backward = seconds(
            functools.partial(torch.autograd.grad, outs, inputs, grads, retain_graph=True), device, repeat
        )
        rates[name] = (fwd * elements / forward, bwd * elements / backward)
    return rates


def measure(small: bool | None = None) -> Measured:
    """Every microbenchmark on the default device (CUDA when present); ``small``: CPU-sized (default on
    CPU)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    small = device.type == "cpu" if small is None else small
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    repeat = 3 if small else 20
    return Measured(
        matmul_flops=gemm_flops(device, dtype, GEMMS_SMALL if small else GEMMS_FULL, repeat),
        copy_bytes=copy_bandwidth(device, dtype, 1 << (20 if small else 28), repeat),
        attention_flops=attention_flops(
            device, dtype, (1, 4, 256, 64) if small else (4, 32, 4096, 128), repeat
        ),
        launch_s=launch_seconds(device, 100 if small else 2000),
        device=name,
        chains=chain_rates(device, dtype, small, repeat),
        attention_curve=attention_by_length(device, dtype, small, repeat),
    )


# ----------------------------------------------------------------------------------------------------
# Collectives (--nproc): an all-reduce ring over the node's ranks
# ----------------------------------------------------------------------------------------------------
def _all_reduce_rank(rank: int, world: int, port: int, elements: int, repeat: int, out: str) -> None:
    """One spawned rank: time ``repeat`` all-reduces of ``elements`` fp32 values; rank 0 writes the
    seconds per call."""
    import json
    import os
    from datetime import timedelta
    from pathlib import Path

    import torch.distributed as dist

    from memplan.measure.distributed.launch.spawn import LOOPBACK, local_interfaces, local_store

    cuda = torch.cuda.is_available()
    os.environ.update(MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    local_interfaces()
    torch.set_num_threads(1)
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(  # the rendezvous on the loopback interface only, as profile --nproc's
        "nccl" if cuda else "gloo",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
        store=local_store(port, rank, world),
    )
    try:
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        x = torch.ones(elements, device=device)
        for _ in range(2):
            dist.all_reduce(x)
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(repeat):
            dist.all_reduce(x)
        _sync(device)
        took = (time.perf_counter() - start) / repeat
        if rank == 0:
            Path(out, "all_reduce.json").write_text(json.dumps({"seconds": took}), encoding="utf-8")
    finally:
        dist.destroy_process_group()


def all_reduce_busbw(nproc: int, small: bool | None = None) -> float:
    """Bus bandwidth (bytes/s) of an all-reduce over ``nproc`` local ranks, as nccl-tests reports it:
    2(n − 1)/n · bytes / seconds (gloo on CPU, NCCL on CUDA)."""
    import json
    import tempfile
    from pathlib import Path

    from memplan.measure.distributed.launch.spawn import free_port, spawn_ranks

    small = not torch.cuda.is_available() if small is None else small
    elements = 1 << (18 if small else 26)  # fp32: 1 MiB on CPU, 256 MiB on a GPU
    with tempfile.TemporaryDirectory(prefix="memplan-calibrate-") as out:
        # every rank stopped on any fault or signal, as profile --nproc's (spawn.spawn_ranks)
        args = (nproc, free_port(), elements, 3 if small else 20, out)
        spawn_ranks(_all_reduce_rank, args, nproc, 300, out)
        seconds = float(json.loads(Path(out, "all_reduce.json").read_text(encoding="utf-8"))["seconds"])
    return 2 * (nproc - 1) / nproc * elements * 4 / seconds
