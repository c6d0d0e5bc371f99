"""ZeRO stage 1 (P_os, Rajbhandari et al. 2019 §5.1) on torch.distributed, for ``profile --nproc --zero 1``.

Every rank keeps the whole 16-bit (or fp32) parameters and their whole gradients; the master weights and
optimizer states of each parameter are sharded over the dp ranks along dim 0, as FSDP2 shards (rank r owns
``torch.chunk(p, dp)[r]``, ⌈rows/dp⌉ rows), so a rank holds Ψ/N_d of them when N_d divides the rows.
The step (ZeRO §7: 2Ψ moved per step, as plain data parallelism):

1. reduce-scatter each gradient over dp (averaged): the rank's chunk of the summed gradient;
2. the reference optimizer updates the rank's chunk: its master chunk and states, then the chunk of the
   parameter itself (a view: no second copy of the weights);
3. all-gather the updated chunks into every rank's whole parameter.

NB: ``ZeroRedundancyOptimizer`` (torch's own) assigns whole parameters to ranks, so its per-rank states are
not Ψ/N_d; DeepSpeed and Megatron's distributed optimizer shard elements, which this follows.
NB: the reduce-scatter output and the all-gather input are per-parameter transients of the step (the peak is
reported, not required equal: dist_compare.py).

With tensor parallelism (``--tp``, DTensor parameters) ZeRO-1 shards what the rank holds: each parameter's
local tensor (``DTensor.to_local()``: the rank's tp shard, or the whole tensor where it is replicated) is
chunked over the dp group, and the collectives run on local tensors over that group. DTensor has no
sharding strategy for ``c10d._reduce_scatter_base_`` (issue #22), so the DTensors themselves never enter
the collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from memplan.config import Optimizer, Precision
from memplan.measure.reference.optim import ReferenceOptimizer


def local(t: Tensor) -> Tensor:
    """A DTensor's local tensor (a view of the same storage), any other tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


class Zero1Optimizer(ReferenceOptimizer):
    """The reference optimizer over this rank's dim-0 chunk of every parameter, with ZeRO-1's collectives."""

    def __init__(
        self, params: list[Tensor], precision: Precision, optimizer: Optimizer, group: dist.ProcessGroup
    ) -> None:
        self.full, self.group = params, group
        self.dp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        for p in params:
            if local(p).shape[0] % self.dp:
                raise ValueError(
                    f"zero: a parameter of {local(p).shape[0]} rows does not split over dp {self.dp}; "
                    "use a dp that divides the model's widths"
                )
        chunks = [torch.chunk(local(p.detach()), self.dp)[self.rank] for p in params]  # views into them
        super().__init__(chunks, precision, optimizer)

    def zero_grad(self) -> None:
        for p in self.full:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """One parameter at a time (the transients stay one chunk): reduce-scatter its gradient, update its
        chunk, all-gather the chunks."""
        self.t += 1
        for i, (p, chunk) in enumerate(zip(self.full, self.params, strict=True)):
            if p.grad is None:
                continue
            chunk.grad = torch.empty_like(chunk)
            summed = dist.ReduceOp.SUM
            dist.reduce_scatter_single(chunk.grad, local(p.grad).contiguous(), op=summed, group=self.group)
            chunk.grad.div_(self.dp)
            self.update(i)
            chunk.grad = None
            dist.all_gather_single(local(p.detach()), chunk.clone(), group=self.group)
