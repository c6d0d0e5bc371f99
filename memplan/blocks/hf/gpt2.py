"""transformers' ``modeling_gpt2.py`` (GPT-2) and ``modeling_gpt_neox.py`` (GPT-NeoX, Pythia): fused qkv
projections, ``nn.Dropout`` everywhere, and each family's own eager attention."""

from __future__ import annotations

from dataclasses import replace

from memplan.blocks.hf.llama import common
from memplan.blocks.profile import Profile
from memplan.config import Gelu, Setup


def gpt_common(setup: Setup) -> Profile:
    """What GPT-2 and GPT-NeoX share: q, k, v split off one projection output (``GPT2Attention.forward``:
    ``self.c_attn(hidden_states).split``; ``GPTNeoXAttention.forward``: ``qkv.chunk(3, dim=-1)``), dropout
    through ``nn.Dropout`` and SDPA called with the dropout probability (``sdpa_attention_forward``)."""
    return replace(common(setup), fused_qkv=True, dropout_noise=True, sdpa_math_dropout=True)


def gpt2(setup: Setup) -> Profile:
    """GPT-2: ``eager_attention_forward`` adds the mask and takes the softmax in the scores' dtype
    (``nn.functional.softmax(attn_weights, dim=-1)``); the MLP's activation is ``ACT2FN[activation_function]``."""
    return replace(
        gpt_common(setup), eager_additive_mask=True, gelu_python=setup.model.gelu is Gelu.GELU_NEW
    )


def gpt_neox(setup: Setup) -> Profile:
    """GPT-NeoX: ``eager_attention_forward`` adds the mask and takes ``softmax(..., dtype=torch.float32)
    .to(query.dtype)``; partial rotary and the parallel residual are the model's (``rotary_pct``,
    ``parallel_residual``)."""
    return replace(
        gpt_common(setup),
        eager_additive_mask=True,
        eager_softmax_fp32=True,
        gelu_python=setup.model.gelu is Gelu.GELU_NEW,
    )
