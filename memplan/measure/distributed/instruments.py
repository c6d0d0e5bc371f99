"""instruments.py on one rank of a distributed run: DTensors unwrapped, collectives counted.

- ``RankRecorder``: the saved-tensor recorder, counting a DTensor by its local shard's storage and excluding
  every parameter the model holds *when the tensor is saved* (FSDP2 swaps in the unsharded parameters for
  the duration of a module's forward, so the exclusions are refreshed from ``model.parameters()``).
- ``RankMemoryTracker``: the live-storage tracker, letting DTensor desugar into local ops first (as
  ``CommDebugMode`` does), so it sees the local tensors and the collectives' output buffers.
- ``CollectiveCounter``: ``CommDebugMode`` (torch's own count of c10d and functional collectives, DTensor's
  redistributions included) plus the bytes of each call, keyed by (dimension, collective, phase).

Bytes of a collective (``Collective.bytes``): the tensor one rank contributes per call, as the
communication tables of the literature count it (Megatron: an all-reduce of the [s, b, h] activation is
"2·s·b·h bytes" in 16-bit): all_reduce its buffer; all_gather its *input* shard; reduce_scatter its *input*
(the whole, unreduced tensor); the gathered or scattered size is the other side, ``bytes × group size`` or
``bytes / group size``.

Known limitations (NB): FSDP2 frees and re-allocates its unsharded parameters with
``untyped_storage().resize_()``, which no dispatch mode sees: ``RankMemoryTracker`` counts them live from
their first all-gather on (its peak is an upper bound under ZeRO-3). Collectives issued outside a dispatch
mode (none in this run) would not be counted.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.debug._comm_mode import _CommModeModuleTracker
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_leaves

from memplan.measure.instruments.record import SavedTensorRecorder, storage_ref
from memplan.measure.instruments.tracker import LiveMemoryTracker


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own tensor: a DTensor's local shard, anything else itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


class ParameterStorages:
    """The storages of a model's current parameters (a DTensor's by its local shard), as FSDP2 swaps its
    sharded and unsharded ones in and out of the modules: ``new`` yields those of the parameter tensors not
    seen before. A tensor seen before keeps its storage (FSDP2 frees and re-allocates an unsharded
    parameter's by ``resize_``, the same storage), so only a swap costs a look; the module tree is read
    once, at the first call (it does not change during a step). What ``model.parameters()`` on every save
    gave, without walking the tree and every storage again (a full-scale rank saves thousands of tensors)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._modules: list[nn.Module] | None = None
        self._seen: dict[int, weakref.ref[torch.Tensor]] = {}  # id → the tensor (ids are reused)

    def new(self) -> Iterator[StorageWeakRef]:
        if self._modules is None:
            self._modules = list(self.model.modules())
        for module in self._modules:
            for p in module._parameters.values():
                if p is None:
                    continue
                t = local(p)
                seen = self._seen.get(id(t))
                if seen is not None and seen() is t:
                    continue
                self._seen[id(t)] = weakref.ref(t)
                yield storage_ref(t)


class RankRecorder(SavedTensorRecorder):
    """``SavedTensorRecorder`` for one rank: DTensors by their local storage, the model's current parameters
    (sharded, unsharded or TP-local) excluded."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(())
        self.model = model
        self._param_storages = ParameterStorages(model)

    def _exclude_parameters(self) -> None:
        for ref in self._param_storages.new():
            self._excluded.setdefault(ref.cdata, ref)

    def _info(self, t: torch.Tensor) -> Any:
        self._exclude_parameters()
        return super()._info(local(t))


class RankMemoryTracker(LiveMemoryTracker):
    """``LiveMemoryTracker`` that sees the local ops a DTensor op desugars into."""

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor runs and re-dispatches its local ops to this mode
        return super().__torch_dispatch__(func, types, args, kwargs)

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        super().track(local(t) for t in tensors)


@dataclass(frozen=True, slots=True)
class Collective:
    """Calls of one collective over one parallel dimension in one phase, and the bytes they move."""

    dimension: str  # "tp", "dp", "tp+dp" (a group spanning both) or "world"
    collective: str  # all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, …
    phase: str  # forward, backward or step (after backward: gradient all-reduce, optimizer)
    count: int
    bytes: int  # summed over the calls: what this rank contributes (module docstring)

    def to_json(self) -> dict[str, Any]:
        return {
            "dimension": self.dimension,
            "collective": self.collective,
            "phase": self.phase,
            "count": self.count,
            "bytes": self.bytes,
        }


_NAMES = (
    ("reduce_scatter", "reduce_scatter"),
    ("all_gather", "all_gather"),
    ("allgather", "all_gather"),
    ("all_reduce", "all_reduce"),
    ("allreduce", "all_reduce"),
    ("all_to_all", "all_to_all"),
    ("alltoall", "all_to_all"),
    ("broadcast", "broadcast"),
)


def _short(op: str) -> str:
    """``c10d._allgather_base_`` (an overload packet's name) → ``_allgather_base_``."""
    return op.replace("::", ".").split(".")[1 if "." in op.replace("::", ".") else 0]


def collective_name(op: str) -> str:
    """``c10d::_reduce_scatter_base_`` / ``_c10d_functional::all_gather_into_tensor`` → the collective."""
    short = _short(op).lower()
    for key, name in _NAMES:
        if key in short.replace("_", "") or key in short:
            return name
    return short


def _group_name(args: Iterable[Any], known: dict[str, str]) -> str | None:
    """The process group an op runs on: a functional collective's group name (a string among its
    arguments, beside the reduce op's "sum"), or c10d's ProcessGroup object."""
    for a in args:
        if isinstance(a, str) and a in known:
            return a
        if isinstance(a, torch.ScriptObject):
            try:
                return str(torch.distributed.ProcessGroup.unbox(a).group_name)
            except (RuntimeError, AttributeError):
                continue
    return None


def _tensor_bytes(args: Any) -> int:
    """Bytes of the op's first tensor argument (or first list of tensors): what one rank contributes."""
    for a in args:
        leaves = [t for t in tree_leaves(a) if isinstance(t, torch.Tensor)]
        if leaves:
            return sum(t.numel() * t.element_size() for t in leaves)
    return 0


class CollectiveCounter(CommDebugMode):
    """``CommDebugMode`` with the bytes of every collective call, keyed by dimension (``groups``: process
    group name → dimension name), collective and phase (set ``phase`` between forward, backward, step)."""

    def __init__(self, groups: dict[str, str], modules: bool = True) -> None:
        super().__init__()
        if not modules:  # a pipeline's forwards run between backwards, which the module tracker cannot follow
            self.advanced_module_tracker = _NoModuleTracker()
        self.groups = groups
        self.phase = "forward"
        self.calls: dict[tuple[str, str, str], list[int]] = {}

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        before = sum(self.comm_counts.values())
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if out is not NotImplemented and sum(self.comm_counts.values()) > before:
            inputs = _input_args(str(func._overloadpacket), args)
            group = _group_name(args, self.groups) or ""
            key = (self.groups.get(group, "world"), collective_name(str(func._overloadpacket)), self.phase)
            entry = self.calls.setdefault(key, [0, 0])
            entry[0] += 1
            entry[1] += _tensor_bytes(inputs)
        return out

    def set_phase(self, phase: str) -> None:
        """The phase the following calls belong to (a callback for the pipeline's stage)."""
        self.phase = phase

    def collectives(self) -> list[Collective]:
        return [Collective(d, c, p, n, b) for (d, c, p), (n, b) in sorted(self.calls.items())]


class _NoModuleTracker(_CommModeModuleTracker):
    """``CommDebugMode``'s per-module attribution switched off (its hooks assume that a forward never follows
    a backward before the next root forward; 1F1B does just that). The counts stay whole."""

    def __init__(self) -> None:
        super().__init__()
        self.name = "Global"  # every call attributed to the whole model, as CommDebugMode's root entry
        self.module_parents_dict["Global"] = set()

    def __enter__(self) -> _NoModuleTracker:
        return self

    def __exit__(self, *args: object) -> None:
        return None


def _input_args(op: str, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The arguments from the one holding what this rank contributes on: c10d's in-place gathers and
    scatters take the output first (``c10d._allgather_base_(out, in, …)``, ``_reduce_scatter_base_(out,
    in, …)``, ``allgather_(outs, ins, …)``, ``reduce_scatter_(outs, ins, …)``); functional collectives
    (``_c10d_functional.*``) and all-reduces take the input first."""
    name = _short(op)
    in_place = op.startswith("c10d.")
    if in_place and name.startswith(
        ("_allgather_base", "_reduce_scatter_base", "allgather", "reduce_scatter")
    ):
        return args[1:]
    return args
