"""One layer's element-wise work on one rank, by chain: the bytes each kind of work moves (eager or fused,
``time.elementwise``'s bytes per element), the chain it streams as (``elementwise.norm_chain`` … a
measured rate of ``efficiency.ELEMENTWISE_STREAM``), those bytes as ``MEMORY`` streams them
(``streamed_bytes``), and the eager kernels it launches. ``time.compute`` charges them (its module
docstring gives the byte formulas); this module only counts.
"""

from __future__ import annotations

from memplan.blocks.moe import rank_slots
from memplan.blocks.profiles import profile_of
from memplan.config import Attention, Impl, MlpType, PositionType, Setup
from memplan.presets import GpuPreset
from memplan.time import elementwise, gemm

Chain = tuple[int, str | None]
"""Bytes of one kind of element-wise work and the measured chain it streams as (``time.elementwise``'s
``norm_chain``, ``rotary_chain``, ``mlp_chain``; None: at ``MEMORY``)."""


def elementwise_parts(s: Setup) -> list[Chain]:
    """One layer's forward element-wise work on one rank by chain (module docstring; each op's bytes per
    element, fused or eager, from ``time.elementwise``): two norms, two residual adds, dropouts and eager
    attention's softmax, the rotary embedding of q and k, the MLP's activation, a mixture of experts'
    token dispatch and combine (``dispatch``)."""
    return [*_forward_parts(s), dispatch(s)]


def dispatch(s: Setup, backward: bool = False) -> Chain:
    """A mixture of experts' token dispatch and combine on one rank, forward (or ``backward``), S = T·k
    slots (``MoEConfig.slots``), e the activation bytes; at ``MEMORY`` (no measured chain). The router's
    [T, E] softmax and top-k (≈ 1 % of these bytes at E 128) are not counted.

    Megatron-core (``Profile.megatron_moe``), either direction (the backward runs each kernel's inverse,
    the same bytes): TE's fused permutation (``moe_permute_fusion``: transformer_engine/pytorch/triton/
    permutation.py) reads each of the T tokens once and writes its k slots, ``_permute_kernel``: (T + S)·h·e;
    ``_unpermute_kernel`` reads the S slots and writes the T tokens (accumulating in registers): (S + T)·h·e;
    with more than one local expert the chunk sort after the all-to-all and the one before it back
    (``_sort_chunks_by_map_kernel``, a row copy each): 2·S·h·e each; its ``row_id_map`` is not counted.
    The permutations run before the all-to-all on the rank's own tokens (T/t and their slots under
    sequence parallelism), the sorts after it on the slots its experts take (``blocks.moe.rank_slots``:
    gathered over tp, or the rank's own under parallel folding).

    memplan's reference MoE (measure/reference/moe.py ``MoEMlp.routed``), op by op, forward:
    ``x.index_select(0, token)`` 2·S·h·e; the grouped products' ``torch.cat`` of the experts' outputs
    (``grouped``), 2·S·f·e for gate and for up (GELU: up), 2·S·h·e for down; ``out * w[:, None]`` 2·S·h·e;
    ``new_zeros`` T·h·e and ``index_add_`` (its source read, each target row read and written) 3·S·h·e:
    9·S·h + 4·S·f + T·h (GELU 2·S·f). Backward (autograd's formulas): ``index_add_``'s source gradient, an
    ``index_select``, 2·S·h; the product's two, ``grad · w`` 2·S·h and ``(grad · out).sum(-1)`` 3·S·h +
    S·h; each ``split``'s backward a ``cat`` of the experts' input gradients, 2·S·f for down's input and
    2·S·h each for gate's and up's, whose two [S, h] gradients are summed (3·S·h; GELU: one, no sum);
    ``index_select``'s, an ``index_add_`` into zeros, 3·S·h + T·h: 18·S·h + 2·S·f + T·h (GELU 13·S·h).
    transformers' ``grouped_mm`` experts: ``transformers_dispatch``. None elsewhere (NB: transformers'
    ``--experts eager`` loop is not counted)."""
    m = s.model
    if m.moe is None or m.moe.router_sigmoid:
        return (0, None)
    tokens, hidden = _tokens(s)
    slots, e, h, f = m.moe.slots(tokens), s.training.precision.activation_dtype.bytes, m.hidden_size, m.ffn
    p = profile_of(s)
    if p.megatron_moe:  # permuted on the rank's own tokens (T/t under sp), sorted on its experts' slots
        own = hidden // h
        sorts = 2 if m.moe.experts // s.parallel.ep > 1 else 0
        return ((2 * (own + m.moe.slots(own)) + sorts * 2 * rank_slots(s, m.moe, tokens)) * h * e, None)
    if p.experts_grouped_mm:
        return (transformers_dispatch(s, tokens, slots, backward), None)
    if s.impl.impl is not Impl.REFERENCE:
        return (0, None)
    swiglu = m.mlp is MlpType.SWIGLU
    forward, back = 9 * h + (4 if swiglu else 2) * f, (18 if swiglu else 13) * h + 2 * f  # a slot's bytes / e
    return (((back if backward else forward) * slots + tokens * h) * e, None)


def transformers_dispatch(s: Setup, tokens: int, slots: int, backward: bool) -> int:
    """transformers' ``grouped_mm_experts_forward`` (integrations/moe.py, 5.x), op by op, e the activation
    bytes and w the routing weights' (fp32 where the router keeps them so, ``Profile.routing_weights_fp32``:
    the weighted output is then fp32, q = 4; else q = e). Forward: ``hidden_states[perm // k]`` 2·S·h·e;
    ``proj_out * w`` S·h·(e + q); ``weighted_out[inv_perm]`` 2·S·h·q; ``.view(T, k, h).sum(1)`` S·h·q +
    T·h·q; ``.to(dtype)`` T·h·(q + e) where q ≠ e. Backward: the cast's T·h·(e + q); the gather's,
    ``index_put_`` accumulating into new zeros, 4·S·h·q; the product's, ``grad · w`` 2·S·h·q (and its cast to
    e, S·h·(q + e)) and ``(grad · proj_out).sum(-1)`` S·h·(2q + e) + S·h·q; the first gather's, into zeros
    [T, h], T·h·e + 3·S·h·e. With expert biases (``MoEConfig.expert_bias``: gpt-oss) each ``_grouped_linear``
    gathers its bias rows and adds them in place, 5·S·n·e forward and 3·S·n·e backward (n = 2f for
    gate_up, h for down)."""
    m = s.model
    e, h, f = s.training.precision.activation_dtype.bytes, m.hidden_size, m.ffn
    q = 4 if profile_of(s).routing_weights_fp32 else e
    cast = q != e
    bias = (2 * f + h) * slots * (3 if backward else 5) * e if m.moe and m.moe.expert_bias else 0
    if backward:
        casts = (tokens * h + slots * h) * (q + e) if cast else 0
        product = slots * h * (2 * q + (2 * q + e) + q)  # grad · w, grad · proj_out and its sum
        gathers = 4 * slots * h * q + tokens * h * e + 3 * slots * h * e
        return casts + product + gathers + bias
    weighted = slots * h * (e + q) + 2 * slots * h * q + slots * h * q + tokens * h * q
    return 2 * slots * h * e + weighted + (tokens * h * (q + e) if cast else 0) + bias


def _forward_parts(s: Setup) -> list[Chain]:
    """``elementwise_parts`` but the dispatch (its backward is not twice its forward)."""
    m, t, par = s.model, s.training, s.parallel
    e = t.precision.activation_dtype.bytes
    p = profile_of(s)
    tokens, hidden = _tokens(s)
    out: list[Chain] = [
        (2 * hidden * elementwise.norm_bytes(s, p, e), elementwise.norm_chain(s, p)),
        (2 * 3 * hidden * e + _dropout_softmax_bytes(s), None),
        _core(s),
    ]
    if m.position is PositionType.ROPE:
        qk = tokens * (m.num_heads + m.kv_heads) * m.dim // par.tp
        out.append((qk * elementwise.rotary_bytes(s, p, e), elementwise.rotary_chain(s, p)))
    routed = (m.moe.experts if m.moe.router_sigmoid else m.moe.top_k) if m.moe else 1  # MoEConfig.slots
    width = m.ffn * routed + m.moe.shared_width(m) if m.moe else m.ffn
    per = elementwise.swiglu_bytes(s, p, e) if m.mlp is MlpType.SWIGLU else 2 * e
    out.append((per * tokens * width // par.tp, elementwise.mlp_chain(s, p)))
    return out


def elementwise_backward_parts(s: Setup) -> list[Chain]:
    """One layer's backward element-wise work by chain: eager code's autograd op lists (``elementwise``:
    RMSNorm's nodes, SwiGLU's, rotary's, the sums of the gradients of tensors used twice — the residual
    stream before each norm on the rank's tokens, the shared input of separate W_Q/W_K/W_V and gate/up on
    all of them); twice the forward's otherwise (``elementwise.eager_backward``) and for LayerNorm, GELU,
    dropouts and eager attention's softmax."""
    if not elementwise.eager_backward(s):
        return [*((2 * b, chain) for b, chain in _forward_parts(s)), dispatch(s, backward=True)]
    m, par = s.model, s.parallel
    e = s.training.precision.activation_dtype.bytes
    p = profile_of(s)
    tokens, hidden = _tokens(s)
    sums = 3 * e * (2 * hidden + shared_inputs(s) * tokens * m.hidden_size)
    out: list[Chain] = [
        (2 * hidden * elementwise.norm_backward(s, p, e)[0], elementwise.norm_chain(s, p)),
        (_dropout_softmax_bytes(s, backward=True) + sums, None),
        _core(s, backward=True),
    ]
    if m.position is PositionType.ROPE:
        qk = tokens * (m.num_heads + m.kv_heads) * m.dim // par.tp
        out.append((qk * elementwise.rotary_backward(s, p, e)[0], elementwise.rotary_chain(s, p)))
    per = elementwise.swiglu_backward(s, p, e)[0] if m.mlp is MlpType.SWIGLU else 2 * 2 * e
    out.append((per * tokens * m.ffn // par.tp, elementwise.mlp_chain(s, p)))
    return out


def elementwise_bytes(s: Setup) -> int:
    """Bytes one layer's forward moves through element-wise kernels on one rank (``elementwise_parts``)."""
    return sum(b for b, _ in elementwise_parts(s))


def elementwise_backward_bytes(s: Setup) -> int:
    """Bytes one layer's backward moves through element-wise kernels (``elementwise_backward_parts``)."""
    return sum(b for b, _ in elementwise_backward_parts(s))


def streamed_bytes(s: Setup, backward: bool = False, gpu: GpuPreset | None = None) -> float:
    """One layer's element-wise bytes as ``MEMORY`` streams them: each chain's bytes times its weight
    (``elementwise.weight``: ``MEMORY`` over the fraction of HBM it was measured to reach, or ``gpu``'s
    calibrated one)."""
    parts = elementwise_backward_parts(s) if backward else elementwise_parts(s)
    return sum(b * elementwise.weight(chain, backward, gpu) for b, chain in parts)


def shared_inputs(s: Setup) -> int:
    """Gradient sums of the normed inputs that feed several linears (``gemm``'s lists): separate W_Q,
    W_K, W_V 2, separate gate and up 1; fused ones none."""
    tokens, _ = _tokens(s)
    return len(gemm.attention_gemms(s, tokens)) - 2 + len(gemm.mlp_gemms(s, tokens, s.model.ffn)) - 2


def _tokens(s: Setup) -> tuple[int, int]:
    """(T, the rank's hidden elements): T = b·s/cp tokens, the rank's Tr·h (Tr = T/t under sp)."""
    par = s.parallel
    tokens = s.training.micro_batch * s.training.seq_len // par.cp  # a context-parallel rank's share
    rank_tokens = tokens // par.tp if par.sp else tokens
    return tokens, rank_tokens * s.model.hidden_size


def _dropout_softmax_bytes(s: Setup, backward: bool = False) -> int:
    """The residual dropouts' (when p > 0) and eager attention's dropout on the rank's [b, a/t, s, s]
    scores, forward (or ``backward``: twice the forward's); the core itself is ``_core``."""
    m, t = s.model, s.training
    e = t.precision.activation_dtype.bytes
    _, hidden = _tokens(s)
    twice = 2 if backward else 1
    out = twice * 2 * (2 * hidden * e + hidden) if m.resid_dropout > 0 else 0
    return out + twice * _attention_dropout_bytes(s)


def _attention_dropout_bytes(s: Setup) -> int:
    """Eager attention's dropout forward on the rank's scores (bf16 in and out, a 1-byte mask)."""
    if s.strategy.attention is not Attention.EAGER or s.model.attn_dropout == 0:
        return 0
    return (2 * s.training.precision.activation_dtype.bytes + 1) * _scores(s)


def _scores(s: Setup) -> int:
    """Elements of the rank's [b, a/t, s, s] attention scores."""
    t = s.training
    return t.micro_batch * (s.model.num_heads // s.parallel.tp) * t.seq_len * t.seq_len


def _core(s: Setup, backward: bool = False) -> Chain:
    """Eager attention's core between its two products, forward or ``backward`` (``elementwise.eager_core``),
    and its measured chain; nothing for a flash kernel."""
    if s.strategy.attention is not Attention.EAGER:
        return (0, None)
    e = s.training.precision.activation_dtype.bytes
    return (_scores(s) * elementwise.eager_core(s, e, backward)[0], elementwise.core_chain(s))


def _dropout_softmax_kernels(s: Setup, backward: bool = False) -> int:
    m, twice = s.model, 2 if backward else 1
    out = twice * 2 if m.resid_dropout > 0 else 0
    if s.strategy.attention is Attention.EAGER:
        out += elementwise.eager_core(s, 0, backward)[1] + (twice if m.attn_dropout > 0 else 0)
    return out


def elementwise_kernels(s: Setup) -> int:
    """Kernels one layer's forward launches for its eager element-wise work on one rank
    (``elementwise``'s counts): two norms, two residual adds, two residual dropouts (when p > 0), the
    rotary embedding, the MLP's activation (SwiGLU eager 2, GELU 1), eager attention's softmax and its
    dropout. 0 under ``--compile`` (Inductor's fused kernels are not charged a gap)."""
    if elementwise.fused(s):
        return 0
    m, p = s.model, profile_of(s)
    e = s.training.precision.activation_dtype.bytes
    out = 2 * elementwise.norm_kernels(s, p, e) + 2 + _dropout_softmax_kernels(s)
    if m.position is PositionType.ROPE:
        out += elementwise.rotary_kernels(s, p)
    return out + (elementwise.swiglu_kernels(s, p) if m.mlp is MlpType.SWIGLU else 1)


def elementwise_backward_kernels(s: Setup) -> int:
    """Kernels one layer's backward launches for its eager element-wise work: the op lists of
    ``elementwise_backward_bytes`` (eager RMSNorm 17, fp32 15; a gradient sum 1 each; rotary 20; SwiGLU 3);
    twice the forward's otherwise; 0 under ``--compile``."""
    if elementwise.fused(s):
        return 0
    if not elementwise.eager_backward(s):
        return 2 * elementwise_kernels(s)
    m, p = s.model, profile_of(s)
    e = s.training.precision.activation_dtype.bytes
    out = 2 * elementwise.norm_backward(s, p, e)[1] + 2 + shared_inputs(s) + _dropout_softmax_kernels(s, True)
    if m.position is PositionType.ROPE:
        out += elementwise.rotary_backward(s, p, e)[1]
    return out + (elementwise.swiglu_backward(s, p, e)[1] if m.mlp is MlpType.SWIGLU else 2)


def attention_bytes(s: Setup, gpu: GpuPreset | None = None) -> float:
    """The eager attention core's element-wise bytes as ``MEMORY`` streams them, and its dropout's (what
    selective recompute re-runs); 0 for flash."""
    core, chain = _core(s)
    return core * elementwise.weight(chain, gpu=gpu) + _attention_dropout_bytes(s)
