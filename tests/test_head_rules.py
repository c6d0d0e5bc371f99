"""The lm head's and the loss variants' saves, FLOPs and backward transient by hand (blocks/head.py);
torch-free, in the mutation selection (docs/mutation.md). tests/measure/test_loss.py measures the same saves
per tensor and the chunked loss's backward moment (torch).

What each loss keeps (blocks/head.py's docstring; measure/reference/loss.py spells the same code out in
torch):
- standard: the lm head's input [b, s, h] (dW = Xᵀ·dY), log_softmax's fp32 output [T, v] (d = p − onehot),
  nll_loss's targets [b, s] int64 and its fp32 total weight (a scalar);
- chunked:N (torchtune's ``chunked_output`` + ``CEWithChunkedOutputLoss``): ``torch.chunk`` cuts s into
  ⌈s/N⌉-position chunks (the last shorter, fewer chunks when ⌈s/N⌉ covers s early); per chunk the fp32
  log-probs [b·c, v] and a total weight; ``(labels != -100).sum()`` divides the summed loss: an int64 scalar
  the division keeps. With b = 1 a chunk along s is contiguous: the lm head's ``reshape(-1, h)`` and the
  labels' ``reshape(-1)`` are views of the [b, s, h] input and the [b, s] labels (one storage each). With
  b > 1 (and more than one chunk) they are copies: [b·c, h] and [b·c] per chunk;
- fused (Liger's ``LigerFusedLinearCrossEntropyFunction``): ``ctx.save_for_backward(grad_input,
  grad_weight)``, dL/dX [T, h] in the hidden states' dtype and dL/dW [v, h] in the weight's, nothing [T, v];
- Megatron's ``_VocabParallelCrossEntropy``: ``save_for_backward(exp_logits, target_mask,
  masked_target_1d)`` — the fp32 softmax [T, v/t], a bool [T] and an int64 [T]; pretrain_gpt's
  ``torch.sum(losses * loss_mask)`` keeps the fp32 [T] loss mask;
- transformers' ``ForCausalLMLoss``: ``F.pad(labels, (0, 1), value=-100)`` then ``[..., 1:]``: with b = 1
  the shifted labels are a view of the padded [1, s+1] storage, with b > 1 ``.contiguous()`` copies [b, s];
- torchtitan's loss divides the summed loss by an int64 token count (kept); Gemma-2's final softcap keeps
  tanh's output [b, s, v] in the activations' dtype.

Sizes: h = 64, 4 heads, f = 160, v = 1000, b = 2, s = 32 (T = 64 tokens), 4 layers, bf16-mixed.
"""

from __future__ import annotations

from typing import Any

import pytest
from tiny_setup import B, H, S, T, V, tiny_setup

from memplan.blocks import head
from memplan.blocks.inventory import Block, Dims, Role
from memplan.config import DType, Impl, ImplConfig, LossKind, Precision, Setup, TrainingConfig
from memplan.config.impl import Family
from memplan.config.strategy import Attention

BF16, FP32, BOOL, INT64 = DType.BF16, DType.FP32, DType.BOOL, DType.INT64
R, K = Role, Block
STD, CHUNKED, FUSED = LossKind.STANDARD, LossKind.CHUNKED, LossKind.FUSED


def setup(
    loss: LossKind = STD,
    chunks: int = 1,
    b: int = B,
    impl: Impl = Impl.REFERENCE,
    precision: Precision = Precision.BF16_MIXED,
    **model: Any,
) -> Setup:
    base = tiny_setup(model, {"attention": Attention.FLASH}, impl=ImplConfig(impl=impl))
    training = TrainingConfig(micro_batch=b, seq_len=S, precision=precision)
    return base.model_validate({**dict(base), "training": training, "loss": loss, "loss_chunks": chunks})


Row = tuple[str, tuple[int, ...], DType, Role, Block]


def rows(s: Setup) -> list[Row]:
    rules = head.lm_head_rules(s, Dims.of(s))
    assert all(isinstance(r.reason, str) and r.reason for r in rules)  # every save says why it is kept
    return [(r.name, r.shape, r.dtype, r.role, r.block) for r in rules]


def head_input(*shape: int, dtype: DType = BF16) -> Row:
    return ("lm_head.input", shape, dtype, R.LINEAR_INPUT, K.LM_HEAD)


def log_probs(n: int) -> Row:
    return ("loss.log_probs", (n, V), FP32, R.LOG_PROBS, K.LOSS)


def labels(*shape: int) -> Row:
    return ("loss.labels", shape, INT64, R.LABELS, K.LOSS)


TOTAL_WEIGHT: Row = ("loss.total_weight", (), FP32, R.LOSS_SCALAR, K.LOSS)
COUNT: Row = ("loss.count", (), INT64, R.LOSS_SCALAR, K.LOSS)
# the chunked loss's own: freed by its backward, before the final norm's (``Role.CHUNK_SCALAR``, ...)
CHUNK_WEIGHT: Row = ("loss.total_weight", (), FP32, R.CHUNK_SCALAR, K.LOSS)
CHUNK_COUNT: Row = ("loss.count", (), INT64, R.CHUNK_SCALAR, K.LOSS)


def chunk_labels(n: int) -> Row:
    """A chunk's labels copy (b > 1)."""
    return ("loss.labels", (n,), INT64, R.CHUNK_LABELS, K.LOSS)


# ----------------------------------------------------------------------------------------------------
# torch.chunk's lengths: ⌈n/N⌉ each, the last what is left; fewer chunks once ⌈n/N⌉ has covered n.
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("n", "chunks", "sizes"),
    [
        (32, 1, [32]),
        (32, 4, [8, 8, 8, 8]),  # even
        (32, 3, [11, 11, 10]),  # ⌈32/3⌉ = 11: 11 + 11 + 10
        (32, 5, [7, 7, 7, 7, 4]),  # ⌈32/5⌉ = 7: four of 7 = 28, then 4
        (32, 6, [6, 6, 6, 6, 6, 2]),  # ⌈32/6⌉ = 6: five of 6 = 30, then 2
        (32, 12, [3] * 10 + [2]),  # ⌈32/12⌉ = 3: eleven chunks, not twelve
        (12, 5, [3, 3, 3, 3]),  # ⌈12/5⌉ = 3 covers 12 in four chunks
        (5, 3, [2, 2, 1]),
        (3, 8, [1, 1, 1]),  # more chunks than rows: one row each
        (1, 1, [1]),
    ],
)
def test_chunk_sizes_as_torch_chunk_cuts(n: int, chunks: int, sizes: list[int]) -> None:
    assert head.chunk_sizes(n, chunks) == sizes


# ----------------------------------------------------------------------------------------------------
# Liger's chunk: inc_factor = ⌈v/h⌉, rows = next_power_of_2(⌈T / inc_factor⌉) (1 stays 1).
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("tokens", "h", "v", "chunk"),
    [
        (64, 64, 1000, 4),  # ⌈1000/64⌉ = 16 (15.6 up); ⌈64/16⌉ = 4, a power of two already
        (96, 64, 1000, 8),  # ⌈96/16⌉ = 6 → 8
        (129, 64, 1000, 16),  # ⌈129/16⌉ = 9 → 16
        (64, 64, 64, 64),  # inc 1: 64
        (65, 64, 64, 128),  # inc 1: 65 → 128
        (64, 64, 65, 32),  # ⌈65/64⌉ = 2: 32
        (3, 64, 64, 4),  # 3 → 4
        (2, 64, 64, 2),
        (64, 64, 8192, 1),  # inc 128: ⌈64/128⌉ = 1 → 1
        (100, 32, 96, 64),  # inc 3: ⌈100/3⌉ = 34 → 64
    ],
)
def test_liger_chunk_rows(tokens: int, h: int, v: int, chunk: int) -> None:
    assert head.liger_chunk_rows(tokens, h, v) == chunk


# ----------------------------------------------------------------------------------------------------
# Saves: the standard loss under each profile
# ----------------------------------------------------------------------------------------------------
def test_standard_loss_keeps_the_input_log_probs_labels_and_total_weight() -> None:
    assert rows(setup()) == [head_input(B, S, H), log_probs(T), labels(B, S), TOTAL_WEIGHT]
    assert rows(setup(b=1)) == [head_input(1, S, H), log_probs(S), labels(1, S), TOTAL_WEIGHT]
    # fp32 training: the head's input in fp32; the log-probs are fp32 whatever the recipe
    s = setup(precision=Precision.FP32)
    assert rows(s) == [head_input(B, S, H, dtype=FP32), log_probs(T), labels(B, S), TOTAL_WEIGHT]


def test_transformers_keeps_the_padded_labels_storage_when_b_is_one() -> None:
    """b = 1: a view of the [1, s+1] padded storage (8 bytes more); b = 2: the [2, s] contiguous copy."""
    hf = Impl.HF
    assert rows(setup(b=1, impl=hf)) == [head_input(1, S, H), log_probs(S), labels(1, S + 1), TOTAL_WEIGHT]
    assert rows(setup(impl=hf)) == [head_input(B, S, H), log_probs(T), labels(B, S), TOTAL_WEIGHT]


def test_gemma2_final_softcap_keeps_tanhs_output() -> None:
    s = setup(impl=Impl.HF, family=Family.GEMMA2, final_softcap=30.0)
    tanh = ("loss.softcap_tanh", (B, S, V), BF16, R.LOG_PROBS, K.LOSS)
    assert rows(s) == [head_input(B, S, H), log_probs(T), tanh, labels(B, S), TOTAL_WEIGHT]
    assert head.softcap_rules(setup(impl=Impl.HF, family=Family.GEMMA2), Dims.of(s)) == []


def test_torchtitan_keeps_the_token_count_it_divides_by() -> None:
    s = setup(impl=Impl.TORCHTITAN)
    assert rows(s) == [head_input(B, S, H), log_probs(T), labels(B, S), TOTAL_WEIGHT, COUNT]
    assert [(r.name, r.shape, r.dtype) for r in head.count_rules(s)] == [("loss.count", (), INT64)]
    assert head.count_rules(setup()) == head.count_rules(setup(impl=Impl.HF)) == []
    assert head.count_rules(setup(FUSED)) == []


def test_megatron_vocab_parallel_cross_entropy() -> None:
    """exp_logits fp32 [T, v], target_mask bool [T], masked_target int64 [T], the fp32 loss mask [T]; no
    labels, no total weight."""
    loss = [
        ("loss.softmax", (T, V), FP32, R.LOG_PROBS, K.LOSS),
        ("loss.target_mask", (T,), BOOL, R.LABELS, K.LOSS),
        ("loss.masked_target", (T,), INT64, R.LABELS, K.LOSS),
        ("loss.loss_mask", (T,), FP32, R.LABELS, K.LOSS),
    ]
    assert rows(setup(impl=Impl.MEGATRON)) == [head_input(B, S, H), *loss]
    # One rank of t = 2: its [T, v/2] share; T = b·s = 3·8 = 24 (not b + s, not s alone).
    d = Dims(b=3, s=8, h=H, a=4, kv=4, d=16, f=160, v=V // 2, layers=4, act=BF16)
    got = [(r.name, r.shape, r.dtype, r.role, r.block) for r in head.vocab_parallel_loss_rules(d)]
    assert [(n, shape) for n, shape, *_ in got] == [
        ("loss.softmax", (24, 500)),
        ("loss.target_mask", (24,)),
        ("loss.masked_target", (24,)),
        ("loss.loss_mask", (24,)),
    ]
    assert [r[2:] for r in got] == [r[2:] for r in loss]
    # bytes: 4·24·500 + 24 + 8·24 + 4·24
    assert sum(r.bytes for r in head.vocab_parallel_loss_rules(d)) == 48_000 + 24 + 192 + 96


# ----------------------------------------------------------------------------------------------------
# Saves: the chunked loss (views at b = 1 or one chunk, copies per chunk at b > 1)
# ----------------------------------------------------------------------------------------------------
def chunk_saves(rows_per_chunk: list[int]) -> list[Row]:
    return [r for n in rows_per_chunk for r in (log_probs(n), CHUNK_WEIGHT)]


def test_chunked_b2_copies_each_chunks_input_and_labels() -> None:
    """s = 32 in 3 chunks: 11, 11, 10 positions → b·c = 22, 22, 20 rows."""
    n = [22, 22, 20]
    expected = [
        *(("lm_head.input", (c, H), BF16, R.LINEAR_INPUT, K.LM_HEAD) for c in n),
        *chunk_saves(n),
        *(chunk_labels(c) for c in n),
        CHUNK_COUNT,
    ]
    assert rows(setup(CHUNKED, 3)) == expected
    # 5 chunks: 7, 7, 7, 7, 4 positions; fp32 training copies fp32 inputs
    n = [14, 14, 14, 14, 8]
    got = rows(setup(CHUNKED, 5, precision=Precision.FP32))
    assert got[:5] == [("lm_head.input", (c, H), FP32, R.LINEAR_INPUT, K.LM_HEAD) for c in n]
    assert got[5:15] == chunk_saves(n)
    assert got[15:] == [*(chunk_labels(c) for c in n), CHUNK_COUNT]


def test_two_chunks_at_b2_are_copies() -> None:
    """chunked:2: 16 + 16 positions, 32 rows each, two copies of the input and of the labels."""
    n = [32, 32]
    expected = [
        *(("lm_head.input", (c, H), BF16, R.LINEAR_INPUT, K.LM_HEAD) for c in n),
        *chunk_saves(n),
        *(chunk_labels(c) for c in n),
        CHUNK_COUNT,
    ]
    assert rows(setup(CHUNKED, 2)) == expected


def test_chunked_b1_keeps_one_input_and_one_labels_storage() -> None:
    """b = 1: chunks of 11, 11, 10 positions are views; only the log-probs and total weights are per chunk."""
    expected = [head_input(1, S, H), *chunk_saves([11, 11, 10]), labels(1, S), CHUNK_COUNT]
    assert rows(setup(CHUNKED, 3, b=1)) == expected


def test_one_chunk_is_the_whole_tensor_even_at_b2() -> None:
    assert rows(setup(CHUNKED, 1)) == [head_input(B, S, H), *chunk_saves([T]), labels(B, S), CHUNK_COUNT]


def test_more_chunks_than_positions() -> None:
    """chunked:40 over s = 32: 32 chunks of one position, b·1 = 2 rows each."""
    got = rows(setup(CHUNKED, 40))
    assert len(got) == 32 + 2 * 32 + 32 + 1
    assert set(got[:32]) == {("lm_head.input", (2, H), BF16, R.LINEAR_INPUT, K.LM_HEAD)}
    assert got[32:96] == chunk_saves([2] * 32)
    assert set(got[96:128]) == {chunk_labels(2)} and got[128] == CHUNK_COUNT


@pytest.mark.parametrize(("chunks", "b"), [(1, 2), (3, 2), (3, 1), (6, 2), (40, 2)])
def test_chunked_log_probs_are_the_standard_bytes(chunks: int, b: int) -> None:
    """Autograd keeps every chunk's log-probs: 4·T·v as standard; the copies' inputs and labels are the
    same bytes as the one storage, in pieces."""
    s = setup(CHUNKED, chunks, b=b)
    by: dict[str, int] = {}
    for r in head.lm_head_rules(s, Dims.of(s)):
        by[r.name] = by.get(r.name, 0) + r.bytes
    chunk_count = min(chunks, S)  # 1, 3, 3, 6 (⌈32/6⌉ = 6 leaves six), 32
    assert by == {
        "lm_head.input": 2 * b * S * H,
        "loss.log_probs": 4 * b * S * V,
        "loss.total_weight": 4 * chunk_count,
        "loss.labels": 8 * b * S,
        "loss.count": 8,
    }


# ----------------------------------------------------------------------------------------------------
# Saves: the fused loss
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("precision", "dtype"), [(Precision.BF16_MIXED, BF16), (Precision.FP32, FP32)])
@pytest.mark.parametrize("b", [1, 2])
def test_fused_keeps_the_two_gradients_it_made(precision: Precision, dtype: DType, b: int) -> None:
    assert rows(setup(FUSED, b=b, precision=precision)) == [
        ("loss.grad_input", (b * S, H), dtype, R.HEAD_INPUT_GRAD, K.LOSS),
        ("loss.grad_weight", (V, H), dtype, R.HEAD_WEIGHT_GRAD, K.LOSS),
    ]


# ----------------------------------------------------------------------------------------------------
# The training loop's labels [b, s] when no save is that storage: 8·b·s bytes.
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("loss", "chunks", "b", "nbytes"),
    [
        (STD, 1, 2, 0),  # nll_loss keeps the labels themselves
        (STD, 1, 1, 0),
        (FUSED, 1, 2, 8 * T),  # Liger keeps no labels: 512
        (FUSED, 1, 1, 8 * S),  # 256
        (CHUNKED, 1, 2, 0),  # one chunk: a view
        (CHUNKED, 3, 1, 0),  # b = 1: views
        (CHUNKED, 2, 2, 8 * T),  # two chunks: copies
        (CHUNKED, 3, 2, 8 * T),  # copies: the loop's own [2, 32] beside them
        (CHUNKED, 40, 2, 8 * T),
    ],
)
def test_loop_labels_bytes(loss: LossKind, chunks: int, b: int, nbytes: int) -> None:
    s = setup(loss, chunks, b=b)
    assert head.loop_labels_bytes(s, Dims.of(s)) == nbytes


# ----------------------------------------------------------------------------------------------------
# The loss backward's buffers beside every save
# ----------------------------------------------------------------------------------------------------
# standard: nll_loss's gradient and log_softmax's input gradient, fp32 [T, v] each: 2·4·T·v.
# fused: none (its backward scales the kept gradients in place).
# chunked: the last chunk (c_last positions) runs first: 8·b·c_last·v, less what its nll_loss backward
# freed: the fp32 total weight (4) and, for copies, its int64 labels (8·b·c_last). When c_last < 2c/3 the
# next chunk's 8·b·c·v less the last chunk's freed log-probs 4·b·c_last·v is larger (blocks/head.py's NB:
# that chunk's dX and dW pieces are not counted).
@pytest.mark.parametrize(
    ("loss", "chunks", "b", "nbytes"),
    [
        (STD, 1, 2, 8 * T * V),  # 512,000
        (STD, 1, 1, 8 * S * V),  # 256,000
        (FUSED, 1, 2, 0),
        (CHUNKED, 1, 2, 8 * 64 * V - 4),  # one chunk of 64 rows, a view: 511,996
        (CHUNKED, 2, 2, 8 * 32 * V - 4 - 8 * 32),  # 16 positions, 32 rows each, copies: 255,740
        (CHUNKED, 4, 2, 8 * 16 * V - 4 - 8 * 16),  # 8 positions, 16 rows each, copies: 127,868
        (CHUNKED, 3, 2, 8 * 20 * V - 4 - 8 * 20),  # last chunk 10 positions, 20 rows: 159,836
        (CHUNKED, 3, 1, 8 * 10 * V - 4),  # 79,996 (views: no labels freed)
        # 7, 7, 7, 7, 4: 4 < 14/3; 8·14·v − 4·8·v = 80,000 > 8·8·v = 64,000; less 4 + 8·8
        (CHUNKED, 5, 2, 8 * 14 * V - 4 * 8 * V - 4 - 8 * 8),  # 79,932
        # 6 × 5 then 2: 8·12·v − 4·4·v = 80,000 > 8·4·v; less 4 + 8·4
        (CHUNKED, 6, 2, 8 * 12 * V - 4 * 4 * V - 4 - 8 * 4),  # 79,964
        (CHUNKED, 6, 1, 8 * 6 * V - 4 * 2 * V - 4),  # 39,996
        (CHUNKED, 40, 2, 8 * 2 * V - 4 - 8 * 2),  # 32 chunks of 2 rows: 15,980
    ],
)
def test_loss_backward_transient(loss: LossKind, chunks: int, b: int, nbytes: int) -> None:
    s = setup(loss, chunks, b=b)
    assert head.loss_backward_transient(s, Dims.of(s)) == nbytes


# ----------------------------------------------------------------------------------------------------
# FLOPs: the logits 2·T·h·v forward; dX = dY·W and dW = dYᵀ·X (2 × that) backward — in the forward
# phase for the fused loss.
# ----------------------------------------------------------------------------------------------------
LOGITS = 2 * T * H * V  # 8,192,000


@pytest.mark.parametrize(
    ("loss", "chunks", "impl", "flops"),
    [
        (STD, 1, Impl.REFERENCE, (LOGITS, 2 * LOGITS)),
        (CHUNKED, 3, Impl.REFERENCE, (LOGITS, 2 * LOGITS)),  # the chunks' products add up to T rows
        (FUSED, 1, Impl.REFERENCE, (3 * LOGITS, 0)),
        (STD, 1, Impl.MEGATRON, (LOGITS, 2 * LOGITS)),
    ],
)
def test_head_flops(loss: LossKind, chunks: int, impl: Impl, flops: tuple[int, int]) -> None:
    s = setup(loss, chunks, impl=impl)
    assert LOGITS == 8_192_000
    assert head.lm_head_flops(Dims.of(s)) == LOGITS
    assert head.head_flops(s, Dims.of(s)) == flops


def test_lm_head_params() -> None:
    assert head.lm_head_params(setup().model) == H * V  # 64,000
    assert head.lm_head_params(setup(tied_embeddings=True).model) == 0
