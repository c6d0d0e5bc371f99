"""transformers' ``modeling_llama.py`` and the families written like it (Mistral, Qwen2, Qwen3, Granite,
StarCoder2, StableLM, GLM)."""

from __future__ import annotations

from dataclasses import replace

from memplan.blocks.profile import Profile
from memplan.config import Checkpointing, Impl, Setup


def common(setup: Setup) -> Profile:
    """What every transformers causal LM does: ``ForCausalLMLoss`` (loss/loss_utils.py) pads the labels
    by one ignore_index and shifts them by a view; ``every_n_layers`` checkpoints single layers; with
    ``use_cache`` the model makes a ``DynamicCache``, which the layers fill unless gradient checkpointing
    runs them (they get ``None`` then, e.g. ``GPT2Model.forward``: ``cache if not
    (self.gradient_checkpointing and self.training)``); ``use_reentrant=True`` re-runs whole layers."""
    cached = setup.impl.use_cache and setup.strategy.checkpointing is Checkpointing.NONE
    reruns = setup.impl.reentrant  # torch.utils.checkpoint(use_reentrant=True): CheckpointFunction
    return Profile(
        impl=Impl.HF,
        labels_padded=True,
        checkpoints_alone=True,
        kv_cache=cached,
        checkpoint_reruns_all=reruns,
        rope_tables_freed_by_layer0=True,
    )


def profile(setup: Setup) -> Profile:
    """Llama (``modeling_llama.py``): ``eager_attention_forward``'s fp32 softmax and additive mask, SDPA
    through torch's dispatcher, ``F.dropout`` (CPU: noise), the checkpointed layer's kwargs kept."""
    return replace(
        common(setup),
        hidden_dropout=False,
        eager_fp32_softmax=True,
        additive_mask=True,
        cpu_dropout_noise=True,
        sdpa_dispatch=True,
        checkpoint_keeps_mask=True,
        repeat_kv_view=True,
    )


def windowed(setup: Setup) -> Profile:
    """Mistral, Qwen2 and Qwen3 (``modeling_mistral.py``, ``modeling_qwen2.py``, ``modeling_qwen3.py``):
    Llama's code with a sliding window (``create_sliding_window_causal_mask``); Qwen3's q_norm/k_norm are
    ``ModelConfig.qk_norm``, the same RMSNorm as the reference's."""
    return replace(profile(setup), window_mask=True)


def granite(setup: Setup) -> Profile:
    """Granite (``modeling_granite.py``): Llama's code and four multipliers, each a multiply by a Python
    float, which saves nothing (``mul(Tensor, Scalar)``'s backward needs only the scalar) and which
    FlopCounterMode does not count: ``inputs_embeds * self.embedding_multiplier`` (GraniteModel),
    ``scaling=config.attention_multiplier`` (the scores' scale in place of d^-½: SDPA's ``scale``, eager's
    ``* scaling``), ``residual + hidden_states * self.residual_multiplier`` (twice per layer) and
    ``logits / self.config.logits_scaling`` (a new [b, s, v] the loss's ``.float()`` copies, as Llama's
    logits). The multipliers change no byte and no FLOP beyond Llama's; the embedding's makes layer 0's
    input a tensor of its own (``embedding_multiplied``)."""
    return replace(profile(setup), embedding_multiplied=True)


def starcoder2(setup: Setup) -> Profile:
    """StarCoder2 (``modeling_starcoder2.py``): Mistral's code (the sliding window's mask) with
    ``nn.LayerNorm`` and a GELU MLP with biases (``ModelConfig.norm``, ``mlp``, the biases: the blocks'),
    and dropout on the residual branches and the embedding: ``nn.functional.dropout(attn_output,
    p=self.residual_dropout)`` after W_O, the same after ``c_proj`` and ``embedding_dropout`` after the
    embedding (``hidden_dropout``; on CPU ``F.dropout`` keeps its noise, ``cpu_dropout_noise``)."""
    return replace(windowed(setup), hidden_dropout=True)


def stablelm(setup: Setup) -> Profile:
    """StableLM (``modeling_stablelm.py``): Llama's attention and MLP with ``nn.LayerNorm`` (the model's
    ``norm``), partial rotary on the first ``rotary_pct`` of each head (``torch.cat((query_rot,
    query_pass))``, as GPT-NeoX: ``rotary_pct``, ``rotary_cat``), an optional parallel layer with one norm
    (``use_parallel_residual``: ``parallel_residual`` and ``shared_norm``) and ``nn.Dropout(hidden_dropout)``
    after the MLP only (``mlp_dropout_only``; on CPU its noise, ``cpu_dropout_noise``); the layer's
    backward tops at W_Q's input gradient (``q_input_gradient_top``)."""
    return replace(
        profile(setup), hidden_dropout=True, mlp_dropout_only=True, rotary_cat=True, q_input_gradient_top=True
    )


def glm(setup: Setup) -> Profile:
    """GLM-4 (``modeling_glm.py``): Llama's code with Phi-3's fused ``gate_up_proj`` (``GlmMLP``:
    ``up_states.chunk(2, dim=-1)``, ``fused_gate_up``) and partial interleaved rotary:
    ``apply_rotary_pos_emb`` repeat_interleaves half of each table per call (``rope_tables_per_layer``)
    and cats the rotated and passed dims (``torch.cat([q_embed, q_pass])``: ``rotary_cat``)."""
    return replace(profile(setup), fused_gate_up=True, rope_tables_per_layer=True, rotary_cat=True)
