"""Names → setup → result: what the CLI, the tests and the benchmarks call.

``Options`` holds every setting of one estimate as the user gives it (preset names, ``--checkpointing
every-4``, ``--gpus`` instead of ``--dp``); ``build(options)`` resolves the names, validates a ``Setup``
(one device, dense, is ``Parallel()`` and ``moe`` None: the trivial case of the same path), runs the
engine and, with a GPU, the memory verdict and the step time. ``memplan compare --vary KEY=A,B``
replaces one ``Options`` field by name and re-validates, so a vary value is parsed and checked exactly
as the option would be.

Devices: ``--gpus N`` is the world size tp · pp · dp; without ``--dp`` it sets dp = N / (tp · pp).
Micro-batches per step: ``--global-batch B`` sequences make B / (micro-batch · dp) of them (the pipeline's
micro-batches, gradient accumulation otherwise); else ``--grad-accum`` (default 1).

Every user mistake raises a one-line ``ValueError`` (``field: what is wrong; fix``). Pure Python, no torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from memplan.config import (
    AttentionChoice,
    Device,
    ModelConfig,
    Optimizer,
    Parallel,
    Precision,
    Setup,
    TrainingConfig,
    parse_checkpointing,
)
from memplan.engine import Result, estimate
from memplan.presets import GpuPreset, ModelPreset, load_gpu, load_model_preset
from memplan.search.budget import Verdict, verdict
from memplan.time.timing import Timing, timing

DEFAULT_SEQ = TrainingConfig().seq_len
"""``--seq`` when not given: 2048 tokens, or the model's context length (max_positions) if shorter."""

_LISTS = "(`memplan presets` lists them)"


class Options(BaseModel):
    """Every setting of one estimate (field names = option names with ``_`` for ``-``)."""

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


# ----------------------------------------------------------------------------------------------------
# Names → setup
# ----------------------------------------------------------------------------------------------------
def load_model(model: str | None) -> ModelPreset:
    """The preset ``--model`` names (dense or a mixture of experts, a preset file or a config.json);
    a one-line ``ValueError`` (with suggestions) if missing or unknown."""
    if model is None:
        raise ValueError(f"model: required; pass --model NAME (e.g. --model 70b) or a file path {_LISTS}")
    return load_model_preset(model)


@functools.lru_cache(maxsize=64)
def _cached_model(name: str) -> ModelPreset:
    return load_model(name)


def build_setup(
    model: str | ModelConfig | None,
    *,
    seq: int | None = None,
    batch: int = 1,
    precision: Precision = Precision.BF16_MIXED,
    optimizer: Optimizer = Optimizer.ADAMW,
    grad_accum: int = 1,
    checkpointing: str = "none",
    attention: AttentionChoice = AttentionChoice.FLASH,
    reversible: bool = False,
    zero: int = 0,
    dp: int = 1,
    dropout: float | None = None,
    device: Device = Device.CUDA,
    parallel: Parallel | None = None,
) -> Setup:
    """A validated ``Setup`` from option values (the defaults are the options' defaults).

    ``model`` is what ``--model`` names (preset, alias or path) or an already built ``ModelConfig``.
    Raises ``ValueError`` / ``ValidationError``.
    """
    cfg = model if isinstance(model, ModelConfig) else load_model(model).model
    mode, every = parse_checkpointing(checkpointing)
    model_data: ModelConfig | dict[str, Any] = cfg
    if dropout is not None:
        # Re-validated as a dict so that a bad probability is reported against the model's fields.
        model_data = {
            **cfg.model_dump(),
            "attn_dropout": dropout,
            "resid_dropout": dropout,
            "embd_dropout": dropout,
        }
    return Setup.model_validate(
        {
            "model": model_data,
            "training": {
                "micro_batch": batch,
                "seq_len": seq if seq is not None else min(DEFAULT_SEQ, cfg.max_positions),
                "precision": precision,
                "optimizer": optimizer,
                "grad_accum": grad_accum,
            },
            "strategy": {
                "checkpointing": mode,
                "checkpoint_every": every,
                "attention": attention.attention,
                "reversible": reversible,
                "zero": zero,
                "dp": dp,
            },
            "parallel": parallel or Parallel(),
            "device": device,
        }
    )


def _choices(n: int, step: int) -> str:
    lower = n - n % step
    return f"{lower} or {lower + step}" if lower else str(step)


def data_parallel(o: Options) -> int:
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


def micro_batches(o: Options, dp: int) -> int:
    """Micro-batches per step per pipeline, from ``--global-batch`` or ``--grad-accum``."""
    if o.global_batch is None:
        return 1 if o.grad_accum is None else o.grad_accum
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


def setup_of(o: Options) -> Setup:
    """The validated ``Setup`` that ``o`` describes."""
    dp = data_parallel(o)
    return build_setup(
        _cached_model(o.model).model,
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
        parallel=Parallel(tp=o.tp, sp=o.sp, pp=o.pp, vpp=o.vpp, ep=o.ep),
    )


# ----------------------------------------------------------------------------------------------------
# Setup → result
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Built:
    """One estimate and, with a GPU, whether it fits and how long a step takes."""

    options: Options
    result: Result
    gpu: GpuPreset | None
    verdict: Verdict | None
    timing: Timing | None


def build(o: Options) -> Built:
    """Estimate the configuration ``o`` describes; ``ValueError`` (one line) for any user mistake."""
    result = estimate(setup_of(o))
    if o.gpu is None:
        if o.mfu is not None or o.step_time is not None or o.tokens is not None:
            raise ValueError(
                "gpu: time needs a GPU's peak FLOP/s; add --gpu NAME (`memplan gpus` lists them)"
            )
        return Built(o, result, None, None, None)
    gpu = load_gpu(o.gpu)
    t = timing(result, gpu, mfu=o.mfu, step_time=o.step_time, tokens=o.tokens)
    return Built(o, result, gpu, verdict(result, gpu), t)


def to_json(b: Built) -> dict[str, Any]:
    """The estimate's JSON contract (``memplan.contract``) with ``fit`` and ``time``."""
    from memplan.contract import to_json as result_json

    out = result_json(b.result)
    out["fit"] = b.verdict.to_json() if b.verdict else None
    out["time"] = b.timing.to_json() if b.timing else None
    return out
