"""transformers' GPT-2 (``modeling_gpt2.py``, GPT-2 124M's widths) and GPT-NeoX (``modeling_gpt_neox.py``,
Pythia-1B's widths: partial rotary 0.25, parallel residual) against ``--impl hf``: SDPA and eager, with
and without transformers' gradient checkpointing, with the model's own dropout and the other setting
(GPT-2: 0.1 everywhere, and 0; Pythia: 0, and 0.1), the KV cache on (transformers' default) and off."""

from __future__ import annotations

import pytest

from memplan.config import Gelu, MlpType, ModelConfig, NormType, PositionType
from tests.grids import pairwise_cases
from tests.hf.harness import check_hf, hf_setup

PYTHIA_1B = ModelConfig(
    # EleutherAI/pythia-1b config.json: hidden_size 2048, num_attention_heads 8, intermediate_size 8192,
    # vocab_size 50304, rotary_pct 0.25, use_parallel_residual true, hidden_act gelu, untied; 16 layers
    # (cut to 2 here). Its 805,736,448 non-embedding parameters (the Pythia model card) check the widths.
    name="pythia-1b",
    hidden_size=2048,
    num_layers=16,
    num_heads=8,
    ffn_size=8192,
    vocab_size=50304,
    norm=NormType.LAYERNORM,
    mlp=MlpType.GELU,
    gelu=Gelu.GELU,
    qkv_bias=True,
    out_bias=True,
    mlp_bias=True,
    position=PositionType.ROPE,
    max_positions=2048,
    rotary_pct=0.25,
    parallel_residual=True,
    family="gpt_neox",
)

DROPOUTS = ("attn_dropout", "resid_dropout", "embd_dropout")


def dropout(p: float) -> dict[str, float]:
    return dict.fromkeys(DROPOUTS, p)


@pairwise_cases(
    "model, attention, checkpointing, p",
    ["gpt2", PYTHIA_1B],
    ["flash", "eager"],
    ["none", "full"],
    [0.1, 0.0],
)
def test_gpt(model: str | ModelConfig, attention: str, checkpointing: str, p: float) -> None:
    setup = hf_setup(model, seq=256, attention=attention, checkpointing=checkpointing, **dropout(p))
    check_hf(setup)


@pytest.mark.parametrize("model", ["gpt2", PYTHIA_1B], ids=["gpt2", "pythia-1b"])
@pytest.mark.parametrize("attention", ["flash", "eager"])
def test_gpt_no_cache(model: str | ModelConfig, attention: str) -> None:
    """use_cache off, no dropout: k and v stay views of the fused projection output (no cache ``cat``)."""
    check_hf(hf_setup(model, seq=256, attention=attention, use_cache=False, **dropout(0.0)))


@pytest.mark.parametrize("model", ["gpt2", PYTHIA_1B], ids=["gpt2", "pythia-1b"])
def test_gpt_reentrant(model: str | ModelConfig) -> None:
    check_hf(hf_setup(model, seq=256, checkpointing="full", reentrant=True))


def test_pythia_params() -> None:
    """Pythia-1B's published non-embedding count: 805,736,448 (the Pythia model card)."""
    from memplan.analytic.params import count_params

    p = count_params(PYTHIA_1B)
    assert p.total - 2 * 50304 * 2048 == 805_736_448


@pytest.mark.parametrize("model", ["gpt2", PYTHIA_1B], ids=["gpt2", "pythia-1b"])
@pytest.mark.parametrize("attention", ["flash", "eager"])
def test_gpt_batch(model: str | ModelConfig, attention: str) -> None:
    """b = 2: eager ``torch.matmul`` copies the non-contiguous q/k/v views (b·a not mergeable) and the
    loss's shifted labels are a [b, s] copy."""
    check_hf(hf_setup(model, seq=128, batch=2, attention=attention, use_cache=False))


@pytest.mark.parametrize(
    ("model", "fields"),
    [
        ("gpt2", {"gelu": Gelu.GELU_PYTORCH_TANH}),  # F.gelu(approximate="tanh"): its input alone
        (PYTHIA_1B, {"rotary_pct": 1.0, "parallel_residual": False}),  # sequential, fully rotary
    ],
    ids=["gpt2-gelu_pytorch_tanh", "neox-sequential-full-rotary"],
)
@pytest.mark.parametrize("attention", ["flash", "eager"])
def test_gpt_variants(model: str | ModelConfig, fields: dict[str, object], attention: str) -> None:
    check_hf(hf_setup(model, seq=256, attention=attention, **dropout(0.0), **fields))
