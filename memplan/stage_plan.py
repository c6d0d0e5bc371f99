"""One pipeline stage's plan: its model states (ZeRO over dp, the routed experts over dp/ep, bitsandbytes'
8-bit states, fine-tuning's trainable share), the tensors it holds at its boundary (``stage_boundary``),
its grouped saves and its peak's moments (``StagePlan``, ``analytic.peak``) — what ``engine.estimate``
computes for each representative stage (``engine``'s module docstring gives the whole)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from memplan.analytic import activations as act
from memplan.analytic import peak as pk
from memplan.analytic.fsdp.moments import zero3_kept_gathered
from memplan.analytic.optimizer_step import bnb_state_bytes, optimizer_impl, step_tensors
from memplan.analytic.params import ParamCount
from memplan.analytic.states import ModelStates, shard
from memplan.blocks import megatron, te_fp8, torchtitan
from memplan.blocks.inventory import Block, Dims, Kept, Role, Scope
from memplan.blocks.norm import cuda_fused_rms_norm
from memplan.blocks.profiles import checkpoints_alone, profile_of
from memplan.config import Checkpointing, DType, Impl, NormType, OptimizerImpl, Setup, ZeroStage
from memplan.config.trainable import final_norm_trains, head_trains
from memplan.pieces import (
    STRATEGIES as STRATEGIES,
)
from memplan.pieces import (
    Pieces,
)
from memplan.pieces import (
    clear_caches as clear_caches,
)
from memplan.strategies import (
    lora,
    offload,
    torch_interleaved,
)
from memplan.strategies.lora_states import finetune_states, with_dequant
from memplan.strategies.offload import HostMemory
from memplan.strategies.pipeline_parallel import (
    Group,
    Stage,
    boundary_tensors,
    group_counts,
    replicated_ends,
    stage,
    stage_params,
)
from memplan.strategies.zero import model_states


def _add(a: ModelStates, b: ModelStates) -> ModelStates:
    return ModelStates(
        weights=a.weights + b.weights,
        gradients=a.gradients + b.gradients,
        master_weights=a.master_weights + b.master_weights,
        optimizer_states=a.optimizer_states + b.optimizer_states,
    )


def bnb_states(states: ModelStates, setup: Setup) -> ModelStates:
    """bitsandbytes' AdamW8bit states counted per tensor (block-wise absmax, fp32 states below 4096
    elements: ``optimizer_step.bnb_state_bytes``) for one stage holding the whole model.
    NB: with pipeline stages or context parallelism the flat 2 bytes per parameter stay."""
    if (  # the layout first: cheaper than the implementation, and most of a search's layouts answer
        setup.parallel.pp > 1
        or setup.parallel.cp > 1
        or optimizer_impl(setup) is not OptimizerImpl.BITSANDBYTES
    ):
        return states
    return states.model_copy(update={"optimizer_states": bnb_state_bytes(step_tensors(setup))})


def partial_grads(setup: Setup, st: Stage) -> int:
    """Elements by which the gradients of stage ``st``'s rank exceed its parameters under the user's
    ``setup`` (``blocks.torchtitan.partial_grad_elements``: torchtitan's TP without SP), its chunks that send
    on counted (``pipeline_parallel.replicated_ends``)."""
    compiled = profile_of(setup).compiled_block and setup.strategy.checkpointing is Checkpointing.NONE
    ends = replicated_ends(st, setup.parallel.pp)
    return torchtitan.partial_grad_elements(setup, st.layers, ends, compiled)


def stage_states(pc: Pieces, params: ParamCount, st: Stage, setup: Setup, ep: int) -> ModelStates:
    """Model states of the stage: ZeRO over dp × cp (``Setup.state_shards``), the routed experts
    over dp × cp / ep (tp × dp / ep under parallel folding)."""
    t, s = setup.training, setup.strategy
    if lora.applies(setup):  # one stage, dense: check_finetune
        return bnb_states(finetune_states(setup, params), setup)  # 8-bit states of the trainable tensors
    shards = setup.state_shards
    experts = pc.expert_params * st.layers
    per_shard = None
    if profile_of(setup).fsdp2_dim0_shards and not experts:  # FSDP2: per parameter, on each stage
        m = pc.setup.model
        if setup.parallel.pp == 1:
            per_shard = torchtitan.fsdp2_shard_elements(m, shards)
        else:
            layers = m.model_copy(update={"num_layers": st.layers})
            per_shard = torchtitan.fsdp2_shard_elements(layers, shards, (st.first, st.last))
    grads = megatron.main_grad_bytes(setup)  # Megatron's main_grad buffer (fp32 under bf16)
    dense = model_states(params.total - experts, t.precision, t.optimizer, s.zero, shards, per_shard, grads)
    if torchtitan.fsdp2_mixed(setup) and not experts:  # fp32 shards, no master copy
        # the reference's shards: one flat ⌈Ψ/N⌉ (``strategies.zero``), as its other states
        elements = per_shard if per_shard is not None else shard(params.total, shards, True)
        dense = torchtitan.fsdp2_mixed_states(dense, elements, s.zero)
    if s.zero < ZeroStage.GRADIENTS:  # torchtitan's TP without SP: W_O's and W2's gradients left Partial
        extra = partial_grads(setup, st) * t.precision.grad_bytes
        dense = dense.model_copy(update={"gradients": dense.gradients + extra})
    if te_fp8.applies(setup):  # Transformer Engine's cached float8 weights and quantizers, per layer
        fsdp = te_fp8.fsdp_primary(setup)  # Megatron FSDP's float8 shards: no cache, 1 byte an element
        te = te_fp8.resident_bytes(pc.setup.model, setup.impl, not fsdp, setup.parallel.ep) * st.layers
        primary = te_fp8.primary_elements(setup, pc.setup.model) * st.layers  # no 16-bit copy of these
        te -= (
            shard(primary, shards, True) * (t.precision.weight_bytes - 1)
            if fsdp
            else primary * t.precision.weight_bytes
        )
        dense = dense.model_copy(update={"weights": dense.weights + te})
    if not experts:
        return bnb_states(dense, setup)
    # the experts' data-parallel group: dp·cp/ep, or tp·dp/ep under parallel folding (``Parallel.fold``)
    edp = shards * setup.parallel.fold // ep
    routed = model_states(experts, t.precision, t.optimizer, s.zero, edp, grad_bytes=grads)
    return _add(dense, routed)


@dataclass(frozen=True)
class StagePlan:
    """One device of one pipeline stage: parameters, model states, activations and (computed on first use,
    the costly part) the peak."""

    stage: Stage
    params: ParamCount
    states: ModelStates
    """On the device (``strategies.offload``: what the host holds is in ``host``)."""
    counts: dict[Group, int]
    activations: int
    """Saved between forward and backward on the device (0 when they are offloaded to the host)."""
    pieces: Pieces = field(repr=False)
    setup: Setup = field(repr=False)
    """The user's setup (ZeRO, dp, micro-batches per step)."""
    host: HostMemory = field(default_factory=HostMemory)
    """What the device's offloaded tensors take in host memory."""
    boundary: tuple[Kept, ...] = ()
    """What the pipeline schedule holds at the stage's boundary (``pipeline_parallel.boundary_tensors``),
    in ``activations``."""

    @functools.cached_property
    def peak(self) -> pk.Peak:
        """``analytic.peak`` on the rank's model cut to one chunk, with the user's ZeRO, dp and micro-batches;
        no loss moment off the last stage; plus what the pieces correct for MoE and sequence parallelism."""
        pc, st = self.pieces, self.stage
        chunk = pc.setup.model.model_copy(update={"num_layers": st.chunk_layers})
        # pp carried for torchtitan's FSDP2 policy under pp (``analytic.fsdp.moments.zero3_kept_gathered``)
        # and for the reference's FSDP2 root, which a pipeline stage does not have (``analytic.fsdp.root``)
        fsdp2 = self.setup.impl.impl in (Impl.TORCHTITAN, Impl.REFERENCE)
        layout = pc.setup.parallel.model_copy(update={"pp": self.setup.parallel.pp if fsdp2 else 1})
        at = pc.setup.model_copy(
            update={
                "model": chunk,
                "training": self.setup.training,
                "strategy": self.setup.strategy,
                "parallel": layout,
            }
        )
        head_grads = head_gradient_bytes(self.params, pc.setup) if st.last else 0
        kept = peak_inputs(pc, st, self.counts, act.total_bytes(list(self.boundary)))
        unsharded = None  # torchtitan's FSDP2 on a pipeline rank: the most chunks torch keeps gathered
        if zero3_kept_gathered(self.setup):
            sizes = torch_interleaved.chunk_params(self.params, st)
            par = self.setup.parallel
            unsharded = torch_interleaved.most_unsharded(par.pp, par.vpp, st.micro_batches, st.index, sizes)
        partial = partial_grads(self.setup, st)  # the user's setup: ``at``'s model is the rank's shard
        # what each layer keeps, where they differ, when this chunk is the whole model
        layers = pc.layer_bytes if len(pc.layer_bytes) == st.chunk_layers else pc.alone_layers
        whole = st.chunk_layers == pc.setup.model.num_layers
        # a chunk's layers re-run as the largest one (their place in the model not known here)
        rerun = pc.rerun_layers if whole else (max(pc.rerun_layers, default=0),) * st.chunk_layers
        base = pk.peak(
            at, self.states, kept, self.params, head_grads, unsharded, partial, layers, rerun, whole
        )
        moments = dict(base.moments)
        if not st.last:  # the final norm and the loss run on the last stage
            for name in ("loss forward", "loss backward", "lm head backward", "final norm backward"):
                moments.pop(name, None)
        layer = moments["layer backward"]
        moments["layer backward"] = {**layer, "transient": layer["transient"] + pc.layer_correction}
        moments = with_dequant(moments, self.setup)  # QLoRA: a 4-bit weight dequantised for its matmul
        return pk.Peak(moments=moments, all_gather_stream=base.all_gather_stream)

    @property
    def lower_bound(self) -> int:
        """A floor of the peak, without computing it: the resident states with every activation (and the
        gradients when micro-batches accumulate), or with all the gradients at the optimizer step."""
        st = self.states
        grads_before = st.gradients if self.setup.training.grad_accum > 1 else 0
        return st.weights + st.optimizer + max(grads_before + self.activations, st.gradients)


def _lump(name: str, nbytes: int, scope: Scope, count: int, block: Block, role: Role) -> Kept:
    return Kept(
        name=name,
        shape=(nbytes,),
        dtype=DType.INT8,
        scope=scope,
        count=count,
        reason="",
        block=block,
        role=role,
    )


def peak_inputs(pc: Pieces, st: Stage, counts: dict[Group, int], boundary: int = 0) -> list[Kept]:
    """The stage's saves as ``analytic.peak`` reads an inventory: the layer scope of the one model chunk
    whose backward runs (one entry per layer or checkpointed segment), the head's saves (tagged as head
    blocks), and everything else alive the whole time — the embedding's, the stage's constants, the
    other chunks in flight and the pipeline's ``boundary`` bytes — as model-scope lumps. Same totals as
    the stage's tensors, a few entries."""
    g, segment = pc.group_bytes, pc.setup.strategy.segment
    layer = g[Group.CHECKPOINT] if segment else g[Group.LAYER]
    per_chunk = counts[Group.CHECKPOINT] if segment else counts[Group.LAYER]
    one_chunk = -(-st.chunk_layers // segment) if segment else st.chunk_layers  # the largest chunk
    if pc.alone_layers:  # transformers' every-K (no pp): one entry per layer, each counted as the largest
        layer, per_chunk = max(pc.alone_layers), counts[Group.CHECKPOINT] + counts[Group.LAYER]
        one_chunk = per_chunk
    others = layer * (per_chunk - one_chunk) + g[Group.STAGE] * counts[Group.STAGE]
    others += g[Group.LAYER_CONSTANTS] * counts[Group.LAYER_CONSTANTS]  # alive throughout
    # a layer's saved module buffer (torchtitan's RoPE cache) with the chunk's layers, once per layer; the
    # other chunks' alive throughout
    buffers = counts[Group.LAYER_BUFFER]
    layer += g[Group.LAYER_BUFFER] if buffers else 0
    others += g[Group.LAYER_BUFFER] * (buffers - one_chunk) if buffers else 0
    return [
        _lump("layers", layer, Scope.LAYER, one_chunk, Block.CHECKPOINT, Role.RESIDUAL),
        _lump(
            "in_flight",
            others + g[Group.EMBED] * counts[Group.EMBED] + g[Group.CHUNK] * counts[Group.CHUNK] + boundary,
            Scope.MODEL,
            1,
            Block.EMBED,
            Role.TOKEN_IDS,
        ),
        _lump("loss.head", g[Group.HEAD], Scope.MODEL, counts[Group.HEAD], Block.LOSS, Role.LABELS),
        # tagged as a head tensor the final norm's backward has freed, so analytic.peak treats it so
        _lump(
            "loss.log_probs",
            g[Group.HEAD_FREED],
            Scope.MODEL,
            counts[Group.HEAD_FREED],
            Block.LOSS,
            Role.LOG_PROBS,
        ),
    ]


def _params_states(pc: Pieces, st: Stage, setup: Setup) -> tuple[ParamCount, ModelStates]:
    """Stage ``st``'s parameters and model states (before offload)."""
    params = stage_params(pc.params, st, setup.model.tied_embeddings, setup.parallel.pp)
    return params, stage_states(pc, params, st, setup, setup.parallel.ep)


def device_states(pc: Pieces, st: Stage, setup: Setup, params: ParamCount | None = None) -> ModelStates:
    """The model states on one device of stage ``st``: ``StagePlan.states`` without the rest of the plan
    (``engine.states_floor``). ``params``: the stage's (``stage_params``), when the caller has them."""
    if params is None:
        states = _params_states(pc, st, setup)[1]
    else:
        states = stage_states(pc, params, st, setup, setup.parallel.ep)
    return offload.device_states(states, setup) if offload.applies(setup) else states


def stage_plan(pc: Pieces, st: Stage, setup: Setup) -> StagePlan:
    """``setup``: the user's (ZeRO, dp, micro-batches per step, layout); ``pc``: its pieces."""
    params, states = _params_states(pc, st, setup)
    counts = group_counts(st, pc.setup.strategy.segment, checkpoints_alone(pc.setup))
    boundary = tuple(stage_boundary(pc, st, setup.parallel.pp))
    acts = sum(pc.group_bytes[g] * n for g, n in counts.items()) - lora.deficit(pc.layer_bytes)
    acts += act.total_bytes(list(boundary))
    if not offload.applies(setup):
        return StagePlan(st, params, states, counts, acts, pc, setup, boundary=boundary)
    host = offload.host_states(states, params.total, setup)
    if offload.offloads_activations(setup):
        copies = offload.saved_weight_bytes(params, pc.setup.model, setup, st.last)
        host, acts = host.model_copy(update={"activations": acts + copies}), 0
    return StagePlan(
        st, params, offload.device_states(states, setup), counts, acts, pc, setup, host, boundary
    )


def stage_boundary(pc: Pieces, st: Stage, pp: int) -> list[Kept]:
    """The stage's ``pipeline_parallel.boundary_tensors`` on one rank: the [b, s, h] it sends (s/t under
    sequence parallelism), the profile's schedule (Megatron frees outputs), whether the first layer's norm
    saves its input storage itself (LayerNorm, fp32 activations, a fused norm: ``segment_rerun_bytes``)."""
    return boundary_tensors(st, pp, *boundary_args(pc))


def boundary_args(pc: Pieces) -> tuple[tuple[int, int], int, DType, bool, bool, int, int]:
    """What ``stage_boundary`` hands ``boundary_tensors`` beside the stage and the pipeline degree: the same
    for every stage of the rank (``plan_rank`` weighs many moments of one rank)."""
    rank = pc.setup
    dims = Dims.of(rank)
    par = rank.parallel
    s = dims.s // par.tp if par.sp else dims.s
    prof = profile_of(rank)
    shared = rank.model.norm is NormType.LAYERNORM or dims.act is DType.FP32 or prof.fused_norm
    shared = shared or cuda_fused_rms_norm(rank)  # torch's fused CUDA RMSNorm keeps its input itself
    # torchtitan's compiled block: its RMSNorm keeps x itself (blocks.norm.compiled_rms_rules), on a receiving
    # stage's first block the receive buffer (measured: tests/hf/test_torchtitan_pp_compile.py; NB: the
    # reference model's compiled pipeline stages are not traced, left as they were)
    titan = rank.impl.impl is Impl.TORCHTITAN
    shared = shared or (titan and prof.compiled_block)
    # torchtitan's FullAC and SelectiveAC: each block's checkpoint keeps its input, which on a receiving
    # chunk's first block is torch's receive buffer itself (PipelineStage passes it to the split model as it
    # is)
    shared = shared or (titan and rank.strategy.checkpointing is not Checkpointing.NONE)
    # the reference model's full and every-K checkpointing: its first segment's checkpoint keeps the stage's
    # input, the receive buffer (measured: profile --nproc --pp, tests/measure/test_distributed_pp.py)
    shared = shared or (rank.impl.impl is Impl.REFERENCE and rank.strategy.segment > 0)
    logits = dims.v if prof.stage_outputs_logits else 0
    return (dims.b, s), dims.h, dims.act, prof.frees_stage_outputs, shared, logits, dims.s


def plan_rank(pc: Pieces, setup: Setup, index: int, chunks_of: tuple[int, ...]) -> StagePlan:
    """Pipeline rank ``index`` whose chunks hold ``chunks_of`` layers: at the end of its warm-up (1F1B,
    Megatron's interleaving), or under torch's ``ScheduleInterleaved1F1B`` (``--impl torchtitan --vpp``) at
    the moment of its step when its activations and the schedule's holds are largest
    (``torch_interleaved.moments``; the first such moment on a tie)."""
    parallel, n = setup.parallel, setup.training.grad_accum
    if not (setup.impl.impl is Impl.TORCHTITAN and parallel.vpp > 1):
        return stage_plan(pc, stage(parallel, index, chunks_of, n), setup)
    segment, alone = pc.setup.strategy.segment, checkpoints_alone(pc.setup)

    boundary = boundary_args(pc)  # the same for every moment of the rank

    def held(st: Stage) -> int:
        counts = group_counts(st, segment, alone)
        return sum(pc.group_bytes[g] * c for g, c in counts.items()) + act.total_bytes(
            boundary_tensors(st, parallel.pp, *boundary)
        )

    return stage_plan(pc, max(torch_interleaved.moments(parallel, index, chunks_of, n), key=held), setup)


def head_gradient_bytes(params: ParamCount, setup: Setup) -> int:
    """Gradients made before the top layer's backward: lm head (or tied embedding) and final norm, those
    that train (``config.trainable``: fine-tuning freezes them)."""
    head = (params.lm_head or params.embedding) if head_trains(setup) else 0
    norm = params.final_norm if final_norm_trains(setup) else 0
    return (head + norm) * setup.training.precision.grad_bytes
