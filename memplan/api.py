"""Names → setup → result: what the CLI, the tests and the benchmarks call.

``Options`` holds every setting of one estimate as the user gives it (preset names, ``--checkpointing
every-4``, ``--gpus`` instead of ``--dp``); ``build(options)`` resolves the names, validates a ``Setup``
(one device, dense, is ``Parallel()`` and ``moe`` None: the trivial case of the same path), runs the
engine and, with a GPU, the memory verdict and the step time. ``memplan compare --vary KEY=A,B``
replaces one ``Options`` field by name and re-validates, so a vary value is parsed and checked exactly
as the option would be.

Devices: ``--gpus N`` is the world size tp · cp · pp · dp; without ``--dp`` it sets dp = N / (tp · cp · pp).
Micro-batches per step: ``--global-batch B`` sequences make B / (micro-batch · dp) of them (the pipeline's
micro-batches, gradient accumulation otherwise); else ``--grad-accum`` (default 1).

Every user mistake raises a one-line ``ValueError`` (``field: what is wrong; fix``). Pure Python, no torch.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from memplan.config import (
    FINETUNE_OPTIONS,
    AttentionChoice,
    CpRotate,
    Device,
    FineTune,
    Fp8Recipe,
    Impl,
    ImplConfig,
    ModelConfig,
    Offload,
    Optimizer,
    OptimizerImpl,
    Parallel,
    Precision,
    ReduceDtype,
    Setup,
    TrainingConfig,
    default_attention,
    default_cp_rotate,
    default_impl,
    finetune_from,
    parse_checkpointing,
    parse_loss,
    parse_offload,
)
from memplan.engine import Result, estimate
from memplan.options import DEFAULT_GPU, LISTS
from memplan.options import DEFAULT_SEQ as DEFAULT_SEQ
from memplan.options import Options as Options
from memplan.presets import GpuPreset, ModelPreset, load_gpu, load_model_preset
from memplan.reserved import Reserved, replay_device
from memplan.search.budget import (
    DEFAULT_RESERVE_GIB,
    NODE_GPUS,
    HostVerdict,
    Verdict,
    host_fit,
    reserve_bytes,
    verdict,
)

if TYPE_CHECKING:
    from memplan.analytic.nccl import NcclBuffers
    from memplan.time.timing import Timing


# ----------------------------------------------------------------------------------------------------
# Names → setup
# ----------------------------------------------------------------------------------------------------
def load_model(model: str | None) -> ModelPreset:
    """The preset ``--model`` names (dense or a mixture of experts, a preset file or a config.json);
    a one-line ``ValueError`` (with suggestions) if missing or unknown."""
    if model is None:
        raise ValueError(f"model: required; pass --model NAME (e.g. --model 70b) or a file path {LISTS}")
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
    optimizer_impl: OptimizerImpl | None = None,
    clip_grad: bool | None = None,
    grad_accum: int = 1,
    checkpointing: str = "none",
    attention: AttentionChoice = AttentionChoice.FLASH,
    reversible: bool = False,
    zero: int = 0,
    dp: int = 1,
    hsdp: int = 0,
    reduce_dtype: ReduceDtype | None = None,
    dropout: float | None = None,
    device: Device = Device.CUDA,
    parallel: Parallel | None = None,
    offload: str = "none",
    loss: str = "standard",
    finetune: FineTune | None = None,
    impl: ImplConfig | None = None,
) -> Setup:
    """A validated ``Setup`` from option values (the defaults are the options' defaults).

    ``model`` is what ``--model`` names (preset, alias or path) or an already built ``ModelConfig``.
    Raises ``ValueError`` / ``ValidationError``.
    """
    cfg = model if isinstance(model, ModelConfig) else load_model(model).model
    mode, every = parse_checkpointing(checkpointing)
    loss_kind, chunks = parse_loss(loss)
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
                "optimizer_impl": optimizer_impl,
                "clip_grad": clip_grad,
                "grad_accum": grad_accum,
            },
            "strategy": {
                "checkpointing": mode,
                "checkpoint_every": every,
                "attention": attention.attention,
                "reversible": reversible,
                "zero": zero,
                "dp": dp,
                "hsdp": hsdp,
                "reduce_dtype": reduce_dtype,
            },
            "parallel": parallel or Parallel(),
            "device": device,
            "offload": parse_offload(offload),
            "loss": loss_kind,
            "loss_chunks": chunks,
            **({"finetune": finetune} if finetune is not None else {}),
            **({"impl": impl} if impl is not None else {}),
        }
    )


def _choices(n: int, step: int) -> str:
    lower = n - n % step
    return f"{lower} or {lower + step}" if lower else str(step)


def data_parallel(o: Options) -> int:
    """dp from ``--dp`` or ``--gpus`` / (tp · cp · pp); one-line errors when they disagree."""
    world = o.tp * o.cp * o.pp
    cp = f" × cp {o.cp}" if o.cp > 1 else ""
    if o.gpus is None:
        return o.dp or 1
    if o.dp is None:
        if o.gpus % world:
            raise ValueError(
                f"gpus: {o.gpus} devices do not split into tp {o.tp}{cp} × pp {o.pp} = {world}-device model "
                f"replicas; use --gpus {_choices(o.gpus, world)}"
            )
        return o.gpus // world
    if o.dp * world != o.gpus:
        raise ValueError(
            f"dp: tp {o.tp}{cp} × pp {o.pp} × dp {o.dp} = {world * o.dp} devices, not --gpus {o.gpus}; "
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
    most = TrainingConfig.model_fields["grad_accum"].metadata  # the micro-batches a step may have
    limit = next(c.le for c in most if getattr(c, "le", None) is not None)
    if o.grad_accum is None and n > limit:
        raise ValueError(
            f"global-batch: {o.global_batch} sequences are {n} micro-batches of {o.batch} × dp {dp}, more "
            f"than {limit}; use --global-batch {limit * per} or less, or a larger --batch or dp"
        )
    if o.grad_accum is not None and o.grad_accum != n:
        raise ValueError(
            f"grad-accum: {o.grad_accum} disagrees with --global-batch {o.global_batch} "
            f"= {o.batch} × {dp} × {n}; give one of them"
        )
    return n


def _stage_layers(text: str | None) -> tuple[int, ...] | None:
    """``--pp-layers 7,8,8,7`` as a tuple; a one-line error for anything but whole numbers."""
    if text is None:
        return None
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(
            f"pp-layers: cannot read {text!r}; give each stage's layers, comma-separated, "
            "e.g. --pp-layers 7,8,8,7"
        ) from None


def setup_of(o: Options) -> Setup:
    """The validated ``Setup`` that ``o`` describes."""
    dp = data_parallel(o)
    model = _cached_model(o.model).model
    impl = impl_of(o, model)
    return build_setup(
        model,
        seq=o.seq,
        batch=o.batch,
        precision=o.precision,
        optimizer=o.optimizer,
        optimizer_impl=o.optimizer_impl,
        clip_grad=o.clip_grad,
        grad_accum=micro_batches(o, dp),
        checkpointing=o.checkpointing,
        attention=attention_of(o, model, impl.impl),
        reversible=o.reversible,
        zero=o.zero,
        dp=dp,
        hsdp=o.hsdp or 0,
        reduce_dtype=o.reduce_dtype,
        dropout=o.dropout,
        device=o.device,
        parallel=Parallel(
            tp=o.tp,
            sp=o.sp,
            pp=o.pp,
            vpp=o.vpp,
            ep=o.ep,
            etp=o.etp,
            pp_layers=_stage_layers(o.pp_layers),
            cp=o.cp,
            # the implementation's own kind of context parallelism (none to choose without cp)
            cp_rotate=o.cp_rotate or (default_cp_rotate(impl.impl) if o.cp > 1 else CpRotate.ALLGATHER),
            cp_rank=o.cp_rank,
        ),
        offload=o.offload,
        loss=o.loss,
        finetune=finetune_from(
            o.finetune.method,
            {name: getattr(o, name) for name in FINETUNE_OPTIONS},
            o.double_quant,
            o.precision.activation_dtype,
        ),
        impl=impl,
    )


def attention_of(o: Options, model: ModelConfig, impl: Impl) -> AttentionChoice:
    """The attention kernel ``o`` asks for (``--attention``: flash, or eager where the model's code runs
    no flash path memplan models, ``config.default_attention``, when not given)."""
    if o.attention is not None:
        return o.attention
    return AttentionChoice[default_attention(model, impl, o.device).name]


def impl_of(o: Options, model: ModelConfig) -> ImplConfig:
    """Whose code and which kernels ``o`` asks for (``--impl``: the model's default when not given)."""
    impl = o.impl if o.impl is not None else default_impl(model)
    # TE's per-tensor float8 keeps no transposes on an any-layout --gpu (``GpuPreset.fp8_any_layout``): set
    # where it changes something; without --gpu the Hopper rule (the default GPU's)
    te = impl is Impl.MEGATRON and o.fp8 in (Fp8Recipe.TENSORWISE, Fp8Recipe.DELAYED) and o.gpu is not None
    return ImplConfig(
        impl=impl,
        use_cache=o.use_cache,
        reentrant=o.reentrant,
        flash_attn=o.flash_attn,
        attention_kernel=o.attention_kernel,
        norm_kernel=o.norm_kernel,
        compile=o.compile,
        compile_loss=o.compile_loss,
        fsdp_wrap=o.fsdp_wrap,
        fp8=o.fp8,
        fp8_amax_history_len=o.fp8_amax_history_len,
        fp8_all_gather=o.fp8_all_gather,
        fp8_tp=o.fp8_tp,
        overlap_grad_reduce=o.overlap_grad_reduce,
        overlap_param_gather=o.overlap_param_gather,
        tp_comm_overlap=o.tp_comm_overlap,
        async_tp=o.async_tp,
        fp8_param_gather=o.fp8_param_gather,
        fp8_any_layout=te and load_gpu(o.gpu or DEFAULT_GPU).fp8_any_layout,
        experts=o.experts,
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
    host: HostVerdict | None = None
    """Whether the offloaded tensors fit the node's host memory (``--host-memory`` or the GPU preset's)."""
    reserved: Reserved | None = None
    """The step's allocations replayed through torch's caching allocator (``memplan.reserved``): allocated
    and reserved peaks, with the GPU's cuBLAS workspace, CUDA context and NCCL buffers when there is one."""
    nccl: tuple[NcclBuffers, ...] = ()
    """NCCL's buffers per communicator of the most loaded device (with a GPU; ``time.comm.buffers``)."""
    fsdp_all_gather: int | None = 0
    """What the allocator reserves on FSDP2's all-gather stream (``analytic.fsdp.buffers``): judged (kept
    back from the default stream's allocator, ``search.budget``); None where not modelled (not judged)."""
    ddp_buckets: int = 0
    """torch DDP's gradient buckets (``time.comm.buffers.ddp_bucket_bytes``): judged as the stream."""
    fsdp_reduce_scatter: int = 0
    """What the allocator reserves on FSDP2's reduce-scatter stream (the sharded gradients under FSDP2's
    mixed precision, ``time.comm.buffers.fsdp_reduce_scatter_bytes``): reported, not kept back."""
    userbuffers: int = 0
    """TE's userbuffers (``--tp-comm-overlap``, ``userbuffer_bytes``): outside the allocator, judged."""
    untimed: str | None = None
    """Why ``timing`` is None on ``gpu`` (``time.offload.untimed``: no host link for the offload)."""


def _host(o: Options, result: Result, gpu: GpuPreset | None) -> HostVerdict | None:
    """The host verdict from ``--host-memory``, or with offload the GPU preset's node's (else None)."""
    offloads = result.setup.offload is not Offload.NONE
    gib = o.host_memory if o.host_memory is not None else (gpu.host_memory_gib if gpu and offloads else None)
    return host_fit(result, gib, gpu.topology.gpus_per_node if gpu else NODE_GPUS)


def gpu_memory_bytes(gib: float) -> int:
    """``--gpu-memory`` GiB → bytes; a one-line ``ValueError`` unless positive, finite and whole bytes."""
    if not (math.isfinite(gib) and 0 < gib < 2**30):  # below 1 EiB: any real device
        raise ValueError(f"gpu-memory: must be a positive number of GiB, got {gib:g}; e.g. --gpu-memory 48")
    n = int(gib * 2**30)
    if n < 1:
        raise ValueError(f"gpu-memory: {gib:g} GiB is less than a byte; e.g. --gpu-memory 48")
    return n


def gpu_of(o: Options, name: str) -> GpuPreset:
    """The GPU preset ``name`` with ``o``'s settings in place of its own: ``--gpu-memory`` (its name then
    says so: ``h100-sxm with 48 GiB``) and the topology (``--gpus-per-node``, ``--intra-node-bw``,
    ``--inter-node-bw``)."""
    gpu = load_gpu(name)
    if o.gpu_memory is not None:
        memory = gpu_memory_bytes(o.gpu_memory)
        # The user's figure is the device's memory: it replaces the preset's driver figure too (device_mib).
        named = f"{gpu.name} with {o.gpu_memory:g} GiB"
        gpu = gpu.model_copy(
            update={"memory_bytes": memory, "device_mib": None, "cuda_bytes": None, "name": named}
        )
    topology = gpu.topology.with_overrides(o.gpus_per_node, o.intra_node_bw, o.inter_node_bw)
    return gpu if topology == gpu.topology else gpu.model_copy(update={"topology": topology})


def build(o: Options) -> Built:
    """Estimate the configuration ``o`` describes; ``ValueError`` (one line) for any user mistake."""
    result = estimate(setup_of(o))
    if o.gpu is None and o.gpu_memory is None:
        host = _host(o, result, None)
        if o.mfu is not None or o.step_time is not None or o.tokens is not None:
            raise ValueError(
                "gpu: time needs a GPU's peak FLOP/s; add --gpu NAME (`memplan gpus` lists them)"
            )
        if any(v is not None for v in (o.gpus_per_node, o.intra_node_bw, o.inter_node_bw)):
            raise ValueError(
                "gpu: a topology setting changes a GPU preset's; add --gpu NAME (`memplan gpus` lists them)"
            )
        if o.reserve != DEFAULT_RESERVE_GIB:
            raise ValueError(
                "gpu: --reserve is kept back from a GPU's memory; add --gpu NAME (`memplan gpus`)"
            )
        from memplan.time.comm.buffers import beside_replay

        reserved = replay_device(result, expandable=o.expandable_segments)
        return Built(o, result, None, None, None, host, reserved, (), *beside_replay(result))
    from memplan.time.async_tp import workspace_bytes  # only with a GPU (start-up)
    from memplan.time.comm.buffers import beside_replay, nccl_buffers
    from memplan.time.offload import untimed
    from memplan.time.timing import check_time_inputs, mfu_ceiling, timing

    gpu = gpu_of(o, o.gpu or DEFAULT_GPU)
    reserve_bytes(o.reserve, gpu)  # a bad --reserve before the time
    check_time_inputs(o.mfu, o.step_time, o.tokens, mfu_ceiling(result.setup, gpu))  # before int()
    tokens = None if o.tokens is None else int(o.tokens)
    # offload on a GPU without a host link: no time (noted), unless one is asked for (refused then)
    missing = untimed(result.setup.offload, gpu) if (o.mfu, o.step_time, o.tokens) == (None,) * 3 else None
    t = None if missing else timing(result, gpu, mfu=o.mfu, step_time=o.step_time, tokens=tokens)
    fit = verdict(result, gpu, reserve=reserve_bytes(o.reserve, gpu), expandable=o.expandable_segments)
    nccl = tuple(nccl_buffers(result, gpu))
    fsdp, ddp, scatter, ub = beside_replay(result)
    replayed = replay_device(result, gpu, expandable=o.expandable_segments)
    symm = workspace_bytes(result.setup)  # --async-tp's, outside the allocator
    reserved = replace(replayed, nccl=sum(b.bytes for b in nccl), userbuffers=ub, symm_mem=symm)
    host, streams = _host(o, result, gpu), (nccl, fsdp, ddp, scatter, ub)
    return Built(o, result, gpu, fit, t, host, reserved, *streams, untimed=missing)


def to_json(b: Built) -> dict[str, Any]:
    """The estimate's JSON contract (``memplan.contract``) with ``fit`` and ``time``."""
    from memplan.contract import to_json as result_json
    from memplan.time.async_tp import workspace_bytes

    out = result_json(b.result)
    if b.reserved is not None:  # as torch's allocator would report it (memplan.reserved)
        out["memory"]["allocated_peak"] = b.reserved.allocated_peak
        out["memory"]["reserved_peak"] = b.reserved.reserved_peak
        out["memory"]["allocator"] = b.reserved.to_json()
    # FSDP2's all-gather stream: its own pool, beside the default stream's replay; judged with DDP's
    # buckets (``fit.comm_buffers``: kept back from the default stream's allocator)
    out["memory"]["fsdp_all_gather_stream"] = b.fsdp_all_gather
    out["memory"]["ddp_buckets"] = b.ddp_buckets  # torch DDP's gradient buckets
    out["memory"]["te_userbuffers"] = b.userbuffers  # --tp-comm-overlap's, outside the allocator
    out["memory"]["symm_mem_workspace"] = workspace_bytes(b.result.setup)  # --async-tp's, outside it too
    # FSDP2's reduce-scatter stream: its own pool (the sharded gradients), reported, not kept back
    out["memory"]["fsdp_reduce_scatter_stream"] = b.fsdp_reduce_scatter
    if b.gpu is not None:  # NCCL's buffers, outside the allocator (memplan.analytic.nccl)
        total = sum(n.bytes for n in b.nccl)
        out["memory"]["nccl"] = {"total": total, "communicators": [n.to_json() for n in b.nccl]}
    if b.verdict is not None:
        out["memory"]["device_bytes"] = b.verdict.device_bytes
        out["memory"]["device_usable"] = b.verdict.usable_bytes
    out["fit"] = b.verdict.to_json() if b.verdict else None
    out["time"] = b.timing.to_json() if b.timing else None
    if b.host is not None:  # with --host-memory, or a GPU preset that states its node's host memory
        out["host_fit"] = b.host.to_json()
    return out
