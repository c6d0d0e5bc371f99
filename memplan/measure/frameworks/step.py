"""Record what a framework's own model keeps (``--impl hf``, ``--impl torchtitan``): one forward with its
loss and backward under fake tensors, every saved storage named by the module that saved it and the op
(``self_attn.q_proj · Mm``), per decoder layer, and the FLOPs per phase (``FlopMeter``).

``run_step(model, layers, forward, checkpointed)`` is the one loop both frameworks share: ``layers`` are the
decoder layers in order, each with the attribute holding its checkpoint function (transformers'
``_gradient_checkpointing_func``, torch's ``CheckpointWrapper.checkpoint_fn``) when checkpointed; the
checkpoint's inputs are counted as kept and its re-run's FLOPs as recompute.

Known limitations:
- NB: ops are named from the autograd graph only without checkpointing (reading a saved tensor of a
  non-reentrant checkpoint would re-run it); under checkpointing each record names its module only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import replace
from functools import partial
from typing import Any

import torch

from memplan.config import Setup
from memplan.measure.instruments.measured import Measured
from memplan.measure.instruments.record import (
    FlopMeter,
    SavedRecord,
    SavedTensorRecorder,
    current_layer,
    layer_scope,
    storage_key,
)


def activation_dtype(setup: Setup) -> torch.dtype:
    """The torch dtype of the activations (the precision's activation dtype)."""
    return getattr(torch, _TORCH_DTYPES[setup.training.precision.activation_dtype.value])


_TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@contextmanager
def _scoped(
    layers: list[tuple[Any, str]], meter: FlopMeter, recorder: PathRecorder, state: dict[str, bool]
) -> Iterator[None]:
    """Per decoder layer: its saves attributed to its index; when checkpointed (its checkpoint function in
    the named attribute), the tensors the checkpoint keeps (arguments, and keyword tensors bound in
    transformers' partial) counted as kept, and the re-run's FLOPs as recompute."""
    handles = []
    for i, (layer, attr) in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(partial(_enter, i)))
        handles.append(layer.register_forward_pre_hook(partial(_given, recorder), with_kwargs=True))
        handles.append(layer.register_forward_hook(_leave))
        func = getattr(layer, attr, None)
        if func is not None:
            setattr(layer, attr, _kept(func, i, meter, recorder, state))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


_TOKENS: list[Any] = []


def _enter(i: int, module: Any, args: Any) -> None:
    _TOKENS.append(layer_scope(i))
    _TOKENS[-1].__enter__()


def _given(recorder: PathRecorder, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
    """The rotary tables and the position ids a decoder layer is given (transformers'
    ``position_embeddings`` and ``position_ids``, made once per forward, outside every layer): the
    model's, whichever layer saves or keeps them (every-K over two layers: layer 0's checkpoint alone).
    (Not its other keyword tensors: a window's mask belongs to the layers of its kind.)"""
    given = [kwargs.get("position_embeddings"), kwargs.get("position_ids")]
    if recorder.recording:
        recorder.outside.update(storage_key(t) for t in _tensors([g for g in given if g is not None]))


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
        # complex too: DeepSeek-V2's freqs_cis (complex64) is a keyword tensor the checkpoint binds; and
        # integers: transformers' int64 position ids (``constants.checkpointed_position_ids``)
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, tuple | list):
            yield from _tensors(list(v))


def hf_path(path: str) -> str:
    """A transformers module path inside decoder layer i: the part below ``layers.i`` (GPT-2: ``h.i``)."""
    return path.split(".", 3)[-1] if ".layers." in path or ".h." in path else path


class PathRecorder(SavedTensorRecorder):
    """The saved-tensor recorder, each storage named by the innermost module running when it is first
    saved, its path shortened by ``short`` (``self_attn.q_proj``: the path below ``layers.i``)."""

    def __init__(self, model: Any, short: Callable[[str], str] = hf_path) -> None:
        super().__init__(self._parameters(model))
        self.stack: list[str] = []
        self.handles = []
        for path, module in model.named_modules():
            self.handles.append(module.register_forward_pre_hook(partial(_push, self.stack, short(path))))
            self.handles.append(module.register_forward_hook(partial(_pop, self.stack)))

        self.layers: dict[int, set[int | None]] = {}
        self.outside: set[int] = set()
        """The rotary tables given to the layers (``_given``): made outside them."""

    def _parameters(self, model: Any) -> Any:
        """The parameters excluded from the records (a subclass may refresh them as it goes)."""
        return model.parameters()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if self.recording:
            if self.stack:
                self.label(t, self.stack[-1])
            self.layers.setdefault(storage_key(t), set()).add(current_layer())
        return super()._pack(t)

    def keep(self, t: torch.Tensor, name: str | None = None) -> None:
        if self.recording:
            self.layers.setdefault(storage_key(t), set()).add(current_layer())
        super().keep(t, name)

    def named(self, ops: dict[int, str]) -> list[SavedRecord]:
        """The records, each named ``module · op``; a storage saved by several layers, or given to the
        layers from outside (the rotary tables made once per forward), belongs to the model, not to the
        first layer that saved it. Before, with every layer below the top frozen (``--freeze``) one layer
        alone saved the tables, and they counted as its (``trace --impl hf`` a layer 2,048 B over)."""
        out = []
        for r, key in zip(self.records, self._saved, strict=True):
            op = ops.get(key)
            shared = len(self.layers.get(key, ())) > 1 or key in self.outside
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
    loss: storage key → op names joined by ``+`` when several ops share it. Python dispatch is off while the
    graph is read (``_DisableTorchDispatch``): reading a saved tensor detaches it, which would otherwise run
    through the FLOP meter and the fake mode, a fifth of a small model's measurement; its storage, all that
    is read here, is the same."""
    names: dict[int, str] = {}
    seen: set[Any] = set()
    todo = [loss.grad_fn]
    with torch._C._DisableTorchDispatch():
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            op = node.name().rstrip("0123456789").removesuffix("Backward")
            for attr in dir(node):
                if attr.startswith("_saved_"):
                    for t in _tensors([getattr(node, attr)]):
                        key = storage_key(t)
                        if op not in names.get(key, "").split("+"):
                            names[key] = f"{names[key]}+{op}" if key in names else op
            todo.extend(fn for fn, _ in node.next_functions)
    return names


def run_step(
    model: Any,
    layers: list[tuple[Any, str]],
    forward: Callable[[], torch.Tensor],
    checkpointed: bool,
    short: Callable[[str], str] = hf_path,
    after_forward: Callable[[PathRecorder], None] | None = None,
    recorder_type: type[PathRecorder] = PathRecorder,
) -> Measured:
    """One ``forward()`` (returning the loss) and backward of ``model``, its saves recorded per layer;
    ``after_forward`` counts what the code keeps outside autograd's saved tensors (torchtitan's selective
    checkpoint cache); then the saves already freed are dropped (``SavedTensorRecorder.forget_freed``:
    a node whose output the code discards dies with its saves, never kept for backward), for every
    framework; ``recorder_type`` a recorder for one rank's DTensors."""
    meter = FlopMeter()
    recorder = recorder_type(model, short)
    state = {"backward": False}
    with ExitStack() as stack:
        stack.enter_context(_scoped(layers, meter, recorder, state))
        stack.enter_context(meter)
        stack.enter_context(recorder)
        with meter.phase("forward"):
            loss = forward()
        if after_forward is not None:
            after_forward(recorder)
        recorder.forget_freed()  # the one rule of every recorder: only the saves alive for backward
        ops = {} if checkpointed else op_names(loss)
        state["backward"] = True
        with recorder.pause(), meter.phase("backward"):
            loss.backward()
    recorder.remove()
    totals = {k: meter.totals.get(k, 0) for k in ("forward", "backward", "recompute")}
    return Measured(records=recorder.named(ops), flops=totals, by_op=meter.by_op)
