"""``trace --impl hf`` builds transformers' model from the user's own config.json, every key of it
(``hf_config_of_file``), not from what memplan read of it: a key memplan misreads or does not read reaches
transformers and shows up as a difference; the run's own options (``--no-use-cache``, ``--dropout``) still
apply on top."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import memplan.presets.hf as importer
import memplan.presets.hf.llama as llama_likes
from memplan.cli.app import app
from memplan.engine import estimate
from memplan.measure.frameworks.hf import measure_hf
from memplan.measure.frameworks.hf_config import hf_config, hf_config_of_file
from memplan.presets import hf_document, load_model_preset
from tests.hf.harness import hf_setup

# A Mistral at toy widths with a sliding window shorter than the traced sequence (64 tokens).
TINY_MISTRAL: dict[str, Any] = {
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 128,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 16,
    "tie_word_embeddings": False,
    "attention_dropout": 0.0,
}
SEQ = 64


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_MISTRAL))
    return path


def test_hf_document_is_the_file(config_file: Path) -> None:
    assert hf_document(str(config_file)) == TINY_MISTRAL
    assert hf_document("llama-3-8b") is None  # a shipped preset: no file to build from


def test_every_key_of_the_file_reaches_transformers(config_file: Path) -> None:
    """A key memplan never passes (``bos_token_id``) keeps the file's value; the run's options win where
    they change what memplan read (``use_cache`` off, attention dropout 0.1)."""
    doc = {**TINY_MISTRAL, "bos_token_id": 7, "use_cache": True}
    model = load_model_preset(str(config_file)).model
    setup = hf_setup(model, layers=2, seq=SEQ, use_cache=False, attn_dropout=0.1)
    config = hf_config_of_file(setup, doc)
    assert config.bos_token_id == 7 and hf_config(setup).bos_token_id != 7
    assert config.use_cache is False and config.attention_dropout == 0.1
    assert config.sliding_window == 16 and config.num_hidden_layers == 2


def test_a_misread_key_shows_up_in_the_trace(config_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """memplan made to misread ``sliding_window`` (read as none): built from memplan's model, transformers'
    run agrees with the wrong estimate (the error is invisible); built from the file, each layer keeps what
    a window shorter than the sequence costs under SDPA: the explicit [1, 1, 64, 64] bf16 mask
    (2·64·64 = 8,192 B) and k and v repeated from 2 to 4 heads (2 · 1·2·64·16 · 2 B = 8,192 B more):
    16,384 B per layer, 32,768 B for the 2 layers."""
    monkeypatch.setattr(llama_likes, "sliding_window", lambda kind, cfg, layers: None)
    model = load_model_preset(str(config_file)).model
    assert model.sliding_window is None  # the misreading
    setup = hf_setup(model, layers=2, seq=SEQ)
    est = estimate(setup).activations
    assert measure_hf(setup).activations == est  # rebuilt from memplan's model: blind to it
    from_file = measure_hf(setup, document=TINY_MISTRAL).activations
    mask, repeated = 2 * SEQ * SEQ, 2 * (1 * 2 * SEQ * 16) * 2
    assert from_file - est == 2 * (mask + repeated) == 32_768


def test_trace_cli_reads_the_file(config_file: Path) -> None:
    result = CliRunner().invoke(
        app, ["trace", "--impl", "hf", "-m", str(config_file), "--seq", str(SEQ), "--json"]
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["built_from"] == "config.json" and out["diff"]["exact"], out["diff"]["total"]
    preset = CliRunner().invoke(app, ["trace", "--impl", "hf", "-m", "tiny", "--seq", "16", "--json"])
    assert json.loads(preset.stdout)["built_from"] == "memplan's model"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        # Mixtral with the router's auxiliary loss on: every layer's router logits kept for it.
        (
            {
                "model_type": "mixtral",
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "output_router_logits": True,
            },
            "output_router_logits: the router's auxiliary (load-balancing) loss is not modelled; "
            "set it false in config.json",
        ),
        # Phi-4-mini's partial rotary (config.json: "partial_rotary_factor": 0.75, model_type phi3).
        (
            {"model_type": "phi3", "partial_rotary_factor": 0.75},
            "partial_rotary_factor: 0.75 (a partially rotated Phi-3) is not modelled for model_type phi3; "
            "use a config with partial_rotary_factor 1",
        ),
        (
            {"model_type": "phi3", "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
            "partial_rotary_factor: 0.5 (a partially rotated Phi-3)",
        ),
    ],
)
def test_unmodelled_keys_are_refused(extra: dict[str, Any], message: str) -> None:
    """A key whose effect memplan does not model is a one-line refusal, not silently dropped."""
    with pytest.raises(ValueError) as info:
        importer.model_from_hf_config({**TINY_MISTRAL, "sliding_window": None, **extra}, "x")
    assert str(info.value).startswith(f"hf config x: {message}"), str(info.value)


def test_hf_document_of_a_hub_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Hub id's cached config.json is the document trace builds from."""
    from tests.test_hub import fake_cache

    fake_cache(tmp_path / "hub", "org/tiny-mistral", {"config.json": TINY_MISTRAL})
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    assert hf_document("org/tiny-mistral") == TINY_MISTRAL
