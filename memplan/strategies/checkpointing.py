"""Activation checkpointing (``torch.utils.checkpoint``, non-reentrant): full and every-k segments, and
selective recompute of the attention core (Korthikanti et al. 2022).

Segments (Chen et al. 2016): every layer's saves are dropped; each segment of k layers keeps its input (a
``Block.CHECKPOINT`` residual, ⌈L/k⌉ of them) and re-runs its forward in backward. Selective: the attention
block leaves its core's saves out under it (``activations.attention_core_rules``), and the core re-runs.

Re-run FLOPs: torch.utils.checkpoint stops a recompute as soon as the last tensor backward needs is saved
again (``set_checkpoint_early_stop``, on by default). A matmul saves its inputs *before* it runs, so a region
whose last saving op is a matmul never re-runs that matmul: a segment ending in the MLP's down projection
(no residual dropout after it, whose mask is saved after it runs) skips it, and selective eager attention
skips P·V. The flash kernel saves its outputs, so it always re-runs. A checkpoint without early stop
re-runs whole regions (``Profile.checkpoint_reruns_all``: Megatron's own checkpoint, torchtitan's
``FullAC``; transformers' with ``use_reentrant=True``).

torchtitan's ``SelectiveAC`` (``Profile.op_selective_checkpoint``) is a per-op policy: each block keeps its
input and the outputs of every other mm (``op_selective_rules``), and re-runs the rest. On CUDA the SDPA op
is in its save list too: its outputs are cached and the attention core is not re-run (``sdpa_cache_rules``).
Eager, the cache holds the block's last mm (W2) although nothing re-reads it (the re-run stops before it);
under ``--compile`` (``blocks.profiles.compiled_sac``) the partitioner keeps only what the backward reads,
so W2's output is not kept (measured; the same re-run matmuls: W_O's output is read again to rebuild the
MLP norm's input).

Known limitations:
- NB: under ``SelectiveAC`` the peak's layer-backward moment (``analytic.peak``) is still the attention-core
  re-run's: the block's re-run saves during its backward are not modelled per op (the saves and FLOPs are).
- NB: on CUDA the cached SDPA op is cuDNN's (torchtitan's ``sdpa_kernel`` priority; head dims above 128 are
  refused, ``config.impl_rules``); checked under fake tensors with the CUDA op's meta kernel
  (tests/hf/test_torchtitan_cuda.py), not on a GPU. ROCm (MI300X) runs no cuDNN: not modelled apart. Its
  time is FlashAttention-2's (``time.attention`` has no cuDNN figure).
- NB: SP's all-gathers re-issued in the block's re-run are not added to the communication time
  (``time.comm.collectives``'s re-run rows count segment checkpointing's).
"""

from __future__ import annotations

from memplan.analytic import activations as act
from memplan.analytic.flops import layer_linear_flops
from memplan.blocks import fp8, llama4, mlp, moe
from memplan.blocks.attention.flops import attention_core_flops
from memplan.blocks.inventory import Block, Dims, Kept, Role, Rule, Scope, save
from memplan.blocks.profiles import checkpoints_alone, compiled_sac, hidden_dropouts, op_selective, profile_of
from memplan.config import Attention, Checkpointing, Device, DType, Fp8Recipe, Setup


def applies(setup: Setup) -> bool:
    return setup.strategy.checkpointing is not Checkpointing.NONE


def segments(setup: Setup) -> int:
    """Checkpointed segments of k layers: ⌈L / k⌉ (0 without segment checkpointing)."""
    k = setup.strategy.segment
    return -(-setup.model.num_layers // k) if k else 0


def op_selective_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """What one block under torchtitan's ``SelectiveAC`` keeps from forward to its backward (measured:
    measure/frameworks/titan.py ``keep_sac``). ``checkpoint_wrapper`` keeps the block's input; the policy
    (``SelectiveAC._wrap_block``) counts the block's ``aten.mm`` calls — ``nn.Linear`` on a 3-d input is
    ``view → mm → _unsafe_view`` on CPU — and caches the outputs of calls 1, 3, 5 (a call whose count is
    even is ``PREFER_RECOMPUTE``): with the fused ``wqkv`` they are W_QKV's [T, (a + 2·kv)·d], W1's [T, f]
    and W2's [T, h] (``w2(silu(w1(x)) * w3(x))``); W_O and W3 are recomputed. The CPU flash SDPA op
    (``_scaled_dot_product_flash_attention_for_cpu``) is not in the save list: recomputed. Under TP the mm
    outputs are the rank's (``dims`` of ``tp_model``; W2's a partial sum [T, h]); under SP the
    reduce-scatters after W_O and W2 (``_c10d_functional.reduce_scatter_tensor``, in the comm save list)
    are cached too, [b, s/t, h] each (the all-gathers and all-reduces are not: re-issued in the re-run).
    On CUDA the SDPA op's outputs are cached as well (``sdpa_cache_rules``)."""
    t, act = dims.tokens, dims.act
    par = setup.parallel
    scattered = (
        [
            save(
                Block.ATTN,
                "wo_reduce_scatter",
                (dims.b, dims.s, dims.h),
                act,
                Role.RESIDUAL,
                "SAC cache: reduce_scatter_tensor after W_O (SP)",
            ),
            save(
                Block.MLP,
                "w2_reduce_scatter",
                (dims.b, dims.s, dims.h),
                act,
                Role.RESIDUAL,
                "SAC cache: reduce_scatter_tensor after W2 (SP)",
            ),
        ]
        if par.sp and par.tp > 1
        else []
    )
    w2_out = save(Block.MLP, "w2_out", (t, dims.h), act, Role.MLP_INNER, "SAC cache: 5th mm (W2's output)")
    return [
        *scattered,
        *(sdpa_cache_rules(dims) if setup.device is Device.CUDA else []),
        *(
            fp8.compiled_sac_scale_rules(dims)
            if compiled_sac(setup) and setup.impl.fp8 is Fp8Recipe.TENSORWISE
            else fp8.sac_amax_rules(setup, dims)
        ),
        # Tagged as the block's first norm (a layer group), not a segment's input (Block.CHECKPOINT).
        save(
            Block.ATTN_NORM,
            "block_input",
            (dims.b, dims.s, dims.h),
            act,
            Role.RESIDUAL,
            "checkpoint_wrapper keeps the block's input",
        ),
        save(
            Block.ATTN,
            "wqkv_out",
            (t, (dims.a + 2 * dims.kv) * dims.d),
            act,
            Role.ATTN_QKV,
            "SAC cache: 1st mm of the block (W_QKV's output)",
        ),
        save(Block.MLP, "w1_out", (t, dims.f), act, Role.MLP_INNER, "SAC cache: 3rd mm (W1's output)"),
        # Compiled (compiled_sac), the partitioner keeps a MUST_SAVE output only where the backward reads
        # it: nothing reads W2's (the block's residual add passes its gradient through), so it is not kept.
        *(compiled_sac_cpu_rules(setup) if compiled_sac(setup) else [w2_out]),
    ]


CPU_GENERATOR_STATE = 5056
"""Bytes of the CPU generator's state (``torch.get_rng_state()``: a uint8 tensor of 5,056, mt19937's 624
words and its offsets)."""


def compiled_sac_cpu_rules(setup: Setup) -> list[Rule]:
    """Compiled ``SelectiveAC`` on CPU: the CPU flash op is not in the save list, so the partitioner re-runs
    it in backward, and the functionalised RNG of a random op keeps the generator's state for that re-run
    (``run_and_save_rng_state``). On CUDA the cached SDPA op is not re-run: nothing."""
    if setup.device is not Device.CPU:
        return []
    why = "compiled SelectiveAC: the CPU generator's state for the flash op's re-run (run_and_save_rng_state)"
    return [save(Block.ATTN, "rng_state", (CPU_GENERATOR_STATE,), DType.UINT8, Role.RNG_STATE, why)]


def sdpa_cache_rules(dims: Dims) -> list[Rule]:
    """On CUDA, what ``SelectiveAC`` caches of the attention: torchtitan's ``ScaledDotProductAttention`` runs
    SDPA under ``sdpa_kernel([CUDNN_ATTENTION, FLASH_ATTENTION, MATH], set_priority=True)``
    (models/common/attention.py), and torch's ``select_sdp_backend`` takes cuDNN first where
    ``can_use_cudnn_attention`` holds (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp: sm80-sm121,
    fp16/bf16, no mask, head dim <= 128 and a multiple of 8, GQA supported). SDPA's composite then calls
    ``aten._scaled_dot_product_cudnn_attention(q, k, v, None, compute_log_sumexp=True, ...)``
    (attention.cpp), an op ``_get_default_save_ops`` lists (MUST_SAVE). The cache holds its outputs, as
    its meta kernel shapes them (torch/_meta_registrations.py ``meta__scaled_dot_product_cudnn_attention``):
    the output [b, a, s, d] in q's layout (one storage, W_O's input after the transpose), the fp32
    logsumexp [b, a, s, 1], and the philox seed and offset, int64 (8 B each; the CUDA kernel makes them
    ``zeros({1}, kLong)`` on the GPU). cum_seq_q/k and the debug mask are None."""
    b, a, s, d = dims.b, dims.a, dims.s, dims.d
    why = "SAC cache: cuDNN SDPA's"
    return [
        save(Block.ATTN, "sdpa_out", (b, a, s, d), dims.act, Role.ATTN_OUT, f"{why} output"),
        save(Block.ATTN, "sdpa_lse", (b, a, s, 1), DType.FP32, Role.ATTN_LSE, f"{why} fp32 logsumexp"),
        save(Block.ATTN, "sdpa_philox_seed", (), DType.INT64, Role.RNG_STATE, f"{why} philox seed"),
        save(Block.ATTN, "sdpa_philox_offset", (), DType.INT64, Role.RNG_STATE, f"{why} philox offset"),
    ]


def op_selective_recompute(dims: Dims, cuda: bool = False) -> int:
    """Re-run FLOPs of one block under ``SelectiveAC``: the uncached mms, W_O (2·T·a·d·h) and W3
    (2·T·h·f), and on CPU the flash attention core (the CPU op is not in the save list; on CUDA the cached
    cuDNN op returns its outputs without running); the cached mms return their outputs without running."""
    linears = 2 * dims.tokens * dims.h * (dims.a * dims.d + dims.f)
    return linears if cuda else linears + attention_core_flops(dims)


def keeps(kept: list[Kept], setup: Setup) -> list[Kept]:
    """Segments: the layers' saves give way to one checkpoint input per segment, where they stood; under a
    per-op policy, to what the policy caches."""
    if op_selective(setup):
        first = next(i for i, k in enumerate(kept) if k.scope is Scope.LAYER)
        rest = [k for k in kept if k.scope is not Scope.LAYER]
        dims = Dims.of(setup)
        return (
            rest[:first] + act.kept(op_selective_rules(setup, dims), Scope.LAYER, dims.layers) + rest[first:]
        )
    if not setup.strategy.segment:
        return kept
    dims = Dims.of(setup)
    why = "checkpoint input: the segment is re-run"
    rule = save(Block.CHECKPOINT, "input", (dims.b, dims.s, dims.h), dims.act, Role.RESIDUAL, why)
    first = next(i for i, k in enumerate(kept) if k.scope is Scope.LAYER)
    rest = [k for k in kept if k.scope is not Scope.LAYER]
    inputs = act.kept([rule], Scope.LAYER, segments(setup))
    if checkpoints_alone(setup):  # the layers not checkpointed keep their saves
        plain = [
            k.model_copy(update={"count": k.count - segments(setup)}) for k in kept if k.scope is Scope.LAYER
        ]
        return rest[:first] + inputs + plain + rest[first:]
    return rest[:first] + inputs + rest[first:]


def recompute(setup: Setup, dims: Dims) -> int:
    whole = profile_of(setup).checkpoint_reruns_all  # no early stop: nothing skipped
    if setup.strategy.segment and llama4.applies(setup) and not llama4.is_uniform(setup.model):
        # Llama 4's kinds of layer, one checkpoint each (every-K refused): each kind's re-run per layer
        return sum(n * recompute(k, Dims.of(k)) // dims.layers for k, n in llama4.layer_kinds(setup))
    if setup.strategy.segment:
        layer_fwd = layer_linear_flops(setup, dims) + attention_core_flops(dims)
        # The last save of a segment with residual dropout is its mask, made after everything ran.
        last = moe.early_stop_skip if setup.model.moe else mlp.early_stop_skip
        # A norm after the MLP (post_norms) saves after W_down, so the re-run reaches W_down too.
        stops = hidden_dropouts(setup)[0] == 0 and not setup.model.post_norms and not whole
        dense = moe.dense_layer_setup(setup)
        if dense is not None:  # DeepSeek: each layer its own checkpoint (blocks.hf.deepseek.check)
            k = moe.dense_mlp_layers(setup)
            ours = _each_layer(setup, dims, dims.layers - k, moe.early_stop_skip(setup, dims) if stops else 0)
            ddims = Dims.of(dense)
            return ours + _each_layer(dense, ddims, k, mlp.early_stop_skip(dense, ddims) if stops else 0)
        skipped = last(setup, dims) if stops else 0
        rerun = segments(setup) if checkpoints_alone(setup) else dims.layers  # layers re-run
        return rerun * layer_fwd - segments(setup) * skipped
    if op_selective(setup):
        return dims.layers * op_selective_recompute(dims, cuda=setup.device is Device.CUDA)
    if setup.strategy.checkpointing is Checkpointing.SELECTIVE:
        core = attention_core_flops(dims)
        return dims.layers * (core if setup.strategy.attention is Attention.FLASH or whole else core // 2)
    return 0


def _each_layer(setup: Setup, dims: Dims, layers: int, skipped: int) -> int:
    """The re-run forward of ``layers`` layers of one kind (DeepSeek's MoE layers, or its dense first
    ones under ``moe.dense_layer_setup``), each checkpointed alone (full checkpointing): projections,
    core and MLP, less what the early stop skips (``skipped``)."""
    return layers * (layer_linear_flops(setup, dims) + attention_core_flops(dims) - skipped)
