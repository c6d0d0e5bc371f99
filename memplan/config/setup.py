"""Everything one estimate depends on: the model, how it is trained, the strategy, the parallel layout and
the device's kernels. One device of a dense model is the trivial layout (``Parallel()``), not another case.

``Parallel`` holds the degrees that split the model itself: tensor (``tp``), sequence (``sp``, over the
same ranks as tp), pipeline (``pp``, with ``vpp`` virtual stages per rank for the interleaved schedule)
and expert (``ep``) parallelism. Data parallelism and the ZeRO stage live in ``StrategyConfig.dp`` /
``.zero``; the world is ``tp · pp · dp`` devices and expert parallelism takes its ranks from data
parallelism (Megatron-Core: ``dp % ep == 0``).
"""

from __future__ import annotations

from enum import Enum, IntEnum
from typing import Any, Self

from pydantic import Field, model_validator

from memplan.config._base import Frozen
from memplan.config.model import ModelConfig, PositionType
from memplan.config.strategy import Checkpointing, Device, StrategyConfig, ZeroStage, checkpointing_label
from memplan.config.training import TrainingConfig


class Parallel(Frozen):
    """Degrees of model parallelism (data parallelism and ZeRO live in ``StrategyConfig``)."""

    tp: int = Field(default=1, gt=0, le=1 << 12, description="tensor-parallel degree t")
    sp: bool = Field(default=False, description="sequence parallelism over the tensor-parallel ranks")
    pp: int = Field(default=1, gt=0, le=1 << 12, description="pipeline stages p")
    vpp: int = Field(default=1, gt=0, le=1 << 12, description="virtual stages per pipeline rank m")
    pp_layers: tuple[int, ...] | None = Field(
        default=None,
        description="layers of each pipeline stage, first to last, or with vpp > 1 of each of the p·m "
        "virtual stages in model order (0 for a chunk of the embedding or head alone); none: ⌈L/p⌉ each, one "
        "fewer on the first and last stages in turn when p does not divide L (Llama 3 405B: 126 layers over "
        "16 stages)",
    )
    ep: int = Field(default=1, gt=0, le=1 << 12, description="expert-parallel degree (MoE)")

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.sp and self.tp == 1:
            raise ValueError(
                "sp: sequence parallelism splits over the tensor-parallel ranks; "
                "add --tp 2 or more, or drop --sp"
            )
        if self.vpp > 1 and self.pp == 1:
            raise ValueError("vpp: the interleaved schedule needs pipeline parallelism; add --pp 2 or more")
        if self.pp_layers is not None:
            virtual = self.pp * self.vpp
            if len(self.pp_layers) == virtual > self.pp:  # one count per virtual stage, model order
                ranks = [sum(self.pp_layers[i :: self.pp]) for i in range(self.pp)]
                if min(self.pp_layers) < 0 or min(ranks) < 1:
                    raise ValueError(
                        "pp_layers: a virtual stage may hold 0 layers (the embedding or head alone) but "
                        "every pipeline rank needs at least one layer"
                    )
            elif len(self.pp_layers) != self.pp:
                also = f", or one per virtual stage ({virtual})" if self.vpp > 1 else ""
                raise ValueError(
                    f"pp_layers: {len(self.pp_layers)} stages listed for --pp {self.pp}; "
                    f"give one layer count per stage{also}"
                )
            elif min(self.pp_layers) < 1:
                raise ValueError("pp_layers: every pipeline stage needs at least one layer")
        return self

    @property
    def model_parallel(self) -> int:
        """Devices one model replica spans: tp · pp."""
        return self.tp * self.pp

    def label(self) -> str:
        """``tp8+sp·pp8×2·ep1`` style summary for tables."""
        sp = "+sp" if self.sp else ""
        vpp = f"×{self.vpp}" if self.vpp > 1 else ""
        ep = f"·ep{self.ep}" if self.ep > 1 else ""
        return f"tp{self.tp}{sp}·pp{self.pp}{vpp}{ep}"


class Setup(Frozen):
    """Everything one estimate depends on."""

    model: ModelConfig
    training: TrainingConfig = TrainingConfig()
    strategy: StrategyConfig = StrategyConfig()
    parallel: Parallel = Parallel()
    device: Device = Device.CUDA

    @model_validator(mode="after")
    def _check(self) -> Self:
        m, t, s = self.model, self.training, self.strategy
        if m.position is PositionType.LEARNED and t.seq_len > m.max_positions:
            raise ValueError(
                f"seq_len: {t.seq_len} exceeds the {m.max_positions} learned positions of {m.name}; "
                f"use --seq {m.max_positions} or less"
            )
        if s.checkpointing is Checkpointing.EVERY_K and s.checkpoint_every > m.num_layers:
            raise ValueError(
                f"checkpointing: every-{s.checkpoint_every} exceeds the {m.num_layers} layers; "
                f"choose k between 1 and {m.num_layers}"
            )
        return self

    def settings(self) -> dict[str, Any]:
        """Every setting but the model's, flat and JSON-ready, under its field's name: the ``setup`` object
        of ``--json`` and its schema (``schema.py``) come from here. Checkpointing is one value
        (``every-4``); choices are their names, the ZeRO stage its number."""
        out = {
            name: json_value(v) for part in (self.training, self.strategy, self.parallel) for name, v in part
        }
        del out["checkpoint_every"]
        out["checkpointing"] = checkpointing_label(self.strategy)
        out["device"] = self.device.value
        return out


def json_value(value: Any) -> Any:
    """A setting as ``--json`` writes it: an enum's value (a string), an ordered choice's lower-case name
    (``flash``), the ZeRO stage's number."""
    if isinstance(value, ZeroStage):
        return int(value)
    if isinstance(value, IntEnum):
        return value.name.lower()
    return value.value if isinstance(value, Enum) else value
