"""The peak's smaller rules by hand (analytic/peak.py), in the fast, torch-free suite the mutation run uses
(docs/mutation.md); tests/measure/test_peak.py measures the moments they feed (torch).

T = b·s tokens, h the width.
"""

from __future__ import annotations

import pytest

from memplan.analytic import peak as pk
from memplan.config import Device, ModelConfig, Precision, Setup, TrainingConfig

B, S, H = 2, 64, 64
T = B * S


def setup(norm: str, precision: Precision) -> Setup:
    model = ModelConfig(
        hidden_size=H, num_layers=4, num_heads=4, ffn_size=160, vocab_size=1000, norm=norm, max_positions=S
    )
    return Setup(
        model=model,
        training=TrainingConfig(micro_batch=B, seq_len=S, precision=precision),
        device=Device.CPU,
    )


@pytest.mark.parametrize(
    ("norm", "precision", "shared"),
    [
        # LayerNorm saves its input as it is: the checkpoint's kept [T, h] storage, not a new one.
        ("layernorm", Precision.BF16_MIXED, 2 * T * H),
        ("layernorm", Precision.FP32, 4 * T * H),
        # Llama's RMSNorm upcasts a 16-bit input to fp32 first and saves the upcast: a new storage ...
        ("rmsnorm", Precision.BF16_MIXED, 0),
        # ... but an fp32 input is saved itself.
        ("rmsnorm", Precision.FP32, 4 * T * H),
    ],
)
def test_a_rerun_segment_counts_the_kept_input_once(norm: str, precision: Precision, shared: int) -> None:
    """n re-run layers are n working sets less the first norm's input when that is the kept checkpoint:
    rerun(2) − 2·rerun(1) = shared; nothing re-runs for no layer."""
    s = setup(norm, precision)
    assert pk.segment_rerun_bytes(s, 0) == 0
    assert pk.segment_rerun_bytes(s, 2) - 2 * pk.segment_rerun_bytes(s, 1) == shared
