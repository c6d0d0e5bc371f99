"""One pipeline rank of torchtitan's Llama 3 under torch's ``ScheduleInterleaved1F1B`` (``--impl torchtitan
--pp P --vpp M``: torchtitan's ``pipeline_parallel_schedule = "Interleaved1F1B"``), in one process.

``measure_titan_interleaved(setup, index)`` joins torch's fake process group as pipeline rank ``index`` of
p, builds torchtitan's ``Llama3Model`` on the meta device once per local chunk and cuts each with
torchtitan's ``_split_module`` over the module names of its virtual stage: local chunk k is virtual stage
k·p + index ("loop" style, ``_get_pp_rank_to_stage_indices_mapping``), the p·M stages' names as
``_generate_llm_fqn_per_model_part`` gives them (the setup's ``pp_layers``, torchtitan's placement unless
given). The chunks become ``PipelineStage``s with static shapes (``titan_pp._stage``'s), materialised under
``FakeTensorMode``, and torch's ``ScheduleInterleaved1F1B`` runs the step's ``grad_accum`` micro-batches
(torchtitan's loss as ``loss_fn``, ``scale_grads=False``, ``global_valid_tokens``). Recorded: the saves
alive at once at their maximum per layer (``pipeline.InFlightRecorder``), the schedule's holds under the
estimate's names — sent outputs (``pp.output``), sent input gradients (``pp.grad_send``; the runtime keeps
every send's ``Work`` to the step's end, ``strategies.torch_interleaved``), the last virtual stage's logits,
every chunk's receive buffers — and the rank's parameter bytes.

Known limitations:
- NB: as ``titan_pp``: static ``input_args`` / ``output_args``, the warm-up's vote decided ``STATIC``;
  a send's ``Work`` keeps its tensor as gloo's does (``titan_pp.sends_hold_tensors``).
- NB: tp, cp and FSDP2 with pp are refused in ``config.setup.check_titan_pipeline``.
"""

from __future__ import annotations

from contextlib import ExitStack, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.pipelining import ScheduleInterleaved1F1B

from memplan.config import Setup
from memplan.measure.distributed.pipeline import InFlightRecorder
from memplan.measure.distributed.titan import fake_world
from memplan.measure.distributed.titan_pp import (
    StageRun,
    StaticSchedule1F1B,
    TitanStage,
    _scoped,
    _stage,
    sends_hold_tensors,
)
from memplan.measure.frameworks.step import activation_dtype
from memplan.measure.frameworks.titan import apply_ac, require_torchtitan, titan_config
from memplan.measure.instruments.record import _RECORDER
from memplan.measure.runs.run import make_batch


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


def build_chunk(setup: Setup, names: list[str]) -> Any:
    """One virtual stage's module on the meta device, cut by torchtitan's ``_split_module``."""
    require_torchtitan()
    from torchtitan.distributed.pipeline_parallel import _split_module

    default = torch.get_default_dtype()
    torch.set_default_dtype(activation_dtype(setup))
    try:
        with torch.device("meta"):
            model = titan_config(setup).build()
    finally:
        torch.set_default_dtype(default)
    apply_ac(model, setup)
    chunk = _split_module(model, names)
    chunk.train()
    return chunk


def measure_titan_interleaved(setup: Setup, index: int, fake: bool = True) -> StageRun:
    """One ``ScheduleInterleaved1F1B`` step of pipeline rank ``index`` (module docstring)."""
    tt = require_torchtitan()
    p, m, n = setup.parallel.pp, setup.parallel.vpp, setup.training.grad_accum
    names = virtual_module_names(setup)
    with fake_world(index, p):
        chunks = [build_chunk(setup, names[k * p + index]) for k in range(m)]
        with FakeTensorMode(allow_non_fake_inputs=True) if fake else nullcontext(), ExitStack() as hooks:
            stages: list[Any] = []  # InterleavedStage, each
            for k, chunk in enumerate(chunks):
                chunk.to_empty(device="cpu")
                stages.append(_stage(chunk, setup, k * p + index, p * m, InterleavedStage))
            for st in stages:
                st.siblings = stages
            loss = tt.loss.CrossEntropyLoss(tt.loss.CrossEntropyLoss.Config())
            schedule = StaticInterleaved1F1B(
                stages, n, loss_fn=lambda out, labels, **kw: loss(out, labels, **kw)[0], scale_grads=False
            )
            layers = []
            for chunk in chunks:
                for key, block in chunk.layers.items():
                    layers.append(int(key))
                    hooks.enter_context(_scoped(block, int(key)))
            batches = [make_batch(setup, "cpu") for _ in range(n)]
            # trainer.py: global_valid_tokens, the valid labels of the whole step (here: every token)
            tokens = torch.tensor(n * setup.training.micro_batch * setup.training.seq_len)
            recorder = InFlightRecorder(torch.nn.ModuleList(chunks))
            with recorder, sends_hold_tensors():
                step(schedule, batches, {"global_valid_tokens": tokens})
            params = sum(q.untyped_storage().nbytes() for c in chunks for q in c.parameters())
            return StageRun(recorder.records, params, tuple(sorted(layers)))


def step(
    schedule: ScheduleInterleaved1F1B, batches: list[tuple[Any, Any]], loss_kwargs: dict[str, Any]
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
    schedule._step_microbatches(
        args, [{} for _ in batches], targets, None, return_outputs=False, loss_kwargs=loss_kwargs
    )
