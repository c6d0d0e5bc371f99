"""Run Hugging Face transformers' own model for a setup (``--impl hf``) and record what it keeps.

``measure_hf(setup)`` builds ``AutoModelForCausalLM.from_config`` for the model's family (its
``modeling_<model_type>.py``; no weights, no network, no ``trust_remote_code``) under ``FakeTensorMode`` on
CPU, runs forward with labels (transformers' own loss) and backward, and records every storage autograd
saves, named by the module that saved it and the op (``self_attn.q_proj · Mm``), per decoder layer; and the
FLOPs per phase (``FlopMeter``). The attention kernel is ``attn_implementation``: ``eager`` for
``--attention eager``, ``sdpa`` for flash (on CPU torch's flash kernel, as the reference model);
``--checkpointing full`` / ``every-K`` is transformers' ``gradient_checkpointing_enable`` (``every_n_layers``
K, ``use_reentrant`` from ``--reentrant``).

The recording loop is ``memplan.measure.framework.run_step`` (shared with ``--impl torchtitan``).

Known limitations:
- NB: transformers is an optional extra (``pip install 'memplan[hf]'``); ``require_transformers`` says so.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan.config import Attention, Checkpointing, Setup
from memplan.measure.framework import activation_dtype, run_step
from memplan.measure.hf_config import hf_config, require_transformers
from memplan.measure.run import Measured, make_batch


def attn_implementation(setup: Setup) -> str:
    return "eager" if setup.strategy.attention is Attention.EAGER else "sdpa"


def build(setup: Setup) -> Any:
    """transformers' causal LM for ``setup`` in the activation dtype, in training mode (call under a fake
    mode: no memory is allocated)."""
    transformers = require_transformers()
    dtype = activation_dtype(setup)
    transformers.logging.set_verbosity_error()  # e.g. "use_cache=True is incompatible with checkpointing"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(
            hf_config(setup), dtype=dtype, attn_implementation=attn_implementation(setup)
        )
    model.train()
    return model


def layers_of(model: Any) -> list[Any]:
    """The decoder layers, in order (``model.layers`` or GPT-2's ``transformer.h``)."""
    base = model.base_model
    return list(base.layers if hasattr(base, "layers") else base.h)


def measure_hf(setup: Setup, fake: bool = True) -> Measured:
    """One forward (transformers' loss) and backward of the real HF model for ``setup`` on CPU."""
    torch.manual_seed(0)
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else nullcontext():
        model = build(setup)
        s = setup.strategy
        if s.checkpointing in (Checkpointing.FULL, Checkpointing.EVERY_K):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                model._activation_checkpointing_enable(
                    {"use_reentrant": setup.impl.reentrant}, every_n_layers=s.segment
                )
        ids, labels = make_batch(setup, "cpu")
        layers = [(layer, "_gradient_checkpointing_func") for layer in layers_of(model)]

        def forward() -> torch.Tensor:
            return model(input_ids=ids, labels=labels, use_cache=setup.impl.use_cache).loss

        return run_step(model, layers, forward, s.checkpointing is not Checkpointing.NONE)
