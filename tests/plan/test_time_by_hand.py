"""Every figure of the time panel, the communication table and compare's time columns, derived by hand
for one small layout: the tiny preset (h 64, 2 layers, 4 heads of 16, 2 kv heads, SwiGLU f 128, v 256,
untied), seq 64, micro-batch 1, bf16-mixed AdamW, flash attention, tp 2 × dp 2 = 4 H100 SXM, ZeRO 0.

The figures the CLI prints (``memplan estimate --gpu``: step time, tokens/s, MFU, HFU, bubble, model and
hardware FLOPs, peak per device, the predicted parts; the communication rows; ``compare``'s step time,
tokens/s, MFU and FLOPs/step) are the JSON's; each is asserted against a derivation from the config, the
GPU preset and the cited constants of time/efficiency.py (MATMUL 0.80, MEMORY 0.80; FlashAttention-2 on
Hopper FA2_HOPPER 0.35, its backward 0.32; LAUNCH_GAP_S 1.1 µs) and the preset's NCCL ring bandwidth on
NVLink 4 (370 GB/s, presets/gpus/h100-sxm.toml), never against memplan's own functions.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

from memplan.cli.app import app

runner = CliRunner(env={"COLUMNS": "120", "NO_COLOR": "1"})
ARGS = ("-m", "tiny", "--seq", "64", "--gpu", "h100-sxm", "--tp", "2", "--dp", "2", "--gpus", "4")

# H100 SXM (its preset, NVIDIA's datasheet): dense bf16 989.5 TFLOP/s, 132 SMs, HBM 3.35 TB/s, 1.5 µs per
# ring step; NCCL's ring on its NVLink 4 runs at 370 GB/s per direction ("an effective NVLink bandwidth of
# 370GB/s", NVIDIA/nccl-tests issue #212, the preset's intra_node_busbw_gbps), of the link's 450.
PEAK, SMS, HBM, NVLINK, ALPHA = 989.5e12, 132, 3350e9, 370e9, 1.5e-6
# the flash core: torch's SDPA runs FlashAttention-2, at 35 % of peak on an H100 for long rows (Shah et al.
# 2024, FlashAttention-3, abstract; time/attention.py), its backward at 318 of 989 TFLOP/s (the same
# paper's backward figure): 0.32; at s 64 with heads of 16 both fall as measured for heads of 64 at the
# shortest length measured, 1,024 (time/efficiency.py FA2_HOPPER_BY_SEQUENCE: 0.163 and 0.103 against the
# 64k head-128 end's 0.351 and 0.327), and its grid, b 1 × 2 heads (a rank's) × 1 query tile over 132 SMs,
# is below the smallest measured (0.485 tiles per SM at 1,024: 0.074 and 0.034 of the full grid's 0.268
# and 0.168, FA2_HOPPER_GRID)
MM, AT, MEM, NET = 0.80 * PEAK, 0.35 * 0.163 / 0.351 * (0.074 / 0.268) * PEAK, 0.80 * HBM, NVLINK
AT_BWD = 0.32 * 0.103 / 0.327 * (0.034 / 0.168) * PEAK

# tiny: T = 64 tokens; per tensor-parallel rank (t 2): q 4·16/2 = 32 columns, k and v 2·16/2 = 16, MLP 64.
T, H, TP = 64, 64, 2
# Forward FLOPs, whole model (2 per multiply-add): per layer the linears 2·T·h·(a·d + 2·kv·d) +
# 2·T·(a·d)·h + 3·2·T·h·f = 4,718,592; the flash core QKᵀ and P·V 2 × 2·b·a·s²·d = 1,048,576; the head
# 2·T·h·v = 2,097,152.
LINEAR = 2 * T * H * (64 + 2 * 32) + 2 * T * 64 * H + 3 * 2 * T * H * 128
CORE = 2 * 2 * 1 * 4 * 64 * 64 * 16
HEAD = 2 * T * H * 256
FORWARD = 2 * LINEAR + 2 * CORE + HEAD
# Backward: linears and head 2× their forward; the flash backward five s×s products (S recomputed, dP,
# dV, dQ, dK), the recomputed S one of them.
BACKWARD = 2 * (2 * LINEAR) + 2 * (5 * CORE // 2) + 2 * HEAD
KERNEL_RECOMPUTE = 2 * (CORE // 2)

# One tile per GEMM (rows, cols ≤ 128): the best tile is 128×128, one wave over 132 SMs, so a product
# [M, K]·[K, N] runs at efficiency M·N/(132·128·128) and takes FLOPs/efficiency = 2·K·132·128·128
# "effective FLOPs" (gemm.py): only the inner dimension K counts.
WAVE = 2 * SMS * 128 * 128
# One layer on one rank, forward: Q, K, V [64, 64]·[64, 32|16|16], O [64, 32]·[32, 64], gate, up, down
# [64, 64]·[64, 64]: inners 64, 64, 64, 32, 64, 64, 64. Backward: dX has inner N, dW inner M = 64:
# Σ N = 32 + 16 + 16 + 64 + 64 + 64 + 64 = 320, plus 7 × 64.
LAYER_FWD, LAYER_BWD = WAVE * 416, WAVE * (320 + 7 * 64)
# The head [64, 64]·[64, 128] (v/t = 128): forward inner 64; backward dX inner 128, dW inner 64.
HEAD_FWD, HEAD_BWD = WAVE * 64, WAVE * (128 + 64)
MATMUL_FWD_S = (2 * LAYER_FWD + HEAD_FWD) / MM
MATMUL_BWD_S = (2 * LAYER_BWD + HEAD_BWD) / MM
# Attention core on a rank: half the heads; the causal kernel runs half of the counted cells (FlashAttention's
# benchmark halves causal FLOPs, and AT is TFLOP/s of that count: time/attention.py causal_work).
ATTN_FWD_S, ATTN_BWD_S = 2 * CORE / TP / 2 / AT, 2 * (5 * CORE // 2) / TP / 2 / AT_BWD
# Element-wise bytes of one layer's forward on a rank (compute.py, elementwise.py: memplan's reference
# model runs eager PyTorch, one kernel per op, e = 2): two RMSNorms, each x.to(fp32) (e + 4), pow (4 + 4),
# mean (4), x·rsqrt (4 + 4), .to(bf16) (4 + e), weight· (e + e) = 28 + 4e = 36 bytes an element of
# [T, h]; two residual adds 3·e; rotary on q and k (a + kv)·d/t elements a token, 10e each (q·cos,
# rotate_half's negation and cat, ·sin, the sum); SwiGLU silu(gate)·up 5e per [T, f/t] element.
ELEMENTWISE = 2 * T * H * 36 + 2 * 3 * T * H * 2 + T * 6 * 16 // TP * 10 * 2 + 5 * 2 * T * 128 // TP
assert ELEMENTWISE == 446_464
# Its backward, by the eager autograd nodes (time/elementwise.py): each RMSNorm 92 bytes an element of
# [T, h] (weight·'s node dY·w 2e, dY·n 3e and its sum e; the cast back e + 4; x·r's dY·r 8, dY·x 12 and its
# sum 4; mean's 4; pow's x.pow(1) 8, ·2 8, ·dY 12; the two fp32 gradients summed 12; the input cast 4 + e);
# gradient sums of tensors used twice, 3e an element of [T, h]: the residual stream before each norm (2),
# the shared input of the separate W_Q, W_K, W_V (2) and of gate and up (1); rotary 17e an element of q
# and k (·cos, ·sin 2e each, the negation e, two slice_backward 2e each, two sums 3e each, the layout
# copy 2e); SwiGLU 9e an element of [T, f/t] (two products and silu_backward, 3e each).
EW_BACKWARD = 2 * T * H * 92 + 5 * 3 * 2 * T * H + T * 6 * 16 // TP * 17 * 2 + 9 * 2 * T * 128 // TP
assert EW_BACKWARD == 1_054_720
# Each eager chain streams at the fraction of HBM measured alone on an H200 (time/efficiency.py
# ELEMENTWISE_STREAM, forward/backward): RMSNorm 0.584/0.664, rotary 0.295/0.348, SwiGLU 0.872/0.877; the
# residual adds and gradient sums at MEMORY 0.80.
NORM_F, ADDS_F = 2 * T * H * 36, 2 * 3 * T * H * 2
ROPE_F, MLP_F = T * 6 * 16 // TP * 10 * 2, 5 * 2 * T * 128 // TP
NORM_B, SUMS_B = 2 * T * H * 92, 5 * 3 * 2 * T * H
ROPE_B, MLP_B = T * 6 * 16 // TP * 17 * 2, 9 * 2 * T * 128 // TP
assert NORM_F + ADDS_F + ROPE_F + MLP_F == ELEMENTWISE and NORM_B + SUMS_B + ROPE_B + MLP_B == EW_BACKWARD
EW_FWD_S = 2 * (NORM_F / 0.584 + ADDS_F / 0.80 + ROPE_F / 0.295 + MLP_F / 0.872) / HBM
EW_BWD_S = 2 * (NORM_B / 0.664 + SUMS_B / 0.80 + ROPE_B / 0.348 + MLP_B / 0.877) / HBM
# Launch gaps of those eager kernels, 1.1 µs each (time/efficiency.py LAUNCH_GAP_S: a CUDA-graph queue of
# tiny x + y kernels, pytorch/pytorch #161104): per layer forward two RMSNorms of 8 kernels (x.to(fp32),
# pow, mean, + eps, rsqrt, x·, .to(bf16), weight·), two residual adds, rotary 5 on q and 5 on k, SwiGLU's
# silu and product: 30; the backward's op lists: two RMSNorms of 17 (the weight's sum in two passes,
# rsqrt's node three on [T, 1]), 5 gradient sums, rotary 10 on q and 10 on k, SwiGLU 3: 62.
KERNELS, BACKWARD_KERNELS = 2 * 8 + 2 + 10 + 2, 2 * 17 + 5 + 20 + 3
GAP_FWD_S, GAP_BWD_S = 2 * KERNELS * 1.1e-6, 2 * BACKWARD_KERNELS * 1.1e-6
FWD_S = MATMUL_FWD_S + ATTN_FWD_S + EW_FWD_S + GAP_FWD_S
BWD_S = MATMUL_BWD_S + ATTN_BWD_S + EW_BWD_S + GAP_BWD_S

# Parameters on one tensor-parallel rank: embedding and head vocabulary-parallel 128·64 each; per layer
# q, o 64·32, k, v 64·16, gate, up, down 64·64 (half of each), two RMSNorm weights of 64 (whole); the
# final norm 64.
RANK_PARAMS = 2 * 128 * 64 + 2 * (2 * 64 * 32 + 2 * 64 * 16 + 3 * 64 * 64 + 2 * 64) + 64
# The optimizer step: memplan's reference optimizer (measure/reference/optim.py, the default under --impl
# reference), one tensor at a time, each kernel reading and writing whole tensors: grad.float() 2 + 4,
# w.mul_ 4 + 4, m.lerp_(g) 4 + 4 + 4, v.mul_ 4 + 4, v.addcmul_(g, g) 4 + 4 + 4, v.sqrt() 4 + 4, .div_ 4 + 4,
# .add_(eps) 4 + 4, w.addcdiv_(m, denom) 4 · 4, p.copy_(w) 4 + 2: 92 bytes a parameter, memory-bound; its
# 10 kernels for each of the 21 tensors (embedding, head, 9 per layer, the final norm) 1.1 µs apart.
OPTIMIZER_S = RANK_PARAMS * 92 / MEM + 10 * (2 + 9 * 2 + 1) * 1.1e-6


def ring(kind: str, nbytes: int, n: int) -> float:
    """One call on n ranks inside the node: all-reduce 2(n−1)/n·B/β + 2(n−1)·α (Patarasuk & Yuan 2009)."""
    assert kind == "all-reduce"
    return 2 * (n - 1) / n * nbytes / NET + 2 * (n - 1) * ALPHA


# Tensor parallelism, one micro-batch: the cross entropy's three fp32 [b, s] all-reduces (max, Σ exp,
# target logit); X = b·s·h·2 = 8,192 bytes all-reduced after the embedding and each layer's attention and
# MLP (5) in forward, and for each layer's two column-parallel inputs and the head's in backward (5).
CE, X = 4 * T, T * H * 2
TP_FWD_S = 3 * ring("all-reduce", CE, 2) + 5 * ring("all-reduce", X, 2)
TP_BWD_S = 5 * ring("all-reduce", X, 2)  # overlapped with the backward's compute
# Data parallelism, ZeRO 0: one all-reduce of the rank's bf16 gradients, under the last backward.
DP_BYTES = 2 * RANK_PARAMS
DP_S = ring("all-reduce", DP_BYTES, 2)
# A collective inside the node slows the compute it overlaps by 18.9 % of the seconds they run together
# (arXiv 2507.03114's average): both groups of 2 are on one node.
SLOW = 0.189
TP_EXPOSED = TP_FWD_S + max(0.0, TP_BWD_S - BWD_S) + SLOW * min(TP_BWD_S, BWD_S)
DP_EXPOSED = max(0.0, DP_S - BWD_S) + SLOW * min(DP_S, BWD_S)
COMPUTE_S = FWD_S + BWD_S
STEP_S = COMPUTE_S + TP_EXPOSED + DP_EXPOSED + OPTIMIZER_S  # no pipeline: no bubble
MODEL_FLOPS = 2 * (FORWARD + BACKWARD - KERNEL_RECOMPUTE)  # dp 2 replicas, one micro-batch each
HARDWARE_FLOPS = 2 * (FORWARD + BACKWARD)


def json_of(*args: str) -> dict[str, Any]:
    out = runner.invoke(app, list(args))
    assert out.exit_code == 0, out.output
    doc: dict[str, Any] = json.loads(out.stdout)
    return doc


def test_the_derivation_holds_its_own_flop_counts() -> None:
    """The hand counts above are the model's: forward 13,631,488, model FLOPs 3 × forward."""
    assert FORWARD == 13_631_488
    assert FORWARD + BACKWARD - KERNEL_RECOMPUTE == 3 * FORWARD
    assert RANK_PARAMS == 53_568


def test_time_panel_by_hand() -> None:
    t = json_of("estimate", *ARGS, "--json")["time"]
    p = t["predicted"]
    assert (t["devices"], t["global_batch"], t["tokens_per_step"]) == (4, 2, 2 * T)
    assert t["peak_flops_per_device"] == PEAK
    assert (t["model_flops_per_step"], t["hardware_flops_per_step"]) == (MODEL_FLOPS, HARDWARE_FLOPS)
    assert t["recompute_flops_per_step"] == 0 and t["bubble"] == 0.0 and p["bubble_s"] == 0.0
    approx = lambda x: pytest.approx(x, rel=1e-12)  # noqa: E731  (float sums in another order)
    assert p["matmul_s"] == approx(MATMUL_FWD_S + MATMUL_BWD_S)
    matmul_flops = 3 * (2 * LINEAR + HEAD) // TP
    assert p["matmul_wave_efficiency"] == approx(matmul_flops / ((MATMUL_FWD_S + MATMUL_BWD_S) * MM))
    assert p["attention_s"] == approx(ATTN_FWD_S + ATTN_BWD_S)
    assert p["elementwise_s"] == approx(EW_FWD_S + EW_BWD_S)
    assert p["launch_s"] == approx(GAP_FWD_S + GAP_BWD_S)
    assert p["compute_s"] == approx(COMPUTE_S)
    assert p["exposed_s"] == {"tp": approx(TP_EXPOSED), "dp": approx(DP_EXPOSED)}
    # the gradients' all-reduce hides behind the last backward: only the slowdown of that backward shows
    assert DP_S < BWD_S and DP_EXPOSED == SLOW * DP_S
    assert p["optimizer_s"] == approx(OPTIMIZER_S)
    assert t["step_time_s"] == p["step_time_s"] == approx(STEP_S)
    assert t["tokens_per_s"] == approx(2 * T / STEP_S)
    assert t["mfu"] == p["mfu"] == approx(MODEL_FLOPS / (STEP_S * 4 * PEAK))
    assert t["hfu"] == approx(HARDWARE_FLOPS / (STEP_S * 4 * PEAK))


def test_communication_rows_by_hand() -> None:
    rows = json_of("estimate", *ARGS, "--json")["time"]["communication"]
    got = [
        (r["dimension"], r["collective"], r["phase"], r["bytes"], r["count"], r["group"], r["link"])
        for r in rows
    ]
    assert got == [
        ("tp", "all-reduce", "forward", CE, 3, 2, "intra-node"),
        ("tp", "all-reduce", "forward", X, 5, 2, "intra-node"),
        ("tp", "all-reduce", "backward", X, 5, 2, "intra-node"),
        ("dp", "all-reduce", "step", DP_BYTES, 1, 2, "intra-node"),
    ]
    times = [r["time_s"] for r in rows]
    expected = [3 * ring("all-reduce", CE, 2), 5 * ring("all-reduce", X, 2), TP_BWD_S, DP_S]
    assert times == pytest.approx(expected, rel=1e-12)
    assert [r["overlaps"] for r in rows] == ["none", "none", "backward", "last backward"]


def test_compare_time_columns_by_hand() -> None:
    """``compare``'s columns for the same layout (ZeRO 0) and ZeRO 1, whose optimizer step owns half the
    rank's parameters (⌈53,568/2⌉) and whose updated weights are all-gathered at the next forward."""
    doc = json_of("compare", *ARGS, "--vary", "zero=0,1", "--json")
    zero0, zero1 = (r["values"] for r in doc["rows"])
    assert zero0["step_time"] == pytest.approx(STEP_S, rel=1e-12)
    assert zero0["tokens_per_s"] == pytest.approx(2 * T / STEP_S, rel=1e-12)
    assert zero0["step_mfu"] == pytest.approx(MODEL_FLOPS / (STEP_S * 4 * PEAK), rel=1e-12)
    assert zero0["flops"] == zero1["flops"] == HARDWARE_FLOPS
    assert zero0["params"] == zero1["params"] == 106_816
    # bf16 weights and gradients of the rank's parameters; fp32 master + m + v: 12 bytes each, ZeRO 1
    # shards them over dp 2
    assert (zero0["weights"], zero0["gradients"], zero0["optimizer_memory"]) == (
        2 * RANK_PARAMS,
        2 * RANK_PARAMS,
        12 * RANK_PARAMS,
    )
    assert zero1["optimizer_memory"] == 12 * (RANK_PARAMS // 2)
    # Activations on a rank (b 1, s 64): model-level token ids int64 [1, 64] and the bf16 rotary tables
    # cos, sin [64, 16]; per layer the fp32 residuals into both RMSNorms [64, 64] with their fp32 rstd
    # [64, 1] and bf16 outputs, the attention's input, q [1, 2, 64, 16], k and v [64, 16] (a rank's heads),
    # the fp32 logsumexp [1, 2, 64], the flash RNG state (2 + 1 uint64), the core's output [64, 32], the
    # MLP's input, gate, activation, up and down input [64, 64] (f/t = 64); the head's final norm (fp32
    # input, rstd, bf16 output), lm_head input, fp32 log-probs [64, v/t = 128], int64 labels, fp32 total
    # weight.
    layer = 2 * (64 * 64 * 4 + 64 * 4 + 64 * 64 * 2) + 64 * 64 * 2 + 2 * 64 * 16 * 2 + 2 * (64 * 16 * 2)
    layer += 2 * 64 * 4 + 3 * 8 + 64 * 32 * 2 + 5 * (64 * 64 * 2)
    head = 64 * 64 * 4 + 64 * 4 + 64 * 64 * 2 + 64 * 64 * 2 + 64 * 128 * 4 + 64 * 8 + 4
    activations = 64 * 8 + 2 * (64 * 16 * 2) + 2 * layer + head
    assert zero0["activations"] == activations == 294_196
    # The peak is the loss backward: weights, optimizer states and every save alive, no gradient yet,
    # nll_loss's and log_softmax's fp32 [T, v/t] gradients, and the fp32 loss scalar; below weights +
    # optimizer + gradients + activations, so the column "transient" (what the peak adds on those) is 0.
    peak = 2 * RANK_PARAMS + 12 * RANK_PARAMS + activations + 2 * 4 * T * 128 + 4
    assert zero0["peak"] == peak
    assert zero0["transient"] == max(0, peak - (16 * RANK_PARAMS + activations)) == 0
    assert zero0["fits"] is zero1["fits"] is True
    # ZeRO 1: the optimizer step moves half the bytes; the gradients are reduce-scattered (half the
    # ring's all-reduce traffic and latency) and the weights all-gathered, both hidden behind compute
    rs = 1 / 2 * DP_BYTES / NET + ALPHA
    assert rs < BWD_S
    # each slows the compute it hides behind (the last backward; the first forward) by 18.9 % of itself
    ag = rs  # the all-gather of the same bytes: the same ring time as the reduce-scatter
    assert ag < FWD_S
    zero1_step = COMPUTE_S + TP_EXPOSED + SLOW * (rs + ag) + (RANK_PARAMS // 2) * 92 / MEM + 210 * 1.1e-6
    assert zero1["step_time"] == pytest.approx(zero1_step, rel=1e-12)
