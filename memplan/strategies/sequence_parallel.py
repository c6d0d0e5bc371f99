"""What tensor and sequence parallelism do to each kept activation, by its role (``inventory.Role``).

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

Every role has a rule (``SPLITS``); a role without one raises, and tests/plan check the table covers the
enum.
"""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple

from memplan.blocks.inventory import Dims, Kept, Role
from memplan.blocks.profiles import profile_of
from memplan.config import Setup


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

SPLITS: dict[Role, Rule] = {
    # Layer norms (LayerNorm: input, mean, rstd; RMSNorm: fp32 input, rstd, normed): replicated under TP.
    Role.NORM_INPUT: _SEQ,
    Role.NORM_STATS: _SEQ,
    Role.NORM_OUTPUT: _SEQ,
    # Inputs of the column-parallel linears, the masks after the row-parallel ones, the residual stream.
    Role.LINEAR_INPUT: _SEQ,
    Role.DROPOUT_MASK: _SEQ,
    Role.LORA_RANK: _SEQ,
    Role.RESIDUAL: _SEQ,
    # A pipeline stage's boundary [b, s, h] (made per stage from the rank's s/t: never split again).
    Role.STAGE_OUTPUT: _SEQ,
    Role.RECV_BUFFER: _SEQ,
    # Inside the attention core: a/t heads (and kv/t groups) per rank. attn.v is [b, s, kv·d] on the flash
    # and selective paths (split on its last dimension) and [b, a, s, d] on the eager one (dimension 1).
    Role.ATTN_QKV: _HEADS,
    Role.ATTN_PROBS: _HEADS,
    Role.ATTN_DROPOUT_MASK: _HEADS,
    Role.ATTN_LSE: _HEADS,
    Role.ATTN_OUT: _WIDTH,
    # MLP between its column- and row-parallel matrices: f/t columns (routed and shared experts alike).
    Role.MLP_INNER: _WIDTH,
    # Vocabulary-parallel loss.
    Role.LOG_PROBS: _WIDTH,
    # A fused loss's gradients: dX like the lm head's input, dW [v/t, h] vocabulary rows (fused with
    # tp > 1 is a vocabulary-parallel variant Liger does not ship: the rank's rows).
    Role.HEAD_INPUT_GRAD: _SEQ,
    Role.HEAD_WEIGHT_GRAD: Rule(Split.TENSOR, 0),
    # Replicated.
    Role.TOKEN_IDS: _WHOLE,
    Role.LABELS: _WHOLE,
    Role.LOSS_SCALAR: _WHOLE,
    Role.CHUNK_SCALAR: _WHOLE,
    Role.CHUNK_LABELS: _WHOLE,
    Role.CAUSAL_MASK: _WHOLE,
    Role.RNG_STATE: _WHOLE,
    Role.ROPE_TABLE: _WHOLE,
    Role.PARAM_DERIVED: _WHOLE,
    # Mixture of experts (blocks/moe.py): the router runs on the rank's tokens (s/t of them with sequence
    # parallelism); the tokens dispatched to the experts, their outputs and routing weights are gathered
    # over the tp ranks (Megatron-Core's all-gather token dispatcher with expert tensor parallelism = tp).
    Role.ROUTER: _TOKENS,
    Role.SHARED_GATE: _TOKENS,
    Role.DISPATCH_INDEX: _WHOLE,
    Role.EXPERT_TOKENS: _WHOLE,
}


def rule(role: Role) -> Rule:
    """The split of a role; a role without a rule is an error (tests/plan check every role has one)."""
    try:
        return SPLITS[role]
    except KeyError:
        raise ValueError(f"role: {str(role)!r} has no tensor-parallel rule; add it to SPLITS") from None


def tensor_dim(k: Kept) -> int:
    """The dimension tensor parallelism splits: heads (dim 1) of a head-major tensor, else the last."""
    if k.role is Role.ATTN_QKV and len(k.shape) == 3:
        return -1  # v as the projection output [b, s, kv·d] on the flash / selective paths
    return rule(k.role).dim


def applies(setup: Setup) -> bool:
    return setup.parallel.sp


def keeps(kept: list[Kept], setup: Setup) -> list[Kept]:
    """The inventory of a tensor-parallel rank (``tp_model``) under sequence parallelism; torchtitan's plan
    gathers the linears' inputs at the module boundary and keeps them whole (``Profile.sp_module_gather``)."""
    if not applies(setup):
        return kept
    whole = (Role.LINEAR_INPUT,) if profile_of(setup).sp_module_gather else ()
    return sequence_parallel(kept, setup.parallel.tp, whole)


def recompute(setup: Setup, dims: Dims) -> int:
    """Nothing is re-run (the gathered inputs are communication, not recompute)."""
    return 0


def sequence_parallel(kept: list[Kept], tp: int, whole: tuple[Role, ...] = ()) -> list[Kept]:
    """The inventory of a tensor-parallel rank (``tp_model``) with sequence parallelism over ``tp`` ranks:
    every ``SEQUENCE`` entry but the roles in ``whole`` keeps s/t of its tokens (``check_parallel`` ensures
    t divides s)."""
    out: list[Kept] = []
    for k in kept:
        r = rule(k.role)
        if r.split is Split.SEQUENCE and tp > 1 and k.role not in whole:
            shape = list(k.shape)
            shape[r.dim] //= tp
            k = k.model_copy(update={"shape": tuple(shape)})
        out.append(k)
    return out
