"""The element-wise backward of eager code by its autograd op lists (time/elementwise.py, issue #21 item 2),
derived by hand and checked against a traced H200 step of memplan's reference Llama-2-7B (seq 2048,
bf16-mixed; docs/step-time.md "Eager PyTorch on a measured H200": every kernel's aten op and input shapes).

One layer, T = 2,048 tokens, h 4,096, f 11,008, 32 heads of 128 (q and k: T·32·128 elements each), e = 2:
- each RMSNorm 92 bytes an element of [T, h]: weight·'s node dY·w 4, dY·n 6 and its sum over tokens 2; the
  cast back to fp32 6; x·r's dY·r 8, dY·x 12 and its sum over h 4; mean's dY/h 4; pow's x.pow(1) 8, ·2 8,
  ·dY 12; the two fp32 gradients summed 12; the input's cast 6;
- 5 gradient sums of 6 bytes an element of [T, h]: the residual stream before each norm, the shared input
  of the separate W_Q, W_K, W_V (2) and of gate and up (1);
- rotary 34 bytes an element of q and of k: ·cos 4, ·sin 4, the negated half 2, two slice_backward (zeros
  2, the half's copy 2) 8, two sums 12, the copy back to [b, s, a, d] 4;
- SwiGLU 18 bytes an element of [T, f]: dY·up, dY·silu(gate), silu_backward, 6 each.
The trace's per-layer kernels by shape: norms 2 × 821 MB (the split sums and mean's expanded read counted
by shape), sums 5 × 50.3 MB, rotary 572.5 MB with the two layout copies, SwiGLU 3 × 135.3 MB.
"""

from __future__ import annotations

from memplan.config import Attention, Setup, StrategyConfig, TrainingConfig
from memplan.config.impl import ImplConfig
from memplan.presets import load_model_preset
from memplan.time.layer_elementwise import elementwise_backward_bytes, elementwise_bytes, shared_inputs
from memplan.time.published import gpt

T, H, F = 2048, 4096, 11008
QK = T * 32 * 128


def llama2() -> Setup:
    return Setup(model=load_model_preset("llama-2-7b").model, training=TrainingConfig(seq_len=T))


def test_llama_layer_backward_by_hand() -> None:
    s = llama2()
    assert shared_inputs(s) == 3
    want = 2 * T * H * 92 + 5 * 6 * T * H + 2 * QK * 34 + 3 * 6 * T * F
    assert elementwise_backward_bytes(s) == want == 2_771_386_368
    # the forward: RMSNorm 36, two adds 6, rotary 20, SwiGLU 10 (time/elementwise.py)
    assert elementwise_bytes(s) == 2 * T * H * 36 + 2 * 6 * T * H + 2 * QK * 20 + 10 * T * F
    assert elementwise_backward_bytes(s) > 2 * elementwise_bytes(s)  # 2.77 against 2.53 GB


def test_fused_code_moves_twice_its_forward() -> None:
    compiled = llama2().model_copy(update={"impl": ImplConfig(compile=True)})
    assert elementwise_backward_bytes(compiled) == 2 * elementwise_bytes(compiled)


def test_gpt_layernorm_and_gelu_as_before() -> None:
    """GPT (LayerNorm, GELU, dropout 0.1, separate W_Q/W_K/W_V in the reference code), eager attention: its
    norms, GELU and dropouts twice their forward; two residual sums and two of the QKV input — the four
    adds' worth the old rule charged (2 × the forward's two residual adds); the reference's eager core op
    by op (time/elementwise.py eager_core): forward the scale, masked_fill and softmax, 2e each of the
    [b, a, s, s] scores, backward the softmax's 3e, the fill's 2e and the scale's 2e."""
    g = Setup(
        model=gpt(1024, 16, 4),
        training=TrainingConfig(seq_len=1024),
        strategy=StrategyConfig(attention=Attention.EAGER),
    )
    assert shared_inputs(g) == 2
    scores, e = 16 * 1024 * 1024, 2
    assert elementwise_backward_bytes(g) == 2 * elementwise_bytes(g) - 2 * 6 * e * scores + 7 * e * scores
