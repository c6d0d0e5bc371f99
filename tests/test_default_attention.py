"""``--attention`` when not given: flash, or eager where the model's code runs no flash path memplan models
(``config.no_flash``: transformers' Gemma-2 softcaps and gpt-oss sinks have no SDPA path; torch's CUDA
SDPA runs DeepSeek's MLA in its memory-efficient kernel, not modelled), with a note. Before, ``memplan
estimate -m gemma-2-2b`` (every option at its default) stopped with "use --attention eager"."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memplan.cli.app import app

runner = CliRunner(env={"COLUMNS": "120", "NO_COLOR": "1"})


def _estimate(*args: str) -> dict:  # type: ignore[type-arg]
    r = runner.invoke(app, ["estimate", "--seq", "1024", *args, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("model", "device", "chosen"),
    [
        ("gemma-2-2b", "cuda", "eager"),  # softcaps
        ("gpt-oss-20b", "cuda", "eager"),  # sinks
        ("deepseek-v2-lite", "cuda", "eager"),  # MLA on CUDA
        ("deepseek-v2-lite", "cpu", "flash"),  # MLA on CPU: torch's math path, modelled
        ("llama-3.2-1b", "cuda", "flash"),
    ],
)
def test_the_default_attention_is_one_the_models_code_runs(model: str, device: str, chosen: str) -> None:
    doc = _estimate("-m", model, "--device", device)
    assert doc["setup"]["attention"] == chosen
    notes = [n for n in doc["notes"] if n.startswith("attention: eager chosen")]
    assert len(notes) == (chosen == "eager"), notes
    # given, it is taken as given: flash where the code runs none is the rule's one line
    for given in ("eager", "flash"):
        r = runner.invoke(
            app, ["estimate", "-m", model, "--seq", "1024", "--device", device, "--attention", given]
        )
        if given == "flash" and chosen == "eager":
            lines = r.output.strip().splitlines()
            assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: attention:"), r.output
        else:
            assert r.exit_code == 0, r.output
            assert "attention: eager chosen" not in r.output
