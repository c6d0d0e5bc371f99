"""Implementation profiles: what one framework's code keeps where memplan's reference model keeps something
else, as data the blocks read (``profile_of(setup)``), not a fork of the engine.

A ``Profile`` is a set of switches, each one fact about the code that runs, with the op that causes it. The
reference model is the all-default profile. ``hf`` reads transformers' ``modeling_<model_type>.py`` per
family (``ModelConfig.code_family``); ``torchtitan`` its Llama; ``megatron`` Megatron-core's fused layers.
Each switch is named after what the code does, and the block that owns the tensor applies it.
``blocks.profiles.profile_of(setup)`` picks the profile of a setup.
"""

from __future__ import annotations

from dataclasses import dataclass

from memplan.config import Impl


@dataclass(frozen=True)
class Profile:
    """What the running code keeps, beyond the reference model (every switch off: the reference)."""

    impl: Impl = Impl.REFERENCE
    labels_padded: bool = False
    """transformers' ``ForCausalLMLoss`` pads the labels by one ignore_index (``F.pad(labels, (0, 1))``) and
    shifts them by a view: cross_entropy keeps the [b, s+1] int64 storage (8·b B more)."""
    kv_cache: bool = False
    """The forward fills a ``DynamicCache`` (``use_cache``, not under gradient checkpointing, where the
    layers get none): ``DynamicLayer.update`` cats k and v onto an empty cache, so the attention reads
    contiguous copies [b, kv, s, d], never views of the projection output."""
    dropout_noise: bool = False
    """``nn.Dropout`` → ``at::dropout``: on CPU ``_dropout_impl`` multiplies by a noise tensor in the
    input's dtype (``input * noise``: Mul keeps the noise); on CUDA the fused ``native_dropout`` keeps a
    bool mask (``is_fused_kernel_acceptable``)."""
    torch_sdpa: bool = False
    """Attention calls torch's ``F.scaled_dot_product_attention`` (transformers' ``sdpa_attention_forward``)
    and torch picks the kernel: with dropout on CPU no fused kernel takes it, so
    ``_scaled_dot_product_attention_math`` runs — 16-bit q, k, v upcast to fp32, q and kᵀ scaled by
    √scale (new tensors), the fp32 softmax, dropout noise and dropped probabilities kept; the CPU flash
    kernel's output takes q's layout (``attention.attention_core_rules``)."""
    matmul_copies_views: bool = False
    """transformers' eager core multiplies [b, a, s, d] views of a batch-first [b, s, ·] buffer with
    ``torch.matmul``, whose reshape to [b·a, s, d] copies a view when b > 1 (a view when b = 1)."""
    eager_softmax_fp32: bool = False
    """Eager attention's ``softmax(..., dtype=torch.float32).to(q.dtype)``: the fp32 probabilities
    (softmax's output) and their A-dtype copy (the P·V matmul's operand) are both kept."""
    eager_additive_mask: bool = False
    """Eager attention adds the causal mask (``attn_weights + attention_mask``): nothing is kept for it,
    where the reference's ``masked_fill`` keeps a bool [s, s]."""
    gelu_python: bool = False
    """``gelu_new`` is ``NewGELUActivation``, written in Python (activations.py):
    ``0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`` keeps x (pow), tanh's output, 0.5·x and 1 + tanh
    (the last product): four [T, f] where ``F.gelu`` keeps x alone."""
    fused_norm: bool = False
    """Fused LayerNorm / RMSNorm kernels (Apex ``FusedLayerNormAffineFunction`` /
    ``FusedRMSNormAffineFunction``, TE ``LayerNorm`` / ``RMSNorm`` / ``LayerNormLinear``):
    ``save_for_backward`` keeps the input in the activation dtype and the fp32 statistics [b, s] (mean and
    invvar; RMSNorm invvar only) on any device, no fp32 copy of x and no normalised output. Korthikanti's
    "two LayerNorm inputs, 4sbh" (statistics ignored)."""
    fused_causal_softmax: bool = False
    """Megatron-core ``FusedScaleMaskSoftmax`` with the causal mask type (``masked_softmax_fusion``, on in
    Megatron-LM's arguments): where ``is_kernel_available`` holds (``attention.fused_softmax_runs``) the
    kernel ``ScaledUpperTriangMaskedSoftmax`` scales, masks and softmaxes in one op and saves its output only
    (Korthikanti's "softmax output, 2as²b") and no mask tensor exists; elsewhere ``forward_torch_softmax``
    runs: with ``attention_softmax_in_fp32`` (Megatron-core's default) the probabilities are kept in fp32
    and ``masked_fill_`` keeps the cached [s, s] bool causal mask (``get_default_causal_mask``)."""
    qkv_views: bool = False
    """q, k, v are views of one projection output: Megatron-core's
    ``SelfAttention.get_query_key_value_tensors`` (one W_QKV output [s, b, g, (a/g + 2)·d] split by
    ``torch.split``), transformers' GPT-2 (``c_attn(x).split``) and GPT-NeoX
    (``query_key_value(x).view(...).chunk(3)``); a saved view keeps the whole buffer
    (``attention.qkv_view_rules``: which of q, k, v are new tensors — RoPE, GQA's reshape copy, the eager
    core's ``repeat_interleave``, transformers' KV cache). For MHA without RoPE this is Korthikanti's
    "Q and K, 4sbh" + "V, 2sbh" in one storage."""
    fused_swiglu: bool = False
    """Megatron-core ``bias_swiglu_impl`` (``SwiGLUFunction``, ``bias_swiglu_fusion`` on by default):
    ``save_for_backward(input)`` keeps W_fc1's fused [·, 2f] output only, not silu(g) nor the chunks."""
    flash_rng_int64: bool = False
    """flash-attn's ``mha_fwd`` (``flash_attn_interface.FlashAttnFunc``, TE's flash backend): ``rng_state``
    is a [2] int64 (16 B), saved with or without dropout, where torch's SDPA keeps a [2] and a [] uint64."""
    checkpoint_reruns_all: bool = False
    """Megatron-core's ``tensor_parallel.checkpoint`` (``CheckpointFunction``, an ``autograd.Function``: it
    keeps the function's tensor inputs and re-runs the whole function in backward, without torch's early
    stop; so does ``torch.utils.checkpoint`` with ``use_reentrant=True``, transformers' ``--reentrant``): full
    recompute re-runs every matmul of the layer, selective recompute (``core_attention`` under
    ``_checkpointed_attention_forward``) both QKᵀ and P·V."""
    vocab_parallel_loss: bool = False
    """Megatron-core ``_VocabParallelCrossEntropy`` (``tensor_parallel/cross_entropy.py``):
    ``save_for_backward(exp_logits, target_mask, masked_target_1d)`` — the fp32 softmax [T, v/t]
    (Korthikanti's "fp32 logits, 4sbv/t"), a bool [T] mask of the targets outside the rank's vocabulary
    and the int64 [T] targets shifted into it; Megatron-LM's ``pretrain_gpt.loss_func``
    (``torch.sum(losses * loss_mask)``) keeps the data set's fp32 [T] loss mask. No labels, no total
    weight."""
    experts_gate_up_fused: bool = False
    """transformers' experts hold gate and up as one ``gate_up_proj``: their product [S, 2f] is one
    storage that ``chunk(2)`` views, so ``act_fn(gate) * up`` keeps the whole buffer (the same bytes as a
    separate gate and up, one tensor)."""
    experts_grouped_mm: bool = False
    """transformers' default experts (``integrations/moe.py::grouped_mm_experts_forward``,
    ``experts_implementation="grouped_mm"``): each grouped_mm keeps its offsets [E] int32
    (``cumsum(histc(...))``), and the slots go back to the tokens by ``weighted_out[inv_perm]`` and a sum
    over k, not ``index_add_``: the inverse permutation [S] int64 is kept, the weighted product is not.
    (The ``eager`` loop keeps what the reference model keeps: per expert its ``torch.where`` [n_e, 2]
    int64, and ``index_add_``'s source.)"""
    routing_weights_fp32: bool = False
    """Mixtral's router (``MixtralTopKRouter.forward``) returns its fp32 top-k weights uncast:
    ``proj_out * sample_weights_g.unsqueeze(-1)`` keeps the slots' weights [S, 1] in fp32."""


REFERENCE = Profile()
