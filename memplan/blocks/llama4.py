"""transformers' ``modeling_llama4.py`` (5.x): ``Llama4ForCausalLM``, the text model of Llama 4 Scout and
Maverick. Its layers come in kinds (``layer_kinds``): RoPE or NoPE (``ModelConfig.nope_every``), MoE or
dense (``moe_every``); each kind is a uniform model whose saves ``layer_rules`` lists, and the inventory
counts each save over the layers of the kinds that keep it (``analytic.activations.layer_entries``).

Its facts, each with the line that causes it:
- ``Llama4TextRotaryEmbedding.forward``: one complex64 ``freqs_cis`` [1, s, d/2] for the whole forward;
  ``apply_rotary_emb``'s ``xq_ * freqs_cis`` keeps it (``constant_rules``), nothing per layer;
- ``Llama4TextAttention``, RoPE layers: with ``use_qk_norm`` the weightless ``Llama4TextL2Norm``
  (``_norm(x.float()).type_as(x)``) keeps q and k in fp32 [b, s, ·, d] and their rsqrt [b, s, ·, 1];
  ``create_chunked_causal_mask`` (``attention_chunk_size`` C ≤ s): SDPA gets an explicit mask, so
  ``sdpa_attention_forward`` repeats k and v to a heads and the CPU flash kernel keeps the mask converted to
  the activation dtype [b, 1, s, s] per layer; at s < C the mask is skipped (``is_causal``);
- NoPE layers: no mask under SDPA (``create_causal_mask``: ``is_causal``, k and v unrepeated); with
  ``attn_temperature_tuning`` ``query_states * attn_scales`` keeps the fp32 scales [1, s, 1, 1];
- ``eager_attention_forward``: no fp32 softmax (``softmax(attn_weights)`` in the activation dtype), the
  mask added (keeps nothing), q, kᵀ and v copied to [b·a, ·, ·] by ``torch.matmul`` (k, v repeated);
- ``Llama4TextMoe.forward``: ``Llama4Router`` keeps its top-k indices [T, k] int64 and the fp32 sigmoid
  [T, E] of the scattered logits; every token goes through every expert: ``hidden_states.repeat(E, 1)``
  [E·T, h] times the scores [E·T, 1] (a copy of the transposed scores; the mul keeps both), then
  ``Llama4TextExperts``' ``bmm``s keep their input [E, T, h], the gate_up output [E, T, 2f] (silu's and the
  product's operands are its chunks), silu's output and the product [E, T, f]; the shared expert is a
  ``Llama4TextMLP`` on the T tokens (gate, act, up, W_down's input); FLOPs: the router, E·T tokens through
  every expert's three matrices, the shared expert's on T;
- dense layers: ``Llama4TextMLP(intermediate_size_mlp)``, Llama's SwiGLU.
- gradient checkpointing: the layer inputs, and the forward's constants bound in the layer's partial: the
  chunked mask (bool [1, 1, s, s] under SDPA at s ≥ C; eager: each layer type's additive mask
  [b, 1, s, s] in the activation dtype), ``freqs_cis`` and the int64 position ids.

Checked to the byte per layer and in total, FLOPs equal (tests/hf/test_llama4.py). Known limitations (each
refused in one line by ``blocks.hf.llama4.check``): attention dropout, selective and every-K checkpointing,
tp / sp / pp / cp / ep (the kinds are modelled on one unsplit replica), the reference model and the other
--impl's. The peak charges each layer's backward as its kind's
(``analytic.moments.layer_kinds.layer_kind_terms``,
the re-run working set per kind: ``pieces.pieces``' ``rerun_layers``), the MoE's replayed op by op
(``blocks.moe.backward._llama4``; tests/hf/test_layer_kinds.py).
"""

from __future__ import annotations

from memplan.blocks import mm
from memplan.blocks.attention.constants import checkpointed_position_ids
from memplan.blocks.attention.core import flash_rules
from memplan.blocks.inventory import Block, Dims, Role, Rule, save
from memplan.blocks.mlp import mlp_flops, mlp_inner_rules, mlp_rules
from memplan.blocks.norm import pre_norm_rules
from memplan.config import Attention, DType, Family, Impl, ModelConfig, Setup

B, R = Block, Role
FP32, INT64, BOOL, C64 = DType.FP32, DType.INT64, DType.BOOL, DType.COMPLEX64


def applies(setup: Setup) -> bool:
    """Whether ``setup`` runs transformers' Llama 4 code."""
    return setup.impl.impl is Impl.HF and setup.model.code_family is Family.LLAMA4


def kind_model(m: ModelConfig, layer: int) -> ModelConfig:
    """Layer i of ``m`` as a uniform model: NoPE (``nope_every`` 1: full attention, no q/k norm) or RoPE
    (chunked, q/k norm, no temperature); MoE or dense (``dense_ffn_size`` wide)."""
    nope = m.is_nope_layer(layer)
    update: dict[str, object] = {
        "nope_every": 1 if nope else None,
        "attn_chunk": None if nope else m.attn_chunk,
        "qk_l2_norm": m.qk_l2_norm and not nope,
        "attn_temperature": m.attn_temperature and nope,
        "moe_every": None,
        "dense_ffn_size": None,
    }
    if not m.is_moe_layer(layer):
        update |= {"moe": None, "ffn_size": m.dense_ffn_size}
    return m.model_copy(update=update)


def layer_kinds(setup: Setup) -> list[tuple[Setup, int]]:
    """Each kind of layer as a setup of its uniform model, with how many layers are of it, in the order of
    their first layer; [] when ``setup`` is not Llama 4's code."""
    if not applies(setup):
        return []
    kinds: dict[ModelConfig, int] = {}
    for i in range(setup.model.num_layers):
        k = kind_model(setup.model, i)
        kinds[k] = kinds.get(k, 0) + 1
    return [(setup.model_copy(update={"model": k}), n) for k, n in kinds.items()]


def kind_of_layers(setup: Setup) -> list[Setup]:
    """The setup of each layer's kind, in layer order."""
    return [
        setup.model_copy(update={"model": kind_model(setup.model, i)}) for i in range(setup.model.num_layers)
    ]


def is_uniform(m: ModelConfig) -> bool:
    return m.moe_every is None and m.nope_every in (None, 1)


def chunk_masked(setup: Setup, dims: Dims) -> bool:
    """Whether a RoPE layer's chunked mask reaches SDPA: s ≥ C (``masking_utils._ignore_causal_mask_sdpa``
    skips it only while ``kv_length < local_attention_size``; below C every causal cell is inside the chunk
    and ``is_causal`` does it)."""
    c = setup.model.attn_chunk
    return c is not None and dims.s >= c


def layer_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """One layer of a uniform kind (``kind_model``): its norms, attention, and MLP or MoE."""
    return [
        *pre_norm_rules(setup, B.ATTN_NORM, dims),
        *attention_rules(setup, dims),
        *pre_norm_rules(setup, B.MLP_NORM, dims),
        *(moe_rules(setup, dims) if setup.model.moe else mlp_rules(setup, dims)),
    ]


def attention_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """W_Q/W_K/W_V's input, the q/k norm or the temperature, the core's saves and W_O's input."""
    b, s, h, a, kv, d, act = dims.b, dims.s, dims.h, dims.a, dims.kv, dims.d, dims.act
    m = setup.model

    def attn(part: str, shape: tuple[int, ...], dtype: DType, role: Role, why: str) -> Rule:
        return save(B.ATTN, part, shape, dtype, role, why)

    rules = [attn("input", (b, s, h), act, R.LINEAR_INPUT, "input of W_Q/W_K/W_V: dW = Xᵀ·dY needs X")]
    if m.qk_l2_norm:
        why = "Llama4TextL2Norm: x.float() for x·rsqrt (pow's input too)"
        rules += [
            attn("q_norm.input", (b, s, a, d), FP32, R.NORM_INPUT, why),
            attn("q_norm.rstd", (b, s, a, 1), FP32, R.NORM_STATS, "rsqrt(mean(x²) + eps): its backward"),
            attn("k_norm.input", (b, s, kv, d), FP32, R.NORM_INPUT, why),
            attn("k_norm.rstd", (b, s, kv, 1), FP32, R.NORM_STATS, "rsqrt(mean(x²) + eps): its backward"),
        ]
    if m.attn_temperature:
        why = "query_states * attn_scales: dq needs the fp32 scales"
        rules.append(attn("temperature", (1, s, 1, 1), FP32, R.ATTN_QKV, why))
    if setup.strategy.attention is Attention.EAGER:
        why = "torch.matmul folds the [b, a, ·, ·] operand into a copy"
        return [
            *rules,
            attn("k", (b * a, d, s), act, R.ATTN_QKV, "kᵀ (repeated to a heads) for QKᵀ: " + why),
            attn("q", (b * a, s, d), act, R.ATTN_QKV, "q for QKᵀ: " + why),
            attn("probs", (b, a, s, s), act, R.ATTN_PROBS, "softmax output (no fp32 upcast): P·V needs it"),
            attn("v", (b * a, s, d), act, R.ATTN_QKV, "v (repeated to a heads) for P·V: " + why),
            attn("out", (b, s, a * d), act, R.ATTN_OUT, "attention output, input of W_O: dW = Xᵀ·dY"),
        ]
    masked = chunk_masked(setup, dims)
    heads = a if masked else kv  # repeat_kv before SDPA when a mask is passed (use_gqa_in_sdpa false)
    if masked:
        why = "the chunked mask, converted to the activation dtype by SDPA's CPU flash kernel"
        rules.append(attn("mask", (b, 1, s, s), act, R.CAUSAL_MASK, why))
    return [
        *rules,
        attn("q", (b, a, s, d), act, R.ATTN_QKV, "flash attention's q"),
        attn("k", (b, heads, s, d), act, R.ATTN_QKV, "flash attention's k"),
        attn("v", (b, heads, s, d), act, R.ATTN_QKV, "flash attention's v"),
        *flash_rules(setup, dims),  # the logsumexp; on CUDA the kernel's RNG state (24 B)
        attn("out", (b, a, s, d), act, R.ATTN_OUT, "flash output: its backward and W_O's input (a view)"),
    ]


def moe_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """``Llama4TextMoe``: the router's saves, every token through every expert, the shared expert."""
    moe = setup.model.moe
    assert moe is not None  # NB: called for MoE kinds only
    t, h, f, e, act = dims.tokens, dims.h, dims.f, moe.experts, dims.act

    def moe_save(part: str, shape: tuple[int, ...], dtype: DType, role: Role, why: str) -> Rule:
        return save(B.MOE, part, shape, dtype, role, why)

    why = "input of the router and the shared expert: dW = Xᵀ·dY"
    return [
        save(B.MLP, "input", (dims.b, dims.s, h), act, R.LINEAR_INPUT, why),
        moe_save("topk_indices", (t, moe.top_k), INT64, R.ROUTER, "topk / scatter_ backward gather at them"),
        moe_save("router_scores", (t, e), FP32, R.ROUTER, "sigmoid of the scattered logits: its backward"),
        moe_save("scores", (e * t, 1), act, R.ROUTER, "each slot's score: d(routed_in) needs it"),
        moe_save("routed_in", (e * t, h), act, R.EXPERT_TOKENS, "hidden.repeat(E, 1): d(score) needs it"),
        moe_save("expert_input", (e, t, h), act, R.EXPERT_TOKENS, "scaled tokens, gate_up bmm's input"),
        moe_save(
            "gate_up", (e, t, 2 * f), act, R.MLP_INNER, "gate_up bmm output: silu(gate) and ·up read it"
        ),
        moe_save("act", (e, t, f), act, R.MLP_INNER, "silu(gate): d up needs it"),
        moe_save("down_input", (e, t, f), act, R.MLP_INNER, "up · silu(gate), down bmm's input"),
        *mlp_inner_rules(setup, B.MOE, "shared.", (t, f), act),
    ]


def layer_linear_flops(setup: Setup, dims: Dims) -> int:
    """Forward FLOPs of one uniform kind's MLP or MoE (the projections are the common attention's): the
    router h×E, E·T tokens through each expert's three matrices (2·(E·T)·h·2f + 2·(E·T)·f·h), the shared
    expert's on T."""
    moe = setup.model.moe
    if moe is None:
        return mlp_flops(setup, dims)
    t, h, f, e = dims.tokens, dims.h, dims.f, moe.experts
    return mm(t, h, e) + mm(e * t, h, 2 * f) + mm(e * t, f, h) + 3 * mm(t, h, f)


def constant_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """The forward's constants: ``freqs_cis`` [1, s, 1, d/2] complex64 (kept by every RoPE layer's
    ``xq_ * freqs_cis``, or bound in the checkpointed layers' partial); under gradient checkpointing the
    masks bound in it (SDPA: the chunked bool mask when s ≥ C; eager: one additive [b, 1, s, s] mask per
    layer type present) and the int64 position ids (``constants.checkpointed_position_ids``)."""
    m, s, b = setup.model, dims.s, dims.b
    kinds = [kind_model(m, i) for i in range(m.num_layers)]
    rope = any(k.nope_every is None for k in kinds)
    rules = []
    if rope:
        why = "freqs_cis: xq_ · freqs_cis's backward multiplies by it"
        rules.append(Rule("rope.freqs_cis", (1, s, 1, dims.d // 2), C64, why, B.ROPE, R.ROPE_TABLE))
    if not setup.strategy.segment:
        return rules
    rules += checkpointed_position_ids(setup, dims)
    why = "attention mask bound in the checkpointed layer's partial(forward, **kwargs)"
    chunked = rope and chunk_masked(setup, dims)
    if setup.strategy.attention is not Attention.EAGER:
        if chunked:
            rules.append(Rule("attn.mask", (b, 1, s, s), BOOL, why, B.CONST, R.CAUSAL_MASK))
        return rules
    types = {k.attn_chunk is not None for k in kinds}  # chunked_attention and / or full_attention
    rules += [
        Rule(f"attn.{'chunked' if t else 'full'}_mask", (b, 1, s, s), dims.act, why, B.CONST, R.CAUSAL_MASK)
        for t in sorted(types)
    ]
    return rules
