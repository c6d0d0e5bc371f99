"""A layer's forward temporaries, as the tensors they are: the reference model's dense layer
(``measure/reference/model.py``: ``rms_norm``, the projections, ``apply_rope``, ``attention_core`` eager,
W_O, ``dense_mlp``) written as its allocations and frees in op order, so that the allocator's replay
(``alloc_stream``) can make and free them where the real step does: the eager core's [b, a, s, s] scores,
masked scores and (selective checkpointing) probabilities are freed each layer, and the next layer's
saves are carved out of their blocks.

``layer_forward_ops`` is the program; ``forward_peak`` walks it to the layer's forward peak: the
temporaries alive then (beyond the saves) in the order they were made, and how many saves were made by
then. tests/measure/test_forward_locals.py checks the program against the CPU tracker's allocations and
frees inside a layer's forward, size by size and in order, and its saves against the inventory.

Known limitations (``applies``: empty elsewhere, the forward's temporaries are then not in the stream):
- NB: the eager core only, without dropout, with checkpointing none or selective, one device's whole
  layer (no tensor, sequence or context parallelism), RMSNorm on 2-byte activations (bf16/fp16: fp32's
  ``x.float()`` aliases the residual), RoPE over the whole head, a dense MLP, no LoRA, MoE, MLA,
  reversible layers, offload, float8 or compile. The flash core's temporaries (RoPE's, the norm's fp32
  square) are a few [T, h]-sized tensors: not modelled (the measured flash rows are within ±1.3 %).
- NB: the residual stream (a layer's input, [T, h]) is not a tensor of the timeline's points; a layer's
  output is counted among its temporaries where the peak is the op that makes it (a layer whose MLP
  peaks), and the stream frees it at the layer's boundary, one layer early.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from memplan.blocks.inventory import Dims
from memplan.config import Attention, Checkpointing, Fp8Recipe, Impl, Offload, Setup
from memplan.config.model import MlpType, ModelConfig, NormType, PositionType


class Kind(Enum):
    SAVE = "save"
    """Kept for the backward (one of the layer's inventory tensors)."""
    TEMP = "temp"
    """Freed before the layer's forward ends."""
    CARRY = "carry"
    """The layer's output, the next layer's input: it outlives the layer (freed after the next one's
    boundary, as the layers' loop rebinds x)."""


@dataclass(frozen=True, slots=True)
class Op:
    """One allocation (``size`` > 0: tensor ``key`` made, of ``kind``) or free (``size`` 0)."""

    key: str
    size: int = 0
    kind: Kind = Kind.TEMP


def _plain(m: ModelConfig) -> bool:
    """A Llama-style layer as ``layer_forward_ops`` writes it: pre-norm RMSNorm, whole-head RoPE, a dense
    MLP, none of the variants' extra ops."""
    return (
        m.norm is NormType.RMSNORM
        and m.position is PositionType.ROPE
        and m.rotary_pct == 1.0
        and m.moe is None
        and m.mla is None
        and not (m.qk_norm or m.post_norms or m.parallel_residual or m.shared_norm or m.attn_sinks)
        and m.sliding_window is None
        and m.sliding_window_pattern is None
        and m.attn_chunk is None
        and m.nope_every is None
        and m.attn_softcap is None
        and not m.attn_temperature
        and m.attn_dropout == 0
        and m.resid_dropout == 0
    )


def applies(setup: Setup, dims: Dims) -> bool:
    """Whether the layer's forward is modelled as its tensors (the module docstring's limitations)."""
    s, p = setup.strategy, setup.parallel
    return (
        setup.impl.impl is Impl.REFERENCE
        and not setup.impl.compile
        and setup.impl.fp8 is Fp8Recipe.NONE
        and s.attention is Attention.EAGER
        and s.checkpointing in (Checkpointing.NONE, Checkpointing.SELECTIVE)
        and not s.segment
        and not s.reversible
        and setup.offload is Offload.NONE
        and setup.finetune.trains_everything
        and p.tp == 1
        and p.cp == 1
        and dims.act.bytes == 2
        and dims.a > 1
        and dims.s > 1
        and _plain(setup.model)
    )


def _rms_norm(prefix: str, t: int, h: int, e: int) -> list[Op]:
    """``rms_norm`` then the weight: x.float() (kept), its square and mean (fp32), + eps, rsqrt (kept),
    x·rstd (fp32), cast back (kept), · weight (kept: the next linear's input)."""
    p = prefix
    return [
        Op(f"{p}.input", t * h * 4, Kind.SAVE),
        Op(f"{p}.square", t * h * 4),
        Op(f"{p}.mean", t * 4),
        Op(f"{p}.square"),
        Op(f"{p}.eps", t * 4),
        Op(f"{p}.mean"),
        Op(f"{p}.rstd", t * 4, Kind.SAVE),
        Op(f"{p}.eps"),
        Op(f"{p}.scaled", t * h * 4),
        Op(f"{p}.normed", t * h * e, Kind.SAVE),
        Op(f"{p}.scaled"),
        Op(f"{p}.out", t * h * e, Kind.SAVE),
    ]


def _rope(name: str, n: int, kind: Kind) -> list[Op]:
    """``apply_rope`` of a [b, heads, s, d] of ``n`` bytes: x·cos, rotate_half's negated half and its
    concatenation, · sin, the sum (``kind``); the products freed once the sum is made."""
    return [
        Op(f"{name}.cos", n),
        Op(f"{name}.neg", n // 2),
        Op(f"{name}.cat", n),
        Op(f"{name}.neg"),
        Op(f"{name}.sin", n),
        Op(f"{name}.cat"),
        Op(name, n, kind),
        Op(f"{name}.cos"),
        Op(f"{name}.sin"),
    ]


def _attention(setup: Setup, dims: Dims) -> list[Op]:
    """The projections, RoPE and the eager core (``attention_core``) up to W_O's input. Selective
    checkpointing keeps the core's inputs (RoPE's q and k, v as W_V's output) and nothing inside it (its
    contiguous copies and probabilities are freed when it returns); without checkpointing the core's
    copies and probabilities are kept, and RoPE's outputs and W_V's output live until ``attention``
    returns (its locals)."""
    e, t = dims.act.bytes, dims.tokens
    q, kv, full = t * dims.a * dims.d * e, t * dims.kv * dims.d * e, t * dims.a * dims.d * e
    scores = dims.b * dims.a * dims.s * dims.s * e  # [b, a, s, s]
    selective = setup.strategy.checkpointing is Checkpointing.SELECTIVE
    kept, inner = (Kind.SAVE, Kind.TEMP) if selective else (Kind.TEMP, Kind.SAVE)
    ops = [Op("q.linear", q), Op("k.linear", kv), Op("v.linear", kv, kept)]
    ops += _rope("q", q, kept) + _rope("k", kv, kept) + [Op("k.linear"), Op("q.linear")]
    # the core: q's copy, k's and v's (repeated to a heads, or copied contiguous), then the scores
    ops += [Op("core.q", full, inner), Op("core.k", full, inner), Op("core.v", full, inner)]
    ops += [Op("core.qk", scores), Op("core.scores", scores), Op("core.qk")]  # q·kᵀ, then scaled
    ops += [Op("core.masked", scores), Op("core.probs", scores, inner), Op("core.masked")]
    ops += [Op("core.ctx", full), Op("attn.out", full, Kind.SAVE)]  # P·V, its [b, s, a·d] copy
    frees = ["core.q", "core.k", "core.v", "core.scores", "core.probs", "core.ctx"]
    return ops + [Op(k) for k in (frees if selective else ["core.scores", "core.ctx"])]


def layer_forward_ops(setup: Setup, dims: Dims) -> list[Op]:
    """The reference's dense layer forward (``applies``), allocation by allocation in op order."""
    e, t, h, f = dims.act.bytes, dims.tokens, dims.h, dims.f
    selective = setup.strategy.checkpointing is Checkpointing.SELECTIVE
    ops = _rms_norm("attn_norm", t, h, e) + _attention(setup, dims)
    ops.append(Op("attn.o", t * h * e))  # W_O's output
    if not selective:  # ``attention``'s locals die as it returns
        ops += [Op("q"), Op("k"), Op("v.linear")]
    ops += [Op("h1", t * h * e), Op("attn.o")]  # x + attention(x)
    ops += _rms_norm("mlp_norm", t, h, e)
    if setup.model.mlp is MlpType.SWIGLU:  # gate, act(gate), up, act·up
        ops += [Op(f"mlp.{k}", t * f * e, Kind.SAVE) for k in ("gate", "act", "up", "down_input")]
    else:  # up, gelu(up)
        ops += [Op(f"mlp.{k}", t * f * e, Kind.SAVE) for k in ("up", "down_input")]
    # W_down's output, h1 + it (the layer's output), then both freed as the layer returns
    return [*ops, Op("mlp.down", t * h * e), Op("out", t * h * e, Kind.CARRY), Op("mlp.down"), Op("h1")]


@dataclass(frozen=True)
class ForwardPeak:
    temporaries: tuple[int, ...]
    """The temporaries alive at the layer's forward peak, in the order they were made (bytes)."""
    saves_before: int
    """The layer's saves made by then (the first ``saves_before`` in op order)."""


def forward_peak(ops: list[Op]) -> ForwardPeak:
    """The moment of ``ops`` with the most bytes alive beyond the layer's start, the first such: the
    tensors alive then that are no saves (its output too, where the peak is its last op) and the saves
    made by then."""
    alive: dict[str, Op] = {}
    live = best = saves = 0
    found = ForwardPeak((), 0)
    for op in ops:
        if op.size:
            alive[op.key] = op
            saves += op.kind is Kind.SAVE
            live += op.size
        else:
            live -= alive.pop(op.key).size
        if live > best:
            best = live
            found = ForwardPeak(tuple(o.size for o in alive.values() if o.kind is not Kind.SAVE), saves)
    return found


def layer_forward_peak(setup: Setup, dims: Dims) -> ForwardPeak:
    """``forward_peak`` of the layer's program where it ``applies``; else nothing (no temporaries)."""
    if not applies(setup, dims):
        return ForwardPeak((), 0)
    return forward_peak(layer_forward_ops(setup, dims))
