"""One pipeline rank of torchtitan's Llama 3 under torch's ``ScheduleInterleaved1F1B`` (``--impl torchtitan
--pp P --vpp M``: torchtitan's ``pipeline_parallel_schedule = "Interleaved1F1B"``) or ``Schedule1F1B`` (M =
1), each stage tensor-parallel over tp (DTensor, ``--sp`` too) and FSDP2-sharded over dp under --zero 2/3, in
one process.

``measure_titan_pipeline(setup, index)`` joins torch's fake process group as pipeline rank ``index`` of p
(with dp or tp > 1: the rank at data- and tensor-parallel coordinate 0 of torchtitan's ["pp", "dp_replicate",
"fsdp", "tp"] mesh, ``pipeline_dims``), builds torchtitan's ``Llama3Model`` on the meta device once per local
chunk and cuts each with torchtitan's ``_split_module`` over the module names of its virtual stage: local
chunk k is virtual stage k·p + index ("loop" style, ``_get_pp_rank_to_stage_indices_mapping``), the p·M
stages' names as ``_generate_llm_fqn_per_model_part`` gives them (the setup's ``pp_layers``, torchtitan's
placement unless given), each parallelised as ``pipeline_llm``'s ``parallelize_fn`` does a model part: TP,
activation checkpointing, then FSDP2 (``apply_fsdp_to_decoder`` with ``pp_enabled``;
``reshard_after_forward_policy`` "default" under ZeRO-3, torchtitan's trainer default, which with pp reshards
no unit after forward — ``get_fsdp_reshard_after_forward_policy``: ``not pp_enabled`` —, "never" under
ZeRO-2). The chunks become ``PipelineStage``s with static shapes (``titan_pp._stage``'s), materialised under
``FakeTensorMode``, and torch's ``ScheduleInterleaved1F1B`` runs the step's ``grad_accum`` micro-batches
(torchtitan's loss as ``loss_fn``, ``scale_grads=False``, ``global_valid_tokens``). Recorded: the saves alive
at once at their maximum per layer (``pipeline.InFlightRecorder``), the schedule's holds under the estimate's
names — sent outputs (``pp.output``), sent input gradients (``pp.grad_send``; the runtime keeps every send's
``Work`` to the step's end, ``strategies.torch_interleaved``), the last virtual stage's logits, every chunk's
receive buffers — and the rank's parameter bytes. Under ``SelectiveAC`` each block call's cache of saved
op outputs is held from its forward until freed (``titan_sac``); under ``--fp8 rowwise`` each part's
linears are torchao's ``Float8Linear`` (``titan.meta_model``: torchtitan's converter, the lm head bf16);
under ``--compile`` each block runs through AOTAutograd's partitioner (``titan_compiled``).

Known limitations:
- NB: as ``titan_pp``: static ``input_args`` / ``output_args``, the warm-up's vote decided ``STATIC``;
  a send's ``Work`` keeps its tensor as gloo's does (``titan_pp.sends_hold_tensors``).
- NB: a tensor-parallel stage (torchtitan's plan applied to each model part, ``Module.parallelize``)
  passes DTensors: torch's fully static DTensor mode with the placements torchtitan's plan gives a stage
  boundary (``dtensor_stage``); the gradients' placements are taken as the activations'.
- NB: with ``--cp`` the rank is context-parallel rank ``cp_rank`` (``--cp-rank``, 0 by default: the
  estimate's) of torch's ring over the mesh's cp group (``titan_pp_cp``), with or without tp: the ring is
  installed before torchtitan's ``Module.parallelize``, so a tensor-parallel stage's attention hands it the
  local heads (``titan.parallelize_part``).
- FSDP2's state is measured (``Fsdp2Held``): the most unsharded parameter bytes alive at once (sampled
  as each chunk's forward, backward and gradient reduction begins: torch's runtime unshards and reshards
  whole chunks between computations, ``strategies.torch_interleaved.fsdp_unshards``), the unsharded
  gradients each chunk has accumulated when its ``perform_reduce_grad`` begins, and the sharded gradients
  after the step. With ``peak`` the rank's live storages are tracked over the step (``titan_peak.
  PeakTracker``, FSDP2's resizes seen) and its highest point split into the parameters and buffers,
  FSDP2's unsharded parameters and gradients, and the rest (``pipeline_peak_parts``).
- NB: that rest (saves, the schedule's holds, transients) is the pipeline estimate's, not exact per rank;
  no optimizer runs (its states are not in the measured peak).
"""

from __future__ import annotations

from contextlib import ExitStack, nullcontext
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.pipelining import ScheduleInterleaved1F1B
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

from memplan.config import Checkpointing, Setup
from memplan.measure.distributed.instruments import local
from memplan.measure.distributed.pipeline import InFlightRecorder
from memplan.measure.distributed.titan import compiles, fake_world, meta_model, parallelize_part, split_part
from memplan.measure.distributed.titan_compiled import block_input, compiled_blocks
from memplan.measure.distributed.titan_peak import PeakTracker, fsdp2_resizes, propagation_unseen
from memplan.measure.distributed.titan_pp import (
    StageRun,
    StaticSchedule1F1B,
    TitanStage,
    _scoped,
    _stage,
    sends_hold_tensors,
)
from memplan.measure.distributed.titan_pp import step as step_single
from memplan.measure.distributed.titan_pp_cp import cp_batches, local_setup
from memplan.measure.distributed.titan_sac import hold_sac
from memplan.measure.frameworks.step import activation_dtype
from memplan.measure.frameworks.titan import require_torchtitan, rope_buffers
from memplan.measure.instruments.record import _RECORDER, storage_ref
from memplan.measure.reference.context import rotate_method


def virtual_module_names(setup: Setup) -> list[list[str]]:
    """Module names of each of the p·M virtual stages, model order (``module_fqns_per_model_part``): the
    setup's ``pp_layers`` (one count per virtual stage), the embedding on the first, the final norm and
    lm head on the last."""
    counts = setup.parallel.pp_layers
    assert counts is not None and len(counts) == setup.parallel.pp * setup.parallel.vpp
    names, start = [], 0
    for v, n in enumerate(counts):
        part = ["tok_embeddings"] if v == 0 else []
        part += [f"layers.{j}" for j in range(start, start + n)]
        names.append(part + (["norm", "lm_head"] if v == len(counts) - 1 else []))
        start += n
    return names


class InterleavedStage(TitanStage):
    """``TitanStage`` of a rank with several: at the rank's first forward every local stage's receive
    buffers are held (torch allocates them all at the step's start), and each input gradient the stage
    sends is held as ``pp.grad_send`` until its storage is freed (the send's ``Work`` keeps it)."""

    siblings: list[InterleavedStage]

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        recorder = _RECORDER.get()
        if isinstance(recorder, InFlightRecorder) and not recorder.holds_buffers:
            recorder.holds_buffers = True
            for st in self.siblings:
                for name, buf in st.named_buffers():
                    recorder.hold(buf, name)
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        recorder = _RECORDER.get()
        if isinstance(recorder, InFlightRecorder):
            for op in ops:
                recorder.hold(op.tensor, "pp.grad_send", until_freed=True)
        return ops


class StaticInterleaved1F1B(ScheduleInterleaved1F1B):
    """``ScheduleInterleaved1F1B`` whose p2p warm-up is the vote's outcome for static shapes
    (``StaticSchedule1F1B``)."""

    _warmup_p2p = StaticSchedule1F1B._warmup_p2p


def pipeline_dims(setup: Setup) -> Any:
    """torchtitan's ``ParallelDims`` of a pp × dp × cp × tp job (``titan.parallel_dims`` with the pipeline
    and context axes), on a CPU mesh; its world is ["pp", "dp_replicate", "dp_shard", "cp", "tp"],
    row-major (FSDP2 over "fsdp": dp_shard × cp)."""
    from torchtitan.distributed import ParallelDims, parallel_dims
    from torchtitan.distributed.utils import set_spmd_backend

    set_spmd_backend("partial_dtensor")
    parallel_dims.device_type = "cpu"
    p, tp, dp, shard = setup.parallel.pp, setup.parallel.tp, setup.strategy.dp, setup.strategy.shard_group
    cp = setup.parallel.cp
    dims = ParallelDims(
        dp_replicate=dp // shard,
        dp_shard=shard,
        cp=cp,
        tp=tp,
        pp=p,
        ep=1,
        world_size=p * dp * cp * tp,
        spmd_backend="partial_dtensor",
    )
    dims.build_mesh()
    return dims


def build_chunk(setup: Setup, names: list[str], dims: Any = None, whole: Any = None) -> Any:
    """One virtual stage's module on the meta device, cut by torchtitan's ``_split_module`` from
    ``whole`` (``titan.meta_model``, built here when not given; ``titan.split_part``: not changed), then
    parallelised as ``pipeline_llm`` does each model part (``titan.parallelize_part`` with ``pp_enabled``)."""
    require_torchtitan()
    model = meta_model(setup) if whole is None else whole
    return parallelize_part(split_part(model, names), setup, dims, pp_enabled=True)


def measure_titan_pipeline(
    setup: Setup, index: int, fake: bool = True, cp_rank: int = 0, peak: bool = False
) -> StageRun:
    """One step of pipeline rank ``index`` (module docstring): its M chunks under
    ``ScheduleInterleaved1F1B``, or its one stage under ``Schedule1F1B`` when M = 1; with dp, cp or tp > 1
    the rank at data-parallel and tensor-parallel coordinate 0 and context-parallel coordinate ``cp_rank``
    of the p × dp × cp × tp mesh (``titan_pp_cp``)."""
    tt = require_torchtitan()
    p, m, n, cp = setup.parallel.pp, setup.parallel.vpp, setup.training.grad_accum, setup.parallel.cp
    tp = setup.parallel.tp
    others = setup.strategy.dp * cp * tp
    shapes = local_setup(setup)  # the stages' static shapes: s/c tokens under cp
    names = virtual_module_names(setup)
    # DTensor's sharding-propagation caches key a spec by its mesh's layout, not its process groups: one
    # cached in an earlier fake world would name a group destroyed with it
    _clear_sharding_prop_cache()
    with fake_world(index * others + cp_rank * tp, p * others):
        dims = pipeline_dims(setup) if others > 1 else None
        group = dims.get_mesh("pp").get_group() if dims is not None else None
        whole = meta_model(setup)  # each chunk cut from it (``pipeline_llm`` cuts every part from one model)
        chunks = [build_chunk(setup, names[k * p + index], dims, whole) for k in range(m)]
        kind = InterleavedStage if m > 1 else TitanStage
        with FakeTensorMode(allow_non_fake_inputs=True) if fake else nullcontext(), ExitStack() as hooks:
            stages: list[Any] = []  # ``kind``, each
            for k, chunk in enumerate(chunks):
                chunk.to_empty(device="cpu")  # under cp its blocks run the ring (``parallelize_part``)
                if tp > 1:
                    stages.append(dtensor_stage(chunk, shapes, k * p + index, p * m, kind, dims))
                else:
                    stages.append(_stage(chunk, shapes, k * p + index, p * m, kind, group))
            for st in stages:
                st.siblings = stages
            loss = tt.loss.CrossEntropyLoss(tt.loss.CrossEntropyLoss.Config())
            loss_fn = partial(_scalar, loss)
            schedule: Any = (
                StaticInterleaved1F1B(stages, n, loss_fn=loss_fn, scale_grads=False)
                if m > 1
                else StaticSchedule1F1B(stages[0], n, loss_fn=loss_fn, scale_grads=False)
            )
            layers, blocks = [], {}
            for chunk in chunks:
                for key, block in chunk.layers.items():
                    layers.append(int(key))
                    blocks[int(key)] = block
                    hooks.enter_context(_scoped(block, int(key)))
            if setup.strategy.checkpointing is Checkpointing.SELECTIVE:
                hooks.enter_context(hold_sac(blocks))
            if compiles(setup):  # the stages' blocks through the partitioner (``titan.compiles``)
                mesh = dims.get_mesh("tp") if tp > 1 and dims is not None else None
                hooks.enter_context(compiled_blocks(blocks, block_input(setup, mesh)))
            if cp > 1:
                hooks.enter_context(rotate_method(setup.parallel.cp_rotate.value))
            batches, kwargs = cp_batches(setup, n, cp_rank)
            # trainer.py: global_valid_tokens, the valid labels of the whole step (here: every token)
            tokens = torch.tensor(n * setup.training.micro_batch * setup.training.seq_len)
            recorder = InFlightRecorder(torch.nn.ModuleList(chunks))
            fsdp2 = Fsdp2Held(stages)
            tracker = PeakTracker()
            states = [t for c in chunks for t in (*c.parameters(), *c.buffers())]
            tracking = (propagation_unseen(tracker), fsdp2_resizes(tracker), tracker) if peak else ()
            with recorder, sends_hold_tensors(), ExitStack() as measuring:
                for ctx in tracking:
                    measuring.enter_context(ctx)
                tracker.track(states)
                for kw in kwargs:  # the positions: a model input, whichever block keeps them first
                    if kw:
                        recorder.label(kw["positions"], "rope.positions")
                run = step if m > 1 else step_single
                run(schedule, batches, {"global_valid_tokens": tokens}, kwargs)
            peak_parts = pipeline_peak_parts(tracker, states, fsdp2) if peak else {}
            params = sum(local(q).untyped_storage().nbytes() for c in chunks for q in c.parameters())
            grads = [q.grad for c in chunks for q in c.parameters() if q.grad is not None]
            # under cp the layers' RoPE caches are module buffers autograd never saves (each forward gathers
            # its rows): the chunks' read from the modules, as the non-pipeline run does
            records = recorder.records + [rope_buffers(c) for c in chunks if cp > 1 and len(c.layers)]
            return StageRun(
                records,
                params,
                tuple(sorted(layers)),
                unsharded_weights=fsdp2.most_weights,
                unsharded_grads=fsdp2.grads_at_reduce,
                grad_bytes=_bytes(grads),  # views of each unit's reduce-scatter output
                peak=tracker.peak if peak else 0,
                peak_parts=peak_parts,
            )


def pipeline_peak_parts(tracker: PeakTracker, states: list[torch.Tensor], held: Fsdp2Held) -> dict[str, int]:
    """The live storages at the rank's highest point by what they are: the parameters (FSDP2's shards)
    and buffers, FSDP2's unsharded parameters and accumulated unsharded gradients, the rest."""
    kinds = {
        "states": {storage_ref(local(t)).cdata for t in states},
        "unsharded weights": held.weight_keys,
        "unsharded gradients": held.grad_keys,
    }
    parts = dict.fromkeys([*kinds, "other"], 0)
    for key, (_, _, nbytes) in tracker.peak_live.items():
        kind = next((k for k, keys in kinds.items() if key in keys), "other")
        parts[kind] += nbytes
    return parts


class Fsdp2Held:
    """What FSDP2 holds on the rank beside its shards, sampled on its stages (``stages``): as each
    chunk's forward, backward and gradient reduction begins, the bytes of every chunk's unsharded
    parameters (``FSDPParam.all_gather_outputs``: storages resized to 0 when resharded, the parameters
    views of them); as a chunk's ``perform_reduce_grad`` begins, its unsharded gradients
    (``unsharded_accumulated_grad`` in the reduce dtype, else the unsharded parameter's ``.grad``)."""

    def __init__(self, stages: list[Any]) -> None:
        self.chunks = [st.submod for st in stages]
        self.most_weights = self.grads_at_reduce = 0
        self.weight_keys: set[int] = set()
        self.grad_keys: set[int] = set()
        for st in stages:
            for name in ("forward_one_chunk", "backward_one_chunk"):
                setattr(st, name, self._sampled(getattr(st, name)))
            st.perform_reduce_grad = self._reduced(st.perform_reduce_grad, st.submod)

    def _sampled(self, fn: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            self._sample()
            return fn(*args, **kwargs)

        return run

    def _reduced(self, fn: Any, chunk: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            self._sample()
            grads = _params_of(chunk, grads=True)
            self.grads_at_reduce += _bytes(grads)
            self.grad_keys |= {storage_ref(local(g)).cdata for g in grads}
            return fn(*args, **kwargs)

        return run

    def _sample(self) -> None:
        unsharded = [t for c in self.chunks for t in _params_of(c, grads=False)]
        self.weight_keys |= {storage_ref(local(t)).cdata for t in unsharded}
        self.most_weights = max(self.most_weights, _bytes(unsharded))


def _params_of(chunk: Any, grads: bool) -> list[torch.Tensor]:
    """The chunk's FSDP2 parameters' all-gather outputs, or (``grads``) their unsharded gradients."""
    from torch.distributed.fsdp import FSDPModule

    out: list[torch.Tensor] = []
    groups = {id(g): g for m in chunk.modules() if isinstance(m, FSDPModule) for g in _group(m)}
    for group in groups.values():  # one group for [norm, lm_head], two FSDPModules
        for fp in group.fsdp_params:
            if not grads:
                out += list(fp.all_gather_outputs)
                continue
            unsharded = getattr(fp, "_unsharded_param", None)
            grad = fp.unsharded_accumulated_grad
            grad = grad if grad is not None else (unsharded.grad if unsharded is not None else None)
            out += [] if grad is None else [local(grad)]
    return out


def _group(module: Any) -> list[Any]:
    """The FSDP2 module's parameter group (none for a root without parameters of its own)."""
    group = module._get_fsdp_state()._fsdp_param_group
    return [] if group is None else [group]


def _bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages of ``tensors`` (DTensors by their local one)."""
    storages = {storage_ref(local(t)).cdata: local(t).untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def dtensor_stage(chunk: Any, setup: Setup, index: int, num: int, kind: type[TitanStage], dims: Any) -> Any:
    """``titan_pp._stage`` for a tensor-parallel chunk: torch's fully static DTensor mode (inputs,
    outputs and both gradients as DTensors on the tp mesh). Between stages the hidden states are
    ``Shard(1)`` under sequence parallelism ([b, s/t, h] local), ``Replicate()`` otherwise (what
    torchtitan's plan hands a stage boundary: the embedding's and each block's output layout); the last
    stage's logits ``Shard(2)`` (the vocabulary-parallel lm head, [b, s, v/t] local)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    t, m, par = setup.training, setup.model, setup.parallel
    b, s, h, tp = t.micro_batch, t.seq_len, m.hidden_size, par.tp
    act, mesh = activation_dtype(setup), dims.get_mesh("tp")
    place = Shard(1) if par.sp else Replicate()

    def dt(shape: tuple[int, ...], placement: Any, grad: bool = False) -> Any:
        local = torch.empty(shape, dtype=act, device="meta", requires_grad=grad)
        return DTensor.from_local(local, mesh, [placement], run_check=False)

    hidden = (b, s // tp, h) if par.sp else (b, s, h)
    first, last = index == 0, index == num - 1
    return kind(
        chunk,
        index,
        num,
        torch.device("cpu"),
        input_args=torch.empty(b, s, dtype=torch.long, device="meta") if first else dt(hidden, place, True),
        output_args=dt((b, s, -(-m.vocab_size // tp)), Shard(2), True) if last else dt(hidden, place, True),
        input_grads=(None,) if first else dt(hidden, place),  # ids have no gradient
        output_grads=(None,) if last else dt(hidden, place),  # the loss starts the last stage's backward
        group=dims.get_mesh("pp").get_group(),
        on_phase=lambda _phase: None,
    )


def _scalar(loss: Any, out: Any, labels: Any, **kw: Any) -> Any:
    """torchtitan's ``_scalar_loss_fn``: the schedule's loss is the loss function's first output."""
    return loss(out, labels, **kw)[0]


def step(
    schedule: ScheduleInterleaved1F1B,
    batches: list[tuple[Any, Any]],
    loss_kwargs: dict[str, Any],
    kwargs: list[dict[str, Any]] | None = None,
) -> None:
    """``ScheduleInterleaved1F1B.step`` without its split (``titan_pp.step``): ids to the model's first
    stage, labels to its last."""
    stages = schedule._stages
    for st in stages:
        st.has_backward = schedule._has_backward
        st.clear_runtime_states()
    first, last = any(st.is_first for st in stages), any(st.is_last for st in stages)
    args = [(ids,) if first else () for ids, _ in batches]
    targets = [labels for _, labels in batches] if last else None
    kw = kwargs if kwargs is not None else [{} for _ in batches]
    schedule._step_microbatches(args, kw, targets, None, return_outputs=False, loss_kwargs=loss_kwargs)
