"""Pipeline parallelism in ``memplan profile --nproc``: one stage of the reference model per pipeline rank,
run by ``torch.distributed.pipelining`` (``PipelineStage`` + ``Schedule1F1B``).

Placement as the estimate's (``strategies.pipeline_parallel.stage_layers``, ``--pp-layers`` included): stage
i holds its layers; stage 0 the embedding (and learned positions), the last stage the final norm and the lm
head (with tied embeddings its own copy of the word embedding: Megatron's ``word_embeddings_for_head``).
Every stage makes its RoPE tables and causal mask itself. The last stage's forward ends with the lm head
and the loss (its labels passed to it alone: inside the forward, where FSDP2 has gathered the head), the
schedule's ``loss_fn`` passing that loss on. 1F1B over n = grad_accum micro-batches: stage i runs
min(n, p − i) forwards before its first backward (``Schedule1F1B._step_microbatches``'s warm-up: the
estimate's in-flight count). Tensor parallelism runs inside each stage; ZeRO-2/3 shards each stage
(``parallelize.shard_dp``), and torch's stage then syncs gradients after the last micro-batch only.

Measured per rank, beside ``distributed.py``'s model states and peak:
- ``InFlightRecorder``: the saves autograd holds *at once*. A save is alive from its pack until autograd
  drops the packed tensor (after that micro-batch's backward): a ``weakref.finalize`` on the packed tensor
  ends it. The records are the live saves at the maximum of their bytes over the whole schedule.
- ``CountedStage``: the point-to-point traffic, counted at the stage's own send and receive ops (what
  ``get_fwd_send_ops`` etc. hand to ``batch_isend_irecv``; ``CommDebugMode`` sees no p2p op): per
  direction and phase, calls and bytes.

Known limitations (NB): the micro-batches are given to the schedule one by one (``run_step`` calls
``_step_microbatches``, the private step after ``step()``'s split) so that each has its own storage, as a
data loader yields them (``step()`` splits one batch tensor into views of one storage, which the recorder
would count once). What the schedule holds beside autograd's saves — each sent stage output until its
backward (``fwd_cache``; under ``Schedule1F1B`` the warm-up's ``send_work`` one more), one receive buffer
per micro-batch and direction — is recorded by ``InFlightRecorder.hold`` under the estimate's names
(``pp.output``, ``pp.recv``, ``pp.grad_recv``: ``pipeline_parallel.boundary_tensors``).
``CommDebugMode``'s per-module attribution is off (a forward
follows a backward). No interleaved schedule (vpp > 1: ``parallelize.check_pipeline``); under sequence
parallelism the stages pass the rank's [b, s/t, h] shard. The tied embedding's two copies are not
all-reduced.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from memplan.config import Setup
from memplan.measure.distributed.instruments import Collective, RankRecorder, local
from memplan.measure.instruments.record import _RECORDER, SavedRecord, current_layer, storage_ref
from memplan.measure.instruments.tracker import data_tensors
from memplan.measure.reference.model import Reference, torch_dtype
from memplan.strategies.pipeline_parallel import stage_layers


def stage_range(setup: Setup, index: int) -> range:
    """The layers of pipeline stage ``index`` (the estimate's placement)."""
    counts = stage_layers(setup.model.num_layers, setup.parallel)
    start = sum(counts[:index])
    return range(start, start + counts[index])


class StageModule(nn.Module):
    """Pipeline stage ``index`` of ``num``: the reference model cut to its layers (and embedding, head)."""

    def __init__(self, ref: Reference, index: int, num: int) -> None:
        super().__init__()
        self.first, self.last = index == 0, index == num - 1
        keep = stage_range(ref.setup, index)
        ref.layers = nn.ModuleList(ref.layers[i] for i in keep)
        if not self.first:
            ref.pos = None
            if not (self.last and ref.head is None):  # tied: the last stage's own copy for the head
                ref.register_parameter("embed", None)
        if not self.last:
            ref.register_module("final_norm", None)
            ref.head = None
        self.ref = ref

    def forward(self, x: Tensor, labels: Tensor | None = None) -> Tensor:
        """Stage 0: ids → hidden states; then the layers; the last stage: the final norm, the lm head and
        the loss over ``labels`` (inside the stage's forward, where FSDP2 has its parameters gathered)."""
        ref = self.ref
        h = ref.embedding(x) if self.first else x
        # the tables of the whole sequence (under SP h is the rank's s/t shard, the attention's s whole)
        h = ref.run_layers(h, ref.consts(ref.setup.training.seq_len, h.device))
        if not self.last:
            return h
        assert labels is not None
        return ref.loss(ref.final(h), labels)


def stage_loss(loss: Tensor, _labels: Tensor) -> Tensor:
    """The schedule's ``loss_fn``: the last stage's output is its loss already."""
    return loss


class CountedStage(PipelineStage):
    """``PipelineStage`` counting its point-to-point ops (calls, bytes per direction and phase) and telling
    ``on_phase`` whether a forward or a backward runs."""

    def __init__(self, *args: Any, on_phase: Callable[[str], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.on_phase = on_phase
        self.p2p: dict[tuple[str, str], list[int]] = {}

    def _count(self, kind: str, phase: str, ops: list[dist.P2POp]) -> list[dist.P2POp]:
        entry = self.p2p.setdefault((kind, phase), [0, 0])
        for op in ops:
            entry[0] += 1
            entry[1] += op.tensor.numel() * op.tensor.element_size()
        return ops

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._count("send", "forward", super().get_fwd_send_ops(fwd_chunk_id))

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        return self._count("recv", "forward", super().get_fwd_recv_ops(fwd_chunk_id))

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._count("send", "backward", super().get_bwd_send_ops(bwd_chunk_id))

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        return self._count("recv", "backward", super().get_bwd_recv_ops(bwd_chunk_id))

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        self.on_phase("forward")
        recorder = _RECORDER.get()
        if isinstance(recorder, InFlightRecorder) and not recorder.holds_buffers:
            recorder.holds_buffers = True  # every buffer exists from the step's start (torch allocates them)
            for name, buf in self.named_buffers():
                recorder.hold(buf, name)
        out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        if isinstance(recorder, InFlightRecorder) and not self.is_last:
            for t in self.fwd_cache[fwd_chunk_id][0]:  # kept until backward_one_chunk pops it
                recorder.hold(t, "pp.output", until_freed=True)
        return out

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> None:
        self.on_phase("backward")
        super().backward_one_chunk(*args, **kwargs)

    def collectives(self) -> list[Collective]:
        """The counted p2p ops as ``Collective`` rows over the pp dimension (empty kinds left out)."""
        return [Collective("pp", k, p, n, b) for (k, p), (n, b) in sorted(self.p2p.items()) if n]

    def buffers(self) -> list[Tensor]:
        """The receive buffers the stage holds (one per micro-batch and direction)."""
        return [t for _, t in self.named_buffers()]

    def named_buffers(self) -> list[tuple[str, Tensor]]:
        """The receive buffers with the estimate's names: ``pp.recv`` (activations), ``pp.grad_recv``."""
        kinds = (("pp.recv", self.args_recv_info), ("pp.grad_recv", self.grad_recv_info))
        out: list[tuple[str, Tensor]] = []
        for name, infos in kinds:
            for recv in infos.values():
                bufs = [getattr(i, "buffer", None) for i in recv]
                out += [(name, b) for b in bufs if isinstance(b, Tensor)]
        return out


def make_stage(
    module: StageModule, setup: Setup, group: dist.ProcessGroup, device: str, on_phase: Callable[[str], None]
) -> CountedStage:
    """The rank's ``PipelineStage`` with static shapes (no metadata inference run: it would run the stage
    once more, on empty tensors): stage 0 takes [b, s] ids, every stage passes [b, s, h] hidden states
    ([b, s/t, h] under sequence parallelism)."""
    t, m, par = setup.training, setup.model, setup.parallel
    seq = t.seq_len // par.tp if par.sp else t.seq_len  # a rank's sequence shard under SP
    hidden = torch.empty(t.micro_batch, seq, m.hidden_size, dtype=torch_dtype(t.precision), device="meta")
    ids = torch.empty(t.micro_batch, t.seq_len, dtype=torch.long, device="meta")
    inputs = ids if module.first else hidden.requires_grad_()
    loss = torch.empty((), dtype=torch.float32, device="meta", requires_grad=True)  # the fp32 loss
    index, num = dist.get_rank(group), dist.get_world_size(group)
    return CountedStage(
        module,
        index,
        num,
        torch.device(device),
        input_args=inputs,
        output_args=loss if module.last else hidden.detach().requires_grad_(),
        group=group,
        on_phase=on_phase,
    )


def make_schedule(stage: CountedStage, setup: Setup) -> Schedule1F1B:
    """1F1B over the step's grad_accum micro-batches, the loss (mean per micro-batch, gradients divided
    by n: ``scale_grads``) on the last stage."""
    return Schedule1F1B(stage, setup.training.grad_accum, loss_fn=stage_loss)


def stage_batches(batches: list[tuple[Tensor, Tensor]], module: StageModule) -> list[tuple[Any, Any]]:
    """(ids, labels) per micro-batch as the stage reads them: ids on the first stage, labels on the last
    (None elsewhere: what the stage never reads is not held, nor counted in its peak)."""
    return [(ids if module.first else None, labels if module.last else None) for ids, labels in batches]


def run_step(schedule: Schedule1F1B, batches: list[tuple[Any, Any]]) -> None:
    """One step over ``batches`` (``stage_batches``): ``Schedule1F1B.step`` without its split (module
    docstring)."""
    stage = schedule._stage
    stage.has_backward = schedule._has_backward
    stage.clear_runtime_states()
    args = [(ids,) if stage.is_first else () for ids, _ in batches]
    kwargs = [{"labels": labels} if stage.is_last else {} for _, labels in batches]
    targets = [labels for _, labels in batches] if stage.is_last else None
    schedule._step_microbatches(args, kwargs, targets, None, return_outputs=False)


class InFlightRecorder(RankRecorder):
    """``RankRecorder`` whose records are the saves alive at once at their maximum (module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self._packs: dict[int, int] = {}  # storage → packed tensors (and schedule holds) still alive
        self.live = 0
        self.max = 0
        # at the maximum: the storages alive, their entries, and each held one's hold name and whether only
        # the schedule held it then (``_at_max``)
        self._max_state: tuple[list[int], list[Any], dict[int, tuple[str, bool]]] = ([], [], {})
        self._held: dict[int, str] = {}  # storage → the name of what the schedule holds it as
        self._saves: dict[int, int] = {}  # storage → packed tensors of autograd's saves still alive
        self.holds_buffers = False

    def _acquire(self, key: int, nbytes: int) -> None:
        self._packs[key] = self._packs.get(key, 0) + 1
        if self._packs[key] == 1:
            self.live += nbytes
            if self.live > self.max:
                self.max = self.live
                # taken at every new maximum (each save of a forward is one): at C speed for the storages
                # alive, the held ones (a few) apart
                keys = list(self._packs)
                held = {k: (name, self._only_held(k)) for k, name in self._held.items() if k in self._packs}
                self._max_state = (keys, list(map(self._storages.__getitem__, keys)), held)

    @property
    def _at_max(self) -> list[tuple[Any, bool, str | None]]:
        """At the maximum: each storage's entry, whether only the schedule held it then, and its hold's
        name."""
        keys, entries, held = self._max_state
        none: tuple[str | None, bool] = (None, False)
        return [(e, held.get(k, none)[1], held.get(k, none)[0]) for k, e in zip(keys, entries, strict=True)]

    def _info(self, t: torch.Tensor) -> Any:
        """``RankRecorder._info``, a freed storage's entry forgotten when its address comes back: under fake
        tensors a new storage may reuse a freed one's key (a later hold or save would otherwise take the
        old entry's layer, size and hold name)."""
        key = storage_ref(local(t)).cdata
        old = self._storages.get(key)
        if old is not None and old.ref.expired() and key not in self._packs:
            del self._storages[key]
            self._held.pop(key, None)
            self._saved.pop(key, None)
        return super()._info(t)

    def _only_held(self, key: int) -> bool:
        """Held by the schedule and by nothing a save names or packs now (a receive buffer no forward in
        flight has read, a sent output): reported under the hold's name, at the model level."""
        return key in self._held and self._storages[key].name is None and not self._saves.get(key)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        """A save, alive until autograd drops what it packed. A DTensor whose local tensor is a wrapper
        (``--fp8-tp``'s ``DTensor(Float8TrainingTensor)``) is counted by the tensors that hold its bytes
        (``data_tensors``: the float8 data and the fp32 scale), each alive as long as the wrapper's pack:
        the wrapper's own storage holds none (``titan.RankPathRecorder._pack``, the unpipelined run's)."""
        if isinstance(t, DTensor) and is_traceable_wrapper_subclass(t._local_tensor):
            packed = t.detach()
            for part in data_tensors(t):
                self._save(part)
                self._held_by(part, packed)
            return packed
        packed = super()._pack(t)
        self._held_by(t, packed)
        return packed

    def _held_by(self, t: torch.Tensor, packed: torch.Tensor) -> None:
        """``t``'s storage counted live until ``packed`` (what autograd keeps) is dropped."""
        info = self._info(t) if self.recording else None
        if info is None:
            return
        key = info.ref.cdata
        if key in self._held and info.layer is None:  # a receive buffer a layer saves: that layer's input
            info.layer = current_layer()
        self._saves[key] = self._saves.get(key, 0) + 1
        self._acquire(key, info.nbytes)
        weakref.finalize(packed, self._unpacked, key).atexit = False

    def _unpacked(self, key: int) -> None:
        self._saves[key] -= 1
        self._dropped(key)

    def hold(self, t: torch.Tensor, name: str, until_freed: bool = False) -> None:
        """A storage the pipeline schedule holds beyond autograd's saves, named ``name`` unless a save
        names it: alive until its storage is freed (``until_freed``: a stage output) or to the end (a
        receive buffer)."""
        info = self._info(t) if self.recording else None
        if info is None:
            return
        key = info.ref.cdata
        self._held.setdefault(key, name)
        self._acquire(key, info.nbytes)
        if until_freed:
            weakref.finalize(local(t).untyped_storage(), self._dropped, key).atexit = False  # a DTensor's

    def _dropped(self, key: int) -> None:
        self._packs[key] -= 1
        if not self._packs[key]:
            del self._packs[key]
            self.live -= self._storages[key].nbytes

    @property
    def records(self) -> list[SavedRecord]:
        out = []
        for i, held, hold in self._at_max:  # held: only by the schedule then (``_only_held``)
            name = hold if held and hold else i.name or "unlabelled"
            out.append(SavedRecord(name, None if held else i.layer, i.shape, i.dtype, i.nbytes))
        return out
