"""``--compile`` (issue #22 item 4): what each block keeps under torch.compile is what AOTAutograd's min-cut
partitioner returns from the compiled forward (memplan/measure/runs/compiled.py, traced under fake tensors
with Inductor's decompositions, no kernels compiled); the estimate (``Profile.compiled_block``) equals it per
layer, in total and in FLOPs."""

from __future__ import annotations

from typing import Any

import pytest
from typer.testing import CliRunner

from memplan.api import Options, setup_of
from memplan.blocks.profiles import compile_modelled, compile_note
from memplan.cli.app import app
from memplan.config import Setup
from memplan.engine import estimate
from memplan.measure.runs.compiled import compiled_block_records, compiled_comparison_json, measure_compiled


def two_layers(**opt: Any) -> Setup:
    s = setup_of(Options(device="cpu", compile=True, **opt))
    return s.model_copy(update={"model": s.model.model_copy(update={"num_layers": 2})})


CASES: list[dict[str, Any]] = [
    {"model": "llama-3-8b", "seq": 256},  # GQA 32/8
    {"model": "llama-2-7b", "seq": 128, "batch": 2},  # MHA
    {"model": "qwen3-8b", "seq": 128},  # q/k norms
    {"model": "tiny", "seq": 64, "precision": "fp32"},
    {"model": "tiny", "seq": 64, "checkpointing": "full"},
]


@pytest.mark.parametrize("opt", CASES, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_compiled_blocks_keep_what_the_estimate_says(opt: dict[str, Any]) -> None:
    s = two_layers(**opt)
    assert compile_modelled(s)
    diff = compiled_comparison_json(estimate(s), measure_compiled(s))["diff"]
    assert diff["exact"] and diff["equal"], diff


def test_the_partitioners_choice_by_hand() -> None:
    """Llama-3-8B's block at T = 512 tokens (h 4096, kv width 1024, f 14336, 32 heads), bf16: the layer input
    x, the fp32 rstd and w·n of each norm (before the MLP, W_O's output stands for the residual sum), v, q and
    k after RoPE, the flash output and its fp32 lse, gate, up and their product — and not the fp32 upcasts,
    the normalised x nor silu(g), which eager keeps."""
    s = two_layers(model="llama-3-8b", seq=512)
    t, h, kv, f, a = 512, 4096, 1024, 14336, 32
    by_hand = [t * h * 2, t * 4, t * h * 2, t * kv * 2, t * h * 2, t * kv * 2, a * t * 4, t * h * 2]
    by_hand += [t * h * 2, t * 4, t * h * 2, t * f * 2, t * f * 2, t * f * 2]
    assert sorted(r.bytes for r in compiled_block_records(s)) == sorted(by_hand)
    eager = s.model_copy(update={"impl": s.impl.model_copy(update={"compile": False})})
    # What compile drops per layer: two fp32 norm upcasts [T, h] and two bf16 normalised x [T, h] (less the
    # two bf16 norm inputs it keeps instead), and silu(g) [T, f].
    dropped = 2 * (t * h * 4 + t * h * 2 - t * h * 2) + t * f * 2
    assert layer_bytes(eager) - layer_bytes(s) == dropped
    assert layer_bytes(s) == sum(by_hand)


def layer_bytes(s: Setup) -> int:
    from memplan.blocks.inventory import Scope

    return sum(k.bytes for k in estimate(s).tensors if k.scope is Scope.LAYER)


def test_an_unmodelled_setup_keeps_the_eager_saves_and_says_so() -> None:
    s = two_layers(model="tiny", seq=64, attention="eager")
    assert not compile_modelled(s)
    eager = s.model_copy(update={"impl": s.impl.model_copy(update={"compile": False})})
    assert layer_bytes(s) == layer_bytes(eager)
    note = compile_note(s)
    assert note is not None and note.startswith("compile: torch.compile's saved set is modelled for")


def test_trace_compile_from_the_command_line() -> None:
    runner = CliRunner(env={"COLUMNS": "120", "NO_COLOR": "1"})
    ok = runner.invoke(app, ["trace", "-m", "tiny", "--seq", "64", "--compile"])
    assert ok.exit_code == 0, ok.output
    bad = runner.invoke(app, ["trace", "-m", "tiny", "--seq", "64", "--compile", "--attention", "eager"])
    assert bad.exit_code == 2 and len(bad.output.strip().splitlines()) == 1
    assert bad.output.startswith("error: compile: trace --compile needs a modelled setup;")


def test_the_note_reaches_the_estimate() -> None:
    from memplan.advice import notes
    from memplan.api import build

    b = build(Options(model="tiny", seq=64, compile=True, attention="eager"))
    assert compile_note(b.result.setup) in notes(b)
    modelled = build(Options(model="tiny", seq=64, compile=True))
    assert all(not n.startswith("compile:") for n in notes(modelled))
