"""Real training steps of the reference model: measured peak, saved bytes, FLOPs and time vs the estimate.

One instrumented step counts saved tensors and FLOPs (``run.run_step``); then warm-up steps make the
optimizer's states, and measured steps (forward + backward for each micro-batch, then the optimizer step)
are timed and their peak taken: on CUDA from the caching allocator (``max_memory_allocated``), on CPU from
``LiveMemoryTracker`` (every storage alive: weights, gradients, optimizer states, activations and
transients). Absolute times mean something on a GPU only.
"""

from __future__ import annotations

import errno
import functools
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from memplan.config import Setup
from memplan.files import write_with
from memplan.measure.instruments.measured import Measured
from memplan.measure.instruments.tracker import (
    CudaCurveRecorder,
    CudaPeak,
    Curve,
    LiveMemoryTracker,
    cuda_peak,
)
from memplan.measure.reference.context import rotate_method
from memplan.measure.reference.model import Reference
from memplan.measure.reference.optim import ReferenceOptimizer
from memplan.measure.runs.run import make_batch, ring, run_step

OUT_OF_MEMORY: tuple[type[BaseException], ...] = (torch.OutOfMemoryError, MemoryError)
"""What a run that does not fit raises: the CUDA allocator's error, or the host's."""


def resolve_device(requested: str | None) -> str:
    """``cuda`` when available unless asked otherwise; ValueError naming ``--device`` for the impossible."""
    cuda = torch.cuda.is_available()
    dev = requested or ("cuda" if cuda else "cpu")
    if dev not in ("cpu", "cuda") and not dev.startswith("cuda:"):
        raise ValueError(f"device: unknown '{dev}'; use --device cuda or --device cpu")
    if dev.startswith("cuda") and not cuda:
        raise ValueError("device: CUDA is not available here; use --device cpu")
    return dev


def available_memory(dev: str) -> tuple[int, str]:
    """Bytes the run can still allocate on ``dev``, and where the figure comes from: on CUDA the driver's
    free memory (``torch.cuda.mem_get_info``); on CPU the kernel's MemAvailable (/proc/meminfo, else
    ``os.sysconf``), capped by a cgroup v2 memory limit when the process runs under one."""
    if dev.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(dev))
        return int(free), f"free on {dev}"
    avail, where = _meminfo_available()
    limit = _cgroup_headroom()
    if limit is not None and limit < avail:
        return limit, "left under this container's memory limit"
    return avail, where


def _meminfo_available() -> tuple[int, str]:
    try:
        for line in Path("/proc/meminfo").read_text(encoding="ascii").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "available host memory"
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "free host memory"


def _cgroup_headroom() -> int | None:
    """memory.max − memory.current of this process's cgroup (v2); None without a limit."""
    try:
        root = Path("/sys/fs/cgroup")
        limit = (root / "memory.max").read_text(encoding="ascii").strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((root / "memory.current").read_text(encoding="ascii")))
    except (OSError, ValueError):
        return None


@contextmanager
def cuda_memory_snapshot(path: str | None) -> Iterator[None]:
    """Record the CUDA allocator's history over the block and dump it to ``path`` for
    pytorch.org/memory_viz (nothing when ``path`` is None)."""
    if path is None:
        yield
        return
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    try:
        yield
        write_with(path, "memory-snapshot", torch.cuda.memory._dump_snapshot)  # whole or not at all
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


@dataclass
class Profile:
    measured: Measured
    peak: int
    phase_peaks: dict[str, int]
    step_seconds: list[float]
    phase_seconds: dict[str, float] = field(default_factory=dict)
    device: str = "cpu"
    curve: Curve | None = None
    """Live bytes over the step that peaked highest (CPU: its tracker; CUDA with ``curve=True``: the
    allocator's history of the last step), with the step's boundaries noted (``StepRunner.step``)."""

    @property
    def median_step(self) -> float:
        s = sorted(self.step_seconds)
        return s[len(s) // 2]


class StepRunner:
    """Owns the model, optimizer and batch of one profiling session."""

    def __init__(self, setup: Setup, device: str, ring: Any = None) -> None:
        """``ring``: with context parallelism, the process group of the rank simulated (``run.ring``):
        the model's attention runs torch's ring over it and the batch is the rank's head-tail chunks."""
        torch.manual_seed(0)
        self.setup = setup
        self.device = device
        self.model = Reference(setup, device=device)
        trainable: list[torch.Tensor] = [
            p for p in self.model.parameters() if p.requires_grad
        ]  # frozen: no state
        self.opt = ReferenceOptimizer(trainable, setup.training.precision, setup.training.optimizer)
        ids, labels = make_batch(setup, device)
        if ring is not None:
            self.model.ring = ring
            mine = self.model.positions(ids.shape[1] // setup.parallel.cp, ids.device)
            ids, labels = ids[:, mine], labels[:, mine]
        self.batch = ids, labels

    def sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def step(
        self,
        mark: Callable[[str], None],
        times: dict[str, float],
        note: Callable[[str], None] | None = None,
    ) -> None:
        """zero_grad; forward + backward per micro-batch; optimizer step (marks after each phase). With
        ``note``, the boundaries on the curve: "start" of each micro-batch, "forward i" after layer i's
        forward, "backward <block>" when the output gradient of the lm head, the final norm, layer i or the
        embedding is ready (its backward begins)."""
        self.opt.zero_grad()
        self.model.on_layer = None if note is None else lambda phase, i: note(f"{phase} {i}")
        self.model.on_note = note
        for _ in range(self.setup.training.grad_accum):
            if note is not None:
                note("start")
            t0 = time.perf_counter()
            loss = self.model(*self.batch)
            self.sync()
            t1 = time.perf_counter()
            mark("forward")
            loss.backward()
            del loss
            self.sync()
            t2 = time.perf_counter()
            mark("backward")
            times["forward"] = times.get("forward", 0.0) + t1 - t0
            times["backward"] = times.get("backward", 0.0) + t2 - t1
        t3 = time.perf_counter()
        self.opt.step()
        self.sync()
        times["optimizer"] = times.get("optimizer", 0.0) + time.perf_counter() - t3
        mark("optimizer step")
        self.model.on_layer = self.model.on_note = None


@contextmanager
def cpu_tracking(runner: StepRunner) -> Iterator[LiveMemoryTracker]:
    tracker = LiveMemoryTracker()
    with tracker:
        tracker.track([*runner.model.parameters(), *runner.opt.tensors(), *runner.batch])
        yield tracker


def matmul_rate(dtype: torch.dtype, n: int = 256, seconds: float = 0.05) -> float:
    """FLOP/s of an n × n × n matmul in ``dtype`` on the CPU (2n³ FLOPs each), timed over at least
    ``seconds`` and 3 runs after one warm-up: what ``profile`` tells the user before a slow bf16 run."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b
    runs, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds or runs < 3:
        a @ b
        runs += 1
    return 2 * n**3 * runs / elapsed


def bf16_and_fp32_rates() -> tuple[float, float]:
    """``matmul_rate`` in bf16 and in fp32 on this CPU (``profile``'s slow-bf16 note)."""
    return matmul_rate(torch.bfloat16), matmul_rate(torch.float32)


def profile(
    setup: Setup,
    device: str = "cpu",
    warmup: int = 1,
    steps: int = 2,
    torch_trace: str | None = None,
    curve: bool = False,
    on_step: Callable[[str], None] | None = None,
    cp_rank: int = 0,
) -> Profile:
    """Real training steps of the reference model: saves, FLOPs, peak and times, and on CPU the curve of
    live bytes (on CUDA too with ``curve``: the allocator's recorded history, which slows the step). A
    mixture of experts' peak is the estimate's where ``blocks.moe.backward`` replays its MLP's backward
    (tests/measure/test_moe_peak.py); elsewhere (``applies``) its saves and FLOPs are.
    ``on_step(what)`` is called after each pass (the saves' run, each warm-up and measured step): a
    progress bar. With context parallelism the run is rank ``cp_rank`` of the ring on the CPU (torch's
    ring attention over a fake process group, ``run.ring``; its rotate method ``--cp-rotate``'s)."""
    cp = setup.parallel.cp
    with (
        ring(cp, cp_rank, device) as group,
        rotate_method(setup.parallel.cp_rotate.value) if cp > 1 else (nullcontext()),
    ):
        return _profile(setup, device, warmup, steps, torch_trace, curve, on_step, group)


def _profile(
    setup: Setup,
    device: str,
    warmup: int,
    steps: int,
    torch_trace: str | None,
    curve: bool,
    on_step: Callable[[str], None] | None,
    group: Any,
) -> Profile:
    done = on_step or (lambda _: None)
    runner = StepRunner(setup, device, group)
    measured = run_step(runner.model, *runner.batch)
    done("saved tensors counted")
    runner.opt.zero_grad()
    times: dict[str, float] = {}
    for i in range(warmup):
        runner.step(lambda _: None, {})
        done(f"warm-up step {i + 1}")
    step_seconds: list[float] = []
    phase_peaks: dict[str, int] = {}
    best: Curve | None = None
    prof_ctx: Any = (
        torch.profiler.profile(record_shapes=True, profile_memory=True) if torch_trace else nullcontext()
    )
    with prof_ctx as prof:
        for _ in range(steps):
            t0 = time.perf_counter()
            if device.startswith("cuda"):
                cp, best = _cuda_step(runner, times, curve)
                peak = cp.peak
                phase_peaks["step"] = max(phase_peaks.get("step", 0), peak)
                # What nvidia-smi sees (the caching allocator's reserved segments), and its retries.
                phase_peaks["reserved"] = max(phase_peaks.get("reserved", 0), cp.reserved_peak)
                phase_peaks["alloc_retries"] = max(phase_peaks.get("alloc_retries", 0), cp.alloc_retries)
            else:
                runner.opt.zero_grad()  # grads of the previous step are not part of this one's baseline
                with cpu_tracking(runner) as tracker:
                    runner.step(functools.partial(_mark, tracker, peaks=phase_peaks), times, tracker.note)
                peak = tracker.peak
                if best is None or tracker.peak > best.peak:
                    best = tracker.curve
            step_seconds.append(time.perf_counter() - t0)
            done(f"measured step {len(step_seconds)}")
    if torch_trace and prof is not None:
        write_with(torch_trace, "torch-trace", functools.partial(export_chrome_trace, prof))
    per_step = {k: v / steps for k, v in times.items()}
    peak = phase_peaks["step"] if device.startswith("cuda") else max(phase_peaks.values())
    return Profile(measured, peak, phase_peaks, step_seconds, per_step, device, best)


def export_chrome_trace(prof: Any, path: str) -> None:
    """``prof.export_chrome_trace(path)``, raising ``OSError`` when it could not write the file.

    Kineto's writer (C++, ``output_json.cpp``) writes ``path + ".tmp"`` and renames it onto ``path`` only
    when every write succeeded; on a failed write (a full disk) it logs "Failed to write to log file!"
    and returns normally, leaving the partial ``.tmp`` (torch 2.13: no exception reaches Python). That
    outcome is read from the files it leaves: no ``path``, or a ``.tmp`` beside it."""
    leftover = Path(path + ".tmp")
    prof.export_chrome_trace(path)
    if leftover.exists() or not Path(path).exists():
        leftover.unlink(missing_ok=True)
        if os.statvfs(Path(path).parent).f_bavail == 0:  # the usual cause, and one that can be told
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        raise OSError(errno.EIO, "PyTorch's trace writer could not write the whole trace")


def _cuda_step(runner: StepRunner, times: dict[str, float], curve: bool) -> tuple[CudaPeak, Curve | None]:
    """One step on CUDA: the allocator's peak, and with ``curve`` its recorded history as a `Curve`."""
    if not curve:
        with cuda_peak() as cp:
            runner.step(lambda _: None, times)
        return cp, None
    recorder = CudaCurveRecorder()
    with cuda_peak() as cp, recorder.recording():
        runner.step(recorder.note, times, recorder.note)
    return cp, recorder.curve()


def _mark(tracker: LiveMemoryTracker, name: str, *, peaks: dict[str, int]) -> None:
    m = tracker.mark(name)
    peaks[name] = max(peaks.get(name, 0), m.peak)
