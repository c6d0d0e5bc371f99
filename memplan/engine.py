"""The engine: one setup → the memory of its most loaded device and the FLOPs of one step.

``estimate(setup)`` is the one computation for every layout: one device of a dense model is
``Parallel()`` with ``moe`` None, the trivial case of the same path. One tensor-parallel rank is the
narrower model of ``strategies.tensor_parallel.tp_model``; its inventory (one micro-batch, every layer:
the blocks' saves from ``analytic.activations``, an MoE's MLPs swapped in by ``activations.with_moe``) goes
through ``STRATEGIES`` in order (checkpointing, reversible layers, sequence parallelism) and is then
regrouped per pipeline stage (``strategies.pipeline_parallel``):

- Placement and micro-batches in flight: ``strategies.pipeline_parallel`` (stage 0 holds p micro-batches
  of its L/p layers under 1F1B — the same activations as all L layers of one micro-batch — and the
  embedding's saves of its first p micro-batches; the last stage the head's of one).
- Model states: each stage's parameters (the MoE's routed experts apart) go through ``model_states`` with
  ZeRO over dp; the routed experts' over dp/ep, the data-parallel group of expert parallelism.
- Peak: the moments of ``analytic.peak`` per stage, built from the same transient functions; a stage
  without the head has no loss- or final-norm-backward moment. With gradient accumulation or a pipeline of
  several micro-batches the gradients are alive while activations are (``grad_accum > 1``, as in peak.py).

Only the representative stages are computed (``pipeline_parallel.representative_stages``): the first, the
last, and the first stage of each other layer count — a later stage with as many layers holds fewer
micro-batches in flight and no embedding, so it never exceeds that one.

Known limitations (NB): communication buffers (tp all-reduce / all-gather, ZeRO buckets) are not counted
(the pipeline's kept outputs and receive buffers are: ``StagePlan.boundary``); the peak's moments are not
re-derived for a stage's boundary (its holds are counted alive throughout; docs/distributed.md item 6);
the re-run working set of a reversible layer keeps its two rebuilt [T, h] inputs
whole under sequence parallelism.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from memplan.analytic import activations as act
from memplan.analytic import peak as pk
from memplan.analytic.flops import Flops
from memplan.analytic.params import ParamCount
from memplan.analytic.states import ModelStates
from memplan.blocks.attention.rope import rope_buffers
from memplan.blocks.inventory import Kept
from memplan.blocks.norm import released_as
from memplan.blocks.profiles import profile_of
from memplan.config import MoEConfig, Parallel, Setup
from memplan.pieces import (
    STRATEGIES as STRATEGIES,
)
from memplan.pieces import (
    Pieces,
    param_counts,
    pieces_by_key,
    pieces_key,
    whole_flops,
)
from memplan.pieces import (
    clear_caches as clear_caches,
)
from memplan.stage_plan import StagePlan, device_states, plan_rank
from memplan.strategies.lora_states import frozen_params, trainable_params
from memplan.strategies.pipeline_parallel import (
    Group,
    Stage,
    chunk_layers,
    group_of,
    representative_stages,
    rope_caches,
    stage,
    stage_layers,
    stage_params,
)
from memplan.strategies.tensor_parallel import check_layout

# ----------------------------------------------------------------------------------------------------
# Pipeline stages
# ----------------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------------
# The plan
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Result:
    """One training step under a parallel layout: every computed stage, the most loaded device (whose
    states, tensors and peak the estimate reports) and the whole model's parameters and FLOPs."""

    setup: Setup
    pieces: Pieces
    stages: tuple[StagePlan, ...]
    """The first stage, and the last when pp > 1."""
    flops: Flops
    """One micro-batch through the whole model."""
    params: ParamCount
    """Whole-model parameters: total, active (= total when dense), one layer's."""

    @property
    def parallel(self) -> Parallel:
        return self.setup.parallel

    @property
    def moe(self) -> MoEConfig | None:
        return self.setup.model.moe

    @property
    def params_total(self) -> int:
        return self.params.total

    @property
    def params_active(self) -> int:
        return self.params.active

    @property
    def params_trainable(self) -> int:
        return trainable_params(self.setup, self.params)

    @property
    def params_frozen(self) -> int:
        return frozen_params(self.setup, self.params)

    @functools.cached_property
    def device(self) -> StagePlan:
        """The most loaded device (the stage with the highest peak; the first on a tie)."""
        return max(self.stages, key=lambda sp: sp.peak.bytes)

    @functools.cached_property
    def rank_setup(self) -> Setup:
        """``setup`` with the model one tensor-parallel rank holds (``pieces.setup.model``:
        ``strategies.tensor_parallel.tp_model``); ``setup`` itself without tensor parallelism. Made once
        per result (the allocation stream's timeline asks it at every point)."""
        if self.setup.parallel.tp == 1:
            return self.setup
        return self.setup.replaced(model=self.pieces.setup.model)

    @property
    def devices(self) -> int:
        return self.parallel.model_parallel * self.setup.strategy.dp

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step per pipeline (= grad_accum)."""
        return self.setup.training.grad_accum

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step: micro-batch × micro-batches × dp."""
        t = self.setup.training
        return t.micro_batch * t.grad_accum * self.setup.strategy.dp

    @property
    def six_n(self) -> int:
        """6·N·tokens of one micro-batch with N the active parameters."""
        return 6 * self.params_active * self.setup.training.micro_batch * self.setup.training.seq_len

    @property
    def per_layer(self) -> int:
        """Bytes one transformer layer keeps on one device for one micro-batch."""
        return act.per_layer_bytes(list(self.pieces.kept), self.setup.model.num_layers)

    def stage_tensors(self, sp: StagePlan) -> list[Kept]:
        """The stage's inventory on one device, each entry's count = instances alive at its warm-up's end."""
        out = []
        rank = self.pieces.setup
        flags = (profile_of(rank).rope_cached_per_chunk, rope_buffers(rank), rope_caches(rank))
        for k in self.pieces.kept:
            group = group_of(k, released_as(rank), *flags)
            n = k.count if self.pieces.layer_bytes and group is Group.LAYER else sp.counts[group]
            if group is Group.LAYER_CONSTANTS and n:  # the stage's layers' share of the [L, …] constant
                out.append(k.model_copy(update={"shape": (n, *k.shape[1:])}))
            elif n:
                out.append(k.model_copy(update={"count": n}))
        return out + list(sp.boundary)

    # The most loaded device's memory: what `memplan estimate` reports.
    @functools.cached_property
    def tensors(self) -> list[Kept]:
        """The most loaded device's activation inventory."""
        return self.stage_tensors(self.device)

    @property
    def states(self) -> ModelStates:
        return self.device.states

    @property
    def peak(self) -> pk.Peak:
        return self.device.peak

    @property
    def activations(self) -> int:
        """Bytes of every activation the most loaded device keeps at once."""
        return self.device.activations


def estimate(setup: Setup) -> Result:
    """Memory per device and FLOPs of one step of ``setup``: its parallel layout (``setup.parallel``;
    one device is ``Parallel()``), ZeRO and dp (``setup.strategy``), micro-batches per step
    (``setup.training.grad_accum``), dense or a mixture of experts (``setup.model.moe``).

    Raises a one-line ``ValueError`` when the layout does not fit the model.
    """
    check_layout(setup)
    pc = pieces_by_key(pieces_key(setup), setup)
    stages = tuple(plan_rank(pc, setup, i, chunks) for i, chunks in _representative(setup))
    return Result(
        setup=setup,
        pieces=pc,
        stages=stages,
        flops=whole_flops(pc.core),
        params=param_counts(setup.model),
    )


def unplanned(setup: Setup) -> Result:
    """``estimate(setup)`` without its stage plans (``stages`` empty: no device, states, tensors or peak):
    the setup, the pieces, the FLOPs and the parameter counts, for what reads only those
    (``search.bound.stages_bound``, which the search asks of thousands of configurations it then prunes).
    Raises as ``estimate`` does."""
    check_layout(setup)
    pc = pieces_by_key(pieces_key(setup), setup)
    return Result(
        setup=setup, pieces=pc, stages=(), flops=whole_flops(pc.core), params=param_counts(setup.model)
    )


@dataclass(frozen=True)
class Floors:
    """What ``states_floor`` reads besides the ZeRO stage (``floors``): the pieces and each planned stage
    with its parameters — none of them reads the ZeRO stage (``pieces._PER_STEP``, ``stage_params``), so
    the stages of one configuration share them."""

    pieces: Pieces
    stages: tuple[tuple[Stage, ParamCount], ...]


def floors(setup: Setup) -> Floors:
    """``Floors`` of ``setup`` (and of every setup that differs from it in the ZeRO stage alone). Raises
    as ``estimate`` does (``check_layout`` reads no ZeRO stage either)."""
    check_layout(setup)
    pc = pieces_by_key(pieces_key(setup), setup)
    parallel, n, tied = setup.parallel, setup.training.grad_accum, setup.model.tied_embeddings
    planned = [stage(parallel, i, chunks, n) for i, chunks in _representative(setup)]
    return Floors(pc, tuple((st, stage_params(pc.params, st, tied, parallel.pp)) for st in planned))


def states_floor(setup: Setup, shared: Floors | None = None) -> int:
    """The largest model states (weights, gradients, optimizer: ``ModelStates.total``) on a device of
    ``estimate(setup)``'s stages, without the stage plans: a floor of each plan's
    ``StagePlan.lower_bound`` (weights + optimizer + max(gradients before the step + activations,
    gradients)), hence of its peak. It reads the stages' layers and parameters, the ZeRO stage and shards,
    the precision and the offload — not the micro-batch (``search.families``: one per configuration at
    every micro-batch size; tests/plan/test_fit_shortcuts.py). ``shared``: ``floors`` of a setup that
    differs from ``setup`` in the ZeRO stage alone (the same floor, sooner). Raises as ``estimate`` does."""
    f = shared or floors(setup)
    return max(device_states(f.pieces, st, setup, params).total for st, params in f.stages)


def _representative(setup: Setup) -> list[tuple[int, tuple[int, ...]]]:
    """The stages ``estimate`` plans (``representative_stages``), each with its chunks' layers."""
    layers, parallel = setup.model.num_layers, setup.parallel
    chunks = chunk_layers(layers, parallel)
    return [(i, chunks[i]) for i in representative_stages(stage_layers(layers, parallel))]


def at_stage(result: Result, index: int) -> Result:
    """``result`` reporting pipeline stage ``index`` as its device (computed when it is not one of the
    representative stages): what that stage's ranks hold."""
    setup = result.setup
    chunks = chunk_layers(setup.model.num_layers, setup.parallel)
    plan = plan_rank(result.pieces, setup, index, chunks[index])
    return dataclasses.replace(result, stages=(plan,))
