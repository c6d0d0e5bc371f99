"""transformers' ``modeling_deepseek_v2.py`` and ``modeling_deepseek_v3.py`` (5.x): multi-head latent
attention (``blocks.attention.mla``), DeepSeek's fine-grained and shared experts behind its own router,
and the first ``first_k_dense_replace`` layers dense.

Facts beyond Llama's code (``llama.profile``) and the MoE families' experts (``moe.experts``: grouped_mm,
gate and up one buffer):
- ``DeepseekV3Attention`` / ``DeepseekV2Attention``: the latents and their norms, q and k assembled by
  ``cat`` / ``expand_kv``, v a view of ``kv_b_proj``'s output (``blocks.attention.mla``); SDPA on CPU falls
  back to the math kernel (q/k and v widths differ: ``attention.core_of``);
- ``DeepseekV2RotaryEmbedding``: a complex64 ``freqs_cis`` table (``Profile.rope_complex_table``);
  V3's cos / sin, cut to their first half under ``rope_interleave``, are views of the [s, d_r] tables;
- the routers (``Profile.deepseek_router``): an fp32 copy of the input, softmax (V2) or sigmoid with the
  correction bias for the choice (V3), group-limited routing (its saves freed within the forward but V2's
  mask: ``blocks.moe.deepseek_router_rules``), the top-k weights returned in fp32
  (``Profile.routing_weights_fp32``); ``routed_scaling_factor`` is a scalar multiply (no bytes);
- ``DeepseekV3MoE``: routed experts plus ``shared_experts``, a dense MLP of n_shared·moe_intermediate_size,
  no gate; the first ``first_k_dense_replace`` layers a ``DeepseekV3MLP`` of ``intermediate_size``
  (``blocks.moe.dense_layer_setup``).

Checked to the byte per layer and in total, FLOPs equal, under fake tensors on CPU
(tests/hf/test_deepseek.py).
Known limitations, refused by ``check`` (one line each): NB torch's CUDA SDPA runs MLA in its
memory-efficient kernel (not modelled: use eager attention, or --device cpu); NB tensor, pipeline,
context and expert parallelism, selective and every-K checkpointing of the mixed dense / MoE layers are not
modelled. The peak charges the dense first layers' backward as a dense layer's
(``analytic.moments.layer_kinds.layer_kind_terms``), V2's MoE backward replayed op by op
(``blocks.moe.backward._deepseek``; V3's sigmoid router ``_v3_choice``). NB ``_keep_in_fp32_modules_strict =
["gate.weight"]`` keeps each router's weight (and so its gradient) in fp32, which the model states count in
the weights' dtype: E·h·2 bytes a MoE layer under (tests/hf/test_layer_kinds.py). NB the MTP modules of
DeepSeek-V3 (``num_nextn_predict_layers``) are not in transformers' model.
"""

from __future__ import annotations

from dataclasses import replace

from memplan.blocks.hf import moe
from memplan.blocks.profile import Profile
from memplan.config import Attention, Checkpointing, Family, Setup, no_flash


def check(setup: Setup) -> None:
    """One-line errors for what is not modelled of DeepSeek's code (module docstring)."""
    m, p, s = setup.model, setup.parallel, setup.strategy
    name = m.code_family.value
    if m.mla is None:
        raise ValueError(f"mla: {name}'s attention is multi-head latent attention; add a [model.mla] table")
    why = no_flash(m, setup.impl.impl, setup.device)
    if why is not None and s.attention is not Attention.EAGER:
        raise ValueError(f"attention: {why}; use --attention eager (or --device cpu)")
    if setup.impl.flash_attn:  # flash-attn needs one head width for q, k and v
        raise ValueError(
            f"flash_attn: flash_attention_2 with {name}'s MLA is not modelled; drop --flash-attn"
        )
    unmodelled = {"--tp": p.tp > 1, "--pp": p.pp > 1, "--cp": p.cp > 1, "--ep": p.ep > 1}
    for option, used in unmodelled.items():
        if used:
            raise ValueError(
                f"{option.lstrip('-')}: {option} with {name}'s MLA and dense first layers is not "
                f"modelled; drop {option}"
            )
    if s.checkpointing in (Checkpointing.SELECTIVE, Checkpointing.EVERY_K):
        raise ValueError(
            f"checkpointing: selective and every-K checkpointing of {name}'s layers are not modelled; "
            "use --checkpointing full or none"
        )
    experts = m.moe
    if experts is not None and (experts.capacity_factor is not None or experts.shared_gate):
        raise ValueError(
            f"moe: {name} routes dropless to ungated shared experts; drop capacity_factor and shared_gate"
        )
    if m.attn_dropout > 0:
        raise ValueError(f"attn_dropout: {name}'s attention dropout is not modelled; set it to 0")


def profile(setup: Setup) -> Profile:
    """DeepSeek-V2 and V3: the MoE families' experts with DeepSeek's router and attention (module
    docstring). A dense first layer's setup (no ``moe``) is profiled the same way."""
    check(setup)
    base = moe.experts(setup)
    v2 = setup.model.code_family is Family.DEEPSEEK_V2
    return replace(base, deepseek_router=True, routing_weights_fp32=True, rope_complex_table=v2)
