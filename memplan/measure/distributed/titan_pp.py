"""One pipeline stage of torchtitan's Llama 3 (``--impl torchtitan --pp P``) under 1F1B, in one process.

``measure_titan_stage(setup, index)`` joins torch's fake process group as pipeline rank ``index`` of p,
builds torchtitan's ``Llama3Model`` on the meta device (``frameworks.titan.titan_config``, with its
``FullAC`` / ``SelectiveAC``), cuts the rank's stage out of it with torchtitan's own split
(``distributed/pipeline_parallel.py`` ``_split_module``: a deep copy with the other layers dropped, the
embedding on the first stage only, the final norm and lm head on the last) over the module names
``_generate_llm_fqn_per_model_part`` gives (``pipeline_llm``'s default placement, the estimate's
``config.impl_rules.titan_stage_layers``), materialises it under ``FakeTensorMode`` and runs torch's
``Schedule1F1B`` (torchtitan 0.3.0's default ``pipeline_parallel_schedule``) over the step's
``grad_accum`` micro-batches with torchtitan's loss as the schedule's ``loss_fn`` on every rank
(``scale_grads=False``, ``global_valid_tokens`` in ``loss_kwargs``, as ``Trainer.forward_backward_step``
passes them). The saves alive at once are recorded by ``pipeline.InFlightRecorder`` (per layer, by the
layer's index in the whole model), and the schedule's own holds — sent outputs in ``fwd_cache``, the
last stage's logits, the receive buffers — by ``pipeline.CountedStage`` under the estimate's names.

Known limitations:
- NB: the stage is built with static ``input_args`` / ``output_args`` (as ``pipeline.make_stage``):
  torchtitan's ``PipelineStage`` infers them by running the stage once, which exchanges metadata that
  the fake process group cannot carry. The shapes are the ones that run would find.
- NB: this builder runs one untensor-parallel, unsharded stage; tp, dp (FSDP2 with ``pp_enabled``), cp,
  ``--compile`` (``titan_compiled``) and the interleaved schedule (vpp > 1) run in ``titan_vpp``, this
  builder's blocks are eager. Under ``SelectiveAC`` each block call's cache is held (``titan_sac``).
- NB: only saved tensors and the stage's parameter bytes are compared, not the peak.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.pipelining import Schedule1F1B

from memplan.config import Checkpointing, Setup
from memplan.measure.distributed.pipeline import CountedStage, InFlightRecorder
from memplan.measure.distributed.titan import fake_world, split_part
from memplan.measure.distributed.titan_sac import hold_sac
from memplan.measure.frameworks.step import activation_dtype
from memplan.measure.frameworks.titan import apply_ac, require_torchtitan, titan_config
from memplan.measure.instruments.record import _RECORDER, SavedRecord, layer_scope
from memplan.measure.runs.run import make_batch
from memplan.strategies.pipeline_parallel import stage_layers


@dataclass(frozen=True)
class StageRun:
    """One pipeline rank's step: the saves alive at once at their maximum, the stage's parameter bytes."""

    records: list[SavedRecord]
    param_bytes: int
    layers: Sequence[int]
    """The stage's layers, by their index in the whole model."""
    unsharded_weights: int = 0
    """FSDP2: the most bytes of the rank's unsharded parameters alive at once during the step (sampled at
    each chunk's forward, backward and gradient reduction: ``titan_vpp.Fsdp2Held``)."""
    unsharded_grads: int = 0
    """FSDP2: the unsharded gradients each chunk holds when its reduction starts, summed over the chunks."""
    grad_bytes: int = 0
    """The rank's parameters' gradients after the step (FSDP2: the reduce-scattered shards)."""
    peak: int = 0
    """With ``peak``: the rank's highest live bytes over the step (``titan_peak.PeakTracker``)."""
    peak_parts: dict[str, int] = field(default_factory=dict)
    """What was alive then (``titan_vpp.pipeline_peak_parts``)."""

    def layer_bytes(self, i: int) -> int:
        return sum(r.bytes for r in self.records if r.layer == i)

    @property
    def activations(self) -> int:
        return sum(r.bytes for r in self.records)


def stage_module_names(setup: Setup) -> list[list[str]]:
    """Module names of each stage as torchtitan's ``module_fqns_per_model_part`` lists them: the
    estimate's stage counts (``pipeline_parallel.stage_layers``; torchtitan's own placement unless
    ``--pp-layers`` says otherwise), the embedding on the first, the final norm and lm head on the last."""
    counts = stage_layers(setup.model.num_layers, setup.parallel)
    names, start = [], 0
    for i, n in enumerate(counts):
        part = ["tok_embeddings"] if i == 0 else []
        part += [f"layers.{j}" for j in range(start, start + n)]
        names.append(part + (["norm", "lm_head"] if i == len(counts) - 1 else []))
        start += n
    return names


def build_stage(setup: Setup, index: int) -> tuple[Any, range]:
    """Stage ``index``'s module on the meta device, cut by torchtitan's ``_split_module``, and its layers."""
    require_torchtitan()
    default = torch.get_default_dtype()
    torch.set_default_dtype(activation_dtype(setup))
    try:
        with torch.device("meta"):
            model = titan_config(setup).build()
    finally:
        torch.set_default_dtype(default)
    apply_ac(model, setup)
    names = stage_module_names(setup)[index]
    chunk = split_part(model, names)  # torchtitan's ``_split_module``, copying only what it keeps
    chunk.train()
    ids = [int(n.split(".")[1]) for n in names if n.startswith("layers.")]
    return chunk, range(ids[0], ids[-1] + 1)


class TitanStage(CountedStage):
    """``CountedStage`` that also holds the last stage's output: torchtitan's stage ends with the lm head,
    its loss runs in the schedule's ``loss_fn``, so ``fwd_cache`` keeps the [b, s, v] logits until that
    micro-batch's backward (``pp.logits``)."""

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        recorder = _RECORDER.get()
        if isinstance(recorder, InFlightRecorder) and self.is_last:
            for t in self.fwd_cache[fwd_chunk_id][0]:
                recorder.hold(t, "pp.logits", until_freed=True)
        return out


class _HeldWork:
    """A send's ``Work`` that keeps its tensor, as gloo's ``SendWork`` does (``tensor_``,
    ProcessGroupGloo.cpp) and the fake backend's does not: ``Schedule1F1B``'s ``send_work`` then holds the
    warm-up's last sent output as on a real backend (``pipeline_parallel.boundary_tensors``)."""

    def __init__(self, work: Any, tensor: torch.Tensor) -> None:
        self.work, self.tensor = work, tensor

    def wait(self, *args: Any) -> Any:
        return self.work.wait(*args)


@contextmanager
def sends_hold_tensors() -> Iterator[None]:
    """``schedules._batch_p2p`` with each send's ``Work`` holding its tensor (``_HeldWork``)."""
    from torch.distributed.pipelining import schedules

    batch = schedules._batch_p2p

    def held(ops: list[dist.P2POp], desc: str | None = None) -> list[Any]:
        works = batch(ops, desc)
        if len(works) != len(ops):  # a coalesced mixed batch (1F1B waits on it at once)
            return works
        return [_HeldWork(w, op.tensor) for w, op in zip(works, ops, strict=True)]

    setattr(schedules, "_batch_p2p", held)  # noqa: B010 (a module function, patched for the run)
    try:
        yield
    finally:
        setattr(schedules, "_batch_p2p", batch)  # noqa: B010


def _stage(
    chunk: Any,
    setup: Setup,
    index: int,
    num: int | None = None,
    kind: type[TitanStage] = TitanStage,
    group: Any = None,
) -> CountedStage:
    """torch's ``PipelineStage`` (``kind``) for the chunk, stage ``index`` of ``num`` (p by default), with
    static shapes: [b, s] ids into the first stage, [b, s, h] hidden states between stages, [b, s, v]
    logits out of the last (module docstring); ``group``: the pipeline ranks' (the world's by default)."""
    t, m = setup.training, setup.model
    b, s, h, v = t.micro_batch, t.seq_len, m.hidden_size, m.vocab_size
    act = activation_dtype(setup)
    hidden = torch.empty(b, s, h, dtype=act, device="meta")
    inputs = torch.empty(b, s, dtype=torch.long, device="meta") if index == 0 else hidden.requires_grad_()
    p = setup.parallel.pp if num is None else num
    out = torch.empty(b, s, v, dtype=act, device="meta") if index == p - 1 else hidden.detach()
    return kind(
        chunk,
        index,
        p,
        torch.device("cpu"),
        input_args=inputs,
        output_args=out.requires_grad_(),
        group=dist.group.WORLD if group is None else group,
        on_phase=lambda _phase: None,
    )


def measure_titan_stage(setup: Setup, index: int, fake: bool = True) -> StageRun:
    """One 1F1B step of pipeline rank ``index`` of torchtitan's Llama 3 (module docstring)."""
    tt = require_torchtitan()
    p, n = setup.parallel.pp, setup.training.grad_accum
    with fake_world(index, p):
        chunk, layers = build_stage(setup, index)
        with FakeTensorMode(allow_non_fake_inputs=True) if fake else nullcontext(), ExitStack() as hooks:
            chunk.to_empty(device="cpu")
            stage = _stage(chunk, setup, index)
            loss = tt.loss.CrossEntropyLoss(tt.loss.CrossEntropyLoss.Config())
            schedule = StaticSchedule1F1B(
                stage, n, loss_fn=lambda out, labels, **kw: loss(out, labels, **kw)[0], scale_grads=False
            )
            for i, block in zip(layers, chunk.layers.values(), strict=True):
                hooks.enter_context(_scoped(block, i))
            if setup.strategy.checkpointing is Checkpointing.SELECTIVE:
                hooks.enter_context(hold_sac(dict(zip(layers, chunk.layers.values(), strict=True))))
            batches = [make_batch(setup, "cpu") for _ in range(n)]
            # trainer.py: global_valid_tokens, the valid labels of the whole step (here: every token)
            tokens = torch.tensor(n * setup.training.micro_batch * setup.training.seq_len)
            recorder = InFlightRecorder(chunk)
            with recorder, sends_hold_tensors():
                step(schedule, batches, {"global_valid_tokens": tokens})
            params = sum(q.untyped_storage().nbytes() for q in chunk.parameters())
            return StageRun(recorder.records, params, layers)


class StaticSchedule1F1B(Schedule1F1B):
    """``Schedule1F1B`` whose p2p warm-up is the vote's outcome for static shapes: the vote (a product of
    the ranks' 0/1 votes read back with ``.item()``, data-dependent under fake tensors) decides ``STATIC``
    when every stage was given its ``input_args`` and ``output_args`` (``InferenceMode.needs_dynamic``)."""

    def _warmup_p2p(self, stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
        from torch.distributed.pipelining._utils import InferenceMode

        for st in stages:
            assert not InferenceMode.needs_dynamic(st._user_meta, has_backward)
            st._inference_mode = InferenceMode.STATIC


def step(
    schedule: Schedule1F1B,
    batches: list[tuple[Any, Any]],
    loss_kwargs: dict[str, Any],
    kwargs: list[dict[str, Any]] | None = None,
) -> None:
    """``Schedule1F1B.step`` without its split (``pipeline.run_step``: each micro-batch its own storage),
    as ``Trainer.forward_backward_step`` calls it: ids to the first stage, labels to the last, ``kwargs``
    (each micro-batch's, e.g. the positions under cp) to every stage."""
    stage = schedule._stage
    stage.has_backward = schedule._has_backward
    stage.clear_runtime_states()
    args = [(ids,) if stage.is_first else () for ids, _ in batches]
    targets = [labels for _, labels in batches] if stage.is_last else None
    kw = kwargs if kwargs is not None else [{} for _ in batches]
    schedule._step_microbatches(args, kw, targets, None, return_outputs=False, loss_kwargs=loss_kwargs)


class _scoped:
    """Saves made inside ``block``'s forward (and its re-run) attributed to layer ``i``."""

    def __init__(self, block: Any, i: int) -> None:
        self.block, self.i = block, i

    def __enter__(self) -> None:
        self.tokens: list[Any] = []
        self.handles = [
            self.block.register_forward_pre_hook(partial(self._enter)),
            self.block.register_forward_hook(self._leave),
        ]

    def _enter(self, *_: Any) -> None:
        self.tokens.append(layer_scope(self.i))
        self.tokens[-1].__enter__()

    def _leave(self, *_: Any) -> None:
        self.tokens.pop().__exit__(None, None, None)

    def __exit__(self, *_: Any) -> None:
        for h in self.handles:
            h.remove()
