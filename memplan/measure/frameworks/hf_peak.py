"""The peak of transformers' own training step (``--impl hf``): one forward (transformers' loss) and backward
of the model ``measure_hf`` builds, peft's adapters on it under LoRA, every storage an op makes counted
until its last reference dies (``instruments.tracker.LiveMemoryTracker``), read at the estimate's moments
(``instruments.moments``).

The curve's boundaries are hooks on transformers' modules: "start", "forward i" when decoder layer i
returns, and when an output gradient is ready (that module's backward begins) "backward lm_head", "backward
final_norm", "backward i", "backward embedding" (a hook on a view of the module's output, registered by a
forward hook; a decoder layer that returns a tuple has its first element, the hidden states, viewed). The
final norm is the last normalisation module outside the layers (Llama's ``model.norm``, GPT-2's
``transformer.ln_f``, GPT-NeoX's ``gpt_neox.final_layer_norm``).

Live from the start: the parameters, the buffers and the batch (ids, labels). The optimizer is not built:
the estimate's side is ``estimated_moments`` (each moment less its optimizer term).

Known limitations (tests/hf/test_hf_peak.py):
- NB: the estimate does not count a model's buffers: the rotary tables' ``inv_freq`` and
  ``original_inv_freq`` (2 × d/2 fp32: 512 B at Llama 3's head dim 128), nor GPT-NeoX's or Pythia's, which
  the measured curve holds from the start; the tests compare the curve less them.
- NB: at one sequence a micro-batch the loss's and the final norm's moments measure 8 B under the estimate
  (its labels: not found further; at two sequences they are exact), the embedding's 4 B under (a scalar of
  the loss's).
- Modelled since they were NBs here: under transformers' checkpointing the int64 [1, s] position ids
  the checkpointed layers bind (``blocks.attention.constants.checkpointed_position_ids``; 8·s B under),
  and a frozen embedding's output, a leaf that requires grad there, with its gradient at the
  embedding's backward (``analytic.head_moments.frozen_embedding_leaf``; two [T, h] under).
- NB: the layer backward moment follows memplan's reference layer; transformers' layers differ by small
  terms per family, each modelled where measured (tests/hf/test_layernorm_peak.py, test_math_core_peak.py,
  test_cohere_peak.py, test_post_norms_peak.py, test_layer_kinds.py; an adapted MLP's LoRA input
  gradients, one [T, h], not). Under
  every-K (transformers' ``every_n_layers``) each layer's moment is read in its own stretch too
  (tests/hf/test_hf_peak.py ``every_k``; ``analytic.every_k``).
- NB: fake tensors (``fake=True``, any size); ``fake=False`` runs real CPU tensors for small models.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan.config import Method, Setup
from memplan.measure.frameworks.hf import (
    _one_sequence_per_row,
    build,
    enable_checkpointing,
    freeze,
    layers_of,
    with_peft,
)
from memplan.measure.instruments.moments import moment_rows, read_points
from memplan.measure.instruments.tracker import LiveMemoryTracker, step_boundaries
from memplan.measure.runs.run import make_batch


def final_norm(model: Any) -> Any:
    """The last normalisation module outside the decoder layers (a name with no layer index)."""
    norms = [
        m
        for name, m in model.named_modules()
        if "norm" in type(m).__name__.lower() and not any(part.isdigit() for part in name.split("."))
    ]
    if not norms:
        raise ValueError(f"model: no final norm found in {type(model).__name__}")
    return norms[-1]


def boundaries(model: Any, tracker: LiveMemoryTracker) -> Any:
    """The step's boundaries (``instruments.tracker.step_boundaries``) on transformers' modules."""
    return step_boundaries(
        tracker,
        model.get_input_embeddings(),
        layers_of(model),
        final_norm(model),
        model.get_output_embeddings(),
    )


def buffer_bytes(model: Any) -> int:
    """Bytes of the model's buffers (the rotary tables' frequencies), which the estimate does not count."""
    return sum(b.untyped_storage().nbytes() for b in model.buffers())


def measure_hf_peak(
    setup: Setup, fake: bool = True, document: Mapping[str, Any] | None = None
) -> tuple[dict[str, int | None], int]:
    """The curve's highest point in each of the estimate's moments (``analytic.peak``'s names but the
    optimizer step's; None where the curve has no such stretch), and the model's ``buffer_bytes``; the
    model built as ``measure_hf`` builds it (from the user's config.json ``document`` when given, with
    transformers' activation checkpointing under ``--checkpointing full|every-K``)."""
    torch.manual_seed(0)
    lora = setup.finetune.method is Method.LORA
    if lora:  # as ``measure_hf``: peft's adapters made on the meta device, then materialised
        with torch.device("meta"):
            meta = with_peft(setup, build(setup, document))
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else nullcontext():
        model = meta.to_empty(device="cpu") if lora else build(setup, document)
        if lora:
            model.tie_weights()  # to_empty makes each parameter anew: a tied head its own copy otherwise
        freeze(setup, model)
        enable_checkpointing(setup, model)
        ids, labels = make_batch(setup, "cpu")
        tracker = LiveMemoryTracker()
        with _one_sequence_per_row(fake), tracker, boundaries(model, tracker), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tracker.track([*model.parameters(), *model.buffers(), ids, labels])
            loss = model(input_ids=ids, labels=labels, use_cache=setup.impl.use_cache).loss
            tracker.note("forward")
            loss.backward()
            tracker.note("backward")
        buffers = buffer_bytes(model)
    names = ["loss backward", "final norm backward", "layer backward", "embedding backward"]
    readings = read_points(tracker.curve, names)
    return {n: None if r is None else r[1] for n, r in zip(names, readings, strict=True)}, buffers


def step_peak_json(
    estimated: dict[str, int], measured: dict[str, int | None], buffers: int
) -> dict[str, Any]:
    """``trace --impl hf``'s ``step_peak``: each moment estimated (``instruments.moments.estimated_moments``)
    and measured less the model's ``buffers``, the two peaks, their difference."""
    less = {k: None if v is None else v - buffers for k, v in measured.items()}
    moments = moment_rows({k: v for k, v in estimated.items() if k in less}, less)
    phase = max(estimated, key=lambda k: estimated[k])
    highest = max((v for v in less.values() if v is not None), default=0)
    return {
        "moments": moments,
        "buffers": buffers,
        "estimated": estimated[phase],
        "estimated_phase": phase,
        "measured": highest,
        "delta": highest - estimated[phase],
        "equal": highest == estimated[phase],
    }
