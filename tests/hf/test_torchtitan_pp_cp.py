"""``--impl torchtitan --pp P [--vpp M] --cp C``: torch's context parallel inside torchtitan's pipeline
stages — one rank of the (pp, dp, cp, tp) mesh torchtitan builds, its micro-batches sharded head-tail, the
positions handed to every stage, each block's attention through torch's ring over the mesh's cp group
(``memplan.measure.distributed.titan_pp_cp``) — against the estimate of that rank (context-parallel rank 0,
the estimate's: the last ring rank keeps one [b, s/c, h] less, tests/measure/test_titan_context.py)."""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan.models.llama3")

from memplan.config import Impl, Setup
from memplan.engine import estimate
from tests.hf.harness import hf_setup
from tests.hf.test_torchtitan_pp import B, H, S, V, held, piped
from tests.hf.test_torchtitan_vpp import sharded, traced_exact

C = 2
T = B * S // C  # the rank's tokens
XC = T * H * 2  # one [b, s/c, h] bf16
# One layer's saves on cp rank 0 (llama-3-8b widths, bf16, s/c = 32 tokens): both norms' fp32 x and x·rstd
# and rstd, W_QKV's, W_O's and W1/W3's bf16 inputs, q and the ring's merged output [b, 32 heads, s/c, 128],
# k and v (8 heads), the fp32 lse [32, s/c], the RoPE rows gathered by position [b, s/c, 64] complex64, the
# MLP's four [T, f]
LAYER = 2 * (2 * T * H * 4 + T * 4) + 3 * XC + 2 * 32 * T * 128 * 2 + 2 * 8 * T * 128 * 2 + 32 * T * 4
LAYER += T * 64 * 8 + 4 * T * 14336 * 2
CACHE = S * 64 * 8  # one layer's whole RoPE cache [s, d/2] complex64: a module buffer, alive all step


def context(checkpointing: str = "none") -> Setup:
    return hf_setup("llama-3-8b", layers=6, seq=S, impl=Impl.TORCHTITAN, checkpointing=checkpointing)


@pytest.mark.parametrize("index", [0, 1, 2])
def test_1f1b_rank_of_a_ring(index: int) -> None:
    """6 layers over pp 3 (2, 3, 1), cp 2, n = 5: s/c tokens through every stage."""
    setup = piped(context(), 3, 5, cp=C)
    run = traced_exact(estimate(setup), setup, index)
    w = (3, 2, 1)[index]
    assert [run.layer_bytes(i) for i in run.layers] == [w * LAYER] * len(run.layers)
    caches = len(run.layers) * CACHE  # the stage's layers' caches, once
    if index == 0:
        assert held(run) == {"pp.output": ((B, T, H), 4), "pp.grad_recv": ((B, T, H), 5)}
        assert run.activations == 2 * w * LAYER + caches + 9 * XC + w * T * 8  # + the sharded ids
    if index == 2:
        assert held(run) == {"pp.recv": ((B, T, H), 5), "pp.logits": ((B, T, V), 1)}


@pytest.mark.parametrize("index", [0, 1])
def test_interleaved_fsdp2_full_ac_rank(index: int) -> None:
    """pp 2 × vpp 2, cp 2, FSDP2 over dp 2 × cp (torchtitan's "fsdp" mesh), FullAC, n = 4: each checkpointed
    block keeps its input and the micro-batch's positions [b, s/c] int64 (one storage per micro-batch in
    flight on the rank: 3 on rank 0, where chunk 0 holds 3 and chunk 1 2 of the same ones)."""
    setup = sharded(piped(context("full"), 2, 4, vpp=2, cp=C), 2, 3)
    run = traced_exact(estimate(setup), setup, index)
    positions = sum(r.bytes for r in run.records if r.name == "rope.positions")
    assert positions == (3, 2)[index] * T * 8


def test_selective_ac_keeps_the_positions() -> None:
    """SelectiveAC's checkpoint_wrapper keeps the block's tensor inputs too: the positions with cp."""
    setup = piped(context("selective"), 2, 4, cp=C)
    run = traced_exact(estimate(setup), setup, 0)
    assert sum(r.bytes for r in run.records if r.name == "rope.positions") == 2 * T * 8


def test_float8_interleaved_fsdp2_selective_rank() -> None:
    """--fp8 rowwise with all of it: pp 2 × vpp 2, cp 2, FSDP2 over dp 2 × cp, SelectiveAC, rank 0 exact
    (torchao's Float8Linear keeps bf16's saves; SelectiveAC's mm counter sees the CPU's aten.mm)."""
    from tests.hf.test_torchtitan_pp_fp8 import float8

    setup = float8(sharded(piped(context("selective"), 2, 4, vpp=2, cp=C), 2, 3))
    traced_exact(estimate(setup), setup, 0)


@pytest.mark.parametrize(("vpp", "checkpointing", "cp_rank", "index"), [(1, "none", 0, 0), (2, "full", 1, 1)])
def test_ring_of_tensor_parallel_stages(vpp: int, checkpointing: str, cp_rank: int, index: int) -> None:
    """cp 2 with tp 2 + SP inside the stages (refused before: installed after torchtitan's
    ``Module.parallelize``, the ring met the stage's DTensor q, k, v — ``all_gather_into_tensor`` has no
    sharding strategy — and now runs inside its ``local_map`` region on the local heads), FSDP2 over
    dp 2 × cp: pipeline rank ``index`` at cp coordinate ``cp_rank`` keeps what the estimate says, to the byte.
    By hand, a layer without checkpointing on the 1F1B rank 0 (2 micro-batches in flight), each micro-batch
    as one cp rank's (``LAYER``) with the heads,
    kv heads and f split over tp, the norms on the SP shard [T/t, h], and W_QKV's and W1/W3's input the
    whole [T, h] gathered over tp; W_O's input [T, h/t]."""
    data = sharded(piped(context(checkpointing), 2, 4, vpp=vpp, cp=C, tp=2, sp=True), 2, 3).model_dump()
    data["parallel"] = {**data["parallel"], "cp_rank": cp_rank}
    setup = Setup.model_validate(data)
    est = estimate(setup)
    run = traced_exact(est, setup, index, cp_rank=cp_rank)
    if vpp == 1:
        t = 2
        norms = 2 * (2 * (T // t) * H * 4 + (T // t) * 4)
        ring = (16 + 16 + 4 + 4) * T * 128 * 2 + 16 * T * 4  # q, the merged output, k, v; the fp32 lse
        layer = norms + 2 * T * H * 2 + T * (H // t) * 2 + ring + T * 64 * 8 + 4 * T * (14336 // t) * 2
        assert {run.layer_bytes(i) for i in run.layers} == {2 * layer}  # 2 micro-batches in flight


def test_one_rank_under_selective_ac_keeps_the_positions() -> None:
    """Without pp too: SelectiveAC's checkpoint keeps each block's positions argument (one storage), as
    FullAC's does (``blocks.attention.rope.titan_cp_rules``); cp rank 0 of 2, 2 layers."""
    from memplan.measure.frameworks.titan import measure_titan

    base = hf_setup("llama-3-8b", layers=2, seq=S, impl=Impl.TORCHTITAN, checkpointing="selective")
    data = base.model_dump()
    data["parallel"] = {**data["parallel"], "cp": C}
    setup = Setup.model_validate(data)
    est = estimate(setup)
    assert measure_titan(setup).activations == est.activations
    assert [k.shape for k in est.tensors if k.name == "rope.positions"] == [(B, T)]


def test_full_scale_4d_rank_of_512() -> None:
    """torchtitan's 4D layout at Llama 3.1 405B's widths (16 of its layers: 2 a stage over pp 8), seq 65,536:
    TP 8 + SP, PP 8 (1F1B, 8 micro-batches), CP 2, FSDP2 over dp 4 × cp under FullAC — pipeline rank 0 of
    the 512-rank fake mesh (its performance.md Table 6 layout, FSDP 4 × CP 2) keeps what the estimate says,
    to the byte: each checkpointed block its input, the SP shard [1, 65,536/2/8, 16,384] bf16 (64 MiB)."""
    setup = sharded(
        piped(
            hf_setup("llama-3.1-405b", layers=16, seq=65536, impl=Impl.TORCHTITAN, checkpointing="full"),
            8,
            8,
            cp=C,
            tp=8,
            sp=True,
        ),
        4,
        3,
    )
    run = traced_exact(estimate(setup), setup, 0)
    inputs = [r.bytes for r in run.records if r.layer in run.layers and r.name != "rope.positions"]
    assert set(inputs) == {65536 // C // 8 * 16384 * 2}
