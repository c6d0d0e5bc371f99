"""One rank of torchtitan's own parallelised Llama 3 (``--impl torchtitan`` with --tp/--sp and FSDP2 over dp)
on torch's fake process group, against the estimate: saved bytes per layer and in total equal to the byte,
and the rank's parameter bytes (TP shard, FSDP2's dim-0 shard).

The estimate's torchtitan facts under TP/SP (blocks/profile.py): SP gathers the attention's and the FFN's
input at the module boundary and the final norm's output before the lm head, and W_QKV, W1/W3 and the lm
head keep the gathered [T, h] (Megatron: [T/t, h]); the vocabulary-parallel embedding keeps its [b, s, 1]
mask; ``_LossParallelCrossEntropy`` keeps the fp32 log-probs [T, v/t] and the labels, no normaliser.
"""

from __future__ import annotations

import json

import jsonschema  # type: ignore[import-untyped]  # (no stubs installed)
import pytest

pytest.importorskip("torchtitan.models.llama3")

from memplan.config import Impl, Setup, ZeroStage
from memplan.engine import estimate
from memplan.measure.compare.tensors import estimated_layers
from memplan.schema import command_schema
from tests.hf.harness import hf_setup, titan_rank

pytestmark = pytest.mark.xdist_group("titan_rank")  # one worker holds titan_rank's traces (harness)


def ranked(setup: Setup, tp: int, sp: bool, dp: int = 1, zero: int = 0, **impl: object) -> Setup:
    """``setup`` on tp × dp ranks (``impl``: its ``ImplConfig`` fields replaced), validated again (the
    setup's checks run on the new layout)."""
    data = setup.model_dump()
    data["parallel"] = {**data["parallel"], "tp": tp, "sp": sp}
    data["strategy"] = {**data["strategy"], "dp": dp, "zero": ZeroStage(zero)}
    data["impl"] = {**data["impl"], **impl}
    return Setup.model_validate(data)


@pytest.mark.parametrize(("sp", "dp", "zero"), [(False, 1, 0), (True, 1, 0), (True, 2, 3)])
def test_tp_rank_saves_what_the_estimate_says(sp: bool, dp: int, zero: int) -> None:
    setup = ranked(hf_setup("llama-3-8b", seq=256, impl=Impl.TORCHTITAN), 2, sp, dp, zero)
    est, run = estimate(setup), titan_rank(setup)
    meas = run.measured
    assert estimated_layers(est) == [meas.layer_bytes(i) for i in range(2)]
    assert est.activations == meas.activations
    # By hand, per layer, tp 2 (a/t = 16 heads, kv/t = 4, f/t = 7168), b = 1, s = 256, h = 4096, bf16:
    b, s, h, t = 1, 256, 4096, 2
    norm = 2 * (b * (s // t if sp else s) * h * 4) + b * (s // t if sp else s) * 4  # fp32 x, x·rstd; rstd
    gathered = b * s * h * 2  # W_QKV's and W1/W3's input, whole with or without SP
    attn = b * s * 64 * 8 + (16 + 4 + 4 + 16) * b * s * 128 * 2 + 16 * b * s * 4  # rope, q k v out, lse
    mlp = 4 * b * s * 7168 * 2
    assert meas.layer_bytes(0) == 2 * norm + 2 * gathered + attn + mlp


@pytest.mark.parametrize("sp", [False, True])
def test_tp_rank_under_selective_ac(sp: bool) -> None:
    """torchtitan's SelectiveAC on a tp 2 rank: the block input, the rank's cached mm outputs (W2's a
    partial sum [T, h]) and, under SP, the two reduce-scatter outputs the comm save list caches."""
    setup = ranked(hf_setup("llama-3-8b", seq=256, impl=Impl.TORCHTITAN, checkpointing="selective"), 2, sp)
    est, meas = estimate(setup), titan_rank(setup).measured
    assert estimated_layers(est) == [meas.layer_bytes(i) for i in range(2)]
    assert est.activations == meas.activations
    b, s, h, t = 1, 256, 4096, 2
    local = b * (s // t if sp else s) * h * 2  # the block's input: the sequence shard under SP
    mms = b * s * (16 + 2 * 4) * 128 * 2 + b * s * 7168 * 2 + b * s * h * 2  # W_QKV, W1, W2 (partial)
    scattered = 2 * b * (s // t) * h * 2 if sp else 0  # reduce_scatter_tensor after W_O and W2
    assert meas.layer_bytes(0) == local + mms + scattered


def test_fsdp2_rank_holds_its_shard() -> None:
    """tp 2 × dp 2, ZeRO-3 (reshard_after_forward) and ZeRO-2 (not): the rank's parameters are the TP
    shard split over dp along dim 0 (every dim-0 here divisible by 2: no padding), in fp32 (FSDP2's
    mixed precision: the model built in fp32, bf16 only while gathered); the tp-only rank (no FSDP) holds
    the whole TP shard in bf16. E elements of the TP shard: 4 B · E/2 = 2 B · E."""
    base = hf_setup("llama-3-8b", seq=256, impl=Impl.TORCHTITAN)
    whole = titan_rank(ranked(base, 2, True)).param_bytes  # 2 B · E
    for zero in (2, 3):
        assert titan_rank(ranked(base, 2, True, 2, zero)).param_bytes == whole  # 4 B · E/2


def test_full_scale_rank_of_8192() -> None:
    """Llama 3 70B's widths (2 of its layers), seq 8192, tp 8 with SP × dp 1,024 under ZeRO-3: rank 0 of
    8,192 on the fake process group keeps what the estimate says to the byte, and holds FSDP2's padded
    dim-0 shards (Σ ⌈dim0/1024⌉·rest, not ⌈Ψ/1024⌉)."""
    setup = ranked(hf_setup("llama-3-70b", seq=8192, impl=Impl.TORCHTITAN), 8, True, 1024, 3)
    est, run = estimate(setup), titan_rank(setup)
    assert estimated_layers(est) == [run.measured.layer_bytes(i) for i in range(2)]
    assert est.activations == run.measured.activations
    # The TP rank's parameters (h 8192, a/t 8, kv/t 1, d 128, f/t 3584, v/t 16032), each cut along dim 0
    # into 1,024 chunks, every shard padded to the first chunk's rows:
    h, dp = 8192, 1024
    rows = -(-16032 // dp)  # 16 of the vocabulary's 16,032 rows (15.66 → 16)
    layer = (
        -(-((8 + 2) * 128) // dp) * h  # wqkv [1280, h]: 2 rows
        + -(-h // dp) * 1024  # wo [h, 1024]: 8 rows
        + 2 * -(-3584 // dp) * h  # w1, w3 [3584, h]: 4 rows each
        + -(-h // dp) * 3584  # w2 [h, 3584]: 8 rows
        + 2 * -(-h // dp)  # two norms [h]: 8 each
    )
    elements = 2 * rows * h + 2 * layer + -(-h // dp)  # embedding, lm head; 2 layers; the final norm
    # fp32 shards (FSDP2's mixed precision: bf16 only while gathered), no master copy beside them
    assert run.param_bytes == est.device.states.weights == 4 * elements
    assert est.device.states.master_weights == 0 and est.device.states.gradients == 4 * elements
    flat = -(-(2 * 16032 * h + 2 * (1280 * h + h * 1024 + 3 * 3584 * h + 2 * h) + h) // dp)
    assert elements - flat == 34_304  # what DeepSpeed's flat ⌈Ψ/Nd⌉ would miss: 7.4 %


@pytest.mark.parametrize(("sp", "zero"), [(True, 3), (False, 2)])
def test_real_tensors_save_what_fake_ones_do(sp: bool, zero: int) -> None:
    """The tiny model on tp 2 × dp 2 with real (uninitialised) tensors over the fake group saves the same
    storages and holds the same parameters as under fake tensors, and both equal the estimate."""
    setup = ranked(hf_setup("tiny", seq=32, batch=2, impl=Impl.TORCHTITAN), 2, sp, 2, zero)
    real, fake = titan_rank(setup, fake=False), titan_rank(setup)
    assert [(r.shape, r.dtype, r.bytes) for r in real.measured.records] == [
        (r.shape, r.dtype, r.bytes) for r in fake.measured.records
    ]
    assert real.param_bytes == fake.param_bytes
    est = estimate(setup)
    assert estimated_layers(est) == [real.measured.layer_bytes(i) for i in range(2)]
    assert est.activations == real.measured.activations


def test_zero1_is_refused() -> None:
    with pytest.raises(ValueError, match="no ZeRO-1"):
        ranked(hf_setup("tiny", seq=32, impl=Impl.TORCHTITAN), 2, True, 2, 1)


def test_trace_cli_runs_one_rank() -> None:
    """``memplan trace --impl torchtitan --tp 2 --sp --zero 3 --dp 2``: rank 0 of 4, exact, exit 0; the
    rich report renders the same result."""
    from typer.testing import CliRunner

    from memplan.cli.app import app

    runner = CliRunner(env={"COLUMNS": "120", "NO_COLOR": "1"})
    args = ["trace", "--model", "tiny", "--seq", "32", "--impl", "torchtitan", "--tp", "2", "--sp"]
    args += ["--zero", "3", "--dp", "2", "--device", "cpu"]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["diff"]["exact"] and out["diff"]["weights"]["equal"] and out["diff"]["gradients"]["equal"]
    assert out["rank"] == {"rank": 0, "world": 4, "tp": 2, "cp": 1, "dp": 2}
    jsonschema.validate(out, command_schema("trace"))
    assert runner.invoke(app, args).exit_code == 0


def test_tp_fsdp2_rank_under_full_ac() -> None:
    """FullAC on a tp 2 + SP × dp 2 ZeRO-3 rank: each block keeps its input, the sequence shard
    [b, s/t, h] (1 × 128 × 4096 bf16 = 1 MiB), and nothing else; the model level as without checkpointing."""
    setup = ranked(hf_setup("llama-3-8b", seq=256, impl=Impl.TORCHTITAN, checkpointing="full"), 2, True, 2, 3)
    est, meas = estimate(setup), titan_rank(setup).measured
    assert [meas.layer_bytes(i) for i in range(2)] == estimated_layers(est) == [128 * 4096 * 2] * 2
    assert est.activations == meas.activations


def test_hsdp_rank_holds_its_group_shard() -> None:
    """HSDP (--hsdp 2 of dp 4, tp 2, ZeRO-3): torchtitan's FSDP2 mesh [dp_replicate 2, fsdp 2] shards the
    parameters over the 2 ranks of the group, so the rank holds half the TP shard, as at dp 2."""
    base = ranked(hf_setup("tiny", seq=32, impl=Impl.TORCHTITAN), 2, True, 4, 3)
    hsdp = base.model_copy(update={"strategy": base.strategy.model_copy(update={"hsdp": 2})})
    run = titan_rank(Setup.model_validate(hsdp.model_dump()))
    half = titan_rank(ranked(hf_setup("tiny", seq=32, impl=Impl.TORCHTITAN), 2, True, 2, 3))
    assert run.param_bytes == half.param_bytes == estimate(hsdp).device.states.weights


@pytest.mark.parametrize(("tp", "dp", "cp_rank"), [(2, 1, 0), (2, 2, 1), (1, 2, 1)])
def test_context_parallel_rank_of_a_tp_or_fsdp2_mesh(tp: int, dp: int, cp_rank: int) -> None:
    """cp 2 with tp 2 + SP and/or FSDP2 over dp 2 × cp (torchtitan's "fsdp" mesh): the rank at cp coordinate
    ``cp_rank`` of torchtitan's [dp, cp, tp] world runs its head-tail share of the sequence through torch's
    ring, which a tensor-parallel rank's attention hands its local heads (the ring installed before
    torchtitan's ``Module.parallelize``; installed after it, the ring met DTensors and the trace failed).
    Its saves equal the estimate's, and by hand on the tp 2 rank 0: T = b·s/c = 128 tokens, 16 of the 32
    heads, 4 of the 8 kv heads, f/t = 7168."""
    data = hf_setup("llama-3-8b", seq=256, impl=Impl.TORCHTITAN).model_dump()
    data["parallel"] = {**data["parallel"], "tp": tp, "sp": tp > 1, "cp": 2, "cp_rank": cp_rank}
    data["strategy"] = {**data["strategy"], "dp": dp, "zero": ZeroStage(3 if dp > 1 else 0)}
    setup = Setup.model_validate(data)
    est, run = estimate(setup), titan_rank(setup)
    assert estimated_layers(est) == [run.measured.layer_bytes(i) for i in range(2)]
    assert est.activations == run.measured.activations
    assert run.param_bytes == est.device.states.weights
    if (tp, dp, cp_rank) == (2, 1, 0):
        T, t, h, d = 128, 2, 4096, 128
        norms = 2 * (2 * (T // t) * h * 4 + (T // t) * 4)  # fp32 x and x·rstd, rstd: the SP shard [T/t, h]
        gathered = 2 * T * h * 2  # W_QKV's and W1/W3's input, gathered over tp
        ring = (16 + 16 + 4 + 4) * T * d * 2 + 16 * T * 4  # q, the merged output, k, v; the fp32 lse
        w_o = T * (h // t) * 2  # W_O's input [T, 16 · 128], apart from the merged output
        rope = T * 64 * 8  # the rows of the RoPE cache gathered by position, complex64
        mlp = 4 * T * 7168 * 2
        assert run.measured.layer_bytes(0) == norms + gathered + ring + w_o + rope + mlp


def test_trace_cli_runs_a_context_parallel_rank() -> None:
    """``memplan trace --impl torchtitan --tp 2 --sp --cp 2 --cp-rank 1 --zero 3 --dp 2``: rank 2 of 8 (cp
    coordinate 1, tp 0), exact, exit 0."""
    from typer.testing import CliRunner

    from memplan.cli.app import app

    runner = CliRunner(env={"COLUMNS": "120", "NO_COLOR": "1"})
    args = ["trace", "--model", "tiny", "--seq", "32", "--impl", "torchtitan", "--tp", "2", "--sp"]
    args += ["--cp", "2", "--cp-rank", "1", "--zero", "3", "--dp", "2", "--device", "cpu", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["diff"]["exact"] and out["diff"]["weights"]["equal"]
    assert out["rank"] == {"rank": 2, "world": 8, "tp": 2, "cp": 2, "dp": 2}
    jsonschema.validate(out, command_schema("trace"))


@pytest.mark.parametrize(("sp", "dp", "zero"), [(False, 1, 0), (True, 1, 0), (False, 2, 3)])
def test_gradients_after_the_step(sp: bool, dp: int, zero: int) -> None:
    """The rank's gradients after backward equal the estimate's. Without SP and without FSDP, DTensor
    leaves W_O's and W2's weight gradients ``Partial`` — each rank's whole [h, a·d] and [h, f], not the
    ``Shard(1)`` halves its parameters are (``blocks.torchtitan.partial_grad_elements``): by hand, tp 2
    (h 64, a·d 64, f 128), 2 layers, bf16, (64·64 + 64·128)/2 elements more a layer. Under SP they arrive
    as shards; under FSDP2 they are redistributed and reduce-scattered to the fp32 shards."""
    setup = ranked(hf_setup("tiny", seq=64, impl=Impl.TORCHTITAN), 2, sp, dp, zero)
    est, run = estimate(setup), titan_rank(setup)
    assert run.grad_bytes == est.device.states.gradients
    shards = ranked(hf_setup("tiny", seq=64, impl=Impl.TORCHTITAN), 2, True, dp, zero)
    more = 2 * (64 * 64 + 64 * 128) // 2 * 2 if (sp, zero) == (False, 0) else 0
    assert run.grad_bytes - estimate(shards).device.states.gradients == more


def test_llama_3_8b_tp_without_sp_keeps_w_o_whole_and_w2_sharded() -> None:
    """Llama 3 8B widths (2 layers), seq 256, tp 2 without SP, no FSDP: DTensor's cost model
    (``blocks.dtensor_cost``) leaves W_O's gradient ``Partial`` — the whole [4,096, 4,096] — and W2's
    the [4,096, 7,168] shard (its 256 × 14,336 input costs more to all-gather than the output gradient to
    all-reduce). The rank's gradients equal the estimate's: the SP layout's plus 2 · 4,096 · 2,048 bf16."""
    base = hf_setup("llama-3-8b", seq=256, impl=Impl.TORCHTITAN)
    setup, sp = ranked(base, 2, False), ranked(base, 2, True)
    est, run = estimate(setup), titan_rank(setup)
    assert run.grad_bytes == est.device.states.gradients
    assert run.grad_bytes == estimate(sp).device.states.gradients + 2 * 4096 * 2048 * 2


def test_a_ring_ranks_flops_count_for_every_rank() -> None:
    """``trace --impl torchtitan --cp 2 --checkpointing full --compile`` (judged FLOP for FLOP): the ring
    rank's FLOPs × cp are the model's, every rank running the same (as the reference's comparison counts
    them); before, one rank's were set against the model's and the trace failed by half."""
    from typer.testing import CliRunner

    from memplan.cli.app import app

    args = ["trace", "--model", "tiny", "--seq", "64", "--impl", "torchtitan", "--cp", "2"]
    args += ["--checkpointing", "full", "--compile", "--device", "cpu", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    flops = json.loads(result.stdout)["diff"]["flops"]
    assert [row["delta"] for row in flops] == [0, 0, 0] and flops[0]["measured"] > 0
