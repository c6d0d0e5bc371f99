"""``--impl torchtitan --pp P [--vpp M] --compile``: torchtitan's ``apply_compile`` (each block of each model
part compiled alone) inside the pipeline stages, each block run through AOTAutograd's min-cut partitioner
under ``Schedule1F1B`` / ``Interleaved1F1B`` on torch's fake process group
(``memplan.measure.distributed.titan_compiled``), one rank against its estimate: every forward in flight
keeps the partitioner's saved set, and a receiving chunk's first block keeps the receive buffer itself (the
compiled RMSNorm keeps its input x)."""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan.models.llama3")

from memplan.config import Impl, Setup
from memplan.engine import estimate
from memplan.measure.distributed.titan_vpp import measure_titan_pipeline
from tests.hf.harness import hf_setup
from tests.hf.test_torchtitan_pp import ROPE, B, H, S, V, X, held, piped
from tests.hf.test_torchtitan_vpp import sharded, traced_exact

T, F = B * S, 14336
# One compiled llama-3-8b block (bf16, s = 64), what the partitioner keeps (../shared/reference/
# full-scale-on-cpu.md): each RMSNorm's input x (bf16) and fp32 rstd [b, s, 1] (the fp32 upcasts
# recomputed), the normalised input of W_QKV and of W1/W3, q, k, v after RoPE (32 + 8 + 8 heads of 128),
# the fp32 lse [32, s], the attention output, both MLP projections and their product [T, f]; plus the
# layer's RoPE cache (its module buffer, once per layer, as eager).
COMPILED = 2 * (X + B * S * 4) + 2 * X + (32 + 8 + 8) * T * 128 * 2 + 32 * T * 4 + X + 3 * T * F * 2
HEAD = 2 * B * S * H * 4 + B * S * 4 + X + B * S * V * 4 + B * S * 8 + 8 + 4  # test_torchtitan_pp's head


def compiled(layers: int = 6, seq: int = S, checkpointing: str = "none", model: str = "llama-3-8b") -> Setup:
    setup = hf_setup(model, layers=layers, seq=seq, impl=Impl.TORCHTITAN, checkpointing=checkpointing)
    data = setup.model_dump()
    data["impl"] = {**data["impl"], "compile": True}
    return Setup.model_validate(data)


@pytest.mark.parametrize("index", [0, 1, 2])
def test_1f1b_rank_keeps_the_partitioners_saves(index: int) -> None:
    """6 layers over pp 3 (2, 3, 1), n = 5."""
    setup = piped(compiled(), 3, 5)
    run = traced_exact(estimate(setup), setup, index)
    w = (3, 2, 1)[index]  # forwards in flight before the first backward
    assert [run.layer_bytes(i) for i in run.layers] == [w * COMPILED + ROPE] * len(run.layers)
    layers = len(run.layers) * (w * COMPILED + ROPE)
    if index == 0:
        assert run.activations == layers + (4 + 5) * X + 3 * B * S * 8
    if index == 1:
        # the first block's w inputs are receive buffers: 5 − 2 more held (eager keeps all 5 beside its
        # fp32 upcasts)
        assert held(run) == {
            "pp.output": ((B, S, H), 3),
            "pp.recv": ((B, S, H), 3),
            "pp.grad_recv": ((B, S, H), 5),
        }
        assert run.activations == layers + (3 + 3 + 5) * X
    if index == 2:
        assert held(run) == {"pp.recv": ((B, S, H), 4), "pp.logits": ((B, S, V), 1)}
        assert run.activations == layers + 4 * X + B * S * V * 2 + HEAD


@pytest.mark.parametrize("index", [0, 1])
def test_interleaved_fsdp2_rank(index: int) -> None:
    """pp 2 × vpp 2 over 6 layers (1, 2, 2, 1), FSDP2 over dp 2 (ZeRO-3; the compiled block computes with
    the gathered bf16 parameters, FSDP2's hooks outside it): the order of test_torchtitan_vpp's by-hand
    case, each instance the compiled block's."""
    setup = sharded(piped(compiled(), 2, 4, vpp=2), 2, 3)
    run = traced_exact(estimate(setup), setup, index)
    per = ([3, 2, 2], [2, 2, 1])[index]  # forwards of each layer's chunk in flight at the largest moment
    assert [run.layer_bytes(i) for i in run.layers] == [k * COMPILED + ROPE for k in per]


def test_full_ac_keeps_the_block_input_alone() -> None:
    """torchtitan applies AC before compile: a FullAC block keeps its input whatever the partitioner would
    (the estimate's compiled profile under full checkpointing); pp 2 × vpp 2, rank 1."""
    setup = piped(compiled(checkpointing="full"), 2, 4, vpp=2)
    run = traced_exact(estimate(setup), setup, 1)
    assert [run.layer_bytes(i) for i in run.layers] == [2 * X, 2 * X, X]


@pytest.mark.parametrize(
    ("parallel", "fp8"),
    [({"tp": 2, "sp": True}, "none"), ({"cp": 2}, "none"), ({}, "tensorwise")],
    ids=["tp2+sp", "cp2", "float8"],
)
def test_full_ac_keeps_the_block_input_alone_at_any_tp_and_cp(parallel: dict[str, object], fp8: str) -> None:
    """Under FullAC a compiled block keeps its input alone at tp > 1 (a sequence shard under sp), under
    torch's ring and with float8 (measured through dynamo: tests/measure/test_fp8.py), so pp takes --compile
    there: pp 2 × vpp 2, rank 1, traced against its estimate, each layer the uncompiled FullAC stage's."""
    data = compiled(checkpointing="full").model_dump()
    data["impl"] = {**data["impl"], "fp8": fp8}
    setup = piped(Setup.model_validate(data), 2, 4, vpp=2, **parallel)
    est = estimate(setup)
    traced_exact(est, setup, 1)
    # the uncompiled stage's estimate (its FullAC stages traced exact in test_torchtitan_vpp.py): the same
    plain = setup.model_copy(update={"impl": setup.impl.model_copy(update={"compile": False})})
    assert estimate(plain).tensors == est.tensors and estimate(plain).activations == est.activations


def test_real_tensors_save_what_fake_ones_do() -> None:
    """The tiny model on pp 2 (1 layer each), n = 3, with real (uninitialised) tensors over the fake group."""
    setup = piped(compiled(layers=2, seq=32, model="tiny"), 2, 3)
    real = measure_titan_pipeline(setup, 1, fake=False)  # the receiving stage, with the head
    fake = traced_exact(estimate(setup), setup, 1)
    assert sorted((r.shape, r.dtype, r.bytes) for r in real.records) == sorted(
        (r.shape, r.dtype, r.bytes) for r in fake.records
    )


def test_full_scale_405b_last_rank() -> None:
    """Llama 3 405B's widths, 126 layers, seq 8192, pp 16 over 16 micro-batches (1F1B), compiled: rank 15
    (7 layers and the head, one forward in flight) to the byte; the partitioner traces one block once."""
    setup = piped(compiled(layers=126, seq=8192, model="llama-3.1-405b"), 16, 16)
    run = traced_exact(estimate(setup), setup, 15)
    s, h, f, v = 8192, 16384, 53248, 128256
    x = s * h * 2
    # COMPILED at 405B's widths (128 heads, 8 KV heads of 128), and the layer's RoPE cache [s, 64] complex64
    one = 2 * (x + s * 4) + 2 * x + (128 + 8 + 8) * s * 128 * 2 + 128 * s * 4 + x + 3 * s * f * 2
    assert [run.layer_bytes(i) for i in run.layers] == [one + s * 64 * 8] * 7
    # the first block's input is one of the 16 receive buffers
    assert held(run) == {"pp.recv": ((1, s, h), 15), "pp.logits": ((1, s, v), 1)}


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no-sp"])
def test_tensor_parallel_stage_keeps_the_partitioners_saves(sp: bool) -> None:
    """tp 2 stages (pp 2 × vpp 2, n = 4) FSDP2-sharded over dp 2 under ZeRO-3, compiled: the partitioner
    traced once on a block's own DTensor parameters (gathered by FSDP2 for it) and a DTensor input
    (``titan_compiled.compiled_blocks``), rank 1 (the head's) exact against its estimate, with and without
    SP (without: W_O's input gathered in the forward, ``activations.compiled_tp_gathers``)."""
    setup = sharded(piped(compiled(layers=4), 2, 4, vpp=2, tp=2, sp=sp), 2, 3)
    traced_exact(estimate(setup), setup, 1)


@pytest.mark.parametrize("name", ["--cp", "--checkpointing selective", "--fp8"])
def test_unmeasured_compiles_are_refused(name: str) -> None:
    """Where the estimate keeps eager saves under --compile (``blocks.profiles.compile_modelled``) and no
    FullAC makes them the compiled block's, pp refuses it in one line."""
    data = compiled(layers=8, checkpointing="selective" if "selective" in name else "none").model_dump()
    if name == "--fp8":
        data["impl"] = {**data["impl"], "fp8": "rowwise"}
    tp = {"cp": 2} if name == "--cp" else {}
    with pytest.raises(ValueError, match=f"compile: --impl torchtitan --pp --compile with {name} is not"):
        piped(Setup.model_validate(data), 2, 4, **tp)
