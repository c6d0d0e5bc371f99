"""The picture of the step (issue #13 item 5): the timeline's points are the estimate's own figures, the
terminal chart fits its width, and the plot file is written (or nothing is)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memplan.analytic.peak import TERMS
from memplan.api import build_setup
from memplan.cli.app import app
from memplan.engine import estimate
from memplan.render.timeline import timeline_chart
from memplan.timeline import timeline

runner = CliRunner(env={"COLUMNS": "100"})


@pytest.mark.parametrize("checkpointing", ["none", "full", "every-4"])
def test_points_are_the_estimates_figures(checkpointing: str) -> None:
    r = estimate(build_setup("70b", seq=8192, checkpointing=checkpointing))
    points = timeline(r)
    st = r.states
    resident = st.weights + st.optimizer
    # The forward starts with the states alone and the embedding's and constants' saves (ids, RoPE tables).
    start = points[0]
    assert start.terms["weights"] == st.weights and start.terms["gradients"] == 0
    assert 0 < start.terms["activations"] < 8 * 2**20
    # It grows by whole layers (or checkpointed segments) to every save at its end.
    end = next(p for p in points if p.label == "forward: end")
    assert end.bytes == resident + r.activations
    forward = [p.terms["activations"] for p in points if p.label.startswith("forward")]
    assert forward == sorted(forward)
    # Then the modelled moments, term by term, summing to the moments the estimate reports.
    moments = {p.label: p.bytes for p in points if not p.label.startswith("forward")}
    assert moments == r.peak.phases
    assert max(p.bytes for p in points) == r.peak.bytes
    assert all(list(p.terms) == list(TERMS) for p in points)


def test_gradient_accumulation_keeps_the_gradients_through_the_forward() -> None:
    r = estimate(build_setup("8b", seq=2048, grad_accum=4))
    assert all(p.terms["gradients"] == r.states.gradients for p in timeline(r)[:3])


@pytest.mark.parametrize(
    ("tp", "root", "block"),
    [
        # tiny on dp 2: the root (embedding, final norm, lm head) 2·256·64 + 64 el, a block 36,992 el
        (1, 32_832, 36_992),
        # on tp 2 + SP × dp 2, one tensor-parallel rank's: the vocabulary-parallel embedding and the
        # column-parallel head [128, 64] each, the norm replicated: 16,448 el; a block's norms 128 el
        # and half its linears' (12,288 + 24,576) / 2: 18,560 el (every dim 0 even: no FSDP2 padding)
        (2, 16_448, 18_560),
    ],
)
def test_the_2024_root_wrapping_holds_its_units_from_the_forward(tp: int, root: int, block: int) -> None:
    """torchtitan's 2024 FSDP2 wrapping (``--fsdp-wrap root``) gathers the root unit first and never
    reshards it, nor the top block after its forward: the forward's points hold them beside the shards
    (the allocator meets them before the loss's tensors), as the backward's moments do — the tensor-
    parallel rank's units under tp (the forward's points had counted the whole model's: at Llama 3.1
    70B's widths on tp 8 + SP, 3.4 GiB more at the forward's points than at the loss's backward, and
    4.8 GiB more reserved in the allocator's replay). By hand, tiny, bf16 (element counts above)."""
    from memplan.api import Options, build

    options = Options(model="tiny", seq=32, batch=2, impl="torchtitan", zero=3, dp=2, gpus=2 * tp)
    if tp > 1:
        options = options.model_copy(update={"tp": tp, "sp": True})
    r = build(options.model_copy(update={"fsdp_wrap": "root"})).result  # type: ignore[arg-type]
    points = {p.label: p for p in timeline(r)}
    root, block, shards = 2 * root, 2 * block, r.states.weights
    assert points["forward: start"].terms["weights"] == shards + root
    assert points["forward: 1/2 layers"].terms["weights"] == shards + root
    assert points["forward: end"].terms["weights"] == shards + root + block
    assert points["loss backward"].terms["weights"] == shards + root + block


def test_the_tied_unit_is_held_from_the_forward() -> None:
    """torchtitan's ZeRO-3 with a tied embedding (``analytic.fsdp.moments.zero3_tied``): the one unit
    [tok_embeddings, norm, lm_head] is gathered at the embedding's forward and never resharded before the
    embedding's backward, so every forward point holds it beside the shards, as the loss's backward does.
    By hand, tiny on dp 2: 256·64 + 64 = 16,448 el, bf16."""
    from memplan.config import Impl, ImplConfig
    from memplan.presets import load_model_preset

    tied = load_model_preset("tiny").model.model_copy(update={"tied_embeddings": True})
    r = estimate(build_setup(tied, seq=32, batch=2, zero=3, dp=2, impl=ImplConfig(impl=Impl.TORCHTITAN)))
    points = {p.label: p for p in timeline(r)}
    unit = 2 * 16_448
    for label in ("forward: start", "forward: 1/2 layers", "forward: end", "loss backward"):
        assert points[label].terms["weights"] == r.states.weights + unit, label


@pytest.mark.parametrize("width", [80, 120])
def test_chart_fits_its_width(width: int) -> None:
    r = estimate(build_setup("70b", seq=8192))
    from rich.console import Console

    console = Console(width=width, record=True)
    console.print(timeline_chart(timeline(r), width))
    lines = console.export_text().splitlines()
    assert all(len(line) <= width for line in lines)
    assert sum("◀ peak" in line for line in lines) == 1


def test_cli_timeline_json_and_plot(tmp_path: Path) -> None:
    svg = tmp_path / "step.svg"
    result = runner.invoke(app, ["estimate", "-m", "tiny", "--timeline", "--plot", str(svg), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["timeline"][-1]["label"] == "optimizer step"
    assert doc["timeline"][-1]["bytes"] == doc["memory"]["phases"]["optimizer step"]
    assert svg.read_text().lstrip().startswith("<?xml") and "<svg" in svg.read_text()


def test_plot_refuses_before_any_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "no" / "such" / "folder" / "step.png"
    result = runner.invoke(app, ["estimate", "-m", "tiny", "--plot", str(missing)])
    assert result.exit_code == 2 and "plot:" in result.stderr and not missing.parent.exists()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the plot extra were not installed
    result = runner.invoke(app, ["estimate", "-m", "tiny", "--plot", str(tmp_path / "a.png")])
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: plot: matplotlib is not installed; pip install 'memplan[plot]'"
    assert not (tmp_path / "a.png").exists()


@pytest.mark.parametrize("name", ["step.txt", "step", "step.svg.bak"])
def test_plot_refuses_a_name_without_a_plot_format(tmp_path: Path, name: str) -> None:
    # matplotlib would refuse .txt with a traceback-worded message and write PNG bytes under "step".
    result = runner.invoke(app, ["estimate", "-m", "tiny", "--plot", str(tmp_path / name)])
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        f"error: plot: {tmp_path / name} does not end in .svg, .png, .pdf; "
        "name the format, e.g. --plot step.svg"
    )
    assert list(tmp_path.iterdir()) == []


def test_forward_points_never_negative_under_lora_and_activation_offload() -> None:
    """Found by tests/test_json_outputs.py: the forward's start was the activations less L × the largest
    layer's bytes, negative under LoRA (its layers keep different bytes along the gradient flow) and under
    --offload activations (nothing stays on the GPU, yet L layers' saves were subtracted)."""
    from memplan.api import Options, build

    lora = build(Options(model="gpt2", seq=16, finetune="lora")).result
    points = timeline(lora)
    forward = [p for p in points if p.label.startswith("forward")]
    acts = [p.terms["activations"] for p in forward]
    # LoRA freezes the embeddings: the lookup keeps no token ids (no scatter-add into a frozen table) and
    # nothing is kept before the first layer.
    assert acts[0] == 0
    assert acts == sorted(acts)
    assert acts[-1] == lora.device.activations
    offloaded = build(Options(model="gpt2", seq=16, offload="activations")).result
    # every save is copied to the host as it is made: the GPU holds none at any forward point
    offloaded_forward = [p for p in timeline(offloaded) if p.label.startswith("forward")]
    assert offloaded_forward and all(p.terms["activations"] == 0 for p in offloaded_forward)
