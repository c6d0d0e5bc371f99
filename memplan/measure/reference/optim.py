"""The reference optimizer: the precision recipes' states, updated one tensor at a time.

Memory layout per parameter (matches memplan/strategies/zero.py and config.Optimizer):
- mixed recipes: an fp32 master copy; states in fp32; the gradient is upcast per tensor (a transient);
- fp32: no master, fp32 states; pure bf16: no master, bf16 states;
- adamw: m, v; adamw-8bit: m (int8, absmax-scaled) and v (uint8, max-scaled) + one fp32 scale each
  (NB: bitsandbytes scales per 2048-element block; one scale per tensor here); sgd: none;
  sgd-momentum and lion: one momentum buffer.
Transients of a step (analytic/peak.py ``optimizer_transient``): the fp32 gradient copy (unless the
gradient is fp32 already), Adam's denominator, lion's update, and for 8-bit Adam the fp32 m and v.

ZeRO on one CPU: ``rank_shards`` builds the tensors one rank of a per-parameter dim-0 sharding (PyTorch
FSDP2) holds and ``step_transient`` measures a step over them (analytic/peak.py ``largest_step_tensor``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from memplan.config import Optimizer, Precision
from memplan.measure.instruments.tracker import LiveMemoryTracker

BETAS, EPS, WD = (0.9, 0.999), 1e-8, 0.01
LION_BETAS = (0.9, 0.99)


class ReferenceOptimizer:
    def __init__(
        self, params: list[Tensor], precision: Precision, optimizer: Optimizer, lr: float = 1e-4
    ) -> None:
        self.params, self.precision, self.kind, self.lr = params, precision, optimizer, lr
        # FSDP2's mixed precision steps the fp32 shards themselves (no master copy: parallelize.shard_dp)
        self.mixed = precision.master_bytes > 0 and precision is not Precision.FSDP2_MIXED
        self.state_dtype = torch.bfloat16 if precision.state_bytes == 2 else torch.float32
        self.master = [p.detach().float().clone() for p in params] if self.mixed else []
        self.states = [self._init_state(p) for p in params]
        self.t = 0

    def _init_state(self, p: Tensor) -> list[Tensor]:
        k = self.kind
        if k is Optimizer.ADAMW:
            return [torch.zeros_like(p, dtype=self.state_dtype) for _ in range(2)]
        if k is Optimizer.ADAMW_8BIT:
            z = torch.zeros(1, dtype=torch.float32, device=p.device)
            return [
                torch.zeros_like(p, dtype=torch.int8),
                torch.zeros_like(p, dtype=torch.uint8),
                z,
                z.clone(),
            ]
        if k in (Optimizer.SGD_MOMENTUM, Optimizer.LION):
            return [torch.zeros_like(p, dtype=self.state_dtype)]
        return []

    def tensors(self) -> list[Tensor]:
        """Every tensor the optimizer owns (for memory tracking)."""
        return [*self.master, *(s for states in self.states for s in states)]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.t += 1
        for i, p in enumerate(self.params):
            if p.grad is not None:
                self.update(i)

    @torch.no_grad()
    def update(self, i: int) -> None:
        """Update parameter ``i`` from its gradient (one tensor of the step)."""
        p = self.params[i]
        assert p.grad is not None
        target = self.master[i] if self.mixed else p
        grad = p.grad
        if grad.dtype != torch.float32 and (self.mixed or self.kind is Optimizer.ADAMW_8BIT):
            grad = grad.float()  # the per-tensor fp32 gradient copy
        self._update(target, grad, self.states[i])
        del grad
        if self.mixed:
            p.copy_(target)

    def _update(self, w: Tensor, g: Tensor, st: list[Tensor]) -> None:
        lr, k = self.lr, self.kind
        w.mul_(1 - lr * WD)
        if k is Optimizer.SGD:
            w.add_(g, alpha=-lr)
        elif k is Optimizer.SGD_MOMENTUM:
            st[0].mul_(0.9).add_(g)
            w.add_(st[0], alpha=-lr)
        elif k is Optimizer.LION:
            update = st[0].mul(LION_BETAS[0]).add_(g, alpha=1 - LION_BETAS[0]).sign_()
            w.add_(update, alpha=-lr)
            st[0].lerp_(g.to(st[0].dtype), 1 - LION_BETAS[1])
        elif k is Optimizer.ADAMW:
            self._adam(w, g, st[0], st[1])
        else:
            self._adam_8bit(w, g, st)

    def _adam(self, w: Tensor, g: Tensor, m: Tensor, v: Tensor) -> None:
        b1, b2 = BETAS
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = v.sqrt().div_(math.sqrt(1 - b2**self.t)).add_(EPS)
        w.addcdiv_(m, denom, value=-self.lr / (1 - b1**self.t))

    def _adam_8bit(self, w: Tensor, g: Tensor, st: list[Tensor]) -> None:
        mq, vq, ms, vs = st
        m = mq.float().mul_(ms)
        v = vq.float().mul_(vs)
        self._adam(w, g, m, v)
        ms.copy_(m.abs().max().clamp_(min=1e-12) / 127)
        vs.copy_(v.max().clamp_(min=1e-12) / 255)
        mq.copy_(m.div_(ms).round_())
        vq.copy_(v.div_(vs).round_())


def rank_shards(params: list[Tensor], dp: int, rank: int = 0) -> list[Tensor]:
    """The parameter shards one rank holds when each parameter is sharded over ``dp`` ranks along dim 0
    as FSDP2 shards it: ``torch.chunk(p, dp)[rank]`` (⌈rows/dp⌉ rows for the first ranks, fewer or none
    for the last), as fresh leaf tensors with a gradient of their own dtype and shape."""
    out = []
    for p in params:
        chunks = torch.chunk(p.detach(), dp, dim=0)
        local = chunks[rank].clone() if rank < len(chunks) else p.detach().new_empty((0, *p.shape[1:]))
        local.grad = torch.randn_like(local)
        out.append(local)
    return out


def step_transient(params: list[Tensor], precision: Precision, optimizer: Optimizer) -> int:
    """Bytes the reference optimizer's step allocates above what is live before it (parameters, their
    gradients, master copies and states), at its peak: every storage tracked (``LiveMemoryTracker``)."""
    opt = ReferenceOptimizer(params, precision, optimizer)
    tracker = LiveMemoryTracker()
    with tracker:
        tracker.track([*params, *(p.grad for p in params if p.grad is not None), *opt.tensors()])
        before = tracker.current
        opt.step()
    return tracker.peak - before
