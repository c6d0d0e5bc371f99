"""Attention: W_Q/W_K/W_V [h, a·d | kv·d], W_O [a·d, h] (+ biases), rotary embeddings, and the core — eager
(explicit QKᵀ, causal ``masked_fill``, softmax, dropout, ·V) or flash (the SDPA flash kernel).

FLOPs: ``blocks.attention.flops``; the eager core's forward locals beyond its saves:
``blocks.attention.eager_locals``; which layers slide: ``blocks.attention.windows``; the rotary tables:
``blocks.attention.rope``; what a forward makes once for every layer (tables, masks):
``blocks.attention.constants``; what its backward kernels hold on CUDA: ``blocks.attention.workspace``.

Megatron-core's profile (``blocks.megatron``): q, k, v as views of W_QKV's one output (``qkv_view_rules``),
the fused causal softmax where its kernel runs (``fused_softmax_runs``), flash-attn's RNG state.

Implementation profiles (``blocks.profile``) change the core's saves: transformers' fp32 eager softmax,
additive mask, CPU dropout noise, SDPA's math kernel on CPU with dropout (``Core.MATH``), a sliding
window's mask with k and v repeated.
"""

from __future__ import annotations

from enum import StrEnum

from memplan.blocks import linear_params
from memplan.blocks.attention.rope import rope_cache_rules
from memplan.blocks.attention.windows import full_and_sliding
from memplan.blocks.inventory import Block, Dims, Role, Rule, save
from memplan.blocks.profiles import dropout_keeps, profile_of
from memplan.config import Attention, Checkpointing, Device, DType, Impl, ModelConfig, PositionType, Setup

FP32, BOOL, INT64, UINT64, COMPLEX64 = DType.FP32, DType.BOOL, DType.INT64, DType.UINT64, DType.COMPLEX64
B, R = Block, Role


class Core(StrEnum):
    """The kernel the attention core runs."""

    EAGER = "eager"
    """Explicit QKᵀ, mask, softmax, dropout, ·V (``--attention eager``)."""
    FLASH = "flash"
    """The SDPA flash kernel: q, k, v, out and the logsumexp."""
    MATH = "math"
    """SDPA's math fallback (``Profile.sdpa_dispatch``: on CPU with attention dropout): eager's ops in
    fp32."""


def core_of(setup: Setup) -> Core:
    """Which kernel runs the core: eager, or SDPA's flash kernel unless torch's dispatcher picks math."""
    if setup.strategy.attention is Attention.EAGER:
        return Core.EAGER
    # torch's CPU flash kernel needs one head width for q, k and v (sdp_utils_cpp.cpp
    # ``check_head_dim_size_cpp``): MLA's d_n + d_r keys with d_v values fall back to math.
    mla = setup.model.mla
    widths = mla is not None and mla.qk_head_dim != mla.v_head_dim
    math = setup.device is Device.CPU and (setup.model.attn_dropout > 0 or widths)
    return Core.MATH if math and profile_of(setup).sdpa_dispatch else Core.FLASH


def math_dropout_core(setup: Setup) -> bool:
    """SDPA's math kernel with attention dropout (``Core.MATH``, p > 0: transformers' SDPA in training on
    CPU). NB: MLA's math core without dropout (d_n + d_r keys, d_v values) is not read here: its softmax
    backward may top its P·V backward, not measured."""
    return core_of(setup) is Core.MATH and setup.model.attn_dropout > 0


def math_backward_buffers(dims: Dims) -> int:
    """The top of the math kernel's backward (``_scaled_dot_product_attention_math``: ``attn = dropout(
    softmax(q·kᵀ))``, ``attn @ v`` on fp32 copies of 16-bit q, k, v, k and v repeated to a heads, the
    output cast back): at P·V's backward, dO in fp32 [b, a, s, d_v] (the cast's backward, a copy of
    W_O's input gradient, which is freed with it; fp32 activations: that gradient itself), dV = attnᵀ·dO
    and d(attn) = dO·vᵀ [b, a, s, s], all fp32 — before the bmm's backward returns and frees dO, the
    repeated v and the dropped probabilities (later steps, each a [b, a, s, s] made as one is freed,
    stay below). Measured: transformers' Granite and StarCoder2 (tests/hf/test_math_core_peak.py)."""
    b, a, s = dims.b, dims.a, dims.s
    return (2 * b * a * s * dims.v_dim + b * a * s * s) * FP32.bytes


def fp32_softmax_gradients(setup: Setup, dims: Dims) -> int:
    """transformers' eager core (``Profile.eager_fp32_softmax``: ``softmax(dtype=float32).to(A)``, A
    16-bit, no dropout) at its softmax's backward, beyond the two [b, a, s, s] in A that the attention's
    moment counts (dP and dS, the probabilities kept): P·V's backward makes dP in A and frees the
    probabilities' A copy (its save, its last use); ``.to(A)``'s backward casts dP to fp32 (dP in A
    freed); ``_softmax_backward_data`` makes dS in fp32 beside it: 2·4 − A bytes an element alive where the
    A-dtype reading counts 2·A. Measured (transformers, fake tensors, two layers, s 512, bf16-mixed,
    eager): the softmax's backward tops the layer backward, one [b, a, s, s] bf16 under before — Llama 3
    8B's 16,777,216 B, DeepSeek-V2-Lite's 8,388,608 B. 0 with attention dropout (its mask and dropped
    probabilities, not measured here), with fp32 activations (one storage) or gpt-oss's sinks (softmax in
    A)."""
    if core_of(setup) is not Core.EAGER or not profile_of(setup).eager_fp32_softmax:
        return 0
    if setup.model.attn_dropout > 0 or setup.model.attn_sinks or dims.act is FP32:
        return 0
    cells = dims.b * dims.a * dims.s * dims.s
    return cells * (2 * FP32.bytes - dims.act.bytes) - 2 * cells * dims.act.bytes


def mqa_value_gradient_over_save(setup: Setup, dims: Dims) -> int:
    """P·V's backward under MQA (kv = 1) in transformers' eager core at b = 1, where ``repeat_kv`` is a
    view and v reaches the core as it was saved (``projection_rules``: its one head; or the fused
    ``query_key_value`` output it is a view of, Falcon's without the KV cache): it frees that storage and
    makes dV at a heads (the expand's backward sums them later), where the attention's moment counts the
    two as equal: dV less v's storage more. Measured (eager, two layers): Gemma-3 1B's widths (4 heads of
    256) 6,291,456 B under at s 4,096, 12,582,912 B at 8,192; Falcon-7B's (71 heads of 64) 9,175,040 B
    under at s 1,024 (v the cache's copy), and under full checkpointing 262,144 B over (the fused output,
    2·T·d wider than dV)."""
    prof = profile_of(setup)
    if core_of(setup) is not Core.EAGER or dims.kv != 1 or dims.b != 1 or not prof.repeat_kv_view:
        return 0
    saves = {r.name: r.bytes for r in projection_rules(setup, dims)}
    v = saves.get("attn.v", saves.get("attn.qkv"))
    return 0 if v is None else dims.tokens * dims.a * dims.d * dims.act.bytes - v


def window_masked(setup: Setup, dims: Dims) -> bool:
    """Whether the code passes SDPA an explicit mask: a sliding window W set, honoured
    (``Profile.window_mask``) and s ≥ W (below it the window covers every causal cell and SDPA's
    ``is_causal`` does it); or always (``Profile.sdpa_mask_always``, Falcon)."""
    w, prof = setup.model.sliding_window, profile_of(setup)
    return prof.sdpa_mask_always or (prof.window_mask and w is not None and dims.s >= w)


def sdpa_kv_heads(setup: Setup, dims: Dims) -> int:
    """The k and v heads SDPA's flash kernel is handed, and so the heads of the dk and dv its backward
    returns: a where the code passes an explicit mask (``window_masked``), since transformers then
    repeats k and v to a heads first (``repeat_kv``: a copy for GQA, an expand view for MQA — the
    kernel's gradient has its input's shape either way, summed back to kv heads by the repeat's own
    backward after); kv otherwise (``enable_gqa``, or no repeat). Measured: Falcon-7B (MQA, its mask
    always passed) at s 2,048 holds dq, dk and dv of [T, a·d] each at the core's backward."""
    return dims.a if window_masked(setup, dims) else dims.kv


def qk_norm_params(m: ModelConfig) -> int:
    """Qwen3's q_norm and k_norm: an RMSNorm weight [d] each; OLMo-2's over the whole projection outputs
    (``qk_norm_whole``): [a·d] and [kv·d]."""
    if m.qk_norm_whole:
        return m.q_width + m.kv_width
    return 2 * m.dim if m.qk_norm else 0


def attention_params(m: ModelConfig) -> tuple[int, int, int, int]:
    """W_Q, W_K, W_V and W_O with their biases."""
    h = m.hidden_size
    kv = linear_params(h, m.kv_width, m.qkv_bias)
    return linear_params(h, m.q_width, m.qkv_bias), kv, kv, linear_params(m.q_width, h, m.out_bias)


def projection_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """Input of W_Q/W_K/W_V and the post-RoPE q, k and v the attention core reads; under a fused
    ``qkv_proj`` whose v slice reaches the core as a view, that whole output in v's place."""
    first, *rest = unfused_projection_rules(setup, dims)
    rules = [first, *rope_cache_rules(setup, dims), *rest]  # W_Q's input, the layer's rotary tables, …
    if not fused_v_is_view(setup, dims):
        return rules
    b, s, a, kv, d = dims.b, dims.s, dims.a, dims.kv, dims.d
    why = "qkv_proj's output: the core keeps v, a view of its slice, so all of it stays"
    qkv = save(B.ATTN, "qkv", (b, s, (a + 2 * kv) * d), dims.act, R.ATTN_QKV, why)
    return [qkv if r.name == "attn.v" else r for r in rules]


def fused_v_is_view(setup: Setup, dims: Dims) -> bool:
    """Whether the core keeps v as a view of a fused ``qkv_proj`` output (``Profile.fused_qkv``,
    Phi-3's ``qkv[..., q+k:].view(...).transpose(1, 2)``): not when the ``DynamicCache`` cats it into a
    copy (``kv_cache``); nor when k and v are repeated to a heads, by ``repeat_kv`` (GQA: eager, or SDPA
    with a window's mask, ``use_gqa_in_sdpa`` false) or by SDPA's math kernel; nor when eager's
    ``torch.matmul`` folds [b, a, s, d] to [b·a, s, d], a copy for b > 1; nor when the math kernel upcasts
    16-bit v to fp32. MQA's ``repeat_kv`` is an expand + reshape view (``Profile.repeat_kv_view``)."""
    prof = profile_of(setup)
    core = core_of(setup)
    if not prof.fused_qkv or prof.kv_cache or setup.strategy.checkpointing is Checkpointing.SELECTIVE:
        return False
    gqa = dims.kv < dims.a and not (dims.kv == 1 and prof.repeat_kv_view)
    if core is Core.MATH:
        return dims.kv == dims.a and dims.act.bytes == 4
    if core is Core.EAGER:
        return not gqa and dims.b == 1
    return not (gqa and window_masked(setup, dims))


def unfused_projection_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """Input of W_Q/W_K/W_V and the post-RoPE q, k and v the attention core reads."""
    b, s, h, a, kv, d, act = dims.b, dims.s, dims.h, dims.a, dims.kv, dims.d, dims.act
    rules = [
        save(B.ATTN, "input", (b, s, h), act, R.LINEAR_INPUT, "input of W_Q/W_K/W_V: dW = Xᵀ·dY needs X")
    ]
    core = core_of(setup)
    core_recomputed = setup.strategy.checkpointing is Checkpointing.SELECTIVE
    if profile_of(setup).qkv_views:
        return [*rules, *qkv_view_rules(setup, dims, core is Core.EAGER and not core_recomputed)]
    if core is Core.MATH and not core_recomputed:
        # _scaled_dot_product_attention_math: q·√scale and k·√scale (k, v repeated to a heads) in fp32.
        why = "fp32 copy (SDPA's math kernel upcasts 16-bit inputs)"
        return [
            *rules,
            save(B.ATTN, "q", (b, a, s, d), FP32, R.ATTN_QKV, f"Q·√scale for QKᵀ, {why}"),
            save(B.ATTN, "k", (b, a, s, d), FP32, R.ATTN_QKV, f"K·√scale, repeated, for QKᵀ, {why}"),
            save(B.ATTN, "v", (b, a, s, d), FP32, R.ATTN_QKV, f"V, repeated, for P·V, {why}"),
        ]
    # MQA's repeat_kv is an expand + reshape view (Profile.repeat_kv_view): k and v keep kv = 1 head.
    mqa_view = kv == 1 and profile_of(setup).repeat_kv_view
    if core is Core.FLASH and window_masked(setup, dims) and not core_recomputed:
        why = "flash backward recomputes S = QKᵀ; with a mask transformers repeats k and v (repeat_kv)"
        heads = kv if mqa_view else a
        return [
            *rules,
            save(B.ATTN, "q", (b, a, s, d), act, R.ATTN_QKV, why),
            save(B.ATTN, "k", (b, heads, s, d), act, R.ATTN_QKV, why),
            save(B.ATTN, "v", (b, heads, s, d), act, R.ATTN_QKV, why),
        ]
    if core is Core.EAGER and not core_recomputed:
        # The matmuls read contiguous [b, a, s, d] copies; GQA repeats k and v to a heads (repeat_kv).
        # MQA's view has a stride-0 head dimension: torch.matmul's fold to [b·a, s, d] views it when
        # b = 1 and copies it to a heads when b > 1 (b and the stride-0 heads cannot merge).
        heads = kv if mqa_view and b == 1 else a
        return [
            *rules,
            save(B.ATTN, "q", (b, a, s, d), act, R.ATTN_QKV, "Q for QKᵀ: dK = dSᵀ·Q"),
            save(B.ATTN, "k", (b, heads, s, d), act, R.ATTN_QKV, "K (repeat_kv) for QKᵀ: dQ = dS·K"),
            save(B.ATTN, "v", (b, heads, s, d), act, R.ATTN_QKV, "V (repeat_kv) for P·V: dP = dO·Vᵀ"),
        ]
    # Flash kernel, or the inputs the selective checkpoint keeps: q and k after RoPE (a new tensor) or
    # the projection output itself; v is always the projection output [b, s, kv·d].
    why = "input of the recomputed attention core" if core_recomputed else "flash backward recomputes S = QKᵀ"
    return [
        *rules,
        save(B.ATTN, "q", (b, a, s, d), act, R.ATTN_QKV, why),
        save(B.ATTN, "k", (b, kv, s, d), act, R.ATTN_QKV, why),
        save(B.ATTN, "v", (b, s, kv * d), act, R.ATTN_QKV, why),
    ]


def qkv_view_rules(setup: Setup, dims: Dims, eager_core: bool) -> list[Rule]:
    """q, k, v split off one projection output (``Profile.qkv_views``): a saved view keeps that whole
    buffer alive, [b, s, (a + 2·kv)·d] in all. New tensors instead: q and k after RoPE (Megatron's
    ``apply_rotary_pos_emb``, GPT-NeoX's ``torch.cat`` of the rotated and passed dims); q under GQA, whose
    ``reshape`` to [s, b, a, d] cannot view Megatron's split (its groups are (a/g + 2)·d apart, not
    (a/g)·d); in Megatron's eager core (``DotProductAttention``) k and v repeated to a heads under GQA
    (``repeat_interleave``); k and v under transformers' KV cache (``Profile.kv_cache``); all three in
    SDPA's math path (q·√scale, kᵀ·√scale, v upcast to fp32 when 16-bit; ``Core.MATH``); and, with b > 1,
    the views transformers' eager ``torch.matmul`` reshapes to [b·a, s, d] (``Profile.matmul_copies_views``);
    v under Megatron's TE attention with RoPE fusion (``Profile.te_contiguous_qkv``).
    Megatron's eager core keeps q and k (``baddbmm``) and v (``bmm``); the flash kernel and the selective
    ``CheckpointFunction`` keep q, k and v as they come."""
    b, s, a, kv, d, act = dims.b, dims.s, dims.a, dims.kv, dims.d, dims.act
    prof = profile_of(setup)
    rope, gqa, math = setup.model.position is PositionType.ROPE, kv < a, core_of(setup) is Core.MATH
    copied = eager_core and b > 1 and prof.matmul_copies_views
    # k and v repeated to a heads: Megatron's eager core under GQA; transformers' repeat_kv in eager and in
    # SDPA with a mask (not MQA's one head: a view, Profile.repeat_kv_view); SDPA's math kernel (enable_gqa).
    masked = core_of(setup) is Core.FLASH and window_masked(setup, dims)
    mqa_view = kv == 1 and prof.repeat_kv_view
    repeated = ((eager_core or masked) and gqa and not mqa_view) or (math and gqa)
    why = "input of the attention core's backward"
    kv_heads = a if repeated or copied else kv
    # Megatron's TE attention with RoPE fusion copies v out of the buffer (Profile.te_contiguous_qkv).
    te_copy = prof.te_contiguous_qkv and rope and core_of(setup) is Core.FLASH
    # (name, new tensor?, heads)
    parts = [
        ("q", rope or gqa or math or copied, a),
        ("k", rope or repeated or prof.kv_cache or math or copied, kv_heads),
        ("v", repeated or prof.kv_cache or (math and act.bytes < 4) or copied or te_copy, kv_heads),
    ]
    dtype = FP32 if math else act
    rules = [save(B.ATTN, n, (b, h, s, d), dtype, R.ATTN_QKV, why) for n, new, h in parts if new]
    if not all(new for _, new, _ in parts):
        why_buffer = "W_QKV's output: the q, k or v views the core keeps hold all of it"
        rules.append(save(B.ATTN, "qkv", (b, s, (a + 2 * kv) * d), act, R.ATTN_QKV, why_buffer))
    return rules


def fused_softmax_runs(setup: Setup, dims: Dims) -> bool:
    """Whether Megatron-core's fused causal softmax runs (``FusedScaleMaskSoftmax.is_kernel_available``):
    16-bit scores, 16 < s ≤ 4096, s a multiple of 4, and b·a (the rank's heads) a multiple of the kernel's
    batches per block (``get_batch_per_block``: 128 threads in warps min(2^⌈log₂ s⌉, 32) wide, two batches
    a warp up to 128 keys, else one: 8 for s ≤ 128, else 4)."""
    if not profile_of(setup).fused_causal_softmax or dims.act not in (DType.FP16, DType.BF16):
        return False
    per_block = 8 if dims.s <= 128 else 4
    return 16 < dims.s <= 4096 and dims.s % 4 == 0 and (dims.b * dims.a) % per_block == 0


def attention_core_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """Saves inside the attention core (absent under selective recompute)."""
    if setup.strategy.checkpointing is Checkpointing.SELECTIVE:
        return []
    core = core_of(setup)
    if core is Core.FLASH:
        return flash_rules(setup, dims)
    b, s, a, act = dims.b, dims.s, dims.a, dims.act
    probs = (b, a, s, s)
    if core is Core.MATH:
        return [
            save(B.ATTN, "probs", probs, FP32, R.ATTN_PROBS, "fp32 softmax output (SDPA's math kernel)"),
            *dropout_rules(setup, probs, FP32),
        ]
    if setup.model.attn_sinks:
        return sink_rules(dims)
    softcap = []
    if setup.model.attn_softcap is not None:
        # Gemma-2's eager_attention_forward: tanh(scores / c) · c; tanh keeps its output (scalars: nothing).
        why = "tanh of the softcapped scores: d tanh = 1 − tanh²"
        softcap = [save(B.ATTN, "softcap_tanh", probs, act, R.ATTN_PROBS, why)]
    if profile_of(setup).eager_fp32_softmax:
        # softmax(dtype=float32).to(query.dtype): the fp32 output, and its copy when P·V reads it (one
        # storage when A is fp32).
        why = "softmax(dtype=float32) output: dS = P·(dP − Σ dP·P)"
        rules = [*softcap, save(B.ATTN, "probs_fp32", probs, FP32, R.ATTN_PROBS, why)]
        if setup.model.attn_dropout == 0 and act is not FP32:
            why = "the probabilities cast to the activation dtype, for P·V: dV = Pᵀ·dO"
            rules.append(save(B.ATTN, "probs", probs, act, R.ATTN_PROBS, why))
        return rules + dropout_rules(setup, probs, act)
    # Megatron's torch fallback (no fused kernel) keeps the softmax output in fp32 (softmax_in_fp32).
    fp32 = profile_of(setup).fused_causal_softmax and not fused_softmax_runs(setup, dims)
    why = "softmax output: dS = P·(dP − Σ dP·P)"
    kept = save(B.ATTN, "probs", probs, FP32 if fp32 else act, R.ATTN_PROBS, why)
    return [*softcap, kept, *dropout_rules(setup, probs, act)]


def last_ring_rank(setup: Setup, dims: Dims) -> bool:
    """Whether the estimate is of the last context-parallel rank (``--cp-rank c−1``), whose merged output
    stays in the kernel's layout and is W_O's input itself."""
    return dims.ring > 1 and setup.parallel.cp_rank == dims.ring - 1


def head_major_output(setup: Setup) -> bool:
    """Whether the flash kernel's output comes out head-major ([b, a, s, d]-contiguous): q is head-major —
    GPT-NeoX's, StableLM's, GLM's ``torch.cat`` rotary (``Profile.rotary_cat``), Phi-3's fused QKV — and
    the kernel's output takes q's layout; W_O then reads a contiguous copy (``flash_rules``' ``kernel_out``)
    and, on CUDA, ``_flash_attention_backward`` copies it again (``out.contiguous()`` of its [b, s, a, d]
    view)."""
    prof = profile_of(setup)
    rope = setup.model.position is PositionType.ROPE
    return prof.fused_qkv or (prof.sdpa_dispatch and prof.rotary_cat and rope)


def sink_rules(dims: Dims) -> list[Rule]:
    """gpt-oss's ``eager_attention_forward``: the sinks [a] expanded to one more column of every row,
    ``combined - combined.max(-1, keepdim=True).values`` (``max.dim`` keeps its indices [b, a, s, 1] int64),
    ``softmax(dtype=A)`` keeps its output [b, a, s, s+1]; P·V reads the first s columns, a view of it
    (``matmul`` of the strided slice: no copy)."""
    b, s, a, act = dims.b, dims.s, dims.a, dims.act
    return [
        save(B.ATTN, "sink_max_index", (b, a, s, 1), INT64, R.ATTN_PROBS, "max.dim backward scatters at it"),
        save(B.ATTN, "probs", (b, a, s, s + 1), act, R.ATTN_PROBS, "softmax over the scores and the sink"),
    ]


def sink_backward_extra(setup: Setup, dims: Dims) -> int:
    """What gpt-oss's eager core's backward (``sink_rules``) holds beyond the two [b, a, s, s] buffers of a
    plain eager core's at its top, ``max.dim``'s backward (``combined - combined.max(-1).values``): the
    softmax's gradient [b, a, s, s+1] (the slice ``probs[..., :-1]``'s backward padded it to the sink
    column, the probabilities freed), the max values' gradient ``-d`` summed over the row [b, a, s, 1],
    and that backward's zeros and ``scatter`` [b, a, s, s+1] — two [b, a, s, s+1] and one [b, a, s, 1]
    beside the live set, whose probabilities [b, a, s, s+1] are freed (measured at gpt-oss-20b's widths,
    s 512, layer 0: 196,608 B above the two [b, a, s, s]). 0 without sinks. NB: with attention dropout
    not measured (the same extra counted)."""
    if not setup.model.attn_sinks:
        return 0
    rows = dims.b * dims.a * dims.s * dims.act.bytes
    return 2 * rows + rows


def dropout_rules(setup: Setup, probs: tuple[int, ...], dtype: DType) -> list[Rule]:
    """Dropout on the probabilities (when p > 0): ``native_dropout``'s bool mask, or on CPU under
    ``Profile.cpu_dropout_noise`` the noise it multiplies by; and the dropped probabilities for P·V."""
    if setup.model.attn_dropout == 0:
        return []
    keep = dropout_keeps(setup, dtype)
    if keep is not BOOL:
        why = "dropout noise bernoulli(1−p)/(1−p) (CPU at::dropout: input·noise): dX = dY·noise"
        kept = save(B.ATTN, "dropout_noise", probs, keep, R.ATTN_DROPOUT_MASK, why)
    else:
        why = "dropout mask on the probabilities"
        kept = save(B.ATTN, "dropout_mask", probs, BOOL, R.ATTN_DROPOUT_MASK, why)
    why = "dropped probabilities for P·V: dV = Pᵀ·dO"
    return [kept, save(B.ATTN, "probs_dropped", probs, dtype, R.ATTN_PROBS, why)]


def flash_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """The flash kernel's own saves: the logsumexp, a window's mask, ring and CUDA extras."""
    b, s, a, act = dims.b, dims.s, dims.a, dims.act
    lse = (b, a, s, 1) if titan_cudnn(setup) else (b, a, s)  # cuDNN's meta kernel: [B, H, S_Q, 1]
    rules = [save(B.ATTN, "lse", lse, FP32, R.ATTN_LSE, "row logsumexp: backward rebuilds P from S")]
    if window_masked(setup, dims):
        why = "the window's bool mask converted to the query's dtype (CPU flash kernel), per layer"
        rules.append(save(B.ATTN, "window_mask", (b, 1, s, s), act, R.CAUSAL_MASK, why))
    if head_major_output(setup):
        # The kernel's output takes q's layout (the CPU kernel and its meta twin alike); GPT-NeoX's q
        # (and StableLM's, GLM's: Profile.rotary_cat) is torch.cat's contiguous [b, a, s, d], so
        # transpose(1, 2).contiguous() copies the output (W_O's input, ``attn.out``) and the kernel keeps
        # its own. GPT-2's q, a view in [b, s, a, d] layout, and Falcon's, rotated elementwise in that
        # layout, give an output whose transpose is W_O's input itself. Phi-3's apply_rotary_pos_emb cats
        # the rotated dims with the passed ones (none at full rotary): head-major (``Profile.fused_qkv``).
        why = "flash output in q's [b, a, s, d] layout; W_O reads a contiguous copy"
        rules.append(save(B.ATTN, "kernel_out", (b, a, s, dims.d), act, R.ATTN_OUT, why))
    if dims.ring > 1:
        # torch's ring merge (_SDPAMerger) re-concatenates a partially updated output head-major on
        # every rank but the last (the most loaded ones): W_O's input [b, s, a·d] is then a copy and
        # the output the ring backward reads is kept apart. The last rank (--cp-rank c−1) merges whole
        # blocks in the kernel's layout: the merged output is W_O's input too, a view
        # (``activations.layer_rules`` keeps no copy for it).
        why = "merged ring-attention output: the flash backward of every ring step reads it"
        if last_ring_rank(setup, dims):
            why += "; on the last rank also W_O's input (a view)"
        rules.append(save(B.ATTN, "merged_out", (b, a, s, dims.d), act, R.ATTN_OUT, why))
    if titan_cudnn(setup):
        # cuDNN's philox seed and offset: int64, 8 B each (meta__scaled_dot_product_cudnn_attention: [];
        # the CUDA kernel: zeros({1}, kLong)), saved by its autograd node with or without dropout
        why = "cuDNN SDPA's philox"
        rules += [
            save(B.ATTN, "philox_seed", (), INT64, R.RNG_STATE, f"{why} seed: the backward's dropout RNG"),
            save(B.ATTN, "philox_offset", (), INT64, R.RNG_STATE, f"{why} offset"),
        ]
    elif setup.device is Device.CUDA and profile_of(setup).flash_rng_int64:
        why = "flash-attn's rng_state (seed, offset): the backward regenerates dropout from it"
        rules.append(save(B.ATTN, "rng_state", (2,), INT64, R.RNG_STATE, why))
    elif setup.device is Device.CUDA:
        # PyTorch's flash_api.cpp (mha_fwd, "[Note] BC breaking change to flash seed/offset", torch ≥
        # 2.5) returns rng_state = empty({2}, uint64) and an unused empty({}, uint64) on the GPU, with or
        # without dropout; autograd saves both (the backward takes philox_seed and philox_offset):
        # 16 + 8 = 24 B per layer. The meta kernel returns the same (``trace --device cuda``).
        why = "the CUDA flash backward regenerates dropout from"
        rules += [
            save(B.ATTN, "philox_seed", (2,), UINT64, R.RNG_STATE, f"RNG state (seed, offset) {why}"),
            save(B.ATTN, "philox_offset", (), UINT64, R.RNG_STATE, "unused offset slot, saved all the same"),
        ]
    return rules


def titan_cudnn(setup: Setup) -> bool:
    """torchtitan's SDPA on CUDA runs cuDNN's kernel: its ``ScaledDotProductAttention`` puts
    ``CUDNN_ATTENTION`` first (``sdpa_kernel(..., set_priority=True)``, models/common/attention.py) and
    torch's ``can_use_cudnn_attention`` holds for a causal, unmasked 16-bit call with a head dim <= 128 and a
    multiple of 8, GQA included (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, sm80-sm121;
    measure.frameworks.titan_attention ``cudnn_attention``). Above 128 the pick depends on the GPU and cuDNN's
    version: the flash rules stay."""
    d = setup.model.dim
    cuda = setup.device is Device.CUDA and setup.impl.impl is Impl.TORCHTITAN
    return cuda and d <= 128 and d % 8 == 0


def full_layer_setup(setup: Setup) -> Setup | None:
    """The setup of a full-attention layer when its saves differ from a sliding layer's, else None: under
    SDPA with both layer types and a window shorter than the sequence, the sliding layers pass SDPA an
    explicit mask (kept, with k and v repeated: ``window_masked``) and the full layers none
    (``is_causal``); under eager attention every layer keeps the same [b, a, s, s] tensors (the masks are
    the forward's constants)."""
    m = setup.model
    eager = setup.strategy.attention is Attention.EAGER
    if eager or not full_and_sliding(m) or not window_masked(setup, Dims.of(setup)):
        return None
    full = m.model_copy(update={"sliding_window": None, "sliding_window_pattern": None, "full_layers": None})
    return setup.model_copy(update={"model": full})
