"""transformers' layers with norms after their sublayers (Gemma-2, Gemma-3: beside pre-norms; OLMo-2: alone,
with q/k norms over the projections' whole outputs) and Gemma's fp32 (1 + w) norm, at the real widths under
fake tensors: each moment measured (``measure.frameworks.hf_peak``) against the estimate's
(``analytic.moments.post_norms``, ``head_moments``' final norm, ``constants.released_below``).

Before (s 512, two layers, none / full checkpointing, beyond the named differences below): OLMo-2 7B's
layer backward 54,513,664 / 58,707,968 B over (its post norms' saves held, q_proj's gradient counted at
its q_norm's peak, the layer input counted twice under a checkpoint); Gemma-2 2B's 9,443,840 /
9,968,128 B (the post-MLP norm's saves held at the MLP norm's peak; the full layers' mask held below them);
Gemma-3 1B's 4,722,944 / 4,722,944 B (at the MLP's backward); every Gemma's final norm h·4 B (its fp32
1 + w held)."""

from __future__ import annotations

import pytest

from memplan.config import Setup
from memplan.engine import estimate
from memplan.measure.frameworks.hf_peak import measure_hf_peak
from memplan.measure.instruments.moments import estimated_moments
from tests.hf.harness import hf_setup

PRESETS = [("olmo-2-7b", "flash"), ("gemma-2-2b", "eager"), ("gemma-3-1b", "eager"), ("gemma-7b", "eager")]
CASES = [(p, a, ck) for p, a in PRESETS for ck in ("none", "full")]


def known(setup: Setup) -> int:
    """measured − buffers − estimate, every term named (tests/hf/test_hf_peak.py): Gemma's 0-dim
    ``embed_scale`` buffer
    (bf16: ``.to(dtype)`` returns it), the embedding product's save the estimate counts and a buffer the
    measured side takes off (−A). Without checkpointing, where the layer's top follows layer 0's rotary
    backward (OLMo-2 7B's, Gemma 7B's), the cos and sin tables [s, d] it frees are off the estimate
    (``constants.tables_freed_by_layer0``; OLMo-2's fp32: 524,288 B over before, Gemma 7B's 524,288 B).
    Under checkpointing the int64 [s] position ids the checkpointed layers hold are modelled
    (``constants.checkpointed_position_ids``; +8·s before)."""
    return -2 if setup.model.code_family.value.startswith("gemma") else 0


@pytest.mark.parametrize(("preset", "attention", "checkpointing"), CASES)
def test_layer_and_final_norm_moments(preset: str, attention: str, checkpointing: str) -> None:
    setup = hf_setup(preset, seq=512, attention=attention, checkpointing=checkpointing)
    est = estimated_moments(estimate(setup))
    measured, buffers = measure_hf_peak(setup)
    layer, final = measured["layer backward"], measured["final norm backward"]
    assert layer is not None and final is not None
    assert layer - buffers - est["layer backward"] == known(setup)
    # the final norm's: the labels' 8 B at one sequence a micro-batch (hf_peak's NB)
    assert final - buffers - est["final norm backward"] == known(setup) - 8
