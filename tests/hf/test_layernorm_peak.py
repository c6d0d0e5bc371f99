"""The layer backward of transformers' LayerNorm families under full training, at their real widths (two
layers, s 512, fake tensors): the highest point measured (``measure.frameworks.hf_peak``) against the
estimate's.

Before, each read under the measured top of its layer's backward (none / full checkpointing):
- GPT-2: 1,966,080 / 1,967,616 B. ``NewGELUActivation``'s last product ``(0.5·x)·(1 + tanh(·))`` makes two
  [T, f] operand gradients beside d(down input), and the residual dropout's CPU noise [T, h] is freed by
  then (``blocks.mlp.gradient_buffers``, ``python_gelu_mask``).
- Falcon-7B: 9,287,936 / 9,423,104 B. Its one norm feeds both branches: W_QKV's dX matmul, with the fused
  output gradient [T, (a + 2)·d], the norm's output and the MLP's input gradient waiting to be summed,
  tops the layer (``analytic.moments.qkv_backward.parallel_fused_qkv``).
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
from tests.hf.harness import hf_moment_deltas, hf_setup

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


@pytest.mark.parametrize(("seq", "checkpointing"), [(2048, "none"), (1024, "full")])
def test_falcons_long_sequence_tops_at_its_attention_core(seq: int, checkpointing: str) -> None:
    """Falcon-7B at longer sequences: the attention core's backward tops the layer (its fused LayerNorm's
    backward is small beside Llama's op-by-op RMSNorm chain), with dq, dk and dv of [T, a·d] each — k and v
    reach SDPA repeated to the 71 heads (transformers passes Falcon's mask always: ``repeat_kv``, an
    expand view of the one kv head, whose gradient the kernel returns whole: ``core.sdpa_kv_heads``) — and
    the MLP branch's input gradient [T, h] waiting for W_QKV's dX (the one norm for both branches,
    ``layer_backward.attention_backward_transient``). Before: 41,295,872 B under at s 2,048 (2 · [T, 70·d]
    for dk, dv at one head, and the waiting [T, h]), 6,590,464 B under at s 1,024 with full checkpointing."""
    setup = hf_setup("falcon-7b", seq=seq, checkpointing=checkpointing)
    delta = hf_moment_deltas(setup)
    assert delta["layer backward"] == 0, delta
    assert all(-8 <= d <= 0 for d in delta.values()), delta


@pytest.mark.parametrize("attention", ["flash", "eager"])
@pytest.mark.parametrize("seq", [1024, 4096])
def test_falcon_40bs_mlp_gradient_waits_for_ln_mlp(attention: str, seq: int) -> None:
    """Falcon-40B's new decoder architecture runs both norms, ``ln_attn`` and ``ln_mlp``, on the layer
    input before the attention: in backward the MLP's input gradient [T, h] waits in ``ln_mlp``'s output
    buffer through the attention's backward and W_QKV's dX, as Falcon-7B's through its one norm
    (``qkv_backward.mlp_gradient_waits``, ``parallel_fused_qkv``), and ``ln_mlp``'s backward runs after
    them: its saves still held, its weight and bias gradients not made (``layer_backward.
    mlp_norm_not_run``). The layer's top — W_QKV's dX at s 1,024, the attention core at s 4,096 — was
    35,590,144 B under at s 1,024 under flash (16,748,544 B eager) and 67,092,480 B at s 4,096; then, with
    the waiting gradient alone, 32,768 − 4·T B over; exact now (and under full checkpointing, checked)."""
    setup = hf_setup("falcon-40b", seq=seq, attention=attention)
    from memplan.analytic.moments.layer_backward import mlp_norm_not_run

    assert mlp_norm_not_run(setup, estimate(setup).pieces.params) == 4 * seq - 2 * 2 * 8192  # rstd; w, b
    delta = hf_moment_deltas(setup)
    assert delta["layer backward"] == 0, delta
