"""``memplan profile --nproc``: the tiny model run by 2–4 real processes (gloo on CPU) against the estimate.

Each world size is spawned once for all its layouts (tests/measure/spawned.py: process start with torch's
import is seconds each); the CLI's tests get their ranks' reports from that spawn.
Per rank the saved tensors and model states must equal ``engine.estimate`` of the same layout; the
independent checks come from the papers: the model states of ZeRO-3 are Ψ/N_d of the preset's published
parameter count (Rajbhandari et al. 2019 §5), ZeRO-3 moves every parameter once in each all-gather and the
whole gradient into the reduce-scatter (ZeRO §7: 3Ψ per step), tensor parallelism all-reduces the [b, s, h]
activation twice per layer in forward (Megatron-LM §3, the g operator after W_O and after the MLP).
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema  # type: ignore[import-untyped]  # (no stubs installed)
import pytest
from typer.testing import CliRunner

from memplan.api import load_model
from memplan.cli.app import app
from memplan.engine import estimate
from memplan.measure.compare.ranks import comparison, sequence_parallel_gathers
from memplan.measure.compare.tensors import estimated_by_name
from memplan.measure.distributed.instruments import collective_name
from memplan.presets import load_gpu
from memplan.schema import command_schema
from memplan.time.comm.collectives import communication
from tests.measure.spawned import SEQ, Runs, tiny_moe
from tests.measure.spawned import tiny as _setup

NPROC2 = pytest.mark.xdist_group("nproc2")  # one worker spawns the 2-rank layouts once (spawned.py)
NPROC4 = pytest.mark.xdist_group("nproc4")


def _run(runs: Runs, nproc: int, **layout: Any) -> tuple[Any, dict[str, Any]]:
    setup = _setup(gpus=nproc, **layout)
    est = estimate(setup)
    return est, comparison(runs.reports(setup, nproc), est, "spawn")


@pytest.fixture(scope="module")
def zero3(nproc_runs: Runs) -> tuple[Any, dict[str, Any]]:
    return _run(nproc_runs, 2, zero=3)


@pytest.fixture(scope="module")
def tp_dp(nproc_runs: Runs) -> tuple[Any, dict[str, Any]]:
    return _run(nproc_runs, 4, tp=2, zero=3)


def _collectives(rank: dict[str, Any]) -> dict[tuple[str, str, str], tuple[int, int]]:
    return {
        (c["dimension"], c["collective"], c["phase"]): (c["count"], c["bytes"]) for c in rank["collectives"]
    }


def _table(est: Any, dimension: str) -> dict[tuple[str, str], Any]:
    """The communication table's rows of ``dimension`` by (collective, phase)."""
    rows = communication(est, load_gpu("h100-sxm").topology)[1]
    return {(r.collective.value, r.phase.value): r for r in rows if r.dimension == dimension}


def _exact(est: Any, result: dict[str, Any]) -> None:
    """Every rank's saved tensors (name by name, no unnamed ones) and model states equal the estimate."""
    expected = {n: {"count": c, "bytes": b} for n, (c, b) in estimated_by_name(est).items()}
    assert result["equal"] is True
    for rank in result["ranks"]:
        assert rank["measured"]["tensors"] == expected
        assert rank["measured"]["unlabelled"] == []
        assert rank["diff"]["states_equal"] is True
        assert rank["diff"]["activations_equal"] is True


@NPROC2
def test_zero3_over_two_ranks_equals_the_estimate(zero3: tuple[Any, dict[str, Any]]) -> None:
    est, result = zero3
    _exact(est, result)
    psi = load_model("tiny").published_params  # 106,816 (the preset's own count)
    assert [r["coords"]["dp"] for r in result["ranks"]] == [0, 1]
    for rank in result["ranks"]:
        mem = rank["measured"]["memory"]
        assert mem["weights"] == mem["gradients"] == psi // 2 * 4  # fp32 shards of Ψ/N_d
        assert mem["optimizer"] == psi // 2 * 8  # Adam's m and v, fp32, no master copy in fp32
        comm = _collectives(rank)
        units = est.setup.model.num_layers + 1  # fully_shard per layer and the root
        assert comm[("dp", "all_gather", "forward")] == (units, psi // 2 * 4)
        assert comm[("dp", "all_gather", "backward")] == (units, psi // 2 * 4)
        assert comm[("dp", "reduce_scatter", "backward")] == (units, psi * 4)
        # The communication table (time/comm/collectives.py) moves the same bytes: one row per kind and
        # micro-batch (its buckets are one call), an all-gather's row carrying the gathered output (each
        # rank sends 1/dp of it), a reduce-scatter's the full gradient buffer each rank sends.
        table = _table(est, "dp")
        for phase in ("forward", "backward"):
            row = table[("all-gather", phase)]
            assert comm[("dp", "all_gather", phase)][1] * row.group == row.bytes * row.count
        row = table[("reduce-scatter", "backward")]
        assert comm[("dp", "reduce_scatter", "backward")][1] == row.bytes * row.count


@NPROC4
def test_tp_by_dp_on_four_ranks_equals_the_estimate(tp_dp: tuple[Any, dict[str, Any]]) -> None:
    est, result = tp_dp
    _exact(est, result)
    coords = [(r["coords"]["dp"], r["coords"]["tp"]) for r in result["ranks"]]
    assert coords == [(0, 0), (0, 1), (1, 0), (1, 1)]  # tp the inner dimension
    m = est.setup.model
    bsh = SEQ * m.hidden_size * 4  # one [b, s, h] fp32 activation
    for rank in result["ranks"]:
        comm = _collectives(rank)
        # Megatron §3: the g all-reduce after W_O and after the MLP per layer, plus the vocabulary-parallel
        # embedding's; the vocabulary-parallel loss's max, sum-exp and target logit are 3 small ones.
        count, nbytes = comm[("tp", "all_reduce", "forward")]
        assert count == 2 * m.num_layers + 1 + 3
        assert nbytes >= (2 * m.num_layers + 1) * bsh
        # The communication table's forward all-reduces (row-parallel outputs and the vocabulary-parallel
        # cross entropy's three per-token fp32 reductions): the same calls and bytes.
        table = [r for r in communication(est, load_gpu("h100-sxm").topology)[1] if r.dimension == "tp"]
        forward = [r for r in table if r.phase.value == "forward" and r.collective.value == "all-reduce"]
        assert (count, nbytes) == (sum(r.count for r in forward), sum(r.bytes * r.count for r in forward))
        # DTensor: one backward all-reduce per column-parallel linear (W_Q, W_K, W_V, gate, up) and the lm
        # head, where Megatron's f operator does one per block (docs/distributed.md).
        assert comm[("tp", "all_reduce", "backward")] == (5 * m.num_layers + 1, (5 * m.num_layers + 1) * bsh)


@NPROC2
def test_fsdp2_mixed_precision_over_two_ranks_equals_the_estimate(nproc_runs: Runs) -> None:
    """``--precision fsdp2-mixed``: FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=
    float32)`` on the model's fp32 parameters. By hand, per rank: the fp32 shards are the weights and what
    AdamW steps (4 B × Ψ/N_d, no master copy), the reduce-scatter writes fp32 sharded gradients (4 B ×
    Ψ/N_d), m and v 8 B × Ψ/N_d; each unit's all-gather sends its bf16 cast of the shard (2 B × Ψ/N_d in
    all) and each reduce-scatter the whole fp32 gradient (4 B × Ψ); the saves are the bf16 recipe's. The
    communication table moves the same bytes."""
    est, result = _run(nproc_runs, 2, zero=3, precision="fsdp2-mixed")
    _exact(est, result)
    psi = load_model("tiny").published_params
    units = est.setup.model.num_layers + 1
    table = _table(est, "dp")
    for rank in result["ranks"]:
        mem = rank["measured"]["memory"]
        assert mem["weights"] == mem["gradients"] == psi // 2 * 4
        assert mem["optimizer"] == psi // 2 * 8
        comm = _collectives(rank)
        for phase in ("forward", "backward"):
            assert comm[("dp", "all_gather", phase)] == (units, psi // 2 * 2)
            row = table[("all-gather", phase)]
            assert comm[("dp", "all_gather", phase)][1] * row.group == row.bytes * row.count
        assert comm[("dp", "reduce_scatter", "backward")] == (units, psi * 4)
        row = table[("reduce-scatter", "backward")]
        assert comm[("dp", "reduce_scatter", "backward")][1] == row.bytes * row.count


@NPROC4
def test_fsdp2_mixed_precision_over_tensor_parallel_ranks_equals_the_estimate(nproc_runs: Runs) -> None:
    """The same policy on tp 2 × dp 2: each rank's fp32 DTensor shards (the model's parameters made fp32
    after the tensor-parallel split) and its saves equal the estimate."""
    est, result = _run(nproc_runs, 4, tp=2, zero=3, precision="fsdp2-mixed")
    _exact(est, result)
    for rank in result["ranks"]:
        assert rank["measured"]["memory"]["optimizer"] == 2 * rank["measured"]["memory"]["weights"]


@NPROC2
def test_full_checkpointing_under_fsdp2_equals_the_estimate(nproc_runs: Runs) -> None:
    """``--checkpointing full`` on FSDP2 ranks (non-reentrant ``torch.utils.checkpoint`` per layer inside
    each ``fully_shard`` unit): each rank keeps one [b, s, h] fp32 input per layer and none of a layer's
    own saves (its re-run makes them in backward), the states as without checkpointing."""
    est, result = _run(nproc_runs, 2, zero=3, checkpointing="full")
    _exact(est, result)
    m = est.setup.model
    for rank in result["ranks"]:
        tensors = rank["measured"]["tensors"]
        assert tensors["layer.input"] == {
            "count": m.num_layers,
            "bytes": m.num_layers * SEQ * m.hidden_size * 4,
        }
        assert "attn.q" not in tensors and "mlp.up" not in tensors


@NPROC2
def test_reversible_layers_over_data_parallel_ranks_equal_the_estimate(nproc_runs: Runs) -> None:
    """Reversible layers over dp 2 with ZeRO-1 (the stack's own autograd Function re-runs them in backward;
    FSDP2, whose hooks it would bypass, is refused: ``parallelize.check_distributed``)."""
    est, result = _run(nproc_runs, 2, zero=1, reversible=True)
    _exact(est, result)


@NPROC2
def test_a_mixture_of_experts_under_fsdp2_equals_the_estimate(nproc_runs: Runs) -> None:
    """A mixture of experts (4 experts, top-2, the router's choices whatever the tokens make them) over dp
    2 with ZeRO-3: each rank's saves equal the estimate, whose experts' bytes do not depend on the routing
    (each expert's rows, T·k in all), and its states are Ψ/N_d of the model's fp32 parameters."""
    setup = tiny_moe(gpus=2, zero=3)
    est = estimate(setup)
    result = comparison(nproc_runs.reports(setup, 2), est, "spawn")
    _exact(est, result)
    psi = est.params.total
    for rank in result["ranks"]:
        assert rank["measured"]["memory"]["weights"] == psi // 2 * 4


@NPROC2
def test_float8_linears_under_fsdp2_equal_the_estimate(nproc_runs: Runs) -> None:
    """``--fp8 tensorwise`` over dp 2 with ZeRO-3: torchao's ``Float8Linear`` keeps the bf16 input and the
    weight's view, so each rank's saves equal the estimate's (bf16 training's) and its states too (FSDP2
    gathers the bf16 weights: no float8 all-gather on the reference)."""
    est, result = _run(nproc_runs, 2, zero=3, fp8="tensorwise", precision="bf16-mixed")
    _exact(est, result)


def test_the_ranks_train_float8_linears() -> None:
    """What ``--nproc --fp8`` ranks run: every linear of the layers a ``Float8Linear`` (7 a layer), under
    FSDP2's units (built on torch's fake process group, as rank 0 of 2)."""
    import torch.nn as nn

    from memplan.measure.distributed.nproc import _mesh
    from memplan.measure.distributed.parallelize import build
    from memplan.measure.distributed.titan import fake_world
    from memplan.measure.reference.fp8 import require_torchao

    setup = _setup(gpus=2, zero=3, fp8="tensorwise", precision="bf16-mixed")
    require_torchao()  # its CUDA extensions' warnings on a CPU build, swallowed
    from torchao.float8.float8_linear import Float8Linear

    with fake_world(0, 2):
        model = build(setup, _mesh(setup, False), "cpu")
        kinds = [type(m) for m in model.modules() if isinstance(m, nn.Linear)]
    assert kinds == [Float8Linear] * 7 * setup.model.num_layers


@NPROC2
def test_the_rank_batches_stay_on_one_worker(request: pytest.FixtureRequest) -> None:
    """Under ``--dist loadgroup`` (pyproject's addopts) pytest-xdist runs an ``xdist_group`` on one worker, so
    each world size's ranks are spawned once (tests/measure/spawned.py); it marks the group in the node
    id. Under pytest 9.2's structured node ids it no longer does and the groups split across workers
    (pytest-dev/pytest-xdist issue #1386): hence pyproject's ``pytest<9.2``."""
    config = request.config
    if not hasattr(config, "workerinput") or not getattr(config.option, "loadgroup", False):
        pytest.skip("not a pytest-xdist worker under --dist loadgroup")
    assert request.node.nodeid.endswith("@nproc2"), request.node.nodeid


@NPROC2
def test_zero1_over_two_ranks_shards_only_the_optimizer(nproc_runs: Runs) -> None:
    """ZeRO-1 (Rajbhandari et al. 2019 §5.1, P_os): weights and gradients whole (4Ψ B each in fp32), Adam's
    m and v sharded (8Ψ/N_d B); the step reduce-scatters every gradient and all-gathers every parameter
    once (ZeRO §7: 2Ψ moved, as data parallelism), the communication table's two dp rows."""
    est, result = _run(nproc_runs, 2, zero=1)
    _exact(est, result)
    psi = load_model("tiny").published_params
    table = _table(est, "dp")
    for rank in result["ranks"]:
        mem = rank["measured"]["memory"]
        assert (mem["weights"], mem["gradients"], mem["optimizer"]) == (psi * 4, psi * 4, psi // 2 * 8)
        comm = _collectives(rank)
        count, gathered = comm[("dp", "all_gather", "step")]
        assert gathered == psi // 2 * 4  # each rank contributes its chunk of every parameter
        assert comm[("dp", "reduce_scatter", "step")] == (count, psi * 4)  # every whole gradient, once
        row = table[("all-gather", "step")]
        assert gathered * row.group == row.bytes * row.count
        row = table[("reduce-scatter", "step")]
        assert psi * 4 == row.bytes * row.count


def test_tp_with_sequence_parallelism_differs_only_by_the_gathered_inputs() -> None:
    """Through the CLI: states equal, and the saves equal the estimate but for DTensor's gathered inputs:
    attn.input, mlp.input and lm_head.input absent, L·5 + 1 unnamed [b, s, h] tensors instead. The one
    test that runs the whole way, CLI to ``launch`` to its own spawn (the others share spawned.py's)."""
    result = CliRunner().invoke(
        app,
        [
            *("profile", "-m", "tiny", "--device", "cpu", "--seq", str(SEQ), "--precision", "fp32"),
            *("--nproc", "2", "--tp", "2", "--sp", "--json"),
        ],
        env={"COLUMNS": "120"},
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["equal"] is True
    # --nproc's output is the second alternative of profile's schema (memplan schema --command profile)
    jsonschema.Draft202012Validator(command_schema("profile")).validate(data)
    est = estimate(_setup(gpus=2, tp=2, sp=True))
    m = est.setup.model
    plain = estimated_by_name(est)
    for rank in data["ranks"]:
        assert rank["diff"]["states_equal"] is True
        tensors = rank["measured"]["tensors"]
        for name in ("attn.input", "mlp.input", "lm_head.input"):
            assert name not in tensors
        for name, (count, nbytes) in plain.items():
            if name not in ("attn.input", "mlp.input", "lm_head.input"):
                assert (tensors[name]["count"], tensors[name]["bytes"]) == (count, nbytes), name
        gathered = rank["measured"]["unlabelled"]
        assert len(gathered) == 5 * m.num_layers + 1
        assert all(g["bytes"] == SEQ * m.hidden_size * 4 for g in gathered)  # whole [b, s, h], fp32
    assert sequence_parallel_gathers(est)["unlabelled"] == (11, 11 * SEQ * m.hidden_size * 4)


@pytest.mark.parametrize(
    ("op", "name"),
    [
        ("c10d._allgather_base_", "all_gather"),
        ("c10d._reduce_scatter_base_", "reduce_scatter"),
        ("c10d.allreduce_", "all_reduce"),
        ("_c10d_functional.all_gather_into_tensor", "all_gather"),
        ("_c10d_functional.reduce_scatter_tensor", "reduce_scatter"),
        ("_c10d_functional.all_reduce", "all_reduce"),
        ("_c10d_functional.all_to_all_single", "all_to_all"),
    ],
)
def test_collective_names(op: str, name: str) -> None:
    assert collective_name(op) == name


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--nproc", "2", "--zero", "3", "--reversible"], "reversible"),
        (["--nproc", "2", "--pp", "2", "--grad-accum", "2", "--reversible"], "reversible"),
        (["--tp", "2"], "nproc"),
        (["--nproc", "3", "--tp", "2"], "nproc"),
    ],
)
def test_what_cannot_run_is_refused_in_one_line(flags: list[str], field: str) -> None:
    result = CliRunner().invoke(app, ["profile", "-m", "tiny", "--device", "cpu", "--seq", "32", *flags])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {field}:"), result.output


class _Hung:
    """A process context whose ranks never finish (a collective waiting forever)."""

    def __init__(self) -> None:
        self.processes: list[Any] = []

    def join(self, timeout: float) -> bool:
        return False


def test_a_hung_launch_ends_with_a_timeout() -> None:
    from memplan.measure.distributed.launch.spawn import _join

    with pytest.raises(TimeoutError, match="ran past"):
        _join(_Hung(), timeout_s=0.3)


@NPROC4
def test_zero1_over_tensor_parallel_ranks_shards_each_local_tensor(
    nproc_runs: Runs, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue #22: ``--nproc 4 --tp 2 --zero 1`` ran into DTensor's missing sharding strategy for
    ``c10d._reduce_scatter_base_``; ZeRO-1 now shards each rank's local tp tensor over dp (zero1.local).
    Independent check (ZeRO §5.1, P_os): in fp32 Adam keeps two fp32 states per element, sharded over
    dp = 2: 2 · 4 · N/2 bytes = 4 · N, the bytes of the rank's own fp32 weights (4 · N). (The CLI's launch
    is answered by the 4-rank spawn: spawned.py.)"""
    nproc_runs.serve(monkeypatch)
    result = CliRunner().invoke(
        app,
        [
            *("profile", "-m", "tiny", "--device", "cpu", "--seq", str(SEQ), "--precision", "fp32"),
            *("--nproc", "4", "--tp", "2", "--zero", "1", "--json"),
        ],
        env={"COLUMNS": "120"},
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["equal"] is True
    for rank in data["ranks"]:
        assert rank["diff"]["states_equal"] is True
        memory = rank["measured"]["memory"]
        assert memory["optimizer"] == memory["weights"] > 0
