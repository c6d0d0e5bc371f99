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


def test_torchs_rms_norm_on_cuda_is_its_fused_op_under_its_own_autograd_node() -> None:
    """What ``titan_norm.cuda_rms_norm`` stands on, read from this torch: ``aten._fused_rms_norm`` (which
    ``rms_norm_symint`` calls) has an ``Autograd`` kernel beside its composite and, on a CPU build, no CPU
    kernel — so on CPU its composite runs, while a GPU's CUDA kernel runs under ``FusedRmsNormBackward0``,
    which keeps the input, the weight and ``result1`` (the rstd). Under ``cuda_rms_norm`` ``F.rms_norm``
    records that node, with x itself and an fp32 [.., 1] rstd; outside it, the composite again."""
    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memplan.measure.frameworks.titan_norm import cuda_rms_norm

    op = "aten::_fused_rms_norm"
    assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CompositeImplicitAutograd")
    assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "Autograd")
    assert not torch._C._dispatch_has_kernel_for_dispatch_key(op, "CPU")
    node = torch._C._functions.FusedRmsNormBackward0
    saved = {a for a in dir(node) if a.startswith("_saved_")}
    assert saved == {"_saved_input", "_saved_weight", "_saved_result1", "_saved_normalized_shape"}
    with FakeTensorMode():
        x = torch.empty(1, 256, 4096, dtype=torch.bfloat16, requires_grad=True)
        w = torch.empty(4096, dtype=torch.bfloat16, requires_grad=True)
        with cuda_rms_norm(), cuda_rms_norm():  # re-entrant
            y = F.rms_norm(x, (4096,), w, 1e-5)
        assert type(y.grad_fn).__name__ == "FusedRmsNormBackward0"
        assert y.grad_fn._saved_input is x
        rstd = y.grad_fn._saved_result1
        assert (tuple(rstd.shape), rstd.dtype) == ((1, 256, 1), torch.float32)
        y.sum().backward()
        assert x.grad is not None and x.grad.dtype is torch.bfloat16
        assert type(F.rms_norm(x, (4096,), w, 1e-5).grad_fn).__name__ != "FusedRmsNormBackward0"


def test_each_norm_keeps_its_input_and_rstd_on_cuda_by_hand() -> None:
    """Without checkpointing, Llama-3-8B's widths at s 256: each nn.RMSNorm of torchtitan's model keeps its
    bf16 input [b, s, h] (2·b·s·h B) and its fp32 rstd [b, s, 1] (4·b·s B) on CUDA, where on CPU the
    composite keeps the fp32 upcast x and the fp32 normalised x besides the rstd (8·b·s·h B): 6·b·s·h B
    less per norm, 2 a layer and the final norm's, in the estimate as in the trace."""
    b, s, h, layers = 1, 256, 4096, 2
    meas = measure_titan(cuda_setup("none"))
    norms = [(r.shape, r.dtype) for r in meas.records if "RmsNorm" in r.name]
    assert norms == [((b, s, h), "bf16"), ((b, s, 1), "fp32")] * (2 * layers + 1)
    on_cpu = estimate(cuda_setup("none").model_copy(update={"device": Device.CPU}))
    on_cuda = estimate(cuda_setup("none"))
    cpu_norms = sum(k.total_bytes for k in on_cpu.pieces.kept if "norm" in k.block.value)
    cuda_norms = sum(k.total_bytes for k in on_cuda.pieces.kept if "norm" in k.block.value)
    assert cpu_norms - cuda_norms == (2 * layers + 1) * 6 * b * s * h


@pytest.mark.parametrize(
    ("checkpointing", "tp", "dp", "zero"),
    [("none", 1, 1, 0), ("full", 1, 1, 0), ("selective", 1, 2, 3), ("none", 2, 1, 0), ("full", 2, 2, 3)],
)
def test_every_backward_moment_on_cuda_is_exact(checkpointing: str, tp: int, dp: int, zero: int) -> None:
    """One rank of torchtitan's model on CUDA's kernels (cuDNN's attention, the fused RMSNorm) at
    Llama-3-8B's widths, s 256 (a tp 2 + SP rank among them): the loss's, the final norm's, the layer's
    and the embedding's backward moments measure what the estimate says — the norms' one-op backward
    holding input and rstd (``blocks.norm.released_as``) and, above the attention norm's, W_QKV's
    input-gradient matmul (``analytic.moments.qkv_backward``)."""
    from memplan.measure.distributed.titan import measure_titan_rank
    from memplan.measure.distributed.titan_peak import estimated_moments
    from tests.hf.test_torchtitan_peak import MOMENTS
    from tests.hf.test_torchtitan_ranks import ranked

    base = hf_setup("llama-3-8b", seq=256, impl=Impl.TORCHTITAN, checkpointing=checkpointing)
    cpu = ranked(base, tp, tp > 1, dp, zero)
    setup = cpu.model_copy(update={"device": Device.CUDA})
    measured = measure_titan_rank(setup).peak.moments(MOMENTS)
    estimated = estimated_moments(estimate(setup))
    assert {n: measured[n] - estimated[n] for n in MOMENTS} == dict.fromkeys(MOMENTS, 0)  # type: ignore[operator]


def test_the_composite_norm_on_cuda_keeps_what_the_cpu_kernels_keep() -> None:
    """``--norm-kernel composite`` (CUDA before torch 2.8; torchtitan's 2024 norm of plain ops): the traced
    CUDA run records the composite's saves, equal to the estimate, and its norms keep the fp32 upcast and
    normalised x — the CPU estimate's norm saves, 6·b·s·h B a norm above the fused kernel's."""
    from memplan.config import NormKernel

    fused = cuda_setup("none")
    composite = fused.model_copy(
        update={"impl": fused.impl.model_copy(update={"norm_kernel": NormKernel.COMPOSITE})}
    )
    check_titan(composite)

    def norms(setup: Setup) -> int:
        return sum(k.total_bytes for k in estimate(setup).pieces.kept if "norm" in k.block.value)

    cpu = composite.model_copy(update={"device": Device.CPU})
    b, s, h, layers = 1, 256, 4096, 2
    assert norms(composite) == norms(cpu) == norms(fused) + (2 * layers + 1) * 6 * b * s * h
