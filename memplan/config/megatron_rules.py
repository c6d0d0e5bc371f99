"""Which of Megatron-LM's switches are modelled, and with what (``--impl megatron``'s own options and its
Transformer Engine float8 beyond dense layers; called from ``config.impl_rules.check_fp8``). One-line
``ValueError``s naming the field and the fix."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memplan.config.impl import Fp8Recipe, Impl
from memplan.config.strategy import ZeroStage

if TYPE_CHECKING:
    from memplan.config.setup import Setup


def check_overlap_grad_reduce(setup: Setup) -> None:
    """``--overlap-grad-reduce`` and ``--overlap-param-gather`` are Megatron's switches; torch's DDP and
    FSDP (the other implementations) overlap their reductions with the backward by design."""
    if setup.impl.overlap_grad_reduce and setup.impl.impl is not Impl.MEGATRON:
        raise ValueError(
            "overlap_grad_reduce: --overlap-grad-reduce is Megatron-LM's switch (torch's DDP and FSDP "
            "overlap their reductions already); add --impl megatron or drop it"
        )
    # megatron/training/arguments.py: "Must use --overlap-param-gather with --overlap-grad-reduce" (and the
    # distributed optimizer, whose gather it overlaps: without ZeRO-1 there is none, and the flag changes
    # nothing — so that fit can hold it over every stage it searches)
    if setup.impl.overlap_param_gather and not setup.impl.overlap_grad_reduce:
        raise ValueError(
            "overlap_param_gather: Megatron's --overlap-param-gather needs --overlap-grad-reduce (and its "
            "distributed optimizer, --zero 1); add --impl megatron --overlap-grad-reduce or drop it"
        )


def check_tp_comm_overlap(setup: Setup) -> None:
    """``--tp-comm-overlap`` (Transformer Engine's userbuffers, ``time.tp_overlap``) where it runs and is
    modelled: Megatron's TE layers, tensor parallelism with sp (Megatron-LM's arguments.py: "Tensor parallel
    communication/GEMM overlap can happen only when sequence parallelism is enabled"), dense layers or
    folded experts (TE's GroupedLinear experts have no userbuffers overlap; under parallel folding the MoE
    layer gathers nothing over tp and the attention's linears overlap theirs, with experts split over tp
    memplan does not model which of an MoE layer's GEMMs would); that the tp group sits inside one node is
    the GPU's to say (``time.tp_overlap``)."""
    if not setup.impl.tp_comm_overlap:
        return
    par = setup.parallel
    why = (
        "it is Transformer Engine's, under --impl megatron" if setup.impl.impl is not Impl.MEGATRON
        else "it overlaps the sequence-parallel collectives: it needs --tp T --sp with T > 1"
        if par.tp == 1 or not par.sp
        else "with a mixture of experts it is modelled under parallel folding (--etp 1), where the MoE layer "
        "has no sequence-parallel collective" if setup.model.moe is not None and par.fold == 1
        else ""
    )  # fmt: skip
    if why:
        raise ValueError(f"tp_comm_overlap: --tp-comm-overlap (TE's userbuffers): {why}; or drop it")


def check_fp8_param_gather(setup: Setup) -> None:
    """``--fp8-param-gather`` where it is modelled (``te_fp8.primary_elements``): Megatron's TE layers under
    a per-tensor recipe with the distributed optimizer (Megatron-LM's arguments.py: "--fp8-param-gather
    only supported with distributed optimizer", ZeRO 1) or Megatron FSDP (ZeRO 3, ``te_fp8.fsdp_primary``);
    MXFP8 with the distributed optimizer, as Megatron runs it with ``--reuse-grad-buf-for-mxfp8-param-ag``
    (``te_fp8.float8_gathered``), not under Megatron FSDP."""
    if not setup.impl.fp8_param_gather:
        return
    impl, recipes = setup.impl, (Fp8Recipe.TENSORWISE, Fp8Recipe.DELAYED, Fp8Recipe.MXFP8)
    zero, mx = setup.strategy.zero, impl.fp8 is Fp8Recipe.MXFP8
    why = (
        "it is Megatron's, with Transformer Engine's per-tensor or MXFP8 float8 (--impl megatron --fp8 "
        "tensorwise, delayed or mxfp8)" if impl.impl is not Impl.MEGATRON or impl.fp8 not in recipes
        else "with --fp8 mxfp8 it is modelled with the distributed optimizer (--zero 1)"
        if mx and zero is not ZeroStage.OPTIMIZER
        else "it is modelled with the distributed optimizer (--zero 1) or Megatron FSDP (--zero 3)"
        if zero not in (ZeroStage.OPTIMIZER, ZeroStage.PARAMETERS)
        else ""
    )  # fmt: skip
    if why:
        raise ValueError(f"fp8_param_gather: --fp8-param-gather (float8 primary weights): {why}; or drop it")


def check_fp8_experts(setup: Setup) -> None:
    """Megatron's mixture of experts under Transformer Engine's float8 where it is modelled
    (``te_fp8.expert_casts``, ``time.fp8.te_gemms``): routed experts in ``GroupedLinear`` under current
    scaling or MXFP8, every layer a mixture of experts, the distributed optimizer or plain DDP."""
    m, s = setup.model, setup.strategy
    moe = m.moe
    if moe is None:
        return
    why = (
        "with --fp8 tensorwise or mxfp8 (delayed scaling's per-expert amax histories are not modelled)"
        if setup.impl.fp8 is Fp8Recipe.DELAYED
        else "without shared experts (their TE linears are not modelled)" if moe.shared_width(m)
        else "with every layer a mixture of experts (dense first layers are not modelled)" if moe.dense_layers
        else "without Megatron FSDP (--zero 1 or 0)" if s.zero is ZeroStage.PARAMETERS
        else ""
    )  # fmt: skip
    if why:
        raise ValueError(
            f"fp8: --impl megatron --fp8 with a mixture of experts is modelled {why}; or drop --fp8"
        )
