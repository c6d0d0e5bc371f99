"""torchtitan's eager standard loss, tensor by tensor, in the allocator's replay (blocks/head.py
``forward_loss_blocks``, ``loss_backward_blocks``; timeline's "forward: loss" point; reserved's pieces):
Table 1's FSDP run of torchtitan's performance.md, by hand."""

from __future__ import annotations

from memplan import alloc_stream
from memplan.api import Options, build
from memplan.timeline import timeline

T, V = 2 * 8192, 128_256  # tokens of the micro-batch (b 2, s 8192) and Llama 3.1's vocabulary
P = 2 * T * V  # the lm head's bf16 output [T, v]: 4,202,692,608 B
X = 4 * T * V  # its fp32 copy, and the fp32 log-probs log_softmax makes of it: 8,405,385,216 B each
T1 = Options(
    model="llama-3.1-8b",
    seq=8192,
    batch=2,
    gpus=8,
    zero=3,
    gpu="h100-teton",
    checkpointing="selective",
    impl="torchtitan",
)


def test_the_forwards_loss_is_a_point_with_its_three_tensors() -> None:
    points = timeline(build(T1).result, forward_points=32)
    labels = [p.label for p in points]
    at = labels.index("forward: loss")
    loss, end = points[at], points[at + 1]
    assert end.label == "forward: end"
    assert (P, X) == (4_202_692_608, 8_405_385_216)
    assert loss.pieces == (P, X, X, 4)  # P, P.float(), log_softmax's output, the loss scalar
    assert loss.terms["transient"] == P + 2 * X + 4
    # before the loss: every save but the loss's — its log-probs (X), int64 labels [2, 8192], fp32
    # total weight, int64 count
    assert end.terms["activations"] - loss.terms["activations"] == X + 8 * T + 4 + 8
    back = points[labels.index("loss backward")]
    # nll_loss's gradient and log_softmax's input gradient, then the + 4 (the loss scalar)
    assert back.pieces == (X, X, 4) and back.terms["transient"] == 2 * X + 4


def test_the_replay_allocates_them_one_by_one() -> None:
    r = build(T1).result
    codes = alloc_stream.codes(alloc_stream.stream_inputs(r))
    i = codes.index(P)
    assert codes[i : i + 4] == [P, X, X, 4]
    # the saves the loss keeps, made at the forward's end as the tensors they are (``Point.saves``): the
    # log-probs (X, in a block the transients left), the int64 labels, the fp32 total weight, the count
    j = codes.index(X, i + 4)  # after the transients' frees
    assert all(c < 0 for c in codes[i + 4 : j]) and codes[j : j + 4] == [X, 8 * T, 4, 8]
    # two steps, each: the forward's X and log-probs, the saved log-probs, the backward's two gradients
    assert codes.count(X) == 2 * (2 + 1 + 2)
    assert codes.count(X + 8 * T + 4 + 8) == 0


def test_the_references_loss_is_the_same_three_tensors() -> None:
    """The reference's ``standard_loss`` makes P, X = P.float() and the log-probs as torchtitan's does (the
    CUDA allocator's snapshot of GPT-2 on an H200: segments of 100 and 198 MiB for [1024, 50257] bf16
    and fp32, docs/gpu-profile.md)."""
    points = timeline(build(T1.model_copy(update={"impl": "reference"})).result, forward_points=32)
    labels = [p.label for p in points]
    assert points[labels.index("forward: loss")].pieces == (P, X, X, 4)
    assert points[labels.index("loss backward")].pieces == (X, X, 4)


def test_elsewhere_the_transients_stay_one_block() -> None:
    for changes in ({"impl": "hf", "checkpointing": "none"}, {"compile": True}):
        r = build(T1.model_copy(update=changes)).result
        points = timeline(r, forward_points=32)
        assert "forward: loss" not in [p.label for p in points]
        assert all(not p.pieces and not p.saves for p in points)
        assert alloc_stream.stream_inputs(r).pieces == alloc_stream.stream_inputs(r).saves == ()


def test_a_compile_that_leaves_the_loss_eager_keeps_its_tensors() -> None:
    """``--compile --no-compile-loss`` (the December-2024 runs: the blocks compiled, the loss eager) has the
    eager loss's tensors; ``--compile`` alone is torchtitan 0.3.0's compiled loss (not modelled: one
    block)."""
    eager = timeline(build(T1).result, forward_points=32)
    blocks = build(T1.model_copy(update={"compile": True, "compile_loss": False})).result
    points = timeline(blocks, forward_points=32)
    assert [p.pieces for p in points if p.pieces][:2] == [p.pieces for p in eager if p.pieces][:2]
    assert [p.saves for p in points if p.saves] == [(X, 8 * T, 4, 8)]


# Table 4's 2D run: Llama 3.1 70B on tp 8 (+ SP) × dp 32, b 16, s 8192: T = 131,072 tokens, v/t = 16,032
T4, V4 = 16 * 8192, 128_256 // 8
T4_RUN = Options(
    model="llama-3.1-70b",
    seq=8192,
    batch=16,
    gpus=256,
    zero=3,
    tp=8,
    sp=True,
    gpu="h100-teton",
    checkpointing="full",
    impl="torchtitan",
)


def test_the_loss_parallel_functions_tensors_by_hand() -> None:
    """torchtitan 0.3.0's ``_LossParallelCrossEntropy`` on a tp 8 rank ([T, v/8]): the forward holds the lm
    head's bf16 output P, ``logits_2d`` (X), ``shifted`` and ``torch.exp(shifted)`` at its sum (fp32,
    4·T·v/8 = 8,405,385,216 B each), then the log-probs take the exponent's block; the backward's
    ``zeros_like``, ``exp`` and their sum, then its [T]-sized locals and scalars (33·T + 8) and the loss
    scalar's 4 as one block (``loss_parallel_backward_transient``). Measured per tensor on a tp 2 rank of
    the tiny model: tests/hf/test_torchtitan_peak.py."""
    p4, x4 = 2 * T4 * V4, 4 * T4 * V4
    assert (p4, x4) == (4_202_692_608, 8_405_385_216)
    points = timeline(build(T4_RUN).result, forward_points=80)
    labels = [p.label for p in points]
    loss = points[labels.index("forward: loss")]
    assert loss.pieces == (p4, x4, x4, x4, 4)
    back = points[labels.index("loss backward")]
    assert back.pieces == (x4, x4, x4, 33 * T4 + 8 + 4)
    # the saves: the log-probs and the int64 labels [T], the count
    assert points[labels.index("forward: end")].saves == (x4, 8 * T4, 8)
