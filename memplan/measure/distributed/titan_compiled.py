"""torchtitan's ``apply_compile`` inside pipeline stages (``--impl torchtitan --pp P [--vpp M] --compile``):
each block of each model part run through AOTAutograd's min-cut partitioner, under the schedule.

torchtitan compiles every block of every model part alone (``distributed/compile.py`` ``apply_compile``:
``transformer_block.compile(backend=..., fullgraph=True)``, called by ``parallelize_llama`` on each part
``pipeline_llm`` hands it). ``compiled_blocks(blocks)`` swaps each block's ``forward`` for the block's
functional call through ``runs.compiled.partitioned_forward`` (Inductor's decompositions, the min-cut
partition, no kernel compiled), so the pipeline schedule runs the partitioned forward and backward graphs:
AOTAutograd's ``CompiledFunction`` keeps what the partitioner chose with ``ctx.save_for_backward``, which
``pipeline.InFlightRecorder``'s hooks see per forward in flight, as they see an eager block's saves. Every
block of a model is the same graph: one trace serves them all (each call passes its block's own parameters
and buffers).

The same serves one rank of the unpipelined model over tp and dp (``titan.measure_titan_rank``).

Known limitations:
- NB: without activation checkpointing only; with ``FullAC`` a compiled block keeps its input alone,
  compiled or not (``runs.compiled``'s NB): the stages run the eager ``FullAC`` blocks, at any tp and cp.
- NB: a tensor-parallel stage's graph depends on its parameters' DTensor specs: ``compiled_blocks`` traces
  it on a block's own parameters (gathered by FSDP2 for it, ``FSDPModule.unshard``) and a DTensor input
  (``_trace_unsharded``); a tp 1 stage's on plain unsharded tensors.
- NB: what ``blocks.profiles.compile_modelled`` excludes (cp > 1 without FullAC, SelectiveAC, --fp8) is
  refused with pp (``config.impl_rules.check_titan_pipeline``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from memplan.config import Setup
from memplan.measure.frameworks.step import activation_dtype
from memplan.measure.runs.compiled import partitioned_forward


@contextmanager
def compiled_blocks(blocks: dict[Any, Any], x: torch.Tensor) -> Iterator[None]:
    """Each block (layer key → ``Llama3TransformerBlock``) called through one partitioned forward of
    their common graph (module docstring), traced once before the step on ``x`` (``block_input``: a
    [b, s, h] input like the stage's) and parameters as the block computes with them — plain unsharded
    tensors in ``x``'s dtype (FSDP2's ``param_dtype`` or the bf16 build), or under tp (``x`` a DTensor) the
    block's own (``_trace_unsharded``) — so that no recorder sees the tracing; the blocks' own ``forward``
    restored after. The traced body is the block class's ``forward`` (not ``__call__``: FSDP2's hooks on
    the block gather and reshard outside the compiled region, as around torchtitan's compiled block)."""
    from torch.nn.utils.stateless import _reparametrize_module

    template = next(iter(blocks.values()))

    def body(inputs: dict[str, torch.Tensor], x: torch.Tensor) -> Any:
        with _reparametrize_module(template, inputs):
            return type(template).forward(template, x, None)

    compiled, _graphs = partitioned_forward(body)
    if isinstance(x, DTensor):  # a tensor-parallel stage: the graph depends on the parameters' specs
        _trace_unsharded(template, compiled, x)
    else:
        plain = {
            n: torch.empty(p.shape, dtype=x.dtype, requires_grad=True) for n, p in template.named_parameters()
        }
        plain.update({n: torch.empty(b.shape, dtype=b.dtype) for n, b in template.named_buffers()})
        compiled(plain, x.requires_grad_())  # AOTAutograd traces and partitions here; the output dropped
    for block in blocks.values():
        block.forward = _forward(block, compiled)
    try:
        yield
    finally:
        for block in blocks.values():
            del block.forward  # the class's forward again


def _trace_unsharded(block: Any, compiled: Any, x: torch.Tensor) -> None:
    """``compiled`` traced on ``block``'s own parameters as it computes with them — DTensors on the tp
    mesh, gathered first by FSDP2 (``FSDPModule.unshard``: its ``param_dtype``, resharded after) where the
    block is an FSDP2 unit — and ``x``, a DTensor like the stage's input."""
    from torch.distributed.fsdp import FSDPModule

    fsdp = isinstance(block, FSDPModule)
    if fsdp:
        block.unshard()
    try:
        inputs = {n: p.detach().requires_grad_() for n, p in block.named_parameters()}
        inputs.update(dict(block.named_buffers()))
        compiled(inputs, x.detach().requires_grad_())  # traced and partitioned; the output dropped
    finally:
        if fsdp:
            block.reshard()


def _forward(block: Any, compiled: Any) -> Any:
    def forward(x: torch.Tensor, attention_masks: Any = None, positions: Any = None) -> Any:
        # torchtitan's Decoder calls layer(h, attention_masks, positions): both None in these runs (SDPA's
        # causal mask, no positions)
        assert attention_masks is None and positions is None
        return compiled({**dict(block.named_parameters()), **dict(block.named_buffers())}, x)

    return forward


def block_input(setup: Setup, tp_mesh: Any) -> torch.Tensor:
    """A [b, s, h] block input like the step's, to trace a block on: under tp the plan hands a block its
    input as a DTensor on ``tp_mesh``, on the sequence shard with ``--sp`` (``Shard(1)``, [b, s/t, h]
    local), else whole (``Replicate()``)."""
    t, h, par = setup.training, setup.model.hidden_size, setup.parallel
    tokens = t.seq_len // par.tp if par.sp else t.seq_len
    x = torch.empty(t.micro_batch, tokens, h, dtype=activation_dtype(setup))
    if par.tp == 1:
        return x
    from torch.distributed.tensor import Replicate, Shard

    return DTensor.from_local(x, tp_mesh, [Shard(1) if par.sp else Replicate()], run_check=False)
