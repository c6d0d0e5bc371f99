"""The attention block's rules by hand (blocks/attention/core.py) where the fast suite did not reach them:
which of q, k, v a core keeps as views of one projection output and which as new tensors, and the eager
core's forward locals; torch-free, in the mutation selection (docs/mutation.md). tests/hf/ and
tests/measure/ measure the same saves per tensor with torch.

The tiny model: h = 64, 4 heads of d = 16, s = 32, bf16 activations; b = 2 unless a case sets b = 1.

A saved view keeps its whole base alive, so where the code splits q, k, v off one projection output
(GPT-2's ``c_attn(x).split``, GPT-NeoX's ``qkv.chunk``, Megatron's ``linear_qkv``) and the core keeps any of
them as a view, the estimate holds that [b, s, (a + 2·kv)·d] output once. New tensors instead:
- q and k after RoPE (the rotation makes new tensors), q under GQA (Megatron's reshape cannot view it);
- k and v repeated to a heads by Megatron's eager core under GQA (``repeat_interleave``);
- k and v of transformers' KV cache (``DynamicCache.update`` concatenates them);
- all three in SDPA's math path: q·√scale, kᵀ·√scale, and v upcast to fp32 when 16-bit;
- with b > 1, the copies transformers' eager ``torch.matmul`` makes reshaping them to [b·a, s, d].
"""

from __future__ import annotations

from typing import Any

import pytest
from tiny_setup import A, H, S, tiny_setup

from memplan.blocks.attention import constants, rope
from memplan.blocks.attention import core as attention
from memplan.blocks.attention import eager_locals as attention_locals
from memplan.blocks.inventory import Block, Dims, Role
from memplan.config import Device, DType, Impl, ImplConfig, Precision, Setup
from memplan.config.impl import Family
from memplan.config.strategy import Attention

D = H // A
EAGER = {"attention": Attention.EAGER}
FLASH = {"attention": Attention.FLASH}
GPT2 = {"family": Family.GPT2, "position": "learned", "mlp": "gelu", "norm": "layernorm"}
NEOX = {"family": Family.GPT_NEOX, "mlp": "gelu", "norm": "layernorm"}


def build(
    model: dict[str, Any],
    strategy: dict[str, Any],
    impl: ImplConfig,
    b: int = 2,
    precision: Precision = Precision.BF16_MIXED,
    device: Device = Device.CUDA,
) -> Setup:
    s = tiny_setup(model, strategy, impl=impl)
    training = s.training.model_copy(update={"micro_batch": b, "precision": precision})
    return s.model_copy(update={"training": training, "device": device})


def views(s: Setup, eager_core: bool) -> list[tuple[str, tuple[int, ...], str]]:
    return [(r.name, r.shape, r.dtype.name) for r in attention.qkv_view_rules(s, Dims.of(s), eager_core)]


def heads(name: str, b: int, n: int = A, dtype: str = "BF16") -> tuple[str, tuple[int, ...], str]:
    """A new q, k or v: [b, heads, s, d]."""
    return ("attn." + name, (b, n, S, D), dtype)


def buffer(b: int, kv: int = A, dtype: str = "BF16") -> tuple[str, tuple[int, ...], str]:
    """The projection's whole output, [b, s, (a + 2·kv)·d]."""
    return ("attn.qkv", (b, S, (A + 2 * kv) * D), dtype)


HF = ImplConfig(impl=Impl.HF, use_cache=False)
HF_CACHE = ImplConfig(impl=Impl.HF, use_cache=True)
MEGATRON = ImplConfig(impl=Impl.MEGATRON)


@pytest.mark.parametrize(
    ("setup", "eager_core", "expected"),
    [
        # GPT-2 (learned positions, MHA), eager, b = 2: torch.matmul copies q, k and v; no view is saved.
        (build(GPT2, EAGER, HF), True, [heads("q", 2), heads("k", 2), heads("v", 2)]),
        # b = 1: the reshape is a view, all three are views of c_attn's output.
        (build(GPT2, EAGER, HF, b=1), True, [buffer(1)]),
        # The KV cache's k and v are new (torch.cat); q stays a view.
        (build(GPT2, EAGER, HF_CACHE, b=1), True, [heads("k", 1), heads("v", 1), buffer(1)]),
        # SDPA's math path (CPU with attention dropout): q and k scaled, v upcast, all fp32.
        (
            build({**GPT2, "attn_dropout": 0.1}, FLASH, HF, device=Device.CPU),
            False,
            [heads("q", 2, dtype="FP32"), heads("k", 2, dtype="FP32"), heads("v", 2, dtype="FP32")],
        ),
        # In fp32 the math path's v is the input itself: a view, which holds the buffer.
        (
            build({**GPT2, "attn_dropout": 0.1}, FLASH, HF, precision=Precision.FP32, device=Device.CPU),
            False,
            [heads("q", 2, dtype="FP32"), heads("k", 2, dtype="FP32"), buffer(2, dtype="FP32")],
        ),
        # GPT-NeoX: RoPE makes q and k new (torch.cat of rotated and passed dims); v a view.
        (build(NEOX, EAGER, HF, b=1), True, [heads("q", 1), heads("k", 1), buffer(1)]),
        # Megatron, GQA (2 kv heads), learned positions, eager core: q a copy (GQA), k and v repeated to
        # a heads: nothing is a view.
        (
            build({"num_kv_heads": 2, "position": "learned"}, EAGER, MEGATRON),
            True,
            [heads("q", 2), heads("k", 2), heads("v", 2)],
        ),
        # The same under flash: k and v are not repeated, they stay views beside the copied q.
        (
            build({"num_kv_heads": 2, "position": "learned"}, FLASH, MEGATRON),
            False,
            [heads("q", 2), buffer(2, kv=2)],
        ),
        # Megatron, MHA, RoPE, flash: q and k rotated, v copied: TEDotProductAttention with RoPE fusion runs
        # bshd after [x.transpose(0, 1).contiguous() for x in (query, key, value)] (Megatron-LM MR 2388).
        (build({}, FLASH, MEGATRON), False, [heads("q", 2), heads("k", 2), heads("v", 2)]),
    ],
)
def test_which_of_q_k_v_are_views_of_the_projection_output(
    setup: Setup, eager_core: bool, expected: list[tuple[str, tuple[int, ...], str]]
) -> None:
    assert views(setup, eager_core) == expected


def test_the_eager_core_flag_follows_the_kernel() -> None:
    # projection_rules calls qkv_view_rules with eager_core only for the eager kernel outside selective
    # recompute: flash's b = 2 GPT-2 keeps views (no matmul copies), eager's copies.
    def rules(strategy: dict[str, Any]) -> list[str]:
        s = build(GPT2, strategy, HF)
        return [r.name for r in attention.projection_rules(s, Dims.of(s))]

    assert rules(FLASH) == ["attn.input", "attn.qkv"]
    assert rules(EAGER) == ["attn.input", "attn.q", "attn.k", "attn.v"]


# ----------------------------------------------------------------------------------------------------
# The eager core's forward locals, beyond its saves (eager_forward_extra, megatron_forward_extra)
# ----------------------------------------------------------------------------------------------------
def test_megatron_eager_forward_holds_the_unsaved_buffer_the_scores_and_the_context() -> None:
    # T = 64 tokens, bf16. baddbmm's scores [b·a, s, s] = 2·4·32·32·2 = 16,384 B; P·V's output [T, a·d]
    # while its copy is made = 64·64·2 = 8,192 B.
    scores, ctx = 2 * A * S * S * 2, 64 * A * D * 2
    # GQA: no view saved, so W_QKV's output [T, (a + 2·kv)·d] = 64·8·16·2 = 16,384 B is a local too.
    gqa = build({"num_kv_heads": 2, "position": "learned"}, EAGER, MEGATRON)
    assert attention_locals.eager_forward_extra(gqa, Dims.of(gqa)) == 64 * (A + 2 * 2) * D * 2 + scores + ctx
    # MHA with RoPE: v is a saved view, the buffer is among the saves already.
    mha = build({}, EAGER, MEGATRON)
    assert attention_locals.eager_forward_extra(mha, Dims.of(mha)) == scores + ctx
    assert attention_locals.megatron_forward_extra(mha, Dims.of(mha), 3, 5) == 8
    assert attention_locals.megatron_forward_extra(gqa, Dims.of(gqa), 3, 5) == 16_384 + 8


def test_the_reference_eager_forward_locals() -> None:
    # q, k, v before their contiguous copies [T, (a + 2·kv)·d] = 64·12·16·2 = 24,576 B, the scaled scores
    # 16,384 B, then the larger of the masked scores (16,384) and P·V's output (8,192); with attention
    # dropout both, the masked scores gone before the dropout's outputs exist.
    locals_, scores, ctx = 64 * 3 * A * D * 2, 2 * A * S * S * 2, 64 * A * D * 2
    plain = build({}, EAGER, ImplConfig())
    assert attention_locals.eager_forward_extra(plain, Dims.of(plain)) == locals_ + scores + max(scores, ctx)
    dropout = build({"attn_dropout": 0.1}, EAGER, ImplConfig())
    assert attention_locals.eager_forward_extra(dropout, Dims.of(dropout)) == locals_ + scores + ctx
    flash = build({}, FLASH, ImplConfig())
    assert attention_locals.eager_forward_extra(flash, Dims.of(flash)) == 0


# ----------------------------------------------------------------------------------------------------
# Megatron's fused causal softmax: where its kernel runs (fused_softmax_runs)
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("s", "b", "runs"),
    [
        # FusedScaleMaskSoftmax.is_kernel_available: 16 < s ≤ 4096, s % 4 == 0, and b·a (4 heads here) a
        # multiple of the batches per block: 8 up to s = 128 (warps of min(2^⌈log₂ s⌉, 32) threads, two
        # batches a warp up to 128 keys, 128 threads a block), else 4.
        (16, 2, False),  # s not above 16
        (20, 2, True),  # b·a = 8: a multiple of 8
        (32, 1, False),  # b·a = 4 is not a multiple of 8 at s ≤ 128
        (128, 1, False),
        (132, 1, True),  # above 128 four batches a block: 4 divides b·a = 4
        (4096, 1, True),
        (4100, 1, False),  # beyond the kernel's 4096 keys
        (34, 2, False),  # s not a multiple of 4
    ],
)
def test_megatron_fused_softmax_runs_where_its_kernel_is_available(s: int, b: int, runs: bool) -> None:
    setup = build({"max_positions": 4100}, EAGER, MEGATRON, b=b)
    setup = setup.model_copy(update={"training": setup.training.model_copy(update={"seq_len": s})})
    assert attention.fused_softmax_runs(setup, Dims.of(setup)) is runs
    # 16-bit scores only: in fp32 the torch softmax runs.
    fp32 = setup.model_copy(
        update={"training": setup.training.model_copy(update={"precision": Precision.FP32})}
    )
    assert attention.fused_softmax_runs(fp32, Dims.of(fp32)) is False


# ----------------------------------------------------------------------------------------------------
# Attention dropout: the mask or, on CPU in transformers' nn.Dropout / F.dropout code, the noise
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("device", "kept"),
    [
        # native_dropout (CUDA): a bool mask [b, a, s, s].
        (Device.CUDA, ("attn.dropout_mask", "BOOL", Role.ATTN_DROPOUT_MASK)),
        # CPU at::dropout: input · noise, the noise bernoulli(1−p)/(1−p) in the probabilities' dtype.
        (Device.CPU, ("attn.dropout_noise", "BF16", Role.ATTN_DROPOUT_MASK)),
    ],
)
def test_attention_dropout_keeps_a_mask_or_the_noise_and_the_dropped_probabilities(
    device: Device, kept: tuple[str, str, Role]
) -> None:
    s = build({**GPT2, "attn_dropout": 0.1}, EAGER, HF, device=device)
    probs = (2, A, S, S)
    rules = attention.dropout_rules(s, probs, DType.BF16)
    name, dtype, role = kept
    assert [(r.name, r.shape, r.dtype.name, r.role, r.block) for r in rules] == [
        (name, probs, dtype, role, Block.ATTN),
        ("attn.probs_dropped", probs, "BF16", Role.ATTN_PROBS, Block.ATTN),  # P·V's input: dV = Pᵀ·dO
    ]
    assert all(r.reason for r in rules)
    assert attention.dropout_rules(build(GPT2, EAGER, HF, device=device), probs, DType.BF16) == []


@pytest.mark.parametrize(("window", "masked"), [(S - 1, True), (S, True), (S + 1, False)])
def test_a_sliding_window_is_masked_from_s_equal_to_the_window(window: int, masked: bool) -> None:
    # transformers' masking_utils._ignore_causal_mask_sdpa skips the mask (SDPA's is_causal does it) only
    # while kv_length < local_attention_size; from s = W on the CPU flash kernel gets the window's mask.
    s = build({"family": Family.MISTRAL, "sliding_window": window}, FLASH, HF, device=Device.CPU)
    assert attention.window_masked(s, Dims.of(s)) is masked
    names = [r.name for r in attention.flash_rules(s, Dims.of(s))]
    assert ("attn.window_mask" in names) is masked


def test_torchtitan_keeps_a_complex_rotary_cache_per_layer() -> None:
    # torchtitan's precompute_freqs_cis: [s, d/2] complex64 (one complex number per pair of dims), sized to
    # the training sequence, saved by each layer's apply_rotary_emb (view_as_complex · freqs_cis).
    s = build({}, FLASH, ImplConfig(impl=Impl.TORCHTITAN), device=Device.CPU)
    rules = rope.rope_cache_rules(s, Dims.of(s))
    assert [(r.name, r.shape, r.dtype.name) for r in rules] == [("attn.rope_cache", (S, D // 2), "COMPLEX64")]
    assert all(type(x) is int for x in rules[0].shape)  # a shape prints as whole numbers
    # The reference model (one table for the model, rope.cos / rope.sin) keeps none per layer.
    reference = build({}, FLASH, ImplConfig(), device=Device.CPU)
    assert rope.rope_cache_rules(reference, Dims.of(reference)) == []


@pytest.mark.parametrize(("pattern", "tables"), [(2, 2), (5, 1)])
def test_gemma3_keeps_a_second_rotary_table_for_its_full_attention_layers(pattern: int, tables: int) -> None:
    # transformers' Gemma-3 rotates its sliding layers with rope_local_theta and its full layers with
    # rope_theta (Gemma3TextModel: rotary_emb_local and rotary_emb): where both layer types exist (every
    # pattern-th layer full, 4 layers here) each table's cos and sin [s, d] (bf16) are kept; with a
    # pattern longer than the model every layer slides, one table.
    model = {"family": Family.GEMMA3, "sliding_window": 64, "sliding_window_pattern": pattern}
    s = build({**model, "rope_local_theta": 10000.0}, FLASH, HF_CACHE)
    rules = [(r.name, r.shape, r.dtype.name, r.role) for r in constants.constant_rules(s, Dims.of(s))]
    table = [("rope.cos", (S, D), "BF16", Role.ROPE_TABLE), ("rope.sin", (S, D), "BF16", Role.ROPE_TABLE)]
    full = [
        ("rope.full_cos", (S, D), "BF16", Role.ROPE_TABLE),
        ("rope.full_sin", (S, D), "BF16", Role.ROPE_TABLE),
    ]
    assert rules == table + (full if tables == 2 else [])


def test_megatron_q_and_k_norms_are_te_fused_rms_norms() -> None:
    """Megatron-core's TE layer spec builds ``q_layernorm`` / ``k_layernorm`` as ``TENorm`` (TE's fused
    RMSNorm): each keeps its input as it comes (bf16) and the fp32 rstd of every head-vector, no fp32 copy
    and no normalised output (the reference's unfused RMSNorm keeps those)."""
    from memplan.blocks.norm import qk_norm_rules

    kv = 2
    setup = build({"num_kv_heads": kv, "qk_norm": True}, FLASH, MEGATRON)
    saves = [(r.name, r.shape, r.dtype.name) for r in qk_norm_rules(setup, Dims.of(setup))]
    assert saves == [
        ("attn.q_norm.input", (2, A, S, D), "BF16"),
        ("attn.q_norm.rstd", (2, A, S, 1), "FP32"),
        ("attn.k_norm.input", (2, kv, S, D), "BF16"),
        ("attn.k_norm.rstd", (2, kv, S, 1), "FP32"),
    ]
    reference = build({"num_kv_heads": kv, "qk_norm": True}, FLASH, ImplConfig())
    names = [r.name for r in qk_norm_rules(reference, Dims.of(reference))]
    assert "attn.q_norm.normed" in names
