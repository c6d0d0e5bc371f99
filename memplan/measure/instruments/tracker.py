"""Memory over one training step: live-storage bytes on CPU (and fake tensors), the CUDA allocator on a GPU.

- `LiveMemoryTracker`: exact live-storage bytes, window peaks (`mark`) and the curve of live bytes after
  every op with labelled boundaries (`note`: a layer's forward or backward, the end of a phase).
- `cuda_peak`: the CUDA caching allocator's own peak over a block, for runs on a GPU.
- `Curve` + `cuda_history_curve`: the measured curve on a GPU, from the allocator's recorded history
  (``torch.cuda.memory._record_memory_history``: one event per allocation and free).

Known limitations:
- NB: `LiveMemoryTracker` sees the storages that op outputs own. Kernel workspaces and temporaries freed
  inside one op, allocator rounding/caching/fragmentation, and `untyped_storage().resize_()` are not seen.
- NB: on a GPU a boundary is placed on the allocator's history by its time stamp (``time_us``, the clock
  of the history's entries); without time stamps the boundaries are not placed (the curve alone is drawn).
  Not run in CI (no GPU there): `cuda_history_curve` is tested on a synthetic history.
"""

from __future__ import annotations

import bisect
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from memplan.analytic.allocator import Alloc, Event, Free
from memplan.measure.instruments.record import _Mode


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or outputs (nested tuples, lists and dicts; an aten op takes no
    other container): ``tree_leaves`` filtered to tensors, without the pytree machinery's cost on every op
    of a traced step (2.6 % of a traced test's samples)."""
    out: list[torch.Tensor] = []
    stack = [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (tuple, list)):
            stack.extend(reversed(x))
        elif isinstance(x, dict):
            stack.extend(reversed(list(x.values())))
    return out


def data_tensors(t: torch.Tensor) -> Iterator[torch.Tensor]:
    """The tensors that hold ``t``'s bytes: ``t`` itself, or for a wrapper subclass (torchao's
    ``WeightWithDynamicFloat8CastTensor`` and ``Float8TrainingTensor``, a DTensor) its inner tensors
    (``__tensor_flatten__``), recursively. A wrapper's own storage holds no data (``_make_wrapper_subclass``:
    a storage of the outer dtype's nbytes with no allocation), so counting it would count the weight again
    in the wrapper's dtype (fp32 for torchao's weight wrapper, whose inner tensor is FSDP2's fp32 shard)."""
    if not is_traceable_wrapper_subclass(t):
        yield t
        return
    names, _ = t.__tensor_flatten__()
    for name in names:
        inner = getattr(t, name)
        if isinstance(inner, torch.Tensor):
            yield from data_tensors(inner)


@dataclass(frozen=True, slots=True)
class Curve:
    """Live bytes over a step: ``samples`` in time order, and labelled boundaries ``notes`` (label, index
    of the sample taken at that boundary). ``max(samples)`` is the measured peak of the window."""

    samples: list[int] = field(default_factory=list)
    notes: list[tuple[str, int]] = field(default_factory=list)

    @property
    def peak(self) -> int:
        return max(self.samples, default=0)


@dataclass(frozen=True, slots=True)
class MemoryMark:
    label: str
    current: int  # live bytes when the mark was taken
    peak: int  # highest live bytes since the previous mark (or since tracking began)


WAIT_TENSOR = getattr(getattr(torch.ops, "_c10d_functional", None), "wait_tensor", None)
"""A functional collective's wait (``_c10d_functional.wait_tensor``; None without torch.distributed): the
real kernel (c10d's ``Functional.cpp``) waits and returns its argument, the same storage; under fake
tensors it makes a new one, which a tracker would count as memory the GPU never holds
(tests/measure/test_fake_wait.py)."""


class LiveMemoryTracker(_Mode):
    """Exact live bytes of every storage allocated by an op while active, plus those given to `track`.

    Why our own mode rather than torch.distributed._tools.mem_tracker.MemTracker: that private tool needs
    nn.Module and optimizer hooks for its categories, monkey-patches UntypedStorage.resize_, and rounds
    sizes the CUDA way; we need only exact storage bytes, on CPU and fake tensors, in ~50 lines.

    A storage is new when an op output's storage is neither tracked nor one of the op's inputs' storages
    (views and in-place results alias an input). Its end is exact: torch keeps one Python object per
    storage while the C++ storage lives, so a `weakref.finalize` on it fires when the last reference (a
    view, autograd's saved variable, ...) dies. Peak = max of live bytes after each op's outputs appear;
    inputs cannot die during an op, so that is the peak of the live set. Frees keep being counted after
    exit; allocations only while active.
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0
        self._window_peak = 0
        self.marks: list[MemoryMark] = []
        self.curve = Curve()
        """Live bytes after each op (and at each `track` and `note`): its maximum is `peak`, since live
        bytes only grow while an op's outputs appear and frees between ops only lower them."""
        self.events: list[Event] = []
        """Every storage's allocation and free, in order (``analytic.allocator``'s stream: what the CUDA
        caching allocator would have been asked for; replay it with ``analytic.allocator.replay``)."""
        self._ids: dict[int, int] = {}

    def track(self, tensors: Iterable[torch.Tensor]) -> None:
        """Count pre-existing tensors (parameters, optimizer states) as live from now on."""
        for t in tensors:
            for d in data_tensors(t):
                self._add(d.untyped_storage())
        self.curve.samples.append(self.current)

    def note(self, label: str) -> None:
        """A labelled boundary on the curve (a layer's forward done, a phase's end): the bytes live now."""
        self.curve.samples.append(self.current)
        self.curve.notes.append((label, len(self.curve.samples) - 1))

    def mark(self, label: str) -> MemoryMark:
        """Close a window (e.g. "forward"): its peak, and the bytes live now; the next window starts here.
        Also a `note` on the curve."""
        m = MemoryMark(label, self.current, self._window_peak)
        self.marks.append(m)
        self._window_peak = self.current
        self.note(label)
        return m

    def _add(self, storage: torch.UntypedStorage) -> None:
        if storage._cdata in self._live:  # the StorageImpl's address: ``StorageWeakRef(storage).cdata``
            return
        ref = StorageWeakRef(storage)
        nbytes = storage.nbytes()
        self._live[ref.cdata] = (ref, nbytes)
        self._ids[ref.cdata] = len(self.events)
        self.events.append(Alloc(len(self.events), nbytes))
        weakref.finalize(storage, self._free, ref.cdata).atexit = False
        self.current += nbytes
        self.peak = max(self.peak, self.current)
        self._window_peak = max(self._window_peak, self.current)

    def _free(self, key: int) -> None:
        _, nbytes = self._live.pop(key)
        self.current -= nbytes
        self.events.append(Free(self._ids.pop(key)))

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if WAIT_TENSOR is not None and func is WAIT_TENSOR.default:
            out = args[0]  # the collective's own tensor, as the real kernel returns it
        inputs = {d.untyped_storage()._cdata for t in tensor_leaves((args, kwargs)) for d in data_tensors(t)}
        for t in tensor_leaves(out):
            for d in data_tensors(t):
                storage = d.untyped_storage()
                if storage._cdata not in inputs:
                    self._add(storage)
        self.curve.samples.append(self.current)
        return out


class OpLiveTracker(LiveMemoryTracker):
    """``LiveMemoryTracker`` that also keeps, after every op, the op's name and the live bytes then
    (``rows``): where in a step two runs part (benchmarks/eager_core_order.py, the ring's ledger tests).
    ``read``: what "live" means instead of the tracked storages' bytes — on a GPU
    ``torch.cuda.memory_allocated`` (a kernel's workspace freed inside the op shows in the allocator's
    ``max_memory_allocated`` only)."""

    def __init__(self, read: Callable[[], int] | None = None) -> None:
        super().__init__()
        self.rows: list[tuple[str, int]] = []
        self._read = read

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.rows.append((str(func), self.current if self._read is None else self._read()))
        return out


class CudaMemoryApi(Protocol):
    """The slice of `torch.cuda` that `cuda_peak` uses (injectable for tests without a GPU)."""

    def synchronize(self, device: int | None = None) -> None: ...
    def reset_peak_memory_stats(self, device: int | None = None) -> None: ...
    def memory_allocated(self, device: int | None = None) -> int: ...
    def max_memory_allocated(self, device: int | None = None) -> int: ...
    def memory_stats(self, device: int | None = None) -> dict[str, Any]: ...


@dataclass(slots=True)
class CudaPeak:
    """Allocator figures for one window; filled when the `cuda_peak` block exits."""

    baseline: int = 0  # bytes allocated when the window opened (weights, optimizer states, ...)
    peak: int = 0  # max_memory_allocated in the window, absolute (includes baseline)
    reserved_peak: int = 0  # memory_stats()["reserved_bytes.all.peak"]: what nvidia-smi sees, ≥ peak
    alloc_retries: int = 0  # memory_stats()["num_alloc_retries"]: > 0 means the cache was flushed to fit

    @property
    def peak_above_baseline(self) -> int:
        return self.peak - self.baseline


@contextmanager
def cuda_peak(device: int | None = None, api: CudaMemoryApi | None = None) -> Iterator[CudaPeak]:
    """Measure the CUDA caching allocator's peak over the block (synchronized at both ends)."""
    cuda = api if api is not None else cast(CudaMemoryApi, torch.cuda)
    cuda.synchronize(device)
    cuda.reset_peak_memory_stats(device)  # resets both allocated and reserved peaks
    result = CudaPeak(baseline=cuda.memory_allocated(device))
    yield result
    cuda.synchronize(device)  # kernels still queued may not have allocated yet
    stats = cuda.memory_stats(device)
    result.peak = cuda.max_memory_allocated(device)
    result.reserved_peak = int(stats.get("reserved_bytes.all.peak", 0))
    result.alloc_retries = int(stats.get("num_alloc_retries", 0))


# ---------------------------------------------------------------------------------------------------------
# The curve on a GPU: the caching allocator's recorded history
# ---------------------------------------------------------------------------------------------------------
class CudaCurveRecorder:
    """Record the allocator's history over a block (``_record_memory_history``) and the time of each
    labelled boundary; ``curve()`` then builds the `Curve` (``cuda_history_curve``). Needs a GPU."""

    def __init__(self) -> None:
        self.baseline = 0
        self.times: list[tuple[str, int]] = []
        self.snapshot: Mapping[str, Any] = {}

    @contextmanager
    def recording(self) -> Iterator[CudaCurveRecorder]:
        torch.cuda.synchronize()
        self.baseline = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=1_000_000)
        try:
            yield self
            torch.cuda.synchronize()
            self.snapshot = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)

    def note(self, label: str) -> None:
        torch.cuda.synchronize()  # the kernels before the boundary have allocated by now
        self.times.append((label, time.time_ns() // 1000))

    def curve(self, device: int = 0) -> Curve:
        traces = self.snapshot.get("device_traces", [])
        events = traces[device] if device < len(traces) else []
        return cuda_history_curve(events, self.baseline, self.times)


def cuda_history_events(events: Sequence[Mapping[str, Any]]) -> list[Event]:
    """The allocator's recorded history (``_record_memory_history``'s device trace) as an allocation stream:
    each ``alloc`` (size as requested, its ``stream``) and its first ``free_requested`` (or
    ``free_completed``), keyed by address; segment events are the allocator's own decisions, left out."""
    ids: dict[int, int] = {}
    out: list[Event] = []
    for e in events:
        action, addr = e.get("action"), int(e.get("addr", 0))
        if action == "alloc":
            ids[addr] = len(out)
            out.append(Alloc(len(out), int(e["size"]), int(e.get("stream", 0))))
        elif action in ("free_requested", "free_completed") and addr in ids:
            out.append(Free(ids.pop(addr)))
    return out


def cuda_history_curve(
    events: Sequence[Mapping[str, Any]], baseline: int, times: Sequence[tuple[str, int]] = ()
) -> Curve:
    """Allocated bytes after each allocator event, from ``baseline`` (what was allocated when recording
    began): an ``alloc`` adds its size, its first ``free_requested`` (or ``free_completed``) removes it,
    keyed by address; segment events do not change what is allocated. Each boundary ``(label, time_us)``
    is placed at the last event at or before its time (events carry ``time_us`` in torch ≥ 2.1)."""
    live: dict[int, int] = {}
    current, samples, stamps = baseline, [baseline], [0]
    for e in events:
        action, addr = e.get("action"), int(e.get("addr", 0))
        if action == "alloc":
            live[addr] = int(e["size"])
            current += live[addr]
        elif action in ("free_requested", "free_completed") and addr in live:
            current -= live.pop(addr)
        else:
            continue
        samples.append(current)
        stamps.append(int(e.get("time_us", 0)))
    notes: list[tuple[str, int]] = []
    if any(stamps[1:]):
        notes = [(label, max(0, bisect.bisect_right(stamps, t) - 1)) for label, t in times]
    return Curve(samples, notes)


@contextmanager
def step_boundaries(
    tracker: LiveMemoryTracker, embedding: Any, layers: Sequence[Any], norm: Any, head: Any
) -> Iterator[None]:
    """The step's boundaries on ``tracker``'s curve, as ``instruments.moments`` reads them: "start",
    "forward i" when layer i's forward returns, and when an output gradient is ready (that module's
    backward begins) "backward lm_head", "backward final_norm", "backward i", "backward embedding": a hook
    on a view of the module's output, registered by a forward hook (a view's gradient is ready before any
    hook on the output runs: under FSDP2 the note comes before its pre-backward hook gathers the unit, so
    the gather falls in the module's backward); a module that returns a tuple (transformers' decoder
    layers) has its first element, the hidden states, viewed."""
    handles = []

    def on_grad(label: str) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            tracker.note(label)

        return hook

    def watch(module: Any, label: str, forward: str | None = None) -> None:
        def after(mod: Any, args: Any, out: Any) -> Any:
            if forward is not None:
                tracker.note(forward)
            first = out[0] if isinstance(out, tuple) else out
            if not (isinstance(first, torch.Tensor) and first.requires_grad):
                return None
            view = first.view_as(first)
            view.register_hook(on_grad(label))
            return (view, *out[1:]) if isinstance(out, tuple) else view

        handles.append(module.register_forward_hook(after))

    watch(embedding, "backward embedding")
    for i, layer in enumerate(layers):
        watch(layer, f"backward {i}", f"forward {i}")
    watch(norm, "backward final_norm")
    watch(head, "backward lm_head")
    tracker.note("start")
    try:
        yield
    finally:
        for h in handles:
            h.remove()
