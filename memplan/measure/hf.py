"""Run Hugging Face transformers' own model for a setup (``--impl hf``) and record what it keeps.

``measure_hf(setup)`` builds ``AutoModelForCausalLM.from_config`` for the model's family (its
``modeling_<model_type>.py``; no weights, no network, no ``trust_remote_code``) under ``FakeTensorMode`` on
CPU, runs forward with labels (transformers' own loss) and backward, and records every storage autograd
saves, named by the module that saved it and the op (``self_attn.q_proj · Mm``), per decoder layer; and the
FLOPs per phase (``FlopMeter``). The attention kernel is ``attn_implementation``: ``eager`` for
``--attention eager``, ``sdpa`` for flash (on CPU torch's flash kernel, as the reference model);
``--checkpointing full`` / ``every-K`` is transformers' ``gradient_checkpointing_enable`` (``every_n_layers``
K, ``use_reentrant`` from ``--reentrant``).

Mixtures of experts run transformers' default ``grouped_mm`` experts, whose buffers are [T·k, ·] whatever
the routing, so fake tensors run them at any size; on real tensors (``fake=False``) a forward hook on each
router records the tokens per expert it chose (``Measured.routing``).

Known limitations:
- NB: ops are named from the autograd graph only without checkpointing (reading a saved tensor of a
  non-reentrant checkpoint would re-run it); under checkpointing each record names its module only.
- Fake tensors cannot be read, so transformers' packed-sequence check (``masking_utils.
  find_packed_sequence_indices``, run when there is no cache) would assume packing and build a [b, 1, s, s]
  mask a real run never makes; the run patches it to what a real run finds for the default position ids
  (0…s−1: one sequence, no mask) — ``one_sequence``.
- NB: transformers is an optional extra (``pip install 'memplan[hf]'``); ``require_transformers`` says so.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import replace
from functools import partial
from typing import Any
from unittest.mock import patch

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan.config import Attention, Checkpointing, ExpertsImpl, Impl, Setup
from memplan.measure.hf_config import hf_config, require_transformers
from memplan.measure.instruments import (
    FlopMeter,
    SavedRecord,
    SavedTensorRecorder,
    current_layer,
    layer_scope,
    storage_ref,
)
from memplan.measure.run import Measured, make_batch


def check_traceable(setup: Setup) -> None:
    """One-line errors before building: the frameworks this module runs, and transformers installed."""
    if setup.impl.impl is not Impl.HF:
        raise ValueError(
            f"impl: trace --impl {setup.impl.impl.value} is not runnable here; trace --impl hf runs "
            "transformers' code, trace (--impl reference) memplan's reference model"
        )
    require_transformers()


def attn_implementation(setup: Setup) -> str:
    return "eager" if setup.strategy.attention is Attention.EAGER else "sdpa"


def build(setup: Setup) -> Any:
    """transformers' causal LM for ``setup`` in the activation dtype, in training mode (call under a fake
    mode: no memory is allocated)."""
    transformers = require_transformers()
    dtype = getattr(torch, _TORCH_DTYPES[setup.training.precision.activation_dtype.value])
    transformers.logging.set_verbosity_error()  # e.g. "use_cache=True is incompatible with checkpointing"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        experts = {"experts_implementation": setup.impl.experts.value} if setup.model.moe else {}
        model = transformers.AutoModelForCausalLM.from_config(
            hf_config(setup), dtype=dtype, attn_implementation=attn_implementation(setup), **experts
        )
    model.train()
    return model


_TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def layers_of(model: Any) -> list[Any]:
    """The decoder layers, in order (``model.layers`` or GPT-2's ``transformer.h``)."""
    base = model.base_model
    return list(base.layers if hasattr(base, "layers") else base.h)


@contextmanager
def _scoped(model: Any, meter: FlopMeter, recorder: PathRecorder, state: dict[str, bool]) -> Iterator[None]:
    """Per decoder layer: its saves attributed to its index; under gradient checkpointing, the tensors the
    checkpoint keeps (arguments, and keyword tensors bound in transformers' partial) counted as kept, and
    the re-run's FLOPs as recompute."""
    handles = []
    for i, layer in enumerate(layers_of(model)):
        handles.append(layer.register_forward_pre_hook(partial(_enter, i)))
        handles.append(layer.register_forward_hook(_leave))
        func = getattr(layer, "_gradient_checkpointing_func", None)
        if func is not None:
            layer._gradient_checkpointing_func = _kept(func, i, meter, recorder, state)
    try:
        yield
    finally:
        for h in handles:
            h.remove()


_TOKENS: list[Any] = []


def _enter(i: int, module: Any, args: Any) -> None:
    _TOKENS.append(layer_scope(i))
    _TOKENS[-1].__enter__()


def _leave(module: Any, args: Any, out: Any) -> None:
    _TOKENS.pop().__exit__(None, None, None)


def _kept(
    func: Callable[..., Any], i: int, meter: FlopMeter, recorder: SavedTensorRecorder, state: dict[str, bool]
) -> Callable[..., Any]:
    def wrapper(fn: Any, *args: Any, **kwargs: Any) -> Any:
        bound = getattr(fn, "keywords", {}) or {}
        with layer_scope(i):
            for t in _tensors([*args, *kwargs.values(), *bound.values()]):
                recorder.keep(t, "checkpoint.input")

        def rerun(*a: Any, **k: Any) -> Any:
            with meter.phase("recompute") if state["backward"] else nullcontext():
                return fn(*a, **k)

        return func(rerun, *args, **kwargs)

    return wrapper


def _tensors(values: list[Any]) -> Iterator[torch.Tensor]:
    for v in values:
        if isinstance(v, torch.Tensor) and v.dtype.is_floating_point | (v.dtype == torch.bool):
            yield v
        elif isinstance(v, tuple | list):
            yield from _tensors(list(v))


class PathRecorder(SavedTensorRecorder):
    """The saved-tensor recorder, each storage named by the innermost module running when it is first
    saved (``self_attn.q_proj``; inside decoder layer i, the path below ``layers.i``)."""

    def __init__(self, model: Any) -> None:
        super().__init__(model.parameters())
        self.stack: list[str] = []
        self.handles = []
        for path, module in model.named_modules():
            short = path.split(".", 3)[-1] if ".layers." in path or ".h." in path else path
            self.handles.append(module.register_forward_pre_hook(partial(_push, self.stack, short)))
            self.handles.append(module.register_forward_hook(partial(_pop, self.stack)))

        self.layers: dict[int, set[int | None]] = {}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.recording:
            if self.stack:
                self.label(t, self.stack[-1])
            self.layers.setdefault(storage_ref(t).cdata, set()).add(current_layer())
        return super()._pack(t)

    def keep(self, t: torch.Tensor, name: str | None = None) -> None:
        if self.recording:
            self.layers.setdefault(storage_ref(t).cdata, set()).add(current_layer())
        super().keep(t, name)

    def named(self, ops: dict[int, str]) -> list[SavedRecord]:
        """The records, each named ``module · op``; a storage saved by several layers (the rotary tables
        made once per forward) belongs to the model, not to the first layer that saved it."""
        out = []
        for r, key in zip(self.records, self._saved, strict=True):
            op = ops.get(key)
            shared = len(self.layers.get(key, ())) > 1
            name = r.name if not op else op if r.name == "unlabelled" else f"{r.name} · {op}"
            out.append(replace(r, name=name, layer=None if shared else r.layer))
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _push(stack: list[str], path: str, module: Any, args: Any) -> None:
    stack.append(path)


def _pop(stack: list[str], module: Any, args: Any, out: Any) -> None:
    stack.pop()  # a forward hook returning a value would replace the module's output


def op_names(loss: torch.Tensor) -> dict[int, str]:
    """The autograd op that saved each storage (``Mm``, ``Softmax``, ``Mul``), walking the graph from the
    loss: storage key → op names joined by ``+`` when several ops share it."""
    names: dict[int, str] = {}
    seen: set[Any] = set()
    todo = [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        op = node.name().rstrip("0123456789").removesuffix("Backward")
        for attr in dir(node):
            if attr.startswith("_saved_"):
                for t in _tensors([getattr(node, attr)]):
                    key = storage_ref(t).cdata
                    if op not in names.get(key, "").split("+"):
                        names[key] = f"{names[key]}+{op}" if key in names else op
        todo.extend(fn for fn, _ in node.next_functions)
    return names


def one_sequence(position_ids: torch.Tensor) -> None:
    """``find_packed_sequence_indices`` as a real run answers for the default position ids (0…s−1 in every
    row: ``(position_diff != 1).cumsum(-1)`` is all 0, so it returns None)."""
    return None


def measure_hf(setup: Setup, fake: bool = True) -> Measured:
    """One forward (transformers' loss) and backward of the real HF model for ``setup`` on CPU."""
    if fake and setup.model.moe and setup.impl.experts is ExpertsImpl.EAGER:
        raise ValueError(
            "experts: transformers' eager experts loop has data-dependent shapes (torch.where) that fake "
            "tensors cannot run; trace --experts grouped_mm, or measure eager on real tensors (tests/hf)"
        )
    torch.manual_seed(0)
    masking = require_transformers().masking_utils
    with (
        FakeTensorMode(allow_non_fake_inputs=True) if fake else nullcontext(),
        patch.object(masking, "find_packed_sequence_indices", one_sequence),
    ):
        model = build(setup)
        s = setup.strategy
        if s.checkpointing in (Checkpointing.FULL, Checkpointing.EVERY_K):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model._activation_checkpointing_enable(
                    {"use_reentrant": setup.impl.reentrant}, every_n_layers=s.segment
                )
        ids, labels = make_batch(setup, "cpu")
        meter = FlopMeter()
        recorder = PathRecorder(model)
        state = {"backward": False}
        routing: list[list[int]] = []
        with ExitStack() as stack:
            stack.enter_context(_scoped(model, meter, recorder, state))
            stack.enter_context(meter)
            stack.enter_context(recorder)
            with meter.phase("forward"), nullcontext() if fake else _routing(model, routing):
                loss = model(input_ids=ids, labels=labels, use_cache=setup.impl.use_cache).loss
            ops = op_names(loss) if s.checkpointing is Checkpointing.NONE else {}
            state["backward"] = True
            with recorder.pause(), meter.phase("backward"):
                loss.backward()
        recorder.remove()
    records = recorder.named(ops)
    totals = {k: meter.totals.get(k, 0) for k in ("forward", "backward", "recompute")}
    return Measured(records=records, flops=totals, by_op=meter.by_op, routing=routing)


@contextmanager
def _routing(model: Any, out: list[list[int]]) -> Iterator[None]:
    """Per MoE layer, the tokens per expert its router chose: a forward hook on each ``*TopKRouter``
    (``MixtralTopKRouter`` / ``Qwen2MoeTopKRouter`` return logits, scores and the [T, k] expert indices)."""
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    handles = [r.register_forward_hook(partial(_count, out)) for r in routers]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _count(out: list[list[int]], module: Any, args: Any, result: Any) -> None:
    indices = result[2]
    out.append(torch.bincount(indices.reshape(-1), minlength=module.num_experts).tolist())
