"""Everything one estimate depends on: the model, how it is trained, the strategy, the parallel layout and
the device's kernels. One device of a dense model is the trivial layout (``Parallel()``), not another case.

``Parallel`` holds the degrees that split the model itself: tensor (``tp``), sequence (``sp``, over the
same ranks as tp), pipeline (``pp``, with ``vpp`` virtual stages per rank for the interleaved schedule),
expert (``ep``) and context (``cp``: ring attention, each rank s/cp tokens) parallelism. Data parallelism
and the ZeRO stage live in ``StrategyConfig.dp`` / ``.zero``; the world is ``tp · cp · pp · dp`` devices
and expert parallelism takes its ranks from data parallelism (Megatron-Core: ``dp % ep == 0``), or under
MoE parallel folding (``etp`` 1 with tp > 1) from tp × dp.
"""

from __future__ import annotations

from enum import Enum, IntEnum, StrEnum
from typing import Any, Self

from pydantic import Field, model_validator

from memplan.config._base import Frozen
from memplan.config.finetune import FULL_TRAINING, FineTune
from memplan.config.finetune_rules import check_finetune
from memplan.config.hf_rules import check_flash_attn, check_hf_only, hf_only_code
from memplan.config.impl import Impl, ImplConfig
from memplan.config.impl_rules import (
    check_compile_loss,
    check_experts,
    check_fp8,
    check_fsdp_wrap,
    check_impl,
    titan_stage_layers,
)
from memplan.config.model import ModelConfig, PositionType
from memplan.config.offload import LossKind, Offload, check_savers, loss_label, offload_label
from memplan.config.strategy import (
    Checkpointing,
    Device,
    StrategyConfig,
    ZeroStage,
    checkpointing_label,
)
from memplan.config.training import Precision, TrainingConfig


class CpRotate(StrEnum):
    """How K/V reach a context-parallel rank's queries: torch's ring attention (``set_rotate_method``),
    or no ring at all (``KV_GATHER``)."""

    ALLGATHER = "allgather"
    """torch's ring: one all-gather of every rank's K/V, waited for after the first block (torch's
    default)."""
    ALLTOALL = "alltoall"
    """torch's ring: a point-to-point rotation of K/V to the next rank per block (``_AllToAllRotater``)."""
    KV_GATHER = "kv-gather"
    """No ring: K/V all-gathered (exposed), then one attention call per local chunk against the gathered
    prefix, dK/dV reduce-scattered — Llama 3's context parallelism (Dubey et al. 2024 §3.3.2), Transformer
    Engine's ``cp_comm_type="all_gather"`` (``AttnFuncWithCPAndKVAllGather``, Megatron-LM's
    ``--cp-comm-type all_gather``)."""


def default_cp_rotate(impl: Impl) -> CpRotate:
    """``--cp-rotate`` when it is not given: the kind of context parallelism the implementation's code runs.
    Megatron-core's is Transformer Engine's point-to-point ring (``--cp-comm-type`` default ``p2p``: each
    step sends K/V to the next rank while the block before computes, TE's ``AttnFuncWithCP``), memplan's
    ``ALLTOALL`` rotation; every other implementation runs torch's ``context_parallel``, whose default
    rotation is the all-gather (``ALLGATHER``)."""
    return CpRotate.ALLTOALL if impl is Impl.MEGATRON else CpRotate.ALLGATHER


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
    etp: int | None = Field(
        default=None,
        gt=0,
        le=1 << 12,
        description="expert tensor-parallel degree (Megatron-core's expert_tensor_parallel_size), a divisor "
        "of tp: none is tp (its default, the experts split like the MLP); below tp is MoE parallel folding "
        "(1: whole experts), expert parallelism drawn across tp/etp × dp",
    )
    cp: int = Field(
        default=1,
        gt=0,
        le=1 << 12,
        description="context-parallel degree c: ring attention over c ranks, each holding s/c tokens",
    )
    cp_rotate: CpRotate = Field(
        default=CpRotate.ALLGATHER,
        description="how K/V reach each rank: torch's ring with allgather (its default) or alltoall, or "
        "kv-gather (Llama 3's, Transformer Engine's all_gather: no ring)",
    )
    cp_rank: int | None = Field(
        default=None,
        ge=0,
        description="the context-parallel rank estimated, 0 … c−1 (the ranks differ in their ring's blocks "
        "and the last keeps its merged output in the kernel's layout); none: the most loaded",
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.sp and self.tp == 1:
            raise ValueError(
                "sp: sequence parallelism splits over the tensor-parallel ranks; "
                "add --tp 2 or more, or drop --sp"
            )
        if self.cp_rank is not None and self.cp_rank >= self.cp:
            raise ValueError(
                f"cp_rank: rank {self.cp_rank} is not a context-parallel rank of --cp {self.cp}; "
                f"use 0 to {self.cp - 1}"
            )
        if self.etp is not None and self.tp % self.etp:
            raise ValueError(
                f"etp: expert tensor parallelism splits the experts over a divisor of --tp {self.tp} (1: MoE "
                "parallel folding, whole experts); use --etp 1 or drop --etp"
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
    def expert_tp(self) -> int:
        """The ranks one routed expert is split over: ``etp``, or tp where it is not given."""
        return self.tp if self.etp is None else self.etp

    @property
    def fold(self) -> int:
        """tp / ``expert_tp``: how many groups of a tensor-parallel group's tokens stay apart at the
        experts — 1, or more under parallel folding (each rank dispatches its s/t tokens, gathered at the
        experts over the etp ranks only: tp under ``--etp 1``, whole experts), whose expert parallelism
        draws its ranks from tp/etp × dp (Megatron-core's expert rank order etp-ep-dp)."""
        return self.tp // self.expert_tp

    @property
    def model_parallel(self) -> int:
        """Devices one model replica spans: tp · cp · pp."""
        return self.tp * self.cp * self.pp

    def label(self) -> str:
        """``tp8+sp·cp2·pp8×2·ep2`` style summary for tables (cp and ep only when above 1)."""
        sp = "+sp" if self.sp else ""
        cp = f"·cp{self.cp}" if self.cp > 1 else ""
        vpp = f"×{self.vpp}" if self.vpp > 1 else ""
        ep = f"·ep{self.ep}" if self.ep > 1 else ""
        ep += f"·etp{self.expert_tp}" if self.fold > 1 else ""
        return f"tp{self.tp}{sp}{cp}·pp{self.pp}{vpp}{ep}"


class Setup(Frozen):
    """Everything one estimate depends on."""

    model: ModelConfig
    training: TrainingConfig = TrainingConfig()
    strategy: StrategyConfig = StrategyConfig()
    parallel: Parallel = Parallel()
    device: Device = Device.CUDA
    offload: Offload = Offload.NONE
    """What lives in host memory (config/offload.py)."""
    loss: LossKind = LossKind.STANDARD
    loss_chunks: int = Field(default=1, gt=0, le=1 << 20, description="chunks of the chunked loss")
    finetune: FineTune = FULL_TRAINING
    """Which parameters train (``config.finetune``); full training by default."""
    impl: ImplConfig = ImplConfig()
    """Whose training code the estimate follows (``config.impl``): memplan's reference by default."""

    @model_validator(mode="after")
    def _check(self) -> Self:
        par = self.parallel
        if self.impl.impl is Impl.TORCHTITAN and par.pp > 1 and par.pp_layers is None:
            # torchtitan places the layers itself: the derived default of --pp-layers (as kv heads are);
            # with --vpp M over its p·M virtual stages, in model order
            virtual = par.pp * par.vpp
            counts = titan_stage_layers(self.model.num_layers, virtual)
            ranks = [sum(counts[i :: virtual // par.vpp]) for i in range(par.pp)]
            if min(counts if par.vpp == 1 else ranks) < 1 or min(counts) < 0:
                raise ValueError(
                    f"pp: torchtitan's placement of {self.model.num_layers} layers over {virtual} stages "
                    f"({','.join(map(str, counts))}) leaves a stage without a layer; use fewer stages or "
                    "--pp-layers"
                )
            object.__setattr__(self, "parallel", par.model_copy(update={"pp_layers": counts}))
        check_setup(self)
        return self

    @property
    def state_shards(self) -> int:
        """Ranks that share one copy of the model states (ZeRO / FSDP shard over them): dp × cp, or with
        HSDP the shard group × cp (``StrategyConfig.shard_group``; torchtitan's ``dp_shard_cp`` mesh)."""
        return self.strategy.shard_group * self.parallel.cp

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
        out["offload"] = offload_label(self.offload)
        out["loss"] = loss_label(self.loss, self.loss_chunks)
        out["finetune"] = self.finetune.method.name.lower()
        out |= {name: json_value(v) for name, v in self.impl}
        return out


def check_setup(setup: Setup) -> None:
    """The combinations memplan models (the ``Setup`` validator; ``search.methods`` calls it on copies it
    does not re-validate); one-line ``ValueError``s naming the field and the fix."""
    m, t, s = setup.model, setup.training, setup.strategy
    if s.hsdp and setup.parallel.ep > 1:
        raise ValueError(
            "hsdp: hybrid sharding with expert parallelism is not modelled (the experts' shard group); "
            "drop --hsdp or --ep"
        )
    segmented = s.checkpointing is not Checkpointing.NONE or s.reversible
    mixed = t.precision.master_bytes > 0
    check_savers(setup.offload, setup.loss, setup.loss_chunks, int(s.zero), segmented, mixed)
    if setup.loss is LossKind.XENTROPY and (setup.parallel.tp > 1 or setup.impl.impl is not Impl.REFERENCE):
        raise ValueError(
            "loss: --loss xentropy is modelled for --impl reference without tensor parallelism; "
            "use --tp 1 and --impl reference, or --loss standard"
        )
    if setup.loss is LossKind.TE and setup.impl.impl is not Impl.MEGATRON:
        raise ValueError(
            "loss: --loss te is Transformer Engine's fused cross entropy as Megatron runs it; add --impl "
            "megatron, or use --loss xentropy or standard"
        )
    if not setup.finetune.trains_everything:
        check_finetune(setup)
    if setup.impl.flash_attn:
        check_flash_attn(setup)
    check_fp8(setup)  # every --impl: torchao's recipes or Transformer Engine's
    check_compile_loss(setup)
    check_experts(setup)
    check_fsdp_wrap(setup)
    if setup.impl.impl is not Impl.REFERENCE:
        check_impl(setup)
    if setup.impl.impl is not Impl.HF and (m.rotary_pct < 1 or m.parallel_residual):  # hf_code_only
        raise ValueError(
            f"impl: {m.name}'s partial rotary / parallel residual (GPT-NeoX, StableLM, GLM, Cohere, Falcon) "
            "is modelled for --impl hf only, "
            "not in memplan's reference model; use --impl hf"
        )
    check_hf_only(setup)
    if t.precision is Precision.FSDP2_MIXED:
        check_fsdp2_mixed(setup)
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


def json_value(value: Any) -> Any:
    """A setting as ``--json`` writes it: an enum's value (a string), an ordered choice's lower-case name
    (``flash``), the ZeRO stage's number."""
    if isinstance(value, ZeroStage):
        return int(value)
    if isinstance(value, IntEnum):
        return value.name.lower()
    return value.value if isinstance(value, Enum) else value


def check_fsdp2_mixed(setup: Setup) -> None:
    """``--precision fsdp2-mixed`` is FSDP2's ``MixedPrecisionPolicy``: it needs FSDP2 (ZeRO-2/3 over more
    than one rank) on a stack that runs it (memplan's reference model, torchtitan), training every
    parameter, dense, without offload (FSDP2's ``CPUOffloadPolicy`` is not modelled)."""
    s, par = setup.strategy, setup.parallel
    if s.zero < ZeroStage.GRADIENTS or s.dp * par.cp == 1:
        raise ValueError(
            "precision: fsdp2-mixed is FSDP2's mixed precision and needs FSDP2 (ZeRO-2/3 over more than one "
            "rank); add --zero 3 with --dp N or --gpus N, or use --precision bf16-mixed"
        )
    if setup.impl.impl not in (Impl.REFERENCE, Impl.TORCHTITAN):
        other = "" if hf_only_code(setup.model) else "use --impl reference or torchtitan, or "
        raise ValueError(
            f"precision: fsdp2-mixed is FSDP2's mixed precision; --impl {setup.impl.impl.value} does not run "
            f"FSDP2: {other}use --precision bf16-mixed"
        )
    if setup.model.moe is not None or not setup.finetune.trains_everything or setup.offload:
        raise ValueError(
            "precision: fsdp2-mixed is modelled for dense models trained in full without offload; "
            "use --precision bf16-mixed"
        )
