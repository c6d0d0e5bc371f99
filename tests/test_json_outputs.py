"""Every ``--json`` output of every command, for random valid setups (hypothesis): each number is finite,
each size and time is ≥ 0 (only the named signed differences may be negative), and the whole output
validates against ``memplan schema --command NAME`` — the schema the CLI itself prints.

The setups: the tiny preset (GQA, RoPE, SwiGLU), GPT-2 (learned positions, tied embeddings, GELU) and
Qwen1.5-MoE (a mixture of experts), over strategies, layouts, fine-tuning, offload, losses and GPUs.
A drawn combination memplan refuses (exit 2: a user mistake, e.g. LoRA with offload) is discarded after
checking its refusal is one line; anything else than 0 or 2 fails. Kept fast: few examples; trace runs
the tiny model, profile one short CPU run.
"""

from __future__ import annotations

import json
import math
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # (no stubs installed)
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from memplan.cli.app import app
from memplan.schema import COMMANDS, command_schema

runner = CliRunner(env={"COLUMNS": "120", "NO_COLOR": "1"})
FEW = settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    derandomize=True,
)

SIGNED = {"headroom", "delta", "delta_bytes", "peak_relative_error"}
"""Keys whose numbers are differences (measured − estimated, usable − peak): signed by definition."""


def _schema_of(command: str) -> dict[str, Any]:
    """What ``memplan schema --command COMMAND`` prints (the CLI, not the function behind it)."""
    out = runner.invoke(app, ["schema", "--command", command, "--compact"])
    assert out.exit_code == 0, out.output
    doc: dict[str, Any] = json.loads(out.stdout)
    return doc


VALIDATORS = {c: jsonschema.Draft202012Validator(_schema_of(c)) for c in COMMANDS}


def _no_constant(name: str) -> float:
    raise AssertionError(f"JSON holds {name}, which is not JSON")


def numbers(node: Any, path: str = "") -> list[tuple[str, float]]:
    """Every number of a JSON document with its dotted path (booleans are not numbers)."""
    if isinstance(node, dict):
        return [x for k, v in node.items() for x in numbers(v, f"{path}.{k}")]
    if isinstance(node, list):
        return [x for i, v in enumerate(node) for x in numbers(v, f"{path}[{i}]")]
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return [(path, node)]
    return []


def check_output(command: str, args: list[str]) -> dict[str, Any] | None:
    """Run ``memplan COMMAND ARGS --json``; None when memplan refuses the setup (one line, exit 2), else
    the document after the checks of the module docstring."""
    out = runner.invoke(app, [command, *args, "--json"])
    if out.exit_code == 2:
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert out.stderr.startswith("error: "), out.stderr
        return None
    assert out.exit_code == 0, (args, out.output)
    doc: dict[str, Any] = json.loads(out.stdout, parse_constant=_no_constant)
    for path, value in numbers(doc):
        assert math.isfinite(value), (path, value)
        if path.rsplit(".", 1)[-1].split("[")[0] not in SIGNED:
            assert value >= 0, (path, value)
    errors = [f"{list(e.absolute_path)}: {e.message[:200]}" for e in VALIDATORS[command].iter_errors(doc)]
    assert not errors, errors
    return doc


# ----------------------------------------------------------------------------------------------------
# Random valid setups, as command-line options
# ----------------------------------------------------------------------------------------------------
MODELS = {"tiny": 2, "gpt2": 12, "qwen1.5-moe-a2.7b": 24}
"""Model → layers (pp and vpp divide them)."""
GPUS = ["none", "h100-sxm", "a100-80gb", "rtx-4090", "mi300x"]


@st.composite
def estimate_args(draw: st.DrawFn) -> list[str]:
    """Options drawn to be mostly valid: the combinations memplan refuses as not modelled (fine-tuning
    with model parallelism, reversible layers with checkpointing, …) are drawn rarely, not never."""
    model = draw(st.sampled_from(sorted(MODELS)))
    moe = model.startswith("qwen")
    finetune = "full" if moe else draw(st.sampled_from(["full", "full", "lora", "qlora"]))
    tuned = finetune != "full"
    args = [
        "-m",
        model,
        "--seq",
        str(draw(st.sampled_from([16, 64, 256]))),
        "--batch",
        str(draw(st.integers(1, 3))),
    ]
    args += ["--finetune", finetune]
    tp, pp = (1, 1) if tuned else (draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2])))
    dp = draw(st.sampled_from([1, 2, 4]))
    ep = draw(st.sampled_from([e for e in (1, 2) if dp % e == 0])) if moe else 1
    args += ["--tp", str(tp), "--pp", str(pp), "--dp", str(dp), "--zero", str(draw(st.integers(0, 3)))]
    if ep > 1:
        args += ["--ep", str(ep)]
    attention = draw(st.sampled_from(["flash", "eager"]))
    args += ["--attention", attention]
    if not moe and not tuned and attention == "flash" and draw(st.booleans()):
        args += ["--cp", "2"]  # context parallelism: the sequence split over 2 ranks (16, 64, 256 are even)
        if draw(st.booleans()):
            args += ["--cp-rank", str(draw(st.integers(0, 1)))]  # one ring rank, not the most loaded
    if tp > 1 and draw(st.booleans()):
        args.append("--sp")
    if pp > 1 and MODELS[model] % 4 == 0 and draw(st.booleans()):
        args += ["--vpp", "2", "--grad-accum", "4"]
    elif pp > 1 and draw(st.booleans()):
        first = draw(st.integers(1, MODELS[model] - 1))
        args += ["--pp-layers", f"{first},{MODELS[model] - first}"]
    checkpointing = draw(
        st.sampled_from(["none", "full"] if tuned else ["none", "full", "selective", "every-2"])
    )
    args += ["--checkpointing", checkpointing]
    precision = draw(st.sampled_from(["bf16-mixed", "fp32", "fp16-mixed"]))
    args += ["--precision", precision]
    optimizer = draw(st.sampled_from(["adamw", "adamw-8bit", "sgd-momentum", "lion"]))
    args += ["--optimizer", optimizer]
    if optimizer == "adamw" and not tuned:
        args += ["--optimizer-impl", draw(st.sampled_from(["reference", "for-loop", "foreach", "fused"]))]
    elif optimizer == "adamw-8bit" and not tuned and draw(st.booleans()):
        args += ["--optimizer-impl", "bitsandbytes"]
    plain = checkpointing == "none"
    if not tuned:
        # ZeRO-Offload steps an fp32 master copy of 16-bit weights: not under fp32
        states = ["optimizer", "params"] if precision != "fp32" else []
        offload = draw(st.sampled_from(["none", *states, *(["activations"] if plain else [])]))
        args += ["--offload", offload]
        if offload == "params":
            args[args.index("--zero") + 1] = "3"  # parameter offload shards as ZeRO-3 does
        args += ["--loss", draw(st.sampled_from(["standard", "fused", "chunked:2"]))]
        if plain and offload != "activations" and draw(st.booleans()):
            args.append("--reversible")
    gpu = draw(st.sampled_from(GPUS))
    if gpu != "none":
        args += ["--gpu", gpu]
        if draw(st.booleans()):
            args += ["--mfu", "0.4", "--tokens", "1e9"]
    if draw(st.booleans()):
        args += ["--host-memory", "512"]
    return args


@FEW
@given(estimate_args(), st.booleans())
def test_estimate_json_is_finite_signed_right_and_valid(args: list[str], timeline: bool) -> None:
    doc = check_output("estimate", [*args, *(["--timeline"] if timeline else [])])
    assume(doc is not None)
    assert doc is not None
    assert ("time" in doc and doc["time"] is not None) == ("--gpu" in args)
    assert ("timeline" in doc) == timeline


@FEW
@given(
    estimate_args(), st.sampled_from(["zero=0,3", "checkpointing=none,full", "offload=none,optimizer+params"])
)
def test_compare_json_is_finite_signed_right_and_valid(args: list[str], vary: str) -> None:
    key = vary.split("=")[0]
    i = args.index(f"--{key}") if f"--{key}" in args else -1
    base = args[:i] + args[i + 2 :] if i >= 0 else args
    doc = check_output("compare", [*base, "--vary", vary])
    assume(doc is not None)
    assert doc is not None
    assert len(doc["rows"]) == 2


@settings(FEW, max_examples=2)
@given(
    st.sampled_from(["tiny", "gpt2"]),
    st.sampled_from(["h100-sxm", "rtx-4090"]),
    st.sampled_from([1, 4, 8]),
    st.sampled_from([64, 512]),
)
def test_fit_json_is_finite_signed_right_and_valid(model: str, gpu: str, gpus: int, seq: int) -> None:
    doc = check_output(
        "fit", ["-m", model, "--gpu", gpu, "--gpus", str(gpus), "--seq", str(seq), "--top", "3"]
    )
    assert doc is not None  # a model that does not fit is an answer (an empty list), not a refusal


@settings(FEW, max_examples=2)
@given(
    st.sampled_from(["none", "full", "selective"]),
    st.sampled_from(["flash", "eager"]),
    st.sampled_from(["reference", "hf"]),
)
def test_trace_json_is_finite_signed_right_and_valid(checkpointing: str, attention: str, impl: str) -> None:
    pytest.importorskip("torch")
    if impl == "hf":
        pytest.importorskip("transformers")
    args = ["-m", "tiny", "--seq", "16", "--checkpointing", checkpointing, "--attention", attention]
    doc = check_output("trace", [*args, "--impl", impl])
    assert doc is not None


def test_profile_json_is_finite_signed_right_and_valid() -> None:
    pytest.importorskip("torch")
    args = ["-m", "tiny", "--seq", "16", "--device", "cpu", "--steps", "1", "--warmup", "0", "--timeline"]
    doc = check_output("profile", args)
    assert doc is not None
    assert doc["time"]["device"] == "cpu"


# ----------------------------------------------------------------------------------------------------
# The schemas themselves
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", COMMANDS)
def test_every_schema_is_a_valid_draft_2020_12_schema(command: str) -> None:
    jsonschema.Draft202012Validator.check_schema(_schema_of(command))
    assert _schema_of(command) == command_schema(command)


def test_schema_command_refuses_a_command_without_json_in_one_line() -> None:
    out = runner.invoke(app, ["schema", "--command", "gpus"])
    assert out.exit_code == 2
    assert out.stderr.strip().splitlines() == [
        "error: command: 'gpus' has no --json output; choose one of estimate, compare, fit, trace, profile"
    ]


@pytest.mark.parametrize("impl", ["reference", "for-loop", "foreach", "fused"])
def test_every_optimizer_impl_validates(impl: str) -> None:
    """The bug of issue 20: the schema typed the optional ``optimizer_impl`` as an array, so every output
    given --optimizer-impl failed memplan's own schema."""
    doc = check_output("estimate", ["-m", "tiny", "--optimizer-impl", impl])
    assert doc is not None
    assert doc["setup"]["optimizer_impl"] == impl


@pytest.mark.parametrize("rank", [0, 1])
def test_cp_rank_validates(rank: int) -> None:
    """The same bug for ``cp_rank`` (an optional number): typed as an array, every output given --cp-rank
    failed memplan's own schema."""
    doc = check_output("estimate", ["-m", "tiny", "--seq", "64", "--cp", "2", "--cp-rank", str(rank)])
    assert doc is not None
    assert doc["setup"]["cp_rank"] == rank


def test_schema_rejects_a_negative_time_and_a_float_size() -> None:
    """The sizes and times are typed: a negative seconds figure or fractional bytes fail validation."""
    doc = check_output("estimate", ["-m", "tiny", "--gpu", "h100-sxm"])
    assert doc is not None
    bad = json.loads(json.dumps(doc))
    bad["time"]["predicted"]["attention_s"] = -1e-9
    assert not VALIDATORS["estimate"].is_valid(bad)
    bad = json.loads(json.dumps(doc))
    bad["time"]["communication"] = [{**_ROW, "bytes": 1.5}]
    assert not VALIDATORS["estimate"].is_valid(bad)


_ROW = {
    "dimension": "dp",
    "collective": "all-reduce",
    "phase": "step",
    "bytes": 8,
    "count": 1,
    "group": 2,
    "link": "intra-node",
    "time_s": 1e-6,
    "overlapped": False,
    "overlaps": "none",
    "what": "gradients",
}


def test_lora_attention_time_is_the_attention_cores_and_never_negative() -> None:
    """Found by the property above: under LoRA/QLoRA the step time took the linears' backward as 2× their
    forward (dX and dW), but a frozen weight skips dW, so the attention class got the difference: a
    negative ``attention_s``. The attention core runs the same products whether or not the linears train
    (flash: forward QKᵀ and P·V, backward five s×s products; tiny: b 1, a 4, s 64, d 16), so its seconds
    under LoRA equal full training's."""
    full = check_output("estimate", ["-m", "tiny", "--seq", "64", "--gpu", "h100-sxm"])
    lora = check_output("estimate", ["-m", "tiny", "--seq", "64", "--gpu", "h100-sxm", "--finetune", "qlora"])
    assert full is not None and lora is not None
    # 2 layers × (forward 2 + backward 5 products) × 2·b·a·s²·d FLOPs each, at FlashAttention-2's 35 %
    # forward and 32 % backward on Hopper (time/efficiency.py FA2_HOPPER, FA2_HOPPER_BACKWARD: Shah et al.
    # 2024) of H100 SXM's dense bf16 989.5 TFLOP/s; the
    # causal kernel runs half the counted cells (time/attention.py causal_work)
    core = 2 * 2 * 1 * 4 * 64 * 64 * 16  # one product, both layers
    # forward 2 products at FA2_HOPPER 0.35, backward 5 at FA2_HOPPER_BACKWARD 0.32, each times the rate
    # measured at s 1,024 (the shortest, for s 64) with heads of 64 (tiny's are 16) over the 64k head-128
    # end (time/efficiency.py FA2_HOPPER_BY_SEQUENCE: 0.163/0.351 forward, 0.103/0.327 backward)
    # and tiny's grid, 4 heads × 1 query tile over 132 SMs, below the smallest measured: the 1,024 row's
    # 0.074/0.268 forward, 0.034/0.168 backward (FA2_HOPPER_GRID)
    fwd, bwd = 0.35 * 0.163 / 0.351 * (0.074 / 0.268), 0.32 * 0.103 / 0.327 * (0.034 / 0.168)
    seconds = (2 * core / fwd + 5 * core / bwd) / 2 / 989.5e12
    assert full["time"]["predicted"]["attention_s"] == pytest.approx(seconds, rel=1e-12)
    assert lora["time"]["predicted"]["attention_s"] == pytest.approx(seconds, rel=1e-12)
