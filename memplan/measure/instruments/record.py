"""Generic instruments that measure one training step in PyTorch: saved tensors, FLOPs, live memory.

- `label` / `layer_scope` / `note_kept` + `SavedTensorRecorder`: what autograd keeps for backward, one record
  per storage (x and x.view(...) are one tensor), named by the label the model gave it.
- `FlopMeter`: FlopCounterMode's counting convention, split into phases (forward / backward / recompute),
  plus the CPU flash-attention formulas torch lacks (`register_cpu_sdpa_formulas`).
- memory (live-storage tracker, CUDA allocator peak and history): memplan/measure/instruments/tracker.py.

Storage identity is `StorageWeakRef(t.untyped_storage()).cdata` (the address of the C++ StorageImpl). Every
table keyed by it also holds the StorageWeakRef, whose weak count keeps the StorageImpl struct (not its data)
allocated, so an address cannot be reused by a new storage while we still remember the old one.

Known limitations:
- NB: the recorder cannot see inside non-reentrant `torch.utils.checkpoint`: its own hooks take the inner
  saves. The model reports what the checkpoint closure keeps alive with `note_kept`.
- NB: `FlopMeter` counts only ops with a formula in torch's `flop_registry` (matmul, conv, attention);
  elementwise ops, norms, softmax and the optimizer count 0, exactly as in FlopCounterMode.
- NB: a tensor subclass without a real storage (DTensor, nested tensors) is not supported.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import (
    flop_registry,
    register_flop_formula,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "fp64",
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "fp8_e4m3",
    torch.float8_e5m2: "fp8_e5m2",
    torch.bool: "bool",
    torch.uint8: "uint8",
    torch.int8: "int8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
}


def dtype_name(dtype: torch.dtype) -> str:
    """Short dtype name used in the inventory ("bf16", "fp32", "bool", "int64", ...)."""
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def storage_ref(t: torch.Tensor) -> StorageWeakRef:
    """Weak reference to t's storage; `.cdata` is the identity shared by t and all its views."""
    return StorageWeakRef(t.untyped_storage())


def storage_key(t: torch.Tensor) -> int:
    """``storage_ref(t).cdata`` without making and freeing a weak reference (the per-op and per-save paths
    of a trace): the address of t's StorageImpl, which ``UntypedStorage._cdata`` returns too."""
    return t.untyped_storage()._cdata


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(n) for n in t.shape)


# ---------------------------------------------------------------------------------------------------------
# 1. Labels, layers and the saved-tensor recorder
# ---------------------------------------------------------------------------------------------------------

_LAYER: ContextVar[int | None] = ContextVar("memplan_layer", default=None)
_RECORDER: ContextVar[SavedTensorRecorder | None] = ContextVar("memplan_recorder", default=None)


@contextmanager
def layer_scope(i: int | None) -> Iterator[None]:
    """Attribute labels and saves inside the block to transformer layer `i` (None = model level)."""
    token = _LAYER.set(i)
    try:
        yield
    finally:
        _LAYER.reset(token)


def current_layer() -> int | None:
    return _LAYER.get()


def label(t: torch.Tensor, name: str) -> torch.Tensor:
    """Name t's storage as the logical tensor `name` in the current layer; returns t (one lookup if idle)."""
    recorder = _RECORDER.get()
    if recorder is not None:
        recorder.label(t, name)
    return t


def relabel(t: torch.Tensor, name: str) -> torch.Tensor:
    """Name t's storage `name` even if it was labelled before (a reversible stack's outputs were labelled
    as the last layer's norm inputs while it ran under no_grad, where nothing is saved)."""
    recorder = _RECORDER.get()
    if recorder is not None:
        recorder.label(t, name, force=True)
    return t


def note_kept(t: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Report a tensor kept alive outside autograd's saves (a checkpoint's inputs); returns t."""
    recorder = _RECORDER.get()
    if recorder is not None:
        recorder.keep(t, name)
    return t


@dataclass(frozen=True, slots=True)
class SavedRecord:
    """One storage kept for backward. `bytes` is the whole storage: views of it are not counted again."""

    name: str  # first label of the storage, or "unlabelled"
    layer: int | None  # layer of that label (else of the first save); None = model level
    shape: tuple[int, ...]  # shape of the tensor through which the storage was first seen
    dtype: str
    bytes: int


@dataclass(frozen=True, slots=True)
class NameTotal:
    count: int
    bytes: int


def totals_by_name(records: Iterable[SavedRecord]) -> dict[str, NameTotal]:
    """Count and bytes of the saved storages per name, in order of first appearance."""
    totals: dict[str, NameTotal] = {}
    for r in records:
        old = totals.get(r.name, NameTotal(0, 0))
        totals[r.name] = NameTotal(old.count + 1, old.bytes + r.bytes)
    return totals


@dataclass(slots=True)
class _StorageInfo:
    ref: StorageWeakRef  # held so the cdata key stays unique (see module docstring)
    layer: int | None
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    name: str | None = None


class SavedTensorRecorder:
    """Record every tensor autograd saves while recording, deduplicated by storage, parameters excluded.

    Installs `saved_tensors_hooks`; pack returns `t.detach()` (same storage, no copy) and unpack is the
    identity. NB: not `t` itself: an op that saves its own output (softmax) would then hold output → grad_fn
    → saved output, a reference cycle that only the garbage collector frees (autograd's own saving avoids it).
    Run backward/recompute under `pause()`: only the forward's saves are the activations we are after.
    """

    def __init__(self, params: Iterable[torch.Tensor] = ()) -> None:
        refs = [storage_ref(p) for p in params]
        self._excluded: dict[int, StorageWeakRef] = {r.cdata: r for r in refs}
        self._storages: dict[int, _StorageInfo] = {}
        self._saved: dict[int, None] = {}  # storage keys in order of first save (or keep): the records
        self.recording = True
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._token: Any = None

    def __enter__(self) -> SavedTensorRecorder:
        self._token = _RECORDER.set(self)
        self._hooks.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._hooks.__exit__(kind, exc, tb)
        _RECORDER.reset(self._token)

    @contextmanager
    def pause(self) -> Iterator[None]:
        """Stop recording (labels, saves, kept) inside the block, e.g. around backward."""
        before, self.recording = self.recording, False
        try:
            yield
        finally:
            self.recording = before

    def _info(self, t: torch.Tensor) -> _StorageInfo | None:
        """The storage's entry, created on first sight; None for parameters (and views of them)."""
        key = storage_key(t)
        if key in self._excluded:
            return None
        info = self._storages.get(key)
        if info is None:
            nbytes = t.untyped_storage().nbytes()
            info = _StorageInfo(storage_ref(t), current_layer(), _shape(t), dtype_name(t.dtype), nbytes)
            self._storages[key] = info
        return info

    def label(self, t: torch.Tensor, name: str, force: bool = False) -> None:
        info = self._info(t) if self.recording else None
        if info is not None and (info.name is None or force):  # first label wins unless forced
            info.name, info.layer = name, current_layer()

    def _save(self, t: torch.Tensor) -> None:
        info = self._info(t) if self.recording else None
        if info is not None:
            self._saved.setdefault(info.ref.cdata)

    def keep(self, t: torch.Tensor, name: str | None = None) -> None:
        """Count t's storage as kept (deduplicated with saves), optionally labelling it first."""
        if name is not None:
            self.label(t, name)
        self._save(t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._save(t)
        return t.detach()

    def forget_freed(self) -> None:
        """Drop the saved storages already freed (called after the forward, by every measurement: the
        reference model's and ``--impl hf``'s): a node whose output the code discards dies with its
        saves, which were never kept for backward (PhiMoE's sparsemixer: the indices of
        ``masked_gates.max(dim=-1, keepdim=True)``, saved by ``MaxBackward0`` on a ``max_scores`` that only
        ``rand_like`` reads; DeepSeek's group-limited routers: ``blocks.moe.deepseek_router_rules``)."""
        self._saved = {k: None for k in self._saved if not self._storages[k].ref.expired()}

    def saved_keys(self) -> set[int]:
        """The storage keys (``storage_ref(t).cdata``) of the records."""
        return set(self._saved)

    @property
    def records(self) -> list[SavedRecord]:
        infos = [self._storages[key] for key in self._saved]
        return [SavedRecord(i.name or "unlabelled", i.layer, i.shape, i.dtype, i.nbytes) for i in infos]

    def by_name(self) -> dict[str, NameTotal]:
        return totals_by_name(self.records)

    @property
    def total_bytes(self) -> int:
        return sum(r.bytes for r in self.records)

    def per_layer_bytes(self, layer: int | None) -> int:
        return sum(r.bytes for r in self.records if r.layer == layer)


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


# ---------------------------------------------------------------------------------------------------------
# 2. FLOPs
# ---------------------------------------------------------------------------------------------------------


def cpu_flash_sdpa_flop(
    query_shape: Any, key_shape: Any, value_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any
) -> int:
    """`aten._scaled_dot_product_flash_attention_for_cpu`: torch's `sdpa_flop_count`, as for the CUDA op.

    q [b, a, s_q, d], k [b, kv, s_k, d], v [b, kv, s_k, d_v]; GQA k/v heads are broadcast to the a query
    heads, so kv does not appear. (×2 multiply-add), causal not halved:
        S = Q·Kᵀ  [b, a, s_q, s_k]: 2·b·a·s_q·s_k·d
        O = P·V   [b, a, s_q, d_v]: 2·b·a·s_q·s_k·d_v
        total = 2·b·a·s_q·s_k·(d + d_v)  (= 4·b·a·s²·d for self-attention with d_v = d)
    """
    return int(sdpa_flop_count(query_shape, key_shape, value_shape))


def cpu_flash_sdpa_backward_flop(
    grad_out_shape: Any,
    query_shape: Any,
    key_shape: Any,
    value_shape: Any,
    *args: Any,
    out_shape: Any = None,
    **kwargs: Any,
) -> int:
    """`..._flash_attention_for_cpu_backward`: torch's `sdpa_backward_flop_count`, as for the CUDA op.

    Five products over all a query heads (kv does not appear; summing dK, dV over a GQA group is not counted):
        S  = Q·Kᵀ   recomputed     2·b·a·s_q·s_k·d
        dP = dO·Vᵀ                 2·b·a·s_q·s_k·d_v
        dV = Pᵀ·dO                 2·b·a·s_q·s_k·d_v
        dQ = dS·K                  2·b·a·s_q·s_k·d
        dK = dSᵀ·Q                 2·b·a·s_q·s_k·d
        total = 2·b·a·s_q·s_k·(3·d + 2·d_v)  (= 10·b·a·s²·d with d_v = d)
    NB: 2.5× the forward, not 2×: the flash backward recomputes S = Q·Kᵀ. Eager attention (explicit bmm)
    counts 8·b·a·s²·d backward instead, and so does SDPA on CPU with dropout_p > 0: the CPU flash kernel
    has no dropout, so torch falls back to the math path (bmm, softmax, fp32-noise dropout).
    """
    return int(sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape))


def grouped_mm_flop(a_shape: Any, b_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """`_grouped_mm` (transformers' grouped_mm experts): 2·M·K·N per group, summed over the groups ``offs``
    splits the shared dimension into, which sums to the whole of it:
        [S, K]·[E, K, N] → [S, N]      (forward, dX)   2·S·K·N   (each row in one group)
        [K, S]·[S, N]    → [E, K, N]   (dW)            2·K·S·N   (each inner row in one group)
        [E, M, K]·[K, N] → [M, N]                      2·M·K·N
        [E, M, K]·[E, K, N]            (batched)       2·E·M·K·N
    """
    a, b = list(a_shape), list(b_shape)
    if len(a) == 3 and len(b) == 3:
        return 2 * a[0] * a[1] * a[2] * b[2]
    return 2 * a[-2] * a[-1] * b[-1]


def register_cpu_sdpa_formulas() -> None:
    """Teach torch's flop_registry the CPU flash kernels and the grouped GEMM (torch 2.13 counts them as
    0). Idempotent."""
    aten = torch.ops.aten
    formulas: dict[Any, Callable[..., int]] = {
        aten._scaled_dot_product_flash_attention_for_cpu: cpu_flash_sdpa_flop,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: cpu_flash_sdpa_backward_flop,
        aten._grouped_mm: grouped_mm_flop,
    }
    for op, formula in formulas.items():
        if op not in flop_registry:  # registering twice raises "duplicate registrations"
            register_flop_formula(op)(formula)


class _Mode(TorchDispatchMode):
    """TorchDispatchMode whose `with Mode() as m` is typed (torch's `__enter__` is untyped)."""

    def __enter__(self) -> Self:
        super().__enter__()
        return self


class FlopMeter(_Mode):
    """FlopCounterMode's counts, split by phase: `with meter.phase("backward"): ...`.

    A TorchDispatchMode of our own (not FlopCounterMode: its totals are keyed by nn.Module, not by phase)
    applying the same `flop_registry` the same way, decomposing ops without a formula as it does — but
    only those with no kernel of their own for their tensors' backend (`composite`), so that what runs under
    the meter is what runs without it. FLOPs go
    to the innermost active phase ("unphased" if none); nest "recompute" inside "backward".
    """

    def __init__(self) -> None:
        super().__init__()
        register_cpu_sdpa_formulas()
        self._phases: list[str] = []
        self.by_op: dict[str, dict[str, int]] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._phases.append(name)
        self.by_op.setdefault(name, {})
        try:
            yield
        finally:
            self._phases.pop()

    @property
    def totals(self) -> dict[str, int]:
        return {phase: sum(ops.values()) for phase, ops in self.by_op.items()}

    @property
    def total(self) -> int:
        return sum(self.totals.values())

    def _add(self, op: str, flops: int) -> None:
        ops = self.by_op.setdefault(self._phases[-1] if self._phases else "unphased", {})
        ops[op] = ops.get(op, 0) + flops

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        packet = func._overloadpacket
        if packet not in flop_registry and func is not _PRIM_DEVICE and composite(func, args):
            with self:  # as FlopCounterMode: count what a composite op decomposes into
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        out = func(*args, **kwargs)
        formula = flop_registry.get(packet)
        if formula is not None:
            self._add(str(packet), formula_flops(formula, str(packet), args, kwargs, out))
        return out


def composite(func: torch._ops.OpOverload, args: tuple[Any, ...]) -> bool:
    """``func`` has no kernel of its own for its tensors' backend (CPU, CUDA), so it runs as what it
    decomposes into: FlopCounterMode's decomposition is then what runs anyway. An op with one — torch's
    ``silu_backward`` has a CPU and a CUDA kernel beside its CompositeImplicitAutograd math — runs its
    kernel, as it does outside the meter: FlopCounterMode would run its math instead (sigmoid, 1 − s,
    x·(1 − s), 1 + …, two products: five [T, f] temporaries where the kernel makes its output alone),
    and a live-memory measurement under the meter would count them (torchtitan's rank peak:
    ``measure.distributed.titan``); its math holds no matmul, no FLOPs are lost."""
    device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "")
    known = _HAS_KERNEL.get((func, device))
    if known is None:
        key = {"cpu": "CPU", "cuda": "CUDA"}.get(device, "")
        known = _HAS_KERNEL[func, device] = bool(key) and torch._C._dispatch_has_kernel_for_dispatch_key(
            func.name(), key
        )
    return not known


_PRIM_DEVICE = torch.ops.prim.device.default
_HAS_KERNEL: dict[tuple[torch._ops.OpOverload, str], bool] = {}
"""``composite``'s answers by (op, device type): the kernels an op has for a backend are registered when
its library loads, before any op of it runs (a dict lookup where the dispatcher's query costs microseconds
an op, every op of a traced step)."""


def formula_flops(
    formula: Callable[..., Any], name: str, args: tuple[Any, ...], kwargs: Any, out: Any
) -> int:
    """``formula``'s FLOPs of one call. torch before 2.13 asserts that an SDPA kernel's key and value have
    the query's heads ("sdpa_flop_count: query/key/value shapes are incompatible", seen with torch
    2.11 on CUDA: the flash kernel takes grouped-query K/V as they are); a grouped-query call is then
    counted as torch 2.13 counts it, with K and V as if broadcast to the query's heads (``kv_as_query``)."""
    try:
        return int(formula(*args, **kwargs, out_val=out))
    except AssertionError:
        if "scaled_dot_product" not in name:
            raise
        return int(formula(*kv_as_query(args), **kwargs, out_val=out))


def kv_as_query(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``args`` with each [b, h, s, d] tensor of fewer heads than the most (grouped-query K and V and
    their gradients) replaced by a meta tensor of that many heads: the shapes a FLOP formula reads."""
    heads = max((a.shape[1] for a in args if isinstance(a, torch.Tensor) and a.dim() == 4), default=0)

    def widened(a: Any) -> Any:
        if isinstance(a, torch.Tensor) and a.dim() == 4 and a.shape[1] < heads and heads % a.shape[1] == 0:
            b, _, n, d = a.shape
            return torch.empty(b, heads, n, d, dtype=a.dtype, device="meta")
        return a

    return tuple(widened(a) for a in args)
