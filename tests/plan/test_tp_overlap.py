"""``--tp-comm-overlap``: Transformer Engine's userbuffers under Megatron (``time.tp_overlap``) — which
sequence-parallel collectives hide behind which GEMMs, how much of them, the buffers it holds, and its
refusals, by hand from the module's docstring."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memplan.api import Options, build
from memplan.cli.app import app
from memplan.time import efficiency, tp_overlap
from memplan.time.comm.collectives import USERBUFFERS
from memplan.time.comm.rows import Overlap

runner = CliRunner()

# Megatron-Bridge's Llama 3 70B layout on 64 H100s (benchmarks/heldout_bridge.py), float8 current scaling
BRIDGE_70B = (
    "estimate -m llama-3-70b --seq 8192 --batch 1 --global-batch 128 --gpus 64 --gpu h100-sxm "
    "--impl megatron --fp8 tensorwise --zero 1 --overlap-grad-reduce --overlap-param-gather "
    "--reduce-dtype bf16 --clip-grad --tp 4 --sp --pp 8 --vpp 5"
)


def _json(argv: str) -> dict:  # type: ignore[type-arg]
    r = runner.invoke(app, [*argv.split(), "--json"])
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def test_the_row_parallel_share_by_hand() -> None:
    """Llama 3 8B: a·d = 4,096, kv·d = 1,024, f = 14,336, SwiGLU: W_O and W_fc2 take (4,096 + 14,336) of
    the (4,096 + 2·1,024) + 4,096 + 3·14,336 = 53,248 columns' FLOPs; GPT-2's GELU MLP (h 768, f 3,072):
    (768 + 3,072) / (3·768 + 768 + 2·3,072)."""
    from memplan.api import build_setup

    assert tp_overlap.shares(build_setup("llama-3-8b")) == (1 - 18432 / 53248, 18432 / 53248)
    assert tp_overlap.shares(build_setup("gpt2"))[1] == (768 + 3072) / (3 * 768 + 768 + 2 * 3072)


def test_the_layers_collectives_move_under_their_gemms_and_the_rest_stay() -> None:
    """Of the forward all-gathers the layers' 2 a layer and micro-batch hide behind the column-parallel
    GEMMs, the head's stays exposed; the same for the reduce-scatters (the embedding's stays) and the
    backward's output-gradient all-gathers; Megatron's two overlapped backward rows are unchanged. Stage
    0 of pp 8 × vpp 5 holds 10 layers and the embedding; 128 sequences over dp 2: 64 micro-batches."""
    plain = _json(BRIDGE_70B)["time"]["communication"]
    ub = _json(BRIDGE_70B + " --tp-comm-overlap")["time"]["communication"]
    tp = [r for r in ub if r["dimension"] == "tp"]
    moved = {(r["what"], r["overlaps"], r["count"]) for r in tp if "userbuffers" in r["what"]}
    calls = 2 * 10 * 64
    assert moved == {
        ("sequence → linear inputs ‖ GEMM (userbuffers)", Overlap.UB_COLUMN_FORWARD.value, calls),
        ("outputs → sequence shards ‖ GEMM (userbuffers)", Overlap.UB_ROW_FORWARD.value, calls),
        ("output gradients ‖ GEMM (userbuffers)", Overlap.UB_ROW_DGRAD.value, calls),
    }
    kept = {(r["what"], r["count"]) for r in tp if "userbuffers" not in r["what"]}
    names = {w.removesuffix(" ‖ GEMM (userbuffers)") for w, _, _ in moved}
    before = [(r["what"], r["count"]) for r in plain if r["dimension"] == "tp"]
    # what remains of each moved row is the embedding's (stage 0 has no head): 64 calls a step
    assert kept == {(w, c - calls) if w in names else (w, c) for w, c in before} - {(w, 0) for w in names}
    assert sum(r["count"] for r in tp) == sum(r["count"] for r in plain if r["dimension"] == "tp")


def test_what_hides_costs_what_its_window_leaves_and_the_overlap_slowdown() -> None:
    """Each moved kind of row costs max(0, T − W) + ``OVERLAP_SLOWDOWN`` · min(T, W) of its seconds T under
    its window W (``predict.exposed``) instead of T. At 70B's tp 4 in float8, on NVLink at 450 GB/s ×
    NETWORK_INTRA (``--intra-node-bw 450``: the preset's measured ring bandwidth of its own link dropped),
    the column-parallel GEMMs (0.79 s a step) hide their all-gathers (0.43 s) with room, the row-parallel
    ones (0.432 s) leave 1 ms of their reduce-scatters (0.433 s) exposed."""
    from memplan.api import setup_of
    from memplan.engine import estimate
    from memplan.presets import load_gpu
    from memplan.time.calibration import calibrated_topology
    from memplan.time.comm.collectives import communication
    from memplan.time.compute import userbuffer_windows
    from memplan.time.timing import peak_flops

    link = " --intra-node-bw 450"
    plain, ub = _json(BRIDGE_70B + link), _json(BRIDGE_70B + link + " --tp-comm-overlap")
    o = Options(  # BRIDGE_70B's settings
        model="llama-3-70b", seq=8192, batch=1, global_batch=128, gpus=64, gpu="h100-sxm", impl="megatron",
        fp8="tensorwise", zero=1, overlap_grad_reduce=True, overlap_param_gather=True, reduce_dtype="bf16",
        clip_grad=True, tp=4, sp=True, pp=8, vpp=5, tp_comm_overlap=True,
    )  # fmt: skip
    h100 = load_gpu("h100-sxm")
    r, gpu = (
        estimate(setup_of(o)),
        h100.model_copy(update={"topology": h100.topology.with_overrides(None, 450, None)}),
    )
    assert gpu.topology.intra_node_busbw_gbps is None  # the override's link, at NETWORK_INTRA
    c, rows = communication(r, calibrated_topology(gpu))
    windows = userbuffer_windows(c, gpu, peak_flops(gpu, r.setup.training.precision))
    slow, saved = efficiency.OVERLAP_SLOWDOWN, 0.0
    for kind, window in windows.items():
        seconds = sum(x.time_s for x in rows if x.overlap is kind)
        saved += seconds - (max(0.0, seconds - window) + slow * min(seconds, window))
    row_forward = sum(x.time_s for x in rows if x.overlap is Overlap.UB_ROW_FORWARD)
    assert windows[Overlap.UB_ROW_FORWARD] < row_forward
    before, after = plain["time"]["predicted"]["exposed_s"]["tp"], ub["time"]["predicted"]["exposed_s"]["tp"]
    assert after == pytest.approx(before - saved, rel=1e-12)
    # and the compute is unchanged: only the exposure moved
    assert ub["time"]["predicted"]["compute_s"] == plain["time"]["predicted"]["compute_s"]


def test_a_window_is_t_minus_one_chunks_of_its_gemms() -> None:
    """``tp_overlap.windows`` by hand: n·(t − 1)/t of each GEMM class's seconds, the row share of the
    layers' linears for W_O and W_fc2, the rest for W_QKV and W_fc1."""
    from memplan.api import build_setup
    from memplan.config import Parallel
    from memplan.engine import estimate
    from memplan.time.comm.rows import critical_stage

    setup = build_setup("llama-3-8b", seq=4096, parallel=Parallel(tp=4, sp=True), grad_accum=3)
    c = critical_stage(estimate(setup))
    w = tp_overlap.windows(c, 2.0, 3.0, 0.5, 3)
    row = 18432 / 53248
    assert w == {
        Overlap.UB_COLUMN_FORWARD: 3 * 3 / 4 * (1 - row) * 2.0,
        Overlap.UB_ROW_FORWARD: 3 * 3 / 4 * row * 2.0,
        Overlap.UB_ROW_DGRAD: 3 * 3 / 4 * row * 3.0,
        Overlap.UB_COLUMN_RERUN: 3 * 3 / 4 * (1 - row) * 0.5,
        Overlap.UB_ROW_RERUN: 3 * 3 / 4 * row * 0.5,
    }
    assert set(USERBUFFERS.values()) == set(w)


def test_full_checkpointing_reruns_hide_behind_the_reruns_gemms() -> None:
    """A re-run layer's all-gather and reduce-scatter (full checkpointing) go under its re-run GEMMs."""
    out = _json(BRIDGE_70B.replace("--vpp 5", "--vpp 5 --checkpointing full") + " --tp-comm-overlap")
    kinds = {r["overlaps"] for r in out["time"]["communication"] if "userbuffers" in r["what"]}
    assert {Overlap.UB_COLUMN_RERUN.value, Overlap.UB_ROW_RERUN.value} <= kinds


def test_the_userbuffers_by_hand_and_kept_back_from_the_allocator() -> None:
    """Ten [s·b/cp, h] buffers: under float8 the six all-gathers' in one byte and the four others' in
    bf16 (14 bytes a [T, h] element), in bf16 all 20; cp halves T. 70B: T = 8,192, h = 8,192. The verdict
    keeps them back: the allocator's usable memory falls by exactly their bytes."""
    t_h = 8192 * 8192
    plain, ub = _json(BRIDGE_70B), _json(BRIDGE_70B + " --tp-comm-overlap")
    assert ub["memory"]["te_userbuffers"] == 14 * t_h
    assert plain["memory"]["te_userbuffers"] == 0
    assert plain["fit"]["usable_bytes"] - ub["fit"]["usable_bytes"] == 14 * t_h
    assert ub["fit"]["userbuffers"] == 14 * t_h
    bf16 = _json(BRIDGE_70B.replace("--fp8 tensorwise ", "") + " --tp-comm-overlap --cp 2 --gpus 128")
    assert bf16["memory"]["te_userbuffers"] == 20 * t_h // 2


@pytest.mark.parametrize(
    ("flags", "why"),
    [
        ("--tp 4 --sp", "it is Transformer Engine's, under --impl megatron"),
        ("--impl megatron --tp 4", "it needs --tp T --sp with T > 1"),
        ("--impl megatron", "it needs --tp T --sp with T > 1"),
    ],
)
def test_refused_where_it_does_not_run_in_one_line(flags: str, why: str) -> None:
    r = runner.invoke(app, ["estimate", "-m", "llama-3-8b", "--tp-comm-overlap", *flags.split()])
    assert r.exit_code == 2
    line = r.stderr.strip()
    assert line.startswith("error: tp_comm_overlap: --tp-comm-overlap (TE's userbuffers): ") and why in line
    assert "\n" not in line


MEGATRON_TP = ["estimate", "--impl", "megatron", "--sp", "--tp-comm-overlap"]


def test_refused_for_experts_split_over_tp_and_across_nodes() -> None:
    moe = runner.invoke(app, [*MEGATRON_TP, "-m", "mixtral-8x7b", "--tp", "2"])
    assert moe.exit_code == 2 and "modelled under parallel folding (--etp 1)" in moe.stderr
    narrow = ["--tp", "8", "--gpus", "8", "--gpu", "h100-sxm", "--gpus-per-node", "4"]
    node = runner.invoke(app, [*MEGATRON_TP, "-m", "llama-3-8b", *narrow])
    assert node.exit_code == 2
    assert node.stderr.strip() == (
        "error: tp_comm_overlap: TE's userbuffers run inside one node's NVLink domain; --tp 8 spans more "
        "than its 4 GPUs: use --tp ≤ 4 or drop --tp-comm-overlap"
    )


def test_fit_keeps_it_on_layouts_that_run_it_and_its_rows_reproduce() -> None:
    """``fit --impl megatron --tp-comm-overlap``: only tensor-parallel layouts with sp (where it runs), inside
    the node; each row's command carries it and reproduces the row's step time."""
    argv = (
        "fit -m llama-3-70b --seq 8192 --gpus 64 --gpu h100-sxm --global-batch 128 --top 3 --impl megatron "
        "--tp-comm-overlap --json"
    )
    r = runner.invoke(app, argv.split())
    assert r.exit_code == 0, r.stderr
    configs = json.loads(r.stdout)["configs"]
    assert configs
    for c in configs:
        assert c["settings"]["tp"] > 1 and c["settings"]["sp"] and c["settings"]["tp"] <= 8
        assert "--tp-comm-overlap" in c["command"]
    again = runner.invoke(app, [*configs[0]["command"].removeprefix("memplan ").split(), "--json"])
    assert again.exit_code == 0, again.stderr
    assert json.loads(again.stdout)["time"]["step_time_s"] == configs[0]["time"]["step_time_s"]


def test_the_search_bound_stays_below_the_prediction() -> None:
    """``search.bound``: with the layers' collectives hidden the bound charges none of them, and stays
    below memplan's own prediction at each ZeRO stage Megatron runs."""
    from memplan.api import build_setup
    from memplan.config import Attention, Checkpointing, Impl, ImplConfig, Parallel
    from memplan.engine import estimate
    from memplan.presets import load_gpu
    from memplan.search.bound import Bound
    from memplan.time.timing import timing

    h100 = load_gpu("h100-sxm")
    impl = ImplConfig(impl=Impl.MEGATRON, tp_comm_overlap=True)
    par = Parallel(tp=8, sp=True, pp=2)
    n, dp = 8, 4
    # fit's base: one device, built without the switch, then given it (``cli.search._fit_base``)
    base = build_setup("llama-3-70b", seq=8192, impl=ImplConfig(impl=Impl.MEGATRON)).replaced(impl=impl)
    bound = Bound(h100, 64, n * dp, userbuffers=True)
    seconds = bound.seconds(base, Checkpointing.NONE, Attention.FLASH, par, n)
    for zero in (0, 1):
        setup = build_setup("llama-3-70b", seq=8192, impl=impl, zero=zero, dp=dp, parallel=par, grad_accum=n)
        assert 0 < seconds <= timing(estimate(setup), h100).step_time_s


def test_options_default_off() -> None:
    o = Options(model="llama-3-8b", tp=2, sp=True, impl="megatron", gpu="h100-sxm")
    assert build(o).result.setup.impl.tp_comm_overlap is False
