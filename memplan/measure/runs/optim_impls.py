"""The real optimizers' step, measured: torch.optim.AdamW (for-loop, foreach, fused) and bitsandbytes'
AdamW8bit, on real tensors on CPU, every storage tracked (``LiveMemoryTracker``; analytic/optimizer_step.py
derives what each allocates).

The states are made by a first step (AdamW and AdamW8bit create them lazily, ``zeros_like`` per
parameter); the second step is measured: its peak above the parameters, gradients and states. Under a
mixed recipe the optimizer steps fp32 master copies (``p.float()``) with fp32 gradients.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from memplan.config import TORCH_ADAMW, OptimizerImpl, Precision
from memplan.measure.instruments.tracker import LiveMemoryTracker

LR, WD = 1e-3, 0.01


def make_optimizer(params: list[Tensor], impl: OptimizerImpl) -> Any:
    """The real optimizer ``impl`` names over ``params``."""
    if impl is OptimizerImpl.BITSANDBYTES:
        import bitsandbytes.optim as bnb_optim  # an optional extra

        return bnb_optim.AdamW8bit(params, lr=LR, weight_decay=WD)  # type: ignore[attr-defined]
    if impl not in TORCH_ADAMW:
        raise ValueError(f"optimizer_impl: {impl} is not a torch or bitsandbytes optimizer")
    fused = impl is OptimizerImpl.FUSED
    foreach = None if fused else impl is OptimizerImpl.FOREACH
    return torch.optim.AdamW(params, lr=LR, weight_decay=WD, foreach=foreach, fused=fused)


def _state_tensors(opt: Any) -> list[Tensor]:
    return [v for state in opt.state.values() for v in state.values() if isinstance(v, Tensor)]


def state_bytes(opt: Any) -> int:
    """Bytes of every distinct storage the optimizer's state holds (shared qmaps once)."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _state_tensors(opt)}
    return sum(seen.values())


def step_transient(params: list[Tensor], precision: Precision, impl: OptimizerImpl) -> tuple[int, int]:
    """(the step's peak above what is live before it, the optimizer's state bytes) for ``params``, each
    with a ``.grad`` of its own dtype, stepped by ``impl``; under a mixed recipe it steps fp32 master
    copies with fp32 gradients (analytic/optimizer_step.py: the framework's, alive before the step)."""
    if precision.master_bytes > 0:
        masters = [p.detach().float().requires_grad_() for p in params]
        for m, p in zip(masters, params, strict=True):
            m.grad = None if p.grad is None else p.grad.float()
        params = masters
    opt = make_optimizer(params, impl)
    opt.step()  # creates the states
    tracker = LiveMemoryTracker()
    with tracker:
        tracker.track([*params, *(p.grad for p in params if p.grad is not None), *_state_tensors(opt)])
        before = tracker.current
        opt.step()
    return tracker.peak - before, state_bytes(opt)
