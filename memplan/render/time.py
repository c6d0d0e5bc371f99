"""Rendering of the step time and the communication table (``memplan estimate --gpu``): formatting only,
every figure computed in ``memplan.time``. Units: seconds, bytes in binary units (MiB = 2²⁰), FLOPs in
decimal (TFLOP = 10¹²)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from memplan.render.estimate import FLOP_UNITS, fmt_bytes, fmt_count, fmt_flops, fmt_int, plural
from memplan.render.fitted import Col, Fitted

if TYPE_CHECKING:
    from memplan.time.predict import Prediction
    from memplan.time.timing import Timing

_BASIS = {
    "predicted": "predicted: kernels at their achievable peak + exposed communication + bubble + optimizer",
    "measured": "measured (--step-time)",
}


def _seconds(s: float) -> str:
    return f"{s * 1e3:,.1f} ms" if s < 1 else f"{s:,.2f} s"


_PARTS = {
    "attention": "QKᵀ and P·V, forward and backward",
    "element-wise": "norms, residuals, activations: bytes / HBM",
    "launch gaps": "per kernel of eager element-wise code (unfused)",
    "dequantize": "QLoRA's 4-bit weights to the compute dtype, per linear, forward and dX: bytes / HBM",
    "offload copies": "host-link (PCIe) copies no compute hides",
    "bubble": "pipeline fill and drain",
    "gradient clipping": "the gradients' norm and rescale before the step: bytes / HBM",
    "optimizer": "the optimizer step on the GPU: bytes / HBM",
    "host optimizer": "the CPU optimizer step (offload): bytes / host memory",
    "dp copies": "FSDP2's gather copy-outs and reduce-scatter copy-ins, DDP's bucket copies: bytes / HBM",
}


def _part_text(name: str, pr: Prediction) -> str:
    if name == "matmul":
        fp8 = pr.fp8_matmul_fraction
        layers = f" (--fp8's layers: {fp8:.1%} of the FP8 peak)" if fp8 is not None else ""
        return (
            f"linears and the head at the best shape's {pr.matmul_fraction:.1%} of the peak{layers} × "
            f"{pr.matmul_wave_efficiency:.1%} (waves, memory-bound shapes)"
        )
    return _PARTS.get(name, "communication no compute hides")


def _hfu_text(t: Timing) -> str:
    """HFU's note; under context parallelism the ranks run fewer attention FLOPs than the model FLOPs count
    (``Flops.cp_skipped``), which is why HFU can read below MFU (said where it does)."""
    note = "; the cp ranks skip the masked blocks the model FLOPs count" if t.hfu < t.mfu else ""
    return f"all FLOPs that run (recompute included{note}) / the same"


FP8_MFU = (
    "the 16-bit peak, as torchtitan counts float8 runs: --fp8's GEMMs run on the FP8 peak, "
    "so it can pass 100%"
)
"""What MFU is against under ``--fp8`` (``time.timing``'s docstring): said wherever an MFU is shown."""


def fp8_mfu_note(timings: Sequence[Timing | None]) -> str:
    """``FP8_MFU`` as a clause for a table's caption where one of its rows runs ``--fp8``; else empty."""
    return f"MFU: against {FP8_MFU}" if any(t and t.fp8_peak_flops_per_device for t in timings) else ""


def _mfu_text(t: Timing) -> str:
    """MFU's note; under ``--fp8`` it is still against the 16-bit peak (``FP8_MFU``)."""
    note = f"; {FP8_MFU}" if t.fp8_peak_flops_per_device else ""
    return f"model FLOPs (no recompute) / (time × devices × peak{note})"


def _fp8_peak_text(t: Timing) -> str:
    fp8 = t.fp8_peak_flops_per_device
    return f"; --fp8's GEMMs: {fp8 / 1e12:,.1f} TFLOP/s (FP8)" if fp8 else ""


def time_table(t: Timing) -> Fitted:
    cols = (Col("", "left"), Col(""), Col("", "left", priority=1, wrap=True, min_width=16))
    table = Fitted(cols, title=f"Time of one step ({FLOP_UNITS})", show_header=False)
    pr = t.prediction
    basis = _BASIS.get(t.basis, f"at an assumed MFU of {t.assumed_mfu or 0:.0%} (--mfu)")
    rows = [
        ("step time", f"{t.step_time_s:,.3f} s", basis),
        ("tokens/s", f"{t.tokens_per_s:,.0f}", f"{fmt_int(t.tokens_per_step)} tokens per step"),
        ("MFU", f"{t.mfu:.1%}", _mfu_text(t)),
        ("HFU", f"{t.hfu:.1%}", _hfu_text(t)),
        ("pipeline bubble", f"{t.bubble:.1%}", "(p − 1)/(m·n) of the busy time"),
        ("model FLOPs", fmt_flops(t.model_flops_per_step), "per step"),
        ("hardware FLOPs", fmt_flops(t.hardware_flops_per_step), "per step"),
        (
            "peak per device",
            f"{t.peak_flops_per_device / 1e12:,.1f} TFLOP/s",
            f"× {plural(t.devices, 'device')}{_fp8_peak_text(t)}",
        ),
    ]
    if t.training_days is not None and t.training_tokens is not None:
        rows.append(("training", f"{t.training_days:,.1f} days", f"{fmt_count(t.training_tokens)} tokens"))
    stage = f"stage {pr.stage}, {pr.stage_layers} layers" if t.devices > 1 else "one device"
    rows.append(
        ("predicted step", _seconds(pr.step_time_s), f"MFU {pr.mfu:.1%}; the busiest device ({stage})")
    )
    always = {"matmul", "attention", "element-wise", "optimizer"}
    for name, seconds in pr.parts().items():
        if seconds or name in always or name.endswith(" exposed"):
            rows.append((f"  {name}", _seconds(seconds), _part_text(name, pr)))
    for cells in rows:
        table.add(*cells)
    return table


def comm_table(t: Timing) -> Fitted:
    """One row per collective of the busiest device's step (``time.communication``)."""
    cols = (
        Col("dim", "left"),
        Col("collective", "left"),
        Col("phase", "left", priority=1),
        Col("per call"),
        Col("calls"),
        Col("ranks", priority=4),
        Col("link", "left", priority=3),
        Col("time"),
        Col("hidden\nbehind", "left", priority=2),
        Col("what", "left", priority=4, wrap=True, min_width=14),
    )
    table = Fitted(cols, title="Communication of one step, one device of the busiest stage")
    for r in t.prediction.communication:
        table.add(
            r.dimension,
            r.collective.value,
            r.phase.value,
            fmt_bytes(r.bytes),
            fmt_int(r.count),
            str(r.group),
            r.link.level,
            _seconds(r.time_s),
            "–" if r.overlap.value == "none" else r.overlap.value,
            r.what,
        )
    table.caption = "time: ring algorithm, (n−1)/n·bytes per link step (all-reduce twice) + latency per step"
    return table
