"""What a training process holds on the GPU outside torch's caching allocator (issue #22: the CUDA context).

``memplan/reserved.py``'s ``CUDA_CONTEXT`` is the memory the driver hands a process beside the allocator's
segments: the CUDA context, the kernel images loaded into it and the libraries' handles (cuBLAS, cuDNN).
This script measures it on the lent GPU, in a fresh process per kernel-loading mode:

    outside = (total − free)  [cudaMemGetInfo, the whole device]
              − used_before   [nvidia-smi's memory.used before this process touched the GPU]
              − memory_reserved()  [the allocator's segments]

after each stage of a training step's first use of the GPU: context creation, a bf16 GEMM (cuBLAS's
handle; its workspace is the allocator's), FlashAttention forward and backward through SDPA, RMSNorm and
the element-wise kernels, an AdamW step, and a whole training step of memplan's reference model (every
kernel a step of `memplan profile` loads). ``CUDA_MODULE_LOADING=LAZY`` (torch's default since 1.13,
pytorch/pytorch#86509) loads each kernel's module at its first launch; ``EAGER`` loads them all at
context creation, the figure the forum measurement quoted in reserved.py was taken under.

    python benchmarks/cuda_context.py --out context.json     # on the GPU machine (≈ 30 s)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

MIB = 2**20


def smi_used_mib() -> int | None:
    """nvidia-smi's memory.used of GPU 0 in MiB (None without nvidia-smi)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
        return int(out.strip().splitlines()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def stages() -> dict[str, Any]:
    """One process's figures: run in a child whose environment sets the loading mode."""
    used_before = smi_used_mib() or 0
    import torch
    import torch.nn.functional as F

    dev = torch.device("cuda")
    out: dict[str, Any] = {"used_before_mib": used_before, "stages": []}

    def note(name: str) -> None:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info(dev)
        reserved = torch.cuda.memory_reserved(dev)
        outside = total - free - used_before * MIB - reserved
        out["total_bytes"] = total
        row = {"stage": name, "outside_bytes": outside, "reserved_bytes": reserved}
        out["stages"].append({**row, "smi_used_mib": smi_used_mib()})

    torch.zeros(1, device=dev)
    note("context (one tensor)")
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    (a @ a).sum().item()
    note("bf16 GEMM (cuBLAS)")
    q = torch.randn(1, 32, 2048, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    note("SDPA flash forward + backward")
    x = torch.randn(2048, 4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
    F.silu(F.rms_norm(x, (4096,)) * 2).float().sum().backward()
    note("rms_norm, silu, casts")
    p = torch.nn.Parameter(torch.randn(4096, 4096, device=dev))
    p.grad = torch.randn_like(p)
    torch.optim.AdamW([p]).step()
    note("AdamW step")
    from memplan.api import build_setup
    from memplan.measure.runs.profile import StepRunner

    runner = StepRunner(build_setup("llama-3.2-1b", seq=1024), "cuda")
    for _ in range(2):
        runner.step(lambda _: None, {})
    note("reference training step (Llama 3.2 1B, seq 1024, bf16-mixed AdamW)")
    out["torch"] = torch.__version__
    out["cuda"] = torch.version.cuda
    out["device"] = torch.cuda.get_device_name(dev)
    out["module_loading"] = os.environ.get("CUDA_MODULE_LOADING", "(torch's default)")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the JSON here as well as printing it")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(stages()))
        return
    results = []
    for mode in (None, "EAGER"):
        env = dict(os.environ)
        env.pop("CUDA_MODULE_LOADING", None)
        if mode:
            env["CUDA_MODULE_LOADING"] = mode
        proc = subprocess.run(
            [sys.executable, __file__, "--child"], capture_output=True, text=True, env=env, timeout=300
        )
        if proc.returncode != 0:
            results.append({"module_loading": mode, "error": proc.stderr.strip().splitlines()[-5:]})
        else:
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)


if __name__ == "__main__":
    main()
