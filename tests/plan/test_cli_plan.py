"""``memplan plan``, ``compare`` and ``fit`` through the typer app: JSON numbers, tables, one-line errors."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

import pytest
from typer.testing import CliRunner

from memplan.api import Options, build
from memplan.cli.app import app
from memplan.engine import estimate

runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})


def invoke(*args: str) -> Any:
    return runner.invoke(app, list(args))


def ok_json(*args: str) -> dict[str, Any]:
    result = invoke(*args, "--json")
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    doc = json.loads(result.stdout)
    assert isinstance(doc, dict)
    return doc


def one_line_error(*args: str) -> str:
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


GPT3 = ("plan", "-m", "gpt3-175b", "--seq", "2048", "--precision", "fp16-mixed", "--attention", "eager")


# ----------------------------------------------------------------------------------------------------
# plan
# ----------------------------------------------------------------------------------------------------
def test_plan_json_has_the_estimate_contract_and_equals_the_api() -> None:
    args = (*GPT3, "--tp", "8", "--sp", "--pp", "8", "--gpus", "1024", "--global-batch", "1536")
    doc = ok_json(*args, "--checkpointing", "selective", "--gpu", "a100", "--step-time", "13.75")
    for section, keys in {
        "params": ("total", "active"),
        "memory": ("weights", "gradients", "optimizer", "activations", "peak"),
        "flops": ("forward", "backward", "recompute", "total", "model"),
        "time": ("mfu", "hfu", "step_time_s", "tokens_per_s"),
        "fit": ("fits", "peak", "memory_bytes"),
    }.items():
        for key in keys:
            assert key in doc[section], f"{section}.{key}"
    assert {"name", "shape", "dtype", "bytes", "count"} <= set(doc["activations"]["tensors"][0])
    assert isinstance(doc["activations"]["per_layer"], int)
    built = build(
        Options(
            model="gpt3-175b",
            seq=2048,
            precision="fp16-mixed",  # type: ignore[arg-type]
            attention="eager",  # type: ignore[arg-type]
            checkpointing="selective",
            tp=8,
            sp=True,
            pp=8,
            gpus=1024,
            global_batch=1536,
            gpu="a100",
            step_time=13.75,
        )
    )
    assert doc["memory"]["peak"] == built.result.device.peak.bytes
    assert doc["setup"]["dp"] == 16 and doc["setup"]["micro_batches"] == 96
    assert doc["stages"][0]["in_flight_layers"] == 96  # 8 micro-batches × 12 layers on stage 0
    assert doc["time"]["mfu"] == built.timing.mfu if built.timing else False


def test_plan_rich_output_runs() -> None:
    result = invoke(
        *GPT3, "--tp", "8", "--sp", "--pp", "4", "--grad-accum", "8", "--gpu", "h100", "--tokens", "3e11"
    )
    assert result.exit_code == 0, result.output
    assert "memplan estimate" in result.stdout and "Pipeline stages" in result.stdout


def test_plan_without_parallelism_equals_estimate_json() -> None:
    est = invoke("estimate", "-m", "llama-3-8b", "--seq", "4096", "--zero", "2", "--dp", "8", "--json")
    doc = ok_json("plan", "-m", "llama-3-8b", "--seq", "4096", "--zero", "2", "--dp", "8")
    ref = json.loads(est.stdout)
    assert doc["memory"]["peak"] == ref["memory"]["peak"]
    assert doc["activations"]["tensors"] == ref["activations"]["tensors"]
    assert doc["flops"]["total"] == ref["flops"]["total"]


def test_plan_moe_counts_and_expert_parallel() -> None:
    doc = ok_json("plan", "-m", "mixtral", "--seq", "4096", "--ep", "8", "--gpus", "32", "--zero", "1")
    assert (doc["params"]["total"], doc["params"]["active"]) == (46_702_792_704, 12_879_925_248)
    assert doc["params"]["layers"] == 46_702_792_704 - 2 * 32000 * 4096 - 4096  # all experts of 32 layers
    assert doc["moe"]["experts"] == 8 and doc["setup"]["ep"] == 8


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        ((*GPT3, "--tp", "5"), "error: tp: 5 does not divide num_heads 96 of gpt3-175b; use --tp 1, 2, 3, 4"),
        ((*GPT3, "--pp", "7", "--pp-layers", "14,14,14,14,14,14,14"), "error: pp-layers: the stages hold 98"),
        ((*GPT3, "--sp"), "error: sp: sequence parallelism splits over the tensor-parallel ranks"),
        ((*GPT3, "--gpu", "h1000"), "error: gpu: unknown preset 'h1000'; did you mean"),
        ((*GPT3, "--tp", "8", "--gpus", "12"), "error: gpus: 12 devices do not split into tp 8 × pp 1"),
        ((*GPT3, "--gpus", "8", "--dp", "4"), "error: dp: tp 1 × pp 1 × dp 4 = 4 devices, not --gpus 8"),
        (
            (*GPT3, "--dp", "8", "--global-batch", "100"),
            "error: global-batch: 100 sequences are not a multiple",
        ),
        ((*GPT3, "--mfu", "0.5"), "error: gpu: time needs a GPU's peak FLOP/s; add --gpu NAME"),
        ((*GPT3, "--gpu", "a100", "--mfu", "2"), "error: mfu: must be in [1e-06, 1], got 2.0"),
        ((*GPT3, "--ep", "2"), "error: ep: gpt3-175b is dense"),
        ((*GPT3, "--gpu", "a100", "--step-time", "inf"), "error: step-time: must be finite positive seconds"),
        ((*GPT3, "--gpu", "a100", "--tokens", "nan"), "error: tokens: must be a positive number of tokens"),
        (("plan", "--seq", "2048"), "error: model: required"),
        (
            ("plan", "-m", "mixtral-8x7"),
            "error: model: unknown preset 'mixtral-8x7'; did you mean mixtral-8x7b",
        ),
    ],
)
def test_plan_mistakes_are_one_line_exit_2(args: tuple[str, ...], needle: str) -> None:
    assert one_line_error(*args).startswith(needle)


# ----------------------------------------------------------------------------------------------------
# compare
# ----------------------------------------------------------------------------------------------------
COMPARE = ("compare", "-m", "7b,70b", "--seq", "4096", "--gpus", "8", "--gpu", "h100")


def test_compare_rows_are_the_cartesian_product() -> None:
    doc = ok_json(*COMPARE, "--vary", "checkpointing=none,selective,full", "--vary", "attention=eager,flash")
    rows = doc["rows"]
    assert len(rows) == 2 * 3 * 2
    assert doc["columns"][:3] == ["model", "checkpointing", "attention"]
    first = rows[0]
    assert first["settings"] == {"model": "7b", "checkpointing": "none", "attention": "eager"}
    ref = build(Options(model="7b", seq=4096, gpus=8, gpu="h100", attention="eager"))  # type: ignore[arg-type]
    assert first["values"]["peak"] == first["plan"]["memory"]["peak"] == ref.result.device.peak.bytes
    assert first["plan"]["flops"]["total"] == ref.result.flops.total
    # 6.74B parameters × 16 bytes (mixed-precision AdamW, ZeRO-0) = 108 GB alone: more than 80 GiB.
    assert first["values"]["fits"] is False and first["values"]["peak"] > 6_738_415_616 * 16


def test_compare_shows_the_reserved_peak_that_fits_is_judged_on() -> None:
    """Llama 3 8B at 8,192 tokens, ZeRO-3 over 8 H100s: the tensors' peak (76.48 GiB) is under the GPU's
    80 GiB and the row does not fit. The row says why: its allocator's reserved peak (the verdict's
    replay) passes the memory the allocator may use (the GPU's less the CUDA context, NCCL's and FSDP2's
    all-gather stream's buffers), which the bar's ``│`` marks."""
    args = ("compare", "-m", "8b", "--seq", "8192", "--dp", "8", "--gpu", "h100", "--vary", "zero=0,3")
    doc = ok_json(*args)
    for row in doc["rows"]:
        v, fit = row["values"], row["plan"]["fit"]
        assert v["reserved"] == fit["reserved_peak"] and v["peak"] == fit["peak"]
        assert v["fits"] is (v["reserved"] <= fit["usable_bytes"])
    zero3 = doc["rows"][1]
    assert zero3["values"]["peak"] < zero3["plan"]["fit"]["memory_bytes"] and zero3["values"]["fits"] is False
    assert "reserved" in doc["columns"]
    table = invoke(*args).stdout
    head = next(line for line in table.splitlines() if "reserved" in line)
    assert head.index("peak") < head.index("reserved")
    said = "reserved: its caching allocator's reserved peak, what fits is judged on"
    assert said in " ".join(table.split())
    assert ok_json("compare", "-m", "8b", "--vary", "zero=0,3")["rows"][0]["values"]["reserved"] is None


def test_the_compare_bar_marks_the_usable_memory() -> None:
    """``memory_cell``: on a scale of 40 cells, 10 bytes each, the ``│`` of 250 usable bytes in cell 25."""
    from memplan.render.plan import memory_cell

    parts = {"weights": 100, "gradients": 0, "optimizer_memory": 0, "activations": 200, "transient": 0}
    bar = memory_cell(parts, 400, 250, width=40).plain
    assert bar.index("│") == 25 and bar[:10] == "█" * 10 and bar[10:25] == "░" * 15


def test_compare_sort_csv_and_markdown() -> None:
    args = (*COMPARE, "--vary", "tp=2,4,8", "--sp", "--sort", "-peak")
    result = invoke(*args, "--csv")
    assert result.exit_code == 0, result.output
    table = list(csv.DictReader(io.StringIO(result.stdout)))
    assert len(table) == 6
    peaks = [int(r["peak"]) for r in table]
    assert peaks == sorted(peaks, reverse=True)
    md = invoke(*args, "--markdown")
    assert md.exit_code == 0 and len(md.stdout.strip().splitlines()) == 2 + 6
    rich = invoke(*args)
    assert rich.exit_code == 0 and "memplan compare" in rich.stdout


def test_compare_refuses_a_row_that_cannot_be_planned() -> None:
    # tp 1 with --sp is invalid (sequence parallelism needs tp > 1): an error naming that row, not a row of
    # dashes.
    line = one_line_error(*COMPARE, "--vary", "tp=1,8", "--sp")
    assert line.startswith("error: sp: sequence parallelism") and line.endswith("tp=1]")


def test_compare_sorts_numeric_settings_as_numbers() -> None:
    doc = ok_json("compare", "-m", "8b", "--vary", "gpus=16,8,32", "--sort", "gpus")
    assert [r["settings"]["gpus"] for r in doc["rows"]] == ["8", "16", "32"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (
            ("--vary", "checkpoint=none"),
            "error: vary: unknown setting 'checkpoint'; did you mean checkpointing?",
        ),
        (("--vary", "tp"), "error: vary: expected KEY=V1,V2"),
        (("--vary", "tp=x"), "error: vary: tp: Input should be a valid integer"),
        (("--vary", "model=7b"), "error: vary: models are listed with --model"),
        (("--vary", "zero=5"), "error: zero: must be 0, 1, 2 or 3, got 5"),
        (("--sort", "speed"), "error: sort: unknown column 'speed'"),
        (("--json", "--csv"), "error: output: choose one of --json, --csv and --markdown"),
        (("--vary", "tp=5"), "error: gpus: 8 devices do not split into tp 5 × pp 1"),  # every row fails
    ],
)
def test_compare_mistakes(args: tuple[str, ...], needle: str) -> None:
    assert one_line_error(*COMPARE, *args).startswith(needle)


# ----------------------------------------------------------------------------------------------------
# fit
# ----------------------------------------------------------------------------------------------------
FIT = ("fit", "-m", "llama-3-8b", "--seq", "8192", "--gpu", "a100-40gb", "--gpus", "8")


def test_fit_json_ranks_fitting_configs_and_explains_rejections() -> None:
    doc = ok_json(*FIT, "--top", "0")
    # the allocator's share of an A100-40GB: nvidia-smi's 40,960 MiB less the CUDA context's 767 MiB
    # (memplan.reserved.CUDA_CONTEXT), the layout's NCCL buffers, FSDP2's all-gather stream and the
    # default reserve, now 0
    configs, memory = doc["configs"], (40960 - 767) * 2**20 - doc["reserve"]
    assert doc["reserve"] == 0
    assert len(configs) == doc["fitting"] > 0
    speeds = [c["time"]["tokens_per_s"] for c in configs]
    assert speeds == sorted(speeds, reverse=True)
    for c in configs:
        # NCCL on 8 A100s of one node: each ring (tp, cp, and dp × cp, when more than one rank) 24
        # channels × 12 MiB (a 10 MiB receive and a 2 MiB send connection); pp 2: one peer, 32
        # point-to-point channels (24 rounded up to a power of two) × 12 MiB
        st = c["settings"]
        rings = (st["tp"] > 1) + (st["cp"] > 1) + (st["dp"] * st["cp"] > 1)
        assert st["pp"] <= 2
        nccl = (rings * 24 + (st["pp"] == 2) * 32) * 12 * 2**20
        assert c["fit"]["nccl"] == nccl
        # FSDP2's all-gather stream (ZeRO ≥ 2 over dp · cp > 1; not modelled with tp): at least the first
        # two units' buffers live together, the reference's root (embedding and head [128256, 4096] and the
        # final norm [4096]: 1,050,677,248 el) and layer 0 (q, o [4096, 4096], k, v [1024, 4096], gate, up,
        # down 14336 × 4096, two norms: 218,112,000 el), bf16; no DDP (--impl reference)
        stream = c["fit"]["fsdp_all_gather_stream"]
        assert c["fit"]["ddp_buckets"] == 0
        if st["zero"] < 2 or st["dp"] * st["cp"] == 1:
            assert stream == 0
        elif st["tp"] == 1 and st["pp"] == 1:
            assert stream >= (1_050_677_248 + 218_112_000) * 2
        usable = memory - nccl - stream
        assert c["fit"]["reserved_peak"] <= usable and c["fit"]["fits"] and c["fit"]["usable_bytes"] == usable
        # the replay is the default stream's: the peak less FSDP2's flat all-gather outputs in it
        # (the reference's top layer prefetched at the loss: analytic.fsdp.root), kept back above
        default = c["memory"]["peak_default_stream"]
        assert default <= c["memory"]["peak"]
        assert default <= c["fit"]["allocated_peak"] <= c["fit"]["reserved_peak"]
        assert {"checkpointing", "attention", "zero", "tp", "pp", "dp", "micro_batch"} <= set(c["settings"])
        assert "total" in c["flops"] and c["setup"]["devices"] == 8
    for r in doc["rejected"]:
        assert not r["fit"]["fits"] and r["fit"]["overflow"] in (
            "weights",
            "optimizer",
            "gradients",
            "activations",
            "transient",
            "allocator",
        )
        # the tensors' peak passes the memory, or (allocator) only the replay's reserved peak does
        held = r["fit"]["nccl"] + r["fit"]["fsdp_all_gather_stream"] + r["fit"]["ddp_buckets"]
        usable = memory - held
        assert r["fit"]["usable_bytes"] == usable
        assert (r["fit"]["peak"] > usable) == (r["fit"]["overflow"] != "allocator")
    assert doc["max_seq"] >= 8192 and doc["searched"] >= doc["evaluated"] >= doc["peaks"]


def test_fit_best_config_replans_to_the_same_numbers() -> None:
    doc = ok_json(*FIT, "--top", "1")
    best = doc["configs"][0]
    s = best["settings"]
    options = Options(
        model="llama-3-8b",
        seq=8192,
        batch=s["micro_batch"],
        global_batch=doc["global_batch"],
        checkpointing=s["checkpointing"],
        attention=s["attention"],
        zero=s["zero"],
        tp=s["tp"],
        sp=s["sp"],
        pp=s["pp"],
        vpp=s["vpp"],
        pp_layers=",".join(map(str, s["pp_layers"])) if s["pp_layers"] else None,
        cp=s["cp"],
        hsdp=s["hsdp"] or None,
        gpus=8,
        gpu="a100-40gb",
    )
    built = build(options)
    assert built.result.device.peak.bytes == best["memory"]["peak"]
    assert built.timing is not None and built.timing.tokens_per_s == best["time"]["tokens_per_s"]


def test_fit_tables_show_the_reserved_peak_each_row_is_judged_on() -> None:
    """Llama 3 8B at 16,384 tokens on two A100-40GB: each listed row prints the tensors' peak, the
    allocator's reserved peak (what fits is judged on) and the headroom, the usable memory less the
    reserved peak (the figures of ``--json``); each method's line says the reserved peak, then the
    tensors'; a family rejected by the allocator alone shows both."""
    from memplan.render.estimate import fmt_bytes, fmt_in, unit_of

    args = ("fit", "-m", "llama-3-8b", "--seq", "16384", "--gpu", "a100-40gb", "--gpus", "2", "--top", "3")
    doc, text = ok_json(*args), invoke(*args).stdout
    lines = text.splitlines()
    configs = doc["configs"]
    size, _ = unit_of([c["fit"]["peak"] for c in configs] + [c["fit"]["reserved_peak"] for c in configs])
    for i, c in enumerate(configs, 1):
        fit = c["fit"]
        assert fit["headroom"] == fit["usable_bytes"] - fit["reserved_peak"]
        row = next(line for line in lines if line.startswith(f"│ {i} │"))
        cells = [cell.strip() for cell in row.strip("│").split("│")]
        want = [fmt_in(fit[k], size) for k in ("peak", "reserved_peak")]
        assert cells[cells.index(want[0]) + 1] == want[1], row
    assert len(doc["methods"]) == 3  # full training fits with savers only: LoRA and QLoRA are searched too
    for m in doc["methods"]:
        judged = f"reserved {fmt_bytes(m['reserved'])} (tensors' peak {fmt_bytes(m['peak'])})"
        assert judged in " ".join(text.split()), m["method"]
    assert configs[0]["fit"]["reserved_peak"] == doc["methods"][0]["reserved"]
    allocator = [r for r in doc["rejected"] if r["fit"]["overflow"] == "allocator"]
    assert allocator and all(
        r["fit"]["peak"] <= r["fit"]["usable_bytes"] < r["fit"]["reserved_peak"] for r in allocator
    )


def test_fit_rich_output_and_mistakes() -> None:
    result = invoke(*FIT, "--top", "3")
    assert result.exit_code == 0 and "Configurations that fit" in result.stdout
    assert one_line_error("fit", "-m", "8b", "--gpus", "8").startswith(
        "error: gpu: fit needs --gpu NAME and --gpus N"
    )
    assert one_line_error(*FIT, "--zero", "0,5").startswith("error: zero: cannot read '0,5'")
    assert one_line_error(*FIT, "--checkpointing", "every-2").startswith("error: checkpointing: cannot read")
    assert one_line_error(*FIT, "--tp-max", "0").startswith("error: tp-max: must be at least 1")
    assert one_line_error(*FIT, "--top", "-1").startswith(
        "error: top: must be 0 (every configuration) or more"
    )
    assert one_line_error(*FIT, "--global-batch", "0").startswith("error: global-batch: must be at least one")
    assert one_line_error(*FIT, "--mfu", "2").startswith("error: mfu: must be in [1e-06, 1], got 2.0")


def test_plan_and_fit_stay_torch_free() -> None:
    import subprocess
    import sys

    code = (
        "import sys; from typer.testing import CliRunner; from memplan.cli.app import app; "
        "r = CliRunner().invoke(app, ['fit', '-m', 'gpt2', '--gpu', 'l40s', '--gpus', '2', '--json']); "
        "assert r.exit_code == 0, r.output; assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert estimate  # the API is importable without torch too


def test_a_varied_setting_is_never_shadowed_by_a_figure_of_the_same_name() -> None:
    # optimizer and mfu are settings (--vary) and figures (optimizer memory, the step's MFU) alike.
    out = CliRunner().invoke(
        app,
        [
            "compare",
            "-m",
            "7b",
            "--vary",
            "optimizer=adamw,lion",
            "--vary",
            "mfu=0.3,0.5",
            "--gpu",
            "h100",
            "--csv",
        ],
    )
    assert out.exit_code == 0, out.output
    rows = list(csv.DictReader(io.StringIO(out.stdout)))
    assert [(r["optimizer"], r["mfu"]) for r in rows] == [
        ("adamw", "0.3"),
        ("adamw", "0.5"),
        ("lion", "0.3"),
        ("lion", "0.5"),
    ]
    # AdamW keeps two fp32 states per parameter, Lion one: 12 vs 8 bytes per parameter with the master copy.
    assert int(rows[0]["optimizer_memory"]) * 8 == int(rows[2]["optimizer_memory"]) * 12
    assert float(rows[1]["step_mfu"]) == 0.5


def test_compare_varies_a_list_valued_setting_with_plus() -> None:
    """The commas of --vary separate values, so one value of a list-valued setting joins its entries with +:
    two rows, each equal to the estimate given that list directly."""
    result = invoke(
        "compare", "-m", "8b", "--seq", "4096", "--pp", "2", "--vary", "pp-layers=16+16,8+24", "--json"
    )
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)["rows"]
    assert [r["settings"]["pp-layers"] for r in rows] == ["16,16", "8,24"]
    for row, layers in zip(rows, ("16,16", "8,24"), strict=True):
        ref = build(Options(model="8b", seq=4096, pp=2, pp_layers=layers))  # type: ignore[arg-type]
        assert row["values"]["peak"] == ref.result.device.peak.bytes
