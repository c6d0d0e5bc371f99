"""Memory as the GPU reports it: the step's allocations replayed through torch's caching allocator
(``analytic.allocator``), and what the device holds outside it.

The allocation stream of the most loaded device is built from ``timeline.timeline`` at every layer (the
forward's layer boundaries, then the backward's and the optimizer step's modelled moments), term by term
(``analytic.peak.TERMS``): at each point the terms that shrink are freed first, newest first (the
backward frees the last layer's saves first), then the terms that grow are allocated:

- a layer's activations as that layer's saved tensors, one allocation each, in inventory order (one
  block of the difference when the layer's saves do not add up to it: fine-tuning's unequal layers,
  checkpointed segments, the embedding's and the head's saves);
- weights, optimizer states and gradients as one allocation per parameter tensor of the rank
  (``analytic.optimizer_step.step_tensors``: whole tensors or ZeRO's dim-0 shards) when the term's full
  size is a whole number of bytes per element over them (else as one block per rise: pipeline stages,
  LoRA's trainable subset, offloaded parts): weights and states in parameter order, gradients in reverse
  (the backward makes the last layer's first), as many whole tensors as a rise holds, the rest one block;
- a moment's transient as one block, freed at the next point — or as the tensors it is, where the timeline
  knows them (``timeline.Point.pieces``: torchtitan's eager standard loss, its forward's logits, their fp32
  copy and the log-probs, and the loss backward's two fp32 gradients; ``blocks.head.forward_loss_blocks``;
  a fully checkpointed layer's backward, the tensors its re-run forward makes again, then the rest one
  block: ``timeline.rerun_tensors``);
- cuBLAS's workspace (with a GPU) once, before the first layer, and never freed (torch keeps one per
  handle and stream, ``getNewWorkspace`` takes it from the caching allocator).

The step is replayed ``STEPS`` times: the second step finds the first one's cached segments, as every
step after the first does (its gradients freed by ``zero_grad(set_to_none=True)`` and its
transients reused), so the peaks are those ``torch.cuda.memory_stats()`` keeps over a run. The requested
peak of the replay equals the estimate's peak (plus the workspace) by construction (less the sharded
gradients where they are the reduce-scatter stream's, NB below); the allocated peak
adds the 512-byte rounding and the blocks handed out unsplit; the reserved peak adds the segments' slack.

The fit search's replays (``refuses``, and ``replay_stream`` once those have loaded it) run compiled
when numba is installed (``analytic.allocator_jit``: the same coding and decisions, tested equal), in
Python otherwise (``analytic.allocator.replay_plain``).

Outside the allocator (in ``nvidia-smi``'s used memory, not in ``memory_reserved()``): the CUDA context,
and NCCL's buffers (``analytic.nccl``, per communicator of the layout: ``time.comm_memory``; added by the
callers above this layer, ``Reserved.nccl``).

Known limitations:
- NB: a moment's transient is one block, though it is often several tensors (the loss backward's two
  fp32 [T, v] buffers, the optimizer step's per-parameter temporaries, a layer backward's own buffers):
  one large block cannot reuse the smaller blocks the freed activations left, so the unlimited replay can
  overstate the segments (QLoRA on Llama-3-8B: reserved 27.8 GiB for 20.0 GiB allocated, its 7.8 GiB
  optimizer-step transient a new segment; torchtitan's Llama 3.1 70B at TP 8 + SP, full AC: 24.8 GiB
  above the allocated peak while its 24.1 GiB layer backward, re-run included, was one block). The
  verdict's replay at the device's capacity releases the free cached segments first, as the allocator
  does, but only where the unlimited replay passes that capacity: below it the two are the same replay.
- NB: the forward's own temporaries (a layer's forward locals, the fp32 logits) are not allocations of
  the stream (``timeline``'s NB), nor are the backward's between its modelled moments.
- NB: one stream. FSDP2's all-gather stream has its own pool: ``analytic.fsdp_buffers`` replays it apart,
  the estimate reports it (``memory.fsdp_all_gather_stream``) and the verdict and ``fit`` keep its
  reserved bytes back from this replay's memory (``search.budget``); the flat all-gather outputs the
  peak's moments count (``Peak.all_gather_stream``: the reference's FSDP2, ``analytic.fsdp2_root``) are
  left out of this stream's terms (torchtitan's, ``analytic.fsdp2_moments.zero3_unit_buffers``, are not
  yet). torch DDP's buckets
  (``bucket_cap_mb``, 25 MiB each by default; with the default ``gradient_as_bucket_view=False`` one more
  copy of the gradients, ``time.comm_memory.ddp_bucket_bytes``) are default-stream allocations made
  before the first step and never freed: kept back the same way (``memory.ddp_buckets``), not replayed
  as allocations of this stream (their 2 MiB segment rounding is not counted). Under FSDP2's mixed
  precision (``analytic.fsdp_buffers.reduce_scatter_modelled``) the reduce-scatter's input is a
  default-stream allocation of the backward's moments (in their transients), while its outputs, the
  sharded gradients, are the reduce-scatter stream's blocks (torch 2.13 ``foreach_reduce``): this replay
  then holds no gradients (its requested peak is the estimate's less the gradients of the peak's moment),
  and ``analytic.fsdp_buffers.reduce_scatter_stream`` replays that pool apart (reported, not kept back:
  ``search.budget``). Elsewhere FSDP2's reduce-scatter buffers are not counted; ``--reserve`` keeps
  memory back for what is not judged. NCCL's own buffers are (``analytic.nccl``), outside the allocator.
- NB: the CUDA context's size depends on the driver, the CUDA version and lazy loading; the constant is
  one published measurement, not a bound.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from operator import itemgetter
from types import ModuleType

from memplan.analytic.allocator import (
    Alloc,
    Allocator,
    Event,
    Free,
    Replay,
    demand,
    replay_plain,
)
from memplan.analytic.fsdp2_reduce import reduce_scatter_modelled
from memplan.analytic.optimizer_step import step_tensors
from memplan.analytic.peak import TERMS
from memplan.blocks.inventory import Scope
from memplan.config import Setup, StrategyConfig
from memplan.engine import Result
from memplan.presets import GpuPreset
from memplan.strategies.pipeline_parallel import Group
from memplan.timeline import timeline

STEPS = 2
"""Steps replayed: the first fills the cache, the second reuses it (module docstring)."""

CUBLAS_WORKSPACE_SM90 = 4096 * 1024 * 8
"""cuBLAS workspace torch takes on a compute-capability 9.0 GPU (Hopper) without
``CUBLAS_WORKSPACE_CONFIG``: ``:4096:8``, 8 chunks of 4096 KiB = 32 MiB (aten/src/ATen/cuda/
CublasHandlePool.cpp, ``parseChosenWorkspaceSize``: ``sm90 ? 4096 * 8 * 1024 : ...``)."""
CUBLAS_WORKSPACE_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8
"""…on every other GPU: ``:4096:2:16:8``, 2 × 4096 KiB + 8 × 16 KiB = 8 MiB + 128 KiB (the same function)."""

CUDA_CONTEXT = 723 * 2**20
"""The CUDA context torch's first CUDA call creates, outside the caching allocator: 723 MiB in
nvidia-smi for ``th.randn(1).cuda()`` (discuss.pytorch.org/t/what-is-the-reason-for-pytorchs-gpu-memory-
floor/73021; ptrblck there and in /t/high-gpu-memory-overhead/81330: "~700+MB" depending on the CUDA
version and the device). NB: CUDA ≥ 12.2 loads kernels lazily on Linux (CUDA_MODULE_LOADING=LAZY by
default), which makes it smaller: an upper figure for recent stacks."""


def cublas_workspace(gpu: GpuPreset | None) -> int:
    """Bytes of the one cuBLAS workspace a training step's GEMMs take (0 without a GPU)."""
    if gpu is None:
        return 0
    return CUBLAS_WORKSPACE_SM90 if gpu.compute_capability == "9.0" else CUBLAS_WORKSPACE_DEFAULT


@dataclass(frozen=True)
class Reserved:
    """The most loaded device's memory as torch's allocator and the driver report it (bytes)."""

    requested_peak: int
    """The estimate's peak plus the cuBLAS workspace: what the tensors ask for."""
    allocated_peak: int
    """``allocated_bytes.all.peak``: the blocks handed out (512-byte rounding, unsplit blocks)."""
    reserved_peak: int
    """``reserved_bytes.all.peak``: the segments the allocator holds."""
    segments: int
    cublas_workspace: int
    cuda_context: int
    """Outside the allocator (with a GPU; else 0)."""
    expandable: bool
    nccl: int = 0
    """NCCL's buffers, outside the allocator (``analytic.nccl``; set by the callers that know the GPU's
    topology, ``time.comm_memory.nccl_bytes``; 0 here)."""

    @property
    def device_peak(self) -> int:
        """What the process holds on the device at the peak: reserved + the CUDA context + NCCL's buffers."""
        return self.reserved_peak + self.cuda_context + self.nccl

    def to_json(self) -> dict[str, object]:
        return {
            "requested_peak": self.requested_peak,
            "allocated_peak": self.allocated_peak,
            "reserved_peak": self.reserved_peak,
            "segments": self.segments,
            "cublas_workspace": self.cublas_workspace,
            "cuda_context": self.cuda_context,
            "nccl": self.nccl,
            "device_peak": self.device_peak,
            "expandable_segments": self.expandable,
        }


def tensor_bytes(total: int, elements: list[int]) -> list[int]:
    """``total`` bytes laid over tensors of ``elements``, one allocation each, when ``total`` is a whole
    number of bytes per element over them; else none (the term is then allocated as blocks)."""
    count = sum(elements)
    if count and total % count == 0:
        return [e * (total // count) for e in elements if e]
    return []


def take(queue: list[int], delta: int) -> list[int]:
    """Allocations for ``delta`` more bytes of a term: its next whole tensors from ``queue`` (consumed)
    while they fit, the rest as one block."""
    out: list[int] = []
    rest, n = delta, 0
    while n < len(queue) and queue[n] <= rest:
        rest -= queue[n]
        n += 1
    out, queue[:] = queue[:n], queue[n:]
    return out + ([rest] if rest > 0 else [])


def layer_saves(r: Result) -> list[int]:
    """Bytes of each tensor one layer saves, in inventory order (one instance each)."""
    return [k.bytes for k in r.pieces.kept if k.scope is Scope.LAYER and k.count]


@dataclass(frozen=True)
class StreamInputs:
    """All ``stream`` reads of a result: equal inputs give equal streams, so a replay is memoised on them
    (configurations of a search that differ only where the device's memory does not: the micro-batch
    count of an unpipelined layout, dp under ZeRO 0, … share one replay)."""

    points: tuple[tuple[int, ...], ...]
    """Each timeline point's bytes of ``analytic.peak.TERMS``, in order."""
    per_tensor: tuple[int, ...]
    """Elements of each tensor the rank steps (``step_tensors``), in parameter order."""
    states: tuple[int, int, int]
    """The device's weights, optimizer states and gradients (bytes)."""
    layer: tuple[int, ...]
    """One layer's saves (``layer_saves``)."""
    pieces: tuple[tuple[int, ...], ...] = ()
    """Each point's transient as its tensors (``timeline.Point.pieces``; empty: one block)."""


_INPUTS: dict[int, tuple[Result, StreamInputs]] = {}
"""``stream_inputs`` of the last results asked (by identity; the result is kept so its id stays its)."""


def stream_inputs(r: Result) -> StreamInputs:
    """What ``stream`` reads of ``r`` (memoised for the last results asked)."""
    found = _INPUTS.get(id(r))
    if found is not None and found[0] is r:
        return found[1]
    if len(_INPUTS) >= _REPLAYS_MAX:
        _INPUTS.clear()
    _INPUTS[id(r)] = (r, inputs := _stream_inputs(r))
    return inputs


_TERMS_OF = itemgetter(*TERMS)
"""A point's bytes of each of ``TERMS``, in order (one tuple)."""


def _stream_inputs(r: Result) -> StreamInputs:
    dev = r.device
    group = Group.CHECKPOINT if r.setup.strategy.segment else Group.LAYER
    points = timeline(r, forward_points=max(1, dev.counts[group]))
    per_tensor = rank_tensors(r.pieces.setup, dev.setup.strategy)
    st = dev.states
    terms = [p.terms for p in points]
    # FSDP2's flat all-gather outputs in the moments: the all-gather stream's pool, replayed apart
    off = dev.peak.all_gather_stream
    terms = [
        {k: v - off.get(p.label, {}).get(k, 0) for k, v in t.items()}
        for p, t in zip(points, terms, strict=True)
    ]
    if reduce_scatter_modelled(r.setup):  # the sharded gradients: the reduce-scatter stream's blocks
        terms = [{**t, "gradients": 0} for t in terms]
    return StreamInputs(
        points=tuple(map(_TERMS_OF, terms)),
        per_tensor=per_tensor,
        states=(st.weights, st.optimizer, st.gradients),
        layer=tuple(layer_saves(r)),
        pieces=tuple(p.pieces for p in points) if any(p.pieces for p in points) else (),
    )


_TENSORS: dict[tuple[object, ...], tuple[int, ...]] = {}
"""``rank_tensors`` by what ``step_tensors`` reads; bounded as ``_REPLAYS``."""


def rank_tensors(setup: Setup, strategy: StrategyConfig) -> tuple[int, ...]:
    """``step_tensors`` of ``setup`` under ``strategy``, memoised on what it reads: the model, the
    fine-tuning method, the implementation (the parameters' order) and the sharding (the ZeRO stage and
    its group) — not the micro-batch or the layout, which a search varies (tests/test_allocator_plain.py
    checks it against ``step_tensors``)."""
    key = (setup.model, setup.finetune, setup.impl, strategy.zero, strategy.shard_group)
    found = _TENSORS.get(key)
    if found is None:
        if len(_TENSORS) >= _REPLAYS_MAX:
            _TENSORS.clear()
        found = _TENSORS[key] = tuple(step_tensors(setup.model_copy(update={"strategy": strategy})))
    return found


def stream(r: Result, workspace: int = 0, steps: int = STEPS) -> list[Event]:
    """The most loaded device's allocations and frees over ``steps`` steps (module docstring)."""
    return events(stream_inputs(r), workspace, steps)


def events(inputs: StreamInputs, workspace: int = 0, steps: int = STEPS) -> list[Event]:
    """``stream`` from its inputs."""
    out: list[Event] = []
    made = 0
    for c in codes(inputs, workspace, steps):
        if c >= 0:
            out.append(Alloc(made, c))
            made += 1
        else:
            out.append(Free(-c - 1))
    return out


def codes(inputs: StreamInputs, workspace: int = 0, steps: int = STEPS) -> list[int]:
    """``events`` as integers (``Allocator.replay_codes``: n ≥ 0 allocates n bytes, the allocations
    numbered in order; −k − 1 frees allocation k): what the replays read, with no event objects.

    A term that shrinks by less than its newest allocation frees that allocation whole and makes the
    rest again (its tensors are not known apart): the rest is allocated before any other term grows, so
    that it takes back the block it was freed from (best fit: no other free block smaller than that one
    fits it, or it takes that smaller one), as the tensors that stay alive keep their blocks. Allocated
    after another term's rise (the order of ``TERMS``), the rest found its block split by that rise and
    opened a segment of its own: at torchtitan's loss backward under context parallelism (the head's
    saves, 16.9 GiB, shrinking by 256 KiB while FSDP2's [norm, output] unit is gathered, 0.98 GiB) a
    second 16.9 GiB segment, 15.9 GiB of it free, that no run holds (docs/published-memory.md)."""
    per_tensor = list(inputs.per_tensor)
    full = dict(zip(("weights", "optimizer", "gradients"), inputs.states, strict=True))
    layer = list(inputs.layer)
    one_layer = sum(layer)
    held: list[list[tuple[int, int]]] = [[] for _ in TERMS]
    total = [0] * len(TERMS)
    queues: dict[int, list[int]] = {}
    out: list[int] = []
    made = 0
    activations, transient = TERMS.index("activations"), TERMS.index("transient")
    names = list(TERMS)

    def pieces(term: int, delta: int, k: int) -> list[int]:
        if term == activations:
            return layer if one_layer == delta else [delta]
        if term == transient:  # one block, or the tensors the timeline knows it as
            return list(inputs.pieces[k]) if inputs.pieces and inputs.pieces[k] else [delta]
        if total[term] == 0:  # the term starts (again): its tensors in the order they are made
            order = per_tensor[::-1] if names[term] == "gradients" else per_tensor
            queues[term] = tensor_bytes(full[names[term]], order)
        return take(queues[term], delta)

    for step in range(steps):
        for k, point in enumerate(inputs.points):
            cut = [False] * len(TERMS)
            for term, target in enumerate(point):  # frees first: what shrinks, newest first; transients
                stack, now = held[term], total[term]
                if term == transient:
                    target = 0
                was = now
                while stack and now > target:
                    i, size = stack.pop()
                    out.append(-i - 1)
                    now -= size
                cut[term] = now < target < was  # freed past its target: the rest is made again, first
                total[term] = now
            if step == 0 and k == 0 and workspace:
                out.append(workspace)
                made += 1
            # a term freed past its target grows back before the others (``codes``' docstring)
            for term in sorted(range(len(TERMS)), key=lambda t: not cut[t]):
                target = point[term]
                delta = target - total[term]
                if delta <= 0:
                    continue
                stack = held[term]
                for size in pieces(term, delta, k):
                    out.append(size)
                    stack.append((made, size))
                    made += 1
                total[term] += delta
    return out


_REPLAYS: dict[tuple[StreamInputs, int, bool, int | None], Replay] = {}
"""Replays by (stream inputs, cuBLAS workspace, expandable, capacity): the fit search judges many
configurations whose device streams are equal, and asks for one result's replay more than once (fits,
verdict). Bounded: cleared when full."""
_REPLAYS_MAX = 2048


def replay_stream(
    inputs: StreamInputs, workspace: int, *, expandable: bool = False, capacity: int | None = None
) -> Replay:
    """``analytic.allocator.replay`` of the stream of ``inputs``, memoised (``_REPLAYS``); by the compiled
    replay (``analytic.allocator_jit``) when the fit search's replays have loaded it, never loading it
    for one estimate's replay."""
    key = (inputs, workspace, expandable, capacity)
    found = _REPLAYS.get(key)
    if found is None:
        # compiled, once a search has loaded it; a transient known as its tensors is coded in Python
        if not expandable and not inputs.pieces and _JIT and _JIT[0] is not None:
            found = _JIT[0].replay_inputs_jit(
                inputs.points, inputs.per_tensor, inputs.states, inputs.layer, workspace, STEPS, capacity
            )
        if found is None and expandable:
            found = Allocator(expandable=True, capacity=capacity).replay_codes(codes(inputs, workspace))
        elif found is None:  # the same allocator, without block objects (``analytic.allocator.replay_plain``)
            found = replay_plain(codes(inputs, workspace), capacity)[0]
        if len(_REPLAYS) >= _REPLAYS_MAX:
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
        if len(_REFUSALS) >= _REPLAYS_MAX:
            _REFUSALS.clear()
        _REFUSALS[key] = found
    return found


def _refused(inputs: StreamInputs, workspace: int, capacity: int) -> bool:
    """``_refuses`` of the stream of ``inputs``: coded and replayed compiled when numba is there
    (``analytic.allocator_jit.refuses_jit``), else in Python."""
    jit = _compiled()
    if jit is not None and not inputs.pieces:  # the compiled coding knows each transient as one block
        found = jit.refuses_jit(
            inputs.points, inputs.per_tensor, inputs.states, inputs.layer, workspace, STEPS, capacity
        )
        if found is not None:
            return bool(found)
    return _refuses(codes(inputs, workspace), capacity)


def _refuses(stream_codes: list[int], capacity: int) -> bool:
    # when even the first event's demand fits, nothing is replayed
    jit = _compiled()
    if jit is not None:  # the same replay, compiled (``analytic.allocator_jit``)
        return bool(jit.replay_jit(stream_codes, capacity, early=True)[0].oom)
    need = demand(stream_codes)
    if need[0] <= capacity:
        return False
    return replay_plain(stream_codes, capacity, need)[0].oom


_JIT: list[ModuleType | None] = []
"""``analytic.allocator_jit`` once imported, or None without numba (or with ``MEMPLAN_JIT=0``)."""


def compiled_replay() -> bool:
    """Whether the fit search's replays run compiled (numba installed and ``MEMPLAN_JIT`` not 0)."""
    return _compiled() is not None


def _compiled() -> ModuleType | None:
    """The compiled replay, imported on the first early-stopped replay (numba's import and its cached
    machine code cost ≈ 0.3 s: a search's worth, not one estimate's)."""
    if not _JIT:
        module: ModuleType | None = None
        if os.environ.get("MEMPLAN_JIT", "1") != "0":
            try:
                module = importlib.import_module("memplan.analytic.allocator_jit")
            except ImportError:  # numba is an optional extra (memplan[jit])
                module = None
        _JIT.append(module)
    return _JIT[0]


def clear_replays() -> None:
    """Forget the memoised replays (benchmarks time a cold search; tests compare with fresh replays)."""
    _REPLAYS.clear()
    _REFUSALS.clear()
    _INPUTS.clear()
    _TENSORS.clear()


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
        cublas_workspace=workspace,
        cuda_context=context,
        expandable=expandable,
    )


def fits_reserved(r: Result, gpu: GpuPreset, capacity: int, *, expandable: bool = False) -> Reserved | None:
    """The replay when the allocator may hold only ``capacity`` bytes (it releases its wholly free cached
    segments before it gives up); None when a request still finds no room."""
    workspace = cublas_workspace(gpu)
    out = replay_stream(stream_inputs(r), workspace, expandable=expandable, capacity=capacity)
    return None if out.oom else reserved_of(out, workspace, CUDA_CONTEXT, expandable)
