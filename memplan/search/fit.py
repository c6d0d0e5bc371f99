"""Search the layouts and strategies that fit a model on N GPUs, ranked by estimated throughput.

The space: activation checkpointing × attention kernel × ZeRO stage × layouts of the N devices
(``space.layouts``: tp up to ``Space.tp_max``, sequence parallel whenever tp > 1; pp any degree up to the
layers, uneven stages as ``estimate`` places them, with the interleaved schedule's vpp of ``Space.vpp``;
context parallelism cp = 1, 2, 4, … ``Space.cp_max`` with flash attention, beside every layout; HSDP with
one node's data-parallel ranks as the shard group; dp = N / (tp·cp·pp); for a mixture of experts every ep
dividing both the experts and dp) × micro-batch size. The global batch (sequences per step) is fixed, so a
layout with dp ranks and micro-batch b runs B / (b·dp) micro-batches. Each listed configuration comes with
the ``memplan estimate`` command that reproduces it (``estimate_command``).

A family is (checkpointing, attention, ZeRO stage, layout); its configurations are its micro-batch sizes. A
family fails when none of them fits; its reason is the overflowing term (``budget.verdict``) of its
smallest micro-batch. Fitting configurations are ranked by tokens/s, predicted (``timing``: kernels,
the communication not hidden on the GPU's topology, the pipeline bubble; docs/step-time.md) or at an
assumed ``--mfu``, ties broken by fewer model-parallel devices, the lower ZeRO stage, the larger
micro-batch, then the lower peak.

Speed: the per-rank pieces (inventory, transients) are cached per (checkpointing, attention, tp, micro-
batch). The search is best-first (``families``): every micro-batch size of every layout is queued at its
step-time lower bound (``bound``: one reference sequence's kernels at the layout's rates, on the busiest
stage, stretched by its bubble), refined when it comes out — the bound its ZeRO stages share
(``bound.stages_bound``), then their predicted step times — and judged for memory only when none of those
is slower than the ``Space.keep`` (``--top``) fastest found so far; the search stops when the lowest key
left is slower than them (exact: the listed rows are those of the full evaluation). At an assumed ``--mfu``
the bound is the step's own formula without the checkpoint recompute (``mfu_bound``), and a group's second
key is its stages' step itself. Memory is judged
cheapest first (``budget.fits``: the stages' lower bounds, the peak, the requested peak, then one replay of
the allocator, memoised on the device's allocation stream), and a listed row's verdict is computed when it
is shown (``results.Config``). A ZeRO stage that fits makes the higher stages of the same configuration
redundant (they never need more memory and never move fewer bytes): they are not listed apart. Figures:
docs/fit.md, benchmarks/bench_fit.py. NB: ZeRO 1 moves ZeRO 0's all-reduce
as a reduce-scatter and an all-gather, and the all-gather may hide behind the next forward: a small gain this
search does not look for. Over one data-parallel rank (dp 1) the ZeRO stages shard nothing, so only stage 0 is
searched there."""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager

from memplan.blocks.profiles import profile_of
from memplan.config import Attention, FineTune, Offload, Setup, no_flash
from memplan.presets import GpuPreset
from memplan.reserved import jit_mode
from memplan.search.bound import Bound, Cutoff
from memplan.search.budget import DEFAULT_RESERVE, fits
from memplan.search.command import estimate_command
from memplan.search.families import search, triple
from memplan.search.longest import longest_sequence
from memplan.search.methods import (
    SAVERS,
    layout_free,
    refusal,
    searches_checkpointing,
    searches_layout,
    valid,
    with_method,
)
from memplan.search.mfu_bound import MfuBound
from memplan.search.results import Config, Family, FitResult, Outcome, Rejected
from memplan.search.space import (
    Layout,
    Space,
    context_degrees,
    default_global_batch,
    every_layout,
    layouts,
    searchable,
    splitting_batch,
    too_many,
    unsplit_degrees,
    why_nothing,
)
from memplan.time.comm.fabric import clear_placed
from memplan.time.offload import untimed
from memplan.time.timing import check_time_inputs, mfu_ceiling

__all__ = [
    "Config",
    "Family",
    "FitResult",
    "Layout",
    "Outcome",
    "Rejected",
    "Space",
    "default_global_batch",
    "estimate_command",
    "fit",
    "fits",
    "layouts",
    "longest_sequence",
]


def offload_unsearched(o: Offload, gpu: GpuPreset) -> str | None:
    """Why a saver level with offload ``o`` cannot be searched on ``gpu`` (None: it can): its verdict
    needs the node's host memory (the preset's or ``--host-memory``), its step time the host link and,
    for the optimizer, the host memory's bandwidth (``time.offload.untimed``)."""
    if o is Offload.NONE:
        return None
    if gpu.host_memory_gib is None:
        return "offload needs the node's host memory: this GPU preset states none; give --host-memory GiB"
    missing = untimed(o, gpu)
    return None if missing is None else missing.removeprefix("gpu: ")


def fit(
    base: Setup,
    gpu: GpuPreset,
    gpus: int,
    *,
    global_batch: int | None = None,
    mfu: float | None = None,
    space: Space | None = None,
    max_seq: bool = True,
    reserve: int = DEFAULT_RESERVE,
    expandable: bool = False,
    finetunes: tuple[FineTune, ...] = (),
    escalate: bool = False,
    shortcuts: bool = True,
) -> FitResult:
    """Search ``space`` for ``base``'s model and sequence on ``gpus`` × ``gpu``, each with ``reserve`` bytes
    kept back (``budget``) and the allocator under ``expandable_segments:True`` when ``expandable``; see
    the module docstring. ``finetunes``: the methods to search, in order
    (default: ``base``'s); ``escalate``: stop at the first that fits without a saver (``methods``);
    ``shortcuts=False``: judge the memory of every estimated configuration (``families``: the reference the
    pruning by predicted time is tested against)."""
    space = space or Space()
    if gpus < 1:
        raise ValueError(f"gpus: need at least one device, got {gpus}; e.g. --gpus 8")
    if space.tp_max < 1:
        raise ValueError(f"tp-max: must be at least 1, got {space.tp_max}; e.g. --tp-max 8")
    if space.cp_max < 1:
        raise ValueError(
            f"cp-max: must be at least 1 (1: no context parallelism), got {space.cp_max}; e.g. --cp-max 16"
        )
    if global_batch is not None and global_batch < 1:
        raise ValueError(
            f"global-batch: must be at least one sequence, got {global_batch}; e.g. --global-batch 512"
        )
    check_time_inputs(mfu, None, None, mfu_ceiling(base, gpu))
    jit_mode()  # MEMPLAN_JIT read before the search, not at its first replay
    clear_placed()  # the fabric's placements memo lives for one search (cold benchmarks)
    space = runnable_attention(base, space)
    batch = global_batch or default_global_batch(base.training.seq_len, gpus)
    start = time.perf_counter()
    result = FitResult(
        setup=base,
        gpu=gpu,
        gpus=gpus,
        global_batch=batch,
        reserve=reserve,
        expandable=expandable,
        cp_rotate=space.cp_rotate,
    )
    memory = result.usable
    # once: both checks and every saver level read it (a 16,384-GPU space: 2 % of a search). The checks
    # read whether there is a layout and its dp, the same at any node size (HSDP's shard groups aside)
    every = every_layout(base, gpus, space, gpu.topology.gpus_per_node)
    crowded = too_many(base, gpus, space, every)
    if crowded:
        raise ValueError(crowded)
    if not searchable(base, gpus, batch, space, every):
        raise ValueError(why_nothing(base, gpus, batch, global_batch is not None, space))
    result.unsplit_dp = unsplit_degrees(every, batch, space)
    if result.unsplit_dp:
        result.splitting_batch = splitting_batch(every, batch, space)
    bound: Bound | MfuBound | None = None  # keep 0: prune nothing
    if space.keep:
        bound = (
            Bound(gpu, gpus, batch, base.impl.fp8_tp, base.impl.tp_comm_overlap or base.impl.async_tp)
            if mfu is None
            else MfuBound(gpu, gpus, batch, mfu)
        )
    levels: dict[FineTune, list[int]] = {}  # per method, the saver levels with a configuration memplan models
    no_offload: dict[FineTune, str] = {}  # why offload's levels were left out, per method
    tunes = finetunes or (base.finetune,)
    # a method memplan models on no layout of this model (QLoRA with a mixture of experts): not searched, and
    # said so — a search of it found nothing and printed "nothing fits" with no rejected family
    refused = {ft: why for ft in tunes if (why := refusal(base, ft)) is not None}
    if len(refused) == len(tunes):
        names = ", ".join(ft.method.name.lower() for ft in tunes)
        why = refused[tunes[0]].removeprefix("finetune: ")
        raise ValueError(f"method: {names} not searched: {why}")
    reached: set[FineTune] = set()  # the refused methods the search came to (escalation may stop before)
    with no_cycle_collection():
        for ft in tunes:
            if ft in refused:
                reached.add(ft)
                continue
            for level, saver in enumerate(SAVERS):
                why = offload_unsearched(saver.offload, gpu)
                if why is not None:
                    no_offload[ft] = why
                    break
                before = len(result.fitting)
                if _search_level(
                    result, with_method(base, ft, saver), ft, level, gpus, space, mfu, bound, every, shortcuts
                ):
                    levels.setdefault(ft, []).append(level)
                if len(result.fitting) > before:
                    break
            fits_plainly = any(c.family.finetune == ft and c.family.saver == 0 for c in result.fitting)
            if escalate and fits_plainly:
                break  # the method fits without a saver: the later methods are not needed
    result.fitting.sort(key=Config.sort_key)
    searched = {c.family.finetune: None for c in result.fitting} | {
        r.family.finetune: None for r in result.rejected
    }
    result.methods = [
        Outcome(
            ft,
            next((c for c in result.fitting if c.family.finetune == ft), None),
            tuple(levels.get(ft, ())),
            no_offload.get(ft),
            refused.get(ft),
        )
        for ft in tunes
        if ft in searched or ft in reached
    ]
    result.seconds = time.perf_counter() - start
    if max_seq and result.best is not None:
        with no_cycle_collection():
            result.max_seq = longest_sequence(result.best, memory, gpu=gpu, expandable=expandable)
    return result


@contextmanager
def no_cycle_collection() -> Iterator[None]:
    """CPython's cyclic garbage collector paused while ``fit`` searches. The search makes millions of
    short-lived objects (setups, estimates, timings) and almost no reference cycles — reference counting
    frees them; after four cold searches of Llama 3.1 405B on 16,384 GPUs without it, ``gc.collect()``
    found 791 objects in cycles, and the process's peak memory was the same (222 MB) — while the
    collector, run every 700 allocations (``gc.get_threshold``), walked the search's growing caches: 15–18 %
    of its CPU time (benchmarks/bench_fit.py, docs/fit.md). What cycles there are wait for the next
    collection after the search; a collector paused by the caller stays paused."""
    paused = not gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if not paused:
            gc.enable()


def runnable_attention(base: Setup, space: Space) -> Space:
    """``space`` with the attention kernels the model's code runs (``methods.valid``: transformers' Gemma-2
    and gpt-oss, and DeepSeek's MLA on CUDA, run eager only, ``config.no_flash``); a one-line
    ``ValueError`` when none of them does."""
    runs = tuple(
        k
        for k in space.attention
        if valid(layout_free(base).replaced(strategy=base.strategy.replaced(attention=k)))
    )
    if not runs:
        profile_of(base)  # the implementation's own refusal of the base, when it is not the attention's
        names = ",".join(k.name.lower() for k in space.attention)
        why = no_flash(base.model, base.impl.impl, base.device) or "not modelled"
        raise ValueError(f"attention: {base.model.name} runs none of {names} ({why}); use --attention eager")
    return dataclasses.replace(space, attention=runs)


def _search_level(
    result: FitResult,
    base: Setup,
    ft: FineTune,
    level: int,
    gpus: int,
    space: Space,
    mfu: float | None,
    bound: Bound | MfuBound | None,
    every: list[Layout],
    shortcuts: bool = True,
) -> bool:
    """Every layout, checkpointing and attention of method ``ft`` at saver ``level`` (``base`` carries
    both); context parallelism (flash attention only) with every layout, not only when nothing fits
    without it: it may be faster (fewer micro-batches per data-parallel rank, a smaller bubble). Searched
    best-first (``families.search``). ``every``: ``every_layout`` of the search's base on the GPU's nodes —
    ``layouts`` reads the model, the sequence and the implementation, which no method or saver changes —
    of which the context-parallel degrees searched here are kept, in its order. Returns whether the level
    held any configuration memplan models (``methods.valid``)."""
    flash = Attention.FLASH in space.attention and ft.trains_everything
    degrees = {1, *(context_degrees(base, gpus, space) if flash else [])}
    candidates = [
        x
        for x in every
        if x.parallel.cp in degrees and searches_layout(ft, x.parallel.tp, x.parallel.pp, x.parallel.cp)
    ]
    # one memo of the optimizer step's and clipping's seconds per layout: keyed on the ZeRO stage and the
    # busiest stage (``predict.Unstaged.step_seconds``), they read neither the checkpointing nor the attention
    steps: list[dict[tuple[object, ...], tuple[float, float]]] = [{} for _ in candidates]
    triples = [
        triple(result, base, x, ckpt, attention, space, mfu, ft, level, steps[k])
        for k, x in enumerate(candidates)
        for ckpt in space.checkpointing
        if searches_checkpointing(ft, ckpt)
        for attention in (space.attention if x.parallel.cp == 1 else (Attention.FLASH,))
    ]
    cutoff = result.cutoffs.setdefault((ft, level), Cutoff(space.keep if bound is not None else 0))
    search(result, triples, bound, cutoff, shortcuts)
    return any(t.families for t in triples)
