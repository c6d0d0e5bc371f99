"""Context parallelism measured: one rank of torch's own ring attention against the estimate, per tensor.

The reference model runs one context-parallel rank with torch's ``_templated_ring_attention`` and its
backward (``memplan.measure.reference.context``): over a fake process group in one process (every tensor and
FLOP of the rank, the values not a real run's), and over a real gloo group of 2 processes (the same code with
real collectives), where the ring's output and gradients also equal full causal attention on the whole
sequence. Expected values come from the measurement (saved-tensor hooks, FlopCounterMode), never from the
estimate.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from memplan.blocks.inventory import Dims
from memplan.config import (
    Attention,
    Checkpointing,
    CpRotate,
    Device,
    DType,
    ModelConfig,
    MoEConfig,
    Parallel,
    Setup,
    StrategyConfig,
    TrainingConfig,
)
from memplan.engine import estimate
from memplan.measure.compare.tensors import compare, estimated_by_name
from memplan.measure.instruments.record import register_cpu_sdpa_formulas
from memplan.measure.reference.context import head_tail_positions, ring_flash, ring_group
from memplan.measure.reference.model import Reference
from memplan.measure.runs.run import make_batch, measure, run_step
from memplan.presets import load_model_preset
from memplan.strategies import context_parallel as cpx
from memplan.strategies.tensor_parallel import tp_model


def tiny(cp: int, **kw: Any) -> Setup:
    gpt = kw.pop("gpt", False)
    model = ModelConfig(
        name="cp",
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=kw.pop("kv", 2),
        ffn_size=48,
        vocab_size=96,
        norm="layernorm" if gpt else "rmsnorm",
        mlp="gelu" if gpt else "swiglu",
        position="learned" if gpt else "rope",
        max_positions=64,
        qkv_bias=gpt,
        resid_dropout=kw.pop("dropout", 0.0),
        moe=kw.pop("moe", None),
    )
    return Setup(
        model=model,
        training=TrainingConfig(
            micro_batch=2, seq_len=kw.pop("seq", 16), precision=kw.pop("precision", "fp32")
        ),
        strategy=StrategyConfig(attention=Attention.FLASH, **kw),
        parallel=Parallel(cp=cp),
        device=Device.CPU,
    )


CASES = {
    "cp2": tiny(2),
    "cp4-bf16-mqa": tiny(4, precision="bf16-mixed", kv=1),
    "cp2-selective": tiny(2, checkpointing=Checkpointing.SELECTIVE),
    "cp4-full-dropout": tiny(4, checkpointing=Checkpointing.FULL, dropout=0.1),
    "cp2-gpt-learned-positions": tiny(2, gpt=True, seq=24),
    "cp2-reversible": tiny(2, reversible=True),
    "cp2-moe": tiny(2, precision="bf16-mixed", moe=MoEConfig(experts=4, top_k=2)),
}


def unequal(est_setup: Setup, measured: Any) -> list[tuple[Any, ...]]:
    c = compare(estimate(est_setup), measured)
    wrong = [(r.name, r.est_count, r.est_bytes, r.meas_count, r.meas_bytes) for r in c.tensors if not r.equal]
    wrong += [(r.name, r.est_bytes, r.meas_bytes) for r in c.flops if not r.equal]
    if c.est_layers != c.meas_layers:
        wrong.append(("layers", c.est_layers, c.meas_layers))
    return wrong


@pytest.mark.parametrize("name", CASES)
def test_one_rank_equals_the_estimate(name: str) -> None:
    """Rank 0 (the most loaded: its merged output is re-concatenated head-major) keeps exactly the
    estimated tensors and runs 1/cp of the whole model's FLOPs."""
    assert not unequal(CASES[name], measure(CASES[name], fake=False, cp_rank=0))


def test_fake_rank_equals_real_rank() -> None:
    setup = CASES["cp4-bf16-mqa"]
    real, fake = measure(setup, fake=False, cp_rank=1), measure(setup, fake=True, cp_rank=1)
    assert real.records == fake.records
    assert real.flops == fake.flops


def test_last_rank_keeps_no_copy_of_the_output() -> None:
    """On rank cp−1 every ring step merges the whole output (no partial update, no re-concatenation): the
    output keeps the kernel's [b, s, a, d] layout and W_O reads a view of it, one tensor fewer per layer
    than the estimate (which reports the most loaded rank)."""
    setup = CASES["cp2"]
    last = measure(setup, fake=False, cp_rank=1).by_name()
    est = estimated_by_name(estimate(setup))
    assert "attn.out" not in last
    without_copy = {n: v for n, v in est.items() if n != "attn.out"}
    assert {n: (t.count, t.bytes) for n, t in last.items()} == without_copy


def test_ring_saves_what_the_flash_op_saves() -> None:
    """``RingFlash`` keeps what autograd keeps for the one SDPA op torch's ring runs inside: at one rank
    (no exchange, no merge) the same storages as ``_scaled_dot_product_flash_attention_for_cpu``."""

    def saved(fn: Any) -> list[tuple[tuple[int, ...], torch.dtype]]:
        q = torch.randn(2, 4, 8, 16, requires_grad=True)
        k = torch.randn(2, 2, 8, 16, requires_grad=True)
        v = torch.randn(2, 2, 8, 16, requires_grad=True)
        seen: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            seen.setdefault(id(t.untyped_storage()), (tuple(t.shape), t.dtype))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(q, k, v)
        return sorted(seen.values(), key=str)

    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    with ring_group(1, 0) as group:
        ring = saved(lambda q, k, v: ring_flash(q, k, v, group))
    assert ring == saved(lambda q, k, v: op(q, k, v, 0.0, True))


def test_ring_flops_split_the_sequence() -> None:
    """FlopCounterMode on one rank's ring forward: the causal step 0 on its s/c tokens and c−1 steps on
    half of them — s_r² + (c−1)·s_r²/2 score cells, each 2·d FLOPs in QKᵀ and 2·d in P·V (independent
    of memplan's count: torch's own formula for the CPU kernel's calls)."""
    register_cpu_sdpa_formulas()
    b, a, d, s, cp = 1, 2, 8, 32, 4
    s_r = s // cp
    with ring_group(cp, 2) as group:
        q, k, v = (torch.randn(b, a, s_r, d) for _ in range(3))
        with FlopCounterMode(display=False) as counter:
            ring_flash(q, k, v, group)
    assert counter.get_total_flops() == 4 * b * a * d * (s_r * s_r + (cp - 1) * s_r * s_r // 2)


# ----------------------------------------------------------------------------------------------------
# Two processes over gloo: torch's ring with real collectives
# ----------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _attention_errors(group: dist.ProcessGroup, rank: int, cp: int) -> list[float]:
    """Max |ring − full causal attention| of the rank's output and q, k, v gradients (float64)."""
    torch.manual_seed(0)
    b, a, kv, s, d = 2, 4, 2, 16, 8
    q, k, v = (torch.randn(b, n, s, d, dtype=torch.float64, requires_grad=True) for n in (a, kv, kv))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    grad = torch.randn_like(full)
    full.backward(grad)
    pos = head_tail_positions(s, cp, rank)
    mine = [t.detach()[:, :, pos].clone().requires_grad_(True) for t in (q, k, v)]
    out, _ = ring_flash(*mine, group)
    out.backward(grad[:, :, pos])
    errors = [(out - full.detach()[:, :, pos]).abs().max().item()]
    for local, whole in zip(mine, (q, k, v), strict=True):
        assert local.grad is not None and whole.grad is not None
        errors.append((local.grad - whole.grad[:, :, pos]).abs().max().item())
    return errors


def _gloo_rank(rank: int, cp: int, port: int, out_dir: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=cp)
    try:
        group = dist.group.WORLD
        assert group is not None
        errors = _attention_errors(group, rank, cp)
        setup = CASES["cp2"]
        torch.manual_seed(0)
        model = Reference(setup)
        model.ring = group
        ids, labels = make_batch(setup, "cpu")
        mine = model.positions(ids.shape[1] // cp, ids.device)
        measured = run_step(model, ids[:, mine], labels[:, mine])
        saved = {n: [t.count, t.bytes] for n, t in measured.by_name().items()}
        result = {"errors": errors, "saved": saved, "flops": measured.flops}
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_run_the_ring(tmp_path: Path) -> None:
    """torch's ring attention on 2 CPU processes (gloo): each rank's output and gradients equal full
    causal attention at its positions, and each rank's reference model keeps what the estimate says
    (rank 0 exactly; rank 1, the last, without the output copy) and runs half the whole model's FLOPs."""
    import torch.multiprocessing as mp

    cp = 2
    # spawn, not fork: a fork of a threaded pytest-xdist worker can deadlock on a lock held at the fork
    mp.spawn(_gloo_rank, args=(cp, _free_port(), str(tmp_path)), nprocs=cp)
    setup = CASES["cp2"]
    est = estimate(setup)
    expected = {n: list(v) for n, v in estimated_by_name(est).items()}
    for rank in range(cp):
        got = json.loads(Path(tmp_path, f"rank{rank}.json").read_text())
        assert max(got["errors"]) < 1e-5, got["errors"]
        want = expected if rank == 0 else {n: v for n, v in expected.items() if n != "attn.out"}
        assert got["saved"] == want
        assert got["flops"]["forward"] * cp == est.flops.forward
        assert got["flops"]["backward"] * cp == est.flops.backward


@pytest.mark.parametrize("rotate", ["allgather", "alltoall"])
def test_kv_exchanges_equal_torch_ring_collectives(rotate: str) -> None:
    """The exchanges of one attention layer, counted on torch's own ring (forward + backward) over a fake
    process group: the functional collectives it issues and their input bytes, under either of torch's
    rotate methods (``set_rotate_method``)."""
    from torch.distributed.tensor.experimental import _attention as cp_attention
    from torch.utils._python_dispatch import TorchDispatchMode

    class Log(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[tuple[str, int]] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            name = func.__name__
            if func.namespace == "_c10d_functional" and not name.startswith(("wait", "_wrap")):
                t = args[0]
                self.calls.append((name.split(".")[0], t.numel() * t.element_size()))
            return func(*args, **(kwargs or {}))

    setup = Setup(
        model=load_model_preset("llama-3-8b").model,
        training=TrainingConfig(seq_len=64, micro_batch=2, precision="bf16-mixed"),
        strategy=StrategyConfig(attention=Attention.FLASH),
        parallel=Parallel(cp=4, cp_rotate=CpRotate(rotate)),
        device=Device.CPU,
    )
    m = tp_model(setup.model, 1)
    s_r = 64 // 4
    with ring_group(4, 1) as group:
        q = torch.randn(2, m.num_heads, s_r, m.dim, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(2, m.kv_heads, s_r, m.dim, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(2, m.kv_heads, s_r, m.dim, dtype=torch.bfloat16, requires_grad=True)
        log = Log()
        before = cp_attention._cp_options.rotate_method
        cp_attention.set_rotate_method(rotate)
        try:
            with log:
                out, _ = ring_flash(q, k, v, group)
                out.sum().backward()
        finally:
            cp_attention._cp_options.rotate_method = before
    expected = []
    for e in cpx.kv_exchanges(setup):
        kind = "all_gather_into_tensor" if e.collective == "all-gather" else "all_to_all_single"
        expected += [(kind, e.bytes)] * e.calls
    assert sorted(log.calls) == sorted(expected)
    assert cpx.kv_bytes(Dims.of(setup), DType.BF16) == 2 * 2 * m.kv_heads * s_r * m.dim * 2
