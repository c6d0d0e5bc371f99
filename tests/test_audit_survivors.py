"""Value tests for the six hand-made bugs an independent audit (issue 20) found no value test catching.

Each test derives its expected figure by hand from the configuration (the derivation in the comments) and
asserts the number memplan reports: expert gradients reduced over dp/ep, transformers' fused gate_up
GEMM of its experts, the bubble under an interleaved pipeline, the order of an uneven pipeline split
that removes an odd number of layers, transformers' eager fp32 softmax and its 16-bit copy, and
``compare --vary offload=a+b``. Torch-free, a few seconds.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

from memplan.api import build_setup
from memplan.cli.app import app
from memplan.config import Attention, Impl, ImplConfig, Parallel, Precision
from memplan.engine import estimate
from memplan.strategies.pipeline_parallel import stage_layers
from memplan.time.gemm import Gemm, efficiency, layer_gemms
from tests.tiny_setup import tiny_setup

runner = CliRunner(env={"COLUMNS": "120", "NO_COLOR": "1"})

# Mixtral-8x7B (its preset; huggingface.co/mistralai/Mixtral-8x7B-v0.1 config.json): h 4096, 32 layers,
# 32 heads of 128, 8 kv heads, 8 experts of ffn 14336 (SwiGLU: w1, w3 [h, f], w2 [f, h]), v 32000, untied.
H, L, F, E, V, KV = 4096, 32, 14336, 8, 32000, 8 * 128

# H100 SXM's preset: NVLink 4, 1.5 µs per ring step inside a node of 8; NCCL's ring runs on it at 370 GB/s
# per direction (the preset's intra_node_busbw_gbps: "an effective NVLink bandwidth of 370GB/s",
# NVIDIA/nccl-tests issue #212), of the link's 450.
RING, ALPHA = 370e9, 1.5e-6


def estimate_json(*args: str) -> dict[str, Any]:
    out = runner.invoke(app, ["estimate", *args, "--json"])
    assert out.exit_code == 0, out.output
    doc: dict[str, Any] = json.loads(out.stdout)
    return doc


def all_reduce_s(nbytes: int, n: int) -> float:
    """Ring all-reduce: 2(n−1)/n · B/β + 2(n−1)·α (Patarasuk & Yuan 2009)."""
    return 2 * (n - 1) / n * nbytes / RING + 2 * (n - 1) * ALPHA


# ----------------------------------------------------------------------------------------------------
# 1. Expert gradients are reduced over dp/ep, the dense ones over dp
# ----------------------------------------------------------------------------------------------------
def test_expert_gradients_are_all_reduced_over_dp_over_ep() -> None:
    """Mixtral on 4 GPUs, ep 2 (dp 4), ZeRO 0: every rank holds E/ep = 4 experts; a given expert lives on
    dp/ep = 2 ranks, so its gradients are all-reduced over 2, the dense parameters over all 4."""
    doc = estimate_json("-m", "mixtral-8x7b", "--seq", "64", "--ep", "2", "--gpus", "4", "--gpu", "h100-sxm")
    rows = {r["dimension"]: r for r in doc["time"]["communication"] if r["phase"] == "step"}
    experts = (E // 2) * 3 * H * F * L  # 4 local experts × 3 matrices × 32 layers
    # embedding + head [v, h] each; per layer W_Q, W_O [h, h], W_K, W_V [h, kv], two RMSNorms, router [h, E];
    # the final norm
    dense = 2 * V * H + L * (2 * H * H + 2 * H * KV + 2 * H + H * E) + H
    assert doc["params"]["device"] == dense + experts
    # bf16-mixed: 16-bit gradients, 2 bytes each
    assert rows["dp experts"]["bytes"] == 2 * experts == 45_097_156_608
    assert rows["dp experts"]["group"] == 2
    assert rows["dp experts"]["time_s"] == pytest.approx(all_reduce_s(2 * experts, 2), rel=1e-12)
    assert rows["dp"]["bytes"] == 2 * dense == 3_211_272_192
    assert rows["dp"]["group"] == 4
    assert rows["dp"]["time_s"] == pytest.approx(all_reduce_s(2 * dense, 4), rel=1e-12)


# ----------------------------------------------------------------------------------------------------
# 2. transformers' experts multiply gate and up as one [h, 2f] GEMM
# ----------------------------------------------------------------------------------------------------
def test_hf_moe_experts_run_gate_up_as_one_gemm() -> None:
    """transformers' MixtralExperts hold ``gate_up_proj`` [E, h, 2f]: one grouped product of 2f columns;
    the reference's experts run gate and up apart. b 1, s 64, top-2: S = 128 slots, 16 rows per expert."""
    setups = {
        impl: build_setup("mixtral-8x7b", seq=64, impl=ImplConfig(impl=impl))
        for impl in (Impl.HF, Impl.REFERENCE)
    }
    experts = {impl: [g for g in layer_gemms(s) if g.count == E] for impl, s in setups.items()}
    assert experts[Impl.HF] == [Gemm(16, H, 2 * F, E), Gemm(16, F, H, E)]
    assert experts[Impl.REFERENCE] == [Gemm(16, H, F, E), Gemm(16, H, F, E), Gemm(16, F, H, E)]
    # Wave quantization on H100's 132 SMs (gemm.py, the best of its tiles): the fused [16, 2f] output in
    # 128×256 tiles is ⌈16/128⌉·⌈28672/256⌉·8 = 896 tiles, 7 waves of 132; the separate [16, f] one in
    # 128×128 tiles ⌈16/128⌉·⌈14336/128⌉·8 = 896 tiles, 7 waves too (its 128×256 tiling: 448 tiles in 4
    # waves, 4·132·128·256 > 7·132·128·128, worse)
    assert efficiency(Gemm(16, H, 2 * F, E), 132) == pytest.approx(16 * 28672 * 8 / (7 * 132 * 128 * 256))
    assert efficiency(Gemm(16, H, F, E), 132) == pytest.approx(16 * 14336 * 8 / (7 * 132 * 128 * 128))


# ----------------------------------------------------------------------------------------------------
# 3. The bubble under an interleaved pipeline
# ----------------------------------------------------------------------------------------------------
def test_reported_bubble_is_divided_by_the_virtual_stages() -> None:
    """Narayanan et al. 2021 §2.2.2: the interleaved 1F1B bubble is (p − 1)/(v·m) of the busy time.
    Llama-3-8B (32 layers) on pp 4 × vpp 2, global batch 16 on dp 2: m = 8 micro-batches; (4 − 1)/(2·8)."""
    doc = estimate_json(
        "-m", "llama-3-8b", "--seq", "1024", "--pp", "4", "--vpp", "2", "--gpus", "8", "--global-batch", "16",
        "--gpu", "h100-sxm",
    )  # fmt: skip
    t = doc["time"]
    assert doc["setup"]["micro_batches"] == 8
    assert t["bubble"] == 3 / 16
    # the seconds: the busy time (compute and the stage's exposed tp/ep/cp time; none here) times that
    assert t["predicted"]["bubble_s"] == pytest.approx(t["predicted"]["compute_s"] * 3 / 16, rel=1e-12)
    # and without interleaving, (4 − 1)/8
    plain = estimate_json(
        "-m", "llama-3-8b", "--seq", "1024", "--pp", "4", "--gpus", "8", "--global-batch", "16",
        "--gpu", "h100-sxm",
    )  # fmt: skip
    assert plain["time"]["bubble"] == 3 / 8


# ----------------------------------------------------------------------------------------------------
# 4. An uneven split removes layers from the first stage, then the last, then the second, …
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("layers", "pp", "expected"),
    [
        # ⌈11/4⌉ = 3 each is 12: one too many, taken from the first stage
        (11, 4, (2, 3, 3, 3)),
        # ⌈13/4⌉ = 4 each is 16: three too many — the first, the last, then the second
        (13, 4, (3, 3, 4, 3)),
        # ⌈29/8⌉ = 4 each is 32: three too many — stages 0, 7, 1
        (29, 8, (3, 3, 4, 4, 4, 4, 4, 3)),
        # Llama 3 405B (Dubey et al. 2024 §3.3.2): 126 layers on 16 stages, the first and last one fewer
        (126, 16, (7, *(8,) * 14, 7)),
    ],
)
def test_uneven_split_order(layers: int, pp: int, expected: tuple[int, ...]) -> None:
    assert stage_layers(layers, Parallel(pp=pp)) == expected
    assert sum(expected) == layers


def test_uneven_split_reaches_the_json_stages() -> None:
    """GPT-2 has 12 layers; on 5 stages ⌈12/5⌉ = 3 each is 15, three too many (odd): stages 0, 4, 1 lose
    one — (2, 2, 3, 3, 2). The JSON lists the stages it computed: the first, the last and the busiest."""
    doc = estimate_json("-m", "gpt2", "--seq", "64", "--pp", "5")
    split = (2, 2, 3, 3, 2)
    assert all(s["layers"] == split[s["stage"]] for s in doc["stages"])
    assert {0, 4} <= {s["stage"] for s in doc["stages"]}
    assert doc["parallel"]["pp"] == 5
    assert stage_layers(12, Parallel(pp=5)) == (2, 2, 3, 3, 2)


# ----------------------------------------------------------------------------------------------------
# 5. transformers' eager softmax: fp32 output, and its 16-bit copy only when that is a copy
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("precision", "dropout", "expected"),
    [
        # softmax(dtype=float32): fp32 [b, a, s, s]; .to(bf16) for P·V: a 2-byte copy
        (Precision.BF16_MIXED, 0.0, {"attn.probs_fp32": 4, "attn.probs": 2}),
        # fp32 activations: .to(float32) is the same storage, no copy
        (Precision.FP32, 0.0, {"attn.probs_fp32": 4}),
        # with dropout P·V reads the dropped probabilities (in the activation dtype), not a cast copy
        (Precision.BF16_MIXED, 0.1, {"attn.probs_fp32": 4, "attn.dropout_mask": 1, "attn.probs_dropped": 2}),
        (Precision.FP32, 0.1, {"attn.probs_fp32": 4, "attn.dropout_mask": 1, "attn.probs_dropped": 4}),
    ],
)
def test_hf_eager_softmax_keeps_fp32_and_a_cast_copy_in_the_activation_dtype(
    precision: Precision, dropout: float, expected: dict[str, int]
) -> None:
    # tiny_setup: b 2, a 4, s 32 → [2, 4, 32, 32] = 8,192 elements per layer, 4 layers
    s = tiny_setup(model={"attn_dropout": dropout}, strategy={"attention": Attention.EAGER})
    s = s.model_copy(
        update={
            "impl": ImplConfig(impl=Impl.HF),
            "training": s.training.model_copy(update={"precision": precision}),
        }
    )
    kept = {k.name: k for k in estimate(s).tensors if k.name.startswith("attn.prob") or "dropout" in k.name}
    assert {n: k.bytes for n, k in kept.items() if n.startswith("attn.")} == {
        n: 2 * 4 * 32 * 32 * size for n, size in expected.items()
    }
    assert all(k.count == 4 for k in kept.values())


# ----------------------------------------------------------------------------------------------------
# 6. compare --vary offload=a+b applies both
# ----------------------------------------------------------------------------------------------------
def test_compare_vary_offload_plus_applies_both() -> None:
    """tiny (106,816 parameters), bf16-mixed AdamW, seq 64, one GPU. ``offload=optimizer+activations``:
    the fp32 master weights, m and v (12 bytes a parameter) and the fp32 gradient buffer (4 bytes) move
    to the host, the 16-bit gradients with them; every saved activation leaves the GPU."""
    out = runner.invoke(
        app,
        ["compare", "-m", "tiny", "--seq", "64", "--vary", "offload=none,optimizer+activations", "--json"],
    )
    assert out.exit_code == 0, out.output
    rows = json.loads(out.stdout)["rows"]
    p = 106_816
    assert [r["settings"]["offload"] for r in rows] == ["none", "optimizer,activations"]
    none, both = rows[0]["values"], rows[1]["values"]
    assert (none["weights"], none["gradients"], none["optimizer_memory"]) == (2 * p, 2 * p, 12 * p)
    assert (both["weights"], both["gradients"], both["optimizer_memory"], both["activations"]) == (
        2 * p,
        0,
        0,
        0,
    )
    host = rows[1]["plan"]["memory"]["host"]
    assert (host["optimizer"], host["gradients"]) == (12 * p, 4 * p)
    # the host holds the saves the GPU held without offload, plus the weights they reference (every
    # linear and norm saves its weight for dX = dY·Wᵀ, copied out with them): all parameters but the
    # embedding table (its backward needs only the ids), 16-bit — 106,816 − 256·64
    assert host["activations"] == none["activations"] + 2 * (p - 256 * 64)
    assert rows[1]["plan"]["setup"]["offload"] == "optimizer,activations"
