"""transformers' ``modeling_llama4.py`` (5.x) as a profile: Llama's code without eager's fp32 softmax. The
layers' kinds and saves, which are this family's own, are ``memplan.blocks.llama4``'s (its docstring
lists each fact with the line that causes it)."""

from __future__ import annotations

from dataclasses import replace

from memplan.blocks.hf import llama
from memplan.blocks.profile import Profile
from memplan.config import Checkpointing, ExpertsImpl, Setup


def profile(setup: Setup) -> Profile:
    """Llama's code (``llama.profile``) without eager's fp32 softmax; the rest is this module's."""
    check(setup)
    return replace(llama.profile(setup), eager_fp32_softmax=False)


def check(setup: Setup) -> None:
    """One-line errors for what is not modelled for Llama 4."""
    m, s, par = setup.model, setup.strategy, setup.parallel
    moe = m.moe  # None in a dense layer's kind (blocks.llama4.kind_model)
    if moe is not None and (not moe.router_sigmoid or moe.shared_experts != 1 or moe.shared_gate):
        raise ValueError(
            "moe: llama4_text's MoE is a sigmoid router, routed experts and one shared expert; "
            "set moe.router_sigmoid true, shared_experts 1, no shared_gate"
        )
    if setup.impl.experts is not ExpertsImpl.GROUPED_MM:
        raise ValueError(
            "experts: llama4_text's experts are one bmm over every token, no experts implementation to "
            "choose; drop --experts"
        )
    if setup.impl.flash_attn:  # Llama4PreTrainedModel._supports_flash_attn = False
        raise ValueError("flash_attn: transformers' Llama 4 has no flash_attention_2 path; drop --flash-attn")
    if m.attn_dropout > 0:
        raise ValueError("attn_dropout: attention dropout is not modelled for llama4_text; set it to 0")
    if s.checkpointing is Checkpointing.SELECTIVE or s.checkpoint_every > 1:
        raise ValueError(
            "checkpointing: llama4_text is modelled with --checkpointing none or full; use one of them"
        )
    if max(par.tp, par.pp, par.cp, par.ep) > 1:
        raise ValueError(
            "tp: llama4_text's layer kinds are modelled on one unsplit replica; use --tp/--pp/--cp/--ep 1"
        )
