"""The predicted step's parts (issue #21 item 4): fine-tuning and offload in time, every term listed, the
parts adding up to the step in every command that prints them, no negative time anywhere.

Every expected figure is derived here by hand from the configuration and the constants' sources.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from memplan.api import Options, build
from memplan.cli.app import app
from memplan.time import efficiency as eff

runner = CliRunner(env={"COLUMNS": "120", "NO_COLOR": "1"})

README_QLORA = dict(  # README's QLoRA example
    model="llama-3-8b",
    seq=2048,
    finetune="qlora",
    lora_rank=16,
    lora_targets="all-linear",
    double_quant=True,
    optimizer="adamw-8bit",
    gpu="rtx-4090",
)
RTX_4090_BF16 = 165.2e12  # dense bf16 with fp32 accumulate (the preset's Ada whitepaper figure)
RTX_4090_HBM = 1008e9  # GDDR6X, 1,008 GB/s

# Llama-3-8B: h 4096, 32 heads of 128, 8 kv heads, f 14336, 32 layers.
H, A, KV, D, F, L = 4096, 32, 8, 128, 14336, 32
LINEARS = {  # (fan in, fan out) of each layer's linears
    "q": (H, A * D),
    "k": (H, KV * D),
    "v": (H, KV * D),
    "o": (A * D, H),
    "gate": (H, F),
    "up": (H, F),
    "down": (F, H),
}


def _predicted(**kw: object) -> dict[str, object]:
    b = build(Options(**kw))  # type: ignore[arg-type]
    assert b.timing is not None
    return b.timing.prediction.to_json()


def _double_quant_bytes(n: int) -> int:
    """bitsandbytes' NF4 storage with double quantisation (README: n/2 packed, a uint8 absmax per 64, a
    fp32 offset, a fp32 absmax per 256 blocks, the 256- and 16-entry fp32 code books)."""
    blocks = math.ceil(n / 64)
    return n // 2 + blocks + 4 + 4 * math.ceil(blocks / 256) + 256 * 4 + 16 * 4


def test_readme_qlora_attention_is_the_cores_flops_at_its_fraction() -> None:
    # The flash core: forward QKᵀ and P·V 2 × 2·b·a·s²·d; backward five products 5 × 2·b·a·s²·d (every
    # layer: the q, k, v adapters make the core's output need a gradient) → 14·b·a·s²·d per layer.
    flops = 14 * 1 * A * 2048**2 * D * L
    pr = _predicted(**README_QLORA)
    # The causal kernel runs half of the counted cells (time/attention.py causal_work).
    assert pr["attention_s"] == pytest.approx(flops / 2 / (eff.ATTENTION * RTX_4090_BF16), rel=1e-12)


def test_readme_qlora_optimizer_steps_the_adapters_only() -> None:
    # 41,943,040 trainable (README, peft's count); bf16-mixed with AdamW8bit: master fp32 read + written
    # (2·4), two 1-byte states read + written (2·2), the bf16 gradient read (2), the bf16 weight written (2)
    # = 16 bytes per trainable parameter, at MEMORY × 1,008 GB/s.
    pr = _predicted(**README_QLORA)
    assert pr["optimizer_s"] == pytest.approx(41_943_040 * 16 / (eff.MEMORY * RTX_4090_HBM), rel=1e-12)


def test_readme_qlora_dequantises_every_linear_forward_and_for_dx() -> None:
    # Each call reads the 4-bit storage and writes the bf16 weight (2 bytes an element). Forward: 7 linears
    # × 32 layers. Backward: dX wherever the linear's input needs a gradient — all but layer 0's q, k, v
    # (their input is the frozen norm of the frozen embedding's output): 32·7 − 3 calls.
    call = {t: _double_quant_bytes(i * o) + 2 * i * o for t, (i, o) in LINEARS.items()}
    forward = L * sum(call.values())
    backward = forward - call["q"] - call["k"] - call["v"]
    pr = _predicted(**README_QLORA)
    assert pr["dequant_s"] == pytest.approx((forward + backward) / (eff.MEMORY * RTX_4090_HBM), rel=1e-12)


@pytest.mark.parametrize(
    "kw",
    [
        README_QLORA,
        dict(model="llama-3-8b", seq=2048, finetune="lora", lora_rank=8, gpu="a100-80gb"),
        dict(model="llama-3-8b", seq=4096, gpu="h100-sxm"),  # full training, one device
        dict(model="llama-3-8b", seq=4096, gpu="h100-sxm", gpus=8, tp=2, pp=2, grad_accum=4, zero=1),
        dict(model="llama-3-8b", seq=4096, gpu="h100-sxm", gpus=8, zero=3, offload="optimizer,params"),
        dict(model="llama-3-8b", seq=4096, gpu="h100-sxm", gpus=8, zero=2, offload="activations"),
    ],
)
def test_the_parts_add_up_to_the_step_and_none_is_negative(kw: dict[str, object]) -> None:
    pr = _predicted(**kw)
    parts = pr["parts"]
    assert isinstance(parts, dict)
    assert all(v >= 0 for v in parts.values())
    assert sum(parts.values()) == pytest.approx(pr["step_time_s"], rel=1e-12)


def _cli_json(*args: str) -> object:
    r = runner.invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_estimate_prints_every_part_and_they_add_up() -> None:
    args = [
        "estimate",
        "-m",
        "llama-3-8b",
        "--seq",
        "4096",
        "--gpu",
        "h100-sxm",
        "--gpus",
        "8",
        "--zero",
        "2",
    ]
    args += ["--offload", "optimizer"]
    d = _cli_json(*args)
    assert isinstance(d, dict)
    pr = d["time"]["predicted"]
    assert sum(pr["parts"].values()) == pytest.approx(d["time"]["step_time_s"], rel=1e-12)
    text = runner.invoke(app, args).stdout
    for name, seconds in pr["parts"].items():  # every non-zero term is a row of the table
        if seconds:
            assert f"  {name} " in text, name


def test_compare_times_offload_and_finetuning_apart() -> None:
    common = ["-m", "llama-3-8b", "--seq", "4096", "--gpu", "h100-sxm", "--gpus", "8", "--zero", "2"]
    rows = _cli_json("compare", *common, "--vary", "offload=none,optimizer")
    steps = _row_steps(rows)
    none = _predicted(model="llama-3-8b", seq=4096, gpu="h100-sxm", gpus=8, zero=2)
    off = _predicted(model="llama-3-8b", seq=4096, gpu="h100-sxm", gpus=8, zero=2, offload="optimizer")
    assert steps == pytest.approx([none["step_time_s"], off["step_time_s"]], rel=1e-12)
    # Optimizer offload trades the GPU step for the CPU's and the copies: 8,030,261,248 parameters over 8
    # ranks (ZeRO ≥ 1) = 1,003,782,656 each; the CPU reads and writes fp32 master and two fp32 states
    # (2·12), reads the fp32 host gradient (4), writes the bf16 weight (2): 30 bytes each, at 0.80 × one
    # eighth of DGX H100's 614.4 GB/s.
    host = 1_003_782_656 * 30 / (eff.HOST_MEMORY * 614.4e9 / 8)
    assert off["host_optimizer_s"] == pytest.approx(host, rel=1e-12)
    assert off["optimizer_s"] == 0
    # the updated bf16 weights back over PCIe Gen5 x16 (64 GB/s a direction at HOST_LINK), exposed
    assert off["offload_step_s"] == pytest.approx(1_003_782_656 * 2 / (eff.HOST_LINK * 64e9), rel=1e-12)
    assert off["step_time_s"] > none["step_time_s"]


def _row_steps(rows: object) -> list[float]:
    """Each compare row's step time, after checking that its printed parts add up to it."""
    assert isinstance(rows, dict)
    out = []
    for r in rows["rows"]:
        t = r["plan"]["time"]
        assert sum(t["predicted"]["parts"].values()) == pytest.approx(t["step_time_s"], rel=1e-12)
        assert r["values"]["step_time"] == t["step_time_s"]
        out.append(float(t["step_time_s"]))
    return out


def test_activation_offload_copies_both_ways_serially() -> None:
    # save_on_cpu copies each saved tensor out in the forward and back in the backward on the compute
    # stream: the host's activation bytes twice over the host link, none hidden (one micro-batch).
    b = build(Options(model="llama-3-8b", seq=4096, gpu="h100-sxm", gpus=8, zero=2, offload="activations"))
    assert b.timing is not None
    saved = b.result.device.host.activations
    pr = b.timing.prediction
    assert pr.offload_micro_batch_s == pytest.approx(2 * saved / (eff.HOST_LINK * 64e9), rel=1e-12)


@st.composite
def setups(draw: st.DrawFn) -> dict[str, object]:
    """Options of a random step: full training on a random layout, or fine-tuning on one replica (what
    memplan models it for); offload, kernels and GPU random."""
    kw: dict[str, object] = {
        "model": draw(st.sampled_from(["tiny", "gpt2", "llama-3-8b", "mixtral-8x7b"])),
        "seq": draw(st.sampled_from([128, 1024, 4096])),
        "batch": draw(st.sampled_from([1, 2])),
        "attention": draw(st.sampled_from(["eager", "flash"])),
        "grad_accum": draw(st.sampled_from([1, 4])),
        "gpu": draw(st.sampled_from(["h100-sxm", "a100-40gb", "rtx-4090", "mi300x", "b200"])),
        "compile": draw(st.booleans()),
        "fp8": draw(st.sampled_from(["none", "none", "tensorwise", "rowwise"])),
    }
    if kw["gpu"] == "a100-40gb":
        kw["fp8"] = "none"
    if draw(st.booleans()):  # fine-tuning: one unsplit replica, data parallel at most
        kw["finetune"] = draw(st.sampled_from(["lora", "qlora"]))
        kw["checkpointing"] = draw(st.sampled_from(["none", "full"]))
        kw["gpus"] = draw(st.sampled_from([1, 8]))
        kw["zero"] = draw(st.integers(0, 2))
        kw["offload"] = draw(st.sampled_from(["none", "optimizer"])) if kw["zero"] else "none"
        return kw
    gpus, tp, pp = draw(st.sampled_from([(1, 1, 1), (8, 1, 1), (8, 2, 1), (8, 2, 2), (16, 1, 4)]))
    zero = draw(st.integers(0, 3))
    # the interleaved schedule and the gradient reduction's dtype (ZeRO 2's reduce-scatter window)
    kw["vpp"] = draw(st.sampled_from([1, 2])) if pp > 1 else 1
    kw["reduce_dtype"] = draw(st.sampled_from([None, "fp32", "bf16"]))
    if draw(st.booleans()):  # Megatron's switches: TE's userbuffers, float8 primary weights (any GPU's rule)
        kw.update(impl="megatron", sp=tp > 1, tp_comm_overlap=draw(st.booleans()))
        kw["fp8"] = (
            draw(st.sampled_from(["none", "tensorwise", "delayed"])) if kw["fp8"] != "none" else "none"
        )
        kw["fp8_param_gather"] = kw["fp8"] != "none" and zero == 1 and draw(st.booleans())
        # a mixture of experts: ep, and its experts folded (--etp 1) or split over tp
        kw.update(ep=draw(st.sampled_from([1, 2])), etp=draw(st.sampled_from([None, 1])) if tp > 1 else None)
    elif tp > 1 and draw(st.booleans()):  # torchtitan's async TP: its fused collectives and added kernels
        kw.update(impl="torchtitan", sp=True, compile=True, async_tp=True, attention="flash")
    offloads = ["none", "optimizer", "activations"] + (["optimizer,params"] if zero == 3 else [])
    kw.update(
        checkpointing=draw(st.sampled_from(["none", "full", "selective"])),
        gpus=gpus,
        tp=tp,
        pp=pp,
        zero=zero,
        offload=draw(st.sampled_from(offloads)) if zero else "none",
    )
    return kw


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]
)
@given(kw=setups())
def test_no_negative_time_over_random_setups(kw: dict[str, object]) -> None:
    try:
        b = build(Options(**kw))  # type: ignore[arg-type]
    except ValueError:
        assume(False)
        return
    assert b.timing is not None
    pr = b.timing.prediction
    parts = pr.parts()
    assert all(math.isfinite(v) and v >= 0 for v in parts.values()), parts
    assert sum(parts.values()) == pytest.approx(pr.step_time_s, rel=1e-9)
    assert pr.step_time_s > 0


def test_compare_times_lora_apart_from_full_training() -> None:
    rows = _cli_json(
        "compare", "-m", "llama-3-8b", "--seq", "2048", "--gpu", "a100-80gb", "--vary", "finetune=full,lora"
    )
    full, lora = _row_steps(rows)
    assert lora < full
    # LoRA r 8 on q, v (the defaults): 32 layers × 8 × ((4096 + 4096) + (4096 + 1024)) = 3,407,872
    # trainable; bf16-mixed AdamW in memplan's reference optimizer (time/optimizer.py: the bf16 gradient's
    # fp32 copy 6, the eight update kernels on the fp32 master, m and v 80, the copy back 6): 92 bytes each
    # at MEMORY × 2,039 GB/s, and its 10 kernels for each of the 128 adapter tensors (A and B on q and v in
    # 32 layers), LAUNCH_GAP_S apart.
    pr = _predicted(model="llama-3-8b", seq=2048, gpu="a100-80gb", finetune="lora")
    seconds = 3_407_872 * 92 / (eff.MEMORY * 2039e9) + 10 * 128 * eff.LAUNCH_GAP_S
    assert pr["optimizer_s"] == pytest.approx(seconds, rel=1e-12)
