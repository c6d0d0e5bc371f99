"""torchtitan's Llama 3 (torchtitan 0.3.0, ``torchtitan/models/llama3`` on ``models/common``) as a profile.

Every fact cites the code that causes it and is checked by running that code under fake tensors
(``memplan.measure.frameworks.titan``, tests/titan/). What torchtitan keeps as memplan's reference model does
(the
fused ``wqkv``'s input, SDPA's q, k, v, out and logsumexp, the SwiGLU's four [b, s, ffn] tensors, the fp32
``cross_entropy`` of ``components/loss.py``) needs no switch.

Context parallel (``--cp``, torchtitan's ``apply_cp_to_forward`` + ``prepare_context_parallel_input``):
the inputs, labels and positions are sharded, not the RoPE caches — each layer keeps the rank's gathered
rows and every layer's whole cache stays a buffer (``blocks.attention.rope.titan_cp_rules``); checked per
tensor against one rank of torchtitan's model (tests/measure/test_titan_context.py).

Known limitations:
- NB: measured with CPU kernels (``trace --impl torchtitan`` runs on CPU), but for the attention: under
  ``--device cuda`` torchtitan's SDPA runs cuDNN's op (its cuDNN-first priority; head dim <= 128:
  ``blocks.attention.titan_cudnn``), measured through that op's meta kernel
  (``measure.frameworks.titan_attention.cudnn_attention``), and ``nn.RMSNorm`` is CUDA's
  ``aten._fused_rms_norm`` kernel (``Profile.torch_rms_norm``: the input and the fp32 rstd), measured
  through torch's own autograd node for that op (``measure.frameworks.titan_norm``).
- NB: torchtitan's ``SelectiveAC`` (``--checkpointing selective``, ``op_selective_checkpoint``): its save
  list holds CUDA's SDPA ops, not the CPU flash kernel, so on CUDA the cuDNN op's outputs are cached too
  and the core is not re-run (``strategies.checkpointing.sdpa_cache_rules``); head dims above 128 are
  refused on CUDA (``config.impl_rules.check_impl``).
FSDP2's mixed precision (``fsdp2_mixed``): torchtitan builds the model in fp32 and shards it with
``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` (torchtitan 0.3.0's
``training.mixed_precision_param`` / ``mixed_precision_reduce`` defaults). FSDP2's sharded parameter is the
fp32 parameter the optimizer steps (torch/distributed/fsdp/_fully_shard/_fsdp_param.py: ``sharded_param``
keeps ``orig_dtype``; ``param_dtype`` applies to the all-gather inputs and the unsharded parameter only),
and ``foreach_reduce`` hands the sharded gradient back in the sharded parameter's dtype (fp32). So under
``--precision bf16-mixed``, ZeRO-2/3 over more than one rank: the weights at rest are the fp32 shards
(4 B/element), no separate master copy, fp32 sharded gradients (4 B/element), AdamW's fp32 states; the
gathered unit and the unsharded gradients autograd makes stay bf16 (the activation dtype).

Known limitations:
- NB: ``--zero 2`` (``reshard_after_forward=False``) holds the weights sharded at rest but gathered from
  each unit's forward to its backward: counted whole in bf16 (the gathered copy), and the peak's forward
  and backward moments add the fp32 shards alive beside them
  (``analytic.fsdp.moments.zero2_shards_beside``); the optimizer step's moment counts the bf16 copy
  (freed by then) in place of the fp32 shards (an upper bound for dp >= 2).
- NB: without FSDP (dp 1, or ``--zero 0``) torchtitan 0.3.0 trains the fp32 model under
  ``torch.autocast`` (``maybe_enable_amp``); memplan keeps the recipe's split there (bf16 weights and
  gradients, fp32 master), and the autocast casts' saves are not modelled.
"""

from __future__ import annotations

import math

from memplan.analytic.states import ModelStates
from memplan.blocks.dtensor_cost import rowwise_weight_grad_whole
from memplan.blocks.profile import Profile
from memplan.config import Fp8Recipe, Impl, ModelConfig, Precision, Setup, ZeroStage

Shapes = list[tuple[int, ...]]


def profile(setup: Setup, compiled: bool = False) -> Profile:
    """torchtitan's Llama 3: ``nn.RMSNorm`` (``F.rms_norm``), the complex rotary cache of each layer and
    ``FullAC``'s re-run without early stop; ``SelectiveAC``'s per-op cache; under TP/SP
    the vocabulary-parallel embedding's mask, the loss-parallel function's saves and the gathered inputs
    of the sequence-parallel plan; the summed loss divided by the valid-token count (its labels are not
    padded: ``cross_entropy_loss`` takes them as they are). ``compiled``: ``apply_compile``'s
    ``torch.compile`` of each block (``Profile.compiled_block``; measured: its partitioner keeps the
    reference block's values, W_O's output in place of the residual sum, and the rotary cache's conjugate,
    the bytes of the eager per-layer cache)."""
    return Profile(
        impl=Impl.TORCHTITAN,
        rms_norm_fp32_product=True,
        torch_rms_norm=True,
        rope_cache_per_layer=True,
        loss_over_token_count=True,
        checkpoint_reruns_all=True,
        op_selective_checkpoint=True,
        vocab_parallel_embedding_mask=True,
        loss_parallel_function=True,
        sp_module_gather=True,
        fsdp2_dim0_shards=True,
        compiled_block=compiled,
        stage_outputs_logits=True,
    )


def param_shapes(m: ModelConfig) -> list[tuple[int, ...]]:
    """The parameters of torchtitan's Llama 3 as one tensor-parallel rank holds them (``m`` is the rank's
    model, ``strategies.tensor_parallel.tp_model``: a/t heads, kv/t groups, f/t, ⌈v/t⌉): the embedding
    [v, h] (vocabulary ``Shard(0)``); per layer the fused ``wqkv`` [(a + 2·kv)·d, h] (colwise: dim 0),
    ``wo`` [h, a·d] (rowwise: dim 1), ``w1`` and ``w3`` [f, h], ``w2`` [h, f], two norms [h]; the final norm
    [h]; the lm head [v, h] unless tied to the embedding."""
    embedding, layer, head = unit_shapes(m)
    return [*embedding, *layer * m.num_layers, *head]


def unit_shapes(m: ModelConfig) -> tuple[Shapes, Shapes, Shapes]:
    """The rank's parameters by FSDP2 unit as torchtitan's ``apply_fsdp_to_decoder`` groups them: the
    embedding, one block, and [norm, lm_head] (the lm head left out when tied: ``param_shapes``)."""
    h, v = m.hidden_size, m.vocab_size
    layer: Shapes = [((m.num_heads + 2 * m.kv_heads) * m.dim, h), (h, m.num_heads * m.dim)]
    layer += [(m.ffn, h), (m.ffn, h)]
    layer += [(h, m.ffn), (h,), (h,)]
    head: Shapes = [(h,)] + ([] if m.tied_embeddings else [(v, h)])
    return [(v, h)], layer, head


def fsdp2_flat_elements(shapes: Shapes, shards: int) -> int:
    """Elements of one FSDP2 unit's flat all-gather output (or reduce-scatter input): every parameter's
    dim 0 padded to a multiple of the shard count, ``shards`` · ⌈dim0/Nd⌉ rows (``_fsdp_param``'s padded
    sharded size × the group's world size)."""
    return sum(-(-shape[0] // shards) * shards * math.prod(shape[1:]) for shape in shapes)


def fsdp2_shard_elements(m: ModelConfig, shards: int, stage: tuple[bool, bool] | None = None) -> int:
    """Elements one FSDP2 rank holds of the rank's parameters (``Profile.fsdp2_dim0_shards``): each
    parameter's dim 0 cut into ``shards`` chunks, every shard padded to the first chunk's ⌈dim0/Nd⌉ rows.
    ``stage``: (first, last) of a pipeline rank whose chunks hold ``m.num_layers`` layers — the embedding
    only on the first, the final norm and lm head only on the last (torchtitan's ``_split_module``)."""
    shapes = param_shapes(m)
    if stage is not None:
        first, last = stage
        head = 1 if m.tied_embeddings else 2  # the final norm, and the lm head unless tied
        shapes = shapes[0 if first else 1 : len(shapes) if last else len(shapes) - head]
    return sum(-(-shape[0] // shards) * math.prod(shape[1:]) for shape in shapes)


FSDP2_MIXED_BYTES = 4
"""Bytes per element of FSDP2's sharded parameter and sharded gradient under torchtitan's mixed precision:
the fp32 model's (``MixedPrecisionPolicy.param_dtype`` casts the all-gather only; ``foreach_reduce``
casts the reduced gradient back to the sharded parameter's ``orig_dtype``)."""


def fsdp2_mixed(setup: Setup) -> bool:
    """FSDP2's mixed precision applies (module docstring): ``--precision fsdp2-mixed`` (any model that
    runs FSDP2: ``config.setup.check_fsdp2_mixed``), or ``--impl torchtitan`` under bf16-mixed (its
    trainer's policy); with ZeRO-2/3 and FSDP2 applied (over dp × cp > 1 ranks: torchtitan's
    ``dp_shard_cp`` mesh, HSDP's replicas included: their fp32 parameters are FSDP2's too)."""
    precision = setup.training.precision
    titan = setup.impl.impl is Impl.TORCHTITAN and precision is Precision.BF16_MIXED
    return (
        (titan or precision is Precision.FSDP2_MIXED)
        and setup.strategy.zero >= ZeroStage.GRADIENTS
        and setup.strategy.dp * setup.parallel.cp > 1
    )


def partial_grad_elements(setup: Setup, layers: int, replicated_ends: int = 0, compiled: bool = False) -> int:
    """Elements by which a torchtitan tensor-parallel rank's unreduced gradients exceed its parameter shards
    under TP without sequence parallelism (``--tp`` > 1, no ``--sp``), for ``layers`` layers of which
    ``replicated_ends`` end a model chunk whose output gradient comes in as a stage boundary's
    ``Replicate()`` (``strategies.pipeline_parallel.replicated_ends``); 0 elsewhere.

    Without SP the residual stream is ``Replicate()`` and a column-parallel linear's input gradient is left
    ``Partial(sum)`` by DTensor (each rank's sum over its own output columns, not yet all-reduced: the
    module boundary declares the forward's placement only), so the gradient reaching a row-parallel
    linear's output is ``Partial``: W_O's always, W2's where the layer's output gradient comes from the next
    layer's norm or the final norm. DTensor then picks the weight gradient's strategy by its own cost
    (``blocks.dtensor_cost.rowwise_weight_grad_whole``): all-gathering the input leaves the gradient
    ``Partial``, the whole [h, a·d] (W_O) or [h, f] (W2) on each rank where the parameter is the
    ``Shard(1)`` [h, a·d/t] or [h, f/t] — (t − 1)/t of it more, until something redistributes it (FSDP2's
    ``_get_grad_inner_tensor`` to the TP placement before its reduce-scatter; the optimizer otherwise) —
    where all-reducing the output gradient would cost more: W_O (a·d = h) at any shape in view, W2 only
    where f is under about 2h. Under SP the norms and the residual stream are ``Shard(1)`` on the sequence
    and the gradients arrive reduce-scattered: shards. Under ``--fp8`` torchao's ``Float8Linear`` (W_O and
    W2: every preset's widths are multiples of 16, the converter's rule) makes the weight gradient in its
    own matmul: the shard, measured. Measured on the fake process group (torch 2.13,
    tests/hf/test_torchtitan_ranks.py, tests/hf/test_torchtitan_vpp.py). ``compiled``: each block under
    ``torch.compile`` without checkpointing, where W2's output gradient is the block output's, which
    AOTAutograd traced with that output's placement (``Replicate``; the ``Partial`` one coming in is
    redistributed to it): W2's weight gradient is the shard, W_O's as eager (measured on the tiny model,
    tests/hf/test_torchtitan_compile_tp.py)."""
    par, t = setup.parallel, setup.parallel.tp
    float8 = setup.impl.fp8 is not Fp8Recipe.NONE
    if setup.impl.impl is not Impl.TORCHTITAN or t == 1 or par.sp or float8 or layers == 0:
        return 0
    m, tr = setup.model, setup.training
    tokens = tr.micro_batch * tr.seq_len // par.cp
    nbytes = tr.precision.activation_dtype.bytes
    h, attn = m.hidden_size, m.num_heads * m.dim
    w_o = h * attn if rowwise_weight_grad_whole(tokens, h, attn, t, nbytes) else 0
    w_2 = h * m.ffn if rowwise_weight_grad_whole(tokens, h, m.ffn, t, nbytes) and not compiled else 0
    return (layers * w_o + (layers - replicated_ends) * w_2) * (t - 1) // t


def fsdp2_mixed_states(states: ModelStates, shard_elements: int, zero: ZeroStage) -> ModelStates:
    """The recipe's states (bf16 weights and gradients, fp32 master) as FSDP2's mixed precision holds them
    on a rank of ``shard_elements``: the fp32 shard is the weights (ZeRO-3; ZeRO-2 keeps the bf16 gathered
    copy counted whole, module NB) and the optimizer's parameter, no master copy, fp32 sharded gradients;
    the optimizer's states unchanged."""
    shard_bytes = shard_elements * FSDP2_MIXED_BYTES
    return states.model_copy(
        update={
            "weights": shard_bytes if zero >= ZeroStage.PARAMETERS else states.weights,
            "gradients": shard_bytes,
            "master_weights": 0,
        }
    )
