"""Context parallelism in the plan: invariants against the one-device estimate and torch's ring.

Independent sources: the one-device estimate itself (proved equal to the measurement elsewhere) for what a
split by the sequence must give; torchtitan's FSDP over dp × cp for the model states. The exchanges are
counted on torch's own ring in tests/measure/test_context_parallel.py (this file stays torch-free: it
judges the mutation run's mutants, docs/mutation.md).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from memplan.api import Options, build
from memplan.config import (
    Attention,
    Checkpointing,
    Device,
    Parallel,
    Setup,
    StrategyConfig,
    TrainingConfig,
    ZeroStage,
)
from memplan.engine import estimate
from memplan.presets import load_model_preset

from .layout import plan


def llama(cp: int = 1, seq: int = 8192, **par: Any) -> Setup:
    return Setup(
        model=load_model_preset("llama-3-8b").model,
        training=TrainingConfig(seq_len=seq, micro_batch=2),
        strategy=StrategyConfig(attention=Attention.FLASH, dp=par.pop("dp", 1), zero=par.pop("zero", 0)),
        parallel=Parallel(cp=cp, **par),
        device=Device.CPU,
    )


def test_cp1_changes_nothing() -> None:
    assert plan(llama(), Parallel(tp=2, sp=True, cp=1)).peak == plan(llama(), Parallel(tp=2, sp=True)).peak
    assert estimate(llama(cp=1)).flops == estimate(llama()).flops


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_every_token_tensor_is_one_cp_th(cp: int) -> None:
    """Per rank, every kept tensor with a token dimension holds 1/cp of the one-device tensor; the only
    addition is the merged ring output (one [b, a, s/cp, d] per layer), the only whole ones the loss's
    scalar weight."""
    one = {k.name: k for k in estimate(llama()).tensors}
    ranked = {k.name: k for k in estimate(llama(cp)).tensors}
    assert set(ranked) - set(one) == {"attn.merged_out"}
    for name, k in one.items():
        if name == "loss.total_weight":
            assert ranked[name].total_bytes == k.total_bytes
        else:
            assert ranked[name].total_bytes * cp == k.total_bytes, name
    m, bf16 = llama().model, 2
    merged = ranked["attn.merged_out"]
    assert merged.total_bytes == m.num_layers * 2 * m.num_heads * (8192 // cp) * m.dim * bf16


@pytest.mark.parametrize("cp", [2, 4])
def test_flops_per_rank_times_cp_is_the_whole_model(cp: int) -> None:
    """Linear layers and the head: the whole model's FLOPs are unchanged by the split (cp ranks × s/cp
    tokens); the attention core is the ring's: per (batch, head) and layer, each rank counts its causal
    step on s/cp tokens and cp−1 half steps, 4·d·(s/cp)²·(cp+1)/2 forward."""
    one, ranked = estimate(llama()).flops, estimate(llama(cp)).flops
    assert ranked.layer_linear == one.layer_linear
    assert ranked.lm_head == one.lm_head
    m, s, b = llama().model, 8192, 2
    per_rank = 4 * b * m.num_heads * m.dim * (s // cp) ** 2 * (cp + 1) // 2
    assert ranked.layer_attention == m.num_layers * cp * per_rank
    assert ranked.forward - ranked.layer_attention == one.forward - one.layer_attention


def test_model_states_shard_over_dp_times_cp() -> None:
    """torchtitan's FSDP mesh ``dp_shard_cp``: ZeRO-3 over dp 2 × cp 4 is ZeRO-3 over 8 ranks."""
    assert (
        estimate(llama(cp=4, dp=2, zero=ZeroStage.PARAMETERS)).states
        == estimate(llama(dp=8, zero=ZeroStage.PARAMETERS)).states
    )


def test_devices_and_layout_label() -> None:
    r = estimate(llama(cp=4, tp=2, sp=True, dp=3))
    assert r.devices == 2 * 4 * 3
    assert "cp4" in r.parallel.label()


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"seq": 8190, "cp": 2}, "seq:"),
        ({"seq": 8192, "cp": 2, "attention": "eager"}, "cp:"),
        ({"seq": 8200, "cp": 4, "tp": 4, "sp": True}, "seq:"),
        ({"seq": 8192, "cp": 4, "gpus": 6}, "gpus:"),
    ],
)
def test_user_mistakes_are_one_line(options: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError) as err:
        build(Options(model="llama-3-8b", **options))
    assert str(err.value).startswith(field) and "\n" not in str(err.value)


def test_gpus_give_dp_over_tp_cp_pp() -> None:
    b = build(Options(model="llama-3-8b", seq=8192, cp=4, tp=2, gpus=64))
    assert b.result.setup.strategy.dp == 8


def test_fit_searches_cp_when_the_sequence_needs_it() -> None:
    """Llama 3 70B at 512K tokens on 64 H100s: nothing fits without context parallelism (cp_max 1);
    with it, every fitting configuration is a ring over cp ranks whose estimate fits, and the longest
    sequence it reports steps by its chunks."""
    from memplan.api import build_setup
    from memplan.presets import load_gpu
    from memplan.search.fit import Space, fit, fits

    base = build_setup("llama-3-70b", seq=1 << 19)
    gpu = load_gpu("h100-sxm")
    space = Space(checkpointing=(Checkpointing.FULL,), micro_batches=(1,))
    assert not fit(base, gpu, 64, global_batch=16, space=replace(space, cp_max=1), max_seq=False).fitting
    found = fit(base, gpu, 64, global_batch=16, space=space)
    assert found.fitting
    for c in found.fitting:
        par = c.result.parallel
        assert par.cp > 1 and par.tp * par.cp * par.pp * c.result.setup.strategy.dp == 64
        assert c.result.setup.strategy.attention is Attention.FLASH
        assert fits(estimate(c.result.setup), found.usable)
    assert found.max_seq is not None and found.max_seq % (2 * found.fitting[0].result.parallel.cp) == 0


def test_the_rings_own_bytes_by_hand() -> None:
    """``context_parallel.ring_bytes`` on the last rank of 8 (Llama 3.1 8B, s 262,144, b 1, bf16): Q =
    32,768 tokens × 32 heads × 128 = 134,217,728 query elements, K = a quarter (8 kv heads).
    Forward: two casts of the output (step 0's to fp32, the merged back: 6 a Q element), then per later
    block its cast (6) and merge (12 + 8 + 12) and a K/V cat (4 a K element, k and v): 12Q + 7·(38Q + 8K).
    Backward: zeros (4Q + 8K), 7 K/V cats (8K each), block 0's adds into the fp32 accumulators (10 an
    element: 10Q + 20K) and the dK/dV cat (16K), each later block's half-dK/dV update (2·(5K + 8K)), cat
    (16K) and dQ add (10Q), the final casts (6Q + 12K)."""
    from memplan.api import build_setup
    from memplan.strategies.context_parallel import ring_bytes

    q, k = 32768 * 32 * 128, 32768 * 8 * 128
    forward = 12 * q + 7 * (38 * q + 8 * k)
    backward = (
        4 * q
        + 8 * k
        + 7 * 8 * k
        + (10 * q + 20 * k + 16 * k)
        + 7 * (26 * k + 16 * k + 10 * q)
        + 6 * q
        + 12 * k
    )
    setup = build_setup("llama-3.1-8b", seq=262144, parallel=Parallel(cp=8))
    assert ring_bytes(setup) == (forward, backward) == (278 * q + 56 * k, 90 * q + 406 * k)
    assert ring_bytes(build_setup("llama-3.1-8b", seq=262144)) == (0, 0)


@pytest.mark.parametrize("checkpointing, reruns", [("none", 0), ("full", 1), ("selective", 1)])
def test_the_rings_bytes_are_charged_as_element_wise_work(
    monkeypatch: pytest.MonkeyPatch, checkpointing: str, reruns: int
) -> None:
    """Every layer's ring bytes at MEMORY × HBM: forward, backward, and the forward again where the
    attention re-runs (full checkpointing, and selective's re-run attention core: once per layer)."""
    from memplan.api import Options, build
    from memplan.strategies import context_parallel
    from memplan.strategies.context_parallel import ring_bytes

    options = Options(
        model="llama-3.1-8b", seq=262144, cp=8, gpus=8, gpu="h100-sxm", checkpointing=checkpointing
    )

    def elementwise_s() -> float:
        timing = build(options).timing
        assert timing is not None
        return timing.prediction.elementwise_s

    with_ring = elementwise_s()
    monkeypatch.setattr(context_parallel, "ring_bytes", lambda setup: (0, 0))
    forward, backward = ring_bytes(build(options).result.pieces.setup)
    assert with_ring - elementwise_s() == pytest.approx(
        32 * (forward + backward + reruns * forward) / (0.80 * 3350e9)
    )
