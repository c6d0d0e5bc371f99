"""Peak memory of one training step on one device: states + activations + the largest transient.

The step is modelled as five moments; the peak is the largest (T = b·s tokens, A activation bytes):

1. ``loss backward`` — the forward is done, every saved activation is alive, and the loss backward makes
   two fp32 [T, v] buffers at once: nll_loss's gradient and log_softmax's input gradient (8·T·v bytes)
   beside the saved fp32 log-probs. (The forward's own loss transient, the fp32 logits, 4·T·v, is smaller.)
   The chunked loss makes them for its largest chunk only; the fused one none (it scales the gradients it
   kept in place), and the labels the training loop holds are counted when the loss keeps no view of them.
   ``loss forward`` (chunked loss only): its forward's logits of every chunk beside the saves, above
   its backward (``blocks.head.chunked_loss_forward_transient``). NB: the fused loss's forward (its chunk
   of logits, [c, v] with c·v ≈ T·h by Liger's chunking, beside the saves and its own [T, h] and [v, h]
   gradients) is not a moment: Liger's versions hold one reused buffer (CUDA, same dtypes) or two, and
   the reference model an fp32 copy; it passes the backward's moments only where those are small (a
   vocabulary far wider than h at a tiny h, where it was measured 0.01–0.7 % above the estimate).
1b. ``lm head backward`` (where modelled): the head's weight gradient made beside the accumulated ones
   (``lm_head_backward_transient``), or the chunked loss's pieces of it summed, three [v, h] at once
   (``chunked_head_backward_transient``).
2. ``final norm backward`` — the head's loss and lm-head saves are freed, its gradients made, and the
   final norm's backward peaks (RMSNorm: five fp32 [T, h] gradient pieces at once).
3. ``layer backward`` — a layer's backward, at the top layer (most activations alive), the bottom one
   (most gradients made) or the first checkpointed segment's top, whichever is larger: the head's saves
   are freed (not the labels the training loop holds, nor the loss scalar and its seed gradient), the
   gradients of the head and the layers above exist, the layer's working set is alive (re-run for
   checkpointed or reversible layers) and the largest of its parts adds its temporaries: the down
   projection's backward or the MLP's [T, f] gradients, its norm's fp32 gradient pieces, the attention's
   [b, a, s, s] softmax gradients (eager; W_O's input freed by then; on CUDA the softmax backward's own
   grad · output) or dq/dk/dv (flash; on CUDA FlashAttention-2's dq accumulator), a re-run
   attention forward's locals (checkpointed segment, reversible layer, selective eager core), the
   attention norm's.
4. ``embedding backward`` — the last gradient: every gradient exists, and the embedding's [v, h] gradient
   is summed into the one the tied lm head (or an earlier micro-batch) left: the new one and the sum;
   untied, the incoming [T, h] gradient is alive beside the new [v, h].
5. ``optimizer step`` — all gradients and states, plus the step's temporaries (``analytic.step``) for the
   largest tensor it steps (under ZeRO ≥ 1 one rank's FSDP2-style dim-0 shard of it,
   ``largest_step_tensor``): its fp32 gradient copy (mixed recipes) and Adam's denominator √v + ε
   (memplan's reference optimizer updates one tensor at a time); torch's for-loop, foreach and fused AdamW
   and bitsandbytes keep their own (``analytic.optimizer_step``, ``--optimizer-impl``); none on the
   device when the step runs on the host (``--offload optimizer``).

Gradients: with gradient accumulation (``grad_accum > 1``) they are alive in every micro-batch after the
first, so moments 1 to 3 include them; otherwise they are made during the backward. Where a later
micro-batch's are summed into them in place (``blocks.profiles.accumulates_in_place``: ZeRO 0–1, eager
autograd), a layer's own new gradients are freed as their node ends (the layer's transients count none
but the one being made), the lm head's new [v, h] comes beside the sums at its own backward (folded into
moment 1b), and a tied one waits in autograd's input buffer for the embedding's (one more [v, h] in
moments 2–4). On a torchtitan
pipeline stage under FSDP2 they are the stage's unsharded gradients in the reduce dtype, reduce-scattered
only after its last backward (``pipeline_unsharded_gradients``), the embedding's backward included.
ZeRO-3 adds the largest gathered (unsharded) weight unit to moments 1 to 3; the reference's FSDP2 wrapping
(a unit per layer and the root) follows torch 2.13 instead (``analytic.fsdp.root``: the root gathered
again at the loss and held, with its unsharded gradients, to the backward's end; each layer's copy-out,
prefetch and held reduce-scatter input; the flat all-gather outputs named in ``Peak.all_gather_stream``,
exact per moment on the fake process group); torchtitan's ZeRO-3 follows its
trainer's default ``reshard_after_forward_policy="default"`` instead (``zero3_resharded``: the [norm, lm_head]
unit held from its forward to its backward, reduced after the final norm's backward; the embedding's
unit gathered again and reduced at its own: ``fsdp.moments.zero3_head_reduce``, ``zero3_embedding_parts``;
tied, one unit of both held from the embedding's forward to its backward, reduced last: ``tied_unit``;
``zero3_kept_gathered``: under pp every unit of the stage), its 2024 wrapping (``--fsdp-wrap root``) the
reference's root. torchtitan's per-layer RoPE caches that no checkpointed layer saves are module state at
every moment (``head_moments.module_rope_buffers``).

Accuracy, measured on CPU against every live storage (``memplan profile``; benchmarks/bench_peak_accuracy.py,
docs/peak-accuracy.md; tests/measure/test_peak.py): the loss-backward, final-norm-backward, embedding-
backward and optimizer-step moments are exact to the byte. The layer-backward moment models the live set
of each part of a layer's backward (which saves are released, which gradients exist, a re-run forward's
locals, a reversible layer's extra buffers) without replaying the autograd engine op by op. It is exact
in 28 of the 37 grid setups where it is the peak; the rest (reversible layers; an eager core with
attention dropout re-run by selective checkpointing) are within −1.9 % … +1.8 %. Over 160 random small
shapes and strategies (seed 2026) the whole peak is exact in 122 and within −2.8 % … +2.9 %; of the 38
not exact, 20 have reversible layers, 7 attention dropout, 8 grouped-query attention (73 more are
exact), 3 are checkpointed eager layers with f ≤ h. The same 60 first of them with two micro-batches: 43
exact (12 before the accumulation rules above), the 11 reversible within −0.9 … +1.4 %, attention dropout
+0.1 … +2.5 %, the eager forward's softmax +1.2 %; and 16-bit (not mixed) checkpointed layers +0.6 … +1.0 %
(+15,872 and +51,200 B at the attention norm's backward; what holds them is not found).
Fine-tuning: the layers' own saves (layer 0 keeps less: ``layer_bytes``), the loop's ids beside a
frozen embedding (``unsaved_ids_bytes``), no gradient of a frozen head, final norm or tied embedding; the
frozen MLP's moment is ``blocks.mlp.mlp_backward_transient``'s (exact on the LoRA setups of
tests/measure/test_peak.py; before, −3.1 … +9.3 %, mostly below).
NB: the forward is not a modelled moment; at an eager attention's softmax in the top layer it can exceed
every backward moment (+0.6 % in one of the random setups).
NB: allocator fragmentation, CUDA context (~0.3–1 GiB) and communication buckets are not counted.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from memplan.analytic import activations as act
from memplan.analytic import every_k, trainable_grads
from memplan.analytic import head_moments as hm
from memplan.analytic.fsdp import root as fsdp2_root
from memplan.analytic.fsdp.moments import (
    layer_gather,
    pipeline_unsharded_gradients,
    tied_copy_out,
    tied_unit,
    units_beside_layer,
    units_reduced,
    zero2_shards_beside,
    zero3_embedding_parts,
    zero3_head_gather,
    zero3_head_reduce,
    zero3_head_unit,
    zero3_kept_gathered,
    zero3_resharded,
    zero3_unit_buffers,
)
from memplan.analytic.fsdp.reduce import reduce_scatter_input
from memplan.analytic.moments.layer_backward import layer_terms
from memplan.analytic.moments.layer_kinds import kind_terms
from memplan.analytic.moments.layer_saves import saved_layers_up_to
from memplan.analytic.optimizer_step import step_transient as optimizer_step_transient
from memplan.analytic.params import ParamCount
from memplan.analytic.states import ModelStates
from memplan.analytic.step import zero3_gather
from memplan.blocks.attention.constants import bound_in_partials, released_below
from memplan.blocks.embedding import loop_ids_bytes, unsaved_ids_bytes
from memplan.blocks.fp8 import gathered_scales as fp8_scales_held
from memplan.blocks.head import (
    chunked_head_backward_transient,
    chunked_loss_forward_transient,
    head_backward_modelled,
    lm_head_backward_transient,
    loop_labels_bytes,
    loss_backward_transient,
)
from memplan.blocks.inventory import Block, Dims, Kept, Role, Scope
from memplan.blocks.norm import norm_rules, released_as
from memplan.blocks.profiles import accumulates_in_place
from memplan.config import Offload, Setup
from memplan.config.trainable import embedding_trains, head_trains

TERMS = ("weights", "optimizer", "gradients", "activations", "transient")
"""What is alive at a moment, in the order it is allocated: the 16-bit weights (a ZeRO-3 gathered unit
included), the optimizer's master copy and states, gradients, the saved activations (and the ids and
labels the training loop holds), and the moment's own temporaries (a re-run layer's saves among them)."""


def terms(weights: int, optimizer: int, gradients: int, activations: int, transient: int) -> dict[str, int]:
    return dict(zip(TERMS, (weights, optimizer, gradients, activations, transient), strict=True))


class Peak(BaseModel):
    model_config = ConfigDict(frozen=True)
    moments: dict[str, dict[str, int]]
    """Each modelled moment, in step order, as the bytes of each of ``TERMS`` alive then."""
    all_gather_stream: dict[str, dict[str, int]] = {}
    """Of each moment's terms, the bytes that are FSDP2's flat all-gather outputs, blocks of the
    all-gather stream's own pool (``analytic.fsdp.root``), which the default stream's replay leaves out
    (``reserved``); empty where not modelled."""

    @property
    def phases(self) -> dict[str, int]:
        """Bytes alive at each modelled moment."""
        return {name: sum(parts.values()) for name, parts in self.moments.items()}

    @property
    def bytes(self) -> int:
        return max(sum(parts.values()) for parts in self.moments.values())

    @property
    def phase(self) -> str:
        return max(self.phases, key=lambda k: self.phases[k])

    @property
    def default_stream_bytes(self) -> int:
        """The highest moment less its ``all_gather_stream`` bytes: what the default stream's allocator
        is asked for (``reserved``; the verdict keeps the all-gather stream's pool back apart)."""
        off = self.all_gather_stream
        return max(sum(p.values()) - sum(off.get(n, {}).values()) for n, p in self.moments.items())


def root_embedding_moment(
    setup: Setup, weights: int, optimizer: int, states: ModelStates, held: int, embedding: int
) -> dict[str, int]:
    """The embedding's backward under the reference's FSDP2 root (``analytic.fsdp.root``): the root unit
    still unsharded, its unsharded gradients (the head's, the final norm's, the embedding's new [v, h],
    untied: its sharded ones not made yet) and layer 0's reduce-scatter input beside the embedding's
    backward; or, at the backward's end, the root's reduce-scatter (resharded, layer 0's input released):
    its unsharded gradients copied into its flat input."""
    unsharded_grads = fsdp2_root.root_grads(setup, embedding=True)
    # the root's sharded gradients exist already when an earlier micro-batch reduced them
    accumulated = setup.training.grad_accum > 1
    layers_grads = states.gradients - (0 if accumulated else fsdp2_root.root_sharded_grads(setup))
    backward = terms(
        weights + fsdp2_root.root_unit(setup),
        optimizer,
        layers_grads + unsharded_grads,
        held,
        embedding + fsdp2_root.layer_reduce_input(setup) + 8,
    )
    # After the embedding's backward its save is freed (the vocabulary-parallel one's clamped ids copy).
    # ``foreach_reduce`` copies the unsharded gradients into the flat input, clears them, then makes the
    # output: at the copy-in its sharded gradients are not made yet.
    held -= loop_ids_bytes(setup, Dims.of(setup))
    reduce = terms(
        weights, optimizer, layers_grads + unsharded_grads, held, fsdp2_root.root_reduce_input(setup) + 8
    )
    # then its output (the sharded gradients) beside the input and the last parameter's unsharded
    # gradient, the lm head's, held by ``foreach_reduce``'s loop variable (``root.last_grad``)
    last = fsdp2_root.last_grad(setup)
    output = terms(weights, optimizer, states.gradients, held, fsdp2_root.root_reduce_input(setup) + last + 8)
    return max(backward, reduce, output, key=lambda t: sum(t.values()))


def peak(
    setup: Setup,
    states: ModelStates,
    kept: list[Kept],
    params: ParamCount,
    gradient_bytes_head: int,
    unsharded: int | None = None,
    partial_grads: int = 0,
    layer_bytes: tuple[int, ...] = (),
    rerun_layers: tuple[int, ...] = (),
    whole_model: bool = True,
) -> Peak:
    """The moments (module docstring). ``unsharded``: on a torchtitan pipeline rank, the most of its
    parameters torch keeps unsharded at once (``strategies.torch_interleaved.most_unsharded``; all of
    them by default); ``partial_grads``: the elements by which its gradients exceed its parameters
    (``stage_plan.partial_grads``); ``layer_bytes``: what each layer keeps, bottom to top, where layers
    differ (fine-tuning's gradient flow, two layer kinds, transformers' every-K: ``Pieces.layer_bytes``,
    ``Pieces.alone_layers``) and ``kept`` counts each as the largest; ``rerun_layers``:
    ``Pieces.rerun_layers``; ``whole_model``: false on a pipeline chunk (``trainable_grads.shares``)."""
    dims = Dims.of(setup)
    # ``kept``'s layer scope counts every layer as the largest; the layers below keep less
    deficit = max(layer_bytes) * len(layer_bytes) - sum(layer_bytes) if layer_bytes else 0
    activations = act.total_bytes(kept) - deficit
    head = sum(k.total_bytes for k in kept if k.block.in_head)
    inputs = 2 * 8 * dims.tokens  # the int64 ids and labels the training loop still holds
    weights, optimizer = states.weights, states.optimizer
    # --fp8-all-gather: the unsharded float8 weights' fp32 scales, held from their first all-gather
    weights += fp8_scales_held(setup)
    # torchtitan's FSDP2 on a pipeline stage: the unsharded gradients accumulated in the reduce dtype
    # until the stage's last backward, in place of the shards (``pipeline_unsharded_gradients``)
    unsharded_grads = pipeline_unsharded_gradients(setup, params, partial_grads)
    step_grads = unsharded_grads or states.gradients  # all of them made, before the optimizer step
    grads_before = step_grads if setup.training.grad_accum > 1 else 0
    # Tied, the lm head's gradient waits in autograd's input buffer for the embedding's (one leaf, one
    # ``AccumulateGrad`` run once both uses are back): beside the summed ones in a later micro-batch.
    tied = setup.model.tied_embeddings
    pending = params.embedding * setup.training.precision.grad_bytes if tied and head_trains(setup) else 0
    pending = pending if accumulates_in_place(setup) else 0
    gather = zero3_gather(params, setup)  # ZeRO-3's gathered unit: weights
    if zero3_kept_gathered(setup):  # torchtitan's ZeRO-3 under pp: the stage's units kept gathered
        gather = (params.total if unsharded is None else unsharded) * setup.training.precision.weight_bytes
    # torchtitan's ZeRO-2: the shards beside the unsharded weights (a pipeline stage's own)
    gather += zero2_shards_beside(setup, params)
    # + 4: the fp32 loss scalar (nll_loss's backward has consumed the seed gradient by then).
    # Held beyond the saves: the loop's labels and ids, RoPE caches, transformers' hooked leaf (each's doc).
    activations += loop_labels_bytes(setup, dims) + loop_ids_bytes(setup, dims)
    activations += unsaved_ids_bytes(setup, dims) + hm.module_rope_buffers(setup, dims)
    activations += hm.hooked_embedding_held(setup, dims)
    offloaded = Offload.ACTIVATIONS in setup.offload
    if offloaded:  # on the device: the head's saves brought back for the loss backward, the loop's inputs
        activations = head + inputs
    # torchtitan's ZeRO-3 (its trainer's ``reshard_after_forward_policy="default"``) reshards the
    # embedding and every block after its forward but not [norm, lm_head] (torchtitan/distributed/fsdp.py
    # ``apply_fsdp_to_decoder``): at the loss's backward that unit alone is gathered.
    gathered = zero3_head_unit(setup) if zero3_resharded(setup) else gather
    root = fsdp2_root.root_gathered(setup)  # the reference's FSDP2 root (``analytic.fsdp.root``)
    if root:  # the root gathered again at the loss, the top layer's all-gather prefetched
        gathered = head_gather = fsdp2_root.root_unit(setup) + fsdp2_root.layer_flat(setup)
    loss_bwd = terms(
        weights + gathered, optimizer, grads_before, activations, loss_backward_transient(setup, dims) + 4
    )
    # The chunked loss's forward (``chunked_loss_forward_transient``): a moment of its own, before the rest.
    upcasts = any(
        r.role is Role.NORM_INPUT and r.dtype is not dims.act
        for r in norm_rules(setup, Block.FINAL_NORM, dims)
    )
    chunked_forward = chunked_loss_forward_transient(setup, dims, upcasts)
    head_moments: dict[str, dict[str, int]] = {}
    if chunked_forward:
        head_moments["loss forward"] = terms(
            weights + gathered, optimizer, grads_before, activations, chunked_forward
        )
    head_moments["loss backward"] = loss_bwd
    # The final norm's backward: the loss's and lm head's saves are freed, the head's gradients made.
    released = released_as(setup)
    freed_for_norm = sum(k.total_bytes for k in kept if hm.freed_before_final_norm(k, released))
    scalars = hm.loss_scalars(setup)  # the loss scalar, and its seed gradient where no save stands in
    if not root:
        head_gather = zero3_head_gather(setup) if zero3_resharded(setup) else gather
    # under the reference's FSDP2 root the head's unsharded gradients come beside the accumulated shards
    head_g = gradient_bytes_head
    grads_at = grads_before + head_g if root else max(grads_before + pending, head_g)
    norm_grad_made = root or head_g >= grads_before + pending  # the final norm's weight's among them
    at_norm = hm.final_norm_backward(setup, dims, params, norm_grad_made) + scalars
    final_norm_bwd = terms(weights + head_gather, optimizer, grads_at, activations - freed_for_norm, at_norm)
    # the [T, h] gradient flowing on to the top layer: the rank's sequence shard under sp
    head_reduce = zero3_head_reduce(setup, params, hm.residual_shard(setup, dims))
    if head_reduce is not None:  # torchtitan's ZeRO-3: [norm, lm_head] reduced after the norm's backward
        top_gather, made, transient_at = head_reduce
        # the final norm's saves its own backward releases (those not released before it)
        norm_saves = sum(r.bytes for r in norm_rules(setup, Block.FINAL_NORM, dims)) // hm.sp_shards(setup)
        after_norm = activations - freed_for_norm - (norm_saves - hm.final_norm_released(setup, dims))
        made += grads_before
        reduce = terms(weights + top_gather, optimizer, made, after_norm, transient_at + scalars)
        final_norm_bwd = max(final_norm_bwd, reduce, key=lambda t: sum(t.values()))
    # The lm head's own backward where modelled: its new weight gradient beside the summed ones
    # (``lm_head_backward_transient``), or the chunks' pieces summed (``chunked_head_backward_transient``).
    if accumulates_in_place(setup) and head_backward_modelled(setup):
        at_head = lm_head_backward_transient(setup, dims)
    else:  # (0, 0) but for the chunked loss
        at_head = chunked_head_backward_transient(setup, dims)
    if at_head[1]:
        freed, made = at_head
        head_at = terms(weights + head_gather, optimizer, grads_before, activations - freed, made)
        head_moments["lm head backward"] = head_at
    if hm.titan_sp_head_scatter(setup):
        # Before the norm's backward: its saves still held, its weight's gradient not made yet.
        norm_saves = hm.final_norm_released(setup, dims)
        norm_grad = params.final_norm * setup.training.precision.grad_bytes
        scatter = terms(
            weights + head_gather,
            optimizer,
            max(grads_before, gradient_bytes_head - norm_grad),
            activations - freed_for_norm + norm_saves,
            hm.head_input_scatter_transient(setup, dims) + scalars,
        )
        final_norm_bwd = max(final_norm_bwd, scatter, key=lambda t: sum(t.values()))
    # the layer's backward transient and re-run working set (none with segments: ``rerun`` below)
    transient, working = layer_terms(setup, params, kept)
    kinds, low, kind_ends = kind_terms(setup, params, kept) if whole_model else ((), None, set())
    layer_saved = sum(k.total_bytes for k in kept if k.scope is Scope.LAYER) - deficit
    trained, whole = trainable_grads.shares(setup, params, whole_model)  # what trains above each layer
    gather_outputs: dict[int, int] = {}  # layer i's moment: its flat all-gather output (root only)

    def layer_moment(i: int) -> dict[str, int]:
        """Layer i's backward: the layers above are done (their saves freed, their gradients made)."""
        terms_i = (low if i == 0 else None) or (kinds[i] if kinds else None) or (transient, working)
        transient_i, working_i = trainable_grads.own_terms(setup, i, params, kept, terms_i)
        if grads_before:
            grads = grads_before + (gradient_bytes_head if root else pending)  # the root's, unsharded
            if setup.strategy.reversible:  # the stack's Function returns every layer's gradients at its
                # end (measure/reference/reversible.py): those of the layers above are new beside the sums
                grads += params.layers_above(i, dims.layers) * step_grads // params.total
        else:
            # Gradients of the head and of the layers above, as many bytes per parameter as the device
            # keeps (ZeRO-2/3 reduce-scatter them into shards as the backward goes; the current layer's
            # full-size gradients are in its transient).
            full = whole * setup.training.precision.grad_bytes
            head_grads = gradient_bytes_head * step_grads // full if full else 0
            if root or tied_unit(setup):  # the root's (tied: the one unit's) unsharded head gradients,
                head_grads = gradient_bytes_head  # held until its reduce-scatter at the end
            grads = head_grads + trained(i) * step_grads // whole
        # A re-run segment's layers above i are done too: their saves freed.
        rerun = every_k.rerun_bytes(setup, i, rerun_layers)
        # The head's saves are freed by then but for the labels, which the training loop holds (the ids
        # are the embedding's save); + 8: the fp32 loss scalar and the backward's seed gradient.
        below = sum(layer_bytes[: i + 1]) if layer_bytes else saved_layers_up_to(setup, kept, i)
        saved = activations - head - layer_saved + below + inputs // 2
        saved -= loop_labels_bytes(setup, dims) + released_below(setup, dims, i)  # masks, tables
        # the layers above have freed their saves, views of their RoPE caches: the buffers stay (under
        # checkpointing every layer's is module state, in ``activations`` already)
        above = dims.layers - 1 - i if hm.rope_saved(setup) else 0
        saved += above * hm.layer_rope_buffer(setup, dims) + hm.loop_count_bytes(setup)
        if offloaded:  # one layer's saves brought back from the host (module docstring of offload)
            saved = max((k.bytes for k in kept if k.scope is Scope.LAYER), default=0) + inputs
        # FSDP2's buffers: torchtitan's (prefetched gather, reduce-scatter input), the reference's input
        fsdp2 = zero3_unit_buffers(setup, i, dims.layers) + reduce_scatter_input(setup, i, dims.layers)
        if root:  # the root unit beside an unsharded layer; the layer's copy-out or its prefetch
            incoming = hm.residual_shard(setup, dims)  # its output gradient
            buffers = fsdp2_root.layer_buffers(
                setup, i, dims.layers, working_i + rerun + transient_i, incoming
            )
            gather_outputs[i] = buffers[1]
            unsharded = fsdp2_root.root_unit(setup) + fsdp2_root.layer_flat(setup)
            return terms(weights + unsharded, optimizer, grads, saved, buffers[0] + 8)
        # torchtitan's ZeRO-3: the layer's own unit gathered (the largest unit, the embedding, is not then)
        own = layer_gather(setup, setup.state_shards) if zero3_resharded(setup) else gather
        own += units_beside_layer(setup, dims.layers - 1 - i)  # tied: the one unit; ZeRO-2: those above
        compute = max(working_i + rerun + transient_i, tied_copy_out(setup, i))  # tied: layer 0's copy-out
        return terms(weights + own, optimizer, grads, saved, compute + 8 + fsdp2)

    first = trainable_grads.first_backward_layer(setup) if whole_model else 0  # none below it; the moment's:
    ends = every_k.moment_layers(setup, dims.layers, kind_ends) | {first}
    ends = {i for i in ends if first <= i < dims.layers} or {dims.layers - 1}  # (NB: none runs: the top)
    if root or units_reduced(setup):  # FSDP2's buffers differ at the ends (no prefetch below layer 0,
        # another or no reduce-scatter input above the top layer): the middle ones linear in i
        ends |= {min(1, dims.layers - 1), max(dims.layers - 2, 0)}
    by_layer = {i: layer_moment(i) for i in sorted(ends, reverse=True)}
    top = max(by_layer, key=lambda i: sum(by_layer[i].values()))
    layer_bwd = by_layer[top]
    # The embedding's gradient [v, h] arrives last; tied to the lm head (or accumulating over
    # micro-batches) it is summed into the gradient already there: the new [v, h] and (tied) the sum.
    # Untied, the peak is the embedding's own backward: the incoming [T, h] gradient is alive beside the
    # new [v, h] (tied, it is freed before the sum).
    # Summed into an earlier micro-batch's in place (``accumulates_in_place``), tied: the lm head's pending
    # one too, beside the accumulated gradient.
    copies = (3 if pending else 2) if tied else (1 if setup.training.grad_accum > 1 else 0)
    embedding = params.embedding * setup.training.precision.grad_bytes * copies
    embedding += 0 if tied else dims.tokens * dims.h * dims.act.bytes
    if not embedding_trains(setup):  # frozen: no backward of its own (the hooked leaf and its gradient)
        embedding = hm.frozen_embedding_leaf(setup, dims)
    # + 8: the fp32 loss scalar and the backward's seed gradient (held until the backward ends).
    # Held to the step's end: the loop's ids, labels and count, every layer's RoPE buffer; under the
    # vocabulary-parallel embedding its clamped ids copy too, saved for its backward.
    held = inputs + loop_ids_bytes(setup, dims) + dims.layers * hm.layer_rope_buffer(setup, dims)
    held += hm.loop_count_bytes(setup) + bound_in_partials(setup, dims)  # reentrant: the layers' kwargs
    if not root:  # layer 0's, under the reference's root (``root_embedding_moment`` counts its own)
        embedding += reduce_scatter_input(setup, -1, dims.layers)
    # a pipeline stage's FSDP2 units stay gathered until the reduce after its last backward
    gathered_to_the_end = gather if unsharded_grads else 0
    incoming = dims.tokens * dims.h * dims.act.bytes  # the embedding's output gradient (gathered under sp)
    unmade, gathering = hm.sp_embedding_gather(setup, dims, params)  # torchtitan's SP: dY gathered first
    titan_parts = zero3_embedding_parts(setup, params, incoming, gathering)  # ZeRO-3: its unit again
    if titan_parts:
        (unmade, copy_out, unit), (unreduced, reduce_at, left), *sp_gather = titan_parts
        # after the embedding's backward its save is freed: the vocabulary-parallel one's clamped ids copy
        freed = held - loop_ids_bytes(setup, dims)
        moments = [terms(weights + unit, optimizer, step_grads - unmade, held, copy_out + 8)]
        moments.append(terms(weights + left, optimizer, step_grads - unreduced, freed, reduce_at + 8))
        moments += [terms(weights + u, optimizer, step_grads - m, held, t + 8) for m, t, u in sp_gather]
    else:
        moments = [terms(weights + gathered_to_the_end, optimizer, step_grads, held, embedding + 8)]
        if gathering:  # its gathered copies where the [T, h] gradient was, its gradient not made yet
            rise = gathering + embedding - incoming + 8
            moments.append(terms(weights + gathered_to_the_end, optimizer, step_grads - unmade, held, rise))
    embedding_bwd = max(moments, key=lambda t: sum(t.values()))
    if root:
        embedding_bwd = root_embedding_moment(setup, weights, optimizer, states, held, embedding)
    # ZeRO-Offload steps on the host: nothing on the device.
    on_device = Offload.OPTIMIZER not in setup.offload
    step_transient = optimizer_step_transient(setup) if on_device else 0
    step = terms(
        weights,
        optimizer,
        states.gradients,
        inputs + dims.layers * hm.layer_rope_buffer(setup, dims),
        step_transient,
    )
    stream: dict[str, dict[str, int]] = {}
    if root:  # the top layer's prefetched output at the head's moments; the layer's own or the one below
        # (torchtitan's 2024 wrapping kept the top block gathered from its forward: the default stream's)
        prefetched = {} if fsdp2_root.kept_after_forward(setup) else {"weights": fsdp2_root.layer_flat(setup)}
        stream = {"loss backward": prefetched, "final norm backward": prefetched}
        stream["layer backward"] = {"transient": gather_outputs[top]}
    return Peak(
        moments={
            **head_moments,
            "final norm backward": final_norm_bwd,
            "layer backward": layer_bwd,
            "embedding backward": embedding_bwd,
            "optimizer step": step,
        },
        all_gather_stream=stream,
    )
