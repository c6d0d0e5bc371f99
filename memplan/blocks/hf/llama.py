"""transformers' ``modeling_llama.py`` and the families written like it (Mistral, Qwen2, Qwen3)."""

from __future__ import annotations

from memplan.blocks.profile import Profile
from memplan.config import Checkpointing, Impl, Setup


def common(setup: Setup) -> Profile:
    """What every transformers causal LM does: ``ForCausalLMLoss`` (loss/loss_utils.py) pads the labels
    by one ignore_index and shifts them by a view; with ``use_cache`` the model makes a ``DynamicCache``,
    which the layers fill unless gradient checkpointing runs them (they get ``None`` then,
    e.g. ``GPT2Model.forward``: ``cache if not (self.gradient_checkpointing and self.training)``)."""
    cached = setup.impl.use_cache and setup.strategy.checkpointing is Checkpointing.NONE
    reruns = setup.impl.reentrant  # torch.utils.checkpoint(use_reentrant=True): CheckpointFunction
    return Profile(impl=Impl.HF, labels_padded=True, kv_cache=cached, checkpoint_reruns_all=reruns)


def profile(setup: Setup) -> Profile:
    """Llama (``modeling_llama.py``)."""
    return common(setup)
