"""The per-launch gap of eager element-wise kernels (issue #21 item 2; memplan/time/compute.py
``elementwise_kernels``, ``launch_seconds``), derived by hand.

LAUNCH_GAP_S 1.1 µs: 2,000 tiny ``x + y`` kernels captured in one CUDA graph (host overhead removed) run at
0.0011–0.0013 ms each (pytorch/pytorch issue #161104); the lower. Kernels of one layer's forward in eager
PyTorch (time/elementwise.py's op lists): RMSNorm x.to(fp32), pow, mean, + eps, rsqrt, x·, .to(dtype),
weight· = 8 (fp32: no casts, 6); a residual add 1; a dropout 1; rotary on q and k 5 each (·cos, the negated
half, cat, ·sin, the sum); SwiGLU silu and the product 2, GELU 1; eager attention's softmax 1 and its
dropout 1. The backward of eager code launches its autograd op lists' kernels (time/elementwise.py), of
fused code, LayerNorm, GELU, dropouts and the softmax twice the forward's; ``--compile`` (Inductor's fused
kernels) is charged none.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from memplan.config import Attention, Precision, Setup, StrategyConfig, TrainingConfig
from memplan.config.impl import ImplConfig
from memplan.engine import estimate
from memplan.presets import Calibration, gpu_text, load_gpu, load_model_preset
from memplan.time import efficiency as eff
from memplan.time.calibration import preset_text
from memplan.time.layer_elementwise import elementwise_backward_kernels, elementwise_kernels
from memplan.time.published import gpt
from memplan.time.timing import timing

H100 = load_gpu("h100-sxm")
LLAMA8 = load_model_preset("llama-3-8b").model  # RMSNorm, rotary, SwiGLU, no dropout, 32 layers


def llama(**training: object) -> Setup:
    return Setup(model=LLAMA8, training=TrainingConfig(seq_len=2048, **training))  # type: ignore[arg-type]


def test_the_constant_is_the_sources_figure() -> None:
    assert eff.LAUNCH_GAP_S == 1.1e-6  # 0.0011 ms, the lower of #161104's 0.0011–0.0013 ms


def test_kernels_per_layer() -> None:
    # Llama, bf16: 2 RMSNorms × 8 + 2 residual adds + rotary 10 + SwiGLU 2 = 30
    assert elementwise_kernels(llama()) == 2 * 8 + 2 + 10 + 2 == 30
    # fp32 activations: an RMSNorm without its two casts, 6: 2 × 6 + 2 + 10 + 2 = 26
    assert elementwise_kernels(llama(precision=Precision.FP32)) == 26
    # torch.compile fuses the chains: no eager kernel is charged
    compiled = llama().model_copy(update={"impl": ImplConfig(compile=True)})
    assert elementwise_kernels(compiled) == 0
    # GPT (LayerNorm, GELU, dropout 0.1) with eager attention: 2 LayerNorms + 2 adds + 2 residual dropouts
    # + GELU + the reference's eager core (scale, masked_fill, softmax: 3) + attention dropout = 11
    g = Setup(
        model=gpt(1024, 16, 4),
        training=TrainingConfig(seq_len=1024),
        strategy=StrategyConfig(attention=Attention.EAGER),
    )
    assert elementwise_kernels(g) == 2 + 2 + 2 + 1 + 3 + 1 == 11


def test_the_step_charges_each_kernel_its_gap() -> None:
    # One device, 4 micro-batches, 32 layers: forward 30 kernels a layer; backward the eager autograd op
    # lists (time/elementwise.py): two RMSNorms of 17, 5 gradient sums (the residual stream before each
    # norm, the input of the separate W_Q, W_K, W_V twice, of gate and up once), rotary 20, SwiGLU 3 = 62;
    # × 1.1 µs
    s = llama(grad_accum=4)
    assert elementwise_backward_kernels(s) == 2 * 17 + 2 + 3 + 20 + 3 == 62
    pr = timing(estimate(s), H100).prediction
    assert pr.launch_s == pytest.approx(4 * 32 * (30 + 62) * 1.1e-6, rel=1e-12)
    assert pr.parts()["launch gaps"] == pr.launch_s
    assert sum(pr.parts().values()) == pytest.approx(pr.step_time_s, rel=1e-12)
    compiled = s.model_copy(update={"impl": ImplConfig(compile=True)})
    assert timing(estimate(compiled), H100).prediction.launch_s == 0.0


def test_a_calibrated_gap_replaces_the_constant(tmp_path: Path) -> None:
    # memplan calibrate measured 5 µs per kernel on the device: 4 × 32 × 92 × 5 µs
    path = tmp_path / "cal.toml"
    c = Calibration(matmul=0.8, memory=0.8, launch_us=5.0, device="gpu")
    path.write_text(preset_text(gpu_text("h100-sxm"), "my-h100", c), encoding="utf-8")
    pr = timing(estimate(llama(grad_accum=4)), load_gpu(str(path))).prediction
    assert pr.launch_s == pytest.approx(4 * 32 * 92 * 5e-6, rel=1e-12)
