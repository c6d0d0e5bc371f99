"""Fine-tuning (LoRA, QLoRA, frozen parts): what autograd keeps and what backward computes when only some
parameters train.

PyTorch saves a tensor for backward only when a gradient that needs it will be computed (autograd's
generated code guards each save by ``should_compute_output``; checked in tests/measure/test_finetune.py):
a linear whose weight is frozen keeps no input (dX = dY·W needs the weight only), ``w·n`` with a frozen
norm weight keeps no ``n``, ``a @ b`` keeps ``a`` only when ``b`` needs a gradient, and an op none of whose
inputs needs a gradient keeps nothing. So the saves follow the *gradient flow*: which tensors require
grad, layer by layer (``Flow``). The first layers before any trainable parameter keep nothing and run no
backward; the first trainable layer's input needs no gradient, so its norm keeps nothing either.

A LoRA adapter on a linear x → W·x adds B·A·drop(x)·α/r (peft's ``lora.Linear``): A's input (x itself
without LoRA dropout, else the dropped copy and the dropout's bool mask), and A's output [T, r] for dB.
Under ``--impl hf`` with 16-bit activations the adapters are peft's default, fp32
(``config.trainable.fp32_adapters``): each adapter keeps its own fp32 copy of x (or the fp32 dropped x)
and an fp32 A·x; the frozen linear keeps nothing. Measured against peft on transformers' Llama, Qwen3,
Gemma-2/3 and Granite (tests/test_finetune_libraries.py): every layer's bytes, the total and the FLOPs.

The gradient flow is ``strategies.lora_flow``; the FLOPs (and segment checkpointing's ``recompute``, this
strategy's) ``strategies.lora_flops``.

Liger's fused loss (``--loss fused``) follows the gradient flow: a frozen head makes no weight gradient, so
only dL/dX is kept and only its product runs in the forward (``blocks.head.fused_rules``, ``head_flops``;
``strategies.lora_flops``). torchtune's chunked loss (``--loss chunked:N``, its LoRA recipes' default):
a frozen head's chunk matmuls keep no input (the pick below), its backward sums no weight-gradient pieces
(``blocks.head.chunked_head_backward_transient``) and the forward holds the final norm's output, which no
save keeps (``chunked_loss_forward_transient``). flash_attn's and Transformer Engine's loss kernels are
refused.

A mixture of experts (Mixtral, Qwen-MoE) with LoRA on its attention, or frozen layers: the MoE MLP frozen
whole keeps what its dX needs and none of its linears' inputs (``moe_keep``), and runs dX alone
(``strategies.lora_flops``), with full or every-K checkpointing too (its re-run stops after the same last
save as in full training, ``blocks.moe.early_stop_skip``); measured equal per tensor and FLOP
(tests/measure/test_finetune.py, and the full-size presets under fake tensors). Its peak takes full
training's MoE moments with the frozen MLP's terms, above the measured step: at h 64, 3 layers, +3.4 and
+3.7 % (Mixtral- and Qwen-like; full training +0.8 %); at h 256, 4 layers exact where the loss's moment is
the peak, and with full checkpointing (the layer's moment) +10.3 and +9.8 % (full training +1.7, +2.3 %).

Known limitations (NB): refused with selective checkpointing, segment checkpointing unless LoRA adapts every
layer (a frozen layer's checkpoint would keep nothing), reversible layers, tensor/sequence/pipeline
parallelism, offload and the xentropy and te losses; with a mixture of experts also adapters on the experts,
QLoRA, expert parallelism, implementations but the reference and the MoE layers of MLA, Llama 4 and gpt-oss
(``config.finetune_rules.check_finetune``). Under ``--impl hf`` every family: a fused projection (Phi-3's
``qkv_proj`` and ``gate_up_proj``, GLM-4's ``gate_up_proj``, GPT-2's ``c_attn``, GPT-NeoX's and Falcon's
``query_key_value``) is one adapter (``config.finetune.FUSED_LINEARS``, ``config.trainable.adapters``: one
fp32 input copy and one A·x per module); parallel layers follow ``Flow.parallel``, missing or shared pre-norms
``pre_norm_rules``; measured equal to peft on transformers' models (tests/test_finetune_libraries.py); a
head-major flash output keeps no copy for a frozen o_proj (``blocks.attention.core.head_major_output``).
peft's GPT-2 adapts the fused ``c_attn`` (one A [r, h], one B [3h, r]); memplan's reference model's separate
q, k, v adapters have 2·r·h more parameters. Memory moments: peft's ``result + B(A(x))·s`` in fp32 and its
cast back (``result.to(torch_result_dtype)``) keep nothing, but their [T, out] fp32 temporaries are not in the
peak's transients. The fp32 adapters' matmuls are timed at the activation dtype's rate and their optimizer
step at the base recipe's bytes (``time.compute``). Where a single layer keeps the rotary products (a 2-layer
trace whose layer 0 has no q/k gradient), a per-layer trace attributes the cos/sin tables to that layer; the
estimate counts them once at model level (the total is the same; kept by several layers, the trace counts them
at model level too)."""

from __future__ import annotations

from memplan.analytic import activations as act
from memplan.analytic.moments import lora_mlp
from memplan.blocks.attention.constants import constant_rules, partials_bind_positions
from memplan.blocks.attention.core import (
    Core,
    attention_core_rules,
    core_of,
    full_layer_setup,
    head_major_output,
    projection_rules,
)
from memplan.blocks.attention.rope import rope_cache_rules
from memplan.blocks.attention.windows import is_sliding
from memplan.blocks.embedding import embedding_rules
from memplan.blocks.head import lm_head_rules
from memplan.blocks.inventory import Block, Dims, Kept, Role, Rule, Scope, save
from memplan.blocks.mlp import mlp_rules
from memplan.blocks.moe import moe_rules
from memplan.blocks.norm import norm_rules, post_norm_rules, pre_norm_rules, qk_norm_rules
from memplan.blocks.profiles import dropout_keeps, profile_of
from memplan.config import DType, Impl, Method, NormType, Setup
from memplan.config.finetune import MLP_TARGETS, Adapter, Target
from memplan.config.trainable import (
    adapters,
    embedding_trains,
    final_norm_trains,
    fp32_adapters,
    head_trains,
    input_grads_hooked,
)
from memplan.strategies.lora_flops import base_dx_linears, flops, recompute
from memplan.strategies.lora_flow import Flow, flows

# The strategy (applies, keeps, recompute), what the engine reads, and base_dx_linears for time.compute.
__all__ = [
    "adapter_note",
    "applies",
    "base_dx_linears",
    "deficit",
    "flops",
    "keeps",
    "layer_bytes",
    "mlp_adapter_note",
    "recompute",
]

B, R, T = Block, Role, Target


def applies(setup: Setup) -> bool:
    return not setup.finetune.trains_everything


def adapter_dtype(setup: Setup) -> DType:
    """The dtype of the adapters' weights and of what they keep (``fp32_adapters``)."""
    return DType.FP32 if fp32_adapters(setup) else setup.training.precision.activation_dtype


def adapter_note(setup: Setup) -> str | None:
    """One line when LoRA runs in 16-bit outside ``--impl hf``: memplan's reference model keeps the
    adapters in the activation dtype, where peft's default keeps them in fp32 (``fp32_adapters``)."""
    act = setup.training.precision.activation_dtype
    if not setup.finetune.lora or act is DType.FP32 or setup.impl.impl is Impl.HF:
        return None
    return (
        f"lora: the adapters are counted in {act.value} as memplan's reference model runs them; peft's "
        "default (autocast_adapter_dtype=True) keeps them in fp32 and casts each adapter's input to fp32, "
        "which keeps more: --impl hf models peft's default"
    )


def mlp_adapter_note(setup: Setup) -> str | None:
    """One line where peft's fp32 adapters sit on the MLP's linears (``--lora-targets`` gate, up, down,
    all-linear) under ``--impl hf`` in a layer ``analytic.moments.lora_mlp`` does not replay (GELU MLPs,
    parallel
    layers, post norms, a subset of the three, adapter dropout, LayerNorm, every-K or reentrant
    checkpointing; QLoRA's bitsandbytes layer, another sequence, is not traced): their own backward's
    fp32 pieces (dY in fp32, its bf16 copy, dx in fp32 over the linear's input) and, re-run under
    checkpointing, their forward's (B·A·x, its scaled copy and the fp32 sum over [T, out]) are not
    modelled there, and the layer backward's moment reads low by the measured 1-9 [T, h]
    (docs/peak-accuracy.md, "All-linear LoRA"); attention targets are exact."""
    if setup.finetune.method is not Method.LORA or not fp32_adapters(setup):  # QLoRA's: not traced
        return None
    if not any(t in MLP_TARGETS for t in setup.finetune.targets) or lora_mlp.modelled(setup):
        return None
    return (
        "lora: peft's adapters on this MLP make fp32 pieces in their backward (and in a checkpoint's "
        "re-run forward) that memplan models only for a gated MLP's gate, up, down adapters after an "
        "RMSNorm (no or full non-reentrant checkpointing): the "
        "layer backward's moment reads low, measured by 1-9 [T, h] bf16 at the families' widths "
        "(docs/peak-accuracy.md, 'All-linear LoRA'); adapters on q, k, v, o are exact"
    )


def _pick(rules: list[Rule], keep: list[bool]) -> list[Rule]:
    """The rules kept, by position: ``keep`` follows the order the block function lists its saves in."""
    assert len(rules) == len(keep), (len(rules), len(keep))
    return [r for r, k in zip(rules, keep, strict=True) if k]


def norm_keep(setup: Setup, rules: list[Rule], g_x: bool, weight_trains: bool) -> list[bool]:
    """Which of one norm's saves are kept. RMSNorm: pow and x·rstd keep x32 and rstd when x needs a
    gradient, w·n keeps n when w trains; Gemma's (x32·rstd)·(1 + w.float()) keeps the fp32 1 + w when x
    needs a gradient (d(normed) needs it). Cohere's LayerNorm in Python alike (its fp32 weight copy for
    d(normed)). ``native_layer_norm``'s [input, mean, rstd]: one node, all kept when anything does."""
    if setup.model.norm is NormType.RMSNORM or profile_of(setup).layernorm_python:
        # op by op (Cohere's Python LayerNorm too, ``python_layernorm_rules``): w·n keeps n for dW alone
        return [weight_trains if r.role is R.NORM_OUTPUT else g_x for r in rules]
    return [g_x or weight_trains] * len(rules)


def core_keep(rules: list[Rule], f: Flow, eager: bool) -> list[bool]:
    """Which of the attention core's saves are kept. Flash (and SDPA's math kernel): every save when any of
    q, k, v needs a gradient. Eager: softmax keeps P for dS (q or k needs one: ``g_qk``), P·V keeps P
    for dV (``g_v``) — one tensor kept when either needs it, except where P·V reads a copy: transformers'
    ``softmax(dtype=float32).to(A)`` (its A copy, ``probs``, beside ``probs_fp32``) or the dropped P
    (its mask or noise kept for dP); Gemma-2's softcap keeps its tanh for dS."""
    if not eager:
        return [f.g_core] * len(rules)
    parts = {r.name.removeprefix(f"{B.ATTN.value}.") for r in rules}
    copy = {"probs", "probs_fp32"} <= parts
    dropped = "probs_dropped" in parts
    keep = []
    for r in rules:
        part = r.name.removeprefix(f"{B.ATTN.value}.")
        if part == "probs_dropped" or (part == "probs" and copy):
            keep.append(f.g_v)  # P·V's operand, a copy of the softmax's output
        elif part in ("probs", "probs_fp32") and not (copy or dropped):
            keep.append(f.g_core)  # softmax's output is P·V's operand too
        else:
            keep.append(f.g_qk)  # softmax's output, the dropout's mask / noise, the softcap's tanh
    return keep


def _qkv_keep(rule: Rule, f: Flow, eager: bool) -> bool:
    """Whether one of q, k, v (or the fused projection's buffer their views keep alive) is kept: by the
    flash kernel when the core needs a gradient; eagerly a @ b keeps a when b needs dB — q for dK, k for
    dQ, v where the scores need one; the buffer when any of its views is. By name: a fused projection's
    views (``Profile.qkv_views``) may be the buffer alone (GPT-2 on CUDA's flash kernel), where a
    positional q, k, v list had crashed ``--impl hf --finetune lora`` with checkpointing."""
    part = rule.name.removeprefix(f"{B.ATTN.value}.")
    if not eager:
        return f.g_core
    return {"q": f.g_k, "k": f.g_q, "v": f.g_qk}.get(part, f.g_k or f.g_q or f.g_qk)


def qk_norm_keep(setup: Setup, dims: Dims, f: Flow) -> list[Rule]:
    """Qwen3's / Gemma-3's per-head q_norm and k_norm (``blocks.norm.qk_norm_rules``) on q_proj's and
    k_proj's outputs: x32 and rstd kept when that output needs a gradient (``g_q``, ``g_k``: an adapter on
    the projection, or its input needs one), Gemma's fp32 1 + w too (d(normed) needs it); the normalised x
    when the norm's weight trains (the layer's own weights train)."""
    out = []
    for prefix, g_x in (("q_norm.", f.g_q), ("k_norm.", f.g_k)):
        for r in qk_norm_rules(setup, dims):
            if not r.name.removeprefix(f"{r.block.value}.").startswith(prefix):
                continue
            if f.trains if r.role is R.NORM_OUTPUT else g_x:
                out.append(r)
    return out


def adapter_rules(setup: Setup, dims: Dims, ad: Adapter, g_x: bool) -> list[Rule]:
    """One adapter's saves: with LoRA dropout its bool mask (when x needs a gradient; on CPU under a profile
    with ``cpu_dropout_noise`` the noise ``input · noise`` keeps, in the adapter's dtype) and the dropped x,
    A's input; A's output [T, r], B's input. Without dropout A's input is x itself, kept by its linear's
    rule — or, under ``fp32_adapters``, the adapter's own fp32 copy ``x.to(fp32)`` (one per adapter: each
    casts the shared input again). The rest of peft's forward keeps nothing: ``* scaling`` (a Python float),
    ``result + …`` and the cast back ``result.to(torch_result_dtype)``."""
    block, t, fan_in = B.ATTN if ad.attention else B.MLP, ad.name, ad.fan_in
    b, s, r = dims.b, dims.s, setup.finetune.rank
    dtype = adapter_dtype(setup)
    out = []
    if setup.finetune.dropout > 0:
        if g_x:
            why = "LoRA dropout mask: dX = dY·mask/(1−p)"
            keeps = dropout_keeps(setup, dtype)
            out.append(save(block, f"{t}_lora_mask", (b, s, fan_in), keeps, R.DROPOUT_MASK, why))
        why = "dropped input of LoRA's A: dA = dYᵀ·X needs it"
        out.append(save(block, f"{t}_lora_input", (b, s, fan_in), dtype, R.LINEAR_INPUT, why))
    elif fp32_adapters(setup):
        why = "the adapter's fp32 copy of its input (peft's _cast_input_dtype), A's input: dA = dYᵀ·X"
        out.append(save(block, f"{t}_lora_input", (b, s, fan_in), dtype, R.LINEAR_INPUT, why))
    why = "LoRA's A·x, input of B: dB = dYᵀ·(A·x)"
    return [*out, save(block, f"{t}_lora_mid", (b, s, r), dtype, R.LORA_RANK, why)]


def layer_rules(setup: Setup, dims: Dims, f: Flow) -> list[Rule]:
    """What one layer keeps under its gradient flow ``f`` (the blocks' saves, picked, plus the adapters')."""
    eager = core_of(setup) is not Core.FLASH  # SDPA's math fallback runs eager's ops (per-operand saves)
    attn_norm = pre_norm_rules(setup, B.ATTN_NORM, dims)  # none on OLMo-2; one shared by both branches
    out = _pick(attn_norm, norm_keep(setup, attn_norm, f.g_in, f.trains))
    # a layer's own rotary tables (GLM's, ``rope_cache_rules``), kept by q·cos and k·cos where q or k
    # needs a gradient, sit between W_Q's input and q, k, v
    tables = [f.g_qk] * len(rope_cache_rules(setup, dims))
    # one norm feeding attention and MLP (``shared_norm``): its output, W_Q's input, is the MLP's too
    shared = (T.GATE, T.UP) if setup.model.shared_norm else ()
    proj = projection_rules(setup, dims)
    qkv_keep = [_qkv_keep(r, f, eager) for r in proj[1 + len(tables) :]]
    out += _pick(proj, [f.keeps_input(T.Q, T.K, T.V, *shared), *tables, *qkv_keep])
    out += qk_norm_keep(setup, dims, f)
    core = attention_core_rules(setup, dims)
    out += _pick(core, core_keep(core, f, eager))
    # The flash kernel keeps its own output, W_O's input (a view of it): kept whenever the core's is —
    # unless it comes out head-major (Phi-3's fused QKV, GLM's cat rotary: ``head_major_output``), when the
    # kernel keeps its own (``kernel_out``) and W_O reads a copy, kept for W_O's dW alone.
    view = not eager and not head_major_output(setup)
    if f.keeps_input(T.O) or (view and f.g_core):
        why = "attention output, input of W_O: dW = Xᵀ·dY"
        out.append(save(B.ATTN, "out", (dims.b, dims.s, dims.a * dims.d), dims.act, R.ATTN_OUT, why))
    # Gemma-2/3's post norms (post_attention_layernorm, post_feedforward_layernorm) on W_O's and W_down's
    # outputs: x32 and rstd when that output needs a gradient.
    post = post_norm_rules(setup, B.POST_ATTN_NORM, dims)
    out += _pick(post, norm_keep(setup, post, f.lin(T.O, f.g_core), f.trains))
    if setup.model.resid_dropout > 0 and f.lin(T.O, f.g_core):
        out.append(_resid_mask(setup, B.ATTN, dims))
    mlp_norm = pre_norm_rules(setup, B.MLP_NORM, dims)
    out += _pick(mlp_norm, norm_keep(setup, mlp_norm, f.g_mlp_in, f.trains))
    if setup.model.moe is not None:
        out += moe_keep(setup, dims, f)
    else:
        # silu keeps g; g·u keeps each. transformers' fused gate_up_proj (Phi-3, GLM: ``fused_gate_up``)
        # keeps its [T, 2f] output whole for g's and u's views (silu's g and the product's u, both for
        # gate's gradient) and act for up's
        # GELU: fc1's output for gelu'(x) where it needs a gradient — and transformers' NewGELUActivation
        # (GPT-2's, ``gelu_python``) keeps its pow's x, tanh, 0.5·x and 1 + tanh for the same one
        fused = f.swiglu and profile_of(setup).fused_gate_up
        mlp = mlp_rules(setup, dims)
        own = [] if setup.model.shared_norm else [f.keeps_input(T.GATE, T.UP)]  # no input of its own
        gelu = [f.g_up] * (len(mlp) - len(own) - 1)
        inner = [f.g_gate, f.g_up] if fused else [f.g_gate, f.g_up, f.g_gate] if f.swiglu else gelu
        out += _pick(mlp, [*own, *inner, f.keeps_input(T.DOWN)])
    post = post_norm_rules(setup, B.POST_MLP_NORM, dims)
    out += _pick(post, norm_keep(setup, post, f.g_down, f.trains))
    if setup.model.resid_dropout > 0 and f.g_down:
        out.append(_resid_mask(setup, B.MLP, dims))
    for ad in adapters(setup, f.adapters):  # a fused projection's one under --impl hf (peft's module)
        out += adapter_rules(setup, dims, ad, f.g_input(ad.targets[0]))
    return out


_MOE_WEIGHT_INPUTS = frozenset({"moe.expert_input", "moe.down_input", "moe.shared.down_input"})
"""A mixture of experts' saves that only its weights' gradients read: the dispatched tokens (the experts'
W_gate/W_up input) and the W_down inputs, routed and shared (``blocks.moe``'s names)."""


def moe_keep(setup: Setup, dims: Dims, f: Flow) -> list[Rule]:
    """A mixture-of-experts MLP under the layer's flow (no adapters on it: ``finetune_rules``). Trained
    whole, every save (its input for the router's, the experts' and the shared experts' dW). Frozen (LoRA,
    a frozen layer) with a gradient to pass on (the norm's output needs one: ``g_mid``): what dX needs —
    the router's fp32 softmax, the top-k indices and renormalisation, the slots' indices, the experts'
    gate, act and up (silu and the product read them), their output and routing weight (each other's
    gradient), index_add_'s source, the shared experts' inner tensors and gate — not the linears' inputs
    (``_MOE_WEIGHT_INPUTS``, the MLP's input). Nothing without a gradient to pass on."""
    moe = setup.model.moe
    assert moe is not None  # NB: called for mixtures of experts only
    if f.trains:
        return [r for r in mlp_rules(setup, dims) if r.role is R.LINEAR_INPUT] + moe_rules(setup, moe)
    if not f.g_mid:
        return []
    return [r for r in moe_rules(setup, moe) if r.name not in _MOE_WEIGHT_INPUTS]


def _resid_mask(setup: Setup, block: Block, dims: Dims) -> Rule:
    """The residual dropout's mask (on CPU under ``Profile.cpu_dropout_noise`` the noise it multiplies by,
    in the activation dtype: ``dropout_keeps``)."""
    why = "dropout mask: dX = dY·mask/(1−p)"
    keeps = dropout_keeps(setup, dims.act)
    return save(block, "resid_dropout_mask", (dims.b, dims.s, dims.h), keeps, R.DROPOUT_MASK, why)


def model_rules(setup: Setup, dims: Dims, fl: tuple[Flow, ...]) -> tuple[list[Rule], list[Rule]]:
    """The embedding's and the constants' saves, and the head's: before and after the layers."""
    g_embed = embedding_trains(setup)
    emb = embedding_rules(setup, dims)
    # transformers' checkpointing hooks the embedding module's output to require grad
    # (``input_grads_hooked``): the embedding dropout after it (GPT-2's) keeps its noise or mask though no
    # embedding weight trains (measured; Gemma's normaliser, applied inside its embedding module, is not)
    hooked = g_embed or input_grads_hooked(setup)
    # GPT-2's learned positions: the ids its frozen table's lookup does not save, the checkpoints' partials
    # keep (``partials_bind_positions``: the storage ``embed.positions`` names)
    bound = partials_bind_positions(setup)
    picks = [
        hooked if r.role is R.DROPOUT_MASK else g_embed or (bound and r.name == "embed.positions")
        for r in emb
    ]
    before = _pick(emb, picks)
    consts = constant_rules(setup, dims)
    before += _pick(consts, [any(f.g_qk for f in fl)] * len(consts))  # q·cos, masked_fill keep theirs
    g_last = fl[-1].g_out if fl else g_embed
    norm_w = final_norm_trains(setup)
    final = norm_rules(setup, B.FINAL_NORM, dims)
    after = _pick(final, norm_keep(setup, final, g_last, norm_w))
    g_logits = g_last or norm_w or head_trains(setup)
    # The head's input for its dW when it trains; the loss's saves (Gemma-2's logit softcap's tanh too)
    # when the logits need a gradient.
    head = lm_head_rules(setup, dims)
    after += _pick(head, [head_trains(setup) if r.block is B.LM_HEAD else g_logits for r in head])
    return before, after


def keeps(kept: list[Kept], setup: Setup) -> list[Kept]:
    """The inventory under fine-tuning, rebuilt from the blocks' saves under each layer's gradient flow (the
    strategies that would change ``kept`` are refused with fine-tuning, so nothing of it is lost). A layer
    save kept in n of the layers has count n."""
    if not applies(setup):
        return kept
    dims = Dims.of(setup)
    fl = flows(setup)
    counts: dict[str, tuple[Rule, int]] = {}
    rules = _rules_by_flow(setup, dims, fl)
    for f in fl:
        for r in rules[f]:
            counts[r.name] = (r, counts.get(r.name, (r, 0))[1] + 1)
    layers = [k for r, n in counts.values() for k in act.kept([r], Scope.LAYER, n)]
    before, after = model_rules(setup, dims, fl)
    return act.kept(before, Scope.MODEL, 1) + layers + act.kept(after, Scope.MODEL, 1)


def top_layer_saves(setup: Setup) -> tuple[Kept, ...]:
    """What the top layer keeps under its gradient flow (``layer_rules``): the saves its backward moments
    free (``analytic.activations.layer_saves_kept``, where this function is registered)."""
    return tuple(act.kept(layer_rules(setup, Dims.of(setup), flows(setup)[-1]), Scope.LAYER, 1))


act.FLOW_SAVES[:] = [top_layer_saves]


def layer_bytes(setup: Setup, fl: tuple[Flow, ...] | None = None) -> list[int]:
    """Bytes each layer keeps, first to last: its flow's rules, on a full-attention layer of a model with
    sliding ones (Gemma-2 and 3 under SDPA, ``full_layer_setup``) its own kind's — SDPA gets no window mask
    there and k and v stay at their kv heads. Before, every layer was charged a sliding one's under LoRA:
    Gemma-3-4B's full layers 6 MiB each over at s 1,024 (tests/test_finetune_libraries.py). ``fl``: the
    layers' flows, by default ``setup``'s; a checkpointed setup's for its re-run layers, read on the setup
    without checkpointing (``pieces``), whose own flows lose transformers' hook on the embedding's output
    (``input_grads_hooked``): layer 0 re-run keeps what the others do (its norm's fp32 input among them),
    measured under all-linear LoRA at rank 16 (Llama 3.2 1B's widths, s 512, full checkpointing), where
    layer 0's moment tops the step: 720,896 B under before."""
    fl = flows(setup) if fl is None else fl

    def per_flow(s: Setup) -> dict[Flow, int]:
        return {f: sum(r.bytes for r in rules) for f, rules in _rules_by_flow(s, Dims.of(s), fl).items()}

    sliding = per_flow(setup)
    full = full_layer_setup(setup)
    if full is None:
        return [sliding[f] for f in fl]
    whole = per_flow(full)
    return [sliding[f] if is_sliding(setup.model, i) else whole[f] for i, f in enumerate(fl)]


def _rules_by_flow(setup: Setup, dims: Dims, fl: tuple[Flow, ...]) -> dict[Flow, list[Rule]]:
    """``layer_rules`` of each distinct flow of ``fl`` (the layers between the first and the last
    trainable one share one: the rules are built once each)."""
    return {f: layer_rules(setup, dims, f) for f in dict.fromkeys(fl)}


def deficit(per_layer: tuple[int, ...]) -> int:
    """What the layers keep less than the largest one each, together (0 without fine-tuning's bytes)."""
    return max(per_layer) * len(per_layer) - sum(per_layer) if per_layer else 0
