"""``fit --mfu``: the search at an assumed MFU prunes by time (``search.mfu_bound``) and lists what the
search that prunes nothing lists.

Before, an assumed MFU switched the bound off and every family was judged for memory and rejection
(``fit -m 70b --seq 4096 --gpus 256 --gpu h100-sxm --mfu 0.4``: 24.8 s of CPU, 22,848 of 23,847
configurations evaluated; now 2.4 s, 804, measured on the development machine, docs/fit.md).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from typer.testing import CliRunner

from memplan.api import build_setup
from memplan.cli.app import app
from memplan.config import Checkpointing, Parallel
from memplan.presets import GpuPreset, load_gpu
from memplan.search.fit import Space, fit
from memplan.search.mfu_bound import MfuBound
from memplan.search.results import FitResult
from memplan.time.timing import peak_flops

H100 = load_gpu("h100-sxm")
A100 = load_gpu("a100-40gb")
MFU = 0.4

CASES = [
    # (model, seq, GPU, GPUs, global batch, space): tp, pp with and without the interleaved schedule,
    # cp 2, with and without checkpointing
    (
        "llama-3.2-1b",
        4096,
        H100,
        16,
        64,
        Space(
            checkpointing=(Checkpointing.NONE, Checkpointing.FULL),
            micro_batches=(1, 2),
            vpp=(1, 2),
            cp_max=2,
            keep=3,
        ),
    ),
    # 8B at 8,192 tokens on 8 A100-40GB: ZeRO 0 fits nowhere (families rejected beside the rows)
    (
        "llama-3-8b",
        8192,
        A100,
        8,
        None,
        Space(checkpointing=(Checkpointing.NONE, Checkpointing.FULL), micro_batches=(1, 2), keep=4),
    ),
]


def _rows(r: FitResult, top: int) -> str:
    doc = r.to_json(top=top)
    return json.dumps({k: doc[k] for k in ("configs", "methods", "max_seq")}, sort_keys=True)


@pytest.mark.parametrize(("name", "seq", "gpu", "gpus", "batch", "space"), CASES)
def test_fit_at_an_assumed_mfu_lists_what_the_full_evaluation_lists(
    name: str, seq: int, gpu: GpuPreset, gpus: int, batch: int | None, space: Space
) -> None:
    """The pruned search (``keep`` rows) against the same space with ``keep`` 0 (no bound, nothing pruned,
    every configuration judged): the same rows, best per method and longest sequence; the families it
    rejects are the full search's with the same verdicts; and the bound is below every configuration's
    assumed step (``timing.assumed_seconds``), equal to it (to the billionth it is lowered by) without
    checkpointing."""
    base = build_setup(name, seq=seq)
    fast = fit(base, gpu, gpus, global_batch=batch, space=space, mfu=MFU)
    full = fit(base, gpu, gpus, global_batch=batch, space=dataclasses.replace(space, keep=0), mfu=MFU)
    assert fast.pruned > 0 and full.pruned == 0
    assert _rows(fast, space.keep) == _rows(full, space.keep)
    rejected = {r.family: r for r in full.rejected}
    assert all(rejected[r.family] == r for r in fast.rejected)
    assert bool(fast.rejected) is (name == "llama-3-8b")

    bound = MfuBound(gpu, gpus, full.global_batch, MFU)
    exact = 0
    for c in full.fitting:
        key = bound.seconds(
            base, c.family.checkpointing, c.family.attention, c.result.parallel, c.result.micro_batches
        )
        step = c.timing.step_time_s
        assert key <= step
        if c.family.checkpointing is Checkpointing.NONE:  # no recompute: the bound is the step
            assert key == pytest.approx(step, rel=2e-9)
            exact += 1
    assert exact and len({c.result.parallel.pp for c in full.fitting}) > 1


def test_the_bound_by_hand() -> None:
    """Llama 3.2 1B, 4,096 tokens, 64 sequences on 16 H100s at MFU 0.4, pp 2 over 4 micro-batches: the
    model FLOPs of one sequence (the reference's: 6 × the forward's matmuls, the causal attention core
    counted whole) over the GPUs' capacity, stretched by the bubble (2 − 1)/(1 · 4)."""
    base = build_setup("llama-3.2-1b", seq=4096)
    m = base.model
    h, layers, f, v, s = m.hidden_size, m.num_layers, m.ffn_size, m.vocab_size, 4096
    kv = m.num_kv_heads * m.head_dim
    linear = layers * (h * h + 2 * h * kv + h * h + 3 * h * f) + h * v  # weights of every matmul
    attention = layers * 2 * (2 * s * s * h)  # QKᵀ and P·V, 2·s²·h FLOPs each a layer forward
    model = 3 * (2 * s * linear + attention)  # forward + backward (2× the forward)
    bound = MfuBound(H100, 16, 64, MFU)
    key = bound.seconds(base, Checkpointing.NONE, base.strategy.attention, Parallel(pp=2), 4)
    capacity = 16 * peak_flops(H100, base.training.precision) * MFU
    assert key == pytest.approx(64 * model / capacity * (1 + 1 / 4), rel=1e-8)


def test_the_summary_says_the_rows_are_at_the_assumed_mfu() -> None:
    """At an assumed MFU the panel says the step times are not predicted, and what orders rows as fast;
    every row's time has the assumed basis (the JSON's ``time.basis``)."""
    runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})
    command = ["fit", "-m", "llama-3.2-1b", "--seq", "2048", "--gpus", "8", "--gpu", "h100-sxm", "--top", "2"]
    shown = runner.invoke(app, [*command, "--mfu", "0.375"])
    assert shown.exit_code == 0, shown.output
    assert "step times at an assumed MFU of 37.5 % (--mfu)" in shown.stdout
    assert "by its bound or at the assumed MFU" in shown.stdout
    predicted = runner.invoke(app, command)
    assert "assumed MFU" not in predicted.stdout and "by its bound or predicted" in predicted.stdout
    doc = json.loads(runner.invoke(app, [*command, "--mfu", "0.375", "--json"]).stdout)
    assert {(c["time"]["basis"], c["time"]["assumed_mfu"]) for c in doc["configs"]} == {("assumed", 0.375)}
