"""``fit --expandable-segments``: the search judges memory with the allocator the user runs.

torchtitan's launch script sets ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, and ``estimate
--expandable-segments`` replays the step through that allocator; ``fit`` took no such option, so a user of
that stack was told by ``fit`` that a layout does not fit which ``estimate`` (and the verdict's own ``fit``
suggestion) said fits, or the other way round. The search now judges each candidate (``budget.fits``),
each listed row (``Config.verdict``), each rejected family and the longest sequence with that allocator, and
every row's command repeats the option.
"""

from __future__ import annotations

import json
import shlex
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # (no stubs installed)
from typer.testing import CliRunner

from memplan.cli.app import app
from memplan.schema import command_schema

runner = CliRunner()

SPACE = (
    "-m 8b --seq 4096 --gpus 16 --gpu h100-sxm --global-batch 64 --checkpointing none --micro-batches 2 "
    "--zero 1 --tp-max 1"
)
ROW = (
    "estimate -m 8b --seq 4096 --gpu h100-sxm --gpus 16 --global-batch 64 --batch 2 --tp 1 --pp 1 --cp 2 "
    "--zero 1 --hsdp 4 --checkpointing none --attention flash"
)
"""The fastest row of ``fit SPACE`` (8B at 4,096 tokens on 16 H100s, cp 2 and HSDP over 4)."""


def run_json(command: str) -> dict[str, Any]:
    out = runner.invoke(app, shlex.split(command))
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert isinstance(doc, dict)
    return doc


def _layout(c: dict[str, Any]) -> str:
    """A row's layout and micro-batch, from its command (before the options it repeats: ``--reserve``)."""
    return str(c["command"]).split("--global-batch 64 ")[1].split(" --reserve")[0]


def test_fit_judges_with_the_allocator_the_user_runs() -> None:
    grown = run_json(f"{ROW} --expandable-segments --json")
    # expandable segments reserve about the allocated peak here (one growing segment per pool); with
    # --reserve leaving 64 MiB above that, the default allocator, even at that capacity (releasing its
    # cached segments), does not fit the row: the estimates say so, and fit must agree with each
    reserve = f"{(grown['fit']['headroom'] - 64 * 2**20) / 2**30:.4f}"
    assert run_json(f"{ROW} --reserve {reserve} --expandable-segments --json")["fit"]["fits"] is True
    assert run_json(f"{ROW} --reserve {reserve} --json")["fit"]["fits"] is False
    default = run_json(f"fit {SPACE} --reserve {reserve} --top 0 --json")
    expandable = run_json(f"fit {SPACE} --reserve {reserve} --expandable-segments --top 0 --json")
    assert default["expandable_segments"] is False and expandable["expandable_segments"] is True
    jsonschema.validate(expandable, command_schema("fit"))
    row = ROW.split("--global-batch 64 ")[1]
    assert row not in {_layout(c) for c in default["configs"]}
    assert row in {_layout(c) for c in expandable["configs"]}
    # each listed row: its command carries the option and its estimate judges as the row does
    for c in expandable["configs"][:3]:
        assert c["command"].endswith(f"--reserve {reserve} --expandable-segments")
        again = run_json(c["command"].removeprefix("memplan ") + " --json")
        assert again["memory"]["allocator"]["expandable_segments"] is True
        assert again["fit"]["reserved_peak"] == c["fit"]["reserved_peak"]
        assert again["fit"]["fits"] is c["fit"]["fits"] is True
