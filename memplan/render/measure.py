"""Rendering of estimate-vs-measurement comparisons (``memplan trace`` and ``memplan profile``)."""

from __future__ import annotations

import itertools
from typing import Any

from rich.console import Group, RenderableType
from rich.text import Text

from memplan.render.estimate import BYTE_UNITS, FLOP_UNITS, fmt_bytes, fmt_flops, fmt_int
from memplan.render.fitted import Col, Fitted


def _delta(d: int, fmt: str = "bytes") -> Text:
    if d == 0:
        return Text("0", style="green")
    sign = "+" if d > 0 else "−"
    body = fmt_bytes(abs(d)) if fmt == "bytes" else fmt_flops(abs(d))
    return Text(f"{sign}{body}", style="bold red")


def tensor_table(
    diff: dict[str, object],
    title: str = "Saved tensors: estimated vs measured",
    total: str = "total",
) -> Fitted:
    rows = diff["tensors"]
    assert isinstance(rows, list)
    cols = (
        # A key, but long prose under --impl (``final_norm.input ↔ transformer.ln_f · NativeLayerNorm``):
        # it folds, so that the counts and the byte figures keep their whole width at 80 columns.
        Col("tensor", "left", wrap=True, min_width=24),
        Col("est.\ncount", priority=2),
        Col("meas.\ncount", priority=2),
        Col("est. bytes"),
        Col("meas. bytes"),
        Col("Δ", priority=1),
    )
    t = Fitted(cols, title=f"{title} ({BYTE_UNITS})")
    for r in rows:
        t.add(
            r["name"],
            fmt_int(r["estimated_count"]),
            fmt_int(r["measured_count"]),
            fmt_bytes(r["estimated_bytes"]),
            fmt_bytes(r["measured_bytes"]),
            _delta(r["delta_bytes"]),
        )
    est = sum(r["estimated_bytes"] for r in rows)
    meas = sum(r["measured_bytes"] for r in rows)
    t.section()
    t.add(total, "", "", fmt_bytes(est), fmt_bytes(meas), _delta(meas - est), style="bold", data=False)
    return t


def flop_table(diff: dict[str, object]) -> Fitted:
    rows = diff["flops"]
    assert isinstance(rows, list)
    cols = (
        Col("phase", "left"),
        Col("estimated"),
        Col("measured"),
        Col("exact count", priority=2),
        Col("Δ", priority=1),
    )
    t = Fitted(cols, title=f"FLOPs: estimated vs FlopCounterMode ({FLOP_UNITS})")
    for r in rows:
        t.add(
            r["phase"],
            fmt_flops(r["estimated"]),
            fmt_flops(r["measured"]),
            fmt_int(r["measured"]),
            _delta(r["delta"], "flops"),
        )
    return t


def verdict(equal: bool, what: str) -> Text:
    if equal:
        return Text(f"✓ {what}: estimate = measurement, byte for byte and FLOP for FLOP", style="bold green")
    return Text(f"✗ {what}: estimate and measurement differ (a bug in one of them)", style="bold red")


def impl_verdict(within: bool, exact: bool, impl: str, tolerance: float) -> Text:
    if exact:
        return verdict(True, f"trace --impl {impl}")
    if within:
        return Text(
            f"✓ trace --impl {impl}: every layer and the total within {tolerance:.0%}", style="bold green"
        )
    return Text(
        f"✗ trace --impl {impl}: a layer or the total differs by more than {tolerance:.0%}", style="bold red"
    )


def layer_table(diff: dict[str, object]) -> Fitted:
    """Bytes each transformer layer keeps, estimated vs measured (layers with equal figures on one row)."""
    rows = diff["layers"]
    assert isinstance(rows, list)
    cols = (Col("layers", "left"), Col("estimated"), Col("measured"), Col("Δ", priority=1))
    t = Fitted(cols, title=f"Per layer: bytes each layer keeps ({BYTE_UNITS})")
    for r in rows:
        delta = _delta(r["measured"] - r["estimated"])
        t.add(layer_span(r["layers"]), fmt_bytes(r["estimated"]), fmt_bytes(r["measured"]), delta)
    return t


def layer_span(layers: list[int]) -> str:
    """0–79 (80 layers); 0–78 every 2 (40 layers); 3; or the first few."""
    if len(layers) == 1:
        return str(layers[0])
    steps = {b - a for a, b in itertools.pairwise(layers)}
    if len(steps) == 1:
        step = steps.pop()
        every = "" if step == 1 else f" every {step}"
        return f"{layers[0]}–{layers[-1]}{every} ({len(layers)} layers)"
    return f"{', '.join(map(str, layers[:4]))}, … ({len(layers)} layers)"


def trace_report(result: dict[str, object], seconds: float) -> RenderableType:
    diff = result["diff"]
    assert isinstance(diff, dict)
    return Group(
        tensor_table(diff),
        layer_table(diff),
        flop_table(diff),
        Text(f"traced in {seconds:.1f} s ({_RAN_ON.get(str(result.get('ran_on')), _RAN_ON['cpu'])})"),
        verdict(bool(diff["equal"]), "trace"),
    )


def impl_trace_report(result: dict[str, Any], seconds: float) -> RenderableType:
    """``trace --impl``: tensors paired with the framework's (module · op), layers with their ratio, the
    total, FLOPs; the verdict is within 1 % per layer and in total."""
    diff = result["diff"]
    impl = result["estimated"]["setup"]["impl"]
    total = diff["total"]
    exact = "exactly equal" if diff["exact"] else f"measured/estimated {total['ratio']:.4f}"
    title = "Saved tensors of layer 0 and the model, estimated ↔ measured (module · op)"
    peak: list[RenderableType] = []
    if "peak" in result:  # trace --impl torchtitan over ranks
        from memplan.render.rank_peak import rank_peak_report

        peak.append(rank_peak_report(result["peak"]))
    if "step_peak" in result:  # trace --impl hf: transformers' step
        from memplan.render.rank_peak import step_peak_report

        peak.append(step_peak_report(result["step_peak"]))
    if "weights" in diff and "rank" in result:  # the rank's states after the step, judged with the saves
        rank, w, g = result["rank"], diff["weights"], diff["gradients"]
        peak.append(
            Text(
                f"rank {rank['rank']} of {rank['world']}: parameters {fmt_bytes(w['measured'])} measured, "
                f"{fmt_bytes(w['estimated'])} estimated; gradients {fmt_bytes(g['measured'])} measured, "
                f"{fmt_bytes(g['estimated'])} estimated"
            )
        )
    return Group(
        tensor_table(diff, title, "layer 0 + model"),
        layer_table(diff),
        flop_table(diff),
        *peak,
        Text(
            f"{impl}: {fmt_bytes(total['measured'])} measured, {fmt_bytes(total['estimated'])} estimated "
            f"({exact}); traced in {seconds:.1f} s on fake tensors (CPU)"
        ),
        impl_verdict(bool(diff["equal"]), bool(diff["exact"]), impl, float(diff["tolerance"])),
    )


_RAN_ON = {
    "cpu": "fake tensors on CPU: no memory, no GPU",
    "meta": "CUDA kernels' outputs on meta tensors, on CPU: no memory, no GPU",
}


def profile_table(rows: list[tuple[str, str, str]]) -> Fitted:
    cols = (Col("quantity", "left"), Col("estimated"), Col("measured"))
    t = Fitted(cols, title=f"Profile: measured vs estimated ({BYTE_UNITS})")
    for r in rows:
        t.add(*r)
    return t
