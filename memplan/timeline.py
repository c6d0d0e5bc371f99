"""The memory of the most loaded device over one training step, term by term: a picture of the step.

Points, in step order:

- the forward pass, layer by layer: the resident states (weights, optimizer; gradients too when micro-batches
  accumulate) and the saved activations growing by one layer's saves per layer the device holds (its
  micro-batches in flight included), from the embedding's and the per-forward constants' saves to every
  save at the forward's end (the head's added last); where a layer's forward temporaries are known
  (``layer_peak``: the reference's eager layer), before each boundary the layer's forward peak: the saves
  it has made by then and its temporaries alive then, as their tensors;
- then each moment of the backward and the optimizer step that ``analytic.peak`` models, with the terms it
  holds (``Peak.moments``): loss backward, final norm backward, the largest layer backward, embedding
  backward, optimizer step; where modelled, the chunked loss's forward ("loss forward", drawn after the
  forward's end though it comes just before it: its transient, the chunks' logits, is freed by then) and
  the lm head's own backward ("lm head backward").

Exact at each point (the same figures the estimate reports; a layer's forward peak is
``blocks.forward_locals``' program, read on the CPU tracker's curve by tests/measure/test_forward_locals.py);
NB: between points nothing is drawn, and the forward's own temporaries (a layer's forward locals, the
fp32 logits) are not points of it — except the reference's eager layers' peaks (above) and
torchtitan's eager standard loss (``blocks.head.forward_loss_blocks``): its forward's loss moment (the
logits, their fp32 copy and the log-probs, alive together) is a point, and its transients at that point
and at the loss backward are the tensors they are (``Point.pieces``), for the allocator's replay; so is a
fully checkpointed layer's backward (``rerun_tensors``: its re-run forward's tensors, then the rest of
its transient one block).
"""

from __future__ import annotations

from dataclasses import dataclass

from memplan.analytic import activations as act
from memplan.analytic.fsdp import root as fsdp2_root
from memplan.analytic.fsdp.moments import zero3_head_unit, zero3_tied
from memplan.analytic.head_moments import module_rope_buffers
from memplan.analytic.moments.layer_saves import segment_rerun_bytes
from memplan.analytic.peak import TERMS, terms
from memplan.blocks.forward_locals import layer_forward_peak
from memplan.blocks.head import forward_loss_blocks, loss_backward_blocks
from memplan.blocks.inventory import Block, Dims, Scope
from memplan.config import Setup
from memplan.engine import Result
from memplan.pieces import rerun_kept
from memplan.strategies import lora
from memplan.strategies.offload import offloads_activations
from memplan.strategies.pipeline_parallel import Group

FORWARD_POINTS = 8
"""Forward points drawn at most (evenly spread over the layers), beside the forward's start and end."""


@dataclass(frozen=True)
class Point:
    label: str
    terms: dict[str, int]
    """Bytes of each of ``analytic.peak.TERMS`` alive then."""
    pieces: tuple[int, ...] = ()
    """The transient's tensors (their sum is ``terms["transient"]``) when it is known as several; empty: one
    block."""
    saves: tuple[int, ...] = ()
    """The activations this point adds to the point before, as the tensors they are, when known (the
    loss's saves at the forward's end, beside ``forward_loss_blocks``); empty: as the allocator's replay
    codes a rise (a layer's saves, or one block)."""

    @property
    def bytes(self) -> int:
        return sum(self.terms.values())


def _moment(
    name: str, parts: dict[str, int], loss_bwd: tuple[int, ...], rerun: tuple[int, ...] = ()
) -> Point:
    """A modelled moment; the loss backward's transient as its tensors when they are known (the rest of it,
    the loss scalar, one more block); a fully checkpointed layer's backward as the tensors its re-run
    forward makes again (``rerun_tensors``), then the rest of it (the backward's own buffers) one block."""
    known = loss_bwd if name == "loss backward" else rerun if name == "layer backward" else ()
    if not known:
        return Point(name, parts)
    rest = parts["transient"] - sum(known)
    if name == "layer backward" and rest < 0:  # not the re-run's moment (offload, …): one block
        return Point(name, parts)
    assert rest >= 0, (name, parts, known)
    return Point(name, parts, (*known, rest) if rest else known)


def rerun_tensors(r: Result) -> tuple[int, ...]:
    """A layer's saves as its full checkpoint's re-run makes them again in its backward, one tensor each
    (``pieces.rerun_kept``: the rank's, sequence parallelism's sharding and MoE included — the re-run term
    of the layer backward's transient, ``analytic.peak`` with ``Pieces.layer_correction``):
    torch.utils.checkpoint re-runs the layer's forward, each op's output its own allocation. Only for one
    layer per checkpoint (full AC), no fine-tuning, no offload, and when the re-run term is that working
    set whole (``segment_rerun_bytes`` shares no storage with the checkpoint: RMSNorm on bf16
    activations); else empty (one block).
    NB: the re-run's tensors are made before the backward's own buffers, so the pieces come first."""
    setup, rank = r.setup, r.pieces.setup
    if setup.strategy.segment != 1 or offloads_activations(setup) or lora.applies(rank):
        return ()
    if segment_rerun_bytes(rank, 1) != act.total_bytes(act.layer_working_set(rank)):
        return ()
    return tuple(k.bytes for k in rerun_kept(rank) for _ in range(k.count))


def layer_peak(r: Result, dims: Dims) -> tuple[int, int, tuple[int, ...]] | None:
    """A layer's forward peak where its temporaries are known as tensors (``blocks.forward_locals``): how
    many of its saves are made by then and their bytes (the first of its inventory's, which follows the
    layer's data flow), and its temporaries alive then, in the order they were made; None where they are
    not known, or where the device's layers do not each save one layer's inventory."""
    peak = layer_forward_peak(r.setup, dims)
    if not peak.temporaries:
        return None
    saves = [k.bytes for k in r.pieces.kept if k.scope is Scope.LAYER and k.count]
    if sum(saves) != r.pieces.group_bytes[Group.LAYER] or peak.saves_before > len(saves):
        return None
    return peak.saves_before, sum(saves[: peak.saves_before]), peak.temporaries


def saved_after(r: Result, layer_sets: int) -> list[int]:
    """Bytes the layers (or checkpointed segments) have saved after the first n of them, n = 0 … all.
    Fine-tuning's layers keep different bytes along the gradient flow (``Pieces.layer_bytes``, first layer
    first): their running sum; else n × one layer's."""
    per_layer = r.pieces.alone_layers or r.pieces.layer_bytes  # transformers' every-K: each layer its own
    if per_layer and (r.pieces.alone_layers or not r.setup.strategy.segment) and len(per_layer) == layer_sets:
        return [sum(per_layer[:n]) for n in range(layer_sets + 1)]
    group = Group.CHECKPOINT if r.setup.strategy.segment else Group.LAYER
    return [r.pieces.group_bytes[group] * n for n in range(layer_sets + 1)]


def forward_gathered(setup: Setup, n: int, layer_sets: int) -> int:
    """Bytes of FSDP2 units the forward holds gathered at layer n's boundary (or forward peak) beyond the
    shards, where they stay gathered into the backward: torchtitan's 2024 wrapping
    (``analytic.fsdp.root.kept_after_forward``) gathers the root unit first and never reshards it, nor
    the top block after its forward; so the allocator meets them there, before the loss's tensors, as
    the backward's moments count them; so does torchtitan's ZeRO-3 its tied [tok_embeddings, norm,
    lm_head] unit (``analytic.fsdp.moments.zero3_tied``), from the embedding's forward on. Elsewhere 0 (a
    unit resharded after its forward comes and goes between the points). ``setup``: the tensor-parallel
    rank's (``Result.rank_setup``), whose units these are, as ``analytic.peak`` counts them at the
    backward's moments."""
    if zero3_tied(setup):  # torchtitan's tied unit, gathered at the embedding's forward, kept to the end
        return zero3_head_unit(setup)
    if not (fsdp2_root.root_gathered(setup) and fsdp2_root.kept_after_forward(setup)):
        return 0
    return fsdp2_root.root_unit(setup) + (fsdp2_root.layer_flat(setup) if n >= layer_sets else 0)


def timeline(r: Result, forward_points: int = FORWARD_POINTS) -> list[Point]:
    """The most loaded device's memory at the forward's layer boundaries and at the modelled moments."""
    dev = r.device
    st, g = dev.states, r.pieces.group_bytes
    accumulating = r.setup.training.grad_accum > 1
    grads = st.gradients if accumulating else 0
    layer_group = Group.CHECKPOINT if r.setup.strategy.segment else Group.LAYER
    alone = len(r.pieces.alone_layers)  # transformers' every-K: layer by layer, each its own bytes
    layer_sets = alone or dev.counts[layer_group]
    saved = saved_after(r, layer_sets)
    # What the forward saves before its first layer and after its last one: the embedding's and the
    # constants' (and, reversible, the stack's outputs) first; the head's at the end.
    head = g[Group.HEAD] * dev.counts[Group.HEAD] + g[Group.HEAD_FREED] * dev.counts[Group.HEAD_FREED]
    before = dev.activations - head - saved[-1]
    if offloads_activations(r.setup):  # every save goes to the host as it is made: none stays on the GPU
        before, saved = 0, [0] * (layer_sets + 1)

    # torchtitan's RoPE caches where no layer saves them: module state, there from the start (one chunk's
    # layers, as the peak's moments count them: ``stage_plan.StagePlan.peak``)
    chunk = r.rank_setup.model.model_copy(update={"num_layers": dev.stage.chunk_layers})
    chunked = r.rank_setup.model_copy(update={"model": chunk})
    ropes = module_rope_buffers(chunked, Dims.of(chunked))

    # ``forward_gathered`` reads n only as n ≥ layer_sets: its two values, once
    gathered = (
        forward_gathered(r.rank_setup, 0, layer_sets),
        forward_gathered(r.rank_setup, layer_sets, layer_sets),
    )

    def forward(label: str, activations: int, n: int = 0) -> Point:
        """A point after (or inside) the forward of n layers (sets)."""
        weights = st.weights + gathered[n >= layer_sets]
        return Point(label, terms(weights, st.optimizer, grads, activations + ropes, 0))

    unit = "segments" if r.setup.strategy.segment and not alone else "layers"  # a segment keeps its input
    points = [forward("forward: start", before)]
    steps = sorted({round(layer_sets * k / forward_points) for k in range(1, forward_points + 1)} - {0})
    dims = Dims.of(r.rank_setup)  # the loss's [T, v] is the tensor-parallel rank's [T, v/t]
    core = layer_peak(r, dims)
    for n in steps:
        if core is not None:  # layer n's forward peak: its first saves and its temporaries (``layer_peak``)
            _, made, temps = core
            at = forward(f"forward: layer {n}/{layer_sets} peak", before + saved[n - 1] + made, n)
            points.append(Point(at.label, {**at.terms, "transient": sum(temps)}, temps))
        points.append(forward(f"forward: {n}/{layer_sets} {unit}", before + saved[n], n))
    loss_fwd = forward_loss_blocks(r.setup, dims)
    if loss_fwd:  # the loss's saves are made at that moment: before it, every save but theirs
        loss_saves = sum(k.total_bytes for k in r.pieces.kept if k.block is Block.LOSS)
        pre = forward("forward: loss", dev.activations - loss_saves, layer_sets)
        pieces = (*loss_fwd, 4)
        points.append(Point(pre.label, {**pre.terms, "transient": sum(pieces)}, pieces))
        # the loss's saves as the tensors they are: the log-probs take a block the transients left
        saves = tuple(k.bytes for k in r.pieces.kept if k.block is Block.LOSS for _ in range(k.count))
        end = forward("forward: end", dev.activations, layer_sets)
        points.append(Point(end.label, end.terms, saves=saves if sum(saves) == loss_saves else ()))
    else:
        points.append(forward("forward: end", dev.activations, layer_sets))
    loss_bwd, rerun = loss_backward_blocks(r.setup, dims), rerun_tensors(r)  # once, not per moment
    points += [_moment(name, dict(parts), loss_bwd, rerun) for name, parts in dev.peak.moments.items()]
    assert all(set(p.terms) == set(TERMS) for p in points)  # NB: one vocabulary of terms throughout
    return points
