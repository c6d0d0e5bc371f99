"""Float8 training under Megatron-core with Transformer Engine (``--impl megatron --fp8 tensorwise|delayed``).

memplan's ``--fp8 tensorwise`` is Megatron-LM's ``--fp8-format hybrid --fp8-recipe tensorwise``:
megatron/core/fp8_utils.py (``get_fp8_context``) builds ``transformer_engine.common.recipe.
Float8CurrentScaling(fp8_format=...)`` for ``Fp8Recipe.tensorwise`` (TE ≥ 2.2) — one scale per tensor,
computed from the tensor being cast, as torchao's tensorwise is. ``--fp8 delayed`` is ``--fp8-recipe
delayed``, Megatron's default (megatron/training/arguments.py ``_add_transformer_engine_args``:
``--fp8-recipe`` default 'delayed'), TE's ``DelayedScaling(margin, fp8_format, amax_compute_algo,
amax_history_len, ...)`` (``TEDelayedScaling``): one scale per tensor too, taken from an amax history
(below). ``--fp8 mxfp8`` is ``--fp8-recipe mxfp8``, TE's ``MXFP8BlockScaling(fp8_format=...)``: one E8M0
scale per 32 elements (blocks/mxfp8.py), Blackwell only (TE's ``check_mxfp8_support``: compute capability
10.x; ``time.fp8.peak`` refuses other GPUs). ``blockwise`` (1×128 / 128×128 blocks) is refused; TE has no
rowwise recipe, so ``--impl megatron --fp8 rowwise`` is refused too (``config.impl_rules.check_fp8``).

Both per-tensor recipes quantize into the same ``Float8Tensor`` (``Float8CurrentScalingQuantizer`` /
``Float8Quantizer``, tensor/float8_tensor.py), and ``_LayerNormLinear`` / ``_Linear`` treat them alike
("vanilla FP8": only ``MXFP8TensorStorage`` / ``Float8BlockwiseQTensorStorage`` change what is kept), so
the saved activations and the weight cache below are the same under either; they differ in the
quantizers' state and the per-step amax reduction. MXFP8 differs in what a float8 copy carries and in one
rule: each ``MXFP8Tensor`` has a [M/32, K] grid of 1-byte scales per usage instead of one fp32 scale
(``mxfp8.scale_shape``), its columnwise data can be all-gathered, so a column-parallel linear under
sequence parallelism keeps the columnwise copy only (``isinstance(ln_out, (MXFP8TensorStorage, ...)) or
not ctx.ln_out_needs_gather`` → ``update_usage(rowwise_usage=False)``), and it has no quantizer state.

Megatron's TE layer spec (``get_gpt_layer_with_transformer_engine_spec``) runs four TE modules a layer:
``TELayerNormColumnParallelLinear`` (TE ``LayerNormLinear``) for W_QKV and for W_fc1, ``TERowParallelLinear``
(TE ``Linear``) for W_O and W_fc2; the attention core is ``TEDotProductAttention`` (not float8 unless
``--fp8-dot-product-attention``), the activation Megatron's ``bias_swiglu_impl`` / ``bias_gelu_impl``, the
lm head Megatron's own ``ColumnParallelLinear`` outside the float8 region. What changes against bf16
(transformer_engine/pytorch/module/layernorm_linear.py and linear.py, ``forward`` of ``_LayerNormLinear``
/ ``_Linear``; tensor/float8_tensor.py ``Float8CurrentScalingQuantizer``, ``Float8Tensor``):

- a linear's saved input is its float8 cast, 1 byte an element: ``input_quantizer`` makes the rowwise
  copy (for the forward GEMM) and the columnwise one (the transpose ``_transpose`` [in, T], for the weight
  gradient); before ``prepare_for_saving`` the rowwise data is dropped (``ln_out.update_usage(
  rowwise_usage=False)``, ``inputmat.update_usage(rowwise_usage=False, ...)``) — except for a
  column-parallel linear with sequence parallelism under per-tensor float8, which all-gathers the rowwise
  data again in backward and keeps both copies (2 bytes an element of the rank's s/t shard). Each cast
  keeps its ``_scale_inv``, one fp32 ``[1]``. So ``attn.input`` and ``mlp.input`` (``LayerNormLinear``'s
  ``ln_out``, cast by the norm's quantizer, ``with_quantized_norm``: for current scaling
  csrc/extensions/normalization.cpp computes the norm and its amax, then casts, ``FUSED_NORM_AMAX_FP8``)
  and ``mlp.down_input`` become uint8; the norm's input (``inputmat``) and statistics stay as they are
  (16-bit input, fp32 rstd);
- W_O's input: TE's attention core keeps its own 16-bit output for its backward (flash), and W_O keeps a
  float8 cast of it besides (``attn.out_fp8``); with the unfused core (``--attention eager``: Megatron's
  local ``DotProductAttention``, whose P·V saves P and V, not its output) or the core re-run by selective
  recompute, W_O's float8 copy is the only one (``core_keeps_output``);
- what stays 16-bit: the attention core's q, k, v (and out, logsumexp), the norms' inputs, the fused
  SwiGLU's (GeLU's) input ``mlp.fc1`` (``SwiGLUFunction.save_for_backward(input)``), the lm head's input;
- the float8 weights (``module.get_weight_workspace``, transformer_engine/pytorch/module/base.py): each
  linear's weight cast, rowwise ``[out, in]`` and columnwise ``[in, out]`` (the weight is the dgrad GEMM's
  operand too: ``weight_quantizer.set_usage(rowwise=True, columnwise=is_grad_enabled)``), 1 byte an
  element each, plus a ``[1]`` fp32 ``_scale_inv``. Megatron's TE wrappers pass ``is_first_microbatch``
  (``TELinear.forward``: ``None if self.disable_parameter_transpose_cache else self.is_first_microbatch``,
  off by default), so TE caches them in ``_fp8_workspaces["weight"]`` on the module: recast on a step's
  first micro-batch, reused by the others, never freed — 2 bytes per layer-linear parameter of the rank,
  resident like the weights (``workspace_bytes``, in ``memory.weights``);
- ``--fp8-param-gather`` (Megatron-LM's, float8 primary weights: the model is built under TE's
  ``fp8_model_init``, so each linear's ``weight`` parameter is itself a ``Float8Tensor`` — the data in
  Megatron's param buffer, 1 byte an element, its transpose made after each all-gather,
  ``post_all_gather_processing`` — and ``get_weight_workspace`` returns it, no cache beside it): the same
  float8 bytes as the cache above, and no 16-bit copy of the layers' linears (``primary_elements``); the
  distributed optimizer keeps its fp32 main parameters and all-gathers the updated float8 data
  (``time.comm.dp``: 1 byte an element). Under Megatron FSDP (``--zero 3``, ``fsdp_primary``) the float8
  data is sharded instead and gathered per layer, its transpose made after each gather and dropped with
  it (``keep_fp8_transpose_cache = False``): no weight cache for the run, a gathered layer's linears
  ``copies`` bytes an element (NB: ``time.fp8`` still charges the weight cast once a step over the stage's
  weights, where each rank casts its 1/N shard: ≈ 0.2 % of Bridge's 8B H100 step). With the distributed
  optimizer or Megatron FSDP and per-tensor recipes only
  (``config.megatron_rules.check_fp8_param_gather``), and MXFP8 under the distributed optimizer, whose
  primary weights are the MXFP8 copies above and are gathered in 16-bit into the gradient buffer
  (``float8_gathered``); the per-step amax all-reduce of current scaling's parameter casts (one fp32 a
  weight) is not charged. A mixture of experts' local experts (``GroupedLinear``) are primary weights too,
  sharded and gathered over the expert-data-parallel group (``routed_elements``);
- on a GPU whose float8 GEMMs take any operand layout (Blackwell, ``ImplConfig.fp8_any_layout``) every
  per-tensor ``Float8Tensor`` above is its rowwise data alone, read as either operand: no transposes
  (``copies``) — 1 byte per weight element, one copy of a sequence-parallel input, dY cast once;
- the quantizers' buffers: ``TransformerEngineBaseModule.set_meta_tensor`` makes 3 forward quantizers
  (input, weight, output) and 2 backward (grad output, grad input) per GEMM (``RecipeState.create(recipe,
  mode, num_quantizers)``, pytorch/quantization.py). Current scaling: each
  ``Float8CurrentScalingQuantizer`` holds ``scale`` and ``amax``, one fp32 ``[1]`` each: 5·8 = 40 B a
  module, no history. Delayed scaling (``DelayedScalingRecipeState.__init__``): per direction one
  ``scale = torch.ones(n, float32)`` and one ``amax_history = torch.zeros(amax_history_len, n, float32)``,
  n = 3 forward, 2 backward; its ``Float8Quantizer``s are views (``scale[i]``, ``amax_history[0][i]``):
  4·(3 + 2)·(1 + len) B a module (``meta_bytes``), len Megatron's ``--fp8-amax-history-len`` (default 1,
  ``AMAX_HISTORY_LEN``; TE's own ``DelayedScaling`` default is 1024) — 40 B a module at Megatron's default;
- delayed scaling's amax reduction (``FP8GlobalStateManager.reduce_and_update_fp8_tensors``): every
  module registers its ``amax_history[0]`` rows in a global buffer (``add_fp8_tensors_to_global_buffer``);
  at the exit of the outermost ``fp8_autocast`` (``autocast_exit``: once per forward of a model chunk —
  Megatron enters one autocast around a TransformerBlock under delayed scaling: transformer_block.py,
  ``use_outer_fp8_context = ... fp8_recipe == Fp8Recipe.delayed``) and at the end of the
  backward of the autocast's first module (``reduce_and_update_bwd_fp8_tensors``), ``torch.cat`` copies
  them into one fp32 buffer (``amax_buffer_bytes``: 3·4 B per module forward, 2·4 B backward), all-reduces
  it (MAX) over the amax reduction group — Megatron's ``get_amax_reduction_group(with_context_parallel=
  True)``, tensor × data × context parallel unless ``--tp-only-amax-red`` — and
  ``tex.fused_amax_and_scale_update_after_reduction`` rolls each history and writes each scale. The buffer
  is freed at once: the forward's before the lm head runs (the head is outside the autocast), the
  backward's once the chunk's first module — the last backward of the chunk — is done: it is live at
  neither of the step's peaks and is not added to them;
- backward: ``grad_output_preprocess`` casts the incoming dY [T, out] to float8 rowwise (dgrad) and
  columnwise (wgrad): 2 bytes an element beside the 16-bit dY (``grad_output_casts``); the MLP's moments
  (``blocks.mlp``) place them at W_fc2's backward and at W_fc1's, whose dY is the [T, 2f] d(fc1)
  (``mlp.te_first_backward``).

Known limitations (NB):
- NB: derived from TE's and Megatron's source, not measured (TE does not run on CPU): no
  ``trace``/``profile`` of ``--impl megatron --fp8``.
- NB: the GEMM's cuBLAS workspace and the forward's transients (the norm's high-precision output before
  current scaling's cast) are not counted.
- NB: ``--fp8-dot-product-attention`` is not modelled; the sequence-parallel all-gathers keep their
  16-bit sizes in the step time (TE gathers the float8 copy).
- NB: multi-head latent attention and Llama 4's layers under ``--fp8`` are refused, and so is a mixture of
  experts with delayed scaling, shared experts, dense first layers or Megatron FSDP
  (``config.megatron_rules.check_fp8_experts``); ZeRO-3 (Megatron FSDP) of dense layers is taken to keep
  the rank's whole float8 weight cache.
- NB: a mixture of experts (Megatron-core's ``TEGroupedMLP``): each local expert's rows are taken as S·ep/E
  (balanced routing), so TE's padding of each expert's rows to a multiple of 16 (32 under MXFP8: its
  ``Fp8Padding``, as ``moe_router_padding_for_fp8`` leaves it) adds nothing; it does where the rows are
  not a multiple. The per-expert ``[1]`` scale_invs are one tensor in the inventory (the allocator rounds
  each to 512 bytes). The MoE layer's backward moment counts the experts' float8 casts over the S slots
  at fc1's backward (``blocks.moe.megatron.fp8_backward_extra``). Derived, not measured.
- NB: delayed scaling under full recompute (Megatron's ``te_checkpoint``): each module stashes a clone of
  its forward ``amax_history`` and ``scale`` per checkpointed forward
  (``copy_forward_fp8_meta_tensors_for_recompute``, 4·3·(len + 1) B a module, 96 B a layer at len 1) and
  keeps ``updated_amax_history_fwd`` / ``updated_scale_fwd`` clones after the re-run: not counted.
  ``--fp8-amax-compute-algo`` (max or most_recent) moves the same bytes (the kernel rolls the whole
  history either way) and is not an option.
"""

from __future__ import annotations

from memplan.blocks import mxfp8
from memplan.blocks.inventory import Block, Role, Rule, save
from memplan.config import (
    Attention,
    Checkpointing,
    DType,
    Fp8Recipe,
    Impl,
    ImplConfig,
    MlpType,
    ModelConfig,
    Setup,
    ZeroStage,
)

B, R = Block, Role

SCALE_INV = DType.FP32
"""A ``Float8Tensor``'s ``_scale_inv``: ``torch.empty(1, dtype=torch.float32)`` (``make_empty``)."""
QUANTIZERS = 3 + 2
"""Per GEMM: input, weight, output forward; grad output, grad input backward (``set_meta_tensor``)."""
QUANTIZER_BYTES = 2 * 4
"""``Float8CurrentScalingQuantizer.__init__``: ``scale`` and ``amax``, ``torch.empty(1, float32)`` each."""
FORWARD_QUANTIZERS, BACKWARD_QUANTIZERS = 3, 2
"""``set_meta_tensor``: ``num_gemms * 3`` forward (input, weight, output), ``num_gemms * 2`` backward."""
AMAX = DType.FP32
"""``DelayedScalingRecipeState``: ``scale`` and ``amax_history`` are ``torch.float32``."""
AMAX_HISTORY_LEN = 1
"""Megatron-LM's ``--fp8-amax-history-len`` default (arguments.py; ``TransformerConfig.fp8_amax_history_len:
int = 1``), passed to ``DelayedScaling(amax_history_len=...)``; memplan's ``--fp8-amax-history-len``
(``ImplConfig.fp8_amax_history_len``) defaults to it."""
MODULES = 4
"""TE modules a layer: LayerNormLinear for W_QKV and W_fc1, Linear for W_O and W_fc2."""


def applies(setup: Setup) -> bool:
    """Megatron-core's layers under Transformer Engine's float8 (``--impl megatron --fp8 tensorwise``,
    ``delayed``)."""
    return setup.impl.impl is Impl.MEGATRON and setup.impl.fp8 is not Fp8Recipe.NONE


def delayed(setup: Setup) -> bool:
    """TE's ``DelayedScaling`` (``--impl megatron --fp8 delayed``)."""
    return applies(setup) and setup.impl.fp8 is Fp8Recipe.DELAYED


def mx(setup: Setup) -> bool:
    """TE's ``MXFP8BlockScaling`` (``--impl megatron --fp8 mxfp8``)."""
    return applies(setup) and setup.impl.fp8 is Fp8Recipe.MXFP8


def float8(rule: Rule, part: str, why: str) -> Rule:
    """``rule``'s tensor as a float8 (uint8) copy of the same elements, named ``part``."""
    return save(rule.block, part, rule.shape, DType.UINT8, rule.role, why)


def scale_inv(block: Block, part: str) -> Rule:
    return save(block, f"{part}_scale_inv", (1,), SCALE_INV, R.PARAM_DERIVED, "float8 cast's 1/scale")


def mx_scale_inv(rule: Rule, part: str, shards: int) -> Rule:
    """The columnwise E8M0 scales of ``rule``'s [M, K] MXFP8 copy (``mxfp8.scale_shape``), M the rank's
    tokens: ``shards`` = t for a sequence-parallel shard (the copy's own role is split afterwards,
    ``strategies.sequence_parallel``; the grid's padded shape is made here, whole)."""
    rows = 1
    for d in rule.shape[:-1]:
        rows *= d
    shape = mxfp8.scale_shape(rows // shards, rule.shape[-1], columnwise=True)
    why = "MXFP8 columnwise scales: one E8M0 per 32 elements of a column, padded to [4, 128]"
    return save(rule.block, f"{part}_scale_inv", shape, DType.UINT8, R.PARAM_DERIVED, why)


def copies(impl: ImplConfig) -> int:
    """Float8 copies of a per-tensor cast, 1 byte an element each: the rowwise data and its transpose on a
    GPU whose float8 GEMMs take TN operands only (Hopper), the data alone where they take any layout
    (``ImplConfig.fp8_any_layout``, Blackwell: TE's ``Float8Tensor.update_usage`` under
    ``is_non_tn_fp8_gemm_supported`` keeps ``_data`` for either usage and drops ``_transpose``;
    ``Float8Quantizer::create_tensor`` makes no transpose)."""
    return 1 if impl.fp8_any_layout else 2


def casts(setup: Setup, rule: Rule, part: str, column_parallel: bool) -> list[Rule]:
    """What a TE linear keeps of its input ``rule``: the columnwise float8 copy and its scale_inv (MXFP8:
    its grid of E8M0 scales); with sequence parallelism a per-tensor column-parallel linear keeps the
    rowwise copy too (re-gathered in backward; MXFP8 gathers the columnwise copy) — except where the GPU
    takes any layout, whose one copy serves both (``copies``)."""
    why = "float8 columnwise input (Xᵀ) of the wgrad GEMM: dW = Xᵀ·dY"
    sequence_shard = column_parallel and setup.parallel.sp
    if mx(setup):
        return [float8(rule, part, why), mx_scale_inv(rule, part, setup.parallel.tp if sequence_shard else 1)]
    one_copy = copies(setup.impl) == 1
    if one_copy:
        why = "float8 input of the wgrad GEMM (one copy: any-layout GEMMs read it as Xᵀ)"
    out = [float8(rule, part, why), scale_inv(rule.block, part)]
    if sequence_shard and not one_copy:
        out.insert(1, float8(rule, f"{part}_rowwise", "float8 rowwise input, all-gathered again in backward"))
    return out


def expert_casts(setup: Setup, rule: Rule, part: str) -> list[Rule]:
    """What a ``GroupedLinear`` keeps of its input ``rule`` [S, in] (the rank's S slots, ``m_splits`` over
    its E/ep local experts, taken balanced): ``tex.split_quantize`` casts each expert's rows, and before
    ``prepare_for_saving`` each cast drops its rowwise data (``inputmat.update_usage(rowwise_usage=False,
    columnwise_usage=True)``, transformer_engine/pytorch/module/grouped_linear.py): 1 byte an element of
    [S, in] and one ``[1]`` fp32 scale_inv per expert (MXFP8: each expert's grid of columnwise E8M0
    scales, ``mxfp8.scale_shape`` of its S·ep/E rows)."""
    moe = setup.model.moe
    assert moe is not None  # NB: called for mixtures of experts only
    local = moe.experts // setup.parallel.ep
    why = "float8 columnwise input of the experts' wgrad GEMMs, one cast per expert: dW_i = X_iᵀ·dY_i"
    rows = 1
    for d in rule.shape[:-1]:
        rows *= d
    if mx(setup):
        grid = mxfp8.scale_shape(rows // local, rule.shape[-1], columnwise=True)
        grids = "each expert's columnwise E8M0 scales: one per 32 elements of a column, padded to [4, 128]"
        scale = save(rule.block, f"{part}_scale_inv", (local, *grid), DType.UINT8, R.PARAM_DERIVED, grids)
    else:
        one = "each expert's cast's 1/scale"
        scale = save(rule.block, f"{part}_scale_inv", (local,), SCALE_INV, R.PARAM_DERIVED, one)
    return [float8(rule, part, why), scale]


def layer_rules(setup: Setup, rules: list[Rule]) -> list[Rule]:
    """A Megatron layer's saves (``activations.layer_rules``) with TE's float8 linears: the four linears'
    saved inputs as float8 casts (module docstring), the rest unchanged. In a mixture of experts the MLP
    input stays 16-bit (the router's input: Megatron's own linear), and the ``GroupedLinear`` experts'
    float8 casts of the dispatched tokens and of fc2's input (``expert_casts``) are the MoE layer's
    (``blocks.moe.megatron.routed_rules``, which replace the dense MLP's)."""
    dense = setup.model.moe is None  # the MoE layer's own saves: blocks.moe.megatron.routed_rules
    out: list[Rule] = []
    for r in rules:
        if r.name == "attn.input" or (dense and r.name == "mlp.input"):
            out += casts(setup, r, r.name.split(".")[1], column_parallel=True)
        elif dense and r.name == "mlp.down_input":
            out += casts(setup, r, "down_input", column_parallel=False)
        elif r.name == "attn.out":
            own = core_keeps_output(setup)
            out += [r] if own else []  # the flash core's own 16-bit output stays
            out += casts(setup, r, "out_fp8" if own else "out", column_parallel=False)
        else:
            out.append(r)
    return out


def core_keeps_output(setup: Setup) -> bool:
    """TE's flash core saves its 16-bit output for its backward, unless selective recompute re-runs it
    (Megatron's ``_checkpointed_attention_forward``: ``CheckpointFunction`` keeps the core's inputs only);
    the eager core's P·V saves P and V, not its output."""
    flash = setup.strategy.attention is Attention.FLASH
    return flash and setup.strategy.checkpointing is not Checkpointing.SELECTIVE


def gemm_shapes(m: ModelConfig, ep: int = 1) -> list[tuple[int, int, int]]:
    """TE's weights [out, in] of one layer on a tensor-parallel rank (``m`` the rank's model,
    ``tensor_parallel.tp_model``) and how many of each: W_QKV [q + 2kv, h] and W_O [h, q], then a dense
    layer's W_fc1 [2f, h] (SwiGLU; GeLU [f, h]) and W_fc2 [h, f], one each, or a mixture of experts'
    ``GroupedLinear`` fc1 and fc2 with one weight per local expert (E/ep of them, f an expert's width; the
    router is Megatron's own linear, outside TE: not cast). Biases are not cast."""
    h, f = m.hidden_size, m.ffn
    fc1 = (2 if m.mlp is MlpType.SWIGLU else 1) * f
    local = m.moe.experts // ep if m.moe is not None else 1
    return [(m.q_width + 2 * m.kv_width, h, 1), (h, m.q_width, 1), (fc1, h, local), (h, f, local)]


def gemm_weights(m: ModelConfig, ep: int = 1) -> int:
    """TE weights of one layer on the rank (``gemm_shapes``): 4 in a dense layer, 2 + 2·E/ep with experts —
    each with its cast's ``[1]`` scale_inv and its quantizers."""
    return sum(n for _, _, n in gemm_shapes(m, ep))


def linear_elements(m: ModelConfig, ep: int = 1) -> int:
    """Weight elements of one layer's TE linears on a tensor-parallel rank (``gemm_shapes``)."""
    return sum(out * inp * n for out, inp, n in gemm_shapes(m, ep))


def routed_elements(m: ModelConfig, ep: int = 1) -> int:
    """``linear_elements`` of the rank's local experts (0 in a dense layer): sharded and gathered over the
    expert-data-parallel group, not dp's (``time.comm.dp``)."""
    return sum(out * inp * n for out, inp, n in gemm_shapes(m, ep)[2:]) if m.moe is not None else 0


def workspace_bytes(
    m: ModelConfig, recipe: Fp8Recipe = Fp8Recipe.TENSORWISE, copies: int = 2, ep: int = 1
) -> int:
    """One layer's cached float8 weights: rowwise and columnwise copies (1 byte an element each; one where
    the GPU takes any layout, ``copies``) and a ``[1]`` fp32 scale_inv per weight (``gemm_shapes``: a
    ``GroupedLinear`` caches each expert's, ``cache_name=f"weight{i}"``); MXFP8: each copy with its grid
    of E8M0 scales (``mxfp8.both_bytes``)."""
    if recipe is Fp8Recipe.MXFP8:
        return sum(n * mxfp8.both_bytes(out, inp) for out, inp, n in gemm_shapes(m, ep))
    return copies * linear_elements(m, ep) + gemm_weights(m, ep) * SCALE_INV.bytes


def primary_elements(setup: Setup, m: ModelConfig) -> int:
    """One layer's linear weight elements on the rank (``m`` the rank's model) that are float8 primary
    weights under ``--fp8-param-gather`` (module docstring); 0 without. The rank holds none of their 16-bit
    copies (``weight_bytes`` each less) and the distributed optimizer gathers 1 byte of each, not
    ``weight_bytes`` (``time.comm.dp``)."""
    return linear_elements(m, setup.parallel.ep) if applies(setup) and setup.impl.fp8_param_gather else 0


def float8_gathered(setup: Setup, m: ModelConfig, routed: bool = False) -> int:
    """``primary_elements`` that the all-gathers move as float8 (1 byte an element): the per-tensor
    recipes'. MXFP8's primary weights are gathered in 16-bit into the gradient buffer and cast to MXFP8 on
    the copy out (Megatron's ``--reuse-grad-buf-for-mxfp8-param-ag``, which Megatron requires beside
    ``--fp8-param-gather`` and Bridge's MXFP8 recipe sets: ``start_param_sync``, "The parameters are cast
    from bf16 to MXFP8 during copy"): no 16-bit copy held between steps, 2 bytes an element gathered.
    ``routed``: the local experts' part, gathered over the expert-data-parallel group
    (``routed_elements``); else the rest, over dp."""
    if setup.impl.fp8 is Fp8Recipe.MXFP8 or not primary_elements(setup, m):
        return 0
    experts = routed_elements(m, setup.parallel.ep)
    return experts if routed else linear_elements(m, setup.parallel.ep) - experts


def fsdp_primary(setup: Setup) -> bool:
    """Megatron FSDP (``--zero 3``) with float8 primary weights: each linear's ``Float8Tensor`` data is
    sharded with the other parameters (1 byte an element over the shard group), gathered per layer as
    float8, and its transpose made after the gather and dropped with it (``keep_fp8_transpose_cache =
    False``, Megatron-FSDP's default and the Bridge recipes'): TE holds no cache of any layer's weights
    for the run (``resident_bytes``), and a gathered layer's linears are ``copies`` bytes an element
    (``gathered_saving``)."""
    return bool(primary_elements(setup, setup.model)) and setup.strategy.zero is ZeroStage.PARAMETERS


def gathered_saving(setup: Setup, m: ModelConfig) -> int:
    """Bytes a gathered layer holds less under ``fsdp_primary`` than its 16-bit copy: its linears' float8
    data and (Hopper) the transpose made from it, ``copies`` bytes an element, not ``weight_bytes``."""
    if not fsdp_primary(setup):
        return 0
    elements = linear_elements(m, setup.parallel.ep)
    return elements * (setup.training.precision.weight_bytes - copies(setup.impl))


def meta_bytes(recipe: Fp8Recipe, history: int = AMAX_HISTORY_LEN, weights: int = MODULES) -> int:
    """One layer's quantizer state (module docstring), ``weights`` its TE GEMMs (``gemm_weights``: a
    ``GroupedLinear``'s ``set_meta_tensor`` makes ``num_gemms`` × 5 quantizers). Current scaling: 5
    quantizers a GEMM × (scale + amax); delayed: (3 + 2) a GEMM × (scale + ``history`` amax rows), fp32;
    MXFP8: none."""
    if recipe is Fp8Recipe.DELAYED:
        return weights * QUANTIZERS * (1 + history) * AMAX.bytes
    if recipe is Fp8Recipe.MXFP8:
        return 0
    return weights * QUANTIZERS * QUANTIZER_BYTES


def resident_bytes(m: ModelConfig, impl: ImplConfig, cached: bool = True, ep: int = 1) -> int:
    """What TE holds per layer for the whole run, beside the weights; ``cached`` False (``fsdp_primary``):
    no weight cast held, the primary weights' ``_scale_inv`` and the quantizers' state only; ``ep`` the
    expert-parallel degree (a mixture of experts' local experts, ``gemm_shapes``)."""
    weights = gemm_weights(m, ep)
    held = workspace_bytes(m, impl.fp8, copies(impl), ep) if cached else weights * SCALE_INV.bytes
    return held + meta_bytes(impl.fp8, impl.fp8_amax_history_len, weights)


def amax_buffer_bytes(layers: int, forward: bool) -> int:
    """Delayed scaling: the ``torch.cat`` of the amax rows of a model chunk's ``layers`` that one reduction
    all-reduces (``reduce_and_update_fp8_tensors``): 3 fp32 a module forward, 2 backward; 0 for an empty
    chunk (``if len(amax_buffer) == 0: continue``)."""
    per_module = FORWARD_QUANTIZERS if forward else BACKWARD_QUANTIZERS
    return layers * MODULES * per_module * AMAX.bytes


def amax_update_bytes(forward: bool, history: int = AMAX_HISTORY_LEN) -> int:
    """Delayed scaling: bytes one layer's quantizers move in a reduction, per direction: the ``torch.cat``
    (reads and writes the amax, 2·4 B) and ``fused_amax_and_scale_update_after_reduction`` (reads the
    reduced amax, reads and writes the rolled ``history`` rows, writes the scale: 4·(2·history + 2) B —
    common/recipe/delayed_scaling.cu's kernel: one block per scale, ``updated_amax_history[i*stride]``)."""
    per_module = FORWARD_QUANTIZERS if forward else BACKWARD_QUANTIZERS
    return MODULES * per_module * AMAX.bytes * (2 + 2 * history + 2)


def grad_output_casts(setup: Setup, tokens: int, n_out: int) -> int:
    """A TE linear's backward above the 16-bit dY [T, out] it receives: ``grad_output_preprocess``'s float8
    rowwise (dgrad) and columnwise (wgrad) casts of dY, 1 byte an element each (one copy for both where
    the GPU takes any layout, ``copies``), and their [1] fp32 scale_inv (MXFP8: both grids of E8M0
    scales). The dgrad output and the weight gradient are bf16's (``blocks.mlp``)."""
    if mx(setup):
        return mxfp8.both_bytes(tokens, n_out)
    return copies(setup.impl) * tokens * n_out + SCALE_INV.bytes


def saved_cast_bytes(setup: Setup, rows: int, cols: int) -> int:
    """A saved float8 columnwise input [rows, cols] with its scale_inv (``casts``), as the backward
    releases it."""
    if mx(setup):
        return rows * cols + mxfp8.scale_bytes(rows, cols, columnwise=True)
    return rows * cols + SCALE_INV.bytes
