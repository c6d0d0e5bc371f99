"""Memory as the GPU reports it: the step's allocations replayed through torch's caching allocator
(``analytic.allocator``), and what the device holds outside it.

The stream of the most loaded device (``alloc_stream``: the timeline at every layer, term by term, the
saves and states as their tensors, cuBLAS's two workspaces) is replayed ``STEPS`` times: the second step finds
the first one's cached segments, so the peaks are those ``torch.cuda.memory_stats()`` keeps over a run.
The requested peak equals the estimate's peak (plus the workspaces) by construction (less the sharded
gradients where they are the reduce-scatter stream's, NB below); the allocated peak adds the 512-byte
rounding and the blocks handed out unsplit; the reserved peak adds the segments' slack. Replays are
memoised on the stream's inputs (``alloc_stream.StreamInputs``).

The fit search's replays (``refuses``, and ``replay_stream`` once those have loaded it) run in Python
(``analytic.allocator.plain.replay_plain``) unless ``MEMPLAN_JIT`` asks for them compiled by numba
(``analytic.allocator.jit``: the same coding and decisions, tested equal; the optional extra jit). Loading the
compiled replay costs a process ``JIT_LOAD_SECONDS``, about what one command's replays take in Python (0.5–1.2
s for the searches of docs/fit.md, "Rent, then buy"), so one ``memplan fit`` gains nothing from it; a process
that runs many searches does. ``MEMPLAN_JIT``: ``0`` (the default) never loads it; ``1`` at the first replay
(benchmarks/bench_fit.py's in-process searches); ``auto`` (the test suite's workers, tests/conftest.py) rents
before it buys — the replays run in Python until they have spent ``JIT_LOAD_SECONDS`` (L) in this process,
then compiled (``_compiled``). Whatever the searches, ``auto``'s replays and load take at most twice what the
better of "never load" (P, its replays in Python) and "load at once" (L + J, J compiled) would have: P ≤ L
costs P; otherwise L in Python (to within one replay), L to load and the rest compiled, J' ≤ J and J' ≤ P − L
(compiled is faster), 2L + J' ≤ min(2(L + J), L + P) ≤ 2·min(P, L + J) — the deterministic rent-or-buy bound
(Karlin, Manasse, Rudolph and Sleator 1988, "Competitive snoopy caching", Algorithmica 3). A single command
whose replays take about L is its worst case: it pays both.

Outside the allocator (in ``nvidia-smi``'s used memory, not in ``memory_reserved()``): the CUDA context,
and NCCL's buffers (``analytic.nccl``, per communicator of the layout: ``time.comm.buffers``; added by the
callers above this layer, ``Reserved.nccl``).

Known limitations:
- NB: one stream. FSDP2's all-gather stream has its own pool: ``analytic.fsdp.buffers`` replays it apart,
  the estimate reports it (``memory.fsdp_all_gather_stream``) and the verdict and ``fit`` keep its
  reserved bytes back from this replay's memory (``search.budget``); the flat all-gather outputs the
  peak's moments count (``Peak.all_gather_stream``: the reference's FSDP2, ``analytic.fsdp.root``) are
  left out of this stream's terms (torchtitan's, ``analytic.fsdp.moments.zero3_unit_buffers``, are not
  yet). torch DDP's buckets
  (``bucket_cap_mb``, 25 MiB each by default; with the default ``gradient_as_bucket_view=False`` one more
  copy of the gradients, ``time.comm.buffers.ddp_bucket_bytes``) are default-stream allocations made
  before the first step and never freed: kept back the same way (``memory.ddp_buckets``), not replayed
  as allocations of this stream (their 2 MiB segment rounding is not counted). Under FSDP2's mixed
  precision (``analytic.fsdp.buffers.reduce_scatter_modelled``) the reduce-scatter's input is a
  default-stream allocation of the backward's moments (in their transients), while its outputs, the
  sharded gradients, are the reduce-scatter stream's blocks (torch 2.13 ``foreach_reduce``): this replay
  then holds no gradients (its requested peak is the estimate's less the gradients of the peak's moment),
  and ``analytic.fsdp.buffers.reduce_scatter_stream`` replays that pool apart (reported, not kept back:
  ``search.budget``). Elsewhere FSDP2's reduce-scatter buffers are not counted; ``--reserve`` keeps
  memory back for what is not judged. NCCL's own buffers are (``analytic.nccl``), outside the allocator.
- NB: the CUDA context's size depends on the driver, the CUDA version and lazy loading; the constant is
  one published measurement, not a bound.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import time
from dataclasses import dataclass
from types import ModuleType

from memplan.alloc_stream import (
    MEMO_MAX,
    STEPS,
    StreamInputs,
    clear_inputs,
    codes,
    stream_inputs,
)
from memplan.analytic.allocator import CUBLAS_THREADS, Allocator, Replay
from memplan.analytic.allocator.plain import demand, replay_plain
from memplan.engine import Result
from memplan.presets import GpuPreset

CUBLAS_WORKSPACE_SM90 = 4096 * 1024 * 8
"""cuBLAS workspace torch takes on a compute-capability 9.0 GPU (Hopper) without
``CUBLAS_WORKSPACE_CONFIG``: ``:4096:8``, 8 chunks of 4096 KiB = 32 MiB (aten/src/ATen/cuda/
CublasHandlePool.cpp, ``parseChosenWorkspaceSize``: ``sm90 ? 4096 * 8 * 1024 : ...``)."""
CUBLAS_WORKSPACE_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8
"""…on every other GPU: ``:4096:2:16:8``, 2 × 4096 KiB + 8 × 16 KiB = 8 MiB + 128 KiB (the same function)."""

CUDA_CONTEXT = 767 * 2**20
"""What a training process holds on the GPU outside the caching allocator once a step has run: the CUDA
context, the kernel modules the step loaded into it and the libraries' handles (cuBLAS, cuDNN).
Measured on an H200 (driver 580.159.04, CUDA 13.0, torch 2.11.0+cu130; benchmarks/cuda_context.py,
docs/gpu-profile.md): the device's used memory less ``memory_reserved()`` is 619 MiB after the first
tensor, 685 after the first bf16 GEMM, 701 after FlashAttention's forward and backward, and 767 MiB
after a training step of the reference model (Llama 3.2 1B), under torch's default lazy kernel loading
(``CUDA_MODULE_LOADING=LAZY`` since torch 1.13, pytorch/pytorch#86509); 1,837 MiB with ``EAGER``.
NB: it differs with the driver, the CUDA version and the GPU (a forum measurement of an older stack
without lazy loading: 723 MiB for ``th.randn(1).cuda()``, discuss.pytorch.org/t/73021); one measured
stack stands for all."""


def cublas_workspace(gpu: GpuPreset | None) -> int:
    """Bytes of one cuBLAS workspace (one per thread that runs GEMMs; 0 without a GPU)."""
    if gpu is None:
        return 0
    return CUBLAS_WORKSPACE_SM90 if gpu.compute_capability == "9.0" else CUBLAS_WORKSPACE_DEFAULT


def cublas_workspaces(gpu: GpuPreset | None) -> int:
    """Bytes of the cuBLAS workspaces a training step holds from its first backward on: the forward
    thread's and the autograd engine's (``analytic.allocator.CUBLAS_THREADS``)."""
    return CUBLAS_THREADS * cublas_workspace(gpu)


@dataclass(frozen=True)
class Reserved:
    """The most loaded device's memory as torch's allocator and the driver report it (bytes)."""

    requested_peak: int
    """The estimate's peak plus the cuBLAS workspaces: what the tensors ask for."""
    allocated_peak: int
    """``allocated_bytes.all.peak``: the blocks handed out (512-byte rounding, unsplit blocks)."""
    reserved_peak: int
    """``reserved_bytes.all.peak``: the segments the allocator holds."""
    segments: int
    cublas_workspace: int
    """The cuBLAS workspaces, all threads' (``cublas_workspaces``)."""
    cuda_context: int
    """Outside the allocator (with a GPU; else 0)."""
    expandable: bool
    nccl: int = 0
    """NCCL's buffers, outside the allocator (``analytic.nccl``; set by the callers that know the GPU's
    topology, ``time.comm.buffers.nccl_bytes``; 0 here)."""
    userbuffers: int = 0
    """TE's userbuffers under ``--tp-comm-overlap``, outside the allocator (``time.tp_overlap``; set by the
    callers; 0 here)."""
    symm_mem: int = 0
    """torch's symmetric-memory workspace under ``--async-tp``, outside the allocator (``time.async_tp``;
    set by the callers; 0 here)."""

    @property
    def device_peak(self) -> int:
        """What the process holds on the device at the peak: reserved + the CUDA context + NCCL's buffers
        (+ TE's userbuffers, + the symmetric-memory workspace)."""
        return self.reserved_peak + self.cuda_context + self.nccl + self.userbuffers + self.symm_mem

    def to_json(self) -> dict[str, object]:
        return {
            "requested_peak": self.requested_peak,
            "allocated_peak": self.allocated_peak,
            "reserved_peak": self.reserved_peak,
            "segments": self.segments,
            "cublas_workspace": self.cublas_workspace,
            "cuda_context": self.cuda_context,
            "nccl": self.nccl,
            "te_userbuffers": self.userbuffers,
            "symm_mem_workspace": self.symm_mem,
            "device_peak": self.device_peak,
            "expandable_segments": self.expandable,
        }


_REPLAYS: dict[tuple[StreamInputs, int, bool, int | None], Replay] = {}
"""Replays by (stream inputs, cuBLAS workspace, expandable, capacity): the fit search judges many
configurations whose device streams are equal, and asks for one result's replay more than once (fits,
verdict). Bounded: cleared when full (``alloc_stream.MEMO_MAX`` entries)."""


def replay_stream(
    inputs: StreamInputs, workspace: int, *, expandable: bool = False, capacity: int | None = None
) -> Replay:
    """``analytic.allocator.replay`` of the stream of ``inputs``, memoised (``_REPLAYS``); by the compiled
    replay (``analytic.allocator.jit``) when the fit search's replays have loaded it, never loading it
    for one estimate's replay."""
    key = (inputs, workspace, expandable, capacity)
    found = _REPLAYS.get(key)
    if found is None:
        # compiled, once a search has loaded it
        if not expandable and _JIT and _JIT[0] is not None:
            found = _JIT[0].replay_inputs_jit(inputs, workspace, STEPS, capacity)
        if found is None and expandable:
            found = Allocator(expandable=True, capacity=capacity).replay_codes(codes(inputs, workspace))
        elif found is None:  # the same allocator, without block objects (``allocator.plain.replay_plain``)
            start = time.process_time()
            found = replay_plain(codes(inputs, workspace), capacity)[0]
            _RENT[0] += time.process_time() - start
        if len(_REPLAYS) >= MEMO_MAX:
            _REPLAYS.clear()
        _REPLAYS[key] = found
    return found


_REFUSALS: dict[tuple[StreamInputs, int, int], bool] = {}
"""``refuses`` by (stream inputs, cuBLAS workspace, capacity); bounded as ``_REPLAYS``."""


def refuses(r: Result, gpu: GpuPreset, capacity: int) -> bool:
    """Whether the replay at ``capacity`` refuses a request (``fits_reserved`` is None), stopping as soon
    as the rest of the stream cannot: a request that finds no cached block opens one segment of
    ``segment_size`` of its rounded size and nothing else grows the reserved bytes, so once the reserved
    bytes plus a new segment for every allocation still to come fit the capacity, no later request can
    pass it (nor make the allocator release cached segments). Memoised (``_REFUSALS``)."""
    workspace = cublas_workspace(gpu)
    inputs = stream_inputs(r)
    key = (inputs, workspace, capacity)
    found = _REFUSALS.get(key)
    if found is None:
        full = _REPLAYS.get((inputs, workspace, False, capacity))
        found = full.oom if full is not None else _refused(inputs, workspace, capacity)
        if len(_REFUSALS) >= MEMO_MAX:
            _REFUSALS.clear()
        _REFUSALS[key] = found
    return found


def _refused(inputs: StreamInputs, workspace: int, capacity: int) -> bool:
    """``_refuses`` of the stream of ``inputs``: coded and replayed compiled when ``_compiled`` gives the
    compiled replay (``analytic.allocator.jit.refuses_jit``), else in Python (its seconds added to the
    rent)."""
    jit = _compiled()
    if jit is not None:
        found = jit.refuses_jit(inputs, workspace, STEPS, capacity)
        if found is not None:
            return bool(found)
    start = time.process_time()
    refused = _refuses(codes(inputs, workspace), capacity)
    _RENT[0] += time.process_time() - start
    return refused


def _refuses(stream_codes: list[int], capacity: int) -> bool:
    # when even the first event's demand fits, nothing is replayed
    jit = _compiled()
    if jit is not None:  # the same replay, compiled (``analytic.allocator.jit``)
        return bool(jit.replay_jit(stream_codes, capacity, early=True)[0].oom)
    need = demand(stream_codes)
    if need[0] <= capacity:
        return False
    return replay_plain(stream_codes, capacity, need)[0].oom


JIT_LOAD_SECONDS = 0.7
"""CPU seconds a process pays to load the compiled replay: numba's import (with numpy's, 0.21–0.32 s)
and, at the first calls, numba's registries and the cached machine code (0.30–0.53 s, a third of it
numba importing scipy to look for a BLAS). Measured on the 2-core development machine, numba 0.68, in
fresh processes that had imported what ``memplan fit`` imports: 0.66–0.78 s, medians of 5 in four runs
(``python benchmarks/bench_fit.py --load``; docs/fit.md, "Rent, then buy"). Another machine's differs:
with this threshold T against a true load L the module docstring's factor 2 becomes 1 + max(T/L, L/T)
(the same argument: P ≤ T costs P; else T + L + J' ≤ min(T + L + J, L + P))."""

JIT_MODES = ("0", "1", "auto")
"""``MEMPLAN_JIT``'s values (module docstring); unset is ``0``."""

_JIT: list[ModuleType | None] = []
"""``analytic.allocator.jit`` once imported, or None without numba (or with ``MEMPLAN_JIT=0``)."""

_RENT: list[float] = [0.0]
"""CPU seconds this process's replays have spent in Python (``_compiled``'s rent; CPU time, as
``JIT_LOAD_SECONDS`` is, so another process's load on the machine does not fill it)."""


def compiled_replay() -> bool:
    """Whether the fit search's replays run compiled now (numba installed and ``MEMPLAN_JIT`` 1, or
    ``auto`` once the Python replays have spent ``JIT_LOAD_SECONDS``)."""
    return _compiled() is not None


def jit_mode() -> str:
    """``MEMPLAN_JIT`` (``0`` when unset or empty); a one-line ``ValueError`` for another value, and for
    ``1`` without numba (asked for and not there: ``auto`` stays in Python without it)."""
    mode = os.environ.get("MEMPLAN_JIT", "0").strip().lower() or "0"
    if mode not in JIT_MODES:
        raise ValueError(
            f"MEMPLAN_JIT: must be 0, 1 or auto, got {mode!r}; e.g. MEMPLAN_JIT=1 to replay compiled (numba)"
        )
    if mode == "1" and not numba_installed():
        raise ValueError(
            "MEMPLAN_JIT: 1 asks for the compiled replay, but numba is not installed; "
            "pip install 'memplan[jit]', or unset MEMPLAN_JIT to replay in Python"
        )
    return mode


def numba_installed() -> bool:
    """Whether numba can be imported (found, not imported: its import is most of the load)."""
    return importlib.util.find_spec("numba") is not None


def _compiled() -> ModuleType | None:
    """The compiled replay when it is to run now (module docstring): ``MEMPLAN_JIT=1`` imports it on the
    first replay, ``auto`` once the Python replays have spent ``JIT_LOAD_SECONDS`` (rent, then buy),
    ``0`` (the default) never; None before that, and without numba."""
    if not _JIT:
        mode = jit_mode()
        if mode == "auto" and _RENT[0] < JIT_LOAD_SECONDS:
            return None
        module: ModuleType | None = None
        if mode != "0":
            try:
                module = importlib.import_module("memplan.analytic.allocator.jit")
            except ImportError:  # numba is an optional extra (memplan[jit])
                module = None
        _JIT.append(module)
    return _JIT[0]


def clear_replays() -> None:
    """Forget the memoised replays (benchmarks time a cold search; tests compare with fresh replays)."""
    _REPLAYS.clear()
    _REFUSALS.clear()
    clear_inputs()


def replay_device(r: Result, gpu: GpuPreset | None = None, *, expandable: bool = False) -> Reserved:
    """The estimate's stream replayed through the allocator on ``gpu`` (its cuBLAS workspace, the CUDA
    context; without a GPU neither). Memoised on the stream's inputs (``replay_stream``)."""
    workspace = cublas_workspace(gpu)
    out = replay_stream(stream_inputs(r), workspace, expandable=expandable)
    return reserved_of(out, workspace, CUDA_CONTEXT if gpu else 0, expandable)


def reserved_of(out: Replay, workspace: int, context: int, expandable: bool) -> Reserved:
    return Reserved(
        requested_peak=out.requested_peak,
        allocated_peak=out.allocated_peak,
        reserved_peak=out.reserved_peak,
        segments=out.segments,
        cublas_workspace=CUBLAS_THREADS * workspace,
        cuda_context=context,
        expandable=expandable,
    )


def fits_reserved(r: Result, gpu: GpuPreset, capacity: int, *, expandable: bool = False) -> Reserved | None:
    """The replay when the allocator may hold only ``capacity`` bytes (it releases its wholly free cached
    segments before it gives up); None when a request still finds no room."""
    workspace = cublas_workspace(gpu)
    out = replay_stream(stream_inputs(r), workspace, expandable=expandable, capacity=capacity)
    return None if out.oom else reserved_of(out, workspace, CUDA_CONTEXT, expandable)
