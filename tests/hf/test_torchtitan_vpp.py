"""``--impl torchtitan --pp P --vpp M``: torchtitan's ``Interleaved1F1B`` — its placement over p·M virtual
stages, torch's ``ScheduleInterleaved1F1B`` order, and one rank's chunks run under that schedule on torch's
fake process group against the estimate for that rank: saved bytes per layer, the schedule's holds
(sent outputs and input gradients the runtime keeps to the step's end, logits, receive buffers) and the
rank's parameters, to the byte (``memplan.measure.distributed.titan_vpp``)."""

from __future__ import annotations

import json
from collections import Counter
from types import SimpleNamespace

import pytest

pytest.importorskip("torchtitan.models.llama3")

from memplan.blocks.inventory import Scope
from memplan.config import Impl, Setup
from memplan.engine import Result, at_stage, estimate
from memplan.measure.distributed.titan_pp import StageRun
from memplan.measure.distributed.titan_vpp import measure_titan_pipeline, virtual_module_names
from memplan.strategies.torch_interleaved import fsdp_unshards, rank_order
from tests.hf.harness import hf_setup
from tests.hf.test_torchtitan_pp import LAYER, PARAMS_LAYER, ROPE, B, H, S, V, X, held, piped

TINY_LAYER, TINY_EMBED, TINY_HEAD = 36_992, 16_384, 16_448
"""The tiny model's FSDP2 units (h 64, 4 heads, 2 kv, d 16, f 128, v 256), elements: a layer wqkv
(4 + 2·2)·16 × 64, wo 64 × 64, w1 w3 w2 3 × 128 × 64, two norms 64; the embedding 256 × 64; the final
norm and lm head 64 + 256 × 64."""


def per_layer(e: Result, run: StageRun) -> list[int]:
    """The estimate's bytes of each of the rank's layers: one instance's saves (the stage's layer-scope
    tensors less the per-layer RoPE buffers, over the layer-forwards in flight) times its chunk's forwards
    in flight, plus its RoPE buffer."""
    st = e.stages[0].stage
    ids = st.chunk_ids if st.chunk_ids is not None else (0,) * st.chunks  # 1F1B: one chunk
    buffers = sum(
        k.bytes * k.count for k in e.tensors if k.scope is Scope.LAYER and k.name == "attn.rope_cache"
    )
    instances = sum(k.bytes * k.count for k in e.tensors if k.scope is Scope.LAYER) - buffers
    assert instances % st.in_flight_layers == 0 and buffers % st.layers == 0
    one, rope = instances // st.in_flight_layers, buffers // st.layers
    chunk_of = {}
    p = e.setup.parallel.pp
    names = virtual_module_names(e.setup)
    for k in range(len(st.chunks_of)):
        for name in names[k * p + st.index]:
            if name.startswith("layers."):
                chunk_of[int(name.split(".")[1])] = k
    return [ids.count(chunk_of[i]) * one + rope for i in run.layers]


def estimated_held(e: Result) -> dict[str, tuple[tuple[int, ...], int]]:
    return {k.name: (k.shape, k.count) for k in e.tensors if k.name.startswith("pp.")}


def traced_exact(est: Result, setup: Setup, index: int, params: bool = True, cp_rank: int = 0) -> StageRun:
    """Pipeline rank ``index`` (context-parallel coordinate ``cp_rank``) traced against its estimate: saves
    per layer, the schedule's holds, the total and (``params``) the parameters at rest; the run, for the
    by-hand checks that follow."""
    e, run = at_stage(est, index), measure_titan_pipeline(setup, index, cp_rank=cp_rank)
    assert [run.layer_bytes(i) for i in run.layers] == per_layer(e, run)
    assert held(run) == estimated_held(e)
    assert run.activations == e.activations
    if params:
        assert run.param_bytes == e.device.states.weights
    return run


@pytest.mark.parametrize(
    ("p", "m", "n"),
    [(2, 2, 4), (4, 2, 8), (4, 3, 4), (4, 2, 3), (4, 2, 6), (4, 2, 10), (3, 4, 9), (2, 8, 16)],
)
def test_order_is_torchs(p: int, m: int, n: int) -> None:
    """``rank_order`` against torch's own ``ScheduleInterleaved1F1B._calculate_single_rank_operations``
    (its computations in order, the idle slots dropped), every rank."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    rounds = max(1, n // p)
    fake = SimpleNamespace(
        n_local_stages=m, pp_group_size=p, _n_microbatches=n, microbatches_per_round=n // rounds
    )
    for i in range(p):
        ops = ScheduleInterleaved1F1B._calculate_single_rank_operations(fake, i)  # type: ignore[arg-type]
        theirs = [(a.computation_type is _ComputationType.FORWARD, a.stage_index // p) for a in ops if a]
        assert rank_order(p, m, n, i) == theirs


@pytest.mark.parametrize(
    ("layers", "pp", "vpp"), [(6, 2, 2), (16, 2, 3), (32, 4, 2), (126, 16, 8), (30, 4, 4)]
)
def test_placement_is_torchtitans(layers: int, pp: int, vpp: int) -> None:
    """The setup's virtual-stage counts and each rank's modules against torchtitan's
    ``_generate_llm_fqn_per_model_part`` over p·M stages and its "loop" rank mapping."""
    from torchtitan.distributed.pipeline_parallel import (
        _generate_llm_fqn_per_model_part,
        _get_pp_rank_to_stage_indices_mapping,
    )

    setup = piped(hf_setup("llama-3-8b", layers=layers, seq=S, impl=Impl.TORCHTITAN), pp, 2 * pp, vpp=vpp)
    theirs = _generate_llm_fqn_per_model_part(pp * vpp, layers, 1, 1)
    assert virtual_module_names(setup) == theirs
    for i in range(pp):
        mine = tuple(k * pp + i for k in range(vpp))
        assert _get_pp_rank_to_stage_indices_mapping(i, pp, "Interleaved1F1B", pp * vpp) == mine


def test_placement_by_hand() -> None:
    # Llama 3 405B: 126 + 2 = 128 effective layers over 16 · 8 virtual stages, one each: the first holds
    # the embedding alone, the last the head alone (Dubey et al. 2024 §3.3.2's layout)
    setup = piped(hf_setup("llama-3-8b", layers=126, seq=S, impl=Impl.TORCHTITAN), 16, 16, vpp=8)
    assert setup.parallel.pp_layers == (0, *[1] * 126, 0)
    # 16 + 2 = 18 over 2 · 3 = 6 stages: 3 each, the first and last one less
    base = hf_setup("llama-3-8b", layers=16, seq=S, impl=Impl.TORCHTITAN)
    assert piped(base, 2, 4, vpp=3).parallel.pp_layers == (2, 3, 3, 3, 3, 2)


B_S_8 = B * S * 8  # one micro-batch's int64 token ids, saved by the embedding


@pytest.fixture(scope="module")
def small() -> tuple[Setup, Result]:
    """6 layers over pp 2 × vpp 2 (torchtitan: 8 = 4·2, less the weights: 1, 2, 2, 1), n = 4."""
    setup = piped(hf_setup("llama-3-8b", layers=6, seq=S, impl=Impl.TORCHTITAN), 2, 4, vpp=2)
    assert setup.parallel.pp_layers == (1, 2, 2, 1)
    return setup, estimate(setup)


@pytest.mark.parametrize("index", [0, 1])
def test_rank_saves_what_the_estimate_says(small: tuple[Setup, Result], index: int) -> None:
    setup, est = small
    run = traced_exact(est, setup, index)
    # By hand. rounds = ⌊4/2⌋ = 2, r = 2 micro-batches per round.
    one = LAYER - ROPE  # one forward's saves of a layer; its RoPE cache is the module's buffer, once
    if index == 0:
        # Chunks: virtual 0 (embedding, layer 0) and 2 (layers 3, 4). Warm-up (2−1)·2 + 2·(2−1) = 4: F0 F0
        # F1 F1; then F0 B1, F0 B1, F1 B0, F1 B0; the largest moment is after the last forward: micro-batches
        # 1-3 of chunk 0 and 2-3 of chunk 1 in flight, all 8 outputs sent and held, the 2 gradients chunk 1
        # sent back; chunk 1 receives 4 activations, both chunks 4 gradients each.
        assert run.layers == (0, 3, 4)
        assert [run.layer_bytes(i) for i in run.layers] == [3 * one + ROPE, 2 * one + ROPE, 2 * one + ROPE]
        assert held(run) == {
            "pp.output": ((B, S, H), 8),
            "pp.grad_send": ((B, S, H), 2),
            "pp.recv": ((B, S, H), 4),
            "pp.grad_recv": ((B, S, H), 8),
        }
        assert run.activations == 7 * one + 3 * ROPE + 3 * B_S_8 + (8 + 2 + 4 + 8) * X
        assert run.param_bytes == 2 * V * H + 3 * PARAMS_LAYER
    else:
        # Chunks: virtual 1 (layers 1, 2) and 3 (layer 5, the head). Warm-up 2: F0 F0; then F1 B1, F1 B1,
        # F0 B0, F0 B0, F1 B1, F1 B1; B0 B0. Largest: after the last F1 (micro-batches 2, 3 of chunk 0 and 3
        # of chunk 1 in flight), chunk 0's 4 outputs held, 5 gradients sent back (4 of chunk 1, 1 of chunk 0);
        # both receive 4 activations, chunk 0 4 gradients; chunk 1's logits in flight.
        assert run.layers == (1, 2, 5)
        assert [run.layer_bytes(i) for i in run.layers] == [2 * one + ROPE, 2 * one + ROPE, one + ROPE]
        assert held(run) == {
            "pp.output": ((B, S, H), 4),
            "pp.grad_send": ((B, S, H), 5),
            "pp.recv": ((B, S, H), 8),
            "pp.grad_recv": ((B, S, H), 4),
            "pp.logits": ((B, S, V), 1),
        }
        # the head (tests/hf/test_torchtitan_pp.py): final norm, lm head input, fp32 log-probs, labels, the
        # token count and the loss
        head = 2 * B * S * H * 4 + B * S * 4 + X + B * S * V * 4 + B * S * 8 + 8 + 4
        assert run.activations == 5 * one + 3 * ROPE + (4 + 5 + 8 + 4) * X + B * S * V * 2 + head
        assert run.param_bytes == 3 * PARAMS_LAYER + 2 * H + 2 * V * H


def test_real_tensors_save_what_fake_ones_do() -> None:
    """The tiny model, 2 layers over pp 2 × vpp 2 (0, 1, 1, 0: the embedding and the head alone on a
    chunk), n = 2, with real (uninitialised) tensors over the fake group."""
    setup = piped(hf_setup("tiny", layers=2, seq=32, impl=Impl.TORCHTITAN), 2, 2, vpp=2)
    assert setup.parallel.pp_layers == (0, 1, 1, 0)
    real_saves_what_fake_ones_do(setup)


def real_saves_what_fake_ones_do(setup: Setup) -> None:
    """On pipeline ranks 0 and 1, real (uninitialised) tensors over the fake group save the shapes, dtypes
    and bytes fake tensors do, and the estimate's activations."""
    est = estimate(setup)
    for index in (0, 1):
        real = measure_titan_pipeline(setup, index, fake=False)
        fake = measure_titan_pipeline(setup, index)
        assert sorted((r.shape, r.dtype, r.bytes) for r in real.records) == sorted(
            (r.shape, r.dtype, r.bytes) for r in fake.records
        )
        assert real.activations == at_stage(est, index).activations


def test_full_scale_405b_first_rank() -> None:
    """Llama 3 405B's widths and 126 layers, seq 8192, pp 16 × vpp 8 (128 virtual stages, one effective
    layer each) over 16 micro-batches: rank 0 holds virtual stages 0 (the embedding alone), 16, …, 112 —
    7 layers — and keeps what the estimate says, to the byte."""
    setup = piped(hf_setup("llama-3.1-405b", layers=126, seq=8192, impl=Impl.TORCHTITAN), 16, 16, vpp=8)
    e, run = at_stage(estimate(setup), 0), measure_titan_pipeline(setup, 0)
    assert run.layers == (15, 31, 47, 63, 79, 95, 111)
    assert [run.layer_bytes(i) for i in run.layers] == per_layer(e, run)
    assert held(run) == estimated_held(e)
    assert run.activations == e.activations
    assert run.param_bytes == e.device.states.weights


def test_a_count_per_rank_is_refused_with_vpp() -> None:
    """With --vpp torchtitan places one count per virtual stage; --pp-layers with one per rank is refused."""
    base = hf_setup("llama-3-8b", layers=8, seq=S, impl=Impl.TORCHTITAN)
    with pytest.raises(ValueError, match="pp_layers: --impl torchtitan --vpp 2 places one count per virtual"):
        piped(base, 2, 4, vpp=2, pp_layers=(4, 4))


@pytest.mark.parametrize(
    ("layers", "pp", "vpp", "n", "message"),
    [
        (6, 2, 3, 4, "vpp: no pipeline_parallel_layers_per_stage"),  # ⌈8/k⌉ is 8, 4, 3, 2, 2, 2, 2, 1
        (16, 4, 2, 9, "grad_accum: torch's Interleaved1F1B"),  # rounds 2 do not divide 9
    ],
)
def test_unreachable_schedules_are_refused(layers: int, pp: int, vpp: int, n: int, message: str) -> None:
    base = hf_setup("llama-3-8b", layers=layers, seq=S, impl=Impl.TORCHTITAN)
    with pytest.raises(ValueError, match=message):
        piped(base, pp, n, vpp=vpp)


def test_megatron_interleaving_is_unchanged() -> None:
    """Megatron's interleaved stage (every impl but torchtitan) keeps its warm-up end, no send holds."""
    from memplan.config import Parallel
    from memplan.strategies.pipeline_parallel import stage

    st = stage(Parallel(pp=2, vpp=2), 0, (2, 2), 4)
    # 2(p − 1) + (m − 1)·p = 4 warm-up forwards, + 1: chunks 0, 0, 1, 1, 0
    assert st.chunks == 5 and st.sent_outputs is None and st.sent_grads == 0


def test_trace_cli_runs_each_rank() -> None:
    """``memplan trace --impl torchtitan --pp 2 [--vpp 2]``: each rank (or ``--stage 1``) exact, exit 0, the
    JSON valid against trace's schema; the rich report renders; a rank beyond pp is one line, exit 2."""
    import json

    import jsonschema
    from typer.testing import CliRunner

    from memplan.cli.app import app
    from memplan.schema import command_schema

    runner = CliRunner(env={"COLUMNS": "120", "NO_COLOR": "1"})
    base = [
        "trace",
        "--model",
        "tiny",
        "--seq",
        "32",
        "--impl",
        "torchtitan",
        "--pp",
        "2",
        "--grad-accum",
        "2",
    ]
    out = runner.invoke(app, [*base, "--vpp", "2", "--json"])
    assert out.exit_code == 0, out.output
    result = json.loads(out.stdout)
    jsonschema.validate(result, command_schema("trace"))
    assert [s["stage"]["virtual_stages"] for s in result["stages"]] == [[0, 2], [1, 3]]
    assert [s["stage"]["layers"] for s in result["stages"]] == [[1], [0]]  # placement 0, 1, 1, 0
    assert result["diff"]["equal"] and all(s["diff"]["exact"] for s in result["stages"])
    one = runner.invoke(app, [*base, "--stage", "1", "--json"])  # 1F1B, rank 1 alone
    assert one.exit_code == 0, one.output
    assert [s["stage"]["index"] for s in json.loads(one.stdout)["stages"]] == [1]
    assert runner.invoke(app, [*base, "--vpp", "2"]).exit_code == 0
    bad = runner.invoke(app, [*base, "--stage", "2"])
    assert bad.exit_code == 2 and "stage: --stage 2 is not a pipeline rank of --pp 2" in bad.stderr
    alone = runner.invoke(app, ["trace", "--model", "tiny", "--seq", "32", "--stage", "0"])
    assert alone.exit_code == 2 and "stage: --stage picks a pipeline rank" in alone.stderr


def sharded(setup: Setup, dp: int, zero: int) -> Setup:
    """``setup`` with each stage FSDP2-sharded over ``dp`` ranks under ZeRO-``zero``, validated again."""
    data = setup.model_dump()
    data["strategy"] = {**data["strategy"], "dp": dp, "zero": zero}
    return Setup.model_validate(data)


@pytest.mark.parametrize(("vpp", "zero"), [(2, 3), (1, 2)])
def test_fsdp2_stage_shards_what_the_estimate_says(vpp: int, zero: int) -> None:
    """pp 2 (× vpp 2 under ZeRO-3; 1F1B under ZeRO-2) × dp 2: rank 0 of the p × dp mesh, each model part
    ``fully_shard``-ed as torchtitan's ``parallelize_fn`` does after the split. The saves are the
    unsharded run's (FSDP2 swaps parameters, autograd keeps the same activations); the parameters at
    rest are ZeRO-3's shard (ZeRO-2 too: FSDP2 reshards after backward), each dim 0 halved."""
    setup = piped(hf_setup("llama-3-8b", layers=6, seq=S, impl=Impl.TORCHTITAN), 2, 4, vpp=vpp)
    plain, fsdp = setup, sharded(setup, 2, zero)
    est = at_stage(estimate(fsdp), 0)
    run, alone = measure_titan_pipeline(fsdp, 0), measure_titan_pipeline(plain, 0)
    assert Counter((r.name, r.layer, r.shape, r.bytes) for r in run.records) == Counter(
        (r.name, r.layer, r.shape, r.bytes) for r in alone.records
    )
    assert run.activations == est.activations == at_stage(estimate(plain), 0).activations
    # rank 0's layers: vpp 2 — 0, 3, 4 (placement 1, 2, 2, 1); 1F1B — 0, 1, 2 (placement 2, 3, 1 of 6 + 2
    # over 2 stages: 4, 4 less the weights: 3, 3). Every dim 0 (v = 128256, 6144, 4096, 14336) is even.
    assert run.layers == ((0, 3, 4) if vpp == 2 else (0, 1, 2))
    # half the bf16 bytes' elements, held in fp32 (FSDP2's mixed precision): 4 B · E/2 = the bf16 bytes
    assert run.param_bytes == 2 * V * H + 3 * PARAMS_LAYER
    if zero == 3:
        assert run.param_bytes == est.device.states.weights
    else:  # the estimate's ZeRO-2 weights are the gathered bf16 copy; at rest FSDP2 holds the fp32 shard
        assert est.device.states.weights == run.param_bytes  # 2 B · E = 4 B · E/2
    # Across the micro-batches (torch's stage: no reshard after backward, no gradient sync until
    # ``perform_reduce_grad``): every unit gathered in bf16 (2 B · E, the same bytes as the fp32 half),
    # the unsharded gradients accumulated in fp32 (4 B · E), the fp32 shards reduced after the step
    elements = (2 * V * H + 3 * PARAMS_LAYER) // 2
    moment = est.device.peak.moments["layer backward"]
    assert run.unsharded_weights == 2 * elements
    assert run.unsharded_grads == 4 * elements == moment["gradients"]
    assert run.grad_bytes == 2 * elements == est.device.states.gradients
    # the fp32 shards and the bf16 units (ZeRO-2: the estimate's weights are the bf16 copy, the shards
    # beside it, ``zero2_shards_beside``)
    assert moment["weights"] == run.param_bytes + run.unsharded_weights
    embedding = est.device.peak.moments["embedding backward"]  # rank 0's last backward: all still held
    assert (embedding["weights"], embedding["gradients"]) == (moment["weights"], moment["gradients"])


@pytest.mark.parametrize(
    ("p", "m", "n"), [(2, 4, 4), (4, 4, 8), (4, 8, 8), (16, 8, 16), (2, 3, 4), (3, 5, 6)]
)
def test_fsdp_lowering_is_torchs(p: int, m: int, n: int) -> None:
    """``fsdp_unshards`` against torch's own ``_add_unshard_reshard`` over torch's order of every rank:
    how many times each local chunk is all-gathered (``UNSHARD``), and at most three unsharded at once."""
    from torch.distributed.pipelining.schedules import (
        ScheduleInterleaved1F1B,
        _add_unshard_reshard,
        _ComputationType,
    )

    rounds = max(1, n // p)
    fake = SimpleNamespace(
        n_local_stages=m, pp_group_size=p, _n_microbatches=n, microbatches_per_round=n // rounds
    )
    for i in range(p):
        ops = ScheduleInterleaved1F1B._calculate_single_rank_operations(fake, i)  # type: ignore[arg-type]
        lowered = [a for a in _add_unshard_reshard(ops) if a is not None]
        unsharded = Counter(
            a.stage_index // p for a in lowered if a.computation_type is _ComputationType.UNSHARD
        )
        gathers, during = fsdp_unshards(p, m, n, i)
        assert gathers == tuple(unsharded[k] for k in range(m))
        assert max(len(ks) for ks in during) == min(m, 3)


def test_interleaved_fsdp2_rank_gathers_three_chunks_at_most() -> None:
    """The tiny model cut to 14 layers on pp 2 × vpp 4 (torchtitan's cut: 1, 2 × 6, 1 layers; the
    embedding and the head in the first and last virtual stages) × dp 2, ZeRO-3, 4 micro-batches. Rank 0's
    chunks: the embedding + a layer (256·64 + 36,992 = 53,376 el) and three of 2 layers (73,984 el each; a
    layer: wqkv (4 + 2·2)·16 × 64, wo 64 × 64, w1 w3 w2 3 × 128 × 64, two norms 64 = 36,992). torch's
    runtime keeps at most three chunks unsharded (``_add_unshard_reshard``): at most the three 2-layer
    chunks, 3 · 73,984 · 2 B = 443,904 B of bf16 gathered (not all four, 550,656 B); the unsharded fp32
    gradients of all four, 4 · 275,328 = 1,101,312 B, each held until its chunk's reduction."""
    base = hf_setup("tiny", layers=14, seq=32, impl=Impl.TORCHTITAN)
    setup = sharded(piped(base, 2, 4, vpp=4, pp_layers=(1, 2, 2, 2, 2, 2, 2, 1)), 2, 3)
    est = estimate(setup)
    run = traced_exact(est, setup, 0)
    device = at_stage(est, 0).device
    moment = device.peak.moments["layer backward"]
    assert run.unsharded_weights == 3 * 73_984 * 2 == moment["weights"] - device.states.weights
    assert run.unsharded_grads == 4 * (53_376 + 3 * 73_984) == moment["gradients"]
    assert run.grad_bytes == device.states.gradients == 2 * (53_376 + 3 * 73_984)


def test_fsdp2_shard_pads_each_parameter() -> None:
    """The tiny model (h 64, f 128, v 256, 4 + 2·2 heads of 16) on pp 2 (one layer each) over dp 3: each
    parameter's dim 0 is cut in ⌈d0/3⌉-row shards, padded; the estimate's per-stage FSDP2 shard is what
    rank 0 of each stage holds."""
    setup = sharded(piped(hf_setup("tiny", layers=2, seq=32, impl=Impl.TORCHTITAN), 2, 2), 3, 3)
    est = estimate(setup)
    # a layer: wqkv [128, 64] → 43 rows, wo [64, 64] → 22, w1 w3 [128, 64] → 43 each, w2 [64, 128] → 22,
    # two norms [64] → 22 each; the embedding and lm head [256, 64] → 86 rows, the final norm 22
    layer = 43 * 64 + 22 * 64 + 2 * 43 * 64 + 22 * 128 + 2 * 22
    by_hand = (86 * 64 + layer, layer + 22 + 86 * 64)
    for index in (0, 1):
        held = measure_titan_pipeline(setup, index).param_bytes
        # fp32 shards (FSDP2's mixed precision: bf16 only while gathered)
        assert held == at_stage(est, index).device.states.weights == 4 * by_hand[index]


@pytest.mark.parametrize(("vpp", "sp", "dp"), [(2, True, 1), (1, False, 1), (2, True, 2)])
def test_tensor_parallel_stage_keeps_what_the_estimate_says(vpp: int, sp: bool, dp: int) -> None:
    """pp 2 × tp 2 (± SP, ± vpp 2, ± FSDP2 over dp 2, ZeRO-3): each pipeline rank at tp and dp coordinate
    0 of the (pp, dp, tp) mesh, torchtitan's TP plan on each model part, DTensors across the stage
    boundary. Saves per layer, the schedule's holds and parameters equal the estimate of that rank."""
    base = piped(hf_setup("llama-3-8b", layers=6, seq=S, impl=Impl.TORCHTITAN), 2, 4, vpp=vpp, tp=2, sp=sp)
    setup = sharded(base, dp, 3) if dp > 1 else base
    est = estimate(setup)
    for index in (0, 1):
        run = traced_exact(est, setup, index)
        # By hand: under SP a boundary tensor is the sequence shard [b, s/2, h]; the last stage's logits
        # the vocabulary shard [b, s, v/2] of the whole sequence
        shapes = {name: shape for name, (shape, _) in held(run).items()}
        hidden = (B, S // 2, H) if sp else (B, S, H)
        assert all(shapes[k] == hidden for k in shapes if k != "pp.logits")
        if index == 1:
            assert shapes["pp.logits"] == (B, S, V // 2)
        if index == 0:
            # the embedding (vocabulary-parallel) and three layers' projections halved, their two norms
            # replicated; FSDP2 then halves every dim 0 (all even)
            tp_bytes = 2 * V * H // 2 + 3 * (PARAMS_LAYER - 2 * 2 * H) // 2 + 3 * 2 * 2 * H
            # without FSDP the bf16 build; FSDP2's shards are fp32 (twice the bytes per element)
            assert run.param_bytes == (tp_bytes if dp == 1 else 2 * tp_bytes // dp)


def test_searched_interleaved_layouts_place_as_torchtitan() -> None:
    """``search.space.layouts`` of a torchtitan setup with vpp 2 searched: each interleaved pipeline carries
    torchtitan's placement over its p·2 virtual stages (32 + 2 = 34 over 8: 5, 5, 4 × 6, less the
    weights)."""
    from memplan.search.space import Space, layouts

    base = hf_setup("llama-3-8b", layers=32, seq=S, impl=Impl.TORCHTITAN)
    found = {
        (x.parallel.pp, x.parallel.vpp): x.parallel.pp_layers for x in layouts(base, 8, Space(vpp=(1, 2)))
    }
    assert found[(4, 2)] == (4, 5, 4, 4, 4, 4, 4, 3)
    assert found[(4, 1)] == (8, 9, 8, 7)


@pytest.mark.parametrize("vpp", [1, 2])
def test_full_ac_keeps_the_receive_buffer_as_a_block_input(vpp: int) -> None:
    """torchtitan's FullAC: each block keeps its input [b, s, h]; a receiving chunk's first block's input
    is torch's receive buffer itself, counted once (as the layer's save, pp.recv less those forwards)."""
    setup = piped(
        hf_setup("llama-3-8b", layers=6, seq=S, impl=Impl.TORCHTITAN, checkpointing="full"), 2, 4, vpp=vpp
    )
    est = estimate(setup)
    runs = [traced_exact(est, setup, index, params=False) for index in (0, 1)]
    if vpp == 1:
        # By hand, stage 1 of 1F1B (layers 3-5 and the head, one forward in flight): each block's input X
        # — layer 3's is one of the 4 receive buffers, so 3 more are held — the head as in 1F1B's test
        run = runs[1]
        head = 2 * B * S * H * 4 + B * S * 4 + X + B * S * V * 4 + B * S * 8 + 8 + 4
        assert held(run) == {"pp.recv": ((B, S, H), 3), "pp.logits": ((B, S, V), 1)}
        assert run.activations == 3 * X + 3 * X + B * S * V * 2 + head


@pytest.mark.parametrize("n", [6, 3])
def test_micro_batches_off_the_pipeline_width(n: int) -> None:
    """torch's Interleaved1F1B takes n not a multiple of p (one round of n when n < 2p; Megatron's refusal
    does not apply): pp 4 × vpp 2 over 6 layers (one effective layer per virtual stage), ranks 0 and 3."""
    setup = piped(hf_setup("llama-3-8b", layers=6, seq=S, impl=Impl.TORCHTITAN), 4, n, vpp=2)
    assert setup.parallel.pp_layers == (0, 1, 1, 1, 1, 1, 1, 0)
    est = estimate(setup)
    for index in (0, 3):
        traced_exact(est, setup, index, params=False)


@pytest.mark.parametrize(("vpp", "zero", "layers"), [(1, 3, 2), (2, 3, 6), (1, 2, 2)])
def test_fsdp2_pipeline_peak_holds_what_the_estimate_says(vpp: int, zero: int, layers: int) -> None:
    """Each rank of pp 2 (× vpp 2: torchtitan's cut of 6 layers, 1, 2, 2, 1) × dp 2, 4 micro-batches,
    the tiny model, with its live storages tracked over the whole step (``PeakTracker``, FSDP2's resizes
    seen). At the rank's highest point FSDP2 holds what the estimate's highest moment says: the fp32
    shards (the parameters at rest; besides them only the RoPE buffers, s·d/2 complex64 = 32·8·8 = 2,048 B
    per layer), every unit gathered in bf16 and the unsharded fp32 gradients of the earlier micro-batches.
    Rank 0 of pp 2: 16,384 + 36,992 = 53,376 el (2 B · E gathered, 4 B · E of gradients); rank 1: 36,992 +
    16,448 = 53,440; under vpp 2 rank 0 holds 16,384 + 3 · 36,992 = 127,360 el.
    NB: the rest of the peak (saves, the schedule's holds, transients) is the pipeline estimate's, not
    exact per rank (docs/distributed.md: at pp 2 × dp 2 under ZeRO-3, rank 0 measures 676,352 B against
    the estimate's 685,328 B without its optimizer states, rank 1 672,148 B against 668,304 B)."""
    base = hf_setup("tiny", layers=layers, seq=32, impl=Impl.TORCHTITAN)
    setup = sharded(piped(base, 2, 4, vpp=vpp), 2, zero)
    est = estimate(setup)
    ranks = (TINY_EMBED + TINY_LAYER, TINY_LAYER + TINY_HEAD) if vpp == 1 else (TINY_EMBED + 3 * TINY_LAYER,)
    for index, elements in enumerate(ranks):
        run = measure_titan_pipeline(setup, index, peak=True)
        device = at_stage(est, index).device
        moment = device.peak.moments[device.peak.phase]
        rope = 2_048 * len(run.layers)
        assert run.param_bytes == 2 * elements  # 4 B · E/2: the fp32 shards
        assert run.peak_parts["states"] == run.param_bytes + rope
        assert run.peak_parts["unsharded weights"] == 2 * elements == moment["weights"] - run.param_bytes
        assert run.peak_parts["unsharded gradients"] == 4 * elements == moment["gradients"]
        assert run.peak == sum(run.peak_parts.values())


def test_trace_cli_shows_fsdp2_held_state() -> None:
    """``trace --impl torchtitan --pp 2 --dp 2 --zero 3 --grad-accum 4`` on the tiny model: each rank's
    FSDP2 state through the schedule beside the estimate's, in JSON (schema-valid) and text. Rank 0 holds
    16,384 + 36,992 = 53,376 el: gathered 2 B each, unsharded gradients 4 B each, fp32 shards 4 B · E/2."""
    import jsonschema
    from typer.testing import CliRunner

    from memplan.cli.app import app
    from memplan.schema import command_schema

    runner = CliRunner(env={"COLUMNS": "120", "NO_COLOR": "1"})
    args = ["trace", "--model", "tiny", "--seq", "32", "--impl", "torchtitan", "--pp", "2", "--dp", "2"]
    args += ["--zero", "3", "--grad-accum", "4", "--stage", "0"]
    out = runner.invoke(app, [*args, "--json"])
    assert out.exit_code == 0, out.output
    result = json.loads(out.stdout)
    jsonschema.validate(result, command_schema("trace"))
    (rank,) = result["stages"]
    elements = TINY_EMBED + TINY_LAYER
    measured = {k: v["measured"] for k, v in rank["diff"]["fsdp2"].items()}
    assert measured == {
        "unsharded_weights": 2 * elements,
        "unsharded_gradients": 4 * elements,
        "gradients": 2 * elements,
    }
    assert all(v["equal"] for v in rank["diff"]["fsdp2"].values()) and rank["diff"]["exact"]
    text = runner.invoke(app, args)
    assert text.exit_code == 0 and "rank 0, FSDP2: units gathered at once" in text.stdout


@pytest.mark.parametrize("vpp", [1, 2])
def test_tp_without_sp_accumulates_whole_partial_gradients(vpp: int) -> None:
    """tp 2 without SP × dp 2 ZeRO-3 (torchtitan's FSDP2 over a TP mesh): DTensor leaves W_O's and W2's
    weight gradients ``Partial``, the whole [64, 64] and [64, 128] on each rank where their parameters are
    the [64, 32] and [64, 64] halves (``blocks.torchtitan.partial_grad_elements``), and FSDP2 accumulates
    them so across the micro-batches in fp32 — but for W2 of a chunk's last layer when the chunk sends its
    output on: its output gradient comes back as the stage boundary's ``Replicate()``. Rank 0, by hand,
    beside the same layout under SP (shards): 1F1B over the 2 layers (one on rank 0), that layer's W_O
    alone more; pp 2 × vpp 2 over 6 layers (1, 2, 2, 1: rank 0 holds virtual stages 0 and 2, 3 layers,
    both chunks sending on), 3 W_O and 1 W2 more."""
    layers, ends, extra = 1, 1, {}
    base = hf_setup("tiny", layers=2 if vpp == 1 else 6, seq=32, impl=Impl.TORCHTITAN)
    if vpp == 2:
        layers, ends, extra = 3, 2, {"pp_layers": (1, 2, 2, 1)}
    setup = sharded(piped(base, 2, 4, vpp=vpp, tp=2, **extra), 2, 3)
    plain = sharded(piped(base, 2, 4, vpp=vpp, tp=2, sp=True, **extra), 2, 3)
    est = estimate(setup)
    run = traced_exact(est, setup, 0)
    moment = at_stage(est, 0).device.peak.moments["layer backward"]
    shards = at_stage(estimate(plain), 0).device.peak.moments["layer backward"]
    more = (layers * 64 * 64 + (layers - ends) * 64 * 128) // 2 * 4  # fp32, the reduce dtype
    assert run.unsharded_grads == moment["gradients"] == shards["gradients"] + more


def test_an_empty_middle_chunk_sends_what_it_received() -> None:
    """--pp-layers 1,1,0,0 over pp 2 × vpp 2 (the tiny model's 2 layers): rank 0's second chunk (virtual
    stage 2) holds no layer, neither the embedding nor the head, and returns the tensor it received, so
    what it sends is its receive buffer: the rank holds 4 sent outputs (chunk 0's, one per micro-batch),
    not 7 (the estimate had counted the pass-throughs' sends as new storages)."""
    base = hf_setup("tiny", seq=32, impl=Impl.TORCHTITAN)
    setup = piped(base, 2, 4, vpp=2, pp_layers=(1, 1, 0, 0))
    run = traced_exact(estimate(setup), setup, 0)
    assert held(run)["pp.output"] == ((1, 32, 64), 4)
