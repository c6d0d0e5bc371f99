"""The typer app: `estimate` (JSON contract and rich output), `presets`, `gpus`, and one-line user errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from memplan.analytic.fsdp.buffers import all_gather_stream, reduce_scatter_stream
from memplan.api import build_setup
from memplan.cli.app import app
from memplan.config import (
    Attention,
    AttentionChoice,
    Checkpointing,
    Device,
    Optimizer,
    Precision,
    Setup,
    StrategyConfig,
    TrainingConfig,
    ZeroStage,
)
from memplan.contract import to_json as contract_json
from memplan.engine import Result, estimate
from memplan.presets import gpu_names, load_model_preset, model_names
from memplan.reserved import replay_device
from memplan.time.async_tp import workspace_bytes
from memplan.time.comm.buffers import ddp_bucket_bytes
from memplan.time.tp_overlap import userbuffer_bytes

ENV = {"COLUMNS": "120", "NO_COLOR": "1"}
runner = CliRunner(env=ENV)


def to_json(r: Result) -> dict[str, Any]:
    """The contract of ``r`` with what ``estimate --json`` adds without a GPU: the allocator's replay,
    FSDP2's all-gather and reduce-scatter streams (their figures by hand: tests/test_fsdp_buffers.py) and
    TE's userbuffers (tests/plan/test_tp_overlap.py) and the symmetric-memory workspace
    (tests/plan/test_async_tp.py)."""
    out = contract_json(r)
    found = replay_device(r)
    st = r.device.stage
    out["memory"].update(
        allocated_peak=found.allocated_peak,
        reserved_peak=found.reserved_peak,
        allocator=found.to_json(),
        fsdp_all_gather_stream=all_gather_stream(r.setup, st.layers, st.first, st.last, r.micro_batches),
        ddp_buckets=ddp_bucket_bytes(r),
        te_userbuffers=userbuffer_bytes(r.setup),
        symm_mem_workspace=workspace_bytes(r.setup),
        fsdp_reduce_scatter_stream=reduce_scatter_stream(
            r.setup, st.layers, st.first, st.last, r.micro_batches
        ),
    )
    return out


def invoke(*args: str) -> Any:
    return runner.invoke(app, list(args))


def estimate_json(*args: str) -> dict[str, Any]:
    result = invoke("estimate", *args, "--json")
    assert result.exit_code == 0, result.output
    assert result.stderr == ""
    doc = json.loads(result.stdout)  # one JSON object and nothing else
    assert isinstance(doc, dict)
    return doc


# ----------------------------------------------------------------------------------------------------
# estimate --json: the contract of DESIGN.md
# ----------------------------------------------------------------------------------------------------
CONTRACT = {
    "params": ("total", "active"),
    "memory": ("weights", "gradients", "optimizer", "activations", "peak"),
    "flops": ("forward", "backward", "recompute", "total", "model"),
}


def test_json_70b_has_every_contract_key_as_integers_and_equals_estimate() -> None:
    doc = estimate_json("--model", "70b", "--seq", "8192")
    for section, keys in CONTRACT.items():
        for key in keys:
            value = doc[section][key]
            assert type(value) is int, f"{section}.{key} = {value!r}"
    assert type(doc["activations"]["per_layer"]) is int
    tensors = doc["activations"]["tensors"]
    assert tensors
    for t in tensors:
        assert isinstance(t["name"], str)
        assert all(type(d) is int for d in t["shape"])
        assert isinstance(t["dtype"], str)
        assert type(t["bytes"]) is int and type(t["count"]) is int
    expected = estimate(
        Setup(model=load_model_preset("llama-3-70b").model, training=TrainingConfig(seq_len=8192))
    )
    assert doc.pop("verdict")["gpu"] == "gb300"  # the verdict panel's answer: tests/test_verdict.py
    assert doc.pop("notes") == []
    assert doc == {**to_json(expected), "fit": None, "time": None}  # no --gpu: no fit, no time
    p = 70_553_706_496
    assert doc["params"]["total"] == p  # Meta-Llama-3-70B model card: 70.6B
    # The values, not only the plumbing: bf16-mixed AdamW on one device, 2 + 2 + 12 bytes a parameter
    # (Transformer Math 101); forward FLOPs 2·T·(a layer's linears: W_Q, W_O [h, h], W_K, W_V [h, 1024],
    # three [h, 28672]) × 80 + the attention core 4·b·a·s²·d × 80 + the head 2·T·h·v; model = 3 × forward.
    m = doc["memory"]
    assert (m["weights"], m["gradients"], m["optimizer"]) == (2 * p, 2 * p, 12 * p)
    t, h = 8192, 8192
    layer = 2 * h * h + 2 * h * 1024 + 3 * h * 28672
    forward = 2 * t * layer * 80 + 80 * 4 * 64 * t * t * 128 + 2 * t * h * 128256
    assert (doc["flops"]["forward"], doc["flops"]["model"], doc["flops"]["recompute"]) == (
        forward,
        3 * forward,
        0,
    )


def test_the_flops_table_adds_up_under_context_parallelism() -> None:
    """At cp 4 the model FLOPs are one device's (``Flops.cp_skipped``): the JSON's and the table's rows add
    up — model = forward + backward − the flash kernel's S + the blocks the cp ranks skip —, and the
    table names the skipped blocks in a row of their own."""
    args = ("-m", "llama-3-8b", "--seq", "32768", "--cp", "4", "--gpus", "4")
    f = estimate_json(*args)["flops"]
    assert f["cp_skipped"] > 0
    assert f["model"] == f["forward"] + f["backward"] - f["kernel_recompute"] + f["cp_skipped"]
    assert f["total"] == f["forward"] + f["backward"] + f["recompute"]
    text = invoke("estimate", *args).stdout
    assert "cp causal skip" in text
    # on a GPU the step's HFU reads below its MFU there, and the time table says why
    timed = estimate_json(*args, "--gpu", "h100-sxm")["time"]
    assert timed["hfu"] < timed["mfu"]
    text = invoke("estimate", *args, "--gpu", "h100-sxm").stdout
    assert "the cp ranks skip the masked blocks" in re.sub(r"[│\s]+", " ", text)  # wrapped cells joined


def test_under_fp8_a_measured_mfu_over_one_is_taken_and_said_to_be_against_the_16_bit_peak() -> None:
    """``--fp8``: MFU stays against the 16-bit peak (torchtitan's convention), the float8 GEMMs run on the
    FP8 peak, so a measured step faster than every model FLOP at the 16-bit peak is a real one (taken,
    exit 0) and the tables say what MFU is against; the JSON carries both peaks. Without ``--fp8`` nothing
    is said."""
    args = ("-m", "llama-3.2-1b", "--seq", "2048", "--gpu", "h100-sxm")
    t = estimate_json(*args, "--fp8", "tensorwise")["time"]
    assert (t["peak_flops_per_device"], t["fp8_peak_flops_per_device"]) == (989.5e12, 1979e12)
    step = 0.75 * t["model_flops_per_step"] / 989.5e12  # MFU 133 %
    measured = estimate_json(*args, "--fp8", "tensorwise", "--step-time", repr(step))["time"]
    assert measured["mfu"] == pytest.approx(1 / 0.75, rel=1e-12)
    result = invoke("estimate", *args, "--fp8", "tensorwise", "--step-time", repr(step))
    assert result.exit_code == 0, result.output
    text = re.sub(r"[│\s]+", " ", result.stdout)  # wrapped cells joined
    assert "133.3%" in text and "--fp8's GEMMs run on the FP8 peak, so it can pass 100%" in text
    assert "--fp8's GEMMs: 1,979.0 TFLOP/s (FP8)" in text
    compared = invoke("compare", *args, "--vary", "fp8=none,tensorwise").stdout
    assert "so it can pass 100%" in re.sub(r"\s+", " ", compared)
    found = invoke("fit", *args, "--gpus", "1", "--fp8", "tensorwise", "--top", "1").stdout
    assert "so it can pass 100%" in re.sub(r"\s+", " ", found)
    assert estimate_json(*args)["time"]["fp8_peak_flops_per_device"] is None
    assert "FP8 peak" not in invoke("estimate", *args).stdout
    assert "FP8 peak" not in invoke("compare", *args, "--vary", "zero=0,1").stdout


def test_compare_says_zero_shards_nothing_over_one_data_parallel_rank() -> None:
    """``compare --vary zero=…`` on one GPU: every stage's row is stage 0's (one shard), which the caption
    says with the fix; over 8 GPUs the stages differ and nothing is said."""
    args = ("-m", "llama-3.2-1b", "--seq", "2048", "--vary", "zero=0,3")
    one = invoke("compare", *args, "--csv").stdout.splitlines()[1:]
    assert len(one) == 2 and one[0].split(",")[2:] == one[1].split(",")[2:]  # the same figures
    note = "zero: over one data-parallel rank (and no cp) ZeRO shards nothing; give --gpus or --dp"
    assert note in re.sub(r"\s+", " ", invoke("compare", *args).stdout)
    assert "shards nothing" not in re.sub(r"\s+", " ", invoke("compare", *args, "--gpus", "8").stdout)


def test_json_with_every_option_equals_estimate_of_the_same_setup() -> None:
    doc = estimate_json(
        "-m", "gpt2", "-s", "512", "-b", "2", "--precision", "fp32", "--optimizer", "sgd-momentum",
        "--grad-accum", "4", "--checkpointing", "every-4", "--attention", "eager", "--zero", "3",
        "--dp", "8", "--dropout", "0.1", "--device", "cpu",
    )  # fmt: skip
    gpt2 = load_model_preset("gpt2").model
    model = gpt2.model_validate(
        {**gpt2.model_dump(), "attn_dropout": 0.1, "resid_dropout": 0.1, "embd_dropout": 0.1}
    )
    setup = Setup(
        model=model,
        training=TrainingConfig(
            micro_batch=2,
            seq_len=512,
            precision=Precision.FP32,
            optimizer=Optimizer.SGD_MOMENTUM,
            grad_accum=4,
        ),
        strategy=StrategyConfig(
            checkpointing=Checkpointing.EVERY_K,
            checkpoint_every=4,
            attention=Attention.EAGER,
            zero=ZeroStage.PARAMETERS,
            dp=8,
        ),
        device=Device.CPU,
    )
    assert doc.pop("verdict")["fits"]  # the verdict panel's answer: tests/test_verdict.py
    assert doc.pop("notes") == []
    assert doc == {**to_json(estimate(setup)), "fit": None, "time": None}


def test_seq_defaults_to_2048_or_the_context_length_if_shorter() -> None:
    assert estimate_json("-m", "llama-3-8b")["setup"]["seq_len"] == 2048
    assert estimate_json("-m", "tiny")["setup"]["seq_len"] == 512  # max_positions of the fixture


def test_build_setup_defaults_are_the_config_defaults() -> None:
    setup = build_setup("tiny", seq=64)
    assert setup == Setup(model=load_model_preset("tiny").model, training=TrainingConfig(seq_len=64))
    assert build_setup("tiny", attention=AttentionChoice.EAGER).strategy.attention is Attention.EAGER


def test_reversible_and_selective_reach_the_setup() -> None:
    assert estimate_json("-m", "tiny", "--reversible")["setup"]["reversible"] is True
    assert (
        estimate_json("-m", "tiny", "--checkpointing", "selective")["setup"]["checkpointing"] == "selective"
    )


# ----------------------------------------------------------------------------------------------------
# Rich output
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "args",
    [
        ("-m", "70b", "--seq", "8192"),
        ("-m", "tiny", "--checkpointing", "full", "--attention", "eager", "--dropout", "0.1"),
        ("-m", "gpt2", "--seq", "1024", "--batch", "8", "--zero", "2", "--dp", "16", "--grad-accum", "8"),
        (
            "-m",
            "llama-3.1-405b",
            "--seq",
            "4096",
            "--checkpointing",
            "selective",
            "--zero",
            "3",
            "--dp",
            "512",
        ),
        ("-m", "mistral-7b", "--reversible", "--precision", "bf16", "--optimizer", "lion", "--device", "cpu"),
        (
            "-m",
            "gpt3-175b",
            "--checkpointing",
            "every-8",
            "--precision",
            "fp16-mixed",
            "--optimizer",
            "adamw-8bit",
        ),
    ],
)
def test_rich_output_runs_and_shows_the_estimate(args: tuple[str, ...]) -> None:
    result = invoke("estimate", *args)
    assert result.exit_code == 0, result.output
    doc = estimate_json(*args)
    assert doc["model"] in result.stdout
    assert f"{doc['activations']['total']:,} bytes" in result.stdout
    assert f"{doc['flops']['total']:,}" in result.stdout
    assert "GiB = 2³⁰ bytes" in result.stdout
    assert result.stderr == ""


def test_the_setup_line_counts_tokens_in_the_numbers_grammar() -> None:
    """One token is "1 token" (``--seq 1`` printed "= 1 tokens"); more keep the plural."""
    one = invoke("estimate", "-m", "tiny", "--seq", "1")
    assert one.exit_code == 0, one.output
    assert "× seq 1 = 1 token ·" in one.stdout
    two = invoke("estimate", "-m", "tiny", "--seq", "1", "--batch", "2")
    assert "× seq 1 = 2 tokens ·" in two.stdout


def test_estimate_help_states_units_and_examples() -> None:
    result = invoke("estimate", "--help")
    assert result.exit_code == 0
    assert "2³⁰" in result.stdout
    assert "memplan estimate --model 70b --seq 8192" in result.stdout


# ----------------------------------------------------------------------------------------------------
# presets, gpus
# ----------------------------------------------------------------------------------------------------
def test_presets_lists_every_model() -> None:
    result = invoke("presets")
    assert result.exit_code == 0, result.output
    for name in model_names():
        assert name in result.stdout


def test_presets_show_gives_the_computed_breakdown() -> None:
    result = invoke("presets", "show", "70b")
    assert result.exit_code == 0, result.output
    assert "llama-3-70b" in result.stdout
    assert "70,553,706,496" in result.stdout  # total = published
    assert "855,654,400" in result.stdout  # one layer


def test_presets_show_reads_a_file(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text(PRESET.format(heads=4), encoding="utf-8")
    result = invoke("presets", "show", str(path))
    assert result.exit_code == 0, result.output
    assert "106,816" in result.stdout


def test_gpus_lists_every_gpu() -> None:
    result = invoke("gpus")
    assert result.exit_code == 0, result.output
    for name in gpu_names():
        assert name in result.stdout


@pytest.mark.parametrize("command", [("estimate", "--model"), ("presets", "show")])
def test_unknown_preset_suggests_names(command: tuple[str, ...]) -> None:
    result = invoke(*command, "70bb")
    assert_one_line_error(result, "model")
    assert "did you mean" in result.stderr and "llama-3-70b" in result.stderr


# ----------------------------------------------------------------------------------------------------
# User mistakes: exit 2, one line on stderr naming the field, no traceback
# ----------------------------------------------------------------------------------------------------
PRESET = """\
name = "mine"
source = "test"
published_params = 106816
[model]
hidden_size = 64
num_layers = 2
num_heads = {heads}
num_kv_heads = 2
ffn_size = 128
vocab_size = 256
"""


def assert_one_line_error(result: Any, field: str) -> None:
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    assert field in lines[0]
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (("--seq", "0"), "seq"),
        (("--seq", "-8"), "seq"),
        (("--seq", "abc"), "seq"),
        (("--batch", "0"), "batch"),
        (("--grad-accum", "0"), "grad-accum"),
        (("--dp", "0"), "dp"),
        (("--zero", "5"), "zero"),
        (("--zero", "-1"), "zero"),
        (("--checkpointing", "every-0"), "checkpointing"),
        (("--checkpointing", "every-999"), "checkpointing"),  # llama-3-70b has 80 layers
        (("--checkpointing", "sometimes"), "checkpointing"),
        (("--reversible", "--checkpointing", "full"), "reversible"),
        (("--precision", "fp8"), "precision"),
        (("--optimizer", "adam"), "optimizer"),
        (("--attention", "sdpa"), "attention"),
        (("--device", "tpu"), "device"),
        (("--dropout", "1.5"), "dropout"),
        (("--dropout", "-0.1"), "dropout"),
        (("--bogus",), "--bogus"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: tuple[str, ...], field: str) -> None:
    assert_one_line_error(invoke("estimate", "--model", "70b", *args, "--json"), field)


def test_zero_message_names_the_fix() -> None:
    result = invoke("estimate", "--model", "70b", "--zero", "5")
    assert result.stderr.strip() == "error: zero: must be 0, 1, 2 or 3, got 5 (use --zero 0, 1, 2 or 3)"


def test_missing_model_is_one_line() -> None:
    assert_one_line_error(invoke("estimate", "--seq", "128"), "--model")


def test_learned_positions_cap_seq() -> None:
    assert_one_line_error(invoke("estimate", "-m", "gpt2", "--seq", "4096"), "seq")


def test_heads_not_dividing_hidden_in_a_preset_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(PRESET.format(heads=6), encoding="utf-8")
    assert_one_line_error(invoke("estimate", "--model", str(path)), "num_heads")


@pytest.mark.parametrize("name", ["missing.toml", "dir"])
def test_file_errors_are_one_line(tmp_path: Path, name: str) -> None:
    (tmp_path / "dir").mkdir()
    assert_one_line_error(invoke("estimate", "--model", str(tmp_path / name)), "model")


def test_unknown_command_is_one_line() -> None:
    result = invoke("estimat")
    assert result.exit_code == 2
    assert len(result.stderr.splitlines()) == 1


# ----------------------------------------------------------------------------------------------------
# torch stays out; python -m memplan
# ----------------------------------------------------------------------------------------------------
def test_estimate_never_imports_torch() -> None:
    code = (
        "import sys, io, contextlib, memplan.cli.app\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        "    try:\n"
        "        args = ['estimate', '--model', '70b', '--seq', '8192', '--json']\n"
        "        memplan.cli.app.app(args, prog_name='memplan')\n"
        "    except SystemExit as e:\n"
        "        assert e.code in (0, None), e.code\n"
        "assert out.getvalue().startswith('{'), out.getvalue()[:200]\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_python_dash_m_memplan() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "memplan", "estimate", "-m", "tiny", "--seq", "16", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["params"]["total"] == 106_816


def test_estimate_takes_a_mixture_of_experts_and_every_parallel_flag() -> None:
    # Mixtral-8x7B: 46,702,792,704 parameters, 12,879,925,248 active (safetensors count and "12.9B" on its
    # Hugging Face page; Jiang et al. 2024).
    doc = estimate_json("--model", "mixtral-8x7b", "--seq", "4096")
    assert (doc["params"]["total"], doc["params"]["active"]) == (46_702_792_704, 12_879_925_248)
    split = estimate_json(
        "-m", "mixtral", "--seq", "4096", "--tp", "2", "--sp", "--pp", "2", "--ep", "4", "--gpus", "32",
        "--zero", "1", "--grad-accum", "8", "--gpu", "h100",
    )  # fmt: skip
    assert split["setup"]["dp"] == 8 and split["setup"]["devices"] == 32
    assert split["memory"]["peak"] < doc["memory"]["peak"]
    t = split["time"]
    # 8 micro-batches × dp 8 × 4,096 tokens; model FLOPs 3 × forward (full training; the flash kernel's
    # re-computed S excluded), forward per micro-batch: 2·T·(the linears one token passes through per
    # layer: W_Q, W_O [h, h], W_K, W_V [h, 1024], router [h, 8], two experts' 3 [h, f]) × 32 layers,
    # the attention core 4·b·a·s²·d × 32, the head 2·T·h·v
    tokens, h, f = 4096, 4096, 14336
    linear = 32 * (2 * h * h + 2 * h * 1024 + h * 8 + 2 * 3 * h * f)
    forward = 2 * tokens * linear + 32 * 4 * 32 * tokens**2 * 128 + 2 * tokens * h * 32000
    assert t["tokens_per_step"] == 8 * 8 * tokens
    assert t["model_flops_per_step"] == 3 * forward * 8 * 8
    assert t["mfu"] == pytest.approx(t["model_flops_per_step"] / (t["step_time_s"] * 32 * 989.5e12))


# ----------------------------------------------------------------------------------------------------
# One engine, one source for options
# ----------------------------------------------------------------------------------------------------
def test_plan_is_estimate_on_any_layout() -> None:
    args = ["-m", "gpt3-175b", "--seq", "2048", "--tp", "8", "--sp", "--pp", "4", "--gpus", "64", "--json"]
    assert estimate_json(*args) == json.loads(invoke("plan", *args).stdout)


def test_every_setting_is_one_option_of_estimate_and_one_setup_key() -> None:
    from memplan.api import Options, setup_of
    from memplan.cli.common import OPTIONS
    from memplan.compare import VARY_KEYS
    from memplan.schema import estimate_schema

    assert set(OPTIONS) == set(Options.model_fields)
    assert set(VARY_KEYS) == {n.replace("_", "-") for n in Options.model_fields} - {"model"}
    help_text = invoke("estimate", "--help").stdout
    for name in Options.model_fields:
        assert f"--{name.replace('_', '-')}" in help_text, name
    settings = setup_of(Options(model="tiny")).settings()
    assert set(settings) == set(estimate_schema()["properties"]["setup"]["properties"])
    assert estimate_json("-m", "tiny")["setup"].items() >= settings.items()


# ----------------------------------------------------------------------------------------------------
# --impl's default: hf for the models only transformers' code is modelled for
# ----------------------------------------------------------------------------------------------------
def test_impl_defaults_to_hf_for_a_model_only_transformers_code_has_and_says_so() -> None:
    """``-m deepseek-v3`` without --impl estimates transformers' DeepSeek-V3 (MLA has no reference model
    here) and a note names why; the same numbers as --impl hf. A Llama keeps the reference, with no note;
    an explicit --impl reference is still refused in one line."""
    args = ("-m", "deepseek-v3", "--seq", "512", "--attention", "eager", "--device", "cpu")
    auto, explicit = estimate_json(*args), estimate_json(*args, "--impl", "hf")
    assert auto["setup"]["impl"] == "hf"
    assert auto["memory"] == explicit["memory"] and auto["flops"] == explicit["flops"]
    assert [n for n in auto["notes"] if n.startswith("impl:")] == [
        "impl: --impl hf chosen for deepseek-v3: its structure (mla, moe.dense_layers, moe.scoring, "
        "moe.groups) is modelled in transformers' code only, not in memplan's reference model; give --impl "
        "to choose"
    ]
    assert not [n for n in explicit["notes"] if n.startswith("impl:")]
    llama = estimate_json("-m", "llama-3-8b", "--seq", "512")
    assert llama["setup"]["impl"] == "reference"
    assert not [n for n in llama["notes"] if n.startswith("impl:")]
    refused = invoke("estimate", *args, "--impl", "reference")
    assert refused.exit_code == 2
    assert (
        refused.stderr.strip() == "error: mla: modelled for transformers' code only; add --impl hf or drop it"
    )
