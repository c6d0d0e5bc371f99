"""``--impl torchtitan --compile`` on a tensor- or data-parallel rank (issue #22 item 4): each block of the
rank runs through AOTAutograd's min-cut partitioner as DTensor code on torch's fake process group
(``measure.distributed.titan_compiled.compiled_blocks``), and its saves equal the estimate's compiled
rules (``Profile.compiled_block``) on the rank's shards; without sequence parallelism also what W_O's
backward gathers in the compiled forward."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from memplan.blocks.profiles import compile_modelled, compile_note
from memplan.cli.app import app
from memplan.config import Impl, Setup
from memplan.engine import estimate
from tests.hf.harness import estimated_layers, hf_setup, titan_rank
from tests.hf.test_torchtitan_ranks import ranked

pytestmark = pytest.mark.xdist_group("titan_compile_tp")  # one worker traces each rank once (``titan_rank``)


def compiled_rank(preset: str, seq: int, tp: int, sp: bool, dp: int = 1, zero: int = 0) -> Setup:
    return ranked(hf_setup(preset, seq=seq, impl=Impl.TORCHTITAN), tp, sp, dp, zero, compile=True)


@pytest.mark.parametrize(
    ("preset", "seq", "tp"),
    [("tiny", 64, 1), ("llama-3.1-405b", 8192, 8)],
    ids=["tiny-dp2", "405b-tp8-sp-dp2"],
)
def test_compiled_rank_saves_what_the_estimate_says(preset: str, seq: int, tp: int) -> None:
    """A rank over dp 2 under ZeRO-3 (FSDP2 gathers each block's parameters around its compiled call): the
    tiny model, and Llama 3.1 405B's widths at s 8,192 on tp 8 + SP (two layers: 1,007,165,440 B each)."""
    setup = compiled_rank(preset, seq, tp, tp > 1, 2, 3)
    assert compile_modelled(setup) and compile_note(setup) is None
    est, run = estimate(setup), titan_rank(setup)
    assert estimated_layers(est) == [run.measured.layer_bytes(i) for i in range(2)]
    assert est.activations == run.measured.activations


def test_the_partitioners_choice_on_a_sequence_parallel_rank_by_hand() -> None:
    """Llama 3 8B's widths on tp 2 + SP, b 1, s 256 (a/t = 16 heads, kv/t = 4, f/t = 7168, h 4096), bf16:
    each norm keeps its bf16 input on the rank's sequence shard [b, s/t, h] and the fp32 rstd (before the
    MLP the input is W_O's reduce-scattered output, standing for the residual sum), the gathered normalised
    inputs of W_QKV and W1/W3 [b·s, h], q, k and v after RoPE, the flash output (W_O's input, one storage)
    and lse, the rotary cache's conjugate, and gate, up and their product — the eager plan's fp32 upcasts,
    normalised shards and silu(g) recomputed in backward."""
    setup = compiled_rank("llama-3-8b", 256, 2, True)
    assert compile_modelled(setup)
    est, run = estimate(setup), titan_rank(setup)
    assert estimated_layers(est) == [run.measured.layer_bytes(i) for i in range(2)]
    assert est.activations == run.measured.activations
    b, s, h, t, d = 1, 256, 4096, 2, 128
    norms = 2 * (b * (s // t) * h * 2 + b * (s // t) * 4)
    gathered = 2 * b * s * h * 2
    attn = b * s * (d // 2) * 8 + (16 + 4 + 4 + 16) * b * s * d * 2 + 16 * b * s * 4  # rope, q k v out, lse
    mlp = 3 * b * s * 7168 * 2
    assert run.measured.layer_bytes(0) == norms + gathered + attn + mlp == 20_071_424
    eager = ranked(hf_setup("llama-3-8b", seq=256, impl=Impl.TORCHTITAN), 2, True)
    # what compile drops per layer: each norm's fp32 x and x·rstd on the shard (it keeps the bf16 x
    # instead) and silu(g) [b·s, f/t]
    dropped = 2 * (2 * b * (s // t) * h * 4 - b * (s // t) * h * 2) + b * s * 7168 * 2
    assert estimated_layers(estimate(eager))[0] - run.measured.layer_bytes(0) == dropped


@pytest.mark.parametrize(
    ("preset", "seq", "h", "f", "weight"),
    [("tiny", 64, 64, 128, True), ("llama-3-8b", 256, 4096, 14336, False)],
    ids=["tiny", "8b"],
)
def test_without_sequence_parallelism_w_os_backward_gathers_in_the_forward(
    preset: str, seq: int, h: int, f: int, weight: bool
) -> None:
    """tp 2 without SP (a·d = h): DTensor's cost-picked strategies for W_O's backward all-gather its input
    [T, a·d] (the weight gradient left ``Partial``) and, on the tiny model, where all-gathering [h, a·d]
    costs less than all-reducing the [T, h] output gradient, its weight; in the joint graph those gathers
    run in the forward and are saved (``activations.compiled_tp_gathers``). W2's weight gradient is the
    shard (its output gradient traced ``Replicate``), where eager leaves the tiny model's ``Partial``."""
    setup = compiled_rank(preset, seq, 2, False)
    assert compile_modelled(setup) and compile_note(setup) is None
    est, run = estimate(setup), titan_rank(setup)
    assert estimated_layers(est) == [run.measured.layer_bytes(i) for i in range(2)]
    assert est.activations == run.measured.activations
    assert est.device.states.gradients == run.grad_bytes
    with_sp = compiled_rank(preset, seq, 2, True)
    t, e = seq, 2
    # beside the SP rank's compiled saves: the norms' inputs and rstd whole (s, not s/2), the gathers
    norms = 2 * (t * h * e + t * 4) - 2 * ((t // 2) * h * e + (t // 2) * 4)
    gathered = t * h * e + (h * h * e if weight else 0)
    assert estimated_layers(est)[0] - estimated_layers(estimate(with_sp))[0] == norms + gathered
    eager = setup.model_copy(update={"impl": setup.impl.model_copy(update={"compile": False})})
    # the eager rank's W2 gradients Partial where whole (the tiny model: f ≤ 2h), 1/2 · h·f more a layer
    w2 = 2 * (h * f // 2) * e if preset == "tiny" else 0
    assert estimate(eager).device.states.gradients - est.device.states.gradients == w2


def test_compile_over_ranks_under_selective_ac_is_refused_in_one_line() -> None:
    runner = CliRunner(env={"COLUMNS": "120", "NO_COLOR": "1"})
    args = ["trace", "-m", "tiny", "--seq", "64", "--impl", "torchtitan", "--tp", "2", "--compile"]
    bad = runner.invoke(app, [*args, "--sp", "--checkpointing", "selective"])
    assert bad.exit_code == 2 and len(bad.output.strip().splitlines()) == 1, bad.output
    ok = runner.invoke(app, args)
    assert ok.exit_code == 0, ok.output
