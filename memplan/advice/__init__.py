"""The answer first: does this step fit a GPU, what fills its peak, and what would make it fit.

``advise(built)`` takes one estimate and answers, from memplan's own estimates only:

- against which GPU: ``--gpu`` when given (with ``--reserve``); otherwise the largest GPU preset by memory
  (with the default reserve), and, when the step fits there, the smallest preset that still holds it;
- the three largest terms of the peak moment (weights, optimizer, gradients, activations, transient);
- how many GPUs of that size it needs: the smallest data-parallel degree N for which ``--zero 3 --dp N``
  fits (the user's other settings kept), with the user's checkpointing and with ``--checkpointing full``,
  whichever needs fewer GPUs (the user's on a tie), checked by estimating N and N − 1;
- suggestions, each a change of the user's options that is estimated here, with its peak, the reserved
  bytes it is judged by and whether it fits: the ZeRO-3 layout above, ``--checkpointing full``,
  ``--finetune lora``, ``--optimizer adamw-8bit``, and ``memplan fit`` on a power of two ≥ N GPUs
  (where ``--zero 3 --dp`` that many is estimated to fit, so the search finds at least that). A change
  that does not lower the peak by at least ``MIN_SAVING`` of it is never suggested (8-bit optimizer
  states under LoRA save megabytes of a 135 GiB peak).

Pure Python (no torch): every candidate is one ``engine.estimate`` of ``api.setup_of(options)``; the
engine's per-rank pieces are cached, so the whole advice costs a few tens of estimates (milliseconds).

NB: the GPU count keeps the user's tensor, context and pipeline degrees and grows only dp: splitting the
model (``--tp``, ``--pp``, ``--cp``) can need fewer GPUs: what the suggested ``memplan fit`` searches.
The count assumes the peak under ZeRO-3 does not grow with dp (states shrink as 1/dp, the rest is
constant); the search checks N and N − 1 only. A candidate whose settings cannot be planned (e.g. a
``--global-batch`` that the new dp does not divide) is dropped, not reported.
"""

from __future__ import annotations

import functools
from enum import Enum
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict

from memplan.advice.candidates import refusal, result
from memplan.advice.remarks import notes
from memplan.api import Built, Options, gpu_of
from memplan.config import MethodChoice, Optimizer
from memplan.config.strategy import MAX_DP  # StrategyConfig.dp's own limit
from memplan.engine import Result
from memplan.fit_options import FIT_OPTIONS as FIT_OPTION_NAMES
from memplan.presets import GpuPreset, gpu_names, load_gpu
from memplan.search.budget import DEFAULT_RESERVE, allocator_memory, reserve_bytes, verdict

TOP_TERMS = 3
MIN_SAVING = 0.01
"""The least share of the peak a one-option suggestion must save to be shown: a presentation choice, not a
physical constant (below it the line says nothing a user would act on)."""

FIT_OPTIONS = frozenset(FIT_OPTION_NAMES)
"""The ``api.Options`` fields ``memplan fit`` takes as they are (``fit_options.FIT_OPTIONS``: its CLI's)."""
_FIT_SEARCHES = frozenset(
    {"gpu", "gpus", "dp", "zero", "checkpointing", "attention", "batch", "grad_accum", "global_batch"}
)
"""The settings ``memplan fit`` chooses itself (or is given as --gpu, --gpus)."""


class Suggestion(BaseModel):
    """One change of the user's options, estimated: its peak on the most loaded device; does it fit."""

    model_config = ConfigDict(frozen=True)
    args: list[str]
    """The options to add or change, as typed: ``["--zero", "3", "--dp", "20"]``."""
    command: list[str]
    """The whole command line that runs it (``memplan estimate …`` or ``memplan fit …``)."""
    peak: int
    """Bytes at the peak on the most loaded device (for ``memplan fit``: of the ZeRO-3 layout it contains)."""
    reserved: int
    """The caching allocator's reserved peak there, what ``fits`` judges (``search.budget.Verdict``)."""
    fits: bool
    devices: int
    """GPUs the suggestion runs on."""
    why: str
    """What it changes, in a few words."""


class GpuCount(BaseModel):
    """How many GPUs of one size the step needs: under ZeRO-3 over dp, or the user's own configuration
    where that fits on as few (None: no dp ≤ ``MAX_DP`` fits)."""

    model_config = ConfigDict(frozen=True)
    gpu: str
    usable_bytes: int
    """What the allocator may reserve for the configuration shown (at ``dp``; at the last dp tried when none
    fits): its verdict's, NCCL's buffers, FSDP2's all-gather stream and DDP's buckets left out as there."""
    devices: int | None
    dp: int | None
    args: list[str]
    """The options that make ``devices`` GPUs fit (``--zero 3 --dp N``, maybe ``--checkpointing full``;
    none, or ``--checkpointing full`` alone, where the user's configuration fits)."""
    peak: int
    """The peak at ``dp`` (at ``MAX_DP`` when nothing fits)."""
    reserved: int
    """The caching allocator's reserved peak there, the judged figure (0 when no dp could be planned)."""
    refused: str | None = None
    """Why ``--zero 3 --dp N`` cannot be planned with the user's other options, when no N could (the
    first refusal's one line: e.g. an implementation that does not model ZeRO-3 with them); else None."""
    hsdp: int | None = None
    """The user's ``--hsdp R``, kept in the count: ZeRO-3 shards over R ranks only (× cp), so more
    data-parallel replicas do not lower the states; None without HSDP."""


class Advice(BaseModel):
    """The verdict panel's content; ``--json``'s ``verdict`` object."""

    model_config = ConfigDict(frozen=True)
    gpu: str
    """The GPU judged against: ``--gpu``, else the largest preset (or the smallest that holds the step)."""
    gpu_given: bool
    memory_bytes: int
    usable_bytes: int
    """What the allocator may reserve: the driver's memory less the CUDA context, NCCL's buffers, FSDP2's
    all-gather stream, DDP's buckets and ``--reserve`` (the verdict's, ``search.budget``)."""
    peak: int
    """The most loaded device's tensors at their peak moment (``phase``), every stream's."""
    phase: str
    reserved: int
    """The caching allocator's reserved peak on the step's default stream (the replay of its allocations),
    what ``fits`` judges against ``usable_bytes`` (``search.budget.Verdict.reserved_peak``)."""
    fits: bool
    headroom: int
    """usable − reserved (negative when it does not fit)."""
    devices: int
    held: dict[str, int] = {}
    """What the verdict takes off the device before the allocator's share, by the ``search.budget.Verdict``
    field (``cuda_context``, ``nccl``, ``fsdp_all_gather_stream``, ``ddp_buckets``, ``userbuffers``,
    ``symm_mem``, ``reserve``), those above 0, largest first: why ``usable_bytes`` is what it is."""
    terms: dict[str, int]
    """The three largest terms of the peak moment, largest first, in bytes."""
    counts: list[GpuCount]
    suggestions: list[Suggestion]
    notes: list[str]
    """Settings that pass but deserve a word (``notes``); also ``--json``'s top-level ``notes``."""

    def to_json(self) -> dict[str, object]:
        return self.model_dump()


# ----------------------------------------------------------------------------------------------------
# Options → command line
# ----------------------------------------------------------------------------------------------------
def _text(value: object) -> str:
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def flags(o: Options) -> list[str]:
    """The options ``o`` sets away from their defaults, as typed on a command line (``-m`` first)."""
    out = ["-m", o.model]
    for name, field in Options.model_fields.items():
        value = getattr(o, name)
        if name == "model" or value == field.default:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else f"--no-{flag[2:]}")
        else:
            out += [flag, _text(value)]
    return out


# ----------------------------------------------------------------------------------------------------
# Estimating candidates
# ----------------------------------------------------------------------------------------------------
class _Judged(NamedTuple):
    """One candidate's verdict on a GPU, as the advice shows it."""

    peak: int
    fits: bool
    devices: int
    usable: int
    """The verdict's usable bytes (``Verdict.usable_bytes``)."""
    reserved: int
    """The allocator's reserved peak, the judged figure (``Verdict.reserved_peak``)."""


def _peak_fits(o: Options, gpu: GpuPreset, reserve: int) -> _Judged | None:
    """The verdict of ``o`` on ``gpu``; None when it cannot be planned."""
    r = result(o)
    if r is None:
        return None
    v = verdict(r, gpu, reserve=reserve, expandable=o.expandable_segments)
    assert v.reserved_peak is not None  # an exact verdict replays the allocator
    return _Judged(v.peak, v.fits, r.devices, v.usable_bytes, v.reserved_peak)


def _change(o: Options, built: Result, **update: object) -> Options:
    """``o`` with ``update``: dp given directly (``--gpus`` dropped), the micro-batches per step kept."""
    base: dict[str, object] = {"gpus": None}
    if o.global_batch is not None:  # the new dp may not divide it: keep the micro-batches it made
        base |= {"global_batch": None, "grad_accum": built.micro_batches}
    return o.model_copy(update=base | update)


def _zero3(o: Options, r: Result, dp: int, full: bool) -> Options:
    extra: dict[str, object] = {"checkpointing": "full"} if full else {}
    return _change(o, r, zero=3, dp=dp, **extra)


def _zero3_args(dp: int, full: bool, cp: int = 1) -> list[str]:
    """The options of ``_zero3`` as typed: ``--zero 3`` wherever it shards — over the dp × cp ranks
    (``Setup.state_shards``: under context parallelism one data-parallel rank's cp ranks share the states
    too) —, ``--dp`` above 1; none where it shards nothing (one GPU's data-parallel rank without cp)."""
    zero = ["--zero", "3", *(["--dp", str(dp)] if dp > 1 else [])] if dp * cp > 1 else []
    return [*zero, *(["--checkpointing", "full"] if full else [])]


def gpu_count(o: Options, r: Result, gpu: GpuPreset, reserve: int) -> GpuCount:
    """The fewest GPUs of ``gpu``'s size the step fits on under ``--zero 3 --dp N`` (see the module): with
    the user's checkpointing and with ``--checkpointing full``, whichever needs fewer (the user's on a tie):
    a large GPU can hold the step without re-running its layers only over many more GPUs than with."""
    found = [_count(o, r, gpu, reserve, full) for full in (False, True)[: 1 + (o.checkpointing != "full")]]
    fitting = [c for c in found if c.devices is not None]  # min keeps the first of equals: the user's
    return min(fitting, key=lambda c: c.devices or 0) if fitting else found[-1]


def _count(o: Options, r: Result, gpu: GpuPreset, reserve: int, full: bool) -> GpuCount:
    """``gpu_count`` for one checkpointing choice: dp doubles from 1 until it fits, then a bisection finds
    the smallest that fits; the user's own configuration instead where it fits on no more GPUs."""
    world = r.devices // r.setup.strategy.dp  # tp · cp · pp, kept
    # memory shown: the judged configuration's (its verdict leaves NCCL's buffers, FSDP2's all-gather stream
    # and DDP's buckets out: they depend on dp); before any is judged, the device's less context and reserve
    last: _Judged | None = None  # the last dp that could be planned and did not fit

    def at(dp: int) -> _Judged | None:
        return _peak_fits(_zero3(o, r, dp, full), gpu, reserve)

    low, high = 0, 1  # low: known not to fit (0: nothing below 1); high: tried next
    got = at(high)
    while (got is None or not got.fits) and high < MAX_DP:
        last = got or last
        low, high = high, min(2 * high, MAX_DP)
        got = at(high)
    if got is None or not got.fits:
        last = got or last
        refused = refusal(_zero3(o, r, 2, full)) if last is None else None
        return GpuCount(
            gpu=gpu.name,
            # before any dp is judged: the device's memory less the context and the reserve
            usable_bytes=allocator_memory(gpu, reserve) if last is None else last.usable,
            devices=None,
            dp=None,
            args=[],
            peak=0 if last is None else last.peak,
            reserved=0 if last is None else last.reserved,
            refused=refused,
            hsdp=r.setup.strategy.hsdp or None,
        )
    best = got
    while high - low > 1:
        mid = (low + high) // 2
        tried = at(mid)
        if tried is not None and tried.fits:
            high, best = mid, tried
        else:
            low = mid
    # The user's own configuration (with this checkpointing), where it fits this GPU on no more devices
    # than ZeRO-3 needs: nothing to change but the checkpointing (it said "--zero 3 --dp 8" for a ZeRO-1
    # step that fits 8 GB300s as it is).
    own = o.model_copy(update={"checkpointing": "full"}) if full else o
    as_is = _peak_fits(own, gpu, reserve)
    mine = as_is is not None and as_is.fits and as_is.devices <= world * high
    shown = as_is if mine and as_is is not None else best
    return GpuCount(
        gpu=gpu.name,
        # the judged configuration's (its verdict leaves NCCL's buffers, FSDP2's all-gather stream and
        # DDP's buckets out: they depend on dp)
        usable_bytes=shown.usable,
        devices=shown.devices,
        dp=r.setup.strategy.dp if mine else high,
        args=(["--checkpointing", "full"] if full and o.checkpointing != "full" else [])
        if mine
        else _zero3_args(high, full, r.setup.parallel.cp),
        peak=shown.peak,
        reserved=shown.reserved,
        hsdp=r.setup.strategy.hsdp or None,
    )


def _single_changes(o: Options) -> list[tuple[list[str], dict[str, object], str]]:
    """(args, option changes, what) of the one-option suggestions that apply to ``o``."""
    out: list[tuple[list[str], dict[str, object], str]] = []
    if o.checkpointing != "full" and not o.reversible:
        out.append((["--checkpointing", "full"], {"checkpointing": "full"}, "keep one input per layer"))
    if o.finetune is MethodChoice.FULL:
        out.append((["--finetune", "lora"], {"finetune": MethodChoice.LORA}, "train low-rank adapters only"))
    if o.optimizer is Optimizer.ADAMW and o.optimizer_impl is None:
        out.append(
            (["--optimizer", "adamw-8bit"], {"optimizer": Optimizer.ADAMW_8BIT}, "8-bit optimizer states")
        )
    return out


def suggestions(o: Options, r: Result, gpu: GpuPreset, reserve: int, count: GpuCount) -> list[Suggestion]:
    """Every suggestion that lowers the peak, estimated; the ZeRO-3 count first, then by peak."""
    peak = r.device.peak.bytes
    out: list[Suggestion] = []
    if count.dp is not None and not count.args:  # fits as it is on one GPU of this size: nothing to suggest
        return []
    # over one GPU ZeRO-3 shards nothing: the count is then full checkpointing alone, which the one-option
    # suggestions below hold (its own command, without ``--zero 3 --dp 1``)
    shards = (count.dp or 0) * r.setup.parallel.cp  # ZeRO-3's ranks (``_zero3_args``)
    if count.dp is not None and "--zero" in count.args:
        out.append(
            Suggestion(
                args=count.args,
                command=["memplan", "estimate", *flags(_zero3(o, r, count.dp, "full" in count.args))],
                peak=count.peak,
                reserved=count.reserved,
                fits=True,
                devices=count.devices or 0,
                why=f"shard weights, gradients and optimizer states over {count.dp} data-parallel GPUs"
                if r.setup.parallel.cp == 1
                else f"shard weights, gradients and optimizer states over {shards} GPUs "
                f"(dp {count.dp} × cp {r.setup.parallel.cp})",
            )
        )
    singles: list[Suggestion] = []
    for args, update, why in _single_changes(o):
        changed = o.model_copy(update=update)
        got = _peak_fits(changed, gpu, reserve)
        if got is None or got.peak > peak * (1 - MIN_SAVING):
            continue
        command = ["memplan", "estimate", *flags(changed)]
        singles.append(
            Suggestion(
                args=args,
                command=command,
                peak=got.peak,
                reserved=got.reserved,
                fits=got.fits,
                devices=got.devices,
                why=why,
            )
        )
    out += sorted(singles, key=lambda s: (s.reserved, s.peak))
    if count.dp is not None and count.devices is not None:
        out += _fit_suggestion(o, r, gpu, reserve, count)
    return out


def _fit_suggestion(o: Options, r: Result, gpu: GpuPreset, reserve: int, count: GpuCount) -> list[Suggestion]:
    """``memplan fit`` on the power of two ≥ the count (it divides fit's default global batch, a power of
    two), when ``--zero 3`` over that many data-parallel GPUs is estimated to fit (the search includes it)."""
    assert count.dp is not None and count.devices is not None
    given = {n for n, f in Options.model_fields.items() if n != "model" and getattr(o, n) != f.default}
    if given - FIT_OPTIONS - _FIT_SEARCHES:
        return []  # a setting fit does not take (a layout, offload, a loss): its search would differ
    gpus = 1 << (count.devices - 1).bit_length()
    full = "full" in count.args
    # fit's space holds tp 1, pp 1, dp = gpus, micro-batch 1, the user's attention and ZeRO 3 (with full
    # checkpointing) at its default global batch, a power of two ≥ gpus: estimate that one.
    got = _peak_fits(_zero3(o, r, gpus, full).model_copy(update={"batch": 1}), gpu, reserve)
    if got is None or not got.fits:
        return []
    seq = str(r.setup.training.seq_len)
    name = o.gpu or gpu.name  # as typed: a preset file's path stays a path
    command = ["memplan", "fit", "-m", o.model, "--seq", seq, "--gpu", name, "--gpus", str(gpus)]
    own = {n: getattr(o, n) for n in given & FIT_OPTIONS - {"seq"}}
    command += flags(o.model_validate({"model": o.model, **own}))[2:]
    return [
        Suggestion(
            args=command[2:],
            command=command,
            peak=got.peak,
            reserved=got.reserved,
            fits=True,
            devices=gpus,
            why=f"the fastest layouts (tp, pp, dp, ZeRO, checkpointing) on {gpus} GPU{'s' * (gpus > 1)}",
        )
    ]


# ----------------------------------------------------------------------------------------------------
# The verdict
# ----------------------------------------------------------------------------------------------------
@functools.cache
def _presets() -> tuple[GpuPreset, ...]:
    """The shipped GPU presets, smallest memory first (ties: by name)."""
    return tuple(sorted((load_gpu(n) for n in gpu_names()), key=lambda g: (g.device_bytes, g.name)))


def top_terms(r: Result, n: int = TOP_TERMS) -> dict[str, int]:
    """The ``n`` largest terms of the peak moment on the most loaded device, largest first (ties: the
    allocation order)."""
    moment = r.device.peak.moments[r.device.peak.phase]
    order = sorted(moment.items(), key=lambda kv: -kv[1])
    return dict(order[:n])


def _judged_against(b: Built) -> tuple[GpuPreset, int, bool]:
    """(GPU, reserve bytes, given): ``--gpu``; else the smallest preset whose verdict fits with the default
    reserve (the allocator's reserved peak, not the tensors': a 3B LoRA step at 8,192 tokens has a 38.4 GiB
    peak and reserves 40.3 GiB, over an A100 40GB's 39.25), else the largest preset."""
    if b.gpu is not None:
        return b.gpu, reserve_bytes(b.options.reserve, b.gpu), True
    peak = b.result.device.peak.bytes  # below the reserved peak: a preset it passes cannot hold the step
    for g in _presets():
        if peak > allocator_memory(g, DEFAULT_RESERVE):
            continue
        if verdict(b.result, g, reserve=DEFAULT_RESERVE, expandable=b.options.expandable_segments).fits:
            return g, DEFAULT_RESERVE, False
    return _presets()[-1], DEFAULT_RESERVE, False


def advise(b: Built) -> Advice:
    """The verdict of ``b`` (see the module docstring)."""
    r, o = b.result, b.options
    gpu, reserve, given = _judged_against(b)
    # judged as the estimate's own fit (``api.build``): the allocator the user typed
    v = verdict(r, gpu, reserve=reserve, expandable=o.expandable_segments)
    assert v.reserved_peak is not None  # an exact verdict replays the allocator
    counts: list[GpuCount] = []
    found: list[Suggestion] = []
    if not v.fits:
        counts.append(gpu_count(o, r, gpu, reserve))
        largest = _presets()[-1]
        if given and largest.device_bytes > gpu.device_bytes:
            preset = gpu_of(o.model_copy(update={"gpu_memory": None}), largest.name)  # its own memory
            counts.append(gpu_count(o, r, preset, DEFAULT_RESERVE))
        found = suggestions(o, r, gpu, reserve, counts[0])
    return Advice(
        gpu=gpu.name,
        gpu_given=given,
        memory_bytes=gpu.memory_bytes,
        usable_bytes=v.usable_bytes,
        peak=v.peak,
        phase=v.phase,
        reserved=v.reserved_peak,
        fits=v.fits,
        headroom=v.headroom,
        devices=r.devices,
        held=v.held(),
        terms=top_terms(r),
        counts=counts,
        suggestions=found,
        notes=notes(b),
    )
