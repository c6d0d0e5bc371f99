"""Attention: W_Q/W_K/W_V [h, a·d | kv·d], W_O [a·d, h] (+ biases), rotary embeddings, and the core — eager
(explicit QKᵀ, causal ``masked_fill``, softmax, dropout, ·V) or flash (the SDPA flash kernel).

FLOPs (FlopCounterMode): the projections 2·T·h·(a·d) + 2·2·T·h·(kv·d) + 2·T·(a·d)·h forward; the core's
QKᵀ and P·V 2·b·a·s²·d each (causal not halved); backward 2× for the projections and eager's bmms, and for
flash five s×s products (S recomputed, dP, dV, dQ, dK), one of them the kernel's own re-computation.
"""

from __future__ import annotations

from memplan.analytic.inventory import Block, Dims, Role, Rule, save
from memplan.blocks import linear_params, mm
from memplan.blocks.profiles import profile_of
from memplan.config import Attention, Checkpointing, Device, DType, ModelConfig, PositionType, Setup

FP32, BOOL, UINT64 = DType.FP32, DType.BOOL, DType.UINT64
B, R = Block, Role


def attention_params(m: ModelConfig) -> tuple[int, int, int, int]:
    """W_Q, W_K, W_V and W_O with their biases."""
    h = m.hidden_size
    kv = linear_params(h, m.kv_width, m.qkv_bias)
    return linear_params(h, m.q_width, m.qkv_bias), kv, kv, linear_params(m.q_width, h, m.out_bias)


def projection_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """Input of W_Q/W_K/W_V and the post-RoPE q, k and v the attention core reads."""
    b, s, h, a, kv, d, act = dims.b, dims.s, dims.h, dims.a, dims.kv, dims.d, dims.act
    rules = [
        save(B.ATTN, "input", (b, s, h), act, R.LINEAR_INPUT, "input of W_Q/W_K/W_V: dW = Xᵀ·dY needs X")
    ]
    eager = setup.strategy.attention is Attention.EAGER
    core_recomputed = setup.strategy.checkpointing is Checkpointing.SELECTIVE
    if eager and not core_recomputed:
        # The matmuls read contiguous [b, a, s, d] copies; GQA repeats k and v to a heads (repeat_kv).
        heads = kv if kv == 1 and profile_of(setup).repeat_kv_view else a
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


def attention_core_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """Saves inside the attention core (absent under selective recompute)."""
    b, s, a, act = dims.b, dims.s, dims.a, dims.act
    if setup.strategy.checkpointing is Checkpointing.SELECTIVE:
        return []
    p = setup.model.attn_dropout
    if setup.strategy.attention is Attention.FLASH:
        rules = [
            save(B.ATTN, "lse", (b, a, s), FP32, R.ATTN_LSE, "row logsumexp: backward rebuilds P from S")
        ]
        if profile_of(setup).sdpa_mask_converted and sliding_mask(setup, dims):
            why = "bool mask converted to the query dtype by SDPA: the flash backward reads it"
            rules.append(save(B.ATTN, "mask", (b, 1, s, s), act, R.CAUSAL_MASK, why))
        if profile_of(setup).fused_qkv:
            why = "SDPA's output, head-major like the query; W_O's input is its contiguous copy"
            rules.append(save(B.ATTN, "kernel_out", (b, a, s, dims.d), act, R.ATTN_OUT, why))
        if dims.ring > 1:
            # torch's ring merge (_SDPAMerger) re-concatenates a partially updated output head-major on
            # every rank but the last (the most loaded ones): W_O's input [b, s, a·d] is then a copy and
            # the output the ring backward reads is kept apart.
            why = "merged ring-attention output: the flash backward of every ring step reads it"
            rules.append(save(B.ATTN, "merged_out", (b, a, s, dims.d), act, R.ATTN_OUT, why))
        if setup.device is Device.CUDA:
            # PyTorch's flash_api.cpp (mha_fwd, "[Note] BC breaking change to flash seed/offset", torch ≥
            # 2.5) returns rng_state = empty({2}, uint64) and an unused empty({}, uint64) on the GPU, with or
            # without dropout; autograd saves both (the backward takes philox_seed and philox_offset):
            # 16 + 8 = 24 B per layer. The meta kernel returns the same (``trace --device cuda``).
            why = "the CUDA flash backward regenerates dropout from"
            rules += [
                save(B.ATTN, "philox_seed", (2,), UINT64, R.RNG_STATE, f"RNG state (seed, offset) {why}"),
                save(
                    B.ATTN, "philox_offset", (), UINT64, R.RNG_STATE, "unused offset slot, saved all the same"
                ),
            ]
        return rules
    rules = [save(B.ATTN, "probs", (b, a, s, s), act, R.ATTN_PROBS, "softmax output: dS = P·(dP − Σ dP·P)")]
    if setup.model.attn_softcap is not None:
        # Gemma-2's eager_attention_forward: tanh(scores / c) · c; tanh keeps its output (scalars: nothing).
        why = "tanh of the softcapped scores: d tanh = 1 − tanh²"
        rules.insert(0, save(B.ATTN, "softcap_tanh", (b, a, s, s), act, R.ATTN_PROBS, why))
    if profile_of(setup).softmax_fp32 and act is not FP32:
        # softmax(dtype=float32) keeps its fp32 output; the cast copy above is what P·V keeps.
        why = "fp32 softmax output: dS = P·(dP − Σ dP·P)"
        rules.insert(0, save(B.ATTN, "probs_fp32", (b, a, s, s), FP32, R.ATTN_PROBS, why))
    if p > 0:
        rules += [
            save(
                B.ATTN,
                "dropout_mask",
                (b, a, s, s),
                BOOL,
                R.ATTN_DROPOUT_MASK,
                "dropout mask on the probabilities",
            ),
            save(
                B.ATTN,
                "probs_dropped",
                (b, a, s, s),
                act,
                R.ATTN_PROBS,
                "dropped probabilities for P·V: dV = Pᵀ·dO",
            ),
        ]
    return rules


def constant_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """Tensors made once per forward and shared by every layer (one storage each)."""
    rules: list[Rule] = []
    if setup.model.position is PositionType.ROPE:
        rules += [
            save(B.ROPE, "cos", (dims.s, dims.d), dims.act, R.ROPE_TABLE, "q·cos and k·cos: dq needs cos"),
            save(B.ROPE, "sin", (dims.s, dims.d), dims.act, R.ROPE_TABLE, "rotate_half(q)·sin: dq needs sin"),
        ]
        if profile_of(setup).rope_per_layer_type and full_and_sliding(setup.model):
            why = "the full-attention layers' table (the sliding layers' base differs)"
            rules += [
                save(B.ROPE, "full_cos", (dims.s, dims.d), dims.act, R.ROPE_TABLE, why),
                save(B.ROPE, "full_sin", (dims.s, dims.d), dims.act, R.ROPE_TABLE, why),
            ]
    rules += checkpointed_mask_rule(setup, dims)
    if setup.strategy.attention is Attention.EAGER and not profile_of(setup).mask_added:
        # Named attn.causal_mask (it belongs to the attention) but made once per forward, not per layer.
        why = "masked_fill's backward zeroes masked cells"
        rules.append(Rule("attn.causal_mask", (dims.s, dims.s), BOOL, why, B.CONST, R.CAUSAL_MASK))
    return rules


def sliding_mask(setup: Setup, dims: Dims) -> bool:
    """Whether transformers masks SDPA explicitly: a sliding window that does not cover the sequence
    (``masking_utils._ignore_causal_mask_sdpa``: ``kv_length >= local_attention_size``)."""
    w = setup.model.sliding_window
    return w is not None and dims.s >= w


def checkpointed_mask_rule(setup: Setup, dims: Dims) -> list[Rule]:
    """transformers' mask is an argument of every decoder layer: a gradient checkpoint keeps it
    (``--checkpointing full`` / ``every-k``). Eager: ``masking_utils.eager_mask``, ``torch.where`` of the
    bool mask expanded to [b, 1, s, s] (0 or the dtype's min), in A; SDPA: the bool mask itself, only when
    a sliding window needs it (``sliding_mask``). Without a checkpoint the add keeps nothing.
    NB: under fake tensors transformers cannot skip SDPA's mask and a checkpoint keeps a bool [b, 1, s, s]
    the real run has not (not counted: the real run is the truth; within 1 % in tests/hf)."""
    if setup.strategy.checkpointing not in (Checkpointing.FULL, Checkpointing.EVERY_K):
        return []
    profile, eager = profile_of(setup), setup.strategy.attention is Attention.EAGER
    if eager and profile.mask_added:
        dtype = dims.act
    elif not eager and profile.sdpa_mask_converted and sliding_mask(setup, dims):
        dtype = BOOL
    else:
        return []
    shape, why = (dims.b, 1, dims.s, dims.s), "attention mask, an input of every checkpointed layer"
    rules = [Rule("attn.mask", shape, dtype, why, B.CONST, R.CAUSAL_MASK)]
    if eager and full_and_sliding(setup.model):
        why = "the full-attention layers' mask, an input of theirs (the sliding layers have their own)"
        rules.append(Rule("attn.full_mask", shape, dtype, why, B.CONST, R.CAUSAL_MASK))
    return rules


def full_and_sliding(m: ModelConfig) -> bool:
    """Whether both layer types exist (``sliding_window_pattern``: every n-th layer full): transformers
    then makes a causal and a sliding-window mask (``Gemma2Model.forward``'s ``causal_mask_mapping``)."""
    every = m.sliding_window_pattern
    return every is not None and m.num_layers >= every


def projection_flops(dims: Dims) -> int:
    """Forward FLOPs of W_Q, W_K, W_V and W_O."""
    t, h = dims.tokens, dims.h
    qd, kvd = dims.a * dims.d, dims.kv * dims.d
    return mm(t, h, qd) + 2 * mm(t, h, kvd) + mm(t, qd, h)


def score_cells(dims: Dims) -> int:
    """(query, key) cells of S = QKᵀ the kernels compute per (batch, head), as FlopCounterMode counts them
    (causal not halved): s² on one device.

    Ring attention over c = ``dims.ring`` ranks, s = one rank's s/c tokens (torch's
    ``_templated_ring_attention`` with its default load balancing: the sequence cut into 2c chunks, rank r
    holding chunks r and 2c−1−r): step 0 runs the causal kernel on the rank's own q, k, v (s² cells);
    each of the c−1 later steps runs a non-causal kernel on half of them — all of q against the first half
    of the received K/V when the source rank is lower, else the second half of q against all of it
    (s·s/2 cells): s² + (c−1)·s²/2 = s²·(c+1)/2 in all (s even: c divides s/2).
    """
    s, c = dims.s, dims.ring
    return s * s + (c - 1) * (s * (s // 2))


def attention_core_flops(dims: Dims) -> int:
    """Forward QKᵀ [s, d]·[d, s] and P·V [s, s]·[s, d] per (batch, head): 2·d FLOPs per score cell each
    (``score_cells``: causal not halved; ring attention's steps under context parallelism)."""
    return 2 * 2 * dims.b * dims.a * dims.d * score_cells(dims)


def attention_backward_flops(setup: Setup, dims: Dims) -> int:
    per_bmm = attention_core_flops(dims) // 2
    # eager: two bmms, each 2× in backward; flash: five s×s products (S recomputed, dP, dV, dQ, dK).
    return (5 if setup.strategy.attention is Attention.FLASH else 4) * per_bmm


def kernel_recompute_flops(setup: Setup, dims: Dims) -> int:
    """One layer's flash backward re-computing S = QKᵀ [s, d]·[d, s] per (batch, head): one of its five
    s×s products (``attention_backward_flops``); eager attention's backward re-computes nothing."""
    if setup.strategy.attention is not Attention.FLASH:
        return 0
    return attention_core_flops(dims) // 2


def eager_core_copies(setup: Setup) -> bool:
    return setup.strategy.attention is Attention.EAGER


def eager_forward_extra(setup: Setup, dims: Dims) -> int:
    """Eager attention's forward beyond its saves: q and k (after RoPE) and v before their contiguous
    copies, the scaled scores (a local until the core returns), and either the masked scores at the
    softmax or P·V's output before its [b, s, a·d] copy; with attention dropout the masked scores are
    gone before the dropout's mask and output (among the saves) exist."""
    if setup.strategy.attention is not Attention.EAGER:
        return 0
    a_bytes, t = dims.act.bytes, dims.tokens
    locals_ = t * (dims.a + 2 * dims.kv) * dims.d * a_bytes
    scores = dims.b * dims.a * dims.s * dims.s * a_bytes
    ctx = t * dims.a * dims.d * a_bytes
    return locals_ + scores + (ctx if setup.model.attn_dropout > 0 else max(scores, ctx))
