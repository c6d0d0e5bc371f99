"""Megatron-core's GPT layers (``megatron/core/transformer``) with their fused kernels, as Korthikanti et al.
2022 ("Reducing Activation Recomputation in Large Transformer Models", §4.1) count them: per layer
sbh(34 + 5as/h) bytes for 16-bit activations with dropout (GPT layout: LayerNorm, MHA, GeLU MLP of 4h).

Korthikanti's terms and the op that keeps each (memplan's save in brackets):
- "two LayerNorm inputs, 4sbh": Apex / TE fused LayerNorm (``fused_norm``) [``attn_norm.input``,
  ``mlp_norm.input``];
- "QKV input, 2sbh": ``ColumnParallelLinear`` (W_QKV) keeps its input [``attn.input``];
- "Q and K, 4sbh" and "V, 2sbh": views of W_QKV's one output (``qkv_views``) [``attn.qkv``];
- "softmax output, 2as²b": the fused causal softmax (``fused_causal_softmax``) [``attn.probs``];
- "softmax dropout mask, as²b": ``attention_dropout`` (torch's ``native_dropout``, a bool mask)
  [``attn.dropout_mask``]; "dropout output, 2as²b": the P·V ``bmm`` operand [``attn.probs_dropped``];
- "output-projection input, 2sbh": ``RowParallelLinear`` (W_O) [``attn.out``];
- "attention dropout mask, sbh" and "MLP dropout mask, sbh": the fused ``bias_dropout_add`` (bool mask)
  [``attn.resid_dropout_mask``, ``mlp.resid_dropout_mask``];
- "MLP input, 2sbh": W_fc1's input [``mlp.input``]; "GeLU input, 8sbh": ``bias_gelu_impl``
  (``GeLUFunction.save_for_backward(input, bias)``, the bias a parameter) [``mlp.up``]; "4h→h input, 8sbh":
  W_fc2's input [``mlp.down_input``].
These are the reference model's bytes already but for three facts: the fused norms keep fp32 statistics on
any device, the fused softmax keeps no causal mask, the flash kernel's RNG state is flash-attn's [2] int64.
``qkv_views`` and ``fused_swiglu`` change bytes only where Korthikanti does not count (RoPE, GQA, SwiGLU).
Beyond the layer, §4.3's "fp32 logits, 4sbv/t" is the vocabulary-parallel cross entropy's softmax
(``vocab_parallel_loss``, with its [T] target mask, shifted targets and pretrain_gpt's loss mask).

Where memplan and the paper legitimately differ (tests/plan/test_megatron_profile.py names each):
- the fused norms' fp32 statistics, 2 norms × (mean, rstd) × 4·s·b = 16sb per layer (the paper ignores
  them); ÷t with sequence parallelism, like the norms;
- ``--attention flash`` (TE / flash-attn: q, k, v, out, the fp32 logsumexp [b, a, s] and the [2] int64
  RNG state; dropout regenerated in the kernel): the 5as/h term is gone, leaving Korthikanti's
  selective-recompute form 34sbh + 4·a·s·b + 16 B.

Known limitations (NB, not counted): the data loader's [1, 1, s, s] attention mask, which Megatron's
``CheckpointFunction`` keeps under selective recompute when ``create_attention_mask`` is on; TE backends
that keep ``cu_seqlens`` int32 [b+1] (the copy of q, k, v to bshd that ``TEDotProductAttention`` makes with
RoPE fusion is counted: ``Profile.te_contiguous_qkv``); the vocabulary-parallel
embedding's masked ids (tp > 1); ``softmax_in_fp32`` off, ``apply_query_key_layer_scaling`` on,
``--cross-entropy-loss-fusion``, ``--no-rope-fusion`` (unfused RoPE keeps cos and sin per call); RoPE's
table (the reference's cos and sin, 2·s·d each in the activation dtype, where TE's fused RoPE keeps fp32
freqs [s, d]: the same bytes for 16-bit activations); Megatron's own context-parallel ring (``--cp``
follows torch's ring attention); the peak's transients (the reference model's). The MoE layer is
Megatron-core's with the alltoall dispatcher and TE's grouped GEMM and fused permutation
(``megatron_moe``, blocks/moe/megatron.py), its q/k norms TE's fused ones (``blocks.norm.qk_norm_rules``).
"""

from __future__ import annotations

from memplan.blocks.profile import Profile
from memplan.config import Impl, Precision, Setup


def profile(setup: Setup) -> Profile:
    """Megatron-core with Megatron-LM's default fusions (``masked_softmax_fusion``, ``bias_gelu_fusion`` /
    ``bias_swiglu_fusion``, ``bias_dropout_fusion``, ``apply_rope_fusion``) and Apex / TE norms; the same
    for every model."""
    return Profile(
        impl=Impl.MEGATRON,
        fused_norm=True,
        fused_causal_softmax=True,
        qkv_views=True,
        fused_swiglu=True,
        fused_rope=True,
        flash_rng_int64=True,
        checkpoint_reruns_all=True,
        vocab_parallel_loss=True,
        te_contiguous_qkv=True,
        frees_stage_outputs=True,
        rope_cached_per_chunk=True,
        megatron_moe=True,
    )


def main_grad_bytes(setup: Setup) -> int | None:
    """Bytes of one element of Megatron's gradient buffer (``main_grad``), which autograd's weight gradients
    accumulate into and data parallelism reduces; None under other implementations.

    megatron/core/distributed/param_and_grad_buffer.py: ``grad_dtype = torch.float if
    accumulate_allreduce_grads_in_fp32 else param.dtype``; megatron/training/arguments.py, for ``--bf16``:
    "bfloat16 requires gradient accumulation and all-reduce to be done in fp32" — it sets
    ``accumulate_allreduce_grads_in_fp32 = True`` unless ``--grad-reduce-in-bf16``; for ``--fp16`` it stays
    off (fp16 gradients). ``--reduce-dtype`` chooses it (fp32: ``--accumulate-allreduce-grads-in-fp32``, bf16:
    ``--grad-reduce-in-bf16``); by default 4 bytes under the bf16 and fp32 recipes, 2 under fp16-mixed."""
    if setup.impl.impl is not Impl.MEGATRON:
        return None
    chosen = setup.strategy.reduce_dtype
    if chosen is not None:
        return chosen.bytes
    return 2 if setup.training.precision is Precision.FP16_MIXED else 4
