"""What ``fit`` answers: the searched families, the configurations that fit (``Config``), the families that
do not (``Rejected``), each method's best (``Outcome``) and the search as a whole (``FitResult``).

A listed configuration's verdict (``budget.verdict``: the allocator's reserved peak, the headroom) is
computed when it is read — for the rows shown, the JSON's configurations — not for every configuration
that fits: the search itself judges fit or not (``budget.fits``), which needs no unlimited replay.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from memplan.config import (
    FULL_TRAINING,
    Attention,
    Checkpointing,
    CpRotate,
    FineTune,
    Setup,
    ZeroStage,
    loss_label,
    offload_label,
)
from memplan.contract import to_json as result_json
from memplan.engine import Result
from memplan.presets import GpuPreset
from memplan.search.bound import Cutoff
from memplan.search.budget import DEFAULT_RESERVE, Verdict, allocator_memory, verdict
from memplan.search.command import estimate_command
from memplan.search.methods import SAVERS
from memplan.search.space import Layout
from memplan.time.timing import Timing


@dataclass(frozen=True)
class Family:
    checkpointing: Checkpointing
    attention: Attention
    zero: ZeroStage
    layout: Layout
    finetune: FineTune = FULL_TRAINING
    saver: int = 0
    """The level of memory savers (``methods.SAVERS``: offload, loss)."""

    def settings(self) -> dict[str, Any]:
        par = self.layout.parallel
        saver = SAVERS[self.saver]
        return {
            "method": self.finetune.method.name.lower(),
            "offload": offload_label(saver.offload),
            "loss": loss_label(saver.loss, 1),
            "checkpointing": self.checkpointing.name.lower(),
            "attention": self.attention.name.lower(),
            "zero": int(self.zero),
            "tp": par.tp,
            "sp": par.sp,
            "pp": par.pp,
            "vpp": par.vpp,
            "pp_layers": list(par.pp_layers) if par.pp_layers is not None else None,
            "ep": par.ep,
            "etp": par.expert_tp,
            "cp": par.cp,
            "cp_rotate": par.cp_rotate.value,
            "dp": self.layout.dp,
            "hsdp": self.layout.hsdp,
        }


@dataclass(frozen=True)
class Config:
    """A configuration that fits (on ``gpu`` with ``reserve`` bytes kept back)."""

    family: Family
    result: Result
    timing: Timing
    gpu: GpuPreset
    reserve: int = DEFAULT_RESERVE
    expandable: bool = False
    """Judged with the allocator under ``expandable_segments:True`` (``fit --expandable-segments``)."""

    @functools.cached_property
    def verdict(self) -> Verdict:
        """``budget.verdict`` of the configuration (the allocator's replays: computed when first read)."""
        return verdict(self.result, self.gpu, reserve=self.reserve, expandable=self.expandable)

    @property
    def micro_batch(self) -> int:
        return self.result.setup.training.micro_batch

    @property
    def peak(self) -> int:
        """The most loaded device's peak (``memory.peak``; the verdict's ``peak``)."""
        return self.result.device.peak.bytes

    def sort_key(self) -> tuple[int, int, float, int, int, int, int]:
        par = self.family.layout.parallel
        return (
            int(self.family.finetune.method),
            self.family.saver,
            -self.timing.tokens_per_s,
            par.model_parallel,
            int(self.family.zero),
            -self.micro_batch,
            self.peak,
        )

    def to_json(self) -> dict[str, Any]:
        out = result_json(self.result)
        out["settings"] = {**self.family.settings(), "micro_batch": self.micro_batch}
        out["fit"] = self.verdict.to_json()
        out["time"] = self.timing.to_json()
        return out


@dataclass(frozen=True)
class Rejected:
    """A family none of whose micro-batch sizes fits, with the verdict of its smallest."""

    family: Family
    micro_batch: int
    verdict: Verdict

    def to_json(self) -> dict[str, Any]:
        return {**self.family.settings(), "micro_batch": self.micro_batch, "fit": self.verdict.to_json()}


@dataclass(frozen=True)
class Outcome:
    """One method's answer: its fastest configuration at the lowest saver level that fits (None: none)."""

    finetune: FineTune
    best: Config | None
    levels: tuple[int, ...] = ()
    """The saver levels searched for it (``methods.SAVERS``' indices) that held a configuration memplan
    models: fine-tuning runs at level 0 alone (``check_finetune``), and offload's levels need the node's
    host memory."""
    no_offload: str | None = None
    """Why offload's levels were not searched (``fit.offload_unsearched``: the GPU preset states no host
    memory, or not what times the offload); None: searched where needed."""
    refused: str | None = None
    """Why the method was not searched at all: memplan models it on no layout of this model and these
    options (``methods.refusal``, e.g. QLoRA with a mixture of experts); None: searched."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"method": self.finetune.method.name.lower(), "fits": self.best is not None}
        out["savers_searched"] = [SAVERS[k].label() for k in self.levels]
        out["offload_not_searched"] = self.no_offload
        out["not_searched"] = self.refused
        if self.best is not None:
            b = self.best
            out |= {
                "settings": {**b.family.settings(), "micro_batch": b.micro_batch},
                "peak": b.peak,
                "reserved": b.verdict.reserved_peak,
                "tokens_per_s": b.timing.tokens_per_s,
                "trainable": b.result.params_trainable,
            }
        return out


@dataclass
class FitResult:
    setup: Setup
    gpu: GpuPreset
    gpus: int
    global_batch: int
    reserve: int = DEFAULT_RESERVE
    """Bytes of each GPU kept back (``budget``): configurations fit in ``usable``."""
    expandable: bool = False
    """Memory judged with the allocator under ``expandable_segments:True`` (``--expandable-segments``)."""
    fitting: list[Config] = field(default_factory=list)
    """The configurations that fit, fastest first; with pruning (``Space.keep``) those evaluated: every
    one that can be among the ``keep`` fastest, not every one that fits."""
    rejected: list[Rejected] = field(default_factory=list)
    searched: int = 0
    """Configurations of the space (families × micro-batch sizes that divide the global batch)."""
    evaluated: int = 0
    """Configurations estimated (states, activations, FLOPs; the rest: pruned by their bound, or by the
    bound their ZeRO stages share, ``bound.stages_bound``, which needs one stage's estimate)."""
    peaks: int = 0
    """Configurations whose peak had to be computed (the lower bound did not rule them out)."""
    pruned: int = 0
    """Configurations neither listed nor judged for memory because their step time — the bound
    (``bound``: unevaluated), the bound the ZeRO stages of one micro-batch share (``bound.stages_bound``)
    or the predicted time of every one of them — is slower than the ``keep`` fastest found so far."""
    states_only: int = 0
    """Configurations judged not to fit by their model states alone (``engine.states_floor``, learnt while
    nothing was listed: the same at every micro-batch size), without a stage plan's estimate or peak."""
    seconds: float = 0.0
    max_seq: int | None = None
    """The longest sequence the best configuration fits (micro-batch 1); None when nothing fits."""
    methods: list[Outcome] = field(default_factory=list)
    """Each method searched, in order: the fastest configuration at the lowest saver level that fits."""
    cutoffs: dict[tuple[FineTune, int], Cutoff] = field(default_factory=dict, repr=False)
    """Per method and saver level, the ``Space.keep`` fastest step times so far (``bound``)."""
    unsplit_dp: tuple[int, ...] = ()
    """The data-parallel degrees the global batch does not split over (``space.unsplit_degrees``): their
    layouts are not searched."""
    splitting_batch: int | None = None
    """The nearest global batch that splits over every data-parallel degree (``space.splitting_batch``),
    where some do not; None otherwise or where none is near."""
    cp_rotate: tuple[CpRotate, ...] = (CpRotate.ALLGATHER,)
    """The kinds of context parallelism searched (``Space.cp_rotate``)."""
    model_typed: str | None = None
    """``--model`` as the user typed it (a preset file, a config.json or a Hub id stays one in the rows'
    commands); None: the model's name."""
    gpu_typed: str | None = None
    """``--gpu`` as the user typed it (a preset file's path stays a path in the rows' commands); None: the
    preset's name."""
    passthrough: tuple[str, ...] = ()
    """Options given to ``fit`` that no setup holds, repeated by every row's command as typed (``cli.search``:
    the dropout, device, topology and memory overrides, ``--mfu``)."""

    @property
    def usable(self) -> int:
        """Bytes of each GPU torch's allocator may reserve: the driver's memory less the CUDA context and
        the reserve (``budget.allocator_memory``)."""
        return allocator_memory(self.gpu, self.reserve)

    @property
    def best(self) -> Config | None:
        return self.fitting[0] if self.fitting else None

    def to_json(self, top: int = 0) -> dict[str, Any]:
        """The search, its ``top`` configurations (0: all) with their plans' keys, every rejected family."""
        shown = self.fitting[:top] if top else self.fitting
        return {
            "model": self.setup.model.name,
            "gpu": self.gpu.name,
            "gpus": self.gpus,
            "seq_len": self.setup.training.seq_len,
            "global_batch": self.global_batch,
            "unsplit_dp": list(self.unsplit_dp),
            "splitting_global_batch": self.splitting_batch,
            "reserve": self.reserve,
            "expandable_segments": self.expandable,
            "searched": self.searched,
            "evaluated": self.evaluated,
            "peaks": self.peaks,
            "pruned": self.pruned,
            "states_only": self.states_only,
            "seconds": self.seconds,
            "max_seq": self.max_seq,
            "fitting": len(self.fitting),
            "configs": [c.to_json() | {"command": estimate_command(c, self)} for c in shown],
            "methods": [m.to_json() for m in self.methods],
            "rejected": [x.to_json() for x in self.rejected],
        }
