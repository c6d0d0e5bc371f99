"""Start-up of ``memplan estimate`` (issue #13 item 7): what it imports, and that the shortcuts taken for
speed change nothing a user sees.

- ``memplan estimate`` runs in a fresh interpreter through the console script's ``main()``; afterwards
  ``sys.modules`` must hold no torch, matplotlib, measurement, search or other commands' modules (and,
  with ``--json``, no rich console or tables);
- ``cli.common.only_invoked`` (the app narrowed to the invoked command) answers exactly as the whole app;
- ``presets._aliases`` (aliases read without validating the preset) equals the validated presets' own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from memplan.cli.app import app
from memplan.cli.common import only_invoked
from memplan.presets import _aliases, _shipped_gpu, _shipped_model, gpu_names, model_names

ENV = {"COLUMNS": "120", "NO_COLOR": "1"}
runner = CliRunner(env=ENV)

# Run as the console script does (memplan.cli.app:main), then list what got imported.
_PROBE = """
import json, sys
sys.argv = ["memplan", *json.loads(sys.argv[1])]
from memplan.cli.app import main
try:
    main()
except SystemExit as exc:
    assert not exc.code, exc.code
print(json.dumps(sorted(sys.modules)), file=sys.stderr)
"""

# Prefixes of modules `memplan estimate` never needs: torch and plotting, the measurement, the search and
# the other commands' computing and rendering. (memplan.timeline is needed: the allocator's replay of the
# step, memplan.reserved, walks its points.)
NEVER = (
    "torch",
    "matplotlib",
    "numpy",
    "transformers",
    "memplan.measure",
    "memplan.search.fit",
    "memplan.render.fit",
    "memplan.render.measure",
    "memplan.render.timeline",
    "memplan.schema",
    "memplan.presets.hf",
    "rich.progress",
)
RICH_TABLES = ("rich.console", "rich.table", "rich.panel", "memplan.render")


def imported_by(*args: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, json.dumps(args)],
        capture_output=True,
        text=True,
        env={**os.environ, **ENV},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stderr.strip().splitlines()[-1])


def _loaded(modules: list[str], prefixes: tuple[str, ...]) -> list[str]:
    return [m for m in modules if any(m == p or m.startswith(p + ".") for p in prefixes)]


def test_estimate_imports_nothing_it_does_not_show() -> None:
    modules = imported_by("estimate", "--model", "70b", "--seq", "8192")
    assert "memplan.render.plan" in modules  # the probe saw the table drawn
    assert _loaded(modules, NEVER) == []


def test_estimate_json_imports_no_rich_tables() -> None:
    modules = imported_by("estimate", "--model", "70b", "--seq", "8192", "--json")
    assert "memplan.contract" in modules
    assert _loaded(modules, NEVER + RICH_TABLES) == []


@pytest.mark.parametrize(
    "args",
    [
        ["estimate", "--model", "70b", "--seq", "8192"],
        ["estimate", "--model", "70b", "--seq", "8192", "--json"],
        ["estimate", "--model", "gpt2", "--tp", "3"],  # a user mistake: one line, exit 2
        ["estimate", "--modle", "gpt2"],  # click's usage error, with its suggestion
        ["estimate", "--help"],
        ["plan", "--help"],
        ["compare", "--help"],
        ["presets", "show", "70b"],
        ["presets"],
        ["gpus"],
        ["schema", "--keys"],
        ["--help"],
        ["--version"],
        ["estimat", "--model", "70b"],  # an unknown command: the whole app suggests
        [],
    ],
    ids=lambda a: " ".join(a) or "no args",
)
def test_only_invoked_answers_as_the_whole_app(args: list[str]) -> None:
    whole = runner.invoke(app, args, prog_name="memplan")
    narrow = runner.invoke(only_invoked(app, args), args, prog_name="memplan")
    assert (narrow.exit_code, narrow.output) == (whole.exit_code, whole.output)


def test_only_invoked_keeps_one_command() -> None:
    narrow = only_invoked(app, ["estimate", "--model", "70b"])
    assert [c.name for c in narrow.registered_commands] == ["estimate"]
    assert narrow.registered_groups == []
    assert len(app.registered_commands) > 1  # the app itself is untouched
    assert only_invoked(app, ["--help"]) is app


def test_aliases_read_without_validation_equal_the_presets() -> None:
    for name in model_names():
        assert _aliases("models", name) == _shipped_model(name).aliases, name
    for name in gpu_names():
        assert _aliases("gpus", name) == _shipped_gpu(name).aliases, name
