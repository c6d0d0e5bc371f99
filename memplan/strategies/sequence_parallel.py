"""What tensor and sequence parallelism do to each kept activation, by inventory name.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models"), §4.2:

- §4.2.2, tensor parallelism (``TENSOR``): everything between a column-parallel and the following
  row-parallel linear is split t ways, because each rank owns a/t heads and f/t MLP columns: q, k, v, the
  softmax output, its dropout mask and the dropped probabilities, the attention output (input of the
  row-parallel W_O), and the MLP's inner activations. The loss's fp32 log-probs are split too: Megatron's
  vocabulary-parallel cross entropy keeps [T, v/t] per rank ("fp32 logits 4sbv/t", Korthikanti §4.3).
  memplan gets these for free: the inventory of ``parallel.tp_model`` (a/t heads, f/t width, v/t vocab)
  already has the split shapes; the table below says so and tests/plan check it name by name.
- §4.2.2, what tensor parallelism leaves whole (``SEQUENCE``): the layer-norm inputs (and statistics),
  the inputs of the column-parallel linears (attention and MLP input) and the dropout masks after the
  row-parallel linears — the "10sbh" of ``sbh(10 + 24/t + 5as/(ht))``. Sequence parallelism (§4.2.3)
  splits exactly these along the sequence: norms and dropouts run on s/t tokens, and the inputs of the
  column-parallel linears are stored as the sequence-parallel shard and all-gathered again in backward,
  which makes ``(sbh/t)(34 + 5as/h)``. The lm head's input follows the same rule ("output-layer input
  2sbh/t") and so do the checkpointed layer input and the reversible stack's outputs (the residual stream
  between layers is [s/t, b, h] in Megatron with sequence parallelism).
- ``REPLICATED``: the same on every rank with or without sequence parallelism: token and position ids, the
  loss labels ("loss labels replicated": the vocabulary-parallel loss needs every target on every rank),
  the causal mask and RoPE tables (constants of the sequence), the flash kernel's RNG seed and offset, and the
  MoE tokens dispatched to the experts (expert tensor parallelism all-gathers them over the tp ranks).

A name missing from the table is kept whole (the safe, larger answer); tests/plan assert that every name
the inventory produces for any strategy is in it.
"""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple

from memplan.analytic.inventory import Kept


class Split(StrEnum):
    TENSOR = "tensor"
    """Split t ways by tensor parallelism itself (the rank's a/t heads, f/t columns or v/t vocabulary)."""
    SEQUENCE = "sequence"
    """Whole under tensor parallelism; split t ways along the sequence by sequence parallelism."""
    REPLICATED = "replicated"
    """Whole on every tensor-parallel rank."""


class Rule(NamedTuple):
    split: Split
    dim: int
    """The dimension split: heads/width for TENSOR, sequence (or flattened tokens) for SEQUENCE."""


_HEADS = Rule(Split.TENSOR, 1)  # [b, heads, s, …]
_WIDTH = Rule(Split.TENSOR, -1)  # [b, s, width] or [T, width]
_SEQ = Rule(Split.SEQUENCE, 1)  # [b, s, …]
_TOKENS = Rule(Split.SEQUENCE, 0)  # [T, …] with T = b·s flattened
_WHOLE = Rule(Split.REPLICATED, 0)

_NORM_PARTS = ("input", "mean", "rstd", "normed")
RULES: dict[str, Rule] = {
    # Layer norms (LayerNorm: input, mean, rstd; RMSNorm: fp32 input, rstd, normed): replicated under TP.
    **{f"{norm}.{part}": _SEQ for norm in ("attn_norm", "mlp_norm", "final_norm") for part in _NORM_PARTS},
    # Inputs of the column-parallel linears and the masks after the row-parallel ones.
    "attn.input": _SEQ,
    "mlp.input": _SEQ,
    "lm_head.input": _SEQ,
    "attn.resid_dropout_mask": _SEQ,
    "mlp.resid_dropout_mask": _SEQ,
    "embed.dropout_mask": _SEQ,
    "layer.input": _SEQ,
    "rev.y1": _SEQ,
    "rev.y2": _SEQ,
    # Inside the attention core: a/t heads (and kv/t groups) per rank. attn.v is [b, s, kv·d] on the flash
    # and selective paths (split on its last dimension) and [b, a, s, d] on the eager one (dimension 1).
    "attn.q": _HEADS,
    "attn.k": _HEADS,
    "attn.v": _HEADS,
    "attn.probs": _HEADS,
    "attn.dropout_mask": _HEADS,
    "attn.probs_dropped": _HEADS,
    "attn.lse": _HEADS,
    "attn.out": _WIDTH,
    # MLP between its column- and row-parallel matrices: f/t columns.
    "mlp.gate": _WIDTH,
    "mlp.act": _WIDTH,
    "mlp.up": _WIDTH,
    "mlp.down_input": _WIDTH,
    # Vocabulary-parallel loss.
    "loss.log_probs": _WIDTH,
    # Replicated.
    "embed.ids": _WHOLE,
    "embed.positions": _WHOLE,
    "loss.labels": _WHOLE,
    "loss.total_weight": _WHOLE,
    "attn.causal_mask": _WHOLE,
    "attn.philox_seed": _WHOLE,
    "attn.philox_offset": _WHOLE,
    "rope.cos": _WHOLE,
    "rope.sin": _WHOLE,
    # Mixture of experts (moe.py): the router runs on the rank's tokens (s/t of them with sequence
    # parallelism); the experts' inner activations are split like a dense MLP; the tokens dispatched to
    # the experts, their outputs and routing weights are gathered over the tp ranks (Megatron-Core's
    # all-gather token dispatcher with expert tensor parallelism = tp).
    "moe.router_probs": _TOKENS,
    "moe.topk_indices": _TOKENS,
    "moe.topk_sum": _TOKENS,
    "moe.topk_weights": _TOKENS,
    "moe.weight_index": _WHOLE,
    "moe.dispatch_index": _WHOLE,
    "moe.expert_input": _WHOLE,
    "moe.gate": _WIDTH,
    "moe.act": _WIDTH,
    "moe.up": _WIDTH,
    "moe.down_input": _WIDTH,
    "moe.expert_output": _WHOLE,
    "moe.routing_weights": _WHOLE,
    "moe.weighted_output": _WHOLE,
    "moe.shared.gate": _WIDTH,
    "moe.shared.act": _WIDTH,
    "moe.shared.up": _WIDTH,
    "moe.shared.down_input": _WIDTH,
    "moe.shared_gate": _TOKENS,
    "moe.shared_output": _TOKENS,
}


def rule(name: str) -> Rule:
    """The rule of one inventory name; a name not in the table is kept whole (see the module docstring)."""
    return RULES.get(name, _WHOLE)


def tensor_dim(k: Kept) -> int:
    """The dimension tensor parallelism splits: heads (dim 1) of a head-major tensor, else the last."""
    if k.name == "attn.v" and len(k.shape) == 3:
        return -1  # [b, s, kv·d] on the flash / selective paths
    return rule(k.name).dim


def sequence_parallel(kept: list[Kept], tp: int) -> list[Kept]:
    """The inventory of a tensor-parallel rank (``tp_model``) with sequence parallelism over ``tp`` ranks:
    every ``SEQUENCE`` entry keeps s/t of its tokens (``check_parallel`` ensures t divides s)."""
    out: list[Kept] = []
    for k in kept:
        r = rule(k.name)
        if r.split is Split.SEQUENCE and tp > 1:
            shape = list(k.shape)
            shape[r.dim] //= tp
            k = k.model_copy(update={"shape": tuple(shape)})
        out.append(k)
    return out
