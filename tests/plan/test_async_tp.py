"""``--async-tp``: torchtitan's asynchronous tensor parallelism (``time.async_tp``) — which sequence-parallel
collectives torch's micro-pipeline pass fuses with their GEMMs, the kernels the fused ops add, the
symmetric-memory workspace they hold outside the allocator, and the refusals, by hand from the module's
docstring."""

from __future__ import annotations

import json

import jsonschema  # type: ignore[import-untyped]  # (no stubs installed)
import pytest
from typer.testing import CliRunner

from memplan.cli.app import app
from memplan.schema import command_schema
from memplan.time import async_tp
from memplan.time.comm.rows import Overlap

runner = CliRunner()

MIB = 2**20
# torchtitan's Llama 3 8B on one node: tp 4 + SP, FSDP over 2, compiled blocks, one micro-batch a step
TITAN = (
    "estimate -m llama-3-8b --seq 4096 --batch 2 --global-batch 4 --gpus 8 --gpu h100-sxm --impl torchtitan "
    "--compile --zero 3 --tp 4 --sp"
)
SHARD = 2 * 4096 // 4 * 4096
"""[T/t, h]: 8,192 tokens over tp 4, h = 4,096."""


def _json(argv: str) -> dict:  # type: ignore[type-arg]
    r = runner.invoke(app, [*argv.split(), "--json"])
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def _tp(out: dict) -> list[dict]:  # type: ignore[type-arg]
    return [r for r in out["time"]["communication"] if r["dimension"] == "tp"]


def test_the_workspace_by_hand_and_kept_back_from_the_allocator() -> None:
    """The largest request is a fused reduce-scatter's two bf16 output chunks, 2 · [T/t, h] · 2 B = 32 MiB
    (an all-gather's shard is half that in bf16, a quarter in float8), plus torch 2.13's 9,216-byte signal
    pad, rounded up to cuMem's 2 MiB: 34 MiB. Outside the caching allocator: in the device's total, not in
    the reserved peak; the verdict keeps it back (the usable memory falls by exactly it). cp 2 halves T:
    16 MiB + the pad → 18 MiB."""
    plain, sym = _json(TITAN), _json(TITAN + " --async-tp")
    assert async_tp.SIGNAL_PAD == 9216
    assert sym["memory"]["symm_mem_workspace"] == 34 * MIB == sym["memory"]["allocator"]["symm_mem_workspace"]
    assert plain["memory"]["symm_mem_workspace"] == 0
    a, b = plain["memory"]["allocator"], sym["memory"]["allocator"]
    assert a["reserved_peak"] == b["reserved_peak"]  # the fused ops allocate what the unfused code did
    assert b["device_peak"] - a["device_peak"] == 34 * MIB
    assert plain["fit"]["usable_bytes"] - sym["fit"]["usable_bytes"] == 34 * MIB == sym["fit"]["symm_mem"]
    float8 = _json(TITAN + " --async-tp --fp8 tensorwise --fp8-tp --checkpointing full")
    assert float8["memory"]["symm_mem_workspace"] == 34 * MIB
    halved = _json(TITAN.replace("--gpus 8", "--gpus 16") + " --cp 2 --async-tp")
    assert halved["memory"]["symm_mem_workspace"] == 18 * MIB
    validator = jsonschema.Draft202012Validator(command_schema("estimate"))
    validator.validate(sym)


def test_the_added_kernels_by_hand() -> None:
    """Per layer forward: two fused all-gathers copy the rank's [T/t, h] shard into the symmetric buffer
    (read and write, 2·(T/t)·h·g) and two fused reduce-scatters sum their t partial chunks (T·h·e read,
    (T/t)·h·e written); backward two fused all-gathers. g = e = 2 in bf16, g = 1 under --fp8-tp."""
    from memplan.api import build_setup
    from memplan.config import ImplConfig, Parallel

    par, impl = Parallel(tp=4, sp=True), ImplConfig(impl="torchtitan", compile=True)
    setup = build_setup("llama-3-8b", seq=4096, parallel=par, impl=impl)
    setup = setup.replaced(training=setup.training.replaced(micro_batch=2))
    assert async_tp.local_bytes(setup) == (0, 0)
    on = setup.replaced(impl=setup.impl.replaced(async_tp=True))
    reduce = SHARD * 4 * 2 + SHARD * 2
    assert async_tp.local_bytes(on) == (2 * 2 * SHARD * 2 + 2 * reduce, 2 * 2 * SHARD * 2)
    f8 = on.replaced(impl=on.impl.replaced(fp8="tensorwise", fp8_tp=True))
    assert async_tp.local_bytes(f8) == (2 * 2 * SHARD + 2 * reduce, 2 * 2 * SHARD)


def test_the_added_kernels_run_at_the_memory_rate_in_every_layer_and_rerun() -> None:
    """The step's element-wise seconds grow by exactly the stage's layers × (forward + backward) bytes at
    ``MEMORY`` × HBM per micro-batch, and a re-run layer's forward bytes again under full checkpointing."""
    from memplan.presets import load_gpu
    from memplan.time.compute import hbm_bytes_per_s

    hbm = hbm_bytes_per_s(load_gpu("h100-sxm"))
    f, b = 2 * 2 * SHARD * 2 + 2 * (SHARD * 4 * 2 + SHARD * 2), 2 * 2 * SHARD * 2
    for ckpt, again in (("none", 0), ("full", f)):
        flags = f" --checkpointing {ckpt}"
        plain = _json(TITAN + flags)["time"]["predicted"]["elementwise_s"]
        sym = _json(TITAN + flags + " --async-tp")["time"]["predicted"]["elementwise_s"]
        assert sym - plain == pytest.approx(32 * (f + b + again) / hbm, rel=1e-9)


def test_the_layers_collectives_move_under_their_gemms_and_the_eager_ones_stay() -> None:
    """Of each forward all-gather, forward reduce-scatter and backward output-gradient all-gather the
    layers' 2 a layer hide behind their GEMMs (32 layers: 64 calls), the head's all-gather and the
    embedding's reduce-scatter and gradient all-gather (torchtitan's eager modules) stay exposed; the
    backward's input-gradient reduce-scatters (a sum of matmuls, not one) stay under the weight gradients."""
    plain, sym = _tp(_json(TITAN)), _tp(_json(TITAN + " --async-tp"))
    moved = {(r["what"], r["overlaps"], r["count"]) for r in sym if "symmetric memory" in r["what"]}
    assert moved == {
        ("sequence → linear inputs ‖ GEMM (symmetric memory)", Overlap.UB_COLUMN_FORWARD.value, 64),
        ("outputs → sequence shards ‖ GEMM (symmetric memory)", Overlap.UB_ROW_FORWARD.value, 64),
        ("output gradients ‖ GEMM (symmetric memory)", Overlap.UB_ROW_DGRAD.value, 64),
    }
    kept = {(r["what"], r["count"], r["overlaps"]) for r in sym if "symmetric memory" not in r["what"]}
    assert kept == {
        ("cross entropy", 3, "none"),
        ("sequence → linear inputs", 1, "none"),
        ("outputs → sequence shards", 1, "none"),
        ("output gradients", 1, "none"),
        ("input gradients ‖ dW", 65, "backward"),
    }
    assert sum(r["count"] for r in sym) == sum(r["count"] for r in plain)


def test_float8_gathers_move_and_the_heads_bf16_gather_stays() -> None:
    """Under --fp8-tp the layers' gathers are float8 (one byte an element) and move under their GEMMs;
    the head's gather and the embedding's gradient gather keep the activation dtype and stay exposed."""
    rows = _tp(_json(TITAN + " --async-tp --fp8 tensorwise --fp8-tp --checkpointing full"))
    x = 2 * 4096 * 4096 * 2  # [T, h] in bf16: an all-gather's output
    got = {(r["what"], r["count"], r["bytes"], r["overlaps"]) for r in rows}
    sym = " ‖ GEMM (symmetric memory)"
    assert {
        (f"sequence → linear inputs (float8){sym}", 64, x // 2, Overlap.UB_COLUMN_FORWARD.value),
        (f"output gradients (float8){sym}", 64, x // 2, Overlap.UB_ROW_DGRAD.value),
        (f"re-run layers' inputs (float8){sym}", 64, x // 2, Overlap.UB_COLUMN_RERUN.value),
        (f"re-run layers' outputs{sym}", 64, x, Overlap.UB_ROW_RERUN.value),
        ("sequence → linear inputs", 1, x, "none"),
        ("output gradients", 1, x, "none"),
    } <= got


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        ("--tp 4 --sp --compile", "under --impl torchtitan"),
        ("--impl torchtitan --tp 4 --sp", "add --compile"),
        ("--impl torchtitan --compile", "it needs --tp T --sp with T > 1"),
        ("--impl torchtitan --compile --tp 4 --sp --device cpu", "use --device cuda"),
    ],
)
def test_refused_where_it_does_not_run_in_one_line(flags: str, why: str) -> None:
    r = runner.invoke(app, ["estimate", "-m", "llama-3-8b", "--async-tp", *flags.split()])
    assert r.exit_code == 2
    line = r.stderr.strip()
    assert line.startswith("error: async_tp: --async-tp (torchtitan's async tensor parallelism): ")
    assert why in line and "\n" not in line


def test_refused_across_nodes() -> None:
    argv = TITAN.replace("--tp 4", "--tp 8") + " --gpus-per-node 4 --async-tp"
    r = runner.invoke(app, argv.split())
    assert r.exit_code == 2
    assert r.stderr.strip() == (
        "error: async_tp: torch's symmetric memory maps the tp ranks' memory over one node's NVLink; --tp 8 "
        "spans more than its 4 GPUs: use --tp ≤ 4 or drop --async-tp"
    )


def test_fit_keeps_it_on_layouts_that_run_it_and_its_rows_reproduce() -> None:
    """``fit --impl torchtitan --compile --async-tp``: only tensor-parallel layouts with sp inside the node;
    each row's command carries it and reproduces the row's step time."""
    argv = (
        "fit -m llama-3-8b --seq 4096 --gpus 16 --gpu h100-sxm --global-batch 32 --top 3 --impl torchtitan "
        "--compile --async-tp --json"
    )
    r = runner.invoke(app, argv.split())
    assert r.exit_code == 0, r.stderr
    configs = json.loads(r.stdout)["configs"]
    assert configs
    for c in configs:
        assert 1 < c["settings"]["tp"] <= 8 and c["settings"]["sp"]
        assert "--async-tp" in c["command"]
    again = runner.invoke(app, [*configs[0]["command"].removeprefix("memplan ").split(), "--json"])
    assert again.exit_code == 0, again.stderr
    assert json.loads(again.stdout)["time"]["step_time_s"] == configs[0]["time"]["step_time_s"]


def test_the_published_speedups_table_is_the_codes_output() -> None:
    """docs/step-time.md's async-TP table is ``benchmarks/async_tp.py``'s output (no error bound asserted:
    the ratios are read there, not fitted), and each pair is typed as its command says: the same setup but
    for ``--async-tp``, torchao's float8 TP plan for tensorwise only."""
    from benchmarks.async_tp import COMMON, DOC, END, PAIRS, START, markdown

    table = DOC.read_text(encoding="utf-8").split(START + "\n", 1)[1].split(END, 1)[0]
    assert table == markdown()
    for p in PAIRS:
        assert ("--fp8-tp" in p.typed) == (p.quantization == "float8 tensorwise")
        assert "--async-tp" not in p.typed + COMMON and "--compile" in COMMON
