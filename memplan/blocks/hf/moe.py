"""transformers' mixtures of experts: ``modeling_mixtral.py``, ``modeling_qwen2_moe.py``,
``modeling_qwen3_moe.py`` and ``modeling_phimoe.py`` (5.x).

Both run their experts through ``@use_experts_implementation``, whose default ``experts_implementation`` is
``grouped_mm`` (``PreTrainedModel.get_correct_experts_implementation``): ``grouped_mm_experts_forward`` in
``integrations/moe.py`` sorts the T·k slots by expert and runs ``torch.nn.functional.grouped_mm`` over all
of them (``Profile.experts_grouped_mm``). Every buffer it keeps is [S, ·] with S = T·k, whatever the
split among the experts, so the kept bytes and the FLOPs do not depend on the routing (dropless; checked
with realised random-router routings, tests/hf/test_moe.py). Mixtral's router does not cast its top-k
weights back to the activation dtype (``Profile.routing_weights_fp32``); Qwen2-MoE's and Qwen3-MoE's do.

``--experts eager`` follows the modeling file's own loop (``experts_implementation="eager"``): per expert a
``torch.where`` [n_e, 2] int64, its tokens' MLP and ``index_add_``, whose source [n_e, h] stays: E pieces
whose rows sum to S, the reference model's bytes. Its shapes are data: only real tensors run it.

The attention, norms and loss are Mistral's and Qwen2's (``llama.profile``). Known limitations: NB the
router's auxiliary loss (``output_router_logits``) is off, as the configs' default; NB on a GPU without a
grouped GEMM kernel transformers falls back to a custom op that holds the offsets on its ctx (32 B per
layer that saved-tensor hooks do not see). NB PhiMoE's sparsemixer samples its experts (Gumbel noise,
``rand_like``): its eval-mode path (argmax, no ``PhimoeMultiplier``) is not modelled, training only.
"""

from __future__ import annotations

from dataclasses import replace

from memplan.blocks.hf import llama
from memplan.blocks.profile import Profile
from memplan.config import ExpertsImpl, MlpType, Setup


def check(setup: Setup, shared: bool) -> None:
    """One-line errors for what the family's code cannot express: gated (SwiGLU-shaped) experts, dropless
    routing, and shared experts (Mixtral none; Qwen2-MoE one of width n·f_s behind its sigmoid gate)."""
    m, family = setup.model, setup.model.code_family.value
    moe = m.moe
    if moe is None:
        raise ValueError(f"moe: model_type {family} is a mixture of experts; add a [model.moe] table")
    if m.mlp is not MlpType.SWIGLU:
        raise ValueError(
            f"mlp: {family}'s experts are gated (act(gate)·up, hidden_act silu); use mlp = swiglu"
        )
    if setup.parallel.ep > 1:  # NB: transformers' EP keeps sentinel masks [S, 1]; not measured here
        raise ValueError(f"ep: {family}'s expert parallelism under --impl hf is not modelled; use --ep 1")
    if moe.capacity_factor is not None:
        raise ValueError(f"capacity_factor: {family} routes dropless in transformers; drop capacity_factor")
    if shared and not (moe.shared_experts and moe.shared_gate):
        raise ValueError(
            f"shared_gate: {family} has a sigmoid-gated shared expert; set shared_experts ≥ 1 and shared_gate"
        )
    if not shared and moe.shared_experts:
        raise ValueError(
            f"shared_experts: {family} has none; set shared_experts = 0 (or family qwen2_moe, shared_gate)"
        )


def experts(setup: Setup) -> Profile:
    """The facts both share: the llama-like layers, ``gate_up_proj``, and the experts implementation."""
    grouped = setup.impl.experts is ExpertsImpl.GROUPED_MM
    return replace(llama.profile(setup), experts_gate_up_fused=True, experts_grouped_mm=grouped)


def mixtral(setup: Setup) -> Profile:
    """Mixtral (``MixtralSparseMoeBlock``): ``MixtralTopKRouter`` renormalises in fp32 and returns the
    weights uncast; no shared experts. Its attention is Mistral's: ``MixtralModel.forward`` masks with
    ``create_sliding_window_causal_mask`` when ``config.sliding_window`` is set (``window_mask``)."""
    check(setup, shared=False)
    return replace(experts(setup), routing_weights_fp32=True, window_mask=True)


def qwen2_moe(setup: Setup) -> Profile:
    """Qwen2-MoE (``Qwen2MoeSparseMoeBlock``): router weights cast to the activation dtype
    (``router_top_value.to(router_logits.dtype)``), one shared expert behind
    ``sigmoid(shared_expert_gate)``."""
    check(setup, shared=True)
    return experts(setup)


def phimoe(setup: Setup) -> Profile:
    """PhiMoE (``PhimoeSparseMoeBlock``): ``sparsemixer``'s two sampled experts
    (``Profile.sparsemixer_router``), their multipliers concatenated in the activation dtype, Mixtral's
    grouped experts, no shared expert; ``nn.LayerNorm`` with bias for every norm (``ModelConfig.norm``),
    biases on q, k, v and o (``attention_bias``) and the lm head (``head_bias``); Mistral's sliding-window
    mask when ``config.sliding_window`` is set (``window_mask``). sparsemixer returns two experts
    whatever ``num_experts_per_tok``: top_k ≠ 2 is refused. Its attention is StableLM's in what tops the
    layer's backward: separate biased q, k, v on one ``nn.LayerNorm``'s output, W_Q's backward over the
    norm's (``q_input_gradient_top``; measured at Phi-3.5-MoE's widths, s 512: 8,372,224 B above the
    attention norm's moment at layer 0, the MoE's replayed backward below it)."""
    check(setup, shared=False)
    moe = setup.model.moe
    assert moe is not None  # NB: check refuses an MoE family without [model.moe]
    if moe.top_k != 2:
        raise ValueError("moe.top_k: PhiMoE's sparsemixer always routes to 2 experts; set top_k = 2")
    return replace(experts(setup), sparsemixer_router=True, window_mask=True, q_input_gradient_top=True)


def qwen3_moe(setup: Setup) -> Profile:
    """Qwen3-MoE (``Qwen3MoeSparseMoeBlock``): Qwen2-MoE's router (``Qwen3MoeTopKRouter``, weights cast to
    the activation dtype) and grouped experts, no shared expert; ``Qwen3MoeAttention``'s q_norm / k_norm
    (``ModelConfig.qk_norm``) and Mistral's sliding-window mask (``create_sliding_window_causal_mask`` when
    ``config.sliding_window`` is set: every layer)."""
    check(setup, shared=False)
    return replace(experts(setup), window_mask=True)
