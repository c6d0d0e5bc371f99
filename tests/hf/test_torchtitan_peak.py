"""The peak of one torchtitan rank's forward and backward (``trace --impl torchtitan`` over ranks), measured
by ``measure.distributed.titan_peak`` under fake tensors on torch's fake process group, against the
estimate's moments (without the optimizer's states: the run builds none).

On a tensor-parallel rank of the tiny model the peak is the loss backward, inside torchtitan's
``_LossParallelCrossEntropy.backward`` (components/loss.py) at ``grad_input + torch.exp(log_probs)``:
three fp32 [T, v/t] and its [T] locals beside every save, and the loop's ids, which the vocabulary-parallel
embedding does not keep (it keeps a clamped copy).
"""

from __future__ import annotations

import json

import jsonschema  # type: ignore[import-untyped]  # (no stubs installed)
import pytest

pytest.importorskip("torchtitan.models.llama3")

from memplan.config import Fp8Recipe, Impl, Setup
from memplan.engine import Result, estimate
from memplan.measure.distributed.titan_peak import estimated_moments, peak_json
from memplan.schema import command_schema
from tests.hf.harness import hf_setup, titan_rank
from tests.hf.test_torchtitan_ranks import ranked

pytestmark = pytest.mark.xdist_group("titan_rank")  # one worker holds titan_rank's traces (harness)

MOMENTS = ["loss backward", "final norm backward", "layer backward", "embedding backward"]
"""The backward's moments a torchtitan rank's trace and its estimate are compared at."""


def assert_every_moment_exact(setup: Setup) -> Result:
    """Trace ``setup``'s rank and assert each of ``MOMENTS`` measures what the estimate says; the estimate."""
    est = estimate(setup)
    measured, estimated = titan_rank(setup).peak.moments(MOMENTS), estimated_moments(est)
    assert {n: measured[n] - estimated[n] for n in MOMENTS} == dict.fromkeys(MOMENTS, 0)  # type: ignore[operator]
    return est


@pytest.mark.parametrize("sp", [False, True])
def test_tp_rank_peak_is_the_loss_parallel_backward(sp: bool) -> None:
    setup = ranked(hf_setup("tiny", seq=32, batch=2, impl=Impl.TORCHTITAN), 2, sp)
    est, run = estimate(setup), titan_rank(setup)
    peak = run.peak
    moments = estimated_moments(est)
    assert peak.peak == moments["loss backward"] == max(moments.values())
    assert peak.phase == "backward" and peak.op == "aten.add"  # grad_input + exp(log_probs)
    # By hand, tiny on tp 2: h 64, a/t 2 heads, kv/t 1, d 16, f/t 64, v/t 128, b 2, s 32: T = 64 tokens.
    T, v, h, f, qkv = 64, 128, 64, 64, (2 + 2 * 1) * 16
    layer = qkv * h + h * 2 * 16 + 3 * f * h + 2 * h  # wqkv, wo [h, a/t·d], w1 w3 w2, two norms
    weights = 2 * (2 * v * h + 2 * layer + h)  # bf16: embedding, lm head, 2 layers, final norm
    rope = 2 * 32 * 8 * 8  # each layer's complex64 cache [s, d/2], a buffer its saves view
    assert peak.parts["states"] == weights + rope
    assert peak.parts["gradients"] == 0  # none made yet
    assert peak.parts["saved"] == run.measured.activations - rope  # every save, the caches apart
    # zeros_like, exp and their sum, fp32 [T, v/t]; safe_labels, local_labels, row_idx (int64),
    # out_of_range (bool), grad_update and the masked grad_output (fp32): 33 B per token; three fp32
    # scalars (the seed, the division's output gradient, the loss); the loop's int64 ids [b, s].
    assert peak.parts["transient"] == 3 * 4 * T * v + 33 * T + 3 * 4 + 8 * T
    assert peak.transient["aten.zeros_like"] == peak.transient["aten.exp"] == 4 * T * v


def test_peak_json_and_trace_cli() -> None:
    """``trace --impl torchtitan --tp 2 --sp``: the ``peak`` object, valid against trace's schema, each
    moment estimated and measured (the loss backward's reading exact), and the rich report renders."""
    from typer.testing import CliRunner

    from memplan.cli.app import app

    runner = CliRunner(env={"COLUMNS": "120", "NO_COLOR": "1"})
    args = ["trace", "--model", "tiny", "--seq", "32", "--impl", "torchtitan", "--tp", "2", "--sp"]
    result = runner.invoke(app, [*args, "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    jsonschema.validate(out, command_schema("trace"))
    peak = out["peak"]
    assert peak["equal"] and peak["delta"] == 0 and peak["estimated_phase"] == "loss backward"
    loss = next(m for m in peak["moments"] if m["moment"] == "loss backward")
    assert loss["measured"] == loss["estimated"] == peak["measured"]
    shown = runner.invoke(app, [*args, "--device", "cpu"])
    assert shown.exit_code == 0 and "Rank peak of forward and backward" in shown.output


def test_fsdp2_resizes_are_followed() -> None:
    """ZeRO-3 over dp 2 (tp 2, SP): FSDP2 frees each unit's unsharded parameters with ``resize_(0)`` (no
    dispatched op); the tracker follows it, so after the step the live bytes are the rank's own again:
    its parameter shards, buffers and sharded gradients (each storage once)."""
    setup = ranked(hf_setup("tiny", seq=32, batch=2, impl=Impl.TORCHTITAN), 2, True, 2, 3)
    run = titan_rank(setup)
    end = run.peak.curve.samples[-1]
    rope = 2 * 32 * 8 * 8
    # The gradients at rest: FSDP2's reduce-scattered shards, one per parameter, in the sharded
    # parameters' dtype (fp32 under FSDP2's mixed precision): the same bytes as the parameter shards.
    assert end == run.param_bytes + rope + run.param_bytes
    assert run.peak.windows == {}  # the live set per stretch is kept only when asked


def test_peak_json_without_a_reading() -> None:
    """A moment whose stretch the curve lacks reads None (no delta), never NaN: the JSON stays valid."""
    from memplan.measure.distributed.titan_peak import PeakRun
    from memplan.measure.instruments.tracker import Curve

    setup = ranked(hf_setup("tiny", seq=32, impl=Impl.TORCHTITAN), 2, True)
    parts = dict.fromkeys(("states", "gradients", "saved", "transient"), 0)
    run = PeakRun(10, "backward", "aten.add", parts, curve=Curve([1, 10], []))
    out = peak_json(estimate(setup), run)
    assert all(m["measured"] is None and m["delta"] is None for m in out["moments"])
    json.dumps(out, allow_nan=False)


def tiny_tp2_weights() -> int:
    """tiny's bf16 parameters on a tp 2 rank (h 64, a/t 2 heads, kv/t 1, d 16, f/t 64, v/t 128)."""
    h, f, v, qkv = 64, 64, 128, (2 + 2 * 1) * 16
    layer = qkv * h + h * 2 * 16 + 3 * f * h + 2 * h  # wqkv, wo [h, a/t·d], w1 w3 w2, two norms
    return 2 * (2 * v * h + 2 * layer + h)  # embedding, lm head, 2 layers, final norm


def test_zero2_rank_holds_its_shards_beside_the_gathered_weights() -> None:
    """torchtitan's ZeRO-2 (FSDP2, ``reshard_after_forward=False``) on tp 2 + SP × dp 2: at the loss's
    backward the rank holds its dim-0 shards (half its TP weights: every dim 0 even) and every unit's
    unsharded parameters, gathered in forward and kept for backward: the estimate's whole weights plus
    the shards (``analytic.fsdp.moments.zero2_shards_beside``), exact."""
    setup = ranked(hf_setup("tiny", seq=32, batch=2, impl=Impl.TORCHTITAN), 2, True, 2, 2)
    est, run = estimate(setup), titan_rank(setup)
    weights, rope = tiny_tp2_weights(), 2 * 32 * 8 * 8
    # the shards are fp32 (FSDP2's mixed precision): half the elements at twice the bf16 bytes
    assert run.param_bytes == weights
    assert run.peak.parts["states"] == weights + rope
    assert run.peak.transient["aten.empty"] == weights  # FSDP2's unsharded parameters (all-gather outputs)
    assert run.peak.peak == estimated_moments(est)["loss backward"] == max(estimated_moments(est).values())


def test_zero3_loss_backward_holds_the_head_unit_gathered() -> None:
    """torchtitan's ZeRO-3 as its trainer runs it ("default": the embedding and blocks resharded after
    forward, [norm, lm_head] not) on tp 2 + SP × dp 2: at the loss's backward the rank holds its shards and
    the [norm, lm_head] unit gathered in its forward; the moment is exact."""
    setup = ranked(hf_setup("tiny", seq=32, batch=2, impl=Impl.TORCHTITAN), 2, True, 2, 3)
    est, run = estimate(setup), titan_rank(setup)
    # every dim 0 even: half the TP rank's elements, fp32 (FSDP2's mixed precision): the bf16 TP bytes
    assert run.param_bytes == tiny_tp2_weights()
    # [norm, lm_head] unsharded on the tp 2 rank: final norm [h] + lm head [v/t, h] = 64 + 128·64 =
    # 8,256 elements, bf16 (both dims 0 even over dp 2: no padding).
    head = 2 * (64 + 128 * 64)
    assert est.peak.moments["loss backward"]["weights"] == run.param_bytes + head
    loss = run.peak.moments(["loss backward"])["loss backward"]
    assert loss == estimated_moments(est)["loss backward"]
    T, v = 64, 128
    saves = run.measured.activations
    assert loss == run.param_bytes + head + saves + 3 * 4 * T * v + 33 * T + 3 * 4 + 8 * T  # rope views saved


def test_full_scale_loss_backward_of_rank_0_of_16384() -> None:
    """Llama 3.1 405B's widths (one layer), seq 8192, tp 8 with SP × dp 2,048 under ZeRO-3: rank 0 of
    16,384 on the fake process group. Its loss backward moment equals the estimate's to the byte: the
    rank's FSDP2 shards, the [norm, lm_head] unit kept gathered from its forward (torchtitan's "default"
    policy), every save and the loss-parallel backward's 3 fp32 [T, v/t] (T 8192, v/t 16,032) with its
    locals. NB: the other moments are not exact (titan_peak's module docstring)."""
    setup = ranked(hf_setup("llama-3.1-405b", seq=8192, layers=1, impl=Impl.TORCHTITAN), 8, True, 2048, 3)
    est, run = estimate(setup), titan_rank(setup, windows=True)
    loss = run.peak.moments(["loss backward"])["loss backward"]
    assert loss == estimated_moments(est)["loss backward"]
    T, v = 8192, 16032
    transient = 3 * 4 * T * v + 33 * T + 3 * 4 + 8 * T  # 1,576,345,612 B: three 501 MiB fp32 [T, v/t]
    # The head unit, unsharded as views of its padded all-gather output: the norm [16,384] (8 rows a
    # shard) and the lm head's 16,032 rows padded to ⌈16,032/2,048⌉ · 2,048 = 16,384, × h 16,384, bf16.
    head = 2 * (16384 + 16384 * 16384)
    assert loss == run.param_bytes + head + run.measured.activations + transient
    _, op, _, by_op = run.peak.windows["forward"]  # from the loss on: its backward's highest point
    assert op == "aten.add" and by_op["aten.zeros_like"] == by_op["aten.exp"] == 4 * T * v


def test_embedding_backward_holds_the_buffers_and_the_loop_tensors() -> None:
    """The embedding's backward on a tp 2 + SP rank at Llama 3 8B's widths (2 layers, s 256): every
    gradient is made and the weights are whole; beside them the loop's ids, labels and valid-token count,
    the vocabulary-parallel embedding's clamped ids (its save), both layers' RoPE buffers, the incoming
    gradient times the vocabulary mask and the fp32 loss scalars; exact."""
    setup = ranked(hf_setup("llama-3-8b", seq=256, impl=Impl.TORCHTITAN), 2, True)
    est, run = estimate(setup), titan_rank(setup)
    moment = run.peak.moments(["embedding backward"])["embedding backward"]
    assert moment == estimated_moments(est)["embedding backward"]
    T, h = 256, 4096
    rope = 2 * 256 * 64 * 8  # [s, d/2] complex64 per layer
    # weights and gradients (bf16, the same bytes), 3 int64 [T] (ids, labels, clamped ids), the int64
    # count, dY·mask [T, h] bf16, the seed gradient and the loss (fp32 scalars)
    assert moment == 2 * run.param_bytes + rope + 3 * 8 * T + 8 + 2 * T * h + 2 * 4


def test_sp_final_norm_backward_tops_at_the_head_input_scatter() -> None:
    """Under torchtitan's SP plan the lm head's input is the gathered final norm output, so its gradient is
    reduce-scattered before the norm's backward, which runs on the rank's T/t tokens: at Llama 3.1 405B's
    widths on tp 8 the stretch tops at that reduce-scatter (the lm head's dX [T, h], funcol's
    concatenated copy and the [T/t, h] output, which the wait returns), the norm's saves still held;
    exact."""
    setup = ranked(hf_setup("llama-3.1-405b", seq=8192, layers=1, impl=Impl.TORCHTITAN), 8, True)
    est, run = estimate(setup), titan_rank(setup, windows=True)
    moment = run.peak.moments(["final norm backward"])["final norm backward"]
    assert moment == estimated_moments(est)["final norm backward"]
    T, h, t = 8192, 16384, 8
    _, _, _, by_op = run.peak.windows["backward final_norm"]
    assert by_op["aten.mm"] == by_op["aten.cat"] == 2 * T * h  # bf16 [T, h]
    assert by_op["_c10d_functional.reduce_scatter_tensor"] == 2 * T // t * h
    assert "_c10d_functional.wait_tensor" not in by_op  # the wait returns the collective's tensor


@pytest.mark.parametrize(("sp", "dp", "zero"), [(False, 1, 0), (True, 2, 3)])
def test_real_tensors_peak_where_fake_ones_do(sp: bool, dp: int, zero: int) -> None:
    """The tiny model's rank with real (uninitialised) tensors over the fake group peaks at the same bytes,
    holding the same parts, as under fake tensors."""
    setup = ranked(hf_setup("tiny", seq=32, batch=2, impl=Impl.TORCHTITAN), 2, sp, dp, zero)
    real, fake = titan_rank(setup, fake=False).peak, titan_rank(setup).peak
    assert (real.peak, real.parts, real.op) == (fake.peak, fake.parts, fake.op)


def test_zero3_layer_and_final_norm_buffers() -> None:
    """FSDP2 under ZeRO-3 on tp 2 + SP × dp 2: beside layer i's backward, the unit below's prefetched flat
    all-gather output (bf16) and the unit above's fp32 reduce-scatter input; beside the final norm's,
    the [norm, lm_head] unit gathered and the top layer's prefetched output. By hand (the tiny model's tp 2
    rank; every dim 0 even, no padding): a layer unit 18,560 elements, the embedding 8,192, [norm, lm_head]
    8,256. Both moments exact, as without FSDP (the layer's since its sequence-parallel moments are
    modelled, ``analytic.moments.sp_moments.sp_mlp_moments``)."""
    from memplan.analytic.peak import zero3_head_gather, zero3_unit_buffers
    from memplan.strategies.tensor_parallel import tp_model

    base = hf_setup("tiny", seq=32, batch=2, impl=Impl.TORCHTITAN)
    zero3, plain = ranked(base, 2, True, 2, 3), ranked(base, 2, True)
    rank = zero3.model_copy(update={"model": tp_model(zero3.model, 2)})  # the rank's model, as the peak's
    layer, embedding, head = 18560, 8192, 8256
    assert zero3_unit_buffers(rank, 1, 2) == 2 * layer + 4 * head  # 37,120 + 33,024
    assert zero3_unit_buffers(rank, 0, 2) == 2 * embedding + 4 * layer  # 16,384 + 74,240
    assert zero3_head_gather(rank) == 2 * head + 2 * layer
    names = ["final norm backward", "layer backward"]

    def errors(setup: Setup) -> list[int | None]:
        measured = titan_rank(setup).peak.moments(names)
        estimated = estimated_moments(estimate(setup))
        return [None if measured[n] is None else measured[n] - estimated[n] for n in names]  # type: ignore[operator]

    (norm3, layer3), (norm, layer1) = errors(zero3), errors(plain)
    assert norm3 == norm == layer3 == layer1 == 0


@pytest.mark.parametrize(("tp", "dp"), [(1, 4), (1, 8), (2, 2)])
def test_zero3_reductions_of_the_head_and_embedding_units(tp: int, dp: int) -> None:
    """torchtitan's ZeRO-3 at Llama 3.1 8B's widths (2 layers, s 1,024, micro-batch 2, no AC) over dp 4
    and 8: the final norm's stretch tops at the [norm, lm_head] unit's post-backward and the embedding's
    at its own (``analytic.fsdp.moments.zero3_head_reduce``, ``zero3_embedding_parts``), each exact. By
    hand: the unit's flat fp32 reduce-scatter input (norm 4,096 + lm head 525,336,576 el: 2,101,362,688 B;
    the embedding's 2,101,346,304 B) beside its last parameter's unsharded bf16 gradient, which torch
    2.13's ``foreach_reduce`` keeps in its loop variable (the lm head's, the embedding's: 1,050,673,152 B)
    — the norm's is freed after the copy-in — and, at the head, the top block's prefetched all-gather
    output (218,112,000 el bf16) and the [T, h] bf16 gradient flowing on (2,048 × 4,096 × 2 B). On a
    tp 2 + SP rank the same moments on its TP-local units, the gradient flowing on its [T/t, h] sequence
    shard, and the vocabulary-parallel embedding's clamped ids (its save) freed before its reduce.
    Without tp every moment is exact: the layer's too, since W_O's gradient is not counted at the MLP
    norm's backward (``analytic.moments.layer_backward.layer_backward_transient``; it had been: 32 MiB more
    there,
    which made that moment top the layer's backward, 16 MiB above the measured)."""
    setup = ranked(hf_setup("llama-3.1-8b", seq=1024, batch=2, impl=Impl.TORCHTITAN), tp, tp > 1, dp, 3)
    est, run = estimate(setup), titan_rank(setup, windows=True)
    names = ["final norm backward", "embedding backward"]
    measured, estimated = run.peak.moments(names), estimated_moments(est)
    assert all(measured[n] == estimated[n] for n in names), (measured, estimated)
    if tp > 1:
        return
    everything = ["loss backward", *names, "layer backward"]
    measured = run.peak.moments(everything)
    assert {n: measured[n] for n in everything} == {n: estimated[n] for n in everything}
    _, op, _, by_op = run.peak.windows["backward final_norm"]
    assert op == "aten.empty"
    assert by_op["aten.empty"] == 2_101_362_688 + 2 * 218_112_000
    assert by_op["aten.mm"] == 1_050_673_152 and by_op["aten._to_copy"] == 2048 * 4096 * 2
    _, op, _, by_op = run.peak.windows["backward embedding"]
    assert (op, by_op["aten.empty"], by_op["aten.embedding_dense_backward"]) == (
        "aten.empty",
        2_101_346_304,
        1_050_673_152,
    )


@pytest.mark.parametrize(
    ("preset", "seq", "ckpt"),
    [
        ("tiny", 32, "selective"),
        ("tiny", 32, "full"),
        ("llama-3.1-8b", 8192, "selective"),
        ("llama-3.1-8b", 1024, "full"),
    ],
)
def test_checkpointed_layers_leave_their_rope_caches_module_state(preset: str, seq: int, ckpt: str) -> None:
    """Under torchtitan's SelectiveAC and FullAC no layer saves a view of its RoPE cache (the rotary ops
    re-run), so the caches are module buffers beside the saves at every moment
    (``analytic.head_moments.module_rope_buffers``): ZeRO-3 over dp 2, two layers, every moment exact. By
    hand at Llama 3.1 8B's widths: 2 × 8,192 × 64 × 8 B = 8 MiB, which the head's moments missed before.
    Nor does a re-run layer make its view again (``pieces.rerun_kept``): under FullAC the layer moment was
    one [s, d/2] complex64 over (2,048 B on the tiny model, 524,288 B at 8B's widths and s 1,024)."""
    setup = ranked(
        hf_setup(preset, seq=seq, batch=2, layers=2, impl=Impl.TORCHTITAN, checkpointing=ckpt), 1, False, 2, 3
    )
    assert_every_moment_exact(setup)
    if preset != "tiny":
        from memplan.analytic.head_moments import module_rope_buffers
        from memplan.blocks.inventory import Dims

        assert module_rope_buffers(setup, Dims.of(setup)) == 2 * seq * 64 * 8


def test_the_loss_parallel_forward_holds_four_vocabulary_blocks() -> None:
    """The forward's highest point on a tp 2 + SP rank of the tiny model is the end of
    ``_LossParallelCrossEntropy.forward`` (components/loss.py), T = 64 tokens, v/t = 128: the lm head's bf16
    output P (``aten.mm``, 2·T·v/t), ``logits_2d = logits.float()`` X (``aten._to_copy``, 4·T·v/t),
    ``shifted`` (``aten.sub``, 4·T·v/t, beside the int64 ``local_labels`` [T] the same op made) and the
    saved log-probs in the exponent's freed place: the estimate's forward loss blocks (blocks/head.py
    ``forward_loss_blocks``: P, X, ``shifted``, the exponent, then the loss's 4 B)."""
    from memplan.timeline import timeline

    setup = ranked(hf_setup("tiny", seq=32, batch=2, impl=Impl.TORCHTITAN), 2, True)
    run = titan_rank(setup, windows=True)
    t, v = 64, 128
    high, _op, _parts, made = run.peak.windows["forward 1"]
    assert high == max(run.peak.curve.samples[: dict(run.peak.curve.notes)["forward"] + 1])
    assert made["aten.mm"] == 2 * t * v and made["aten._to_copy"] == 4 * t * v
    assert made["aten.sub"] == 4 * t * v + 8 * t
    loss = next(p for p in timeline(estimate(setup)) if p.label == "forward: loss")
    assert loss.pieces == (2 * t * v, 4 * t * v, 4 * t * v, 4 * t * v, 4)


@pytest.mark.parametrize(
    ("preset", "seq", "tp", "dp", "ckpt", "embedding", "block"),
    [
        ("tiny", 32, 1, 2, "none", 256 * 64, 36_992),
        ("tiny", 32, 2, 2, "none", 128 * 64, 18_560),  # tp 2 + SP: the TP-local units
        # Table 1's widths and rank (2 of 32 layers): s 8,192, micro-batch 2, dp 8, torchtitan's SelectiveAC
        ("llama-3.1-8b", 8192, 1, 8, "selective", 128_256 * 4096, 218_112_000),
    ],
)
def test_the_2024_root_wrapping_holds_what_the_estimate_says(
    preset: str, seq: int, tp: int, dp: int, ckpt: str, embedding: int, block: int
) -> None:
    """``--fsdp-wrap root`` (torchtitan's parallelize_llama of 2024, ``analytic.fsdp.root``) under ZeRO-3,
    measured on the fake process group beside torchtitan 0.3.0's wrapping: at every moment the root
    wrapping's estimate is off by what the 0.3.0 wrapping's is (the layer's own backward where it is
    not exact, under SelectiveAC: nothing else), and on the tiny model every moment is exact, on tp 2 +
    SP too. By hand, at the loss
    backward it holds, beyond 0.3.0's [norm, lm_head], the embedding (gathered at the forward's start,
    never resharded) and the top block (kept after its forward), bf16: the tiny model's 16,384 + 36,992
    el = 106,752 B (on tp 2 + SP its TP-local 8,192 + 18,560 el); Llama
    3.1 8B's 525,336,576 + 218,112,000 el = 1,486,897,152 B, the 1.38 GiB docs/published-memory.md sized
    by hand."""
    base = hf_setup(preset, seq=seq, batch=2, impl=Impl.TORCHTITAN, checkpointing=ckpt)
    names = MOMENTS

    def errors(wrap: str) -> tuple[dict[str, int], int]:
        setup = ranked(base, tp, tp > 1, dp, 3, fsdp_wrap=wrap)
        measured, estimated = (
            titan_rank(setup).peak.moments(names),
            estimated_moments(estimate(setup)),
        )
        return {n: measured[n] - estimated[n] for n in names}, measured["loss backward"]  # type: ignore[operator]

    (root, root_loss), (units, units_loss) = errors("root"), errors("units")
    assert root == units
    assert root["embedding backward"] == 0
    assert preset != "tiny" or root == dict.fromkeys(names, 0)
    assert root_loss - units_loss == 2 * (embedding + block)


@pytest.mark.parametrize(("tp", "sp"), [(1, False), (2, True)])
def test_a_tied_model_is_measured_tied(tp: int, sp: bool) -> None:
    """torchtitan's trainer re-ties the embedding and the lm head after ``to_empty`` (its
    ``Decoder.init_states``); the rank harness does too (``measure.distributed.titan.retie``), so a tied
    model's rank holds one [v, h] and its loss backward equals the estimate's (before: one [v, h] more,
    measured on an untied model). dp 1; under FSDP2: ``test_the_tied_unit_holds_what_the_estimate_says``."""
    setup = ranked(hf_setup("tiny", seq=32, batch=2, impl=Impl.TORCHTITAN, tied_embeddings=True), tp, sp)
    est, run = estimate(setup), titan_rank(setup)
    assert run.param_bytes == est.states.weights
    measured = run.peak.moments(["loss backward"])["loss backward"]
    assert measured == estimated_moments(est)["loss backward"]


@pytest.mark.parametrize(
    ("preset", "seq", "dp", "layers", "unit"),
    [
        ("tiny", 32, 2, 2, 2 * (256 * 64 + 64)),
        # 4 layers: a middle layer's backward holds a block's reduce-scatter input the top one does not
        ("tiny", 32, 4, 4, 2 * (256 * 64 + 64)),
        ("llama-3.2-1b", 512, 2, 2, 2 * (128_256 * 2048 + 2048)),
    ],
)
def test_the_tied_unit_holds_what_the_estimate_says(
    preset: str, seq: int, dp: int, layers: int, unit: int
) -> None:
    """torchtitan's ZeRO-3 with a tied embedding (``analytic.fsdp.moments.zero3_tied``): one unit
    [tok_embeddings, norm, lm_head], gathered at the embedding's forward and held to the end of the
    embedding's backward, reduced last; the lm head's gradient waits for the embedding's and is summed
    with it; layer 0's copy-out, which nothing prefetched below it, can top its backward
    (``tied_copy_out``). Measured beside the same model untied on the fake process group: every moment
    exact, tied and untied (before: the unit's [v, h] missing at the head's moments, 525 MB at Llama 3.2
    1B's widths, and the embedding's gathered again). By hand, the unit's
    bf16 bytes beside the shards at the loss's backward: v·h + h el (the unit's padding on dp 3:
    tests/measure/test_fsdp_streams.py)."""
    names = MOMENTS

    def errors(tied: bool) -> tuple[dict[str, int], Setup]:
        base = hf_setup(preset, seq=seq, batch=2, layers=layers, impl=Impl.TORCHTITAN, tied_embeddings=tied)
        setup = ranked(base, 1, False, dp, 3)
        measured, estimated = (
            titan_rank(setup).peak.moments(names),
            estimated_moments(estimate(setup)),
        )
        return {n: measured[n] - estimated[n] for n in names}, setup  # type: ignore[operator]

    (tied, setup), (untied, _) = errors(True), errors(False)
    assert tied == untied == dict.fromkeys(names, 0)
    r = estimate(setup)
    assert r.peak.moments["loss backward"]["weights"] - r.states.weights == unit


@pytest.mark.parametrize(
    ("preset", "seq", "tp", "dp", "layers", "tied"),
    [
        ("tiny", 32, 1, 2, 2, False),
        ("tiny", 32, 1, 2, 4, True),
        ("tiny", 32, 2, 2, 2, False),  # tp 2 + SP
        ("llama-3.2-1b", 512, 1, 2, 2, False),
    ],
)
def test_zero2_backward_reshards_and_reduces_each_unit(
    preset: str, seq: int, tp: int, dp: int, layers: int, tied: bool
) -> None:
    """torchtitan's ZeRO-2 (``reshard_after_forward=False``; ``analytic.fsdp.moments.units_reduced``): no
    unit is gathered again in backward, but each is resharded after its backward and reduce-scattered at its
    post-backward, its flat fp32 input held until the next unit's (``zero2_resharded``,
    ``zero3_unit_buffers``; the embedding's and the [norm, lm_head] unit's reduce moments; tied, the one
    unit held to the end, ``tied_unit``). Measured beside ZeRO-3 on the fake process group: every moment
    off by exactly what ZeRO-3's is, exact (on tp 2 + SP since the fake wait's copy is not counted and
    the layer's sequence-parallel moments are modelled; before, 4,224 B at the embedding's backward and
    24,448 B at the layer's) — before, the head's reduce-scatter input missing
    beside the top layer (65,792 B less the head's 32,896 B resharded, on the tiny model) and layer 0's
    beside the embedding's backward (147,968 B), 1.0 GB at the final norm's backward at Llama 3.2 1B's
    widths. By hand, the tiny model on dp 2: the head unit 16,448 el bf16, its reduce-scatter input fp32;
    a block's 36,992 el fp32."""
    from memplan.analytic.fsdp.moments import zero2_resharded, zero3_unit_buffers

    names = MOMENTS
    base = hf_setup(preset, seq=seq, batch=2, layers=layers, impl=Impl.TORCHTITAN, tied_embeddings=tied)

    def errors(zero: int) -> tuple[dict[str, int], Setup]:
        setup = ranked(base, tp, tp > 1, dp, zero)
        measured, estimated = (
            titan_rank(setup).peak.moments(names),
            estimated_moments(estimate(setup)),
        )
        return {n: measured[n] - estimated[n] for n in names}, setup  # type: ignore[operator]

    (zero2, setup), (zero3, _) = errors(2), errors(3)
    assert zero2 == zero3 == dict.fromkeys(names, 0)
    if preset == "tiny" and tp == 1 and layers == 2:
        rank = estimate(setup).rank_setup
        assert zero2_resharded(rank, 0) == 2 * 16_448
        assert zero3_unit_buffers(rank, 1, 2) == 4 * 16_448 and zero3_unit_buffers(rank, 0, 2) == 4 * 36_992


def test_selective_ac_reruns_the_block_but_its_cache() -> None:
    """torchtitan's per-op SelectiveAC (``analytic.moments.layer_backward.op_selective_working``): the block's
    forward re-run in its backward makes again every save of the un-checkpointed layer but the policy's
    cache (W_QKV's, W1's, W2's outputs, the block input), alive already. Llama 3.1 8B's widths (2 layers, s
    1,024, micro-batch 2) on dp 4 under ZeRO-3: every moment exact (the layer's was 327,434,240 B under,
    the working set counted as the attention core's re-run alone; then one [T, h] under while the block's
    input, which the wrapper keeps and the un-checkpointed layer does not save, was taken for the cache)."""
    setup = ranked(
        hf_setup(
            "llama-3.1-8b", seq=1024, batch=2, layers=2, impl=Impl.TORCHTITAN, checkpointing="selective"
        ),
        1,
        False,
        4,
        3,
    )
    assert_every_moment_exact(setup)


@pytest.mark.parametrize(
    ("preset", "seq", "ckpt"),
    [
        ("tiny", 32, "none"),
        ("tiny", 32, "full"),
        ("llama-3.1-8b", 1024, "none"),
        ("llama-3.1-8b", 1024, "selective"),
    ],
)
def test_one_sequence_a_micro_batch_tops_at_the_attention_norm(preset: str, seq: int, ckpt: str) -> None:
    """At one sequence a micro-batch the layer's weight gradients outweigh the MLP's [T, f] buffers and
    its backward tops at the attention norm's (``analytic.moments.layer_backward.layer_backward_transient``):
    the norm's five fp32 [T, h] pieces beside the residual branch's gradient [T, h] (autograd's input
    buffer of the norm's input, ``residual_gradient``), the MLP norm's input freed, the layer's RoPE
    cache still its buffer (``rope_view_kept``). ZeRO-3 over dp 4, two layers: every moment exact (the
    layer's was one [T, h] under on the tiny model, one over at Llama 3.1 8B's widths)."""
    setup = ranked(
        hf_setup(preset, seq=seq, batch=1, layers=2, impl=Impl.TORCHTITAN, checkpointing=ckpt), 1, False, 4, 3
    )
    est = assert_every_moment_exact(setup)
    from memplan.analytic.moments import layer_backward as lb
    from memplan.blocks.inventory import Dims

    rank = est.pieces.setup
    dims = Dims.of(rank)
    assert lb.residual_gradient(rank, dims) == dims.tokens * dims.h * 2  # bf16 [T, h]
    assert lb.layer_backward_transient(rank, dims, est.pieces.params) > lb.mlp_moment(rank, dims)


@pytest.mark.parametrize(
    ("seq", "tp", "ckpt", "batch", "float8", "top"),
    [
        (1024, 2, "none", 2, False, "first"),
        (2048, 8, "none", 1, False, "first"),
        (4096, 8, "none", 2, False, "gather"),
        (2048, 8, "full", 2, False, "rerun"),
        (256, 2, "selective", 2, False, None),  # the attention norm's moment tops
        (1024, 2, "none", 2, True, "first"),
        (2048, 8, "full", 2, True, "first"),
    ],
)
def test_sequence_parallel_layer_backward_is_exact(
    seq: int, tp: int, ckpt: str, batch: int, float8: bool, top: str | None
) -> None:
    """torchtitan's sequence-parallel layer at Llama 3.1 8B's widths (2 layers): the MLP's backward starts
    by all-gathering the layer's output gradient shard to W_down's dY [T, h], freed after W_down's backward
    (``analytic.moments.sp_moments.sp_mlp_moments``; with torchao's tensorwise float8, its W_gate's casts
    ``fp8_first_backward``); a FullAC layer re-runs after that gather, up to its last reduce-scatter
    (``sp_rerun_scatter``); SelectiveAC's re-run makes the norms' saves on T/t tokens
    (``rank_working_set``). Every moment exact, the layer's top where named. Before, at the same
    layouts (the fake wait's copy not counted): 4,194,304 B over (tp 2), 11,534,336 B under (tp 8, one
    sequence), 2,097,152 B under (s 4,096), 39,845,888 B under (FullAC), 16,779,264 B over (SelectiveAC);
    float8: 8,388,608 B and 29,360,128 B over; the final norm's moment 2–8 MiB over (the wait's [T/t, h]
    counted)."""
    from memplan.analytic.moments import layer_backward as lb
    from memplan.analytic.moments import sp_moments
    from memplan.blocks.inventory import Dims

    base = hf_setup("llama-3.1-8b", seq=seq, batch=batch, layers=2, impl=Impl.TORCHTITAN, checkpointing=ckpt)
    if float8:
        base = base.model_copy(update={"impl": base.impl.model_copy(update={"fp8": Fp8Recipe.TENSORWISE})})
    setup = ranked(base, tp, True, 1, 3)
    est = assert_every_moment_exact(setup)
    rank = est.pieces.setup
    dims = Dims.of(rank)
    transient = lb.layer_backward_transient(rank, dims, est.pieces.params)
    if top == "rerun":
        assert sp_moments.sp_rerun_scatter(rank, dims) == transient
    elif top:
        moments = sp_moments.sp_mlp_moments(rank, dims)
        assert max(moments, key=lambda k: moments[k]) == top
        assert moments[top] - lb.not_yet_rerun(rank, dims) == transient


@pytest.mark.parametrize(
    ("preset", "seq", "tp", "dp", "zero", "ckpt"),
    [
        ("tiny", 64, 2, 1, 0, "none"),
        ("tiny", 64, 2, 2, 2, "none"),
        ("tiny", 64, 2, 2, 3, "none"),
        ("llama-3.1-70b", 8192, 8, 2, 3, "full"),
    ],
)
def test_the_embedding_backward_gathers_its_gradient_first(
    preset: str, seq: int, tp: int, dp: int, zero: int, ckpt: str
) -> None:
    """torchtitan's SP plan: the embedding's output is the rank's T/t tokens, so its backward all-gathers
    layer 0's input gradient before its lookup's backward (``analytic.head_moments.sp_embedding_gather``:
    the shard, funcol's output and concatenated copy [T, h], the vocabulary mask still saved, the
    embedding's gradient not made yet; under FSDP2 after the unit's copy-out,
    ``zero3_embedding_parts``). Two sequences a micro-batch, 2 layers: every moment exact; before, the
    embedding's 8,448 B under on the tiny model, 39,354,368 B at Llama 3.1 70B's widths."""
    from memplan.analytic.head_moments import sp_embedding_gather
    from memplan.blocks.inventory import Dims

    base = hf_setup(preset, seq=seq, batch=2, layers=2, impl=Impl.TORCHTITAN, checkpointing=ckpt)
    est = assert_every_moment_exact(ranked(base, tp, True, dp, zero))
    rank = est.pieces.setup
    dims = Dims.of(rank)
    T, h, t = dims.tokens, dims.h, tp
    unmade, gathering = sp_embedding_gather(rank, dims, est.pieces.params)
    assert gathering == T // t * h * 2 + 2 * T * h * 2 + T * 2  # shard, two [T, h], the bf16 mask [T, 1]
    assert unmade == est.pieces.params.embedding * 2
