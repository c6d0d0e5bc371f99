"""``--impl torchtitan --pp P [--vpp M] --checkpointing selective``: torchtitan's op-level ``SelectiveAC``
inside each pipeline stage under ``Schedule1F1B`` and ``Interleaved1F1B``, one rank traced on torch's fake
process group against its estimate (``memplan.measure.distributed.titan_sac``): every forward in flight
keeps its own cache — torchtitan's ``context_fn`` makes a fresh policy (its own mm counter) per block call —
so a layer keeps w copies of the single-forward saves, and a receiving chunk's first block input is the
receive buffer.
"""

from __future__ import annotations

from collections import Counter

import pytest

pytest.importorskip("torchtitan.models.llama3")

from memplan.config import Checkpointing, Impl, Setup
from memplan.engine import Result, estimate
from tests.hf.harness import hf_setup
from tests.hf.test_torchtitan_pp import B, H, S, V, X, held, piped
from tests.hf.test_torchtitan_vpp import real_saves_what_fake_ones_do, sharded, traced_exact

T = B * S
# One block call under SelectiveAC (torchtitan's default config), llama-3-8b's widths (32 heads, 8 KV heads
# of 128, f 14336), bf16: checkpoint_wrapper keeps the block input [b, s, h]; the policy counts the block's
# mms (view → mm → _unsafe_view per nn.Linear on CPU: wqkv, wo, w1, w3, w2 in call order) and caches calls
# 1, 3, 5: W_QKV's [T, (32 + 2·8)·128], W1's [T, f], W2's [T, h]; everything else is recomputed (the CPU
# flash SDPA op is not in its save list).
SAC = X + T * (32 + 2 * 8) * 128 * 2 + T * 14336 * 2 + T * H * 2
HEAD = 2 * B * S * H * 4 + B * S * 4 + X + B * S * V * 4 + B * S * 8 + 8 + 4  # test_torchtitan_pp's head


def selective(layers: int = 6, seq: int = S, model: str = "llama-3-8b") -> Setup:
    return hf_setup(model, layers=layers, seq=seq, impl=Impl.TORCHTITAN, checkpointing="selective")


@pytest.fixture(scope="module")
def one_f_one_b() -> tuple[Setup, Result]:
    """6 layers over pp 3 (torchtitan's placement 2, 3, 1), n = 5."""
    setup = piped(selective(), 3, 5)
    assert setup.parallel.pp_layers == (2, 3, 1)
    return setup, estimate(setup)


@pytest.mark.parametrize("index", [0, 1, 2])
def test_1f1b_rank_caches_per_forward_in_flight(one_f_one_b: tuple[Setup, Result], index: int) -> None:
    setup, est = one_f_one_b
    run = traced_exact(est, setup, index)
    # By hand: stage i runs w = min(n, p − i) = 3, 2, 1 forwards before its first backward; each keeps one
    # cache per block (no RoPE buffer: the rope's saves are inside the checkpoint, recomputed)
    w = (3, 2, 1)[index]
    assert [run.layer_bytes(i) for i in run.layers] == [w * SAC] * len(run.layers)
    layers = len(run.layers) * w * SAC
    if index == 0:
        # w outputs in fwd_cache + send_work's (n = 5 ≥ 2w − 1), 5 gradient buffers, w int64 ids
        assert held(run) == {"pp.output": ((B, S, H), 4), "pp.grad_recv": ((B, S, H), 5)}
        assert run.activations == layers + 9 * X + 3 * B * S * 8
        # each in-flight forward's cache holds the same three mms: the per-call counter restarts
        sac = Counter((r.layer, r.shape) for r in run.records if r.name.startswith("sac · aten.mm"))
        assert sac == {(i, shape): 3 for i in (0, 1) for shape in [(T, 6144), (T, 14336), (T, H)]}
    if index == 1:
        # the first block's input is one of the 5 receive buffers (checkpoint_wrapper keeps it as it is):
        # 5 − w = 3 held beside the w layer saves
        assert held(run) == {
            "pp.output": ((B, S, H), 3),
            "pp.recv": ((B, S, H), 3),
            "pp.grad_recv": ((B, S, H), 5),
        }
        assert run.activations == layers + 11 * X
    if index == 2:
        assert held(run) == {"pp.recv": ((B, S, H), 4), "pp.logits": ((B, S, V), 1)}
        assert run.activations == layers + 4 * X + B * S * V * 2 + HEAD


@pytest.mark.parametrize("index", [0, 1])
def test_interleaved_rank_caches_per_chunk_forward(index: int) -> None:
    """pp 2 × vpp 2 over 6 layers (1, 2, 2, 1), n = 4: the order of test_torchtitan_vpp's by-hand case."""
    setup = piped(selective(), 2, 4, vpp=2)
    run = traced_exact(estimate(setup), setup, index)
    if index == 0:
        # chunk 0 (layer 0) 3 forwards in flight at the largest moment, chunk 1 (layers 3, 4) 2; chunk 1's
        # first block reads a receive buffer: 4 − 2 of them left as pp.recv
        assert [run.layer_bytes(i) for i in run.layers] == [3 * SAC, 2 * SAC, 2 * SAC]
        assert held(run) == {
            "pp.output": ((B, S, H), 8),
            "pp.grad_send": ((B, S, H), 2),
            "pp.recv": ((B, S, H), 2),
            "pp.grad_recv": ((B, S, H), 8),
        }
        assert run.activations == 7 * SAC + 3 * B * S * 8 + (8 + 2 + 2 + 8) * X
    else:
        # chunk 0 (layers 1, 2) 2 forwards, chunk 1 (layer 5) 1; 8 − 3 receive buffers beside the inputs
        assert [run.layer_bytes(i) for i in run.layers] == [2 * SAC, 2 * SAC, SAC]
        assert held(run) == {
            "pp.output": ((B, S, H), 4),
            "pp.grad_send": ((B, S, H), 5),
            "pp.recv": ((B, S, H), 5),
            "pp.grad_recv": ((B, S, H), 4),
            "pp.logits": ((B, S, V), 1),
        }
        assert run.activations == 5 * SAC + (4 + 5 + 5 + 4) * X + B * S * V * 2 + HEAD


def test_tensor_parallel_fsdp2_stage() -> None:
    """pp 2 × vpp 2, tp 2 with SP, FSDP2 over dp 2 (ZeRO-3): rank 0. Under TP the cached mms are the
    rank's (24 heads' worth of W_QKV: (16 + 2·4)·128, W1's f/2, W2's partial sum [T, h]); SP adds the two
    reduce-scatters the comm save list caches ([b, s/2, h] each) and the block input is [b, s/2, h]."""
    setup = sharded(piped(selective(), 2, 4, vpp=2, tp=2, sp=True), 2, 3)
    run = traced_exact(estimate(setup), setup, 0)
    half = X // 2
    one = half + T * 24 * 128 * 2 + T * 7168 * 2 + T * H * 2 + 2 * half
    assert [run.layer_bytes(i) for i in run.layers] == [3 * one, 2 * one, 2 * one]


def test_real_tensors_save_what_fake_ones_do() -> None:
    """The tiny model on pp 2 (1 layer each), n = 3, real (uninitialised) tensors over the fake group: the
    re-run under each call's own cache matches its forward (a mismatch raises in torch's SAC)."""
    setup = piped(selective(layers=2, seq=32, model="tiny"), 2, 3)
    real_saves_what_fake_ones_do(setup)


def test_full_scale_405b_first_rank() -> None:
    """Llama 3 405B's widths, 126 layers, seq 8192, pp 16 over 16 micro-batches (1F1B): rank 0 holds the
    embedding and 7 layers, 16 forwards in flight, each block's cache of its own, to the byte."""
    setup = piped(selective(layers=126, seq=8192, model="llama-3.1-405b"), 16, 16)
    run = traced_exact(estimate(setup), setup, 0)
    s, h, f = 8192, 16384, 53248
    one = s * h * 2 + s * (128 + 2 * 8) * 128 * 2 + s * f * 2 + s * h * 2  # as SAC, at 405B's widths
    assert len(run.layers) == 7
    # 16 outputs (n = 16 < 2w − 1: send_work's never an extra), 16 gradient buffers, 16 forwards' ids
    assert run.activations == 7 * 16 * one + 32 * s * h * 2 + 16 * s * 8


def test_selective_is_lifted() -> None:
    base = selective(layers=8)
    assert piped(base, 2, 4, vpp=2).strategy.checkpointing is Checkpointing.SELECTIVE
