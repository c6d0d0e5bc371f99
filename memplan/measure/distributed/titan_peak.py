"""The peak of one torchtitan rank's forward and backward (``trace --impl torchtitan`` over ranks), measured
under fake tensors on torch's fake process group and set beside the estimate's.

``PeakTracker`` is the rank's live-storage tracker (``distributed.instruments.RankMemoryTracker``: DTensor
ops desugared to the local ones, every storage an op makes counted until its last reference dies) with
what that tracker cannot see made visible:

- FSDP2's unsharded parameters: ``_fsdp_param.alloc_storage`` / ``free_storage`` resize their storages
  (``untyped_storage().resize_(n)`` / ``resize_(0)``: no dispatched op) around each unit's all-gather and
  reshard; both are wrapped (``fsdp2_resizes``) so each resize moves the live bytes by its difference.
- DTensor's sharding propagation infers an op's output shape by running it on fake global-shape
  arguments through every mode on the stack, where the tracker would count them (alive while the
  propagator's cache holds them); the tracker passes them by (``propagation_unseen``).

At the highest point the live storages are split into what the estimate's moments name: the rank's
parameters and buffers (``states``: the RoPE caches are buffers, their saved views the same storage), the
saves autograd holds (``saved``, the recorder's storages), the gradients made so far (``gradients``: the
storages the parameters' ``.grad`` hold at the end of the step) and the rest by the op that made it
(``transient``): what the estimate's moment must place as its temporaries.

The estimate's side: each moment of ``analytic.peak`` less its ``optimizer`` term (the run builds no
optimizer: its states, and the master copy where the recipe keeps one, are constant through forward and
backward; under FSDP2's mixed precision the fp32 shards it steps are the run's parameters).

What is exact (tests/hf/test_torchtitan_peak.py): the loss backward moment on every layout traced (tp 2
with and without SP, ZeRO-2 and ZeRO-3 over dp 2, Llama 3.1 405B's widths on tp 8 with SP × dp 2,048),
and the whole peak where it is the loss's (the tiny model's tp 2 ranks, with ZeRO-2 too): torchtitan's
loss-parallel backward (``blocks.head.loss_parallel_backward_transient``), the loop's ids beside the
vocabulary-parallel embedding's copy (``blocks.embedding.loop_ids_bytes``), FSDP2's shards beside the
unsharded weights under ZeRO-2, under ZeRO-3 (torchtitan's "default" policy) the [norm, lm_head] unit alone
gathered at the loss, as views of its padded all-gather output
(``analytic.fsdp.moments.zero3_head_unit``); the final norm's backward without FSDP (under SP it tops
at the reduce-scatter of the lm head's input gradient, ``analytic.peak.head_input_scatter_transient``, and
the norm runs on T/t tokens); the embedding backward moment where its own backward tops its stretch.

Known limitations (each moment's measured and estimated bytes are in ``trace``'s output, ``peak.moments``):
- NB: the optimizer step is not run (torchtitan's trainer steps the fp32 parameters with
  ``torch.optim.AdamW``; under FSDP2 the run holds them as torchtitan does, fp32 shards gathered to bf16,
  ``titan.build_dtype``; without FSDP in the activation dtype, as the estimate's weights term counts
  them): the estimate's "optimizer step" moment is not compared.
- NB: the layer backward moment follows the reference model's layer, not torchtitan's, even on one
  device (measured above the estimate by 57,344 B on the tiny model; below it by 1,966,080 B at Llama 3
  8B's widths, 2 layers, s 256, and by 990 MB at 405B's on tp 8 + SP). It is the rank's highest
  estimated moment there, so the estimated peak is off by as much.
- NB: FSDP2's ZeRO-3 backward is modelled for the layers (the next unit's prefetched flat all-gather
  output and the previous unit's fp32 reduce-scatter input: ``analytic.fsdp.moments.zero3_unit_buffers``; the
  layer moment's error under ZeRO-3 equals its error without FSDP on the tiny model at tp 1 and 2, ±SP)
  and for the final norm's backward with a small head (the [norm, lm_head] unit gathered and the top
  layer's prefetched output: ``zero3_head_gather``). Not modelled: the head unit's reduce-scatter, which
  tops the final norm's stretch when the vocabulary is large (its bf16 [v/t, h] gradient, the fp32 flat
  input and output: +1.3 GB at Llama 3 8B's widths on tp 2 × dp 2), and the embedding unit's gather and
  reduce-scatter in the embedding's backward (+3.0 GB at 405B's on tp 8 × dp 2,048); at 405B's widths
  the layer moment's error differs from the one without FSDP by 159 MB (dim-0 padding over 2,048 shards
  not yet checked there).
- NB: each boundary is noted by a hook on a view of the block's output, so that the note comes before
  FSDP2's pre-backward hook on the output gathers the block's unit (the gather falls in the block's
  stretch); the model returns the lm head's view (FSDP2's warning about it is silenced: nothing writes to
  it).
- NB: the embedding backward moment is exact on one device and on tp 2 + SP at Llama 3 8B's widths
  (every layer's RoPE buffer, the loop's ids, labels and count, the embedding's clamped ids:
  ``analytic.peak``), and under SP where the stretch tops at the all-gather of the embedding output's
  gradient (``analytic.head_moments.sp_embedding_gather``: the tiny model's rank at s 64, Llama 3.1
  70B's widths on tp 8; not under the 2024 root wrapping, 8,448 B under on the tiny model).
- NB: a functional collective's wait returns the collective's tensor, as the real kernel does
  (``instruments.tracker.WAIT_TENSOR``; under fake tensors it would make a storage of its own).
- NB: real (uninitialised) tensors on the fake process group peak at the same bytes with the same parts
  (tests: tp 2, and tp 2 + SP × dp 2 under ZeRO-3); under SP the stretches of the forward and of the
  embedding's backward read differently (the fake run's SP all-gather of the embedding output's gradient
  falls inside the embedding's stretch, the real run's not).
- NB: under TP without SP, DTensor's sharding propagation picks the weight gradient's strategy by its
  cost: at Llama 3 8B's widths on tp 2 W_O's gradient is a ``Partial(sum)`` DTensor of the whole
  [h, a·d] (t× its shard, kept to the step's end); at 405B's widths on tp 8 a [f, h] gradient is
  all-gathered (1.7 GB, and its concatenated copy). Neither is modelled: the model states' gradients
  are the shard's.
- NB: kernel workspaces and temporaries freed inside one op are not seen (``tracker``'s NB); under fake
  tensors the collectives allocate their outputs as their CUDA kernels do (a new tensor per functional
  collective; c10d's in-place ones write into the buffer given).
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef

from memplan.measure.distributed.instruments import RankMemoryTracker, local
from memplan.measure.instruments.moments import estimated_moments, moment_rows, read_points
from memplan.measure.instruments.record import storage_ref
from memplan.measure.instruments.tracker import Curve, data_tensors, step_boundaries

KINDS = ("states", "gradients", "saved", "transient")
"""What is alive at the measured peak, in the order the comparison shows it."""


@dataclass(frozen=True)
class PeakRun:
    """The rank's highest live bytes over forward and backward, and what was alive then."""

    peak: int
    phase: str
    """``forward`` or ``backward``: the window the peak fell in."""
    op: str
    """The op (or FSDP2 resize) whose output made the peak."""
    parts: dict[str, int]
    """Bytes of each of ``KINDS`` alive at the peak."""
    transient: dict[str, int] = field(default_factory=dict)
    """The ``transient`` bytes by the op that made them, largest first."""
    curve: Curve = field(default_factory=Curve)
    """Live bytes after every op, with the step's boundaries (``boundaries``)."""
    windows: dict[str, tuple[int, str, dict[str, int], dict[str, int]]] = field(default_factory=dict)
    """With ``PeakTracker.keep_windows``: per boundary label, the highest point until the next boundary,
    the op there, its parts and its transient bytes by op."""

    def moments(self, names: list[str]) -> dict[str, int | None]:
        """The curve's highest point in each of the estimate's moments (``instruments.moments``'s
        stretches), None where the curve has no such stretch."""
        readings = read_points(self.curve, names)
        return {name: None if r is None else r[1] for name, r in zip(names, readings, strict=True)}


class PeakTracker(RankMemoryTracker):
    """``RankMemoryTracker`` that remembers which op made each storage, follows FSDP2's storage resizes
    (``resized``) and keeps the live set of its highest point."""

    def __init__(self) -> None:
        super().__init__()
        self._op = "before the step"
        self._made_by: dict[int, str] = {}
        self.phase = "forward"
        self.peak_live: dict[int, tuple[StorageWeakRef, str, int]] = {}
        """The live storages at the highest point: their references (which keep each key from being reused
        by a later storage, ``record``'s module docstring), the op that made them, their bytes."""
        self.peak_op = ""
        self.peak_phase = ""
        self.paused = False
        """Set while DTensor's sharding propagation infers shapes (``propagation_unseen``)."""
        self.window = "start"
        self.keep_windows = False
        """Also keep the live set at the highest point between each two boundaries (``windows``), to
        find what a moment holds."""
        self.windows: dict[str, tuple[int, str, dict[int, tuple[StorageWeakRef, str, int]]]] = {}

    def _add(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata  # ``StorageWeakRef(storage).cdata``, without making and freeing one
        if key not in self._live:
            self._made_by[key] = self._op
        super()._add(storage)
        self._check_peak()

    def _free(self, key: int) -> None:
        super()._free(key)
        self._made_by.pop(key, None)

    def _check_peak(self) -> None:
        if self.current > self._highest():
            self.peak_live = self._snapshot()
            self.peak_op, self.peak_phase = self._op, self.phase
        best = self.windows.get(self.window)
        if self.keep_windows and (best is None or self.current > best[0]):
            self.windows[self.window] = (self.current, self._op, self._snapshot())

    def _snapshot(self) -> dict[int, tuple[StorageWeakRef, str, int]]:
        return {k: (r, self._made_by.get(k, "?"), n) for k, (r, n) in self._live.items()}

    def note(self, label: str) -> None:
        super().note(label)
        self.window = label
        self._check_peak()

    def _highest(self) -> int:
        return sum(n for _, _, n in self.peak_live.values())

    def resized(self, storage: torch.UntypedStorage, op: str) -> None:
        """A storage resized in place (FSDP2): its live bytes become its new size."""
        key = storage._cdata  # ``StorageWeakRef(storage).cdata``, without making and freeing one
        if key not in self._live:
            return  # made before tracking began and never seen: resized to 0 before the step
        ref, before = self._live[key]
        after = storage.nbytes()
        self._live[key] = (ref, after)
        self.current += after - before
        self.peak = max(self.peak, self.current)
        self._window_peak = max(self._window_peak, self.current)
        if after > before:
            self._op = op
            self._made_by[key] = op
            self._check_peak()
        self.curve.samples.append(self.current)

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if self.paused and not any(issubclass(t, DTensor) for t in types):
            return func(*args, **(kwargs or {}))  # DTensor's shape inference: not the rank's memory
        self._op = str(func._overloadpacket)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def result(
        self, states: Iterable[torch.Tensor], saved: set[int], grads: Iterable[torch.Tensor]
    ) -> PeakRun:
        """The peak's live set split into ``KINDS``: ``states`` (parameters, buffers), the recorder's
        ``saved`` storage keys, the ``grads`` alive at the end; the rest by op."""
        state_keys = {storage_ref(d).cdata for t in states for d in data_tensors(local(t))}
        grad_keys = {storage_ref(d).cdata for g in grads for d in data_tensors(local(g))}
        keys = (state_keys, saved, grad_keys)
        parts, transient = split(self.peak_live, *keys)
        windows = {label: (n, op, *split(live, *keys)) for label, (n, op, live) in self.windows.items()}
        return PeakRun(self._highest(), self.peak_phase, self.peak_op, parts, transient, self.curve, windows)


def split(
    live: dict[int, tuple[StorageWeakRef, str, int]],
    state_keys: set[int],
    saved: set[int],
    grad_keys: set[int],
) -> tuple[dict[str, int], dict[str, int]]:
    """A live set's bytes in each of ``KINDS``, and its ``transient`` bytes by op, largest first."""
    parts = dict.fromkeys(KINDS, 0)
    by_op: Counter[str] = Counter()
    for key, (_, op, nbytes) in live.items():
        kind = (
            "states"
            if key in state_keys
            else "saved"
            if key in saved
            else "gradients"
            if key in grad_keys
            else "transient"
        )
        parts[kind] += nbytes
        if kind == "transient":
            by_op[op] += nbytes
    return parts, dict(by_op.most_common())


@contextmanager
def fsdp2_resizes(tracker: PeakTracker) -> Iterator[None]:
    """FSDP2's ``alloc_storage`` / ``free_storage`` (``_fsdp_param``; ``_fsdp_param_group`` imports the
    first by name) reported to ``tracker`` after they resize."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    alloc, free = _fsdp_param.alloc_storage, _fsdp_param.free_storage

    def alloc_reported(t: torch.Tensor) -> None:
        alloc(t)
        tracker.resized(t.untyped_storage(), "fsdp2 all-gather (unsharded parameter)")

    def free_reported(t: torch.Tensor) -> None:
        free(t)
        tracker.resized(t.untyped_storage(), "fsdp2 reshard")

    with (
        mock.patch.object(_fsdp_param, "alloc_storage", alloc_reported),
        mock.patch.object(_fsdp_param, "free_storage", free_reported),
        mock.patch.object(_fsdp_param_group, "alloc_storage", alloc_reported),
    ):
        yield


@contextmanager
def propagation_unseen(tracker: PeakTracker) -> Iterator[None]:
    """DTensor's sharding propagation (``ShardingPropagator._propagate_tensor_meta_non_cached``) infers
    an op's output shape by running it on fake arguments it makes (``OpSchema.gen_fake_args``: the
    global-shape tensors), through every mode on the stack: ``tracker`` passes them by."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    infer = ShardingPropagator._propagate_tensor_meta_non_cached

    def unseen(self: Any, *args: Any, **kwargs: Any) -> Any:
        tracker.paused = True
        try:
            return infer(self, *args, **kwargs)
        finally:
            tracker.paused = False

    with mock.patch.object(ShardingPropagator, "_propagate_tensor_meta_non_cached", unseen):
        yield


@contextmanager
def boundaries(model: Any, tracker: PeakTracker) -> Iterator[None]:
    """The step's boundaries on the tracker's curve (``instruments.tracker.step_boundaries``) on
    torchtitan's embedding, blocks, final norm and head."""
    with (
        step_boundaries(
            tracker, model.tok_embeddings, list(model.layers.values()), model.norm, model.lm_head
        ),
        warnings.catch_warnings(),
    ):
        # FSDP2's root warns that the model returns a view (the lm head's): nothing writes to it
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        yield


def grads_of(model: Any) -> list[torch.Tensor]:
    return [p.grad for p in model.parameters() if p.grad is not None]


def peak_json(est: Any, run: PeakRun) -> dict[str, Any]:
    """``trace --impl torchtitan``'s ``peak`` object: the measured peak of forward and backward beside the
    estimate's highest moment, both without the optimizer's states; each moment estimated and measured
    (the curve's highest point in its stretch); the measured live set's parts."""
    estimated = estimated_moments(est)
    measured = run.moments(list(estimated))
    phase = max(estimated, key=lambda k: estimated[k])
    moments = moment_rows(estimated, measured)
    return {
        "estimated": estimated[phase],
        "estimated_phase": phase,
        "moments": moments,
        "measured": run.peak,
        "measured_phase": run.phase,
        "measured_op": run.op,
        "measured_parts": run.parts,
        "measured_transient": run.transient,
        "delta": run.peak - estimated[phase],
        "equal": run.peak == estimated[phase],
    }
