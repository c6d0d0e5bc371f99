"""Tables that fit the terminal (issue #13): the rendered layout at 80, 120 and 200 columns.

Layout only — other tests assert the numbers. Each case is rendered as the CLI prints it (typer's
``CliRunner`` with ``COLUMNS`` pinned; ``fit`` directly, with its search time pinned) and compared with a
syrupy snapshot under tests/__snapshots__/ (``pytest --snapshot-update`` rewrites them after a deliberate
change of layout). The checks beside them hold at every width: no line wider than the terminal, no
number cut (``…`` after a digit, or anywhere), and the key columns — model names, tp/pp/dp, tensor names,
GPU and preset names — whole in their rows.
"""

from __future__ import annotations

import dataclasses
import io
import re
from functools import cache

import pytest
from rich.cells import cell_len
from rich.console import Console
from syrupy.assertion import SnapshotAssertion
from typer.testing import CliRunner

from memplan import compare as cmp
from memplan.api import Options, build, build_setup
from memplan.cli.app import app
from memplan.config import Checkpointing
from memplan.presets import gpu_names, load_gpu, model_names
from memplan.render.fit import fit_report
from memplan.search.fit import FitResult, Space, fit

WIDTHS = (80, 120, 200)
# One xdist worker runs this file (pyproject.toml's --dist loadgroup): the cached fit search below, which
# nine tests read, then runs once in the suite rather than once per worker.
pytestmark = pytest.mark.xdist_group("layout")

COMMANDS = {
    "estimate-70b": ("estimate", "-m", "70b", "--seq", "8192"),
    "estimate-layout": (
        "estimate",
        *("-m", "mixtral-8x7b", "--seq", "4096", "--tp", "2", "--sp", "--pp", "2", "--gpus", "32"),
        *("--gpu", "h100"),
    ),
    "compare-models-vary-tp": ("compare", "-m", "70b,gpt2", "--vary", "tp=1,4", "--gpus", "8"),
    "compare-models-gpu": (
        "compare",
        *("-m", "7b,70b,405b", "--seq", "4096", "--gpus", "64", "--zero", "3", "--gpu", "h100"),
    ),
    "compare-vary-two": (
        "compare",
        *("-m", "70b", "--vary", "checkpointing=none,selective,full", "--vary", "attention=eager,flash"),
        *("--gpu", "h100"),
    ),
    "gpus": ("gpus",),
    "presets": ("presets",),
}


@cache
def cli_output(name: str, width: int) -> str:
    result = CliRunner().invoke(app, list(COMMANDS[name]), env={"COLUMNS": str(width), "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    return result.stdout


@cache
def fit_result() -> FitResult:
    base = build_setup("70b", seq=4096)
    # A narrowed space: the layout of fit's tables is what is pinned here, and the full search still takes
    # ~9 s of CPU (docs/fit.md).
    space = Space(checkpointing=(Checkpointing.NONE, Checkpointing.FULL), micro_batches=(1, 2), vpp=(1, 2))
    result = fit(base, load_gpu("h100"), 64, space=space)
    return dataclasses.replace(result, seconds=0.5)  # the search's own time varies from run to run


def fit_output(width: int) -> str:
    console = Console(width=width, file=io.StringIO(), color_system=None, record=True)
    console.print(fit_report(fit_result(), top=5))
    return console.export_text()


def output(name: str, width: int) -> str:
    return fit_output(width) if name == "fit" else cli_output(name, width)


CASES = [*COMMANDS, "fit"]


def cells(line: str) -> list[str]:
    """The cells of one table row (``│ a │ b │``), stripped."""
    return [c.strip() for c in line.strip().strip("│").split("│")]


def rows(text: str) -> list[list[str]]:
    return [cells(line) for line in text.splitlines() if line.startswith("│") and line.count("│") > 2]


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", CASES)
def test_layout_snapshot(name: str, width: int, snapshot: SnapshotAssertion) -> None:
    assert output(name, width) == snapshot


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("name", CASES)
def test_nothing_is_cut_and_every_line_fits(name: str, width: int) -> None:
    text = output(name, width)
    wide = [line for line in text.splitlines() if cell_len(line) > width]
    assert not wide, f"{name} at {width} columns: lines wider than the terminal: {wide[:2]}"
    assert not re.search(r"\d…", text), f"{name} at {width} columns: a number is cut"
    assert "…" not in text, f"{name} at {width} columns: a cell is cut"


@pytest.mark.parametrize("width", WIDTHS)
def test_estimate_shows_every_tensor_name_whole(width: int) -> None:
    result = build(Options(model="70b", seq=8192)).result  # type: ignore[call-arg]
    first = {r[0] for r in rows(output("estimate-70b", width))}
    assert {k.name for k in result.tensors} <= first


@pytest.mark.parametrize("width", WIDTHS)
def test_compare_shows_the_settings_that_tell_rows_apart(width: int) -> None:
    # 70b and gpt2 default to different sequence lengths, and --gpus 8 leaves dp 8 at tp 1, dp 2 at tp 4:
    # columns say so; what every row shares is said once, above the table.
    text = output("compare-models-vary-tp", width)
    table = rows(text)
    assert table[0][:5] == ["70b", "1", "2048", "8", "8"]  # model, tp, seq, global batch, dp
    assert table[1][:5] == ["70b", "4", "2048", "2", "2"]
    assert table[2][:5] == ["gpt2", "1", "1024", "8", "8"]
    assert table[3][:5] == ["gpt2", "4", "1024", "2", "2"]
    header = text.split("┏")[0]
    assert "gpus 8" in header and "zero 0" in header
    assert "peak" in text and "GiB" in text  # the unit in the header
    base = {"gpus": 8}
    planned = cmp.rows(base, ["70b", "gpt2"], [("tp", ["1", "4"])])
    for line, row in zip(table, planned, strict=False):
        peak = row.built.result.device.peak.bytes
        assert f"{peak / 2**30:,.2f}" in line  # the peak, whole, in its row


@pytest.mark.parametrize("width", WIDTHS)
def test_compare_keys_are_never_left_out(width: int) -> None:
    table = rows(output("compare-vary-two", width))
    assert [r[:3] for r in table] == [
        ["70b", ckpt, attn] for ckpt in ("none", "selective", "full") for attn in ("eager", "flash")
    ]


@pytest.mark.parametrize("width", WIDTHS)
def test_presets_and_gpus_show_every_name_whole(width: int) -> None:
    assert {r[0] for r in rows(output("presets", width))} >= set(model_names())
    assert {r[0] for r in rows(output("gpus", width))} >= set(gpu_names())


@pytest.mark.parametrize("width", WIDTHS)
def test_fit_rows_are_numbered_and_their_layout_whole(width: int) -> None:
    text = fit_output(width)
    fitting = rows(text.split("Rejected families")[0])
    assert [r[0] for r in fitting] == ["1", "2", "3", "4", "5"]
    for row, config in zip(fitting, fit_result().fitting, strict=False):
        par = config.family.layout.parallel
        tp = f"{par.tp}" + ("+sp" if par.sp else "") + (f"·cp{par.cp}" if par.cp > 1 else "")
        pp = f"{par.pp}" + (f"×{par.vpp}" if par.vpp > 1 else "")
        hsdp = config.family.layout.hsdp
        dp = f"{config.family.layout.dp}" + (f"/{hsdp}" if hsdp else "")
        for key, value in (("tp", tp), ("pp", pp), ("dp", dp)):
            assert value in row or f"{key} {value}" in text  # a column, or said once for every row
