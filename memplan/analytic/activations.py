"""Per-tensor inventory of what autograd keeps for the backward pass of one micro-batch, composed from the
blocks' saves (``memplan.blocks``: each block declares what its ops keep).

Each rule mirrors one op of the reference model (memplan/measure/reference/model.py) and what its PyTorch
autograd node saves; the measurement side counts those saves byte for byte (storage-deduplicated,
parameters excluded). Shapes: b micro-batch, s sequence, h hidden, a heads, kv key/value heads, d head
dim, f ffn width, v vocabulary; A the activation dtype of the precision recipe.

What each op saves (torch 2.x derivatives.yaml, checked by tests/measure):
- ``F.linear`` / ``addmm``: its input (and the weight, a parameter: not counted);
- ``x.float()``, ``x.to(A)``, ``x * python_float``, ``+``, ``mean``, ``cat``, views: nothing;
- ``pow``: its input; ``rsqrt``: its output; ``a * b``: each operand the other's gradient needs;
- ``silu`` / ``gelu``: input; ``softmax`` / ``log_softmax``: output; ``native_dropout``: the bool mask;
- ``masked_fill``: the mask; ``matmul``/``bmm``: both operands; ``embedding``: the indices;
- ``native_layer_norm``: input, mean and rstd ([b, s, 1]; fp32 on CUDA, A on CPU);
- the flash SDPA kernel: q, k, v, out and the fp32 logsumexp [b, a, s] (CUDA adds its RNG state,
  a [2] uint64, and an unused [] uint64 offset: 24 bytes, with or without dropout); ``nll_loss``: log-probs,
  labels and a fp32 scalar total weight.
- ``torch.utils.checkpoint`` (non-reentrant) keeps the checkpointed function's inputs; a reversible stack
  keeps its last outputs.

Known limitations (NB): checkpoint and reversible layers also keep the RNG state (5056 bytes on CPU, 16 on
CUDA) as a Python object, not a saved tensor; it is not counted. Gradients and transient buffers are not
activations: see ``peak.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

from memplan.blocks import dropout_rule, fp8, fp8_tp, llama4, te_fp8
from memplan.blocks.attention.constants import constant_rules
from memplan.blocks.attention.core import (
    attention_core_rules,
    full_layer_setup,
    last_ring_rank,
    projection_rules,
)
from memplan.blocks.attention.mla import mla_projection_rules
from memplan.blocks.attention.windows import is_sliding, sliding_layers
from memplan.blocks.dtensor_cost import rowwise_input_grad_weight_whole, rowwise_weight_grad_whole
from memplan.blocks.embedding import embedding_rules
from memplan.blocks.head import lm_head_rules
from memplan.blocks.inventory import Block, Dims, Kept, Role, Rule, Scope, save
from memplan.blocks.mlp import mlp_rules
from memplan.blocks.moe import dense_layer_setup, dense_mlp_layers, moe_rules
from memplan.blocks.norm import norm_rules, post_norm_rules, pre_norm_rules, qk_norm_rules
from memplan.blocks.profiles import dropout_keeps, hidden_dropouts, profile_of
from memplan.config import Setup, StrategyConfig, TrainingConfig, unvalidated

B, R = Block, Role


# ----------------------------------------------------------------------------------------------------
# A layer and the model, composed from the blocks
# ----------------------------------------------------------------------------------------------------
def compiled_tp_gathers(setup: Setup, dims: Dims) -> list[Rule]:
    """A compiled block on a tensor-parallel rank without sequence parallelism (torchtitan's plan,
    ``Profile.compiled_block``): DTensor's cost-picked strategies for W_O's backward all-gather its input
    [T, a·d] (the weight gradient left ``Partial``: ``dtensor_cost.rowwise_weight_grad_whole``) and, where
    cheaper than all-reducing the output gradient, its weight [h, a·d] (the input gradient:
    ``rowwise_input_grad_weight_whole``). In the joint graph those all-gathers run in the forward, and the
    partitioner, which recomputes no collective, saves what they gathered; the eager plan gathers in
    backward (measured: tests/hf/test_torchtitan_compile_tp.py)."""
    par = setup.parallel
    if not (profile_of(setup).compiled_block and par.tp > 1 and not par.sp):
        return []
    t, act = par.tp, dims.act
    tokens, attn = dims.b * dims.s, dims.a * dims.v_dim * t  # the whole W_O input width, a·d
    why = "gathered for W_O's backward in the compiled forward (DTensor's cost-picked strategy)"
    rules = []
    if rowwise_weight_grad_whole(tokens, dims.h, attn, t, act.bytes):
        rules.append(save(B.ATTN, "out_gathered", (tokens, attn), act, R.ATTN_OUT, f"W_O's input {why}"))
    if rowwise_input_grad_weight_whole(tokens, dims.h, attn, t, act.bytes):
        rules.append(save(B.ATTN, "wo_gathered", (dims.h, attn), act, R.PARAM_DERIVED, f"W_O {why}"))
    return rules


def layer_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """Everything one transformer layer keeps when it is not checkpointed (Llama 4's code: its largest
    kind of layer, ``blocks.hf.llama4``)."""
    if llama4.applies(setup):
        return llama4_layer_rules(setup, dims)
    b, s, h, act = dims.b, dims.s, dims.h, dims.act
    p, keeps = hidden_dropouts(setup)[0], dropout_keeps(setup, act)
    p_attn = 0.0 if profile_of(setup).mlp_dropout_only else p
    rules = [
        *pre_norm_rules(setup, B.ATTN_NORM, dims),
        *(mla_projection_rules(setup, dims) if setup.model.mla else projection_rules(setup, dims)),
        *qk_norm_rules(setup, dims),
        *attention_core_rules(setup, dims),
        *(
            []
            if last_ring_rank(setup, dims)  # W_O reads the merged ring output itself (attention.flash_rules)
            else [
                save(
                    B.ATTN,
                    "out",
                    (b, s, dims.a * dims.v_dim),
                    act,
                    R.ATTN_OUT,
                    "attention output, input of W_O: dW = Xᵀ·dY",
                )
            ]
        ),
        *compiled_tp_gathers(setup, dims),
        *post_norm_rules(setup, B.POST_ATTN_NORM, dims),
        *dropout_rule(B.ATTN, "resid_dropout_mask", p_attn, (b, s, h), keeps),
        *pre_norm_rules(setup, B.MLP_NORM, dims),
        *mlp_rules(setup, dims),
        *post_norm_rules(setup, B.POST_MLP_NORM, dims),
        *dropout_rule(B.MLP, "resid_dropout_mask", p, (b, s, h), keeps),
    ]
    # Transformer Engine's float8 linears keep float8 casts of their inputs (blocks/te_fp8.py), and so do
    # torchao's under its float8 tensor-parallel plan (blocks/fp8_tp.py).
    if te_fp8.applies(setup):
        return te_fp8.layer_rules(setup, rules)
    if profile_of(setup).compiled_block and fp8.enabled(setup):  # torchao's under --compile
        return fp8.compiled_rules(setup, dims, rules)
    return fp8_tp.layer_rules(rules) if fp8_tp.applies(setup) else rules


def llama4_layer_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """A uniform kind's rules, or the largest kind's for a model of several."""
    if llama4.is_uniform(setup.model):
        return llama4.layer_rules(setup, dims)
    kinds = [k for k, _ in llama4.layer_kinds(setup)]
    rules = [llama4.layer_rules(k, Dims.of(k)) for k in kinds]
    return max(rules, key=lambda rs: sum(r.bytes for r in rs))


def head_rules(setup: Setup, dims: Dims) -> list[Rule]:
    """The final norm, the lm head and the loss."""
    return norm_rules(setup, B.FINAL_NORM, dims) + lm_head_rules(setup, dims)


# ----------------------------------------------------------------------------------------------------
# The inventory
# ----------------------------------------------------------------------------------------------------
def kept(rules: list[Rule], scope: Scope, count: int) -> list[Kept]:
    """The inventory entries of ``rules``, ``count`` of each. Built without pydantic's validation
    (``config.unvalidated``): every field comes typed from a ``Rule`` (``memplan fit`` builds ≈ 10⁵ of
    them; validation was ≈ 8 % of its time). tests/test_inventory_text.py compares them with validated
    ones."""
    return [
        unvalidated(
            Kept,
            name=r.name,
            block=r.block,
            role=r.role,
            shape=r.shape,
            dtype=r.dtype,
            scope=scope,
            count=count,
            reason=r.reason,
        )
        for r in rules
    ]


def with_moe(saves: list[Kept], setup: Setup) -> list[Kept]:
    """``saves`` with each layer's dense MLP inner saves replaced by the MoE layer's (same count), for a
    mixture of experts (``blocks.moe.moe_rules``)."""
    moe = setup.model.moe
    if moe is None:
        return saves
    out: list[Kept] = []
    done = False
    for k in saves:
        if not (k.block is B.MLP and k.role is R.MLP_INNER):
            out.append(k)
            continue
        if not done:
            out += moe_entries(setup, k.count)
            done = True
    return out


def moe_entries(setup: Setup, count: int) -> list[Kept]:
    """The MoE MLP's saves for ``count`` layers; with DeepSeek's dense first layers (``moe.dense_layers``)
    over the whole model (``count`` = L), those k layers keep a dense MLP's inner saves of ``dense_ffn``
    instead (``blocks.moe.dense_layer_setup``); a single layer's working set (count 1) is an MoE layer's,
    the larger."""
    moe = setup.model.moe
    assert moe is not None  # NB: called for mixtures of experts only
    dense = dense_layer_setup(setup)
    if dense is None or count != setup.model.num_layers:
        return kept(moe_rules(setup, moe), Scope.LAYER, count)
    inner = [r for r in mlp_rules(dense, Dims.of(dense)) if r.role is R.MLP_INNER]
    ours = kept(moe_rules(setup, moe), Scope.LAYER, count - moe.dense_layers)
    return ours + kept(inner, Scope.LAYER, moe.dense_layers)


def layer_entries(setup: Setup, dims: Dims) -> list[Kept]:
    """Every layer's saves: one entry per save, ``count`` the layers keeping it. Layers of two kinds
    (``attention.full_layer_setup``: Gemma-2/3's full and sliding layers under SDPA) share the saves both
    make (count L); a save of one kind only counts that kind's layers."""
    if llama4.applies(setup) and not llama4.is_uniform(setup.model):
        return kinds_entries(llama4.layer_kinds(setup))
    full = full_layer_setup(setup)
    if full is None:
        return with_moe(kept(layer_rules(setup, dims), Scope.LAYER, dims.layers), setup)
    sliding, whole = layer_rules(setup, dims), layer_rules(full, Dims.of(full))
    n = sliding_layers(setup.model)

    def key(r: Rule) -> tuple[object, ...]:
        return r.name, r.shape, r.dtype, r.role

    theirs, ours = {key(r) for r in whole}, {key(r) for r in sliding}
    entries = [k for r in sliding for k in kept([r], Scope.LAYER, dims.layers if key(r) in theirs else n)]
    entries += kept([r for r in whole if key(r) not in ours], Scope.LAYER, dims.layers - n)
    return with_moe(entries, setup)


def kinds_entries(kinds: list[tuple[Setup, int]]) -> list[Kept]:
    """The saves of layers of several kinds (each a setup and its number of layers): one entry per save,
    ``count`` the layers whose kind keeps it, in the order the kinds first make them."""
    counts: dict[tuple[object, ...], int] = {}
    rules: dict[tuple[object, ...], Rule] = {}
    for kind, n in kinds:
        for r in layer_rules(kind, Dims.of(kind)):
            key = r.name, r.shape, r.dtype, r.role
            rules.setdefault(key, r)
            counts[key] = counts.get(key, 0) + n
    return [k for key, r in rules.items() for k in kept([r], Scope.LAYER, counts[key])]


def layer_kind_setups(setup: Setup) -> tuple[Setup, ...]:
    """Each layer's own setup when the layers differ by kind, in order — Llama 4's kinds
    (``blocks.hf.llama4.kind_of_layers``), DeepSeek's dense first layers (``blocks.moe.dense_layer_setup``;
    its MoE layers are ``setup`` itself), the full layers among sliding ones (``attention.full_layer_setup``)
    —; () when every layer is alike (``layer_kind_bytes``' layers)."""
    m = setup.model
    if llama4.applies(setup) and not llama4.is_uniform(m):
        return tuple(llama4.kind_of_layers(setup))
    dense = dense_layer_setup(setup)
    if dense is not None:
        n = dense_mlp_layers(setup)
        return tuple(dense if i < n else setup for i in range(m.num_layers))
    full = full_layer_setup(setup)
    if full is None:
        return ()
    return tuple(setup if is_sliding(m, i) else full for i in range(m.num_layers))


def layer_kind_bytes(setup: Setup) -> tuple[int, ...]:
    """Each layer's bytes when the layers differ by kind (``attention.full_layer_setup``, Llama 4's
    ``blocks.hf.llama4.layer_kinds``), in order; () when every layer keeps the same."""
    if llama4.applies(setup) and not llama4.is_uniform(setup.model):
        per_kind = [
            total_bytes(kept(layer_rules(k, Dims.of(k)), Scope.LAYER, 1))
            for k in llama4.kind_of_layers(setup)
        ]
        return tuple(per_kind)
    dense = dense_layer_setup(setup)
    if dense is not None:  # DeepSeek: the first k layers dense, the others MoE
        moe_bytes = total_bytes(with_moe(kept(layer_rules(setup, Dims.of(setup)), Scope.LAYER, 1), setup))
        dense_bytes = total_bytes(kept(layer_rules(dense, Dims.of(dense)), Scope.LAYER, 1))
        n = dense_mlp_layers(setup)
        return tuple(dense_bytes if i < n else moe_bytes for i in range(setup.model.num_layers))
    full = full_layer_setup(setup)
    if full is None:
        return ()
    sliding = total_bytes(kept(layer_rules(setup, Dims.of(setup)), Scope.LAYER, 1))
    whole = total_bytes(kept(layer_rules(full, Dims.of(full)), Scope.LAYER, 1))
    return tuple(sliding if is_sliding(setup.model, i) else whole for i in range(setup.model.num_layers))


def inventory(setup: Setup) -> list[Kept]:
    """What the blocks keep when the forward pass of one micro-batch ends, every layer whole: the
    embedding and per-forward constants, each layer's saves (an MoE's MLP swapped in), the head. The
    strategies that drop or replace layers' saves (checkpointing, reversible layers, memplan.strategies)
    are applied to it by the engine."""
    dims = Dims.of(setup)
    constants = llama4.constant_rules if llama4.applies(setup) else constant_rules
    model = embedding_rules(setup, dims) + constants(setup, dims)
    layers = layer_entries(setup, dims)
    return kept(model, Scope.MODEL, 1) + layers + kept(head_rules(setup, dims), Scope.MODEL, 1)


PER_STEP = frozenset({"grad_accum", "zero", "dp"})
"""The setup fields no block's rule reads, nor the strategies the rules go through (the engine caches the
pieces without them: ``pieces._PER_STEP``), nor ``Dims.of``."""


def rank_key(setup: Setup) -> tuple[object, ...]:
    """Every field of ``setup`` but ``PER_STEP``: the key of what one layer's rules give, shared by the
    ZeRO stages, dp degrees and micro-batch counts of one configuration."""
    return setup_key(setup, PER_STEP)


def setup_key(setup: Setup, without: frozenset[str]) -> tuple[object, ...]:
    """Every field of ``setup`` — its training's and strategy's one by one — but those named ``without``,
    flat, read from the models' ``__dict__`` (no copies; pydantic's own iteration costs several times
    more, and the search builds such keys for every configuration)."""
    top, training, strategy = _field_names(without)
    d, t, s = setup.__dict__, setup.training.__dict__, setup.strategy.__dict__
    return (*[d[n] for n in top], *[t[n] for n in training], *[s[n] for n in strategy])


@functools.cache
def _field_names(without: frozenset[str]) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """The names ``setup_key`` reads: the setup's fields but training and strategy, then theirs."""
    top = tuple(n for n in Setup.model_fields if n not in ("training", "strategy"))
    training = tuple(n for n in TrainingConfig.model_fields if n not in without)
    strategy = tuple(n for n in StrategyConfig.model_fields if n not in without)
    return top, training, strategy


_WORKING: dict[tuple[object, ...], tuple[Kept, ...]] = {}
_WORKING_MAX = 8192


def layer_working_set(setup: Setup) -> tuple[Kept, ...]:
    """What one un-checkpointed layer keeps: the working set of a recomputed layer in backward.

    Memoised on ``rank_key`` (the peak model asks for it several times per estimate; ``memplan fit`` per
    configuration, each ZeRO stage of it). tests/plan/test_fit_memos.py checks it against the rules.
    """
    key = rank_key(setup)
    found = _WORKING.get(key)
    if found is None:
        if len(_WORKING) >= _WORKING_MAX:
            _WORKING.clear()
        found = _WORKING[key] = tuple(kept(layer_rules(setup, Dims.of(setup)), Scope.LAYER, 1))
    return found


def layer_saves_kept(setup: Setup) -> tuple[Kept, ...]:
    """``layer_working_set`` as the top layer keeps it: a mixture of experts' MLP with its MoE saves
    (``with_moe``: block ``moe``) where a dense MLP keeps its inner [T, f] ones; under fine-tuning its saves
    under its gradient flow (``FLOW_SAVES``: a frozen norm's weight product keeps no normalised x, a frozen
    linear no input). Memoised as ``layer_working_set`` (the layer moments ask for it a dozen times an
    estimate). Before, the fine-tuned layer's moments freed the saves of a trained one: OLMo-2's and
    Gemma-2's post norms' normalised x, which no frozen norm keeps, one fp32 [T, h] under at their layer
    backward (tests/hf/test_hf_peak.py)."""
    tuned = not setup.finetune.trains_everything
    if setup.model.moe is None and not tuned:
        return layer_working_set(setup)
    key = rank_key(setup)
    found = _KEPT.get(key)
    if found is None:
        if len(_KEPT) >= _WORKING_MAX:
            _KEPT.clear()
        if tuned:
            if not FLOW_SAVES:
                raise RuntimeError("layer_saves_kept: fine-tuning's flow needs strategies.lora imported")
            found = FLOW_SAVES[0](setup)
        else:
            found = tuple(with_moe(list(layer_working_set(setup)), setup))
        _KEPT[key] = found
    return found


FLOW_SAVES: list[Callable[[Setup], tuple[Kept, ...]]] = []
"""The top layer's saves under fine-tuning's gradient flow (``strategies.lora.top_layer_saves``), which
that module registers as it is imported: the strategies sit above this module, the layer moments below it
(import-linter's layers), and it is one source, the inventory's rules."""


_KEPT: dict[tuple[object, ...], tuple[Kept, ...]] = {}


def clear_working_sets() -> None:
    """Forget ``layer_working_set``'s and ``layer_saves_kept``'s memos (cold-start benchmarks)."""
    _WORKING.clear()
    _KEPT.clear()


def total_bytes(kept: Iterable[Kept]) -> int:
    return sum(k.total_bytes for k in kept)


def per_layer_bytes(kept: list[Kept], layers: int) -> int:
    """Bytes of one layer's entries (layer-scope totals spread over the layers)."""
    return sum(k.total_bytes for k in kept if k.scope is Scope.LAYER) // layers
