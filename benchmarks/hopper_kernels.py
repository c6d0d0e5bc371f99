"""Microbenchmarks of the step-time model's kernel classes at the shapes of the held-out runs, on a GPU.

    python benchmarks/hopper_kernels.py --out rows.jsonl          # on the GPU machine (issue #21)
    python benchmarks/hopper_kernels.py --report rows.jsonl       # here: measured against memplan's model

Each row is one kernel class measured alone (CUDA events, the median of ``--reps`` after two warm-ups),
never a training run: torch's SDPA attention by backend (flash, cuDNN, memory-efficient), causal or
not, forward and backward, over sequence lengths and head layouts; bf16 GEMMs at the linear layers'
shapes of docs/step-time.md's held-out runs, forward and both backward products; and the element-wise
kernels of an eager layer (LayerNorm, RMSNorm's ops, GELU, SiLU, adds), with the bytes they move.
``--report`` sets each beside what memplan's step-time model charges for it (``time.attention``'s
fractions, ``time.gemm``'s wave model at ``MATMUL``, ``MEMORY`` × HBM) on the preset of the GPU that ran.
FLOPs follow the conventions the model uses: a GEMM 2·m·k·n, attention's forward 4·b·heads·s²·d (half
of it causal, FlashAttention's benchmark convention), its backward 2.5 × the forward's.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Held-out runs' linear layers (benchmarks/heldout.py): (name, hidden, ffn, tokens per micro-batch).
MPT_SHAPES = (
    ("mpt-760m", 1536, 6144, 24 * 2048),
    ("mpt-1b", 2048, 8192, 14 * 2048),
    ("mpt-3b", 2560, 10240, 10 * 2048),
    ("mpt-7b", 4096, 16384, 6 * 2048),
    ("mpt-13b", 5120, 20480, 2 * 2048),
    ("mpt-30b", 7168, 28672, 3 * 2048),
    ("mpt-70b", 8192, 32768, 2 * 2048),
)
LLAMA_SHAPES = (("llama-3.1-8b", 4096, 14336, 2 * 8192),)
# Attention: (heads, kv heads, head dim) × sequence lengths; batch so that b·s ≥ 16,384 tokens.
ATTN_LAYOUTS = ((32, 32, 128), (32, 8, 128), (16, 16, 128), (12, 12, 64))
ATTN_SEQS = (1024, 2048, 4096, 8192, 16384, 32768)
DEV = "cuda"
"""The device measured (``--device cpu`` only checks that the script runs, at tiny sizes)."""


def _timer(fn: Callable[[], Any], reps: int) -> float:
    """Seconds of one call: the median of ``reps`` timings after two warm-ups, each timing ``inner`` calls
    back to back between two CUDA events (``inner`` from the second warm-up: enough calls to span 5 ms),
    so the host's gap before the first kernel — and a compiled function's guards — do not count."""
    import time

    import torch

    if DEV != "cuda":
        fn()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    inner = max(1, min(100, round(5e-3 / max(time.perf_counter() - t0, 1e-6))))
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / inner)
    return statistics.median(times)


def attention_rows(reps: int, seqs: tuple[int, ...]) -> list[dict[str, Any]]:
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows: list[dict[str, Any]] = []
    backends = {
        "flash": SDPBackend.FLASH_ATTENTION,
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
    }
    for heads, kv, d in ATTN_LAYOUTS:
        for s in seqs:
            b = max(1, 16384 // s)
            q = torch.randn(b, heads, s, d, device=DEV, dtype=torch.bfloat16, requires_grad=True)
            k = torch.randn(b, kv, s, d, device=DEV, dtype=torch.bfloat16, requires_grad=True)
            v = torch.randn(b, kv, s, d, device=DEV, dtype=torch.bfloat16, requires_grad=True)
            for causal in (True, False):
                if not causal and (heads, kv) != (32, 32):
                    continue
                fwd_flops = 4 * b * heads * s * s * d // (2 if causal else 1)
                for name, backend in backends.items():
                    if name != "flash" and (heads, kv, d) != (32, 32, 128):
                        continue
                    row: dict[str, Any] = dict(
                        kind="attention",
                        backend=name,
                        b=b,
                        heads=heads,
                        kv_heads=kv,
                        d=d,
                        s=s,
                        causal=causal,
                        fwd_flops=fwd_flops,
                        bwd_flops=int(2.5 * fwd_flops),
                    )
                    try:
                        with sdpa_kernel([backend]):
                            fwd = functools.partial(
                                F.scaled_dot_product_attention,
                                q,
                                k,
                                v,
                                is_causal=causal,
                                enable_gqa=kv != heads,
                            )
                            n = reps if s <= 8192 else 2
                            row["fwd_s"] = _timer(fwd, n)
                            out = fwd()
                            bwd = functools.partial(
                                torch.autograd.grad, out, (q, k, v), torch.randn_like(out), retain_graph=True
                            )
                            row["bwd_s"] = _timer(bwd, n)
                            del out, bwd
                    except Exception as e:  # a backend that refuses the shape: say so, go on
                        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            del q, k, v
            torch.cuda.empty_cache()
    return rows


def gemm_rows(reps: int) -> list[dict[str, Any]]:
    """Every linear of one layer, forward (x·Wᵀ), input gradient (dy·W) and weight gradient (dyᵀ·x), as
    autograd runs them for ``F.linear``."""
    import torch

    rows: list[dict[str, Any]] = []
    for model, h, ffn, t in MPT_SHAPES + LLAMA_SHAPES:
        kv = 1024 if model.startswith("llama") else h
        up = ffn * (2 if model.startswith("llama") else 1)  # SwiGLU's gate and up in one product
        linears = {"qkv": (h, h + 2 * kv), "out": (h, h), "up": (h, up), "down": (ffn, h)}
        for lin, (k_in, n_out) in linears.items():
            x = torch.randn(t, k_in, device=DEV, dtype=torch.bfloat16)
            w = torch.randn(n_out, k_in, device=DEV, dtype=torch.bfloat16)
            dy = torch.randn(t, n_out, device=DEV, dtype=torch.bfloat16)
            cases = {
                "fwd": ((t, k_in, n_out), functools.partial(torch.nn.functional.linear, x, w)),
                "dgrad": ((t, n_out, k_in), functools.partial(torch.mm, dy, w)),
                "wgrad": ((n_out, t, k_in), functools.partial(torch.mm, dy.t(), x)),
            }
            for which, ((m, kk, n), fn) in cases.items():
                sec = _timer(fn, reps)
                row = dict(
                    kind="gemm",
                    model=model,
                    linear=lin,
                    which=which,
                    m=m,
                    k=kk,
                    n=n,
                    s=sec,
                    tflops=2 * m * kk * n / sec / 1e12,
                )
                rows.append(row)
                print(json.dumps(row), flush=True)
            del x, w, dy
    return rows


def elementwise_rows(reps: int) -> list[dict[str, Any]]:
    """Element-wise kernels of an eager layer on [tokens, hidden] bf16, with the bytes each moves once."""
    import torch
    import torch.nn.functional as F

    rows: list[dict[str, Any]] = []
    for model, h, ffn, t in (MPT_SHAPES[1], MPT_SHAPES[3], LLAMA_SHAPES[0]):
        x = torch.randn(t, h, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        y = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
        u = torch.randn(t, ffn, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        wln = torch.ones(h, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        e = t * h * 2
        ef = t * ffn * 2
        ln = F.layer_norm(x, (h,), wln)
        g_ln = torch.randn_like(ln)
        ge = F.gelu(u)
        g_ge = torch.randn_like(ge)
        p = functools.partial
        grad = torch.autograd.grad
        cases: dict[str, tuple[int, Callable[[], Any]]] = {
            "add": (3 * e, p(torch.add, x, y)),
            "layer_norm_fwd": (2 * e, p(F.layer_norm, x, (h,), wln)),
            "layer_norm_bwd": (3 * e, p(grad, ln, (x, wln), g_ln, retain_graph=True)),
            "rms_pow_mean": (e, p(lambda a: a.float().pow(2).mean(-1, keepdim=True), x)),
            "mul_broadcast": (3 * e, p(torch.mul, x, y[:, :1])),
            "gelu_fwd": (2 * ef, p(F.gelu, u)),
            "gelu_bwd": (3 * ef, p(grad, ge, u, g_ge, retain_graph=True)),
            "silu_fwd": (2 * ef, p(F.silu, u)),
            "to_fp32": (3 * e, p(torch.Tensor.float, x)),
        }
        for name, (nbytes, fn) in cases.items():
            sec = _timer(fn, reps)
            row = dict(kind="elementwise", model=model, op=name, bytes=nbytes, s=sec, gbps=nbytes / sec / 1e9)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def chain_rows(reps: int, compiled: bool = False) -> list[dict[str, Any]]:
    """The eager element-wise chains of memplan's reference layer (memplan/measure/reference/model.py's own
    ``rms_norm`` and ``apply_rope``; the rest the same ops in the same order), forward and backward
    (``autograd.grad`` of the chain's output, the weight included), alone: RMSNorm as Llama writes it,
    torch's ``F.rms_norm``, LayerNorm, rotary on a strided [b, a, s, d] view with [s, d] tables, SwiGLU's
    ``silu(gate)·up``, the tanh GELU, a residual add. ``compiled``: the same chains through
    ``torch.compile`` (Inductor's fused kernels, ``--compile``), named ``<chain>_compiled``."""
    import torch
    import torch.nn.functional as F

    from memplan.measure.reference.model import apply_rope, rms_norm

    rows: list[dict[str, Any]] = []
    bf = torch.bfloat16
    for model, h, ffn, t_, heads, kv in (
        ("llama-3.1-8b", 4096, 14336, 16384, 32, 8),
        ("mpt-7b", 4096, 16384, 12288, 32, 32),
    ):
        b, d = 2, h // heads
        s = t_ // b

        def rand(*shape: int, grad: bool = True) -> Any:
            return torch.randn(*shape, device=DEV, dtype=bf, requires_grad=grad)

        x, w, bias = rand(t_, h), rand(h), rand(h)
        g, u = rand(t_, ffn), rand(t_, ffn)
        q_lin, k_lin = rand(b, s, heads * d), rand(b, s, kv * d)
        cos, sin = rand(s, d, grad=False), rand(s, d, grad=False)

        def rms(x: Any, w: Any) -> Any:
            return rms_norm(x, w, 1e-5, "rmsnorm")

        def rope(
            q_lin: Any, k_lin: Any, cos: Any = cos, sin: Any = sin, b: int = b, s: int = s, d: int = d
        ) -> Any:
            def one(z: Any) -> Any:
                return apply_rope(z.view(b, s, -1, d).transpose(1, 2), cos, sin)

            return one(q_lin), one(k_lin)

        p = functools.partial
        chains: dict[str, tuple[Callable[..., Any], tuple[Any, ...], int]] = {
            "rmsnorm_eager": (rms, (x, w), t_ * h),
            "rms_norm_torch": (lambda x, w, h=h: F.rms_norm(x, (h,), w), (x, w), t_ * h),
            "layer_norm": (lambda x, w, bias, h=h: F.layer_norm(x, (h,), w, bias), (x, w, bias), t_ * h),
            "rotary": (rope, (q_lin, k_lin), t_ * (heads + kv) * d),
            "swiglu": (lambda g, u: F.silu(g) * u, (g, u), t_ * ffn),
            "gelu_tanh": (p(F.gelu, approximate="tanh"), (u,), t_ * ffn),
            "residual_add": (torch.add, (x, x.detach()), t_ * h),
            "copy": (torch.clone, (x,), t_ * h),
        }
        for name, (fn, args, elements) in chains.items():
            if compiled:
                if name in ("rms_norm_torch", "residual_add", "copy"):
                    continue
                # static shapes (a second shape would otherwise recompile with dynamic ones); the backward is
                # run repeatedly on one graph, so no buffer may be donated
                import torch._functorch.config as functorch_config

                functorch_config.donated_buffer = False
                fn, name = torch.compile(fn, dynamic=False), f"{name}_compiled"
            row: dict[str, Any] = dict(kind="chain", model=model, chain=name, elements=elements)
            try:
                row["fwd_s"] = _timer(functools.partial(fn, *args), reps)
                out = fn(*args)
                outs = out if isinstance(out, tuple) else (out,)
                inputs = tuple(a for a in args if a.requires_grad)
                grads = tuple(torch.randn_like(o) for o in outs)
                row["bwd_s"] = _timer(
                    functools.partial(torch.autograd.grad, outs, inputs, grads, retain_graph=True), reps
                )
                del out, outs, grads
            except Exception as e:  # Inductor without a compiler: say so, go on
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def grid_rows(reps: int) -> list[dict[str, Any]]:
    """The flash kernel (causal, heads of 128) on grids smaller than ``attention_rows``' 16,384 tokens: b
    from 1 at each length, and 8 heads (a tensor-parallel rank's share) — the query tiles per SM."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows: list[dict[str, Any]] = []
    for heads in (32, 8):
        for s in (1024, 2048, 4096, 8192):
            for b in (1, 2, 4, 8, 16):
                if b * s > 16384:
                    continue
                q, k, v = (
                    torch.randn(b, heads, s, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
                    for _ in range(3)
                )
                fwd_flops = 4 * b * heads * s * s * 128 // 2
                row: dict[str, Any] = dict(
                    kind="attention", backend="flash", b=b, heads=heads, kv_heads=heads, d=128, s=s,
                    causal=True, fwd_flops=fwd_flops, bwd_flops=int(2.5 * fwd_flops), grid=True,
                )  # fmt: skip
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                    fwd = functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=True)
                    row["fwd_s"] = _timer(fwd, reps)
                    out = fwd()
                    bwd = functools.partial(
                        torch.autograd.grad, out, (q, k, v), torch.randn_like(out), retain_graph=True
                    )
                    row["bwd_s"] = _timer(bwd, reps)
                del q, k, v, out
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def core_rows(reps: int) -> list[dict[str, Any]]:
    """memplan's reference eager attention core between its two products (reference/model.py): the scores
    scaled by d^-½, the causal mask filled with -inf, the softmax; forward and ``autograd.grad`` of the
    probabilities, on Llama-2-7B's [1, 32, s, s] scores."""
    import torch

    rows: list[dict[str, Any]] = []
    for s in (1024, 2048, 3072):
        scores = torch.randn(1, 32, s, s, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        mask = torch.ones(s, s, device=DEV, dtype=torch.bool).triu(1)

        def core(x: Any, mask: Any = mask) -> Any:
            return torch.softmax((x * (1.0 / 128**0.5)).masked_fill(mask, float("-inf")), dim=-1)

        row: dict[str, Any] = dict(
            kind="chain", model=f"llama-2-7b s {s}", chain="eager_core", elements=32 * s * s
        )
        row["fwd_s"] = _timer(functools.partial(core, scores), reps)
        out = core(scores)
        row["bwd_s"] = _timer(
            functools.partial(torch.autograd.grad, out, scores, torch.randn_like(out), retain_graph=True),
            reps,
        )
        del out, scores
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def sustained(fn: Callable[[], Any], seconds: float) -> dict[str, Any]:
    """``fn`` back to back for ≈ ``seconds`` with nvidia-smi's SM clock and board power sampled meanwhile
    (every ≈ 0.2 s): seconds a call, and the samples' medians (``sm_mhz``, ``watts``) and the limit."""
    import subprocess
    import threading
    import time

    import torch

    samples: list[tuple[float, ...]] = []
    stop = threading.Event()

    def poll() -> None:
        query = [
            "nvidia-smi",
            "--query-gpu=clocks.sm,power.draw,power.limit",
            "--format=csv,noheader,nounits",
        ]
        while not stop.is_set():
            try:
                line = subprocess.run(query, capture_output=True, text=True, timeout=5).stdout.splitlines()[0]
                samples.append(tuple(float(x) for x in line.split(",")))
            except (OSError, ValueError, IndexError, subprocess.SubprocessError):
                return
            time.sleep(0.2)

    for _ in range(3):  # warm: the clock settles under the limit
        fn()
    calls = max(1, round(seconds / max(_timer(fn, 1), 1e-6)))
    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    if DEV == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    stop.set()
    thread.join()
    row: dict[str, Any] = dict(calls=calls, s=wall / calls)
    if samples:
        row["sm_mhz"] = statistics.median(x[0] for x in samples)
        row["watts"] = statistics.median(x[1] for x in samples)
        row["limit_w"] = samples[0][2]
        row["samples"] = len(samples)
    return row


def power_rows(reps: int) -> list[dict[str, Any]]:
    """Kernels held at full load for ≈ 4 s each (``sustained``): one large bf16 GEMM (70B's MLP shape,
    16,384 × 8,192 × 28,672) with random inputs and with zeros — whether it runs at the board's power limit
    and at what clock (the data-dependent power of Horace He's "Strangely, Matrix Multiplications on GPUs
    Run Faster When Given 'Predictable' Data", 2024: zeros switch fewer transistors, so the same GEMM
    holds a higher clock under the same limit) — and the flash attention kernel, forward and backward
    (causal, 32 heads of 128, b 2 × 8,192; and b 1 × 32,768, a context-parallel rank's local block): what
    it draws at its own rate."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cuda = DEV == "cuda"
    seconds = 4.0 if cuda else 0.05
    m, k, n = (16384, 8192, 28672) if cuda else (256, 128, 512)
    rows: list[dict[str, Any]] = []
    for fill in ("randn", "zeros"):
        make = torch.randn if fill == "randn" else torch.zeros
        a = make(m, k, device=DEV, dtype=torch.bfloat16)
        b = make(k, n, device=DEV, dtype=torch.bfloat16)
        row: dict[str, Any] = dict(kind="power", fill=fill, m=m, k=k, n=n)
        row.update(sustained(functools.partial(torch.mm, a, b), seconds))
        row["tflops"] = 2 * m * k * n / row["s"] / 1e12
        rows.append(row)
        print(json.dumps(row), flush=True)
        del a, b
    for batch, s in ((2, 8192), (1, 32768)) if cuda else ((1, 64),):
        heads, d = (32, 128) if cuda else (2, 16)
        q, kk, v = (
            torch.randn(batch, heads, s, d, device=DEV, dtype=torch.bfloat16, requires_grad=True)
            for _ in "qkv"
        )
        dout = torch.randn(batch, heads, s, d, device=DEV, dtype=torch.bfloat16)
        backends = [SDPBackend.FLASH_ATTENTION] if cuda else [SDPBackend.MATH]

        def step(q: Any = q, kk: Any = kk, v: Any = v, dout: Any = dout, backends: Any = backends) -> Any:
            with sdpa_kernel(backends):
                out = F.scaled_dot_product_attention(q, kk, v, is_causal=True)
            return torch.autograd.grad(out, (q, kk, v), dout)

        flops = 3.5 * 4 * batch * heads * s * s * d / 2  # forward + backward (2.5×), causal half
        row = dict(kind="power", fill="flash", b=batch, heads=heads, seq=s, d=d)
        row.update(sustained(step, seconds))
        row["tflops"] = flops / row["s"] / 1e12
        rows.append(row)
        print(json.dumps(row), flush=True)
        del q, kk, v, dout
    return rows


def env_row() -> dict[str, Any]:
    """The machine a run measured on (a file's first row)."""
    import torch

    name = torch.cuda.get_device_name() if DEV == "cuda" else DEV
    cudnn = torch.backends.cudnn.version()
    return dict(kind="env", torch=torch.__version__, cuda=torch.version.cuda, device=name, cudnn=cudnn)


def write_parts(out: Path, parts: str, makers: dict[str, Callable[[], list[dict[str, Any]]]]) -> int:
    """``env_row`` and the rows of each of ``makers`` named in ``parts`` (comma-separated), in the makers'
    order, written to ``out`` as JSON lines — also what was measured before a part failed."""
    chosen = set(parts.split(","))
    rows = [env_row()]
    try:
        for name, make in makers.items():
            if name in chosen:
                rows += make()
    finally:
        out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return 0


def measure(args: argparse.Namespace) -> int:
    global DEV, MPT_SHAPES, LLAMA_SHAPES
    DEV = args.device
    if DEV != "cuda":  # a smoke run: small shapes
        MPT_SHAPES = tuple((m, h // 16, f // 16, 256) for m, h, f, _ in MPT_SHAPES[:4])
        LLAMA_SHAPES = tuple((m, h // 4, f // 4, 256) for m, h, f, _ in LLAMA_SHAPES)
    reps = args.reps
    makers: dict[str, Callable[[], list[dict[str, Any]]]] = {
        "gemm": lambda: gemm_rows(reps),
        "elementwise": lambda: elementwise_rows(reps),
        "chains": lambda: chain_rows(reps),
        "core": lambda: core_rows(reps),
        "compiled": lambda: chain_rows(reps, compiled=True),
        "grid": lambda: grid_rows(reps),
        "power": lambda: power_rows(reps),
        "attention": lambda: attention_rows(reps, tuple(int(s) for s in args.seqs.split(","))),
    }
    return write_parts(Path(args.out), args.parts, makers)


def report(path: Path, gpu_name: str) -> int:
    """Measured against the model's charge for each kernel class on ``gpu_name``'s preset (Markdown)."""
    from memplan.presets import load_gpu
    from memplan.time import efficiency, gemm

    gpu = load_gpu(gpu_name)
    peak = gpu.peak_tflops.bf16 * 1e12
    hbm = gpu.hbm_bandwidth_gbps * 1e9
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    env = rows[0]
    print(f"{env['device']}, torch {env['torch']}, CUDA {env['cuda']}, cuDNN {env['cudnn']}\n")
    print("| model | linear | product | m × k × n | TFLOP/s | of peak | model | measured / model |")
    print("|---|---|---|---|---:|---:|---:|---:|")
    for r in (r for r in rows if r["kind"] == "gemm"):
        model = efficiency.MATMUL * gemm.efficiency(gemm.Gemm(r["m"], r["k"], r["n"]), gpu.sms)
        frac = r["tflops"] * 1e12 / peak
        shape = f"{r['m']} × {r['k']} × {r['n']}"
        cells = (
            r["model"],
            r["linear"],
            r["which"],
            shape,
            f"{r['tflops']:.0f}",
            f"{frac:.3f}",
            f"{model:.3f}",
        )
        print("| " + " | ".join(cells) + f" | {frac / model:.3f} |")
    print("\n| op | model | bytes moved | GB/s | of HBM |")
    print("|---|---|---:|---:|---:|")
    for r in (r for r in rows if r["kind"] == "elementwise"):
        cells = (r["op"], r["model"], f"{r['bytes']:,}", f"{r['gbps']:.0f}", f"{r['gbps'] * 1e9 / hbm:.3f}")
        print("| " + " | ".join(cells) + " |")
    counted = {  # time/elementwise.py's bytes per element (bf16), forward and backward
        "rmsnorm_eager": (36, 92),
        "layer_norm": (4, 8),
        "rotary": (20, 34),
        "swiglu": (10, 18),
        "gelu_tanh": (4, 8),
    }
    print("\n| chain | shape of | forward ms | of HBM | backward ms | of HBM |")
    print("|---|---|---:|---:|---:|---:|")
    for r in (r for r in rows if r["kind"] == "chain" and r["chain"] in counted):
        fwd, bwd = (n * r["elements"] for n in counted[r["chain"]])
        cells = (r["chain"], r["model"], f"{r['fwd_s'] * 1e3:.3f}", f"{fwd / r['fwd_s'] / hbm:.3f}")
        print("| " + " | ".join(cells) + f" | {r['bwd_s'] * 1e3:.3f} | {bwd / r['bwd_s'] / hbm:.3f} |")
    print("\n| backend | heads / kv / d | s | b | causal | forward of peak | backward of peak |")
    print("|---|---|---:|---:|---|---:|---:|")
    for r in (r for r in rows if r["kind"] == "attention"):
        head = (
            r["backend"],
            f"{r['heads']} / {r['kv_heads']} / {r['d']}",
            str(r["s"]),
            str(r["b"]),
            str(r["causal"]),
        )
        if "error" in r:
            print("| " + " | ".join(head) + f" | {r['error'][:60]} | |")
            continue
        f, b = r["fwd_flops"] / r["fwd_s"] / peak, r["bwd_flops"] / r["bwd_s"] / peak
        print("| " + " | ".join(head) + f" | {f:.3f} | {b:.3f} |")
    return 0


def command_line(
    argv: list[str] | None,
    doc: str | None,
    parts: str,
    measure: Callable[[argparse.Namespace], int],
    report: Callable[[Path, str], int],
    seqs: bool = False,
) -> int:
    """A benchmark's command line: ``--out FILE`` measures ``--parts`` on this machine's GPU, ``--report
    FILE`` renders a file of rows against the model."""
    p = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    p.add_argument("--out", help="measure on this machine's GPU; write JSON lines here")
    p.add_argument("--report", help="render a file of rows against the model")
    p.add_argument("--gpu", default="h200", help="the preset of the GPU that measured (--report)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--device", default="cuda", help="cpu: a smoke run at tiny sizes")
    p.add_argument("--parts", default=parts)
    if seqs:
        p.add_argument("--seqs", default=",".join(map(str, ATTN_SEQS)))
    a = p.parse_args(argv)
    if a.report:
        return report(Path(a.report), a.gpu)
    if not a.out:
        p.error("--out FILE or --report FILE")
    return measure(a)


def main(argv: list[str] | None = None) -> int:
    return command_line(argv, __doc__, "gemm,elementwise,chains,core,attention", measure, report, seqs=True)


if __name__ == "__main__":
    sys.exit(main())
