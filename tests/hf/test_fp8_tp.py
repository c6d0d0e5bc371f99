"""``--fp8-tp``: torchao's float8 tensor-parallel plan on torchtitan's Llama 3 blocks, one rank traced on the
fake process group (``measure.distributed.titan_fp8_tp``) against the estimate (blocks/fp8_tp.py,
analytic/moments/fp8_tp_moments.py, the time's float8 all-gathers)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torchtitan.models.llama3")
pytest.importorskip("torchao.float8.float8_tensor_parallel")

from memplan.config import Fp8Recipe, Impl, ModelConfig, Setup
from memplan.engine import estimate
from memplan.measure.distributed.titan import measure_titan_rank
from memplan.measure.distributed.titan_peak import estimated_moments
from tests.hf.harness import hf_setup
from tests.hf.test_torchtitan_peak import MOMENTS, assert_every_moment_exact
from tests.hf.test_torchtitan_ranks import ranked


def float8_plan(
    preset: str | ModelConfig, seq: int, tp: int, batch: int = 1, checkpointing: str = "none"
) -> Setup:
    base = hf_setup(preset, seq=seq, batch=batch, impl=Impl.TORCHTITAN, checkpointing=checkpointing)
    return ranked(base, tp, True, fp8=Fp8Recipe.TENSORWISE, fp8_tp=True)


def test_the_float8_plan_saves_float8_inputs() -> None:
    """The tiny model on tp 2 + SP (b 1, s 64: T = 64, h = 64, a·d/t = 32, f/t = 64): each linear's input
    saved as its float8 cast and a 4-byte scale — W_QKV's and the MLP's gathered [T, h], W_O's [T, a·d/t]
    beside the flash core's own output, W_down's [T, f/t] in place of the bf16 product — every save by
    name and layer as the estimate says, and every moment of the backward exact."""
    setup = float8_plan("tiny", 64, 2)
    est, run = estimate(setup), measure_titan_rank(setup)
    measured, estimated = run.peak.moments(MOMENTS), estimated_moments(est)
    assert {n: measured[n] - estimated[n] for n in MOMENTS} == dict.fromkeys(MOMENTS, 0)  # type: ignore[operator]
    fp8 = sorted(
        (r.name, r.shape, r.bytes) for r in run.measured.records if r.dtype == "fp8_e4m3" and r.layer == 0
    )
    t, h = 64, 64
    assert fp8 == [
        ("attention.qkv_linear.wqkv", (1, t, h), t * h),
        ("attention.wo", (1, t, 32), t * 32),
        ("feed_forward.w1", (1, t, h), t * h),
        ("feed_forward.w2", (1, t, 64), t * 64),
    ]
    scales = [r for r in run.measured.records if r.dtype == "fp32" and r.shape == () and r.layer == 0]
    assert [r.bytes for r in scales] == [4] * 4
    assert run.measured.activations == est.activations
    # 0.3.0's plan saves the bf16 gathered inputs and product instead, and no cast of W_O's input: per layer
    # 3·(2 − 1)·T·h − (T·32 + 4) − 4·3 more
    plain = estimate(setup.model_copy(update={"impl": setup.impl.model_copy(update={"fp8_tp": False})}))
    assert plain.activations - est.activations == 2 * (3 * t * h - t * 32 - 4 * 4)


@pytest.mark.parametrize(
    ("seq", "tp", "batch"),
    [
        (1024, 2, 2),  # the top: W_gate's weight cast beside the float8 d(gate) (``gate_weight``)
        (4096, 8, 2),  # the top: d(gate)'s cast, W_up's dX [T, h] alive (``first``)
    ],
)
def test_the_float8_plan_layer_backward_is_exact(seq: int, tp: int, batch: int) -> None:
    """At Llama 3 8B's widths (2 layers, no checkpointing): every moment of the backward as estimated, the
    layer's top among the MLP's float8 moments (``fp8_tp_moments.mlp_moments``)."""
    setup = float8_plan("llama-3-8b", seq, tp, batch)
    assert_every_moment_exact(setup)


@pytest.mark.parametrize(
    ("preset", "seq", "tp", "dp", "batch"),
    [
        ("tiny", 64, 2, 2, 2),  # the re-run's cast of the product [T, f/t] tops (h = f)
        ("llama-3-8b", 1024, 2, 1, 2),  # the re-run's W_down weight cast
        ("llama-3-8b", 4096, 8, 1, 2),  # the re-run's W_down output reduce-scatter
    ],
)
def test_the_float8_plan_under_full_checkpointing_is_exact(
    preset: str, seq: int, tp: int, dp: int, batch: int
) -> None:
    """Full checkpointing: the re-run runs after the output gradient's float8 all-gather, the bf16 product
    held by W_down's call beside its float8 save (``fp8_tp_moments.rerun``); every moment exact."""
    setup = float8_plan(preset, seq, tp, batch, "full")
    if dp > 1:
        setup = ranked(setup, tp, True, dp, 3)
    assert_every_moment_exact(setup)


@pytest.mark.parametrize(
    ("preset", "seq", "tp", "batch", "plan"),
    [("tiny", 64, 2, 2, True), ("llama-3-8b", 1024, 2, 2, True), ("llama-3-8b", 1024, 2, 2, False)],
)
def test_selective_checkpointing_under_float8(preset: str, seq: int, tp: int, batch: int, plan: bool) -> None:
    """torchtitan's SelectiveAC caches each tensorwise amax (``aten.max``); under the float8 plan W1 and W3
    share one cast of their input, so a block caches 9 amaxes, not 10 (``blocks.fp8.sac_amax_rules``): the
    saves exact, and the moments but the layer's. The layer tops in its re-run, where W_down's matmul and
    reduce-scatter are cached but the casts of its input and weight run again (``fp8_tp_moments.rerun``):
    an upper bound, NB 3,070 B (0.6 %) above on the tiny model, 393,216 B (0.01 %) at Llama 3 8B's widths
    under either plan (33,292,292 B below with the float8 plan, 12,320,768 B below with 0.3.0's, before)."""
    setup = float8_plan(preset, seq, tp, batch, "selective")
    setup = setup.model_copy(update={"impl": setup.impl.model_copy(update={"fp8_tp": plan})})
    est, run = estimate(setup), measure_titan_rank(setup)
    assert run.measured.activations == est.activations
    measured, estimated = run.peak.moments(MOMENTS), estimated_moments(est)
    layer = "layer backward"
    assert {n: measured[n] - estimated[n] for n in MOMENTS if n != layer} == dict.fromkeys(
        [n for n in MOMENTS if n != layer], 0
    )
    assert 0 <= estimated[layer] - measured[layer] <= estimated[layer] // 100  # type: ignore[operator]


def test_the_70b_tensor_parallel_layout_is_exact() -> None:
    """Table 4's layout of torchtitan's 2024 benchmarks (Llama 3.1 70B's widths, 2 layers, tp 8 + SP, full
    checkpointing, FSDP2's 2024 root wrapping over dp 2, the float8 plan; s 2,048, two sequences): every
    moment of the backward as estimated."""
    setup = ranked(float8_plan("llama-3.1-70b", 2048, 8, 2, "full"), 8, True, 2, 3, fsdp_wrap="root")
    assert setup.impl.fp8_tp and setup.impl.fsdp_wrap.value == "root"
    assert_every_moment_exact(setup)


def test_float8_plan_gathers_in_float8() -> None:
    """The step time's sequence-parallel all-gathers: the layers' inputs, their outputs' gradients and a
    re-run layer's inputs move one byte an element under the float8 plan; the head's input and the
    embedding's output gradient stay bf16 (two bytes)."""
    from memplan.presets import load_gpu
    from memplan.time.comm.collectives import FLOAT8_GATHERS, communication

    setup = float8_plan("llama-3-8b", 1024, 2, checkpointing="full")
    rows = [
        r for r in communication(estimate(setup), load_gpu("h100-sxm").topology)[1] if r.dimension == "tp"
    ]
    x = 1024 * 4096 * 2  # one micro-batch's hidden states, bf16
    f8 = {r.what: (r.bytes, r.count) for r in rows if r.what.endswith("(float8)")}
    layers = 2  # the layers of the pipeline-less rank, each with two gathered inputs and two gradients
    assert f8 == {f"{w} (float8)": (x // 2, 2 * layers) for w in FLOAT8_GATHERS}
    rest = {r.what: (r.bytes, r.count) for r in rows if r.what in FLOAT8_GATHERS}
    assert rest == {"sequence → linear inputs": (x, 1), "output gradients": (x, 1)}


def test_the_float8_plan_casts_shards_once() -> None:
    """The step time's float8 casts of one layer on a tp 2 rank (Llama 3 8B, s 1,024, T = 1,024 tokens,
    h 4,096, a·d/t 2,048, (a + 2·kv)·d/t 3,072, f/t 7,168), by hand: forward the weights, the two block
    inputs on their [T/t, h] shard, W_O's and W_down's inputs; backward the weights and each output
    gradient once (W_QKV's, W1's and W3's on the rank, W_O's and W_down's on the shard); 2e + 1 = 5 bytes
    an element (tensorwise: the amax pass and the scaled cast)."""
    from memplan.time.fp8 import cast_bytes

    setup = float8_plan("llama-3-8b", 1024, 2)
    t, h, q, qkv, f = 1024, 4096, 2048, 3072, 7168
    weights = h * qkv + q * h + 3 * h * f
    forward = weights + 2 * (t // 2) * h + t * (q + f)
    backward = weights + t * (qkv + 2 * f) + 2 * (t // 2) * h
    assert cast_bytes(setup) == (5 * forward, 5 * backward)


def test_the_float8_plan_on_a_pipeline_stage_is_exact() -> None:
    """pp 2 (1F1B) × cp 2 (torch's ring inside the stages) × tp 2 + SP × FSDP2 over dp 2 × cp, 4
    micro-batches, the tiny model on 4 layers, no checkpointing (interleaved over 2 chunks a rank
    without cp, and full checkpointing, were checked the same way when the rule was lifted; the suite keeps
    the widest layout): each pipeline rank at tp, dp and cp coordinate 0, torchao's float8 styles on each
    model part (``titan.parallelize_part``). Per layer the saves in flight (each linear's float8 input and
    its 4-byte scale, counted by the tensors that hold them: ``pipeline.InFlightRecorder._pack``; under cp
    W_O's float8 input replaces the bf16 one beside the ring's merged output, ``blocks.fp8_tp``), the
    schedule's holds, the activations and the parameters equal the estimate of that rank."""
    from tests.hf.test_torchtitan_pp import S, piped
    from tests.hf.test_torchtitan_vpp import sharded, traced_exact

    base = hf_setup("tiny", layers=4, seq=S, impl=Impl.TORCHTITAN)
    setup = sharded(piped(base, 2, 4, tp=2, sp=True, cp=2), 2, 3)
    setup = setup.replaced(impl=setup.impl.replaced(fp8=Fp8Recipe.TENSORWISE, fp8_tp=True))
    est = estimate(setup)
    assert est.setup.parallel.pp == 2 and est.setup.impl.fp8_tp
    for index in (0, 1):
        run = traced_exact(est, setup, index)
        # each layer instance saves W_QKV's, W_O's, W_1's and W_down's float8 inputs
        assert sum(1 for r in run.records if r.dtype == "fp8_e4m3" and r.layer == run.layers[0]) >= 4
    # no bf16 [T, a·d/t] of W_O's input beside the ring's merged output
    assert not any(k.name == "attn.out" for k in est.tensors)


def test_the_float8_plan_with_context_parallelism_saves_what_the_estimate_says() -> None:
    """Without pp: tp 2 + SP × cp 2, the tiny model, rank 0 (torch's ring on the rank's local heads): the
    saves equal the estimate's; the loss's, the final norm's and the embedding's backward moments are off by
    what they are off without float8 on the same layout (512, 512 and 8,704 B: tp × cp's own). NB: the
    layer backward's is +512 B here against −1,280 B without float8, not found."""
    base = float8_plan("tiny", 64, 2)
    plain = base.replaced(impl=base.impl.replaced(fp8=Fp8Recipe.NONE, fp8_tp=False))
    runs = []
    for s in (base, plain):
        setup = s.replaced(parallel=s.parallel.replaced(cp=2))
        est, run = estimate(setup), measure_titan_rank(setup)
        assert run.measured.activations == est.activations
        measured, estimated = run.peak.moments(MOMENTS), estimated_moments(est)
        runs.append({n: measured[n] - estimated[n] for n in MOMENTS})  # type: ignore[operator]
    float8, bf16 = runs
    assert {n: float8[n] for n in MOMENTS if n != "layer backward"} == {
        n: bf16[n] for n in MOMENTS if n != "layer backward"
    }


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--fp8", "tensorwise", "--tp", "2"], "it needs --tp 2 or more with --sp"),
        (["--fp8", "rowwise", "--tp", "2", "--sp"], "tensorwise"),
        (["--tp", "2", "--sp"], "tensorwise"),
        (["--fp8", "tensorwise", "--tp", "2", "--sp", "--compile"], "--checkpointing full only"),
    ],
)
def test_the_float8_plan_refuses_what_it_does_not_model(args: list[str], field: str) -> None:
    """One line, exit code 2, naming the field and the fix."""
    from typer.testing import CliRunner

    from memplan.cli.app import app

    result = CliRunner().invoke(
        app, ["estimate", "-m", "llama-3-8b", "--impl", "torchtitan", "--fp8-tp", *args, "--json"]
    )
    assert result.exit_code == 2
    line = result.output.strip()
    assert (
        "\n" not in line
        and line.lower().startswith("error: fp8_tp:")
        and field in line
        and "--fp8-tp" in line
    )


def test_the_float8_plan_refuses_linears_torchtitan_does_not_convert() -> None:
    """torchtitan's converter skips a linear whose width is not a multiple of 16, and torchao's float8 styles
    refuse a plain linear (``_apply``: "Expecting module to be Float8Linear"): refused before any run."""
    with pytest.raises(ValueError, match=r"fp8_tp: .*multiple of 16 \(tiny: ffn 72\)"):
        float8_plan(hf_setup("tiny", impl=Impl.TORCHTITAN, ffn_size=72).model, 64, 2)


def test_trace_cli_runs_the_float8_plan() -> None:
    """``memplan trace --impl torchtitan --fp8 tensorwise --tp 2 --sp --fp8-tp``: the rank's saves equal
    the estimate's (exit code 0)."""
    from typer.testing import CliRunner

    from memplan.cli.app import app

    args = ["trace", "-m", "tiny", "--seq", "32", "--impl", "torchtitan", "--fp8", "tensorwise"]
    result = CliRunner().invoke(app, [*args, "--tp", "2", "--sp", "--fp8-tp", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["diff"]["equal"]
