"""The optimizer step's temporaries by implementation (``--optimizer-impl``), and bitsandbytes' 8-bit states.

What one rank's step allocates above the states, at its peak, for the tensors it steps in order
(``step_tensors``: the reference model's ``parameters()`` order, each a whole parameter or under ZeRO its
dim-0 shard as ``analytic.step.largest_step_tensor`` cuts it), e bytes per element of the stepped dtype:

- reference: memplan's own optimizer (``analytic.step.optimizer_transient``), unchanged.
- for-loop, torch/optim/adam.py ``_single_tensor_adam``: per parameter i,
  ``denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)``: ``sqrt()`` and the quotient are two
  new [N_i] tensors alive at once, while the previous iteration's ``denom`` [N_{i-1}] is still bound (the
  name is rebound only after the right side is built); ``lerp_``, ``mul_``, ``addcmul_``, ``addcdiv_``
  and AdamW's ``param.mul_(1 - lr·wd)`` are in place: e · max_i (N_{i-1} + 2·N_i). Two equal tensors in a
  row give three copies of one tensor (the reference model registers embed then head, both [v, h]).
- foreach, ``_multi_tensor_adam``: ``torch._foreach_lerp_`` / ``_foreach_mul_`` / ``_foreach_addcmul_``
  / ``_foreach_div_`` / ``_foreach_add_`` / ``_foreach_addcdiv_`` are in place; only
  ``exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)`` allocates, one [N_i] per parameter of
  the (device, dtype) group: e · Σ N_i (one group: every parameter has the recipe's dtype).
- fused, ``torch._fused_adamw_``: one kernel updating param, exp_avg, exp_avg_sq in place: 0.
- bitsandbytes ``AdamW8bit`` on CUDA: ``optimizer_update_8bit_blockwise`` dequantises, updates and
  requantises each block in registers (bitsandbytes/backends/cuda/ops.py): 0.
- Under a mixed recipe the optimizer steps the fp32 master copy (e = 4): torch.optim reads ``p.grad`` in
  p's dtype, so the master's fp32 gradient comes from the training framework (DeepSpeed's flat partition,
  FSDP2's fp32 reduce dtype, apex's master grads).

Known limitations:
- The order matters to the for-loop: the reference model registers embed then head (e·3·v·h when untied);
  transformers registers the lm head after the final norm (e·(2·v·h + h)). ``parameter_shapes`` follows
  transformers' order for Llama, Mistral, Qwen2 and GPT-2 under ``--impl hf``.
- NB: the other families under ``--impl hf`` (Phi-3, GPT-NeoX, MoE, Gemma, Gemma-2/3, Qwen3) and torchtitan /
  Megatron step in the reference model's order here.
- NB: the fp32 gradients of the master copy under a mixed recipe are the framework's, not counted here
  (the reference optimizer upcasts one tensor at a time; torch.optim cannot).
- LoRA / QLoRA / --freeze: every implementation steps the trainable tensors only (``trainable_shapes``).
- NB: a pipeline stage steps its own layers but is counted with the embedding and head too (the list is
  the rank's model cut to the stage's layers): an upper bound off the first and last stages.
- NB: bitsandbytes on CPU runs a Python fallback (backends/cpu/ops.py) with temporaries of its own, inside
  one custom op, where memplan's tracker cannot see them: not modelled (its CUDA kernel's 0 is used).
- NB: torch.optim's per-parameter ``step`` counter (a fp32 scalar; on the device only with fused or
  capturable) is not counted in the states.
"""

from __future__ import annotations

import math
from itertools import pairwise

from memplan.analytic.states import shard
from memplan.analytic.step import largest_step_tensor, optimizer_transient
from memplan.config import (
    Device,
    Family,
    Impl,
    MlpType,
    ModelConfig,
    NormType,
    Optimizer,
    OptimizerImpl,
    PositionType,
    Setup,
    ZeroStage,
)
from memplan.config.finetune import Target
from memplan.config.trainable import (
    adapted,
    adapters,
    base_trains,
    embedding_trains,
    final_norm_trains,
    head_trains,
)

Shape = tuple[int, ...]

BNB_BLOCK = 256
"""Elements per absmax block of bitsandbytes' 8-bit states (optim/optimizer.py ``init_state``:
``blocksize = 256``; ``absmax1`` / ``absmax2`` fp32 [⌈n/256⌉])."""
BNB_MIN_8BIT = 4096
"""bitsandbytes' ``min_8bit_size``: a parameter of fewer elements keeps fp32 state1 / state2."""
BNB_QMAPS = 2 * 256 * 4
"""The two fp32 [256] quantisation maps (``name2qmap['dynamic']`` / ``['udynamic']``), one pair shared
by every parameter of the optimizer."""


def optimizer_impl(setup: Setup) -> OptimizerImpl:
    """The implementation that steps: the user's, else Megatron's fused Adam under ``--impl megatron`` and
    torch's fused AdamW under ``--impl hf`` and ``torchtitan`` (transformers' default
    ``adamw_torch_fused``, torchtitan's ``implementation = "fused"``; AdamW, full training), the reference
    optimizer under ``--impl reference``
    (and for optimizers torch.optim does not model here), bitsandbytes for adamw-8bit, and for AdamW as
    torch picks (optim/optimizer.py ``_default_to_fused_or_foreach(..., use_fused=False)``: foreach when
    every parameter is on a foreach device — cuda, not cpu; never fused by default). Fine-tuning (LoRA,
    frozen parts) defaults to the reference optimizer; an explicit implementation steps the trainable
    tensors only (``trainable_shapes``: the optimizer is built over the ``requires_grad`` parameters, as
    transformers' Trainer builds it), so a frozen tensor has no state and no step."""
    t = setup.training
    if t.optimizer_impl is not None:
        return t.optimizer_impl
    full_adamw = t.optimizer is Optimizer.ADAMW and setup.finetune.trains_everything
    if setup.impl.impl is Impl.MEGATRON and full_adamw:
        # megatron/core/optimizer/__init__.py: ``from transformer_engine.pytorch.optimizers import FusedAdam
        # as Adam``, else ``from apex.optimizers import FusedAdam as Adam`` (torch's AdamW only when neither
        # is installed): one multi-tensor kernel over master, gradient and states, no temporaries
        return OptimizerImpl.FUSED
    if setup.impl.impl in (Impl.HF, Impl.TORCHTITAN) and full_adamw:
        # transformers' TrainingArguments: ``default_optim = "adamw_torch_fused"`` with torch ≥ 2.8
        # (training_args.py, 5.x; "adamw_torch" before); torchtitan 0.3.0's optimizer config:
        # ``implementation ... = "fused"`` (components/optimizer/optimizer.py; its 2024 trainer built foreach
        # unless ``--optimizer.fused``): torch.optim.AdamW(fused=True)
        return OptimizerImpl.FUSED
    if (
        setup.impl.impl is Impl.REFERENCE
        or t.optimizer not in (Optimizer.ADAMW, Optimizer.ADAMW_8BIT)
        or not setup.finetune.trains_everything
    ):
        return OptimizerImpl.REFERENCE
    if t.optimizer is Optimizer.ADAMW_8BIT:
        return OptimizerImpl.BITSANDBYTES
    return OptimizerImpl.FOREACH if setup.device is Device.CUDA else OptimizerImpl.FOR_LOOP


def _mlp_shapes(m: ModelConfig, width: int) -> list[Shape]:
    """measure/reference/moe.py ``Mlp``: gate (SwiGLU), up [width, h], down [h, width], each with its bias."""
    h, bias = m.hidden_size, m.mlp_bias
    linears = [(width, h)] * (2 if m.mlp is MlpType.SWIGLU else 1) + [(h, width)]
    return [s for rows, cols in linears for s in [(rows, cols), *([(rows,)] if bias else [])]]


def _linear(rows: int, cols: int, bias: bool) -> list[Shape]:
    """An nn.Linear's weight [out, in] and, after it, its bias [out]."""
    return [(rows, cols), *([(rows,)] if bias else [])]


def _attention_shapes(m: ModelConfig) -> list[Shape]:
    """q [a·d, h], k and v [kv·d, h] (biases with qkv_bias), o [h, a·d] (bias with out_bias)."""
    h = m.hidden_size
    qkv = [(m.q_width, h), (m.kv_width, h), (m.kv_width, h)]
    return [s for rows, cols in qkv for s in _linear(rows, cols, m.qkv_bias)] + _linear(
        h, m.q_width, m.out_bias
    )


def _norm_shapes(m: ModelConfig) -> list[Shape]:
    """A norm's weight [h] (and LayerNorm's bias [h])."""
    return [(m.hidden_size,)] * (2 if m.norm is NormType.LAYERNORM else 1)


def _layer_shapes(m: ModelConfig) -> list[Shape]:
    """measure/reference/model.py ``Layer``: attn_norm, mlp_norm, q, k, v, o, then the MLP (dense, or router,
    experts, shared experts and their gate)."""
    shapes = [*_norm_shapes(m), *_norm_shapes(m), *_attention_shapes(m)]
    if m.moe is None:
        return shapes + _mlp_shapes(m, m.ffn)
    moe, width = m.moe, m.moe.shared_width(m)
    shapes.append((moe.experts, m.hidden_size))
    shapes += _mlp_shapes(m, m.ffn) * moe.experts
    shapes += _mlp_shapes(m, width) if width else []
    return shapes + ([(1, m.hidden_size)] if moe.shared_gate else [])


def _reference_shapes(m: ModelConfig) -> list[Shape]:
    """measure/reference/model.py ``Reference``: nn.Module yields a module's own parameters before its
    submodules',
    so embed [v, h], learned positions [P, h] and an untied head [v, h] come first, then the layers and
    the final norm."""
    h = m.hidden_size
    shapes: list[Shape] = [(m.vocab_size, h)]
    shapes += [(m.max_positions, h)] if m.position is PositionType.LEARNED else []
    shapes += [] if m.tied_embeddings else [(m.vocab_size, h)]
    return shapes + _layer_shapes(m) * m.num_layers + _norm_shapes(m)


def _hf_llama_shapes(m: ModelConfig) -> list[Shape]:
    """transformers' ``LlamaForCausalLM`` layout (modeling_llama.py; Mistral and Qwen2 the same):
    model.embed_tokens, per ``LlamaDecoderLayer`` self_attn (q, k, v, o with their biases) then mlp (gate,
    up, down) then input_layernorm and post_attention_layernorm, model.norm, then an untied lm_head —
    after the final norm."""
    layer = [*_attention_shapes(m), *_mlp_shapes(m, m.ffn), *_norm_shapes(m), *_norm_shapes(m)]
    head = [] if m.tied_embeddings else [(m.vocab_size, m.hidden_size)]
    return [(m.vocab_size, m.hidden_size), *layer * m.num_layers, *_norm_shapes(m), *head]


def _hf_gpt2_shapes(m: ModelConfig) -> list[Shape]:
    """transformers' ``GPT2LMHeadModel`` (modeling_gpt2.py): wte, wpe, per block ln_1, attn.c_attn,
    attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj, then ln_f; the head is tied to wte. ``Conv1D`` keeps its
    weight [in, out] (the transpose of nn.Linear's), its bias [out] after it."""
    h, f, qkv = m.hidden_size, m.ffn, m.q_width + 2 * m.kv_width
    conv = [(h, qkv), (qkv,), (m.q_width, h), (h,)], [(h, f), (f,), (f, h), (h,)]
    layer = [*_norm_shapes(m), *conv[0], *_norm_shapes(m), *conv[1]]
    return [(m.vocab_size, h), (m.max_positions, h), *layer * m.num_layers, *_norm_shapes(m)]


HF_LAYOUTS = {
    Family.LLAMA: _hf_llama_shapes,
    Family.MISTRAL: _hf_llama_shapes,
    Family.QWEN2: _hf_llama_shapes,
    Family.GPT2: _hf_gpt2_shapes,
}
"""Families whose parameter order ``--impl hf`` follows; the others step in the reference model's order."""


def parameter_shapes(setup: Setup) -> list[Shape]:
    """Every parameter in the order the optimizer steps them (``model.parameters()``): transformers'
    layout under ``--impl hf`` for the families of ``HF_LAYOUTS``, else the reference model's."""
    m = setup.model
    layout = HF_LAYOUTS.get(m.code_family) if setup.impl.impl is Impl.HF else None
    return (layout or _reference_shapes)(m)


def _adapter_shapes(setup: Setup, targets: frozenset[Target]) -> list[Shape]:
    """One layer's LoRA adapters in module order (q, k, v, o, then the MLP's gate, up, down;
    measure/reference/lora.py ``LoraLinear`` and peft's ``lora.Linear`` alike): A [r, in] then B [out, r]
    for each adapter (``config.trainable.adapters``: a fused projection's one under ``--impl hf``).
    NB: Phi-3 registers o_proj before qkv_proj (modeling_phi3.py): only the for-loop's transient reads
    the order."""
    rank = setup.finetune.rank
    return [s for a in adapters(setup, targets) for s in ((rank, a.fan_in), (a.fan_out, rank))]


def _finetune_shapes(setup: Setup) -> list[Shape]:
    """The tensors that train under ``--finetune``/``--freeze``, in the reference model's ``parameters()``
    order (``_reference_shapes`` with the frozen ones dropped and each layer's adapters in place).
    NB: full fine-tuning with frozen parts under ``--impl hf`` steps in this order too (transformers
    registers the lm head last): only the for-loop's transient depends on the order."""
    m = setup.model
    h = m.hidden_size
    shapes: list[Shape] = []
    if embedding_trains(setup):
        shapes.append((m.vocab_size, h))
        shapes += [(m.max_positions, h)] if m.position is PositionType.LEARNED else []
    if not m.tied_embeddings and head_trains(setup):
        shapes.append((m.vocab_size, h))
    for i in range(m.num_layers):
        shapes += _layer_shapes(m) if base_trains(setup, i) else []
        shapes += _adapter_shapes(setup, adapted(setup, i))
    return shapes + (_norm_shapes(m) if final_norm_trains(setup) else [])


def trainable_shapes(setup: Setup) -> list[Shape]:
    """The tensors the optimizer steps, in order: every parameter under full training
    (``parameter_shapes``), else the trainable ones (``_finetune_shapes``)."""
    return parameter_shapes(setup) if setup.finetune.trains_everything else _finetune_shapes(setup)


def step_tensors(setup: Setup) -> list[int]:
    """Elements of each tensor one rank steps, in order: whole trainable parameters, or under ZeRO ≥ 1 over
    dp > 1 the rank's ``torch.chunk`` of each along dim 0 (⌈rows/dp⌉ rows; FSDP2's ``Shard(0)``) — over
    dp × cp under context parallelism, as the states (``Setup.state_shards``: torchtitan's
    ``dp_shard_cp`` mesh)."""
    s = setup.strategy
    shards = setup.state_shards
    sharded = s.zero >= ZeroStage.OPTIMIZER and shards > 1
    return [shard(shape[0], shards, sharded) * math.prod(shape[1:]) for shape in trainable_shapes(setup)]


def for_loop_transient(sizes: list[int], e: int) -> int:
    """``_single_tensor_adam``: e · max_i (N_{i-1} + 2·N_i) (module docstring)."""
    return e * max((prev + 2 * n for prev, n in pairwise([0, *sizes])), default=0)


def foreach_transient(sizes: list[int], e: int) -> int:
    """``_multi_tensor_adam``: ``_foreach_sqrt``'s list, e · Σ N_i (module docstring)."""
    return e * sum(sizes)


def bnb_state_bytes(sizes: list[int]) -> int:
    """bitsandbytes AdamW8bit's states for these tensors (optim/optimizer.py ``Optimizer2State.init_state``):
    n ≥ 4096: uint8 state1 and state2 (2n) + fp32 absmax1 / absmax2 per 256-element block (2·4·⌈n/256⌉);
    smaller: fp32 state1 and state2 (8n); + the two shared fp32 [256] qmaps when any tensor is 8-bit.
    NB: the per-step ``step`` counter is a Python int (no storage)."""
    blocks = sum(2 * n + 8 * -(-n // BNB_BLOCK) for n in sizes if n >= BNB_MIN_8BIT)
    small = sum(8 * n for n in sizes if n < BNB_MIN_8BIT)
    return blocks + small + (BNB_QMAPS if any(n >= BNB_MIN_8BIT for n in sizes) else 0)


def step_transient(setup: Setup) -> int:
    """Bytes the optimizer step allocates above the states at its peak, by implementation."""
    impl = optimizer_impl(setup)
    if impl is OptimizerImpl.REFERENCE:
        # Full training: the largest 2-D weight (``largest_step_tensor``); fine-tuning: the largest tensor
        # that trains — a frozen embedding is never stepped.
        full = setup.finetune.trains_everything
        largest = largest_step_tensor(setup) if full else max(step_tensors(setup), default=0)
        return optimizer_transient(setup, largest)
    sizes = step_tensors(setup)
    e = setup.training.precision.state_bytes  # the stepped dtype: the fp32 master, or the parameters' own
    if impl is OptimizerImpl.FOR_LOOP:
        return for_loop_transient(sizes, e)
    if impl is OptimizerImpl.FOREACH:
        return foreach_transient(sizes, e)
    return 0  # fused, bitsandbytes' CUDA kernel: in place
