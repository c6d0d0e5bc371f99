"""What a transformer block keeps for backward under ``torch.compile`` (``--compile``), measured.

torchtitan's ``apply_compile`` compiles each block alone (``torch.compile(block)``); the embedding, final
norm, head and loss run eagerly. What a compiled block keeps is what AOTAutograd's partitioner returns from
the compiled forward for the backward: ``min_cut_rematerialization_partition``
(torch/_functorch/partitioners.py) over the joint graph traced with Inductor's decompositions
(``torch._inductor.decomposition.select_decomp_table``), as ``torch.compile``'s Inductor backend runs it. No
kernel is compiled: the forward and backward "compilers" record the graphs and run them boxed
(``make_boxed_func``), under fake tensors, so any size traces in seconds
(../shared/reference/full-scale-on-cpu.md).

The saved values are the forward graph's outputs beyond the block's own output. Each is traced through its
views to the storage it keeps (``_base``): a parameter or a view of one (a transposed weight) and the rotary
tables (graph inputs the model keeps anyway) are no new memory; the block's input x is (the previous
layer's output, kept alive by this block). Storages are counted once.

``measure_compiled`` puts the block's saves in place of the eager layers' in an eager run of the whole model
(the embedding, head and loss are not compiled; every block is the same graph, compiled once): the
``Measured`` that ``trace --compile`` sets beside the estimate (``blocks.profiles.compile_modelled``).

Known limitations:
- NB: CPU kernels only (the CPU flash op): on CUDA the flash op's RNG state is kept as well (eager keeps it
  too); ``trace --compile --device cuda`` is refused.
- NB: with ``--checkpointing full`` a checkpointed block keeps its input alone, compiled or not: the eager
  run's layer records are used.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import fx

from memplan.config import Checkpointing, Setup
from memplan.engine import Result
from memplan.measure.compare.impl import impl_comparison_json
from memplan.measure.instruments.measured import Measured
from memplan.measure.instruments.record import SavedRecord, dtype_name
from memplan.measure.reference.model import Consts, Layer, Reference
from memplan.measure.runs.run import measure

_aten = torch.ops.aten
VIEW_OPS = frozenset(
    {
        _aten.view.default,
        _aten._unsafe_view.default,
        _aten.reshape.default,
        _aten.permute.default,
        _aten.t.default,
        _aten.transpose.int,
        _aten.alias.default,
        _aten.expand.default,
        _aten.unsqueeze.default,
        _aten.squeeze.dim,
        _aten.squeeze.default,
        _aten.slice.Tensor,
        _aten.select.int,
        _aten.as_strided.default,
    }
)
"""Ops whose output shares its input's storage: a saved view keeps its base's storage."""


def _base(node: fx.Node) -> fx.Node:
    """The node whose storage ``node`` is a view of (itself when it is no view)."""
    while node.op == "call_function" and node.target in VIEW_OPS:
        arg = node.args[0]
        assert isinstance(arg, fx.Node)
        node = arg
    return node


def _storage_bytes(value: torch.Tensor) -> int:
    return int(value.untyped_storage().nbytes())


def _op_name(target: object) -> str:
    """``aten.mm.default`` → ``mm``; ``operator.getitem`` → ``getitem``."""
    text = str(target)
    return text.split(".")[1] if text.startswith("aten.") else getattr(target, "__name__", text)


def saved_records(forward: fx.GraphModule, n_params: int, user_outputs: int, layer: int) -> list[SavedRecord]:
    """The storages the forward graph returns for backward beyond its ``user_outputs``; placeholders are the
    parameters (``n_params`` first), then x, then the rotary tables."""
    placeholders = [n for n in forward.graph.nodes if n.op == "placeholder"]
    x = placeholders[n_params]
    output = next(n for n in forward.graph.nodes if n.op == "output")
    records: list[SavedRecord] = []
    seen: set[str] = set()
    for node in output.args[0][user_outputs:]:
        if not isinstance(node, fx.Node):
            continue
        base = _base(node)
        value = base.meta.get("val")
        if not isinstance(value, torch.Tensor) or base.name in seen:
            continue  # a symbolic size, or a storage counted already
        if base.op == "placeholder" and base is not x:
            continue  # a parameter or the rotary tables: the model keeps them anyway
        seen.add(base.name)
        op = "input" if base is x else _op_name(base.target)
        name = f"compiled.{base.name} ({op})"
        shape = tuple(int(d) for d in value.shape)
        records.append(SavedRecord(name, layer, shape, dtype_name(value.dtype), _storage_bytes(value)))
    return records


def partitioned_forward(body: Any) -> tuple[Any, dict[str, fx.GraphModule]]:
    """``body`` through AOTAutograd with Inductor's decompositions and the min-cut partitioner, its forward
    and backward graphs recorded (run boxed, no kernel compiled): the compiled callable and the graphs it
    fills on its first call."""
    from torch._functorch._aot_autograd.utils import make_boxed_func
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    graphs: dict[str, fx.GraphModule] = {}

    def record(kind: str) -> Any:
        def compiler(gm: fx.GraphModule, _inputs: Any) -> Any:
            graphs[kind] = gm
            return make_boxed_func(gm)

        return compiler

    compiled = aot_function(
        body,
        fw_compiler=record("forward"),
        bw_compiler=record("backward"),
        partition_fn=min_cut_rematerialization_partition,
        decompositions=select_decomp_table(),
    )
    return compiled, graphs


def compiled_block_records(setup: Setup, layer: int = 0) -> list[SavedRecord]:
    """What block ``layer`` of the reference model keeps under ``torch.compile`` (module docstring)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    m, t = setup.model, setup.training
    eager = setup.model_copy(update={"impl": setup.impl.model_copy(update={"compile": False})})
    with torch.device("meta"):
        ref = Reference(eager.model_copy(update={"model": m.model_copy(update={"num_layers": 1})}), "meta")
    block = ref.layers[0]
    assert isinstance(block, Layer)
    meta = dict(block.named_parameters())

    def body(params: dict[str, torch.Tensor], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Any:
        args = (ref.layer_body, block, 0, x, Consts(cos, sin, None))
        return torch.func.functional_call(block, params, args)

    compiled, graphs = partitioned_forward(body)
    act = next(iter(meta.values())).dtype
    with FakeTensorMode():
        params = {k: torch.empty(v.shape, dtype=v.dtype, requires_grad=True) for k, v in meta.items()}
        x = torch.empty(t.micro_batch, t.seq_len, m.hidden_size, dtype=act, requires_grad=True)
        cos, sin = (torch.empty(t.seq_len, m.dim, dtype=act) for _ in range(2))
        compiled(params, x, cos, sin).sum().backward()
    return saved_records(graphs["forward"], len(params), 1, layer)


def measure_compiled(setup: Setup) -> Measured:
    """The whole model with every block compiled (module docstring): an eager run's model-level saves and
    FLOPs (the partitioner runs the same matmuls), and each block's compiled saves."""
    eager = setup.model_copy(update={"impl": setup.impl.model_copy(update={"compile": False})})
    base = measure(eager, fake=True)
    if setup.strategy.checkpointing is Checkpointing.FULL:
        return base  # a checkpointed block keeps its input alone, compiled or not
    block = compiled_block_records(setup)
    layers = [replace(r, layer=i) for i in range(setup.model.num_layers) for r in block]
    model = [r for r in base.records if r.layer is None]
    return Measured(records=model + layers, flops=base.flops, by_op=base.by_op)


def compiled_comparison_json(est: Result, meas: Measured) -> dict[str, Any]:
    """``trace --compile``: ``impl_comparison_json``'s pairing (the partitioner's values have graph names, the
    estimate inventory names), equal only when exact: every layer, the total and the FLOPs to the byte."""
    out = impl_comparison_json(est, meas)
    diff = out["diff"]
    flops_equal = all(row["delta"] == 0 for row in diff["flops"])
    diff["tolerance"] = 0.0
    diff["equal"] = diff["exact"] = diff["exact"] and flops_equal
    return out
