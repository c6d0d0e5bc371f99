"""Context parallelism's K/V traffic per layer, by hand from torch's ring (strategies/context_parallel.py's
docstring: ``_templated_ring_attention`` with ``_RotateMethod.ALL_GATHER``).

tests/measure/test_context_parallel.py counts the same collectives on torch's own ring (torch); this file
pins them in the fast, torch-free suite the mutation run uses (docs/mutation.md). Llama-3-8B: 8 kv heads
of d = 128; b = 2, s = 64 over cp = 4 ranks, so one rank holds 16 tokens.
"""

from __future__ import annotations

from typing import Any

import pytest

from memplan.blocks.inventory import Dims
from memplan.config import (
    Attention,
    Checkpointing,
    CpRotate,
    Device,
    DType,
    Parallel,
    Setup,
    StrategyConfig,
    TrainingConfig,
)
from memplan.presets import load_model_preset
from memplan.strategies import context_parallel as cpx

B, KV_HEADS, D = 2, 8, 128


def llama(cp: int, **strategy: Any) -> Setup:
    return Setup(
        model=load_model_preset("llama-3-8b").model,
        training=TrainingConfig(seq_len=64, micro_batch=B, precision="bf16-mixed"),
        strategy=StrategyConfig(attention=Attention.FLASH, **strategy),
        parallel=Parallel(cp=cp),
        device=Device.CPU,
    )


def kv(tokens: int, dtype_bytes: int) -> int:
    """k and v of one rank, [b, kv, tokens, d] each (``torch.cat([k.flatten(), v.flatten()])``)."""
    return 2 * B * KV_HEADS * tokens * D * dtype_bytes


def test_kv_bytes_is_the_ranks_k_and_v() -> None:
    dims = Dims.of(llama(4))
    assert cpx.kv_bytes(dims, DType.BF16) == kv(16, 2) == 131_072
    assert cpx.kv_bytes(dims, DType.FP32) == kv(16, 4)


FP32 = TrainingConfig(seq_len=64, micro_batch=3, precision="fp32")


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_kv_bytes_of_is_kv_bytes_of_the_dims(cp: int) -> None:
    """``kv_bytes_of`` reads the setup without building ``Dims``: the same bytes, here and on an MLA, GQA
    and fp32 rank."""
    for setup in (
        llama(cp),
        llama(cp).model_copy(update={"model": load_model_preset("deepseek-v2-lite").model}),
        llama(cp).model_copy(update={"model": load_model_preset("qwen3-0.6b").model}),
        llama(cp).model_copy(update={"training": FP32}),
    ):
        dims = Dims.of(setup)
        assert cpx.kv_bytes_of(setup) == cpx.kv_bytes(dims, dims.act)
    assert cpx.kv_bytes_of(llama(4)) == kv(16, 2)


def test_no_exchange_without_context_parallelism() -> None:
    assert cpx.kv_exchanges(llama(1)) == []


@pytest.mark.parametrize("cp", [2, 4])
def test_forward_gathers_backward_gathers_again_and_rotates_fp32_gradients(cp: int) -> None:
    """Forward: one all-gather of the bf16 K/V shard, under the first block; backward: the same all-gather
    plus cp rotations of the fp32 dK/dV accumulators (``convert_to_f32``) to rank r+1, the first cp − 1
    each under the next block, the last after the loop (torch 2.13 ``_templated_ring_attention_backward``)."""
    tokens = 64 // cp
    assert cpx.kv_exchanges(llama(cp)) == [
        cpx.Exchange("forward", "all-gather", kv(tokens, 2), 1, "first"),
        cpx.Exchange("backward", "all-gather", kv(tokens, 2), 1, "first"),
        cpx.Exchange("backward", "send-recv", kv(tokens, 4), cp - 1, "blocks"),
        cpx.Exchange("backward", "send-recv", kv(tokens, 4), 1),
    ]


@pytest.mark.parametrize("cp", [2, 4])
def test_alltoall_rotates_kv_per_block(cp: int) -> None:
    """``set_rotate_method("alltoall")``: K/V go to rank r+1 at every block but the last (cp − 1 sends),
    in forward and again in backward, each waited for at the next block."""
    tokens = 64 // cp
    setup = llama(cp)
    setup = setup.model_copy(update={"parallel": Parallel(cp=cp, cp_rotate=CpRotate.ALLTOALL)})
    assert cpx.kv_exchanges(setup) == [
        cpx.Exchange("forward", "send-recv", kv(tokens, 2), cp - 1, "blocks"),
        cpx.Exchange("backward", "send-recv", kv(tokens, 2), cp - 1, "blocks"),
        cpx.Exchange("backward", "send-recv", kv(tokens, 4), cp - 1, "blocks"),
        cpx.Exchange("backward", "send-recv", kv(tokens, 4), 1),
    ]


@pytest.mark.parametrize(
    ("cp", "first", "blocks"), [(2, 2 / 3, 2 / 3), (4, 2 / 5, 4 / 5), (16, 2 / 17, 16 / 17)]
)
def test_block_shares(cp: int, first: float, blocks: float) -> None:
    """A rank's attention cells: its local causal block (s/c)² (counted whole), each later block
    (s/c)²/2: the first block 2/(c+1) of the work, all but the last block 1 − 1/(c+1)."""
    assert cpx.block_shares(cp) == pytest.approx((first, blocks))


@pytest.mark.parametrize(
    ("strategy", "reruns"),
    [
        ({}, False),
        ({"checkpointing": Checkpointing.FULL}, True),
        ({"checkpointing": Checkpointing.SELECTIVE}, True),
        ({"reversible": True}, True),
    ],
)
def test_a_layer_whose_attention_reruns_gathers_once_more(strategy: dict[str, Any], reruns: bool) -> None:
    setup = llama(4, **strategy)
    assert cpx.attention_reruns(setup) is reruns
    recompute = [e for e in cpx.kv_exchanges(setup) if e.phase == "recompute"]
    assert recompute == ([cpx.Exchange("recompute", "all-gather", kv(16, 2), 1)] if reruns else [])
