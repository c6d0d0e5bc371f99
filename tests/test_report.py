"""render/estimate.py: unit formatting and the rendered tables, on a console of pinned width."""

from __future__ import annotations

import io

import pytest
from rich.console import Console, RenderableType

from memplan.analytic.params import count_params
from memplan.blocks.inventory import Scope
from memplan.config import Attention, Checkpointing, Setup, StrategyConfig, TrainingConfig
from memplan.engine import Result, estimate
from memplan.presets import gpu_names, load_gpu, load_model_preset, model_names
from memplan.render import estimate as report
from memplan.render import presets as presets_report


def render(renderable: RenderableType, width: int = 120) -> str:
    console = Console(width=width, file=io.StringIO(), color_system=None, legacy_windows=False)
    console.print(renderable)
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert isinstance(out, str)
    return out


def make(preset: str, **training: int) -> Result:
    return estimate(Setup(model=load_model_preset(preset).model, training=TrainingConfig(**training)))


# ----------------------------------------------------------------------------------------------------
# Units: binary bytes (GiB = 2³⁰), decimal FLOPs and counts
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1,023 B"),
        (1 << 10, "1.00 KiB"),
        (3 << 20, "3.00 MiB"),
        (1 << 30, "1.00 GiB"),
        (1536 << 30, "1,536.00 GiB"),  # stays in GiB, the unit stated
    ],
)
def test_fmt_bytes(n: int, text: str) -> None:
    assert report.fmt_bytes(n) == text


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 FLOP"),
        (2 * 10**9, "2.00 GFLOP"),
        (17_214_228_922_368, "17.21 TFLOP"),
        (4_031_874_779_316_224, "4.03 PFLOP"),
    ],
)
def test_fmt_flops(n: int, text: str) -> None:
    assert report.fmt_flops(n) == text


def test_fmt_count_and_shape() -> None:
    assert report.fmt_count(70_553_706_496) == "70.55 B"
    assert report.fmt_count(124_439_808) == "124.44 M"
    assert report.fmt_count(64) == "64"
    assert report.fmt_shape((1, 64, 8192, 128)) == "[1, 64, 8192, 128]"
    assert report.fmt_shape(()) == "scalar"


# ----------------------------------------------------------------------------------------------------
# Summary and memory bar
# ----------------------------------------------------------------------------------------------------
GLYPHS = "█▓▒░▞"


def bar_line(text: str) -> str:
    return next(
        line.strip("│ ")
        for line in text.splitlines()
        if line.strip("│ ") and set(line.strip("│ ")) <= set(GLYPHS)
    )


def test_summary_panel_states_model_params_setup_and_units() -> None:
    e = make("llama-3-70b", seq_len=8192)
    text = render(report.summary_panel(e))
    assert "llama-3-70b" in text
    assert "70,553,706,496" in text
    assert "GiB = 2³⁰ bytes" in text
    assert e.peak.phase in text
    assert report.fmt_bytes(e.peak.bytes) in text
    for phase, value in e.peak.phases.items():
        assert f"{phase} {report.fmt_bytes(value)}" in text


def test_bar_segments_are_proportional_to_the_bytes() -> None:
    e = make("llama-3-70b", seq_len=8192)
    bar = bar_line(render(report.memory_bar(e)))
    assert len(bar) == report.BAR_WIDTH
    st = e.states
    parts = [st.weights, st.gradients, st.optimizer, e.activations]
    # Peak (loss backward, gradients not yet made) < all four: no transient segment.
    assert e.peak.bytes < sum(parts)
    assert bar.count("▞") == 0
    for glyph, value in zip(GLYPHS, parts, strict=False):
        assert abs(bar.count(glyph) - value * report.BAR_WIDTH / sum(parts)) <= 1


def test_bar_shows_the_peak_transient_when_the_peak_exceeds_the_parts() -> None:
    # GPT-2 at 64 × 1024 tokens: the fp32 loss-backward buffers (8·T·v bytes) dwarf the gradients.
    e = make("gpt2", seq_len=1024, micro_batch=64)
    parts = e.states.weights + e.states.gradients + e.states.optimizer + e.activations
    assert e.peak.bytes > parts
    text = render(report.memory_bar(e))
    assert f"peak transient {report.fmt_bytes(e.peak.bytes - parts)}" in text
    bar = bar_line(text)
    assert len(bar) == report.BAR_WIDTH and bar.endswith("▞")


# ----------------------------------------------------------------------------------------------------
# Activation and FLOPs tables
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "strategy",
    [
        StrategyConfig(),
        StrategyConfig(attention=Attention.EAGER),
        StrategyConfig(checkpointing=Checkpointing.FULL),
        StrategyConfig(reversible=True),
    ],
)
def test_activation_table_lists_every_tensor_and_the_totals(strategy: StrategyConfig) -> None:
    model = load_model_preset("tiny").model
    e = estimate(Setup(model=model, training=TrainingConfig(seq_len=128), strategy=strategy))
    text = render(report.activation_table(e), width=200)
    for k in e.tensors:
        assert k.name in text
        assert report.fmt_shape(k.shape) in text  # brackets are data, never rich markup
    assert f"{e.activations:,} bytes" in text
    assert report.fmt_bytes(e.per_layer) in text
    assert ("per layer" in text) == any(k.scope is Scope.LAYER for k in e.tensors)


def test_flops_table_rows() -> None:
    e = make("llama-3-70b", seq_len=8192, grad_accum=8)
    text = render(report.flops_table(e), width=200)
    f = e.flops
    for value in (f.forward, f.backward, f.recompute, f.total, f.model, e.six_n, f.total * 8, f.model * 8):
        assert f"{value:,}" in text
    assert f"{f.model / e.six_n:.3f}×" in text
    assert "[tokens, vocab]" in text  # not eaten as markup


# ----------------------------------------------------------------------------------------------------
# Presets
# ----------------------------------------------------------------------------------------------------
def test_preset_tables_render() -> None:
    presets = [load_model_preset(n) for n in model_names()]
    text = render(presets_report.presets_table(presets), width=200)
    assert all(p.name in text for p in presets)
    preset = load_model_preset("gpt2")
    detail = render(presets_report.preset_detail(preset, count_params(preset.model)), width=200)
    assert "124,439,808" in detail and "matches" in detail
    gpus = render(presets_report.gpus_table([load_gpu(n) for n in gpu_names()]), width=200)
    assert all(n in gpus for n in gpu_names())
