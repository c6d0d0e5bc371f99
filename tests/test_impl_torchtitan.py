"""``--impl torchtitan`` without torch: what its profile changes against memplan's reference, term by term
(the derivation of each fact is in ``memplan/blocks/profile.py``; tests/hf/test_torchtitan.py measures
them), and what the setup refuses."""

from __future__ import annotations

import pytest

from memplan.api import build_setup
from memplan.config import AttentionChoice, Device, Impl, ImplConfig, Parallel
from memplan.config.finetune import FineTune, Method
from memplan.engine import estimate
from memplan.measure.compare.tensors import estimated_layers
from memplan.presets import load_gpu
from memplan.time.comm.rows import critical_stage
from memplan.time.compute import kernel_times, stage_flops
from memplan.time.layer_elementwise import streamed_bytes

TITAN = ImplConfig(impl=Impl.TORCHTITAN)


@pytest.mark.parametrize("batch", [1, 2])
def test_titan_keeps_what_its_profile_says(batch: int) -> None:
    ref = build_setup("llama-3-8b", seq=1024, batch=batch, device=Device.CPU)
    titan = build_setup("llama-3-8b", seq=1024, batch=batch, device=Device.CPU, impl=TITAN)
    b, s, h, d = batch, 1024, 4096, 128
    normed = 2 * b * s * h  # F.rms_norm's normalised x in fp32 (4 B) instead of bf16 (2 B)
    rope = s * (d // 2) * 8  # each layer's complex64 cache [s, d/2], whatever the batch
    per_layer = 2 * normed + rope
    r, t = estimate(ref), estimate(titan)
    assert [x - y for x, y in zip(estimated_layers(t), estimated_layers(r), strict=True)] == [per_layer] * 32
    cos_sin = 2 * s * d * 2  # the reference's shared bf16 cos and sin tables, absent
    count = 8  # the int64 valid-token count the summed loss is divided by
    assert t.activations - r.activations == 32 * per_layer + normed - cos_sin + count


@pytest.mark.parametrize(
    ("model", "options", "match"),
    [
        ("gpt2", {}, "mlp"),
        ("mixtral-8x7b", {}, "moe"),
        ("qwen2.5-7b", {}, "qkv_bias"),
        ("llama-3-8b", {"dropout": 0.1}, "dropout"),
        ("llama-3-8b", {"attention": AttentionChoice.EAGER}, "attention"),
        ("llama-3-8b", {"checkpointing": "every-2"}, "every-K"),
        ("llama-3-8b", {"finetune": FineTune(method=Method.LORA)}, "finetune"),
    ],
)
def test_titan_refuses_what_it_does_not_model(model: str, options: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_setup(model, seq=512, impl=TITAN, **options)  # type: ignore[arg-type]


def test_titan_selective_ac_keeps_every_other_mm() -> None:
    """torchtitan's SelectiveAC on CPU: per block the checkpoint's input and the outputs of the 1st, 3rd and
    5th mm (W_QKV, W1, W2); W_O, W3 and the CPU flash attention re-run (activation_checkpoint.py)."""
    b, s, h, a, kv, d, f, L = 2, 1024, 4096, 32, 8, 128, 14336, 32
    setup = build_setup(
        "llama-3-8b", seq=s, batch=b, device=Device.CPU, impl=TITAN, checkpointing="selective"
    )
    t, bf16 = b * s, 2
    per_layer = bf16 * (b * s * h + t * (a + 2 * kv) * d + t * f + t * h)
    est = estimate(setup)
    assert estimated_layers(est) == [per_layer] * L
    wo_w3 = 2 * t * h * (a * d) + 2 * t * h * f
    core = 2 * 2 * b * a * d * s * s  # QKᵀ and P·V as FlopCounterMode counts them (causal not halved)
    assert est.flops.recompute == L * (wo_w3 + core)


def test_titan_selective_ac_on_cuda_caches_cudnn_sdpa() -> None:
    """torchtitan's SelectiveAC on CUDA: its save list holds ``_scaled_dot_product_cudnn_attention`` (the
    op SDPA runs under torchtitan's cuDNN-first priority at head dim 128), so per block the cache adds that
    op's outputs to the CPU set — the output [b, a, s, d] bf16, the fp32 logsumexp [b, a, s, 1] and two
    int64 philox scalars (its meta kernel) — and the attention core is not re-run: W_O and W3 only."""
    b, s, h, a, kv, d, f, L = 2, 1024, 4096, 32, 8, 128, 14336, 32
    setup = build_setup("llama-3-8b", seq=s, batch=b, impl=TITAN, checkpointing="selective")
    assert setup.device is Device.CUDA
    t, bf16 = b * s, 2
    cpu = bf16 * (b * s * h + t * (a + 2 * kv) * d + t * f + t * h)  # input, W_QKV, W1, W2 outputs
    sdpa = bf16 * b * a * s * d + 4 * b * a * s + 2 * 8
    est = estimate(setup)
    assert estimated_layers(est) == [cpu + sdpa] * L
    assert est.flops.recompute == L * (2 * t * h * (a * d) + 2 * t * h * f)


def test_titan_selective_ac_on_cuda_times_its_rerun_as_linears() -> None:
    """The step time's split of SelectiveAC's re-run on CUDA: W_O and W3 are GEMMs of the forward's shapes
    (the linear class), no attention core re-runs, and the block's element-wise work runs once more (every
    element-wise op re-runs; none is in the save list): the backward's element-wise bytes are its op
    lists' plus one forward's (time/elementwise.py)."""
    setup = build_setup("llama-3-8b", seq=1024, batch=2, impl=TITAN, checkpointing="selective")
    c = critical_stage(estimate(setup))
    f = stage_flops(c)
    t, h, a, d, f_w, L = 2 * 1024, 4096, 32, 128, 14336, 32
    assert f.rerun_linear == L * (2 * t * h * a * d + 2 * t * h * f_w)
    gpu = load_gpu("h100-sxm")
    peak = gpu.peak_tflops.bf16 * 1e12
    _, backward = kernel_times(c, gpu, peak)
    plain = critical_stage(estimate(build_setup("llama-3-8b", seq=1024, batch=2, impl=TITAN)))
    assert stage_flops(plain).attention_backward == f.attention_backward  # no core re-run
    _, plain_backward = kernel_times(plain, gpu, peak)
    # the chains' bytes as MEMORY streams them (layer_elementwise.streamed_bytes: each at its measured rate)
    ratio = (streamed_bytes(setup, backward=True) + streamed_bytes(setup)) / streamed_bytes(
        setup, backward=True
    )
    assert backward.elementwise_s / plain_backward.elementwise_s == pytest.approx(ratio, rel=1e-12)


def test_titan_selective_ac_on_cuda_refuses_wide_heads() -> None:
    """Above head dim 128 torch's SDPA pick depends on the GPU and cuDNN's version (sdp_utils.cpp
    check_cudnn_tensor_shapes): not modelled, one line."""
    wide = build_setup("llama-3-8b", seq=512, impl=TITAN, device=Device.CPU).model.model_copy(
        update={"head_dim": 256, "num_heads": 16}
    )
    with pytest.raises(ValueError, match="head dim 256"):
        build_setup(wide, seq=512, impl=TITAN, checkpointing="selective")


def test_titan_tp_sp_keeps_the_gathered_inputs() -> None:
    """tp 2 with SP against the reference's (Megatron's layout): torchtitan's module-boundary all-gathers
    keep W_QKV's, W1/W3's and the lm head's input whole, the vocabulary-parallel embedding its mask, and
    ``_LossParallelCrossEntropy`` no fp32 normaliser (blocks/profile.py)."""
    b, s, h, d, t = 1, 1024, 4096, 128, 2
    par = Parallel(tp=t, sp=True)
    ref = build_setup("llama-3-8b", seq=s, batch=b, device=Device.CPU, parallel=par)
    titan = build_setup("llama-3-8b", seq=s, batch=b, device=Device.CPU, impl=TITAN, parallel=par)
    normed = 2 * b * (s // t) * h  # F.rms_norm's fp32 normalised x (4 B, not 2) on the s/t tokens
    rope = s * (d // 2) * 8  # each layer's complex64 cache, whole
    gathered = 2 * b * s * h - 2 * b * (s // t) * h  # [T, h] kept instead of Megatron's [T/t, h]
    per_layer = 2 * normed + rope + 2 * gathered
    r, tt = estimate(ref), estimate(titan)
    assert [x - y for x, y in zip(estimated_layers(tt), estimated_layers(r), strict=True)] == [per_layer] * 32
    cos_sin = 2 * s * d * 2  # the reference's shared bf16 cos and sin tables, absent
    mask, count, total_weight = b * s * 2, 8, 4  # embedding's bf16 [b, s, 1]; int64 count; fp32 scalar
    model = normed + gathered - cos_sin + mask + count - total_weight
    assert tt.activations - r.activations == 32 * per_layer + model
