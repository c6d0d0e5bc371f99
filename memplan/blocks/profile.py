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
    matmul_copies_views: bool = False
    """transformers' eager core multiplies [b, a, s, d] views of a batch-first [b, s, ·] buffer with
    ``torch.matmul``, whose reshape to [b·a, s, d] copies a view when b > 1 (a view when b = 1)."""
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
    te_contiguous_qkv: bool = False
    """Megatron-core's ``TEDotProductAttention.forward`` (megatron/core/extensions/transformer_engine.py,
    Transformer Engine the default ``--transformer-impl``) with ``apply_rope_fusion`` (on unless
    ``--no-rope-fusion``) runs TE in ``bshd`` and first makes ``[x.transpose(0, 1).contiguous() for x in
    (query, key, value)]`` ("WAR for peak memory usage", Megatron-LM MR 2388): v, a view of W_QKV's output,
    becomes its own [b, s, kv, d] copy, so the attention keeps no view of that buffer (q and k are RoPE's
    new tensors already). Read with RoPE and the flash core (``attention.qkv_view_rules``)."""
    frees_stage_outputs: bool = False
    """Megatron-core's pipeline schedules (``deallocate_pipeline_outputs``, on in Megatron-LM's arguments):
    ``deallocate_output_tensor`` sets a sent stage output's ``.data`` to ``torch.empty([])`` (a 0-dim
    tensor) and its backward runs through ``custom_backward``; received tensors are fresh per
    micro-batch, the first layer's fused norm keeps that very storage. Off: torch's pipelining
    (``PipelineStage``: ``fwd_cache`` keeps the whole output until its backward; one receive buffer per
    micro-batch and direction, kept): ``strategies.pipeline_parallel.boundary_tensors``."""
    stage_outputs_logits: bool = False
    """The last pipeline stage's forward ends with the lm head and the schedule's ``loss_fn`` computes the
    loss: torchtitan's ``pipeline_llm`` (``_split_module`` keeps ``norm`` and ``lm_head`` on the last stage,
    ``_build_pipeline_schedule`` passes the trainer's loss as ``loss_fn``), so torch's ``fwd_cache`` holds
    the [b, s, v] logits until that micro-batch's backward (``boundary_tensors``' ``pp.logits``)."""
    rope_cached_per_chunk: bool = False
    """Megatron-core's ``RotaryEmbedding.forward`` is ``functools.lru_cache(maxsize=32)``-decorated
    (megatron/core/models/common/embeddings/rotary_pos_embedding.py): each model chunk's module makes its
    table once and hands the same storage to every micro-batch's forward — one table per chunk, not one per
    forward in flight."""
    fused_rope: bool = False
    """Megatron-core's ``apply_rope_fusion`` (on unless ``--no-rope-fusion``): Transformer Engine's
    ``fused_apply_rotary_pos_emb`` rotates q and k in one kernel each, reading the tensor once and writing
    it once (2e an element) and its backward the same on the gradient — not the eager op list of
    ``rotate_half`` (``time.elementwise``)."""
    fused_swiglu: bool = False
    """Megatron-core ``bias_swiglu_impl`` (``SwiGLUFunction``, ``bias_swiglu_fusion`` on by default):
    ``save_for_backward(input)`` keeps W_fc1's fused [·, 2f] output only, not silu(g) nor the chunks."""
    flash_rng_int64: bool = False
    """flash-attn's ``mha_fwd`` (``flash_attn_interface.FlashAttnFunc``, TE's flash backend): ``rng_state``
    is a [2] int64 (16 B), saved with or without dropout, where torch's SDPA keeps a [2] and a [] uint64."""
    checkpoint_reruns_all: bool = False
    """The checkpoint re-runs its whole function in backward, without torch's early stop (which ends the
    re-run once the last saved tensor is rebuilt, ``set_checkpoint_early_stop``): Megatron-core's
    ``tensor_parallel.checkpoint`` (``CheckpointFunction``, an ``autograd.Function``: full recompute re-runs
    every matmul of the layer, selective recompute (``core_attention`` under
    ``_checkpointed_attention_forward``) both QKᵀ and P·V); torchtitan's ``FullAC``
    (distributed/activation_checkpoint.py: ``checkpoint_wrapper(..., early_stop=False)``), the MLP's down
    projection included."""
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
    router_topk_softmax: bool = False
    """gpt-oss's router (``GptOssTopKRouter.forward``): top-k of the biased logits, then a softmax over
    those k in the activation dtype: it keeps the [T, k] softmax output and the top-k indices, no [T, E]
    fp32 probabilities."""
    sparsemixer_router: bool = False
    """PhiMoE's router (``sparsemixer`` in ``modeling_phimoe.py``, training mode): two rounds, each
    ``masked_fill`` of the logits by a no-grad threshold mask (keeps the bool mask [T, E]), a softmax in
    the activation dtype (keeps its output [T, E]), ``gather`` of the Gumbel-sampled expert (keeps the
    index [T, 1] int64) and ``PhimoeMultiplier.apply``, whose ``ctx.save_for_backward(multiplier,
    selected_experts, masked_gates)`` keeps the gathered [T, 1] and the same index and softmax (no new
    storage); the second round's ``torch.scatter`` of -inf at the first choice keeps that index too. No
    top-k, no fp32 probabilities: the k = 2 weights are ``torch.concat`` of the two multipliers."""
    rope_half_table: bool = False
    """gpt-oss's rotary embedding (``GptOssRotaryEmbedding``, ``_apply_rotary_emb``) holds cos and sin as
    [s, d/2] (first and second halves rotated by one table), not [s, d]."""
    deepseek_router: bool = False
    """DeepSeek's routers (``DeepseekV2TopkRouter`` / ``DeepseekV3TopkRouter``): ``F.linear`` on
    ``hidden_states.type(float32)`` keeps an fp32 copy of the MLP input [T, h] (16-bit A); softmax (V2) or
    sigmoid (V3, ``MoEConfig.scoring``) scores [T, E] fp32; group-limited routing (``MoEConfig.groups``)
    keeps the per-group max (V2) or top-2 (V3) indices, the chosen groups' indices and the bool mask of
    ``masked_fill``; V2's code never renormalises (``norm_topk_prob`` unread), V3's divides in fp32."""
    rope_complex_table: bool = False
    """DeepSeek-V2's rotary embedding (``DeepseekV2RotaryEmbedding``, ``apply_rotary_emb``): one complex64
    ``freqs_cis`` [s, d/2] per forward; ``view_as_complex(q.float()) * freqs_cis`` keeps it (q needs no
    saving: the table needs no gradient)."""
    routing_weights_fp32: bool = False
    """Mixtral's router (``MixtralTopKRouter.forward``) returns its fp32 top-k weights uncast:
    ``proj_out * sample_weights_g.unsqueeze(-1)`` keeps the slots' weights [S, 1] in fp32."""
    megatron_moe: bool = False
    """Megatron-core's ``MoELayer`` (alltoall dispatcher, TE's grouped GEMM and fused permutation): its
    router, dispatch, experts and combine keep what ``blocks.moe.megatron`` lists, not the reference MoE's."""
    checkpoints_alone: bool = False
    """``--checkpointing every-K`` is transformers' ``every_n_layers`` (modeling_utils
    ``_set_gradient_checkpointing``: ``layer_index % every_n_layers == 0``): every K-th layer is
    checkpointed alone and the others keep all they save — not K-layer segments re-run whole."""
    hidden_dropout: bool = True
    """The code applies ``resid_dropout`` after attention and the MLP and ``embd_dropout`` after the
    embedding; transformers' Llama-style decoder layers have neither (only ``attention_dropout``), so
    ``--dropout`` reaches the attention probabilities only."""
    eager_fp32_softmax: bool = False
    """The eager core's ``softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)``
    (``eager_attention_forward``): Softmax keeps its fp32 output [b, a, s, s], and P·V the 16-bit copy."""
    additive_mask: bool = False
    """The eager core adds a [b, 1, s, s] mask made once per forward (``masking_utils.eager_mask``: 0 or
    the dtype's min, in the activation dtype) — ``attn_weights + attention_mask`` keeps nothing, where the
    reference's ``masked_fill`` keeps a bool [s, s] mask."""
    cpu_dropout_noise: bool = False
    """``F.dropout`` is the fused ``native_dropout`` (a bool mask) only on CUDA; on CPU ``at::dropout`` runs
    ``_dropout_impl``: ``input · noise`` with noise = bernoulli(1−p)/(1−p) in the input's dtype — the Mul
    keeps the noise, not a mask."""
    sdpa_dispatch: bool = False
    """Attention goes through ``F.scaled_dot_product_attention``'s dispatcher (integrations/
    sdpa_attention.py), with ``dropout_p`` in training. torch's CPU flash kernel takes no dropout
    (sdp_utils_cpp.cpp ``check_for_dropout``): on CPU with p > 0 SDPA runs
    ``_scaled_dot_product_attention_math``, which upcasts 16-bit q, k, v to fp32, repeats k and v to a
    heads (``enable_gqa``), scales q and k by √scale each, and keeps q, k, the fp32 softmax, the dropout's
    noise, the dropped probabilities and v — eager's FLOPs, nothing recomputed."""
    window_mask: bool = False
    """The code honours ``ModelConfig.sliding_window`` with a mask (Mistral, Qwen2, Qwen3:
    ``create_sliding_window_causal_mask``): at s ≥ W ``masking_utils._ignore_causal_mask_sdpa`` cannot
    skip it (``kv_length >= local_attention_size``) and SDPA gets an explicit bool [b, 1, s, s] mask; with
    a mask ``sdpa_attention_forward`` repeats k and v to a heads (``use_gqa_in_sdpa`` needs none), and the
    CPU flash kernel keeps the mask converted to the query's dtype, per layer. NB: on CUDA a masked SDPA
    runs the memory-efficient kernel (its own logsumexp padding and RNG state): estimated as the CPU
    flash kernel's saves, not checked (measure_hf runs CPU kernels)."""
    sdpa_mask_always: bool = False
    """Falcon's ``FalconModel.forward`` calls ``create_causal_mask(..., allow_is_causal_skip=False)``
    ("Always materialize the mask so alibi can be added"): SDPA always gets an explicit bool [b, 1, s, s]
    mask, with ``window_mask``'s consequences (the CPU flash kernel's converted mask per layer, k and v
    repeated under GQA, the mask kept by a checkpoint)."""
    embedding_multiplied: bool = False
    """Granite's ``inputs_embeds * self.embedding_multiplier``: layer 0's input is a new tensor, not the
    embedding's output (``head_moments.hooked_embedding_held``)."""
    checkpoint_keeps_mask: bool = False
    """``GradientCheckpointingLayer`` checkpoints ``partial(forward, self, **kwargs)``: the attention mask
    bound in the partial (one storage for every layer) stays alive until backward, with the rotary
    cos/sin the reference keeps anyway."""
    rms_norm_fp32_product: bool = False
    """torch's ``F.rms_norm`` (``nn.RMSNorm``; ``aten::rms_norm`` is CompositeImplicitAutograd, no fused CPU
    kernel: ``rms_norm_symint`` in aten/src/ATen/native/layer_norm.cpp) multiplies x32·rstd by the weight
    in fp32 and casts the product back (``type_as``): the mul with the weight keeps the normalised x in
    fp32, not in the activation dtype (2·b·s·h B more per norm in bf16)."""
    torch_rms_norm: bool = False
    """The code's RMSNorm is torch's ``nn.RMSNorm`` (``F.rms_norm``), which ``rms_norm_symint``
    (aten/src/ATen/native/layer_norm.cpp) sends to ``aten._fused_rms_norm`` unless the weight's dtype is
    not the input's: on CPU that op is its composite (the saves above, ``rms_norm_fp32_product``), on CUDA
    a kernel whose autograd node (``FusedRmsNormBackward0``: ``_saved_input``, ``_saved_weight``,
    ``_saved_result1``) keeps the input as it comes and the fp32 rstd, no fp32 copy and no normalised x
    (``blocks.norm.cuda_fused_rms_norm``)."""
    compiled_block: bool = False
    """Each transformer block under ``torch.compile`` (torchtitan's ``apply_compile``: one
    ``torch.compile(block)`` a layer; the embedding, final norm, head and loss stay eager). AOTAutograd's
    ``min_cut_rematerialization_partition`` (torch/_functorch/partitioners.py) chooses what the compiled
    forward returns for backward: the cheapest cut that lets backward recompute the element-wise ops
    (``default_recomputable_ops``). Measured on the reference block under fake tensors
    (``measure.compiled``; Llama 2/3 and Qwen3 shapes): each RMSNorm keeps its input in the activation
    dtype (the layer input; before the MLP, W_O's output, re-added to it) and the fp32 rstd — the fp32
    upcast and the normalised x are recomputed; SwiGLU keeps gate, up and their product, not silu(g); the
    rest as eager (W_Q/W_K/W_V's input w·n, q and k after RoPE, v, the flash output and lse)."""
    op_selective_checkpoint: bool = False
    """``--checkpointing selective`` is torchtitan's ``SelectiveAC`` (distributed/activation_checkpoint.py):
    each block under ``checkpoint_wrapper`` with a per-op policy (``create_selective_checkpoint_contexts``)
    that caches the outputs of ``_get_default_save_ops()`` (``aten.mm`` among the partitioner's
    ``compute_intensive_ops``, CUDA's SDPA ops, the comm ops) except every second mm of the block, and
    recomputes the rest (``strategies.checkpointing.op_selective_rules``), not the attention core alone."""
    vocab_parallel_embedding_mask: bool = False
    """torchtitan's ``Embedding.forward`` under TP (models/common/embedding.py): the rank looks up its v/t
    rows and zeroes the other ranks' tokens with ``out * mask.unsqueeze(-1).to(out.dtype)``: the Mul keeps
    the [b, s, 1] mask in the activation dtype (the whole sequence: the embedding's input is replicated)."""
    loss_parallel_function: bool = False
    """torchtitan's ``_LossParallelCrossEntropy`` (components/loss.py) under TP:
    ``ctx.save_for_backward(log_probs, labels_1d)`` keeps the fp32 log-probs [T, v/t] and the int64 labels,
    and no ``nll_loss`` normaliser (its backward is written out, no autograd ops)."""
    sp_module_gather: bool = False
    """torchtitan's sequence-parallel plan (models/common/decoder_sharding.py): the attention's and the
    FFN's ``ShardingConfig`` redistribute x from the sequence shard to ``Replicate`` at the module
    boundary (``in_dst_shardings``: one all-gather), and the final norm's ``out_dst_shardings`` is
    ``Replicate`` before the lm head: W_QKV, W1 and W3 (one storage), and the lm head keep the gathered
    [T, h] (``Role.LINEAR_INPUT`` stays whole), where Megatron keeps the s/t shard and gathers again in
    backward (Korthikanti §4.2.3)."""
    fsdp2_dim0_shards: bool = False
    """FSDP2's ``fully_shard`` (torchtitan's ``apply_fsdp_to_decoder``) shards every parameter on its own
    along dim 0, padded to a multiple of the shard count (``FSDPParam._init_sharded_param``:
    ``torch.chunk`` then ``padded_sharded_param_size`` = the first chunk's): a rank holds Σ ⌈dim0/Nd⌉·rest
    elements (``blocks.torchtitan.fsdp2_shard_elements``), not DeepSpeed's ⌈Ψ/Nd⌉ of one flat buffer."""
    rope_cache_per_layer: bool = False
    """torchtitan's ``ComplexRoPE`` (models/common/rope.py): every attention builds its own complex64 cache
    [max_seq_len, d/2] (a buffer, ``torch.polar``) and ``apply_rotary_emb`` multiplies the complex q and k
    by a view of it: the mul keeps the cache, one per layer, and no shared cos/sin tables exist."""
    loss_over_token_count: bool = False
    """torchtitan's ``CrossEntropyLoss`` (components/loss.py) sums the loss and divides it by the trainer's
    ``global_valid_tokens``, an int64 scalar tensor: the division keeps it (8 B)."""
    repeat_kv_view: bool = False
    """``repeat_kv`` is ``expand`` + ``reshape``: a view of the kv-head k and v when kv = 1 (MQA: the merged
    dimension has size 1), a copy to a heads otherwise; the eager matmuls keep what it returns."""
    norm_fp32_affine: bool = False
    """Gemma's RMSNorm: ``(x32·rstd) * (1.0 + weight.float())`` then ``type_as(x)``: the product keeps the
    normalised x in fp32 [b, s, h] (not the 16-bit cast) and the fp32 (1 + w) [h] of each norm."""
    embed_scale_tensor: bool = False
    """Gemma's ``hidden_states * torch.tensor(hidden_size**0.5, dtype=hidden_states.dtype)``: the mul keeps
    the 0-dim normaliser (A bytes) once per forward (the code scales: ``ModelConfig.embed_scale`` is what
    the reference model does)."""
    rope_fp32_interleaved: bool = False
    """Cohere's ``apply_rotary_pos_emb``: ``q.float()``, ``k.float()``, then ``rotate_half`` on the even and
    odd dims (slices, ``stack``, ``flatten``) and ``.to(dtype)``: its backward upcasts q's and k's
    gradients to fp32 and k's ``rotate_half`` backward makes two ``slice_backward`` [T, kv·d] fp32 and
    their sum (``analytic.moments.rotary_backward``)."""
    rope_tables_per_layer: bool = False
    """GLM's ``apply_rotary_pos_emb`` interleaves the tables on every call (``cos[..., : rot // 2]
    .repeat_interleave(2, dim=-1)``): q_rot·cos and k_rot·cos keep that layer's own [s, rot] cos and sin,
    and the model's shared tables are kept only by a checkpoint (the layer's ``position_embeddings``)."""
    rotary_cat: bool = False
    """GPT-NeoX's, StableLM's and GLM's attention rotate the first ``rotary_ndims`` of each head and
    ``torch.cat((query_rot, query_pass), dim=-1)`` them: q is a new contiguous head-major [b, a, s, d],
    so SDPA's output is laid out head-major and ``transpose(1, 2).contiguous()`` copies it
    (``attn.kernel_out``)."""
    mlp_dropout_only: bool = False
    """StableLM's only hidden dropout is ``self.dropout(mlp_output)`` (``nn.Dropout(hidden_dropout)`` after
    the MLP, ``StableLmDecoderLayer.forward``): none after the attention nor after the embedding."""
    q_input_gradient_top: bool = False
    """StableLM's attention: separate ``q_proj``, ``k_proj``, ``v_proj`` (with biases) on the output of one
    ``nn.LayerNorm`` (``native_layer_norm``, whose backward holds only dY and dX [T, h]): W_Q's backward,
    the last of the three (autograd runs v's, k's, then q's), tops the layer, above the norm's backward
    (``analytic.moments.qkv_backward.q_input_gradient``).
    NB: set for StableLM and PhiMoE only, where it is measured; other LayerNorm layers with separate
    projections (StarCoder2's, Cohere's) are not switched to it here."""
    layernorm_python: bool = False
    """Cohere's ``CohereLayerNorm.forward``, LayerNorm in Python ops in fp32 (no ``native_layer_norm``):
    ``(x32 - mean).pow(2)`` keeps x − mean, ``(x32 - mean) * rsqrt(...)`` a second x − mean and rstd,
    ``self.weight.to(float32) * x`` the fp32 normalised x and the fp32 weight copy
    (``norm.python_layernorm_rules``)."""
    rope_fp32_tables: bool = False
    """OLMo-2's ``Olmo2RotaryEmbedding.forward`` returns cos and sin in fp32 (no ``.to(x.dtype)``) and
    ``apply_rotary_pos_emb`` multiplies in fp32 before ``q_embed.to(q_type)``: the muls keep fp32 tables
    [s, d] (4·s·d B each, not 2)."""
    rope_tables_freed_by_layer0: bool = False
    """transformers' model makes the rotary tables once per forward (``self.rotary_emb(hidden_states,
    position_ids)``: cos and sin, no module keeps them) and hands them to every layer as
    ``position_embeddings``; only the layers' rotary muls keep them (``q * cos``, ``rotate_half(q) * sin``
    and k's), so layer 0's rotary backward, their last user, frees them before its projections' and its
    norm's backward (``attention.constants.tables_freed_by_layer0``). Not under checkpointing: the
    checkpointed layer's ``partial`` keeps ``position_embeddings`` to its backward's end."""
    rope_per_layer_type: bool = False
    """Gemma-3's ``Gemma3TextModel.forward``: one rotary table pair per layer type present (``for
    layer_type in set(layer_types)``: full and sliding layers, each with its base), every pair kept."""
    fused_qkv: bool = False
    """Phi-3's ``qkv_proj``: q, k, v are slices of one [b, s, (a + 2·kv)·d] output. A slice is not dense, so
    RoPE's output is laid out head-major [b, a, s, d] and SDPA's output follows the query's layout:
    ``attn_output.reshape(...).contiguous()`` copies it, and the kernel's output and W_O's input are two
    [b, s, a·d] storages (eager's P·V output is a local, copied either way)."""
    fused_gate_up: bool = False
    """Phi-3's ``gate_up_proj``: gate and up are the two ``chunk``s of one [b, s, 2f] output; the
    activation's input and the product's operand are views of it, kept as one storage."""


REFERENCE = Profile()
COMPILED_REFERENCE = Profile(compiled_block=True)
"""The reference model with every block under ``torch.compile`` (``--compile``; ``compile_modelled``)."""
