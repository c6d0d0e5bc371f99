"""transformers' ``modeling_gpt2.py`` (GPT-2), and what GPT-NeoX's code shares with it (``gpt_common``).

Checked (tests/hf/test_gpt.py) on CPU kernels: saved bytes per layer and in total, and FLOPs per phase,
exact. Known limitations:
- NB: CUDA semantics (``native_dropout``'s bool masks, SDPA's flash kernel with dropout instead of the
  math path) follow torch's dispatch rules but are not measured: ``measure.hf`` runs on CPU only.
- NB: the peak's transients (eager forward locals, backward buffers) use the reference's and Megatron's
  formulas (``attention.eager_locals.eager_forward_extra``, ``mlp.mlp_backward_transient``); gelu_new's
  last product's two operand gradients are counted (``mlp.gradient_buffers``: the layer backward exact at
  GPT-2's widths, s 512, tests/hf/test_layernorm_peak.py), and so are the math path's fp32 backward
  buffers under attention dropout (``attention.core.math_backward_buffers``: at s 128, where the attention's
  backward tops the layer, exact; 589,824 B under before).
"""

from __future__ import annotations

from dataclasses import replace

from memplan.blocks.hf.llama import common
from memplan.blocks.profile import Profile
from memplan.config import Gelu, Setup


def gpt_common(setup: Setup) -> Profile:
    """What GPT-2 and GPT-NeoX share: q, k, v split off one projection output (``GPT2Attention.forward``:
    ``self.c_attn(hidden_states).split``; ``GPTNeoXAttention.forward``: ``qkv.chunk(3, dim=-1)``), dropout
    through ``nn.Dropout``, SDPA called with the dropout probability (``sdpa_attention_forward``), an
    eager attention that adds the mask (``attn_weights + attention_mask``), and the MLP's activation
    ``ACT2FN[activation_function / hidden_act]``."""
    return replace(
        common(setup),
        qkv_views=True,
        cpu_dropout_noise=True,
        sdpa_dispatch=True,
        matmul_copies_views=True,
        additive_mask=True,
        checkpoint_keeps_mask=True,
        gelu_python=setup.model.gelu is Gelu.GELU_NEW,
    )


def profile(setup: Setup) -> Profile:
    """GPT-2: its ``eager_attention_forward`` takes the softmax in the scores' dtype
    (``nn.functional.softmax(attn_weights, dim=-1)``): nothing beyond ``gpt_common``."""
    return gpt_common(setup)
