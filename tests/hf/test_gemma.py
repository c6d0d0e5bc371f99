"""transformers' Gemma (``modeling_gemma.py``) against ``--impl hf``: SDPA and eager, with and without
transformers' gradient checkpointing (reentrant and not), at Gemma-2B's widths (MQA: kv = 1, head_dim 256)
and Gemma-7B's (MHA). Both read from the published config.json through the importer: GeGLU, the √h
embedding scale, the fp32 (1 + w) RMSNorm."""

from __future__ import annotations

from typing import Any

import pytest

from memplan.config import Attention, Device, ModelConfig, Setup, StrategyConfig, TrainingConfig
from memplan.engine import estimate
from memplan.measure.compare.tensors import compare
from memplan.measure.runs.run import measure
from memplan.presets.hf import model_from_hf_config
from tests.hf.harness import check_hf, hf_setup
from tests.test_hf_config import GEMMA_2B

# huggingface.co/google/gemma-7b/blob/main/config.json (the keys that differ from gemma-2b's)
GEMMA_7B: dict[str, Any] = GEMMA_2B | {
    "hidden_size": 3072,
    "intermediate_size": 24576,
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 16,
}


@pytest.mark.parametrize(
    ("config", "attention", "checkpointing", "reentrant"),
    [
        (GEMMA_2B, "flash", "none", False),
        (GEMMA_2B, "eager", "full", True),
        (GEMMA_7B, "eager", "none", False),
        (GEMMA_7B, "flash", "full", False),
    ],
)
def test_gemma(config: dict[str, Any], attention: str, checkpointing: str, reentrant: bool) -> None:
    model = model_from_hf_config(config, "gemma")
    check_hf(hf_setup(model, seq=256, attention=attention, checkpointing=checkpointing, reentrant=reentrant))


@pytest.mark.parametrize("attention", [Attention.FLASH, Attention.EAGER])
def test_reference_runs_geglu_and_the_embedding_scale(attention: Attention) -> None:
    """Gemma's structure under ``--impl reference``: memplan's reference model runs the tanh-GELU gate and
    the √h scale (a Python float); its saves and FLOPs equal the estimate's, tensor by tensor."""
    model = ModelConfig(
        name="geglu",
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=1,
        ffn_size=48,
        vocab_size=96,
        tied_embeddings=True,
        gate_act="gelu_tanh",
        embed_scale=True,
    )
    setup = Setup(
        model=model,
        training=TrainingConfig(micro_batch=2, seq_len=12),
        strategy=StrategyConfig(attention=attention),
        device=Device.CPU,
    )
    c = compare(estimate(setup), measure(setup, fake=False))
    assert [r.name for r in c.tensors if not r.equal] == []
    assert [(r.name, r.est_bytes) for r in c.flops] == [(r.name, r.meas_bytes) for r in c.flops]
    assert c.equal
