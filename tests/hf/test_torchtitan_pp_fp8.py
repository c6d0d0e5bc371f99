"""``--impl torchtitan --pp P [--vpp M] --fp8 rowwise``: each pipeline model part built with torchtitan's
``Float8LinearConverter`` (torchao's ``Float8Linear`` for every linear but the lm head), one rank traced on
torch's fake process group against its estimate. torchao's float8 matmul saves the high-precision input and
weight and casts again in backward, so each stage keeps what its bf16 twin keeps: the pipeline's saves per
layer, holds and parameters are bf16's, to the byte (the casts' temporaries are ``blocks.fp8``'s peak
terms, not saves)."""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan.models.llama3")
pytest.importorskip("torchao.float8")

from memplan.config import Fp8Recipe, Impl, Setup
from memplan.engine import estimate
from memplan.measure.distributed.titan import fake_world
from memplan.measure.distributed.titan_vpp import build_chunk, virtual_module_names
from tests.hf.harness import hf_setup
from tests.hf.test_torchtitan_pp import LAYER, ROPE, B, H, S, V, X, held, piped
from tests.hf.test_torchtitan_vpp import sharded, traced_exact


def float8(setup: Setup) -> Setup:
    """``setup`` under ``--fp8 rowwise`` (torchtitan 0.3.0's converter's default recipe; tensorwise:
    tests/hf/test_torchtitan_tensorwise.py)."""
    data = setup.model_dump()
    data["impl"] = {**data["impl"], "fp8": Fp8Recipe.ROWWISE}
    return Setup.model_validate(data)


def test_model_parts_are_float8() -> None:
    """Each virtual stage's chunk carries torchao's Float8Linear for W_QKV, W_O, W1, W2, W3 (torchtitan's
    ``filter_fqns=["lm_head"]`` keeps the head in bf16): pp 2 × vpp 2, 6 layers (1, 2, 2, 1)."""
    setup = float8(piped(hf_setup("llama-3-8b", layers=6, seq=S, impl=Impl.TORCHTITAN), 2, 4, vpp=2))
    names = virtual_module_names(setup)
    with fake_world(0, 2):
        chunks = [build_chunk(setup, names[v]) for v in range(4)]
    kinds = [[type(m).__name__ for _, m in c.named_modules() if "Linear" in type(m).__name__] for c in chunks]
    # 5 linears a layer (the fused QKV's inner linear, W_O, W1, W2, W3); the last chunk's lm head stays bf16
    assert [k.count("Float8Linear") for k in kinds] == [5, 10, 10, 5]
    assert dict(chunks[3].named_modules())["lm_head"].__class__.__name__ == "Linear"


@pytest.mark.parametrize("index", [0, 1, 2])
def test_1f1b_rank_keeps_bf16s_saves(index: int) -> None:
    """6 layers over pp 3 (2, 3, 1), n = 5: test_torchtitan_pp's by-hand stage totals, unchanged."""
    setup = float8(piped(hf_setup("llama-3-8b", layers=6, seq=S, impl=Impl.TORCHTITAN), 3, 5))
    run = traced_exact(estimate(setup), setup, index)
    w = (3, 2, 1)[index]  # forwards in flight before the first backward
    assert [run.layer_bytes(i) for i in run.layers] == [w * (LAYER - ROPE) + ROPE] * len(run.layers)
    layers = len(run.layers) * (w * (LAYER - ROPE) + ROPE)
    head = 2 * B * S * H * 4 + B * S * 4 + X + B * S * V * 4 + B * S * 8 + 8 + 4
    expected = (
        layers + 4 * X + 5 * X + 3 * B * S * 8,
        layers + 3 * X + 5 * X + 5 * X,
        layers + 5 * X + B * S * V * 2 + head,
    )
    assert run.activations == expected[index]


@pytest.mark.parametrize("index", [0, 1])
def test_interleaved_tp_fsdp2_rank_with_selective_ac(index: int) -> None:
    """pp 2 × vpp 2 over 2 layers (0, 1, 1, 0: the embedding and the head alone on a chunk), tp 2 + SP,
    FSDP2 over dp 2 (ZeRO-3), SelectiveAC, float8, n = 4: each rank's one layer exact. On CPU torchao's
    rowwise GEMM runs as ``aten.mm`` on the upcast operands, so SelectiveAC's mm counter picks the same
    three outputs as in bf16 (test_torchtitan_pp_sac's tensor-parallel case: [T, 24·128], [T, f/2], [T, h]
    and the two [b, s/2, h] reduce-scatters, beside the [b, s/2, h] input)."""
    base = hf_setup("llama-3-8b", layers=2, seq=S, impl=Impl.TORCHTITAN, checkpointing="selective")
    setup = float8(sharded(piped(base, 2, 4, vpp=2, tp=2, sp=True), 2, 3))
    run = traced_exact(estimate(setup), setup, index)
    t, half = B * S, X // 2
    one = half + t * 24 * 128 * 2 + t * 7168 * 2 + t * H * 2 + 2 * half
    # rank 0: layer 1 (virtual stage 2, its second chunk); rank 1: layer 0 (virtual stage 1, its first):
    # at each rank's largest moment two forwards of that chunk are in flight
    assert run.layers == ((1,), (0,))[index]
    assert [run.layer_bytes(i) for i in run.layers] == [2 * one]
    if index == 1:
        assert held(run)["pp.logits"] == ((B, S, V // 2), 1)  # the vocabulary-parallel head's [b, s, v/t]
