"""Tables at 80 columns keep every number whole, and say what they leave out or cut (render/fitted.py)."""

from __future__ import annotations

import io

from rich.console import Console

from memplan.render.fitted import Col, Fitted
from memplan.render.measure import tensor_table

# Names as `trace --impl hf -m gpt2` pairs them (memplan's ↔ transformers' module · op): up to 52 cells.
NAMES = (
    ("final_norm.input ↔ transformer.ln_f · NativeLayerNorm", 1, 98_304),
    ("attn.resid_dropout_mask ↔ attn.resid_dropout · Mul", 1, 98_304),
    ("loss.log_probs ↔ NllLoss+LogSoftmax", 1, 12_865_536),
    ("mlp.up ↔ mlp.act · Pow", 12, 393_216),
)


def render(table: Fitted, width: int) -> str:
    console = Console(width=width, file=io.StringIO(), color_system=None, record=True)
    console.print(table)
    return console.export_text()


def diff() -> dict[str, object]:
    rows = [
        {
            "name": name,
            "estimated_count": count,
            "measured_count": count,
            "estimated_bytes": size,
            "measured_bytes": size,
            "delta_bytes": 0,
        }
        for name, count, size in NAMES
    ]
    return {"tensors": rows}


def test_impl_tensor_table_keeps_counts_and_units_at_80_columns() -> None:
    text = render(tensor_table(diff(), "Saved tensors", "layer 0 + model"), 80)
    assert max(len(line) for line in text.splitlines()) <= 80
    # 98,304 B = 96 KiB; 12,865,536 B = 12.27 MiB (÷ 2²⁰ = 12.269…); 393,216 B = 384 KiB: whole, with units.
    assert text.count("96.00 KiB") == 4 and text.count("12.27 MiB") == 2 and text.count("384.00 KiB") == 2
    assert "est." in text and "count" in text and " 12 " in text  # the counts are shown
    assert "not shown" not in text and "cut at" not in text
    # Every name is there, folded onto more lines where it is long.
    flat = " ".join(line.strip("│ ").replace("│", " ") for line in text.splitlines())
    assert "NativeLayerNorm" in flat and "final_norm.input" in flat


def test_keys_wider_than_the_terminal_are_said_to_be_cut() -> None:
    table = Fitted((Col("name", "left"), Col("value")), title="t")
    table.add("x" * 70, "1,234.00 GiB")
    text = render(table, 60)
    # name 70 + value 12, each with 3 cells of padding and rule, + the left border: 1 + 73 + 15 = 89.
    assert "cut at 60 columns: name, value (a terminal of ≥ 89 columns shows them whole)" in " ".join(
        text.split()
    )
    assert "cut at" not in render(table, 89)
