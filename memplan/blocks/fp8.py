"""Float8 training's memory (``--fp8 tensorwise|rowwise``): torchao 0.18's ``Float8Linear``, eager.

What it keeps for backward: what bf16 training keeps. ``matmul_with_hp_or_float8_args.forward``
(torchao/float8/float8_linear.py) saves the high-precision input and the weight's transposed view
(``ctx.save_for_backward(input_hp, weight_hp_t)``) and its backward casts them again: no float8 tensor
outlives the op (``trace --fp8``: the saved tensors equal bf16's, byte for byte). Delayed scaling, whose
per-tensor amax history was a buffer, is gone from torchao (0.18's ``ScalingType`` is ``DYNAMIC`` or
``DISABLED``): there is no amax history to count. With FSDP2's ``enable_fsdp_float8_all_gather`` (tensorwise
only, ``--fp8-all-gather``) the all-gathered weight is float8 (below).

What it adds are the casts' temporaries, per linear Y = X·Wᵀ (X [T, in], W [out, in], dY [T, out]):
- one cast of an n-element tensor (``hp_tensor_to_float8_dynamic``): ``tensor_to_amax`` (``abs`` of it,
  e bytes an element, freed with the reduction), then ``_ToFloat8ConstrFunc.forward``: ``tensor.to(float32)
  * scale`` (4n, the upcast freed once the product exists), ``to_fp8_saturated``: ``clamp`` (4n more) and
  ``.to(float8)`` (n) while the scaled and the clamped copies are both alive: 9n bytes at its top, then the
  float8 copy (n) and its scale stay while the op uses them;
- scales (fp32): tensorwise one per tensor (4 bytes); rowwise (``AXISWISE``) one per row of the scaled
  axis: X by token (4T) and Wᵀ by output (4·out) in forward; dY by token (4T) for dX and by output (4·out)
  for dW, W by input (4·in) for dX, X by input (4·in) for dW;
- forward, in order: cast X, cast Wᵀ, the GEMM's output Y (e·T·out);
- backward, in order, dY alive: cast dY (for dX), cast W, dX (e·T·in), cast dY again (for dW), cast X,
  dW (the gradient's bytes); every float8 copy lives until the backward returns.

``backward_transient`` is the top of that sequence above what is alive before it (dY excluded), exact
against torch's live storages (tests/measure/test_fp8.py). The peak places it at the MLP's linears'
backward: the down projection's (``blocks.mlp.down_backward_transient``: the layer's saves all alive, the
largest input [T, f]) and, with few tokens where the weight casts dominate, W_up's and W_gate's
(``blocks.mlp.fp8_first_backward``: W_down's gradient made by then).

Known limitations (NB):
- NB: the forward's casts (``forward_transient``) are not a modelled moment (the peak model's forward is
  not); the attention's linears' backward casts are taken smaller than the MLP's (their weights and inputs
  are no larger when f > h, their live set smaller). benchmarks/bench_fp8_peak.py: 13 of 14 random small
  setups exact; the miss (h = f, eager grouped-query attention, where the bf16 layer moment is already
  inexact) is 4,928 B (1.1 %) above the estimate.
- NB: eager casts. Under ``--compile`` the partitioner keeps each linear's float8 weight cast for backward
  (pytorch/pytorch#141881): the saves are ``compiled_rules`` (tp 1, no checkpointing, measured), the
  backward's cast temporaries are still taken as the eager code's (which makes the weight casts again: an
  upper bound); elsewhere a note says the memory is the eager code's.
- NB: a mixture of experts' float8 path (torchao's grouped GEMMs) is not modelled: the dense MLP's down
  projection only; ``trace --fp8`` refuses an MoE. torchtitan skips linears with a dim not a multiple of
  16 (``module_filter_fn``); the estimate takes the down projection as converted.
- NB: under torchtitan 0.3.0's tensor-parallel plan the linears cast the gathered bf16 input on the rank
  as here (a rank's shapes as they are); torchao's float8 tensor-parallel plan (``--fp8-tp``), which
  casts before the collectives, is blocks/fp8_tp.py.

FSDP2's float8 all-gather (``--fp8-all-gather``: torchao's ``enable_fsdp_float8_all_gather``, torchtitan's
``float8.enable_fsdp_float8_all_gather`` with ``precompute_float8_dynamic_scale_for_fsdp``; tensorwise only,
torchtitan under ZeRO-3 over dp > 1): ``Float8Linear.from_float`` wraps each weight in
``WeightWithDynamicFloat8CastTensor`` (torchao float8/fsdp_utils.py), whose ``fsdp_pre_all_gather`` casts
the rank's fp32 shard to float8 and returns its data (1 B an element) with the scale as metadata, and whose
``fsdp_post_all_gather`` makes the unsharded weight a ``Float8TrainingTensor`` (``param_dtype`` its nominal
dtype). So: a gathered block holds its converted weights in float8 (``gathered_saving``: (weight bytes − 1)
an element less; FSDP2 gathers the unit's mixed dtypes as bytes, the norms bf16); the linear's forward and
backward find the weight already float8 (no weight cast: ``forward_transient``, ``backward_transient``);
each unsharded weight keeps its fp32 scale across reshards (``gathered_scales``) and a prefetched block's
pre-all-gather makes five more beside them until its copy-out (``analytic.fsdp.moments.layer_gather``);
the all-gathers move float8 and one all-reduce of the amaxes runs after the step (``time.comm.dp``).
Traced on one rank of Llama-3-8B's widths (2 layers, seq 256, dp 2, ZeRO-3; tests/hf/test_fp8_all_gather.py):
saves and shards unchanged, the gathered block 218,120,192 B (bf16's 436,224,000), the loss backward's
moment exact, the final norm's and the embedding's moved as the estimate says (− F + 60 B, + 40 B). The
probe of d7a4862 saw two "fp32 whole-layer" tensors (872,415,232 B) at its peak: the wrapper subclass's own
dataless storages (``_make_wrapper_subclass``) counted by the live-memory tracker beside the inner fp32
shards; the tracker now counts a wrapper by its inner tensors (``instruments.tracker.data_tensors``), and the
peak is bf16-gathered's + 40 B (the held scales).
- NB: the weights are wrapped as ``from_float`` does (``measure.distributed.titan.wrap_float8_weights``):
  torchtitan 0.3.0's config-level converter builds ``Float8Linear`` by ``__init__`` and never wraps them.
- NB: the pre-all-gather cast of the fp32 shard (its ``cast_top``, before each block's all-gather, in the
  forward and in the backward's prefetch) is not a modelled moment; with the weight casts gone the tiny
  rank's layer-backward top moves to SiLU's backward, between W_up's and W_gate's (W_up's dX [T, h] and a
  scale alive), 4,100 B (0.6 %) above the estimate, which models the casts' moments only. On the Llama-3-8B
  rank the layer-backward moment is inexact with or without the float8 all-gather (titan_peak's NBs).
- NB: refused with --tp, --pp, --cp and HSDP (not traced); under ``--compile`` the note of the eager
  casts applies.
- NB: under torchtitan's ``SelectiveAC`` tensorwise's amaxes are cached (``sac_amax_rules``); the SAC
  re-run's casts are not a modelled moment.
"""

from __future__ import annotations

from memplan.blocks.inventory import Block, Dims, Role, Rule, save
from memplan.config import Checkpointing, DType, Fp8Recipe, Impl, Setup

SCALE = 4
"""Bytes of one scale: torchao's ``amax_to_scale`` returns float32."""


def enabled(setup: Setup) -> bool:
    """torchao's ``Float8Linear`` runs (``--fp8`` outside ``--impl megatron``, whose Transformer Engine
    linears are blocks/te_fp8.py's)."""
    return setup.impl.fp8 is not Fp8Recipe.NONE and setup.impl.impl is not Impl.MEGATRON


def cast_top(n: int) -> int:
    """The top of one cast of n elements (module docstring): the fp32 scaled and clamped copies and the
    float8 result, alive at once: 4n + 4n + n."""
    return 9 * n


def scales(recipe: Fp8Recipe, rows: int) -> int:
    """Bytes of a cast's scales: tensorwise one fp32; rowwise one per row of the scaled axis."""
    return SCALE if recipe is Fp8Recipe.TENSORWISE else SCALE * rows


def forward_transient(setup: Setup, tokens: int, n_in: int, n_out: int) -> int:
    """A linear's forward above X and W: cast X (scales by token), cast Wᵀ (by output) beside float8 X,
    then the GEMM's output beside both float8 copies."""
    r, e = setup.impl.fp8, setup.training.precision.activation_dtype.bytes
    x, w = tokens * n_in, n_in * n_out
    sx, sw = scales(r, tokens), scales(r, n_out)
    if all_gather(setup):  # Wᵀ is the gathered float8 weight (column-major: no copy for the GEMM)
        return max(cast_top(x) + sx, x + sx + e * tokens * n_out)
    return max(
        cast_top(x) + sx,
        x + sx + cast_top(w) + sw,
        x + sx + w + sw + e * tokens * n_out,
    )


def backward_transient(setup: Setup, tokens: int, n_in: int, n_out: int) -> int:
    """A linear's backward above its saves and the incoming dY (module docstring's order): the largest of
    its six steps' live sets."""
    r = setup.impl.fp8
    e, g = setup.training.precision.activation_dtype.bytes, setup.training.precision.grad_bytes
    x, w, y = tokens * n_in, n_in * n_out, tokens * n_out
    dy = y + scales(r, tokens)  # float8 dY for dX, by token
    wt = w + scales(r, n_in)  # float8 W for dX, by input
    if all_gather(setup):
        # W is already float8 (the gathered weight): no cast; the GEMM's operand is W's column-major copy
        # (torchao float8_ops ``preprocess_addmm``: ``b.t().contiguous().t()`` of the row-major W), its
        # scale shared
        wt = w
    weight_cast = 0 if all_gather(setup) else dy + cast_top(w) + scales(r, n_in)
    dx = e * x
    dy2 = y + scales(r, n_out)  # float8 dY for dW, by output
    xt = x + scales(r, n_in)  # float8 X for dW, by input
    return max(
        cast_top(y) + scales(r, tokens),
        weight_cast,
        dy + wt + dx,
        dy + wt + dx + cast_top(y) + scales(r, n_out),
        dy + wt + dx + dy2 + cast_top(x) + scales(r, n_in),
        dy + wt + dx + dy2 + xt + g * w,
    )


def down_backward(setup: Setup, dims: Dims) -> int:
    """The down projection's backward casts (its input [T, f], its output [T, h])."""
    return backward_transient(setup, dims.tokens, dims.f, dims.h)


def titan_linear_shapes(setup: Setup) -> list[tuple[Block, str, int, int]]:
    """A torchtitan Llama 3 block's linears that its converter makes Float8Linear, in forward order (fused
    ``wqkv``, ``wo``; ``w2(silu(w1(x)) * w3(x))``), with (in_features, out_features): 0.3.0's
    ``module_filter_fn`` skips a linear with ``in_features`` or ``out_features`` not a multiple of 16
    (torchtitan components/quantization/utils.py), judged on the model's whole widths (the converter
    rewrites the config before the TP plan shards it)."""
    m = setup.model
    h, qkv, heads, f = m.hidden_size, (m.num_heads + 2 * m.kv_heads) * m.dim, m.num_heads * m.dim, m.ffn
    shapes = (
        (Block.ATTN, "wqkv", h, qkv),
        (Block.ATTN, "wo", heads, h),
        (Block.MLP, "w1", h, f),
        (Block.MLP, "w2", f, h),
        (Block.MLP, "w3", h, f),
    )
    return [s for s in shapes if s[2] % 16 == 0 and s[3] % 16 == 0]


def titan_all_converted(setup: Setup) -> bool:
    """Every one of a torchtitan block's five linears is converted (``titan_linear_shapes``' filter keeps
    them all: every width a multiple of 16)."""
    return len(titan_linear_shapes(setup)) == len(WEIGHTS)


def titan_linears(setup: Setup) -> list[tuple[Block, str]]:
    """``titan_linear_shapes``' (block, name)."""
    return [(block, name) for block, name, _, _ in titan_linear_shapes(setup)]


def all_gather(setup: Setup) -> bool:
    """``--fp8-all-gather``: torchao's ``enable_fsdp_float8_all_gather`` under torchtitan's FSDP2 ZeRO-3
    (the setup's rules refuse it elsewhere)."""
    return setup.impl.fp8_all_gather


def gathered_linear_elements(setup: Setup, shards: int = 1) -> int:
    """Elements of one block's converted weights as FSDP2 gathers them: each [out, in] weight's dim 0
    padded to a multiple of ``shards`` (``blocks.torchtitan.fsdp2_flat_elements``)."""
    return sum(-(-n_out // shards) * shards * n_in for _, _, n_in, n_out in titan_linear_shapes(setup))


def gathered_saving(setup: Setup, shards: int = 1) -> int:
    """Bytes one gathered block holds less under ``--fp8-all-gather``: its converted weights all-gathered
    in float8 (``fsdp_pre_all_gather`` returns ``float8_training_tensor._data``, 1 byte an element) where
    FSDP2's ``param_dtype`` copy would be ``weight_bytes``; FSDP2 all-gathers the mixed dtypes as bytes
    (the unit's norms stay bf16). 0 without it."""
    if not all_gather(setup):
        return 0
    return gathered_linear_elements(setup, shards) * (setup.training.precision.weight_bytes - 1)


def gathered_scales(setup: Setup) -> int:
    """Bytes of the converted weights' fp32 scales alive from their first all-gather on: each unsharded
    weight is a ``Float8TrainingTensor`` whose ``_scale`` (``fsdp_pre_all_gather``'s metadata, set again by
    ``fsdp_post_all_gather(out=...)``) FSDP2's reshard does not free (``free_unsharded_param`` frees the
    all-gather outputs only): one ``SCALE`` per converted weight of every block. 0 without it."""
    if not all_gather(setup):
        return 0
    return SCALE * len(titan_linear_shapes(setup)) * setup.model.num_layers


def compiled_sac_scale_rules(dims: Dims) -> list[Rule]:
    """What torchtitan's ``SelectiveAC`` keeps of tensorwise float8 under ``--compile``
    (``blocks.profiles.compiled_sac``): the partitioner keeps a MUST_SAVE node only where the backward reads
    it (traced: ``trace --impl torchtitan --checkpointing selective --compile --fp8 tensorwise``). torchao's
    backward casts the saved bf16 activations and the output gradient again with fresh amaxes, and casts
    each weight with its forward scale; the re-run linears (W_O and W3: the policy's every other
    ``_scaled_mm``) cast their inputs as in forward. So the block keeps each of its five weights' amax, the
    amax of W_O's input and of the input W1 and W3 share (0-d, the activation dtype), and the fp32 inverse
    scales the policy tags MUST_SAVE beside a cached ``_scaled_mm`` that the backward reads: of W_QKV's,
    W1's and W2's weights and of W1's (and W3's) input."""
    act = dims.act
    why = "compiled SelectiveAC: float8 tensorwise"
    amaxes = [
        *(save(b, f"{n}_weight_amax", (), act, Role.PARAM_DERIVED, f"{why} weight amax") for b, n in WEIGHTS),
        save(Block.ATTN, "wo_input_amax", (), act, Role.PARAM_DERIVED, f"{why} amax of W_O's re-run input"),
        save(Block.MLP, "w1_input_amax", (), act, Role.PARAM_DERIVED, f"{why} amax of W1's and W3's input"),
    ]
    inverse = [
        save(b, f"{n}_inverse_scale", (), DType.FP32, Role.PARAM_DERIVED, f"{why} inverse scale of {n}")
        for b, n in ((Block.ATTN, "wqkv"), (Block.MLP, "w1"), (Block.MLP, "w2"), (Block.MLP, "w1_input"))
    ]
    return amaxes + inverse


WEIGHTS = ((Block.ATTN, "wqkv"), (Block.ATTN, "wo"), (Block.MLP, "w1"), (Block.MLP, "w3"), (Block.MLP, "w2"))
"""A torchtitan Llama 3 block's five converted linears (``titan_linear_shapes`` when every width is a
multiple of 16)."""


def sac_amax_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """What torchtitan's ``SelectiveAC`` caches of tensorwise float8: its save list holds ``aten.max.default``
    ("for low precision training, always save the absolute maximum used to compute the scaling factor",
    torchtitan 0.3.0 distributed/activation_checkpoint.py ``_get_default_save_ops``), and torchao's
    tensorwise amax is ``torch.max(torch.abs(x))`` (float8_utils.py ``tensor_to_amax``; rowwise's is
    ``torch.amax``, not in the list). Each forward cast of a block caches a 0-d amax in the cast tensor's
    dtype (the activation dtype: X, and W gathered in bf16 or built in it): X and W of each of the block's
    converted linears (``titan_linears``), 10 a block at Llama's widths (measured: ``trace --impl
    torchtitan --checkpointing selective --fp8 tensorwise``, tests/hf/test_torchtitan_tensorwise.py)."""
    if setup.impl.fp8 is not Fp8Recipe.TENSORWISE:
        return []
    # --fp8-all-gather: the weight arrives float8 (cast in FSDP2's pre-all-gather hook, outside the
    # checkpointed block): no weight amax inside it
    parts = ("input",) if all_gather(setup) else ("input", "weight")
    why = "SAC cache: aten.max (tensorwise amax) of the float8 cast of"
    return [
        save(block, f"{name}_{part}_amax", (), dims.act, Role.PARAM_DERIVED, f"{why} {name}'s {part}")
        for block, name in titan_linears(setup)
        for part in parts
        # --fp8-tp: W1 and W3 share one cast of their input (``PrepareFloat8ModuleInput``)
        if not (setup.impl.fp8_tp and name == "w3" and part == "input")
    ]


COMPILED_RECIPES = (Fp8Recipe.TENSORWISE, Fp8Recipe.ROWWISE)


def compiled_modelled(setup: Setup) -> bool:
    """``--compile`` with torchao's float8 where its partitioner's saves were measured (``compiled_rules``):
    tensorwise or rowwise on a block of one tensor-parallel rank (tp 1), without ``--fp8-all-gather``
    (the weight would arrive float8) or checkpointing, every linear converted (torchtitan's widths all
    multiples of 16)."""
    return (
        enabled(setup)
        and setup.impl.fp8 in COMPILED_RECIPES
        and setup.parallel.tp == 1
        and not all_gather(setup)
        and setup.strategy.checkpointing is Checkpointing.NONE
        and (setup.impl.impl is not Impl.TORCHTITAN or titan_all_converted(setup))
    )


def linear_shapes(setup: Setup) -> list[tuple[Block, str, int, int]]:
    """The block's converted linears with (in_features, out_features): torchtitan's (fused ``wqkv``) or the
    reference's W_Q, W_K, W_V, W_O and SwiGLU's gate, up and down."""
    if setup.impl.impl is Impl.TORCHTITAN:
        return titan_linear_shapes(setup)
    m = setup.model
    h, heads, kv, f = m.hidden_size, m.num_heads * m.dim, m.kv_heads * m.dim, m.ffn
    return [
        (Block.ATTN, "q", h, heads),
        (Block.ATTN, "k", h, kv),
        (Block.ATTN, "v", h, kv),
        (Block.ATTN, "o", heads, h),
        (Block.MLP, "gate", h, f),
        (Block.MLP, "up", h, f),
        (Block.MLP, "down", f, h),
    ]


RECOMPUTED = ("attn.input", "mlp.input", "mlp.down_input")
"""The compiled bf16 block's saves a compiled float8 block recomputes in backward: the two normalised
inputs (rebuilt from x, the residual and the rstds the block keeps) and SwiGLU's product."""


def compiled_rules(setup: Setup, dims: Dims, rules: list[Rule]) -> list[Rule]:
    """A compiled block's saves under torchao's float8 (``compiled_modelled``), measured: AOTAutograd's
    min-cut partitioner on the block's joint graph (measure/runs/compiled.py, torchtitan's through
    measure/frameworks/titan.py; tests/measure/test_fp8.py). Casting a weight materialises it,
    so the partitioner keeps each linear's float8 weight, transposed [in, out] at 1 byte an element, with
    its scale (pytorch/pytorch#141881), and the float8 cast of W_O's input [T, a·d] (the attention output,
    which the flash backward keeps in bf16 too) with its scale; it recomputes the normalised inputs and
    SwiGLU's product from what the compiled block keeps (``RECOMPUTED``). Scales: tensorwise one fp32 per
    cast (its reciprocal); rowwise an amax in the cast tensor's dtype per row of the weight's [in, out]
    copy (in) and per column of W_O's input (a·d). Llama-3-8B at 256 tokens: 243,304,480 bytes a layer
    (compiled bf16: 35,686,400)."""
    act, fp8 = dims.act, DType.FP8_E4M3
    tensorwise = setup.impl.fp8 is Fp8Recipe.TENSORWISE
    why = "compiled float8: the partitioner keeps the cast for backward"

    def scale(block: Block, name: str, rows: tuple[int, ...]) -> Rule:
        shape, dtype = ((), DType.FP32) if tensorwise else (rows, act)
        return save(block, f"{name}_scale", shape, dtype, Role.PARAM_DERIVED, f"{why}: its scale")

    casts: list[Rule] = []
    for block, name, n_in, n_out in linear_shapes(setup):
        casts.append(save(block, f"{name}_weight_fp8", (n_in, n_out), fp8, Role.PARAM_DERIVED, why))
        casts.append(scale(block, f"{name}_weight", (n_in, 1)))
    heads = dims.a * dims.v_dim
    casts.append(save(Block.ATTN, "out_fp8", (dims.tokens, heads), fp8, Role.LINEAR_INPUT, why))
    casts.append(scale(Block.ATTN, "out", (1, heads)))
    return [r for r in rules if r.name not in RECOMPUTED] + casts
