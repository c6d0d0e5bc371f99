"""The layer backward of transformers' LayerNorm families under full training, at their real widths (two
layers, s 512, fake tensors): the highest point measured (``measure.frameworks.hf_peak``) against the
estimate's.

Before, each read under the measured top of its layer's backward (none / full checkpointing):
- GPT-2: 1,966,080 / 1,967,616 B. ``NewGELUActivation``'s last product ``(0.5·x)·(1 + tanh(·))`` makes two
  [T, f] operand gradients beside d(down input), and the residual dropout's CPU noise [T, h] is freed by
  then (``blocks.mlp.gradient_buffers``, ``python_gelu_mask``).
- Falcon-7B: 9,287,936 / 9,423,104 B. Its one norm feeds both branches: W_QKV's dX matmul, with the fused
  output gradient [T, (a + 2)·d], the norm's output and the MLP's input gradient waiting to be summed,
  tops the layer (``analytic.moments.qkv_backward.parallel_shared_qkv``).
- StableLM 2 1.6B: 4,153,344 / 4,186,112 B. W_Q's backward, the last of its three projections, above
  LayerNorm's (``analytic.moments.qkv_backward.q_input_gradient``).

Without checkpointing the rotary tables' cos and sin [s, rot] (bf16), which layer 0's rotary backward frees
before the moment that tops it (``constants.tables_freed_by_layer0``): 4·rot B a token over before (Falcon's
131,072 B, StableLM's 32,768 B), exact now. Under checkpointing the int64 [s] position ids the
checkpointed layers hold where the layers take rotary positions (GPT-2's learned positions are added
before its layers: none) are modelled (``constants.checkpointed_position_ids``; 8·s B under before)."""

from __future__ import annotations

import pytest

from memplan.config import Setup
from memplan.engine import estimate
from memplan.measure.frameworks.hf_peak import measure_hf_peak
from memplan.measure.instruments.moments import estimated_moments
from tests.hf.harness import hf_setup

CASES = [
    hf_setup(name, seq=512, checkpointing=checkpointing)
    for name in ("gpt2", "falcon-7b", "stablelm-2-1.6b")
    for checkpointing in ("none", "full")
]


def case_id(setup: Setup) -> str:
    return f"{setup.model.name}-{setup.strategy.checkpointing.name.lower()}"


@pytest.mark.parametrize("setup", CASES, ids=case_id)
def test_layer_backward_is_transformers(setup: Setup) -> None:
    est = estimated_moments(estimate(setup))
    measured, buffers = measure_hf_peak(setup)
    layer = measured["layer backward"]
    assert layer is not None
    assert layer - buffers - est["layer backward"] == 0
