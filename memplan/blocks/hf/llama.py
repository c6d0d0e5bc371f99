"""transformers' ``modeling_llama.py`` and the families written like it (Mistral, Qwen2, Qwen3)."""

from __future__ import annotations

from memplan.blocks.profile import Profile
from memplan.config import Impl, Setup


def common(setup: Setup) -> Profile:
    """What every transformers causal LM does: ``ForCausalLMLoss`` (loss/loss_utils.py) pads the labels
    by one ignore_index and shifts them by a view; the Llama-style ``eager_attention_forward`` (softmax
    in fp32, an added float mask, ``repeat_kv``) and ``sdpa_attention_forward``'s mask."""
    return Profile(
        impl=Impl.HF,
        labels_padded=True,
        softmax_fp32=True,
        mask_added=True,
        sdpa_mask_converted=True,
        repeat_kv_view=True,
    )


def profile(setup: Setup) -> Profile:
    """Llama (``modeling_llama.py``)."""
    return common(setup)
