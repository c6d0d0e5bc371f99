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

``compiled_rank_blocks(model, ids)`` does the same for one rank of the unpipelined model over tp and dp
(``titan.measure_titan_rank``): there a block computes with DTensors — its tensor-parallel shards, gathered
by FSDP2 around its call under dp — so its graph is traced from the first block's own call (its parameters
and input as the rank's forward hands them: the DTensor specs the graph depends on), in a forward run
before the measured step, under no recorder.

Known limitations:
- NB: without activation checkpointing only; with ``FullAC`` a compiled block keeps its input alone,
  compiled or not (``runs.compiled``'s NB): the stages run the eager ``FullAC`` blocks, at any tp and cp.
- NB: a tensor-parallel stage's graph depends on its parameters' DTensor specs: ``compiled_blocks`` traces
  it on a block's own parameters (gathered by FSDP2 for it, ``FSDPModule.unshard``) and a DTensor input
  (``_trace_unsharded``); a tp 1 stage's on plain unsharded tensors.
- NB: what ``blocks.profiles.compile_modelled`` excludes (tp > 1 without --sp, cp > 1 without FullAC,
  SelectiveAC, --fp8) is refused with pp (``config.impl_rules.check_titan_pipeline``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from memplan.measure.runs.compiled import partitioned_forward


@contextmanager
def compiled_blocks(blocks: dict[int, Any], x: torch.Tensor) -> Iterator[None]:
    """Each block (layer index → ``Llama3TransformerBlock``) called through one partitioned forward of
    their common graph (module docstring), traced once before the step on ``x`` (a [b, s, h] input like
    the stage's) and plain parameters as the block computes with them — unsharded, in ``x``'s dtype (FSDP2's
    ``param_dtype`` or the bf16 build) — so that no recorder sees the tracing; the blocks' own ``forward``
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


@contextmanager
def compiled_rank_blocks(model: Any, ids: torch.Tensor) -> Iterator[None]:
    """Each block of a tensor- or data-parallel rank's ``model`` (torchtitan's ``Decoder``) called through
    one partitioned forward of their common graph (module docstring), traced in a forward of ``ids``
    without gradients at the first block's call: its parameters as they are then (FSDP2's pre-forward hook
    has gathered them; DTensors on the tp mesh) and its input, both detached and requiring grad as in the
    step. That forward runs to its end, so FSDP2's hooks leave every unit resharded; the blocks' own
    ``forward`` restored after."""
    from torch.nn.utils.stateless import _reparametrize_module

    blocks = list(model.layers.values())
    template = blocks[0]
    traced: list[Any] = []

    def body(inputs: dict[str, torch.Tensor], x: torch.Tensor) -> Any:
        with _reparametrize_module(template, inputs):
            return type(template).forward(template, x, None)

    def trace(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        compiled, _graphs = partitioned_forward(body)
        inputs = {n: p.detach().requires_grad_() for n, p in module.named_parameters()}
        inputs.update(dict(module.named_buffers()))
        with torch.enable_grad():
            compiled(inputs, args[0].detach().requires_grad_())  # traced and partitioned; output dropped
        traced.append(compiled)

    handle = template.register_forward_pre_hook(trace, with_kwargs=True)
    try:
        with torch.no_grad():
            model(ids)
    finally:
        handle.remove()
    for block in blocks:
        block.forward = _forward(block, traced[0])
    try:
        yield
    finally:
        for block in blocks:
            del block.forward  # the class's forward again
