"""The reference model laid out over ranks with PyTorch's own parallel APIs (one rank's view).

- Tensor parallelism: ``parallelize_module`` with ``ColwiseParallel`` on W_Q, W_K, W_V and the MLP's gate and
  up matrices, ``RowwiseParallel`` on W_O and the MLP's down matrix (Shoeybi et al. 2019, §3), norms
  replicated; the embedding and the lm head vocabulary-parallel (``Shard(0)`` DTensors, the embedding's
  partial sums all-reduced, the loss under ``loss_parallel``: log-probs [T, v/t] per rank).
- Sequence parallelism: the column-parallel linears take their input sequence-sharded (``input_layouts=
  Shard(1)``: DTensor all-gathers it), the row-parallel ones reduce-scatter their output (``output_layouts=
  Shard(1)``), the embedding reduce-scatters, the lm head all-gathers; norms and dropout run on s/t tokens
  and the norm weights' gradients are all-reduced over the tp ranks after backward (Megatron-LM does the
  same for sequence-parallel norm weights).
- ZeRO-3: FSDP2 ``fully_shard`` per layer and on the root (parameters, gradients and optimizer states
  sharded over dp, dim 0 of each parameter); ZeRO-2: the same with ``reshard_after_forward=False`` (ZeRO-2's
  communication: the gathered parameters stay from forward to backward, no re-gather; gradients and states
  sharded; but FSDP2 reshards after backward, so at rest the weights are sharded too: dist_compare.py).
  ZeRO-0 over dp: every gradient all-reduced after backward (what DDP does, one call per parameter instead
  of 25 MB buckets).

- ``--precision fsdp2-mixed``: FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``
  on the model's parameters in fp32 (torchtitan's trainer): the fp32 shards are what the optimizer steps,
  the layers compute with the bf16 gathered copies, gradients are reduce-scattered in fp32 into fp32
  shards (``blocks.torchtitan.fsdp2_mixed_states``, what the estimate holds).

- ZeRO-1: the parameters and gradients whole, the optimizer's master weights and states sharded over dp
  along dim 0; reduce-scatter, step, all-gather (memplan/measure/distributed/zero1.py).

- Pipeline parallelism: the model cut into stages and run by torch.distributed.pipelining
  (memplan/measure/distributed/pipeline.py); ZeRO-2/3 then shards each stage (``shard_dp``).

Known limitations (NB): pp without the interleaved schedule (``check_pipeline``); DTensor sequence
parallelism gathers the input of each column-parallel linear itself and autograd keeps the gathered
[b, s, h] copy (Megatron keeps the s/t shard and gathers again in backward): docs/distributed.md.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from memplan.config import Precision, Setup, ZeroStage
from memplan.measure.reference.model import Reference

_COLUMN = ("q", "k", "v", "mlp.gate", "mlp.up")
_ROW = ("o", "mlp.down")


class ParallelReference(Reference):
    """The reference model with a vocabulary-parallel embedding and lm head when ``tp_mesh`` is set."""

    tp_mesh: DeviceMesh | None = None
    sequence_parallel: bool = False

    def _seq_placement(self) -> Any:
        return Shard(1) if self.sequence_parallel else Replicate()

    def embed_tokens(self, ids: Tensor) -> Tensor:
        mesh = self.tp_mesh
        if mesh is None:
            return super().embed_tokens(ids)
        ids_d = DTensor.from_local(ids, mesh, [Replicate()], run_check=False)
        x = cast(DTensor, nn.functional.embedding(ids_d, self.embed))  # partial sums of each rank's v/t rows
        return x.redistribute(mesh, [self._seq_placement()]).to_local()

    def logits(self, y: Tensor) -> Tensor:
        mesh = self.tp_mesh
        if mesh is None:
            return super().logits(y)
        y_d = DTensor.from_local(y, mesh, [self._seq_placement()], run_check=False)
        return nn.functional.linear(y_d.redistribute(mesh, [Replicate()]), self.head_weight)  # [b, s, v/t]


def tp_plan(sp: bool) -> dict[str, Any]:
    """``parallelize_module``'s plan for every layer (Megatron's column/row split; SP: sequence-sharded
    inputs of the column-parallel linears, reduce-scattered outputs of the row-parallel ones)."""
    shard = Shard(1) if sp else None  # None: the styles' defaults (Replicate in, Replicate out)
    plan: dict[str, Any] = {f"layers.*.{n}": ColwiseParallel(input_layouts=shard) for n in _COLUMN}
    plan.update({f"layers.*.{n}": RowwiseParallel(output_layouts=shard) for n in _ROW})
    return plan


def build(setup: Setup, mesh: DeviceMesh, device: str) -> ParallelReference:
    """The rank's model: the whole reference model built alike on every rank (seed 0), then split."""
    torch.manual_seed(0)
    model = ParallelReference(setup, device=device)
    par = setup.parallel
    if par.tp > 1:
        tp_mesh = mesh["tp"]
        model.tp_mesh, model.sequence_parallel = tp_mesh, par.sp
        parallelize_module(model, tp_mesh, tp_plan(par.sp))
        model.embed = nn.Parameter(distribute_tensor(model.embed.detach(), tp_mesh, [Shard(0)]))
        if model.head is not None:
            model.head = nn.Parameter(distribute_tensor(model.head.detach(), tp_mesh, [Shard(0)]))
    if par.pp == 1:
        shard_dp(model, model.layers, setup, mesh)
    return model


def shard_dp(root: nn.Module, layers: nn.ModuleList, setup: Setup, mesh: DeviceMesh) -> None:
    """ZeRO-2/3 over dp > 1: FSDP2 ``fully_shard`` on each layer and on the root (a pipeline rank's root
    is its stage: measure/distributed/pipeline.py)."""
    zero, dp = setup.strategy.zero, setup.strategy.dp
    if dp > 1 and zero >= ZeroStage.GRADIENTS:
        dp_mesh = mesh["dp"]
        after_forward = zero >= ZeroStage.PARAMETERS
        policy = MixedPrecisionPolicy()  # the parameters' own dtype throughout
        if setup.training.precision is Precision.FSDP2_MIXED:
            # The model's parameters in fp32 (the model still computes its own tables and masks in the
            # activation dtype, bf16), cast to bf16 by the all-gather, reduced in fp32.
            root.float()
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in layers:
            fully_shard(layer, mesh=dp_mesh, reshard_after_forward=after_forward, mp_policy=policy)
        fully_shard(root, mesh=dp_mesh, reshard_after_forward=after_forward, mp_policy=policy)


def sync_gradients(model: nn.Module, setup: Setup, mesh: DeviceMesh) -> None:
    """The gradient collectives FSDP2 and DTensor do not issue themselves: ZeRO-0's all-reduce over dp
    (averaged, as DDP), and the sequence-parallel norm weights' all-reduce over tp (summed: each rank saw
    s/t of the tokens)."""
    par, dp = setup.parallel, setup.strategy.dp
    for p in model.parameters():
        if isinstance(p, DTensor) and isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            # The vocabulary-parallel embedding's gradient comes out of DTensor's embedding backward as a
            # Partial [v, h] on every rank: reduce-scatter it to the parameter's [v/t, h] shard.
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)
    if dp > 1 and setup.strategy.zero is ZeroStage.NONE:
        group = mesh["dp"].get_group()
        for p in model.parameters():
            if p.grad is not None:
                grad = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
                dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=group)
                grad.div_(dp)
    if par.sp:
        group = mesh["tp"].get_group()
        for name, p in model.named_parameters():
            if "norm" in name and p.grad is not None and not isinstance(p.grad, DTensor):
                dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)


def check_distributed(setup: Setup) -> None:
    """One-line ValueError (field, fix) for a layout this run does not implement."""
    par, s = setup.parallel, setup.strategy
    if par.pp > 1:
        check_pipeline(setup)
    if setup.model.moe is not None and par.tp > 1:  # ``tp_plan`` names the dense MLP's linears only
        raise ValueError(
            f"tp: {setup.model.name} is a mixture of experts, which --nproc runs over data and pipeline "
            "ranks (its experts whole on each rank); drop --tp"
        )
    if s.reversible and (par.pp > 1 or (s.dp > 1 and s.zero >= ZeroStage.GRADIENTS)):
        # the reversible stack's own autograd Function re-runs its layers in backward outside FSDP2's
        # hooks (their parameters still sharded DTensors) and outside the pipeline stage's
        raise ValueError(
            "reversible: the distributed profile runs reversible layers with --tp and ZeRO-0/1 only, not "
            "under FSDP2 (--zero 2/3) or --pp; drop --reversible, or use --zero 1 without --pp"
        )


def check_pipeline(setup: Setup) -> None:
    """What the pipeline run (measure/distributed/pipeline.py) does not combine with, one line each."""
    par, n = setup.parallel, setup.training.grad_accum
    if par.vpp > 1:
        raise ValueError("vpp: the distributed profile runs 1F1B, not the interleaved schedule; drop --vpp")
    if n < par.pp:
        raise ValueError(
            f"grad_accum: 1F1B over {par.pp} stages needs at least {par.pp} micro-batches "
            f"(torch's Schedule1F1B); use --grad-accum {par.pp} or more"
        )
