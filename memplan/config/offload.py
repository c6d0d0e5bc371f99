"""Memory savers beside the strategies: offloading model states or activations to the host, and the loss
variant (the fp32 log-probs [T, v] are the largest single tensor for large vocabularies).

``Offload`` is an ordered flag: each member moves one more kind of tensor to the host, and a setting is any
combination (``optimizer,params``); ``LossKind`` is ordered by the kept memory it saves. Both are plain
values the ``fit`` search can enumerate.
"""

from __future__ import annotations

from enum import IntEnum, IntFlag


class Offload(IntFlag):
    """What lives in host memory instead of the device's (any combination; 0: nothing)."""

    NONE = 0
    """Everything on the device."""
    OPTIMIZER = 1
    """ZeRO-Offload (Ren et al. 2021): fp32 master weights, optimizer states and the gradients on the host;
    the optimizer step runs on the CPU; the 16-bit weights stay on the device."""
    PARAMS = 2
    """ZeRO-Infinity (Rajbhandari et al. 2021) / FSDP2 ``CPUOffloadPolicy``: the (ZeRO-3-sharded) 16-bit
    weights on the host, each unit gathered onto the device for its forward and backward."""
    ACTIVATIONS = 4
    """``torch.autograd.graph.save_on_cpu``: every tensor autograd saves is copied to the host in forward
    and back to the device when its backward op runs."""


_OFFLOAD_NAMES = {
    "optimizer": Offload.OPTIMIZER,
    "params": Offload.PARAMS,
    "activations": Offload.ACTIVATIONS,
}


def parse_offload(text: str) -> Offload:
    """``none`` or a comma-separated combination of ``optimizer``, ``params``, ``activations``."""
    t = text.strip().lower()
    if t in ("", "none"):
        return Offload.NONE
    out = Offload.NONE
    for part in t.split(","):
        name = part.strip()
        if name not in _OFFLOAD_NAMES:
            raise ValueError(
                f"offload: unknown '{part}'; choose none or a comma-separated combination of "
                "optimizer, params, activations (e.g. --offload optimizer,params)"
            )
        out |= _OFFLOAD_NAMES[name]
    return out


def offload_label(o: Offload) -> str:
    """``none`` or ``optimizer,params`` (members in their order)."""
    names = [name for name, m in _OFFLOAD_NAMES.items() if m in o]
    return ",".join(names) or "none"


class LossKind(IntEnum):
    """How the cross-entropy over the vocabulary is computed, ordered by the memory it keeps."""

    STANDARD = 0
    """fp32 logits, ``log_softmax`` + ``nll_loss``: keeps the fp32 log-probs [T, v]."""
    CHUNKED = 1
    """torchtune's ``CEWithChunkedOutputLoss``: the lm head and the fp32 cross-entropy per chunk of the
    sequence. Autograd still keeps every chunk's fp32 log-probs (the same 4·T·v bytes); only the forward's
    and the backward's transients shrink to one chunk."""
    XENTROPY = 2
    """flash_attn's fused cross-entropy kernel (``flash_attn.losses.cross_entropy.CrossEntropyLoss``,
    llm-foundry's ``fused_crossentropy``): one kernel over the 16-bit logits, which it keeps with the fp32
    logsumexp [T]; its backward writes one logits-dtype gradient [T, v]. No fp32 [T, v] tensor."""
    TE = 3
    """Transformer Engine's ``parallel_cross_entropy`` as Megatron runs it (``--cross-entropy-loss-fusion
    --cross-entropy-fusion-impl te``, Megatron-Bridge's default): its Triton kernels keep the 16-bit logits
    [T, v/t] with three fp32 numbers a token, and its backward writes the gradient over the logits, in
    place: no fp32 [T, v] tensor and no new [T, v] gradient."""
    FUSED = 4
    """Liger's fused linear cross-entropy: the gradients of the hidden states and of the lm head's weight
    are made in forward, chunk by chunk; autograd keeps those two instead of any [T, v] tensor."""


def parse_loss(text: str) -> tuple[LossKind, int]:
    """``standard``, ``xentropy``, ``te``, ``fused`` or ``chunked:N`` → the kind and N (1 unless chunked)."""
    t = text.strip().lower()
    if t.startswith("chunked"):
        n = t.removeprefix("chunked").removeprefix(":")
        if not n.isdigit() or int(n) < 1:
            raise ValueError(f"loss: '{text}' needs a whole number of chunks ≥ 1, e.g. chunked:8")
        return LossKind.CHUNKED, int(n)
    if t not in ("standard", "xentropy", "te", "fused"):
        raise ValueError(
            f"loss: unknown '{text}'; choose standard, xentropy, te, fused or chunked:N (e.g. chunked:8)"
        )
    return LossKind[t.upper()], 1


def loss_label(kind: LossKind, chunks: int) -> str:
    return f"chunked:{chunks}" if kind is LossKind.CHUNKED else kind.name.lower()


def check_savers(
    offload: Offload, loss: LossKind, chunks: int, zero: int, segmented: bool, mixed: bool
) -> None:
    """The combinations memplan models; a one-line ``ValueError`` with the fix otherwise. ``mixed``: the
    precision recipe keeps an fp32 master copy."""
    if loss is not LossKind.CHUNKED and chunks != 1:
        raise ValueError("loss_chunks: only the chunked loss takes a chunk count; use --loss chunked:N")
    if loss in (LossKind.XENTROPY, LossKind.TE) and offload is not Offload.NONE:
        name = loss.name.lower()
        raise ValueError(f"loss: --loss {name} is modelled without offload; use --offload none")
    if Offload.OPTIMIZER in offload and not mixed:
        raise ValueError(
            "offload: ZeRO-Offload steps an fp32 master copy of 16-bit weights on the host; use --precision "
            "bf16-mixed or fp16-mixed with --offload optimizer"
        )
    if Offload.PARAMS in offload and zero < 3:
        raise ValueError(
            "offload: parameter offload shards the weights as ZeRO-3 does (DeepSpeed stage 3 / FSDP2 "
            "fully_shard); add --zero 3"
        )
    if Offload.ACTIVATIONS in offload and segmented:
        raise ValueError(
            "offload: activation offload is modelled without checkpointing or reversible layers; "
            "use --checkpointing none and drop --reversible"
        )
