"""The planning commands' settings as one validated object, and what they build: plan, GPU verdict, time.

``PlanOptions`` holds every setting ``memplan plan`` takes (the shared estimate options of
``cli_common`` plus parallelism, GPU and time); ``memplan compare --vary KEY=A,B`` replaces one field by
name and re-validates, so a vary value is parsed and checked exactly as the option would be.

Devices: ``--gpus N`` is the world size tp · pp · dp; without ``--dp`` it sets dp = N / (tp · pp).
Micro-batches per step: ``--global-batch B`` sequences make B / (micro-batch · dp) of them (the pipeline's
micro-batches, gradient accumulation otherwise); else ``--grad-accum`` (default 1).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from memplan.cli_common import AttentionChoice, build_setup
from memplan.config import Device, Optimizer, Precision
from memplan.plan.budget import Verdict, verdict
from memplan.plan.device import Plan, plan
from memplan.plan.parallel import Parallel
from memplan.plan.presets import PlanModel, load_plan_model
from memplan.plan.timing import Timing, timing
from memplan.presets import GpuPreset, load_gpu


class PlanOptions(BaseModel):
    """Every setting of one planned configuration (field names = option names with ``_`` for ``-``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(min_length=1)
    seq: int | None = None
    batch: int = 1
    precision: Precision = Precision.BF16_MIXED
    optimizer: Optimizer = Optimizer.ADAMW
    grad_accum: int | None = None
    global_batch: int | None = Field(default=None, gt=0)
    checkpointing: str = "none"
    attention: AttentionChoice = AttentionChoice.FLASH
    reversible: bool = False
    zero: int = 0
    dp: int | None = Field(default=None, gt=0)
    gpus: int | None = Field(default=None, gt=0)
    tp: int = 1
    sp: bool = False
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    dropout: float | None = None
    device: Device = Device.CUDA
    gpu: str | None = None
    mfu: float | None = None
    step_time: float | None = None
    tokens: int | None = None


def _choices(n: int, step: int) -> str:
    lower = n - n % step
    return f"{lower} or {lower + step}" if lower else str(step)


def data_parallel(o: PlanOptions) -> int:
    """dp from ``--dp`` or ``--gpus`` / (tp · pp); one-line errors when they disagree."""
    world = o.tp * o.pp
    if o.gpus is None:
        return o.dp or 1
    if o.dp is None:
        if o.gpus % world:
            raise ValueError(
                f"gpus: {o.gpus} devices do not split into tp {o.tp} × pp {o.pp} = {world}-device model "
                f"replicas; use --gpus {_choices(o.gpus, world)}"
            )
        return o.gpus // world
    if o.dp * world != o.gpus:
        raise ValueError(
            f"dp: tp {o.tp} × pp {o.pp} × dp {o.dp} = {world * o.dp} devices, not --gpus {o.gpus}; "
            "drop --dp (it follows from --gpus) or make them agree"
        )
    return o.dp


def micro_batches(o: PlanOptions, dp: int) -> int:
    """Micro-batches per step per pipeline, from ``--global-batch`` or ``--grad-accum``."""
    if o.global_batch is None:
        return o.grad_accum or 1
    per = o.batch * dp
    if o.global_batch % per:
        raise ValueError(
            f"global-batch: {o.global_batch} sequences are not a multiple of micro-batch {o.batch} × dp {dp} "
            f"= {per}; use --global-batch {_choices(o.global_batch, per)}"
        )
    n = o.global_batch // per
    if o.grad_accum is not None and o.grad_accum != n:
        raise ValueError(
            f"grad-accum: {o.grad_accum} disagrees with --global-batch {o.global_batch} "
            f"= {o.batch} × {dp} × {n}; give one of them"
        )
    return n


@functools.lru_cache(maxsize=64)
def model_of(name: str) -> PlanModel:
    return load_plan_model(name)


@dataclass(frozen=True)
class Built:
    options: PlanOptions
    model: PlanModel
    plan: Plan
    gpu: GpuPreset | None
    verdict: Verdict | None
    timing: Timing | None

    def to_json(self) -> dict[str, Any]:
        """The plan's JSON (the estimate's keys for the most loaded device) with ``fit`` and ``time``."""
        out = self.plan.to_json()
        out["fit"] = self.verdict.to_json() if self.verdict else None
        out["time"] = self.timing.to_json() if self.timing else None
        return out


def build(o: PlanOptions) -> Built:
    """Plan the configuration ``o`` describes; ``ValueError`` (one line) for any user mistake."""
    pm = model_of(o.model)
    dp = data_parallel(o)
    setup = build_setup(
        pm.model,
        seq=o.seq,
        batch=o.batch,
        precision=o.precision,
        optimizer=o.optimizer,
        grad_accum=micro_batches(o, dp),
        checkpointing=o.checkpointing,
        attention=o.attention,
        reversible=o.reversible,
        zero=o.zero,
        dp=dp,
        dropout=o.dropout,
        device=o.device,
    )
    parallel = Parallel(tp=o.tp, sp=o.sp, pp=o.pp, vpp=o.vpp, ep=o.ep)
    p = plan(setup, parallel, pm.moe)
    if o.gpu is None:
        if o.mfu is not None or o.step_time is not None or o.tokens is not None:
            raise ValueError(
                "gpu: time needs a GPU's peak FLOP/s; add --gpu NAME (`memplan gpus` lists them)"
            )
        return Built(o, pm, p, None, None, None)
    gpu = load_gpu(o.gpu)
    t = timing(p, gpu, mfu=o.mfu, step_time=o.step_time, tokens=o.tokens)
    return Built(o, pm, p, gpu, verdict(p, gpu), t)
