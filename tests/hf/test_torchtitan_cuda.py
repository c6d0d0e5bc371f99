"""torchtitan's Llama 3 on CUDA's attention op, without a GPU: ``measure_titan`` under ``--device cuda`` runs
each block's SDPA as the op a GPU dispatches under torchtitan's cuDNN-first priority
(``aten._scaled_dot_product_cudnn_attention``, its meta kernel under fake tensors on CPU;
``measure.frameworks.titan_attention.cudnn_attention`` says why that is the GPU's op sequence), with
torchtitan's own ``SelectiveAC`` policy over its own block. Saved bytes per layer and in total, and FLOPs
per phase, equal the estimate's to the byte and the FLOP; the per-layer bytes are also derived by hand."""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan.models.llama3")  # needs spmd_types, tyro, torch_checkpointing, triton

from memplan.config import Device, Impl, Setup
from memplan.engine import estimate
from memplan.measure.compare.tensors import estimated_layers
from memplan.measure.frameworks.titan import measure_titan
from tests.hf.harness import check_titan, hf_setup

GQA_64 = {"head_dim": 64, "num_heads": 16, "num_kv_heads": 4}  # a head dim apart from h / a


def cuda_setup(checkpointing: str, **fields: object) -> Setup:
    cpu = hf_setup("llama-3-8b", seq=256, checkpointing=checkpointing, impl=Impl.TORCHTITAN, **fields)
    return cpu.model_copy(update={"device": Device.CUDA})


@pytest.mark.parametrize("fields", [{}, GQA_64])
@pytest.mark.parametrize("checkpointing", ["selective", "none"])
def test_cuda_attention_saves_what_the_estimate_says(checkpointing: str, fields: dict[str, object]) -> None:
    setup = cuda_setup(checkpointing, **fields)
    check_titan(setup)


def test_selective_ac_caches_the_cudnn_outputs_by_hand() -> None:
    """Llama-3-8B's widths, b 1, s 256: the block input [b, s, h], the 1st, 3rd and 5th mm outputs
    (W_QKV [T, (a + 2kv)·d], W1 [T, f], W2 [T, h]) and the cuDNN op's output [b, a, s, d] (bf16), fp32
    logsumexp [b, a, s, 1] and two int64 philox scalars; re-run: W_O and W3 (2·T·h·a·d + 2·T·h·f per
    layer), not the attention core (its cached op returns without running)."""
    b, s, h, a, kv, d, f, layers = 1, 256, 4096, 32, 8, 128, 14336, 2
    t = b * s
    per_layer = (
        2 * (b * s * h + t * (a + 2 * kv) * d + t * f + t * h) + 2 * b * a * s * d + 4 * b * a * s + 16
    )
    meas = measure_titan(cuda_setup("selective"))
    assert [meas.layer_bytes(i) for i in range(layers)] == [per_layer] * layers
    assert meas.flops["recompute"] == layers * (2 * t * h * a * d + 2 * t * h * f)
    kept = {r.name for r in meas.records if r.layer == 0}
    assert "sac · aten._scaled_dot_product_cudnn_attention.default" in kept


@pytest.mark.parametrize("sp", [False, True])
def test_tp_rank_caches_its_heads_cudnn_outputs(sp: bool) -> None:
    """A tp 2 rank of torchtitan's parallelised model (DTensor, torch's fake process group) under SelectiveAC
    on CUDA: the rank's a/t = 16 heads' cuDNN output and logsumexp join the CPU set (block input, W_QKV,
    W1, W2's partial sum; under SP the two reduce-scatter outputs); equal to the estimate, and by hand."""
    from memplan.measure.distributed.titan import measure_titan_rank
    from tests.hf.test_torchtitan_ranks import ranked

    cpu = ranked(hf_setup("llama-3-8b", seq=256, impl=Impl.TORCHTITAN, checkpointing="selective"), 2, sp)
    setup = cpu.model_copy(update={"device": Device.CUDA})
    est, meas = estimate(setup), measure_titan_rank(setup).measured
    assert estimated_layers(est) == [meas.layer_bytes(i) for i in range(2)]
    assert est.activations == meas.activations
    assert est.flops.recompute == meas.flops["recompute"]
    b, s, h, t, d = 1, 256, 4096, 2, 128
    local = b * (s // t if sp else s) * h * 2  # the block's input: the sequence shard under SP
    mms = b * s * (16 + 2 * 4) * d * 2 + b * s * 7168 * 2 + b * s * h * 2  # W_QKV, W1, W2 (partial)
    scattered = 2 * b * (s // t) * h * 2 if sp else 0  # reduce_scatter_tensor after W_O and W2
    sdpa = b * 16 * s * d * 2 + b * 16 * s * 4 + 16  # the rank's heads: output, fp32 lse, two int64
    assert meas.layer_bytes(0) == local + mms + scattered + sdpa
