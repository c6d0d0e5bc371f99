"""MoE parallel folding (``--etp 1`` with ``--tp > 1`` under ``--impl megatron``: Megatron-core's
``expert_tensor_parallel_size=1``), every figure by hand from Megatron-core's alltoall dispatcher and its
expert rank order, set beside the same layout with the experts split over tp (``--etp`` not given: tp).

The layout: Qwen3 30B-A3B (h 2048, 32 heads and 4 KV heads of 128, 48 layers, 128 experts top-8 of width
768, vocabulary 151,936) at s 4,096, micro-batch 1, global batch 128, on 16 H100s (8 a node) with tp 2 +
sp, ep 8, dp 8. Folded, each rank routes its own T/t = 2,048 tokens: S = 2,048 · 8 = 16,384 slots on its
E/ep = 16 whole experts (1,024 rows an expert), nothing gathered over tp; ep 8 is 8 consecutive ranks
(etp-ep-dp order: one node), the experts' data-parallel group tp·dp/ep = 2 (ranks 8 apart: two nodes).
Split over tp instead, each rank's experts are f/2 = 384 wide and take the tp group's gathered T·k =
32,768 slots; ep takes its ranks from dp (stride tp = 2: ranks 0, 2, …, 14, two nodes)."""

from __future__ import annotations

import functools
import json
from typing import Any

import pytest
from typer.testing import CliRunner

from memplan.api import Options, setup_of
from memplan.cli.app import app
from memplan.time import gemm
from memplan.time.layer_elementwise import dispatch

runner = CliRunner()

H, F, E, K, L, T, V = 2048, 768, 128, 8, 48, 4096, 151_936
OWN = T // 2  # a rank's own tokens under sp
FOLDED_SLOTS = OWN * K  # 16,384: its own tokens' slots, balanced over ep
GATHERED_SLOTS = T * K  # 32,768: the tp group's slots, gathered over tp
ARGV = (
    "estimate -m qwen3-30b-a3b --seq 4096 --batch 1 --global-batch 128 --gpus 16 --gpu h100-sxm "
    "--impl megatron --zero 1 --reduce-dtype bf16 --tp 2 --sp --ep 8 --json"
)
FOLD = "--etp 1"


@functools.cache  # one estimate per layout for the whole module (the tests read it, none changes it)
def _run(extra: str = "") -> dict[str, Any]:
    r = runner.invoke(app, [*(ARGV + " " + extra).split()])
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def _tensors(out: dict[str, Any]) -> dict[str, tuple[list[int], str]]:
    return {t["name"]: (t["shape"], t["dtype"]) for t in out["activations"]["tensors"]}


def _setup(extra: str = "") -> Any:
    argv = dict(
        model="qwen3-30b-a3b", seq=T, batch=1, global_batch=128, gpus=16, gpu="h100-sxm", impl="megatron",
        zero=1, reduce_dtype="bf16", tp=2, sp=True, ep=8,
    )  # fmt: skip
    if extra:
        argv["etp"] = 1
    return setup_of(Options(**argv))


def test_a_folded_rank_keeps_its_own_tokens_slots_through_whole_experts() -> None:
    """The router's maps and TE's permutation map on the rank's own T/2 tokens (both layouts: Megatron
    permutes before the all-to-all); the dispatched tokens, fc1's [S, 2f] output and the probabilities on
    S = 16,384 slots, f whole — where the tp-split experts keep the gathered 32,768 slots at 2f/2."""
    folded, split = _tensors(_run(FOLD)), _tensors(_run())
    for saves in (folded, split):
        assert saves["moe.routing_map"] == ([OWN, E], "bool")
        assert saves["moe.row_id_map"] == ([OWN, 2 * E + 1], "int32")
    assert folded["moe.expert_input"] == ([FOLDED_SLOTS, H], "bf16")
    assert folded["moe.fc1"] == ([FOLDED_SLOTS, 2 * F], "bf16")
    assert folded["moe.probs"] == ([FOLDED_SLOTS, 1], "bf16")
    assert folded["moe.chunk_sort_map"] == ([FOLDED_SLOTS], "int32")
    assert split["moe.expert_input"] == ([GATHERED_SLOTS, H], "bf16")
    assert split["moe.fc1"] == ([GATHERED_SLOTS, 2 * F // 2], "bf16")
    assert split["moe.chunk_sort_map"] == ([GATHERED_SLOTS], "int32")


def test_whole_experts_on_the_rank_their_states_over_tp_dp_over_ep() -> None:
    """Parameters on a rank: the vocabulary-parallel embedding and head, the attention split over tp, the
    norms and router whole, and 16 whole experts (fc1 [2f, h], fc2 [h, f]); AdamW's fp32 master and moments
    (12 B) of the dense part over dp 8, of the experts over tp·dp/ep = 2 — the same expert states a rank
    holds with the experts split over tp (half as wide, not sharded: dp/ep = 1); their bf16 weights twice."""
    attention = (H * (32 * 128 + 2 * 4 * 128) + 32 * 128 * H) // 2
    norms, router, experts = 2 * H + 2 * 128, H * E, (E // 8) * 3 * H * F
    dense = 2 * (V // 2) * H + L * (attention + norms + router) + H
    folded = _run(FOLD)
    assert folded["params"]["device"] == dense + L * experts == 4_400_822_272
    assert folded["memory"]["weights"] == 2 * (dense + L * experts)
    split = _run()
    assert split["params"]["device"] == dense + L * experts // 2
    states = folded["memory"]["optimizer"]
    assert states == 12 * (dense // 8 + L * experts // 2) == split["memory"]["optimizer"]


def _rows(out: dict[str, Any], dimension: str) -> list[dict[str, Any]]:
    return [r for r in out["time"]["communication"] if r["dimension"] == dimension]


def test_folded_expert_groups_are_placed_in_megatrons_expert_order() -> None:
    """ep 8 is eight consecutive ranks (one node) folded, every second rank (two nodes) when it is drawn
    from dp; both move a rank's own T/2 tokens' slots, 2,048 · 8 · h · 2 B a call. The experts' gradients
    reduce over tp·dp/ep = 2 ranks 8 apart (folded); over dp/ep = 1 (no collective) split over tp."""
    folded, split = _run(FOLD), _run()
    a2a = OWN * K * H * 2
    for out, link in ((folded, "intra-node"), (split, "inter-node")):
        rows = _rows(out, "ep")
        assert {(r["bytes"], r["group"], r["link"]) for r in rows} == {(a2a, 8, link)}
    experts = _rows(folded, "dp experts")
    grads = L * (E // 8) * 3 * H * F * 2  # the 16 whole experts' bf16 gradients
    assert {(r["what"], r["bytes"], r["group"], r["link"]) for r in experts} == {
        ("gradients", grads, 2, "inter-node"),
        ("updated weights", grads, 2, "inter-node"),
    }
    assert not _rows(split, "dp experts")
    # NCCL's communicators (memory): the same groups, where they are placed
    nccl = {c["group"]: (c["ranks"], c["inter_node"]) for c in folded["memory"]["nccl"]["communicators"]}
    assert (nccl["ep"], nccl["dp experts"]) == ((8, False), (2, True))


def test_folded_moe_layers_gather_nothing_over_tp() -> None:
    """The sequence-parallel all-gather before the column-parallel linears runs, per micro-batch, once a
    layer for the attention and once for the head: (48 + 1) × 16 micro-batches, [T, h] each — folded or
    not, the MoE gathers no [T, h]. Folded it gathers nothing more; split over tp Megatron's dispatcher
    gathers the rank's dispatched slots over tp after the all-to-all, and reduce-scatters the experts'
    outputs before the one back (token_dispatcher.py), T·k·h·e = 4,096 · 8 · 2,048 · 2 B gathered, and
    their inverses in backward, per layer and micro-batch, none hidden."""
    n = 128 // 8
    folded, split = _rows(_run(FOLD), "tp"), _rows(_run(), "tp")
    for rows in (folded, split):
        gathers = [r for r in rows if r["what"] == "sequence → linear inputs"]
        assert [(r["count"], r["bytes"]) for r in gathers] == [((L + 1) * n, T * H * 2)]
    slots = {(r["collective"], r["phase"], r["what"], r["bytes"], r["count"], r["overlaps"]) for r in split}
    y = T * K * H * 2
    assert {
        ("all-gather", "forward", "dispatched slots → experts", y, L * n, "none"),
        ("reduce-scatter", "forward", "experts' outputs → slots", y, L * n, "none"),
        ("all-gather", "backward", "experts' output gradients", y, L * n, "none"),
        ("reduce-scatter", "backward", "dispatched slots' gradients", y, L * n, "none"),
    } <= slots
    assert not [r for r in folded if "slots" in r["what"] or "experts" in r["what"]]


def test_folded_expert_gemms_are_whole_on_fewer_rows() -> None:
    """The grouped GEMMs of the rank's 16 experts: S·ep/E rows each — 1,024 folded ([h, 2f] then [f, h]),
    2,048 split over tp ([h, 2f/2] then [f/2, h]); the model FLOPs of a step are the same."""
    folded, split = gemm.layer_gemms(_setup(FOLD)), gemm.layer_gemms(_setup())
    experts = E // 8
    assert [(g.rows, g.inner, g.cols, g.count) for g in folded if g.count == experts] == [
        (1024, H, 2 * F, experts),
        (1024, F, H, experts),
    ]
    assert [(g.rows, g.inner, g.cols, g.count) for g in split if g.count == experts] == [
        (2048, H, F, experts),
        (2048, F // 2, H, experts),
    ]
    assert _run(FOLD)["time"]["model_flops_per_step"] == _run()["time"]["model_flops_per_step"]


def test_dispatch_moves_the_ranks_own_tokens_and_its_experts_slots() -> None:
    """TE's fused permute and unpermute on the rank's own tokens and their slots, 2·(T/2 + S/2)·h·e both
    layouts; the two chunk sorts on the slots its experts take, 2·2·S_rank·h·e: S/2 folded, S split."""
    e = 2
    permute = 2 * (OWN + OWN * K) * H * e
    assert dispatch(_setup(FOLD))[0] == permute + 4 * FOLDED_SLOTS * H * e == 419_430_400
    assert dispatch(_setup())[0] == permute + 4 * GATHERED_SLOTS * H * e == 687_865_856


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ("--etp 1 --impl reference", "etp: --etp 1 with --tp 2 (MoE parallel folding) is Megatron-core's"),
        ("--etp 3", "etp: expert tensor parallelism splits the experts over a divisor of --tp 2"),
        ("--etp 0", "etp: must be greater than 0, got 0 (use --etp 1 (parallel folding) or drop --etp"),
        ("--etp 1 --ep 32", "ep: with --etp 1 expert parallelism takes its 32 ranks from tp/etp × dp = 16"),
    ],
)
def test_folding_refusals_are_one_line(extra: str, field: str) -> None:
    r = runner.invoke(app, [*(ARGV + " " + extra).split()])
    assert r.exit_code == 2 and field in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_folding_needs_sp_and_a_routed_only_mixture() -> None:
    """Megatron runs a mixture of experts under tp with sp; parallel folding is modelled for routed
    experts alone, without cp: each a one-line refusal naming --etp's field."""
    argv = ARGV.replace(" --sp", "")
    r = runner.invoke(app, [*(argv + " " + FOLD).split()])
    assert r.exit_code == 2 and "etp: Megatron runs a mixture of experts under tensor parallelism" in r.stderr
    dense = "estimate -m llama-3.1-8b --seq 4096 --gpus 16 --impl megatron --tp 2 --sp --etp 1"
    r = runner.invoke(app, dense.split())
    assert r.exit_code == 2 and "etp: llama-3.1-8b is dense" in r.stderr
    shared = "estimate -m qwen1.5-moe-a2.7b --seq 4096 --gpus 16 --impl megatron --tp 2 --sp --etp 1"
    r = runner.invoke(app, shared.split())
    assert r.exit_code == 2 and "etp: parallel folding is modelled for models whose every MLP" in r.stderr
    r = runner.invoke(app, [*(ARGV + " --cp 2 " + FOLD).split()])
    assert r.exit_code == 2 and "etp: parallel folding with context parallelism" in r.stderr


def test_fit_searches_folded_layouts_and_their_commands_reproduce_them() -> None:
    """Under Megatron with tp > 1 ``fit`` tries parallel folding beside ep from dp (search.space.layouts):
    a folded row says ``etp 1`` in its JSON and ``--etp 1`` in its command, which reproduces its step time
    and peak."""
    argv = (
        "fit -m qwen3-30b-a3b --seq 4096 --gpus 16 --gpu h100-sxm --impl megatron --global-batch 128 "
        "--top 40 --micro-batches 1 --checkpointing none --attention flash --json"
    )
    r = runner.invoke(app, argv.split())
    assert r.exit_code == 0, r.stderr
    configs = json.loads(r.stdout)["configs"]
    folded = [c for c in configs if c["settings"]["tp"] > 1 and c["settings"]["etp"] == 1]
    assert folded and all(c["settings"]["etp"] == c["settings"]["tp"] for c in configs if c not in folded)
    c = folded[0]
    assert f"--tp {c['settings']['tp']} --sp" in c["command"] and "--etp 1" in c["command"]
    again = runner.invoke(app, [*c["command"].removeprefix("memplan ").split(), "--json"])
    assert again.exit_code == 0, again.stderr
    out = json.loads(again.stdout)
    assert out["time"]["step_time_s"] == c["time"]["step_time_s"]
    assert out["memory"]["peak"] == c["memory"]["peak"]


def test_the_bounds_prune_no_folded_row() -> None:
    """The bound charges a folded layer's one pair of sequence-parallel collectives, not two
    (``search.bound.tp_layer_seconds``): with pruning on, the ``keep`` fastest rows are those of the search
    that prunes nothing, folded rows among them."""
    import dataclasses

    from memplan.api import build_setup
    from memplan.config import Attention, Checkpointing, Impl, ImplConfig
    from memplan.presets import load_gpu
    from memplan.search.fit import Space, estimate_command, fit

    base = build_setup("qwen3-30b-a3b", seq=4096, impl=ImplConfig(impl=Impl.MEGATRON))
    h100 = load_gpu("h100-sxm")
    space = Space(
        checkpointing=(Checkpointing.NONE, Checkpointing.FULL), attention=(Attention.FLASH,),
        micro_batches=(1,), tp_max=4, cp_max=1, vpp=(1,), hsdp=False, keep=6,
    )  # fmt: skip
    pruned = fit(base, h100, 16, global_batch=64, space=space, max_seq=False)
    full = fit(base, h100, 16, global_batch=64, space=dataclasses.replace(space, keep=0), max_seq=False)
    assert pruned.pruned > 0 and full.pruned == 0
    rows = [(estimate_command(c, pruned), c.timing.step_time_s) for c in pruned.fitting[: space.keep]]
    assert rows == [(estimate_command(c, full), c.timing.step_time_s) for c in full.fitting[: space.keep]]
    assert any("--etp 1" in command for command, _ in rows)


def test_userbuffers_overlap_the_attentions_linears_of_a_folded_layer() -> None:
    """``--tp-comm-overlap`` under parallel folding (time.tp_overlap.shares): the MoE layer has no
    sequence-parallel collective, so W_QKV (column) and W_O (row) alone hide them, their shares of the
    layer's FLOPs by hand — per token (a + 2·kv)·d = 5,120 and a·d = 4,096 columns against those, the
    router's E = 128 and k = 8 whole SwiGLU experts' 3·f = 2,304 each; the layers' forward all-gathers hide
    behind W_QKV, the MoE's count none (48 + the head's, a micro-batch). With the experts split over tp it
    stays refused in one line."""
    from memplan.time import tp_overlap

    total = 5120 + 4096 + E + K * 3 * F
    assert tp_overlap.shares(_setup(FOLD)) == (T * 5120 / (T * total), T * 4096 / (T * total))
    out = _run(FOLD + " --tp-comm-overlap")
    n = 128 // 8
    rows = {r["what"]: r["count"] for r in _rows(out, "tp") if r["phase"] == "forward"}
    assert rows["sequence → linear inputs ‖ GEMM (userbuffers)"] == L * n  # the layers' W_QKV inputs
    assert rows["sequence → linear inputs"] == n  # the head's, Megatron's own: exposed
    r = runner.invoke(app, [*(ARGV + " --tp-comm-overlap").split()])
    assert r.exit_code == 2 and "modelled under parallel folding (--etp 1)" in r.stderr


def test_the_verdict_names_folding_where_the_experts_are_split_over_tp() -> None:
    """Megatron with tp > 1 and the experts split over tp (no --etp): a note names --etp 1, with the folded
    layout's peak as its own estimate gives it; none once folded."""
    split, folded = _run(), _run(FOLD)
    note = [n for n in split["notes"] if n.startswith("etp: ")]
    assert len(note) == 1 and "--etp 1" in note[0]
    assert note[0].endswith(f"the peak {folded['memory']['peak'] / 2**30:.2f} GiB here")
    assert not [n for n in folded["notes"] if n.startswith("etp: ")]


def test_experts_split_over_part_of_tp_gather_over_their_own_ranks() -> None:
    """tp 4 with --etp 2 on 16 GPUs (dp 4): each rank routes its own T/4 tokens; the dispatched slots are
    gathered over its 2 expert tensor-parallel ranks (consecutive: one node), S·2/4 = 16,384 slots a rank
    on 32 local experts of f/2; ep 4 drawn from tp/etp × dp = 8 ranks at stride etp (one node), the
    experts' data-parallel group the other 2, 8 ranks apart (two nodes). Parameters by hand: the attention
    and vocabulary over 4, the router and norms whole, 32 experts at half width."""
    argv = ARGV.replace("--tp 2", "--tp 4").replace("--ep 8", "--ep 4") + " --etp 2"
    out = runner.invoke(app, argv.split())
    assert out.exit_code == 0, out.stderr
    d = json.loads(out.stdout)
    attention = (H * (32 * 128 + 2 * 4 * 128) + 32 * 128 * H) // 4
    experts = 32 * 3 * H * F // 2
    dense = 2 * (V // 4) * H + L * (attention + 2 * H + 2 * 128 + H * E) + H
    assert d["params"]["device"] == dense + L * experts == 4_018_747_392
    saves = _tensors(d)
    assert saves["moe.expert_input"] == ([FOLDED_SLOTS, H], "bf16")
    assert saves["moe.fc1"] == ([FOLDED_SLOTS, 2 * F // 2], "bf16")
    assert saves["moe.routing_map"] == ([T // 4, E], "bool")
    rows = {(r["dimension"], r["what"], r["phase"]): r for r in d["time"]["communication"]}
    gather = rows[("tp", "dispatched slots → experts", "forward")]
    assert (gather["bytes"], gather["group"], gather["link"]) == (FOLDED_SLOTS * H * 2, 2, "intra-node")
    a2a = rows[("ep", "tokens ⇄", "forward")]
    assert (a2a["bytes"], a2a["group"], a2a["link"]) == (T // 4 * K * H * 2, 4, "intra-node")
    grads = rows[("dp experts", "gradients", "step")]
    assert (grads["group"], grads["link"]) == (2, "inter-node")
