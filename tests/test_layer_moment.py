"""The layer-backward moment of the peak by hand (analytic/peak.py, ``peak``'s ``layer_moment`` and the
layers it evaluates), in the fast, torch-free suite the mutation run uses (docs/mutation.md);
tests/measure/test_peak.py measures the moment (torch).

Llama-style layers (RMSNorm, SwiGLU, flash attention), h 64, 4 heads, f 160, v 1000, untied, bf16-mixed
AdamW on one CPU: weights, gradients and activations 2 bytes, the loop's ids and labels int64 (8).
T = b·s tokens. Per layer: 4·h² (W_Q, W_K, W_V, W_O) + 3·h·f (gate, up, down) + 2·h (two RMSNorm weights)
= 16,384 + 30,720 + 128 = 47,232 parameters, so G = 2 · 47,232 = 94,464 gradient bytes; the head's
gradients are the lm head [v, h] and the final norm [h], 2 · (64,000 + 64) = 128,128 bytes.
At layer i's backward (L layers) the layers above have run theirs: L − 1 − i layers' gradients exist.
"""

from __future__ import annotations

import pytest

from memplan.analytic import peak as pk
from memplan.analytic.moments import layer_backward as lb
from memplan.analytic.params import count_params
from memplan.blocks.attention import core as att
from memplan.blocks.attention import workspace as aw
from memplan.blocks.inventory import Block, Dims
from memplan.config import (
    Attention,
    Checkpointing,
    Device,
    Impl,
    ImplConfig,
    LossKind,
    ModelConfig,
    Offload,
    Setup,
    StrategyConfig,
    TrainingConfig,
)
from memplan.engine import estimate

H, F, V = 64, 160, 1000
G = 2 * (4 * H * H + 3 * H * F + 2 * H)  # one layer's bf16 gradients: 94,464 bytes
HEAD_GRADS = 2 * (V * H + H)  # lm head and final norm, bf16: 128,128 bytes
LABELS = 8  # bytes per token of the loop's int64 labels (and of its ids)


def setup(
    layers: int = 4,
    b: int = 2,
    s: int = 64,
    tied: bool = False,
    accum: int = 1,
    norm: str = "rmsnorm",
    **kw: object,
) -> Setup:
    model = ModelConfig(
        norm=norm,
        hidden_size=H,
        num_layers=layers,
        num_heads=4,
        ffn_size=F,
        vocab_size=V,
        max_positions=max(s, 64),
        tied_embeddings=tied,
    )
    training = TrainingConfig(micro_batch=b, seq_len=s, grad_accum=accum)
    return Setup(model=model, training=training, device=Device.CPU, **kw)  # type: ignore[arg-type]


def every(k: int) -> StrategyConfig:
    return StrategyConfig(checkpointing=Checkpointing.EVERY_K, checkpoint_every=k)


def layer_backward(s: Setup) -> dict[str, int]:
    return estimate(s).peak.moments["layer backward"]


def one_layers_saves(layers: int = 4, b: int = 2, s: int = 64, impl: ImplConfig | None = None) -> int:
    """The saves of one un-checkpointed layer: the inventory of L layers less that of L − 1."""
    kw = {"impl": impl} if impl else {}
    return (
        estimate(setup(layers, b, s, **kw)).activations - estimate(setup(layers - 1, b, s, **kw)).activations
    )


# --- what the layer moment holds -----------------------------------------------------------------------


def test_the_layer_moments_transient_is_the_swiglu_product_gradient_plus_the_loss_scalar_and_seed() -> None:
    """b 2, s 64, T 128, no checkpointing: the layer's backward peaks in its MLP, at the SwiGLU product's
    gradient (tests/test_mlp_rules.py derives it): dY [T, h], d(down input) and the two operand gradients
    [T, f] (3 · [T, f]), the down projection's weight gradient [h, f], its saved input [T, f] released:
    2·T·h + 2·2·T·f + 2·h·f = 16,384 + 81,920 + 20,480 = 118,784 bytes. The other parts rise less: the
    MLP norm's five fp32 [T, h] (163,840) + the MLP's, its norm's and W_O's gradients (2 · 34,880) come
    after the MLP's saves (2·T·(h + 4f) = 180,224) and the norm's n [T, h] bf16 and rstd [T] fp32 (16,896)
    are freed: 36,480; flash attention's dY and dq, dk, dv, dO (5 · 2·T·h = 81,920) after the MLP norm's
    fp32 input (32,768) is freed too: below 0.
    + 8: the fp32 loss scalar and the backward's fp32 seed gradient, alive until the backward ends."""
    t = 2 * 64
    mlp = 2 * t * H + 2 * 2 * t * F + 2 * H * F
    assert layer_backward(setup())["transient"] == mlp + 4 + 4


@pytest.mark.parametrize(
    ("loss", "chunks"),
    [(LossKind.FUSED, 1), (LossKind.CHUNKED, 2)],  # the fused loss; chunk copies of the labels (b > 1)
)
def test_the_loop_labels_are_alive_once_at_a_layers_backward(loss: LossKind, chunks: int) -> None:
    """The loss only changes the head's saves, all freed before any layer's backward; the training loop's
    int64 labels [b, s] are alive there whichever loss ran (the standard loss's nll_loss saves that very
    storage; the fused and the chunked loss keep none or copies of it, freed with the head): the same
    moment, term by term, as the standard loss's."""
    s = setup().model_copy(update={"loss": loss, "loss_chunks": chunks})
    assert layer_backward(s) == layer_backward(setup())


@pytest.mark.parametrize(("b", "s"), [(2, 64), ((1 << 20) - 1, (1 << 24) - 1)])
def test_the_top_layers_activations_are_every_save_but_the_heads_to_the_byte(b: int, s: int) -> None:
    """Layer 3 of 4 (the top: saves outweigh gradients): every layer's and the embedding's saves are
    alive, the head's freed but for the labels the loop holds. The head's saves (RMSNorm, lm head, loss):
    the fp32 upcast input [T, h] and rstd [T, 1], the bf16 normalised input [T, h], the lm head's input
    [T, h], log_softmax's fp32 [T, v], nll_loss's int64 targets [T] and fp32 total weight (one scalar).
    Exact in integers at any size: the second shape, the largest b and s (2²⁰ − 1, 2²⁴ − 1), keeps ≈ 2⁵⁷·⁵
    bytes at the top layer, where floats are 32 bytes apart (a float byte count would round)."""
    t = b * s
    head = 4 * t * H + 4 * t + 2 * t * H + 2 * t * H + 4 * t * V + LABELS * t + 4
    est = estimate(setup(b=b, s=s))
    assert est.activations - layer_backward(setup(b=b, s=s))["activations"] == head - LABELS * t


def test_offloaded_activations_bring_back_one_layers_saves_beside_the_loops_ids_and_labels() -> None:
    """save_on_cpu: nothing saved stays on the device; at a layer's backward its own saves come back from
    the host (strategies/offload.py's model: one layer's saves) beside the loop's int64 ids and labels
    [b, s] (2 · 8·T)."""
    t = 2 * 64
    moment = layer_backward(setup(offload=Offload.ACTIVATIONS))
    assert moment["activations"] == one_layers_saves() + 2 * LABELS * t


def test_an_inventory_without_layer_saves_brings_nothing_back() -> None:
    """``peak`` read directly with an empty inventory (no layer saves, no head saves), activations
    offloaded: only the loop's ids and labels, 2 · 8·T, are alive at a layer's backward."""
    s = setup(offload=Offload.ACTIVATIONS)
    dev = estimate(s).device
    moments = pk.peak(s, dev.states, [], dev.params, 0).moments
    assert moments["layer backward"]["activations"] == 2 * LABELS * 2 * 64


# --- the parts of a layer's backward ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("norm", "alive"),
    [
        # Llama's RMSNorm: its last backward ops need the fp32 upcast input [T, h] only; n and rstd are gone.
        ("rmsnorm", 4 * 128 * H),
        # native_layer_norm's one backward op holds its bf16 input [T, h] and mean, rstd [b, s, 1] (on CPU
        # in the input's dtype, bf16) to its end.
        ("layernorm", 2 * 128 * H + 2 * 2 * 128),
    ],
)
def test_a_norms_own_saves_alive_at_its_backwards_peak(norm: str, alive: int) -> None:
    s = setup(norm=norm)
    assert lb.norm_saves_at_peak(s, Block.MLP_NORM) == lb.norm_saves_at_peak(s, Block.ATTN_NORM) == alive


def test_eager_attentions_backward_holds_two_score_gradients_where_flash_holds_four_t_by_h() -> None:
    """The attention's backward after the MLP's (the same MLP done and dY either way). Eager: softmax's
    and the scores' gradients, two [b, a, s, s] bf16, with W_O's input (eager's [b, s, a·d] copy of P·V's
    output) freed; flash: dq, dO [T, a·d] and dk, dv [T, kv·d] bf16, W_O's input the kernel's own output
    (still needed). Eager − flash = 2 · 2·b·a·s² − 4 · 2·T·h − 2·T·h = 131,072 − 65,536 − 16,384."""
    eager = setup(strategy=StrategyConfig(attention=Attention.EAGER))
    flash = setup()
    params = count_params(flash.model)
    rise = [lb.attention_backward_transient(x, Dims.of(x), params) for x in (eager, flash)]
    assert rise[0] - rise[1] == 2 * 2 * 2 * 4 * 64 * 64 - 4 * 2 * 128 * H - 2 * 128 * H == 49_152


def test_on_cuda_the_eager_softmax_backward_holds_its_own_product_of_grad_and_output() -> None:
    """torch's CUDA softmax backward makes tmp = grad · output, one [b, a, s, s] in the gradient's dtype,
    beside dP and dS (SoftMax.cu ``softmax_backward_cuda_out``); the CPU kernel does not. bf16: 2·b·a·s²."""
    eager = StrategyConfig(attention=Attention.EAGER)
    cpu, cuda = setup(strategy=eager), setup(strategy=eager).model_copy(update={"device": Device.CUDA})
    params = count_params(cpu.model)
    rise = [lb.attention_backward_transient(x, Dims.of(x), params) for x in (cpu, cuda)]
    assert rise[1] - rise[0] == 2 * 2 * 4 * 64 * 64 == 65_536
    flash = setup().model_copy(update={"device": Device.CUDA})
    assert aw.softmax_backward_scratch(flash, Dims.of(flash)) == 0  # the flash kernel has no softmax op


@pytest.mark.parametrize(("kv", "s", "expanded"), [(4, 64, 0), (2, 64, 2 * 2 * 64 * 4 * 16 * 2), (4, 100, 0)])
def test_on_cuda_flash_attentions_backward_holds_fa2s_fp32_accumulator_and_row_sums(
    kv: int, s: int, expanded: int
) -> None:
    """FlashAttention-2's ``mha_bwd`` on CUDA: softmax_d [b, a, s_r] and dq_accum [b, s_r, a, d_r] fp32,
    s_r = s rounded up to 128, d_r = 16 rounded up to 32; with 2 K/V heads for 4 query heads (GQA) also
    dk and dv expanded to the query heads, [b, s, a, d] bf16 each. b 2, 4 heads of 16."""
    base = setup(s=s)
    model = base.model.model_copy(update={"num_kv_heads": kv})
    cuda = base.model_copy(update={"device": Device.CUDA, "model": model})
    rows = 128
    work = aw.flash_backward_workspace(cuda, Dims.of(cuda))
    assert work == 2 * 4 * rows * 4 + 2 * rows * 4 * 32 * 4 + expanded
    cpu = cuda.model_copy(update={"device": Device.CPU})
    assert aw.flash_backward_workspace(cpu, Dims.of(cpu)) == 0
    params = count_params(model)
    rise = [lb.attention_backward_transient(x, Dims.of(x), params) for x in (cpu, cuda)]
    assert rise[1] - rise[0] == aw.flash_backward_workspace(cuda, Dims.of(cuda))


def test_a_selective_eager_cores_softmax_backward_trades_the_output_gradient_for_cudas_product() -> None:
    """At the re-run core's softmax backward P·V's backward has made dP and dV and freed the core's output
    gradient [T, a·d] and the V copy (dV's size): against the re-run's softmax (scaled and masked scores
    alive), dP and dS replace them, so the moment is T·a·d·2 lower on CPU (tests/measure/test_peak.py
    measures both), and 2·b·a·s² − T·a·d·2 higher on CUDA."""
    selective = StrategyConfig(checkpointing=Checkpointing.SELECTIVE, attention=Attention.EAGER)
    cpu = setup(strategy=selective)
    cuda = cpu.model_copy(update={"device": Device.CUDA})
    params = count_params(cpu.model)
    for x, extra in ((cpu, 0), (cuda, 2 * 2 * 4 * 64 * 64)):
        rerun = lb.selective_rerun_transient(x, Dims.of(x), params)
        assert lb.selective_softmax_backward(x, Dims.of(x), params) == rerun - 2 * 128 * H + extra
    assert lb.selective_softmax_backward(setup(), Dims.of(setup()), params) is None  # no selective core


# --- what a re-run rebuilds (``recompute_working_set``) ----------------------------------------------------
# T 128. RMSNorm upcasts its bf16 input to fp32 before saving it: no re-run save shares the kept input.
HF = ImplConfig(impl=Impl.HF, use_cache=False)  # transformers' Llama, no KV cache (checkpointing drops it)


@pytest.mark.parametrize(
    ("strategy", "impl", "layers"),
    [
        (StrategyConfig(checkpointing=Checkpointing.FULL), None, 1),  # each layer alone
        (every(2), None, 2),  # the reference model re-runs a segment of 2 layers at once
        (every(2), HF, 1),  # transformers' every_n_layers checkpoints single layers (1 in 2)
    ],
)
def test_a_checkpointed_re_run_rebuilds_its_layers_saves(
    strategy: StrategyConfig, impl: ImplConfig | None, layers: int
) -> None:
    """A checkpoint's re-run rebuilds every save of the layers it re-runs at once. (The estimate reads this
    for un-segmented setups only, where it is 0; the segment's re-run is counted layer by layer.)"""
    s = setup(strategy=strategy, **({"impl": impl} if impl else {}))
    assert lb.recompute_working_set(s) == layers * one_layers_saves(impl=impl)


def test_a_reversible_layer_rebuilds_its_saves_and_its_two_inputs() -> None:
    """RevNet: the layer's backward re-runs F and G (one layer's saves) and rebuilds its inputs x1 and x2
    from the outputs, two bf16 [T, h] beside them."""
    s = setup(strategy=StrategyConfig(reversible=True))
    assert lb.recompute_working_set(s) == one_layers_saves() + 2 * 2 * 128 * H


def test_a_selective_eager_core_rebuilds_its_copies_and_the_probabilities() -> None:
    """The eager core's matmuls save their own contiguous q, k (q·kᵀ) and v (P·V) [b, a, s, d] and
    softmax's probabilities [b, a, s, s] (bf16): all new storages, none of them the q, k, v the
    checkpoint keeps (flash re-runs on those, tests/test_peak_terms.py). 3 · 2·T·h + 2·b·a·s²."""
    s = setup(strategy=StrategyConfig(checkpointing=Checkpointing.SELECTIVE, attention=Attention.EAGER))
    assert lb.recompute_working_set(s) == 3 * 2 * 128 * H + 2 * 2 * 4 * 64 * 64


# --- which layer's backward is the moment ---------------------------------------------------------------
# Every-k checkpointing keeps one [T, h] bf16 input per segment of k layers (K = 2·T·h bytes) and re-runs a
# segment's layers one by one in its backward: at layer i of segment j = i // k, the i % k + 1 layers of
# the segment from its bottom up to i are re-run (their saves alive), j + 1 kept inputs exist, and L − 1 − i
# layers' gradients. Going up one layer inside a segment adds a re-run layer's saves S and removes one
# layer's gradients G; from one segment's top to the next adds K and removes k·G. So when S > G each
# segment peaks at its top, and the full segments' tops are linear in j: the first or the last full one
# (or the last, partial segment's top L − 1) is the moment.


@pytest.mark.parametrize(("layers", "k"), [(5, 3), (4, 2)])
def test_few_tokens_peak_at_the_first_segments_top(layers: int, k: int) -> None:
    """T 128 (S > G: a segment peaks at its top), K = 2·128·64 = 16,384 bytes.
    L 5, k 3: segments {0, 1, 2} and {3, 4}. Layer 2 (3 layers re-run, 1 kept input, 2 layers'
    gradients) against layer 4 (2 re-run, 2 kept, none): + S − K + 2G > 0; against layer 0: + 2S − 2G > 0.
    L 4, k 2: segments {0, 1} and {2, 3}, two full ones. Layer 1 (2 re-run, 1 kept, 2 layers' gradients)
    against layer 3, the last full top (2 re-run, 2 kept, none): 2G − K > 0; against layer 0: S − G > 0.
    Either way the moment is the first segment's top, layer k − 1: the head's and L − k layers' gradients."""
    assert one_layers_saves(layers) > G > 2 * 128 * H
    moment = layer_backward(setup(layers, strategy=every(k)))
    assert moment["gradients"] == HEAD_GRADS + (layers - k) * G


def test_every_2_of_4_layers_peaks_at_the_top_when_a_kept_input_outweighs_two_layers_gradients() -> None:
    """L 4, k 2, b 4, s 512 (T 2048): K = 2·2048·64 = 262,144 > 2G = 188,928, so the top layer 3 (2 kept
    inputs, no gradient) beats layer 1, the first segment's top (1 kept input, 2 layers' gradients); layer
    2 is its segment's bottom, one re-run layer fewer than layer 3. The head's gradients alone."""
    assert one_layers_saves(4, 4, 512) > G
    assert 2 * 2048 * H > 2 * G
    assert layer_backward(setup(4, 4, 512, strategy=every(2)))["gradients"] == HEAD_GRADS


def test_every_2_of_5_layers_peaks_at_the_last_full_segments_top() -> None:
    """L 5, k 2, T 2048: segments {0, 1}, {2, 3}, {4}. Layer 3 (2 re-run, 2 kept inputs, 1 layer's
    gradients) beats layer 1 (2 re-run, 1 kept, 3 layers' gradients) by K − 2G = 73,216 bytes and layer 4,
    the partial segment's top (1 re-run, 3 kept, none), by S − K + G > 0: neither end nor the first
    segment's top, the last full one."""
    t = 4 * 512
    assert 2 * t * H - 2 * G == 73_216
    assert one_layers_saves(5, 4, 512) > 2 * t * H
    moment = layer_backward(setup(5, 4, 512, strategy=every(2)))
    assert moment["gradients"] == HEAD_GRADS + G
    # Layer 3 of 5 against layer 3 of 4 (every-2, the same T): the same saves and re-run layers, one more
    # layer's weights (2 bytes), fp32 master copy and Adam's two fp32 states (12) and gradients (2).
    top4 = layer_backward(setup(4, 4, 512, strategy=every(2)))
    assert sum(moment.values()) - sum(top4.values()) == 47_232 * (2 + 12) + G


def test_when_the_top_and_bottom_layers_tie_the_moment_is_the_top_layers() -> None:
    """Full checkpointing (one kept [T, h] input per layer, one layer re-run), T = 2 · 369 = 738: a kept
    input, 2·738·64 = 94,464 bytes, equals a layer's gradients G, so every layer's backward holds the same
    bytes (going down one layer frees a kept input and adds a layer's gradients). The backward reaches the
    top layer first: the moment reported is the top layer's, the head's gradients alone beside 4 kept
    inputs; the bottom's would show 3 layers' gradients beside 1."""
    assert 2 * 738 * H == G
    full = StrategyConfig(checkpointing=Checkpointing.FULL)
    top = layer_backward(setup(b=2, s=369, strategy=full))
    assert top["gradients"] == HEAD_GRADS
    # 4 kept inputs, the embedding's one save (its int64 ids [b, s], for the gradient's index_add), RoPE's
    # cos and sin tables [s, d] bf16 (d = 64 / 4 = 16; every layer's rotation saves the same two storages)
    # and the loop's int64 labels.
    assert top["activations"] == 4 * G + LABELS * 738 + 2 * 2 * 369 * 16 + LABELS * 738


# --- the embedding's backward (tied or not) -----------------------------------------------------------


@pytest.mark.parametrize(
    ("tied", "accum", "transient"),
    [
        # Tied: the embedding's new [v, h] gradient and its sum with the lm head's (2 · 2·v·h).
        (True, 1, 2 * 2 * V * H),
        # Untied: the incoming [T, h] gradient beside the new [v, h] (in the gradients term) ...
        (False, 1, 2 * 128 * H),
        # ... and, accumulating, the new [v, h] beside the one the earlier micro-batch left.
        (False, 2, 2 * V * H + 2 * 128 * H),
    ],
)
def test_the_embeddings_backward_transient(tied: bool, accum: int, transient: int) -> None:
    """+ 8: the fp32 loss scalar and the backward's seed gradient."""
    s = setup(tied=tied, accum=accum)
    assert estimate(s).peak.moments["embedding backward"]["transient"] == transient + 8


def test_a_head_major_flash_output_is_copied_again_for_the_cuda_backward() -> None:
    """Phi-3's fused QKV makes q, and so the kernel's output, head-major: torch's
    ``_flash_attention_backward`` hands the kernel ``out.contiguous()`` of its [b, s, a, d] view, one
    [b, a, s, d] copy beside FlashAttention-2's workspace (a model with q in [b, s, a, d] copies nothing)."""
    from memplan.api import build_setup

    phi = build_setup("phi-3-mini", seq=512, impl=ImplConfig(impl=Impl.HF))
    d = Dims.of(phi)
    assert att.head_major_output(phi) and not att.head_major_output(setup())
    work = aw.fa2_backward_workspace(d.b, d.a, d.kv, d.s, d.s, d.qk_dim, d.v_dim, d.act.bytes)
    assert aw.flash_backward_workspace(phi, d) == work + d.b * d.a * d.s * d.v_dim * 2
