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
from dataclasses import dataclass
from typing import Any

from pydantic import Field
from pydantic.config import JsonDict

from memplan.config import (
    FINETUNE_OPTIONS,
    AttentionChoice,
    Device,
    FineTune,
    Frozen,
    MethodChoice,
    ModelConfig,
    Offload,
    Optimizer,
    Parallel,
    Precision,
    Quant,
    Setup,
    TrainingConfig,
    finetune_from,
    parse_checkpointing,
    parse_loss,
    parse_offload,
)
from memplan.engine import Result, estimate
from memplan.presets import GpuPreset, ModelPreset, load_gpu, load_model_preset
from memplan.search.budget import (
    DEFAULT_RESERVE_GIB,
    NODE_GPUS,
    HostVerdict,
    Verdict,
    host_fit,
    reserve_bytes,
    verdict,
)
from memplan.time.timing import Timing, check_time_inputs, timing

DEFAULT_SEQ = TrainingConfig().seq_len
"""``--seq`` when not given: 2048 tokens, or the model's context length (max_positions) if shorter."""

_LISTS = "(`memplan presets` lists them)"


def _option(
    description: str,
    panel: str,
    *,
    default: Any = None,
    metavar: str | None = None,
    flags: tuple[str, ...] = (),
    show_default: bool = True,
    **constraints: Any,
) -> Any:
    """An ``Options`` field and how the command line spells it: help text, metavar, extra flags (``-s``),
    help panel; ``cli.common`` derives every command's typer options from these."""
    extra: JsonDict = {"panel": panel, "metavar": metavar, "flags": list(flags), "show_default": show_default}
    return Field(default=default, description=description, json_schema_extra=extra, **constraints)


_MODEL, _TRAINING, _STRATEGY, _PARALLEL, _GPU = "Model", "Training", "Strategy", "Parallelism", "GPU and time"
_FINETUNE = "Fine-tuning"


def _tune(description: str, metavar: str | None = None) -> Any:
    """A fine-tuning option without a shown default (None: the setting's default, or not given)."""
    return _option(description, _FINETUNE, metavar=metavar, show_default=False)


class Options(Frozen):
    """Every setting of one estimate, declared once: field names are the option names (``_`` for ``-``),
    each with its help text; the CLI, ``compare --vary`` and the setup they build all read them here."""

    model: str = _option(
        "Model preset name or alias (e.g. 70b, llama-3-8b, mixtral-8x7b, gpt2), a preset .toml or a Hugging "
        "Face config.json. Required. `memplan presets` lists them.",
        _MODEL,
        default=...,
        flags=("-m",),
        show_default=False,
        min_length=1,
    )
    dropout: float | None = _option(
        "Dropout probability 0 ≤ P < 1 for attention, residual and embedding dropout [default: the "
        "preset's own]",
        _MODEL,
        metavar="P",
        show_default=False,
    )
    seq: int | None = _option(
        f"Tokens per sequence s [default: {DEFAULT_SEQ}, or the model's context length if shorter]",
        _TRAINING,
        metavar="TOKENS",
        flags=("-s",),
        show_default=False,
    )
    batch: int = _option(
        "Sequences per micro-batch b", _TRAINING, default=1, metavar="N", flags=("-b",), gt=0
    )
    precision: Precision = _option(
        "Precision recipe: dtype of weights, gradients, master copy, optimizer states, activations",
        _TRAINING,
        default=Precision.BF16_MIXED,
    )
    optimizer: Optimizer = _option("Optimizer", _TRAINING, default=Optimizer.ADAMW)
    checkpointing: str = _option(
        "Activation checkpointing: none, full (keep each layer's input), selective (recompute the "
        "attention core), every-K (keep one input per K layers)",
        _STRATEGY,
        default="none",
        metavar="none|full|selective|every-K",
    )
    attention: AttentionChoice = _option(
        "Attention kernel: eager (keeps s×s probabilities) or flash (SDPA flash: q, k, v, out, lse)",
        _STRATEGY,
        default=AttentionChoice.FLASH,
    )
    reversible: bool = _option(
        "Reversible (RevNet) layers: backward rebuilds each layer's input from its output",
        _STRATEGY,
        default=False,
    )
    zero: int = _option(
        "ZeRO stage: 0 none, 1 optimizer states, 2 + gradients, 3 + weights (sharded over --dp)",
        _STRATEGY,
        default=0,
        metavar="0-3",
    )
    device: Device = _option(
        "Kernels the step runs on (a few saved tensors differ between cuda and cpu)",
        _STRATEGY,
        default=Device.CUDA,
    )
    offload: str = _option(
        "Host offload: none, or any of optimizer (ZeRO-Offload: master weights, optimizer states and "
        "gradients on the host, the step on the CPU), params (16-bit weights on the host, needs --zero 3), "
        "activations (torch's save_on_cpu), comma-separated",
        _STRATEGY,
        default="none",
        metavar="none|optimizer,params,activations",
    )
    loss: str = _option(
        "Loss: standard (fp32 log-probs [T, v] kept), chunked:N (torchtune: lm head and cross-entropy per "
        "chunk), fused (Liger's fused linear cross-entropy: no [T, v] tensor kept)",
        _STRATEGY,
        default="standard",
        metavar="standard|chunked:N|fused",
    )
    tp: int = _option("Tensor-parallel degree t", _PARALLEL, default=1, metavar="N", gt=0)
    sp: bool = _option("Sequence parallelism over the tensor-parallel ranks", _PARALLEL, default=False)
    pp: int = _option("Pipeline stages p (1F1B)", _PARALLEL, default=1, metavar="N", gt=0)
    pp_layers: str | None = _option(
        "Layers of each pipeline stage, first to last, e.g. 7,8,8,…,8,7; with --vpp M one per virtual stage "
        "(pp·M, model order; 0 for a chunk of the embedding or head alone) [default: ⌈L/pp⌉ each, the first "
        "and last stages one fewer in turn when pp does not divide the layers]",
        _PARALLEL,
        metavar="N,N,…",
        show_default=False,
    )
    vpp: int = _option(
        "Virtual stages per pipeline rank (interleaved 1F1B)", _PARALLEL, default=1, metavar="M", gt=0
    )
    ep: int = _option("Expert-parallel degree (MoE; ranks from dp)", _PARALLEL, default=1, metavar="N", gt=0)
    cp: int = _option(
        "Context-parallel degree c: ring attention (torch context_parallel, as torchtitan), each rank holds "
        "s/c tokens and exchanges K/V, e.g. --cp 4 --seq 131072; needs flash attention and s a multiple "
        "of 2·c",
        _PARALLEL,
        default=1,
        metavar="N",
        gt=0,
    )
    dp: int | None = _option(
        "Data-parallel degree [default: --gpus / (tp·cp·pp), else 1]",
        _PARALLEL,
        metavar="N",
        show_default=False,
        gt=0,
    )
    gpus: int | None = _option(
        "Devices in all: tp · cp · pp · dp", _PARALLEL, metavar="N", show_default=False, gt=0
    )
    global_batch: int | None = _option(
        "Sequences per optimizer step; micro-batches per step = B / (batch · dp)",
        _PARALLEL,
        metavar="B",
        show_default=False,
        gt=0,
    )
    grad_accum: int | None = _option(
        "Micro-batches per step (the pipeline's, or gradient accumulation) [default: 1]",
        _PARALLEL,
        metavar="N",
        show_default=False,
    )
    gpu: str | None = _option(
        "GPU preset: marks fit / not fit, gives the time (`memplan gpus`)",
        _GPU,
        metavar="NAME",
        show_default=False,
    )
    mfu: float | None = _option(
        "Assumed model FLOPs utilisation for the step time [default: predicted from the kernels, the "
        "communication on the topology and the bubble]",
        _GPU,
        metavar="F",
        show_default=False,
    )
    step_time: float | None = _option(
        "Measured seconds per step: gives the achieved MFU and HFU instead",
        _GPU,
        metavar="S",
        show_default=False,
    )
    tokens: float | None = _option(
        "Training tokens (e.g. 300e9): gives the training days", _GPU, metavar="T", show_default=False
    )
    gpus_per_node: int | None = _option(
        "GPUs per node: tensor-parallel and other groups inside it use the intra-node link [default: the "
        "GPU preset's topology]",
        _GPU,
        metavar="N",
        show_default=False,
    )
    intra_node_bw: float | None = _option(
        "Bandwidth per GPU and direction inside a node, GB/s (NVLink, Infinity Fabric, PCIe) [default: "
        "the GPU preset's]",
        _GPU,
        metavar="GB/s",
        show_default=False,
    )
    inter_node_bw: float | None = _option(
        "Bandwidth per GPU and direction between nodes, GB/s (InfiniBand/RoCE NICs) [default: the GPU "
        "preset's]",
        _GPU,
        metavar="GB/s",
        show_default=False,
    )
    host_memory: float | None = _option(
        "GiB of host memory per node: do the offloaded tensors fit [default: the GPU preset's node's]",
        _GPU,
        metavar="GiB",
        show_default=False,
    )
    finetune: MethodChoice = _option(
        "What trains: full (every parameter), lora (low-rank adapters on a frozen base, peft's LoRA) or "
        "qlora (LoRA on a 4-bit bitsandbytes base), e.g. --finetune lora --lora-rank 16",
        _FINETUNE,
        default=MethodChoice.FULL,
    )
    lora_rank: int | None = _tune("LoRA rank r (A is r × in, B out × r) [default: 8]", "R")
    lora_alpha: float | None = _tune("LoRA α: B·A is scaled by α/r (no memory effect) [default: 16]", "ALPHA")
    lora_dropout: float | None = _tune(
        "Dropout 0 ≤ P < 1 on each adapter's input (keeps its bool mask and the dropped input) [default: 0]",
        "P",
    )
    lora_targets: str | None = _tune(
        "Linears with adapters: some of q,k,v,o,gate,up,down (GELU: up = fc1, down = fc2) or all-linear, "
        "e.g. q,v (q+v in compare --vary) [default: q,v, as peft for Llama]",
        "q,k,v,o,gate,up,down|all-linear",
    )
    freeze: str | None = _tune(
        "Parts that do not train: embeddings, lm_head, layers:A-B (from 0), e.g. embeddings,layers:0-15; "
        "with lora|qlora only layers:A-B (no adapters there)",
        "PARTS",
    )
    quant: Quant | None = _tune(
        "QLoRA's 4-bit type (bitsandbytes): nf4 or fp4, an absmax per 64 [default: nf4]"
    )
    double_quant: bool = _option(
        "QLoRA double quantisation: absmax in uint8 + fp32 per 256 (0.5 → 0.127 bits/weight)",
        _FINETUNE,
        default=False,
    )
    reserve: float = _option(
        "GiB of each GPU's memory kept back for the CUDA context and the allocator (cuBLAS and NCCL "
        "buffers, fragmentation): a plan fits in the GPU's memory minus this",
        _GPU,
        default=DEFAULT_RESERVE_GIB,
        metavar="GiB",
    )


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
    offload: str = "none",
    loss: str = "standard",
    finetune: FineTune | None = None,
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
            "offload": parse_offload(offload),
            "loss": loss_kind,
            "loss_chunks": chunks,
            **({"finetune": finetune} if finetune is not None else {}),
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
        parallel=Parallel(
            tp=o.tp,
            sp=o.sp,
            pp=o.pp,
            vpp=o.vpp,
            ep=o.ep,
            pp_layers=_stage_layers(o.pp_layers),
            cp=o.cp,
        ),
        offload=o.offload,
        loss=o.loss,
        finetune=finetune_from(
            o.finetune.method,
            {name: getattr(o, name) for name in FINETUNE_OPTIONS},
            o.double_quant,
            o.precision.activation_dtype,
        ),
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


def _host(o: Options, result: Result, gpu: GpuPreset | None) -> HostVerdict | None:
    """The host verdict from ``--host-memory``, or with offload the GPU preset's node's (else None)."""
    offloads = result.setup.offload is not Offload.NONE
    gib = o.host_memory if o.host_memory is not None else (gpu.host_memory_gib if gpu and offloads else None)
    return host_fit(result, gib, gpu.topology.gpus_per_node if gpu else NODE_GPUS)


def gpu_of(o: Options, name: str) -> GpuPreset:
    """The GPU preset ``name`` with ``o``'s topology settings (``--gpus-per-node``, ``--intra-node-bw``,
    ``--inter-node-bw``) in place of its own."""
    gpu = load_gpu(name)
    topology = gpu.topology.with_overrides(o.gpus_per_node, o.intra_node_bw, o.inter_node_bw)
    return gpu if topology == gpu.topology else gpu.model_copy(update={"topology": topology})


def build(o: Options) -> Built:
    """Estimate the configuration ``o`` describes; ``ValueError`` (one line) for any user mistake."""
    result = estimate(setup_of(o))
    if o.gpu is None:
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
        return Built(o, result, None, None, None, host)
    gpu = gpu_of(o, o.gpu)
    reserve_bytes(o.reserve, gpu)  # a bad --reserve before the time
    check_time_inputs(o.mfu, o.step_time, o.tokens)  # before int(): --tokens nan, inf
    tokens = None if o.tokens is None else int(o.tokens)
    t = timing(result, gpu, mfu=o.mfu, step_time=o.step_time, tokens=tokens)
    fit = verdict(result, gpu, reserve=reserve_bytes(o.reserve, gpu))
    return Built(o, result, gpu, fit, t, _host(o, result, gpu))


def to_json(b: Built) -> dict[str, Any]:
    """The estimate's JSON contract (``memplan.contract``) with ``fit`` and ``time``."""
    from memplan.contract import to_json as result_json

    out = result_json(b.result)
    out["fit"] = b.verdict.to_json() if b.verdict else None
    out["time"] = b.timing.to_json() if b.timing else None
    if b.host is not None:  # with --host-memory, or a GPU preset that states its node's host memory
        out["host_fit"] = b.host.to_json()
    return out
