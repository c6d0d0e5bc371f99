"""torchtitan's context parallel (``--impl torchtitan --cp c``) measured: one rank of torchtitan's own Llama 3
with its inputs, labels and positions sharded head-tail as ``prepare_context_parallel_input`` does and torch's
ring inside each block's SDPA (``memplan.measure.frameworks.titan``), over a fake process group, against the
estimate per tensor, per layer and in FLOPs — at Llama 3 8B's and Llama 3.1 405B's widths (2 layers), the
405B case at seq 131,072 over cp 16 under fake tensors. Expected values come from the measurement or are
derived by hand below, never from the estimate's own functions.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torchtitan.models.llama3")  # needs spmd_types, tyro, torch_checkpointing, triton

from memplan.config import Device, Impl, ModelConfig, Setup
from memplan.engine import estimate
from memplan.measure.compare.impl import paired_tensors
from memplan.measure.compare.tensors import estimated_layers
from memplan.measure.frameworks.dispatch import check_traceable
from memplan.measure.frameworks.titan import measure_titan
from tests.hf.harness import hf_setup


def with_cp(setup: Setup, cp: int, rotate: str = "allgather") -> Setup:
    return Setup.model_validate({**setup.model_dump(), "parallel": {"cp": cp, "cp_rotate": rotate}})


def unequal(setup: Setup, measured: Any) -> list[Any]:
    """Everything where the estimate and one rank's run differ: unpaired tensors, layers, total, FLOPs (the
    estimate's FLOPs are the whole model's: cp × one rank's)."""
    est, cp = estimate(setup), setup.parallel.cp
    wrong: list[Any] = [r["name"] for r in paired_tensors(est, measured) if r["delta_bytes"]]
    layers = [measured.layer_bytes(i) for i in range(setup.model.num_layers)]
    if estimated_layers(est) != layers:
        wrong.append(("layers", estimated_layers(est), layers))
    if est.activations != measured.activations:
        wrong.append(("total", est.activations, measured.activations))
    flops = (est.flops.forward, est.flops.backward, est.flops.recompute)
    if flops != tuple(cp * measured.flops[k] for k in ("forward", "backward", "recompute")):
        wrong.append(("flops", flops, measured.flops))
    return wrong


CASES = {
    "8b-cp2-b2": (hf_setup("llama-3-8b", seq=256, batch=2, impl=Impl.TORCHTITAN), 2, "allgather"),
    "8b-cp4-full": (
        hf_setup("llama-3-8b", seq=256, batch=2, checkpointing="full", impl=Impl.TORCHTITAN),
        4,
        "allgather",
    ),
    "8b-cp2-alltoall": (hf_setup("llama-3-8b", seq=128, impl=Impl.TORCHTITAN), 2, "alltoall"),
}


@pytest.mark.parametrize("name", CASES)
def test_rank_zero_equals_the_estimate(name: str) -> None:
    base, cp, rotate = CASES[name]
    setup = with_cp(base, cp, rotate)
    assert not unequal(setup, measure_titan(setup, cp_rank=0))


def test_llama_405b_cp16_at_131072_tokens() -> None:
    """Llama 3.1 405B's widths (h 16,384, 128 heads, 8 kv heads, d 128, ffn 53,248), seq 131,072 over cp 16:
    rank 0 of torchtitan's model under fake tensors keeps what the estimate says, to the byte."""
    setup = with_cp(hf_setup("llama-3.1-405b", seq=131072, impl=Impl.TORCHTITAN), 16)
    measured = measure_titan(setup, cp_rank=0)
    assert not unequal(setup, measured)
    # By hand: each of the 2 layers' RoPE buffers is [131072, 64] complex64 (8 B), whole on every rank;
    # the rank's gathered rows are [1, 131072/16, 64] complex64 per layer.
    rows = measured.by_name()
    assert rows["rope · buffers"].bytes == 2 * 131072 * 64 * 8
    assert rows["attention.rope · Mul"].bytes == 2 * (131072 // 16) * 64 * 8


def tiny() -> ModelConfig:
    return ModelConfig(
        name="titan-tiny",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        ffn_size=96,
        vocab_size=128,
        max_positions=64,
    )


def test_fake_rank_equals_real_rank() -> None:
    setup = with_cp(hf_setup(tiny(), seq=32, batch=2, impl=Impl.TORCHTITAN), 2)
    real, fake = measure_titan(setup, fake=False, cp_rank=1), measure_titan(setup, fake=True, cp_rank=1)
    assert real.records == fake.records
    assert real.flops == fake.flops


def test_last_rank_keeps_no_copy_of_the_output() -> None:
    """On rank c−1 every ring step merges the whole output, which keeps the kernel's [b, s, a, d] layout:
    torchtitan's ``.contiguous()`` after the inner attention is then a no-op and W_O's saved input is a view
    of the SDPA output — one [b, s/c, h] activation fewer per layer than rank 0 (the estimate's, the most
    loaded): b 2 × s/c 32 × h 64 × 2 B (bf16) = 8,192 B per layer."""
    setup = with_cp(hf_setup(tiny(), seq=64, batch=2, impl=Impl.TORCHTITAN), 2)
    est, last = estimate(setup), measure_titan(setup, cp_rank=1)
    per_layer = 2 * (64 // 2) * 64 * 2
    assert [last.layer_bytes(i) for i in range(2)] == [b - per_layer for b in estimated_layers(est)]
    assert last.activations == est.activations - 2 * per_layer
    # --cp-rank 1: the estimate of that rank is its run, tensor for tensor
    ranked = setup.model_copy(update={"parallel": setup.parallel.model_copy(update={"cp_rank": 1})})
    assert unequal(ranked, measure_titan(ranked)) == []


@pytest.mark.parametrize("rank", [0, 1])
def test_a_cuda_rank_runs_torchs_cudnn_ring_and_equals_the_estimate(rank: int) -> None:
    """``--device cuda``: the inner attention is torch's ``_scaled_dot_product_ring_cudnn_attention`` (cuDNN's
    kernel, as torchtitan's SDPA picks it on CUDA) under the fake mode, saving its [b, a, s, 1] logsumexp
    and philox seed and offset; with ``--cp-rank`` each rank equals its estimate."""
    plain = with_cp(hf_setup(tiny(), seq=64, batch=2, impl=Impl.TORCHTITAN), 2)
    parallel = plain.parallel.model_copy(update={"cp_rank": rank})
    setup = plain.model_copy(update={"device": Device.CUDA, "parallel": parallel})
    assert unequal(setup, measure_titan(setup)) == []


def test_cp_is_traceable_for_torchtitan_only() -> None:
    check_traceable(with_cp(hf_setup("llama-3-8b", seq=256, impl=Impl.TORCHTITAN), 2))
    with pytest.raises(ValueError, match="--cp"):
        with_cp(hf_setup("llama-3-8b", seq=256, impl=Impl.HF), 2)


def test_trace_impl_torchtitan_cp_through_the_cli() -> None:
    """``memplan trace --impl torchtitan --cp 2``: rank 0 of torchtitan's model, equal to the estimate."""
    import json

    from typer.testing import CliRunner

    from memplan.cli.app import app

    args = ["trace", "--impl", "torchtitan", "-m", "tiny", "--seq", "64", "--cp", "2", "--attention", "flash"]
    result = CliRunner().invoke(app, [*args, "--device", "cpu", "--json"], env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    diff = json.loads(result.stdout)["diff"]
    assert diff["exact"] and diff["total"]["estimated"] == diff["total"]["measured"]
