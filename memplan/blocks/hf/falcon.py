"""transformers' ``modeling_falcon.py`` (Falcon-7B/40B/180B): one ``query_key_value`` projection whose
output q, k and v are views of (``qkv_views``: multi-query ``split([a, 1, 1])``, the new decoder
architecture's [kv, a/kv + 2, d] groups, or multi-head [a, 3, d] ``unbind``), rotary on them, Llama's
attention functions (fp32 eager softmax, additive mask, ``repeat_kv``), a GELU MLP, ``nn.LayerNorm``s,
and a parallel layer: one norm for both branches (Falcon-7B, ``shared_norm``) or two reading the layer
input (the new architecture's ``ln_attn`` / ``ln_mlp``: ``parallel_residual``). ``FalconLinear`` is
``input @ self.weight.T`` (+ bias): the same saves and FLOPs as ``nn.Linear``.

Checked to the byte per layer and in total, FLOPs per phase equal (tests/hf/test_falcon.py); the layer
backward's top, W_QKV's input gradient beside the MLP's
(``analytic.moments.qkv_backward.parallel_fused_qkv``),
exact at Falcon-7B's widths (tests/hf/test_layernorm_peak.py). Known
limitations:
- NB: ALiBi (Falcon-RW, ``alibi``) and the sequential layer (``parallel_attn`` false, which drops out the
  attention output with ``attention_dropout``) are refused by the importer, not modelled.
"""

from __future__ import annotations

from dataclasses import replace

from memplan.blocks.hf.llama import profile as llama_profile
from memplan.blocks.profile import Profile
from memplan.config import Gelu, Setup


def profile(setup: Setup) -> Profile:
    """Falcon: q, k, v views of ``query_key_value``'s output; eager's ``torch.matmul`` copies the views
    when b > 1 (``matmul_copies_views``); ``dropout_add(mlp_output, residual, hidden_dropout)`` once per
    layer, after the branches' sum (``hidden_dropout``, ``mlp_dropout_only``); GELU as ``activation``;
    SDPA always masked explicitly (``sdpa_mask_always``)."""
    if not setup.model.parallel_residual:
        raise ValueError(
            "parallel_residual: Falcon's sequential layer (parallel_attn false) is not modelled; set "
            "parallel_residual true"
        )
    return replace(
        llama_profile(setup),
        qkv_views=True,
        matmul_copies_views=True,
        hidden_dropout=True,
        mlp_dropout_only=True,
        sdpa_mask_always=True,
        gelu_python=setup.model.gelu is Gelu.GELU_NEW,
    )
