"""transformers' reentrant checkpointing (``use_reentrant=True``: torch.utils.checkpoint's
``CheckpointFunction``) under full training, at the families' real widths (two layers, s 512, fake
tensors): the layer's and the embedding's backward measured (``measure.frameworks.hf_peak``) against the
estimate's (``analytic.moments.reentrant``, ``blocks.attention.constants.bound_in_partials``).

Before, each read under the measured moments (layer backward / embedding backward, beyond the named
differences below):
- Llama 3 8B: 8,388,608 / 262,144 B. The Function's backward frame holds the re-run layer's output and,
  past the residual sum below the MLP's norm, the layer's output gradient (two [T, h]) at the attention's
  backward; the cos and sin [s, 128] its layers' partials bind stay alive to the backward's end.
- GPT-2: 786,432 / 0 B. The re-run output [T, h] beside the GELU's backward, the layer's top.
- Falcon-7B: 4,653,056 / 393,216 B. The re-run output [T, h] at W_QKV's dX matmul (the parallel layer's
  output gradient is its residual gradient: alive either way); the tables and the bool mask [1, 1, s, s].
- StableLM 2 1.6B: 4,198,400 / 32,768 B. Two [T, h] and W_Q's bias gradient [a·d], made before the
  re-run graph frees W_Q's saved input (``analytic.moments.qkv_backward.q_input_gradient``); the tables [s,
  16].
- Gemma 2 2B (eager): the full layers' additive mask [1, 1, s, s] is held to the end, not freed below
  the lowest full layer (``released_below``: 524,288 B over at layer 0's backward with the above modelled).

- The int64 [1, s] position ids (8·s B) the checkpointed layers' partials bind, kept to the end: at the
  layer backward where the layers take rotary positions (``constants.checkpointed_position_ids``, as
  non-reentrant), at the embedding's in every family (``bound_in_partials``; GPT-2's layers are passed
  them too: the position table's saved ids, whose backward frees the save but not the partials'
  reference), 8·s B under at both before.

Left, named: Gemma's ``embed_scale`` buffer, which ``.to(bf16)`` returns as itself (−2 B at the layer's
backward)."""

from __future__ import annotations

import pytest

from memplan.config import Family, Setup
from memplan.engine import estimate
from memplan.measure.frameworks.hf_peak import measure_hf_peak
from memplan.measure.instruments.moments import estimated_moments
from tests.hf.harness import hf_setup

CASES = [
    *(
        hf_setup(name, seq=512, checkpointing="full", reentrant=True)
        for name in ("llama-3-8b", "gpt2", "falcon-7b", "stablelm-2-1.6b")
    ),
    hf_setup("gemma-2-2b", seq=512, checkpointing="full", reentrant=True, attention="eager"),
]


def case_id(setup: Setup) -> str:
    return setup.model.name


@pytest.mark.parametrize("setup", CASES, ids=case_id)
def test_reentrant_moments_are_transformers(setup: Setup) -> None:
    """The layer's and the embedding's backward exact but for Gemma's ``embed_scale`` (2 B)."""
    est = estimated_moments(estimate(setup))
    measured, buffers = measure_hf_peak(setup)
    scale = 2 if setup.model.family is Family.GEMMA2 else 0  # embed_scale: .to(bf16) returns itself
    got = {k: measured[k] for k in ("layer backward", "embedding backward")}
    assert all(v is not None for v in got.values())
    assert {k: v - buffers - est[k] for k, v in got.items() if v is not None} == {
        "layer backward": -scale,
        "embedding backward": 0,
    }
