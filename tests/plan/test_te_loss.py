"""``--loss te``: Transformer Engine's ``parallel_cross_entropy`` as Megatron runs it (blocks/head.py
``te_rules``; transformer_engine/pytorch/cross_entropy.py and triton/cross_entropy.py) — the 16-bit logits
kept and overwritten by their gradient, no fp32 [T, v] — by hand against Megatron's vocabulary-parallel
cross entropy, with its refusals."""

from __future__ import annotations

import json
from typing import Any

import pytest
from typer.testing import CliRunner

from memplan.cli.app import app

runner = CliRunner()

T, H, V = 4096, 4096, 128_256  # Llama 3 8B at s 4,096, one micro-batch, tp 1


def _run(*extra: str) -> dict[str, Any]:
    argv = ["estimate", "-m", "llama-3-8b", "--seq", str(T), "--impl", "megatron", "--json", *extra]
    r = runner.invoke(app, argv)
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def _loss_saves(out: dict[str, Any]) -> dict[str, tuple[list[int], str]]:
    tensors = out["activations"]["tensors"]
    return {t["name"]: (t["shape"], t["dtype"]) for t in tensors if t["name"].startswith("loss.")}


def test_the_kernel_keeps_the_16_bit_logits_and_three_fp32_a_token_per_rank() -> None:
    """``ctx.save_for_backward(_input, target, m_d_X_y)``: the logits [T, v/t] as the output layer made them
    (bf16), the targets [T] int64, each tensor-parallel rank's max, sum and target logit (fp32, all-gathered:
    3·t a token); pretrain_gpt's loss mask [T] fp32. At tp 2 the rank's vocabulary shard is v/2."""
    assert _loss_saves(_run("--loss", "te")) == {
        "loss.logits": ([T, V], "bf16"),
        "loss.m_d_X_y": ([3 * T], "fp32"),
        "loss.target": ([T], "int64"),
        "loss.loss_mask": ([T], "fp32"),
    }
    tp2 = _loss_saves(_run("--loss", "te", "--tp", "2", "--sp", "--gpus", "2"))
    assert tp2["loss.logits"] == ([T, V // 2], "bf16") and tp2["loss.m_d_X_y"] == ([3 * 2 * T], "fp32")


def test_the_loss_backward_moment_by_hand() -> None:
    """Megatron's vocabulary-parallel loss keeps the fp32 softmax [T, v] (4Tv), a bool mask, the int64
    shifted targets and the fp32 loss mask (13T), and its backward makes two fp32 [T, v] (8Tv); TE's keeps
    2Tv + 24T and writes its gradient in place, the output layer's dX [T, h] in bf16 (2Th) the next
    allocation: 10Tv − 11T − 2Th lower at the loss's backward, everything else the same."""
    standard, te = _run()["memory"]["phases"], _run("--loss", "te")["memory"]["phases"]
    assert standard["loss backward"] - te["loss backward"] == 10 * T * V - 11 * T - 2 * T * H
    assert standard["layer backward"] == te["layer backward"]


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        (["--impl", "reference"], "Transformer Engine's fused cross entropy as Megatron runs it"),
        (["--impl", "megatron", "--offload", "optimizer"], "--loss te is modelled without offload"),
    ],
)
def test_refused_where_not_modelled_in_one_line(extra: list[str], why: str) -> None:
    r = runner.invoke(app, ["estimate", "-m", "llama-3-8b", "--loss", "te", *extra])
    assert r.exit_code == 2 and r.stderr.startswith("error: loss:") and why in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_the_verdict_names_the_loss_megatron_bridge_runs() -> None:
    """Under --impl megatron the standard loss is Megatron-LM's own; the verdict's note names --loss te, and
    says nothing once it is given (nor under the reference)."""
    said = [n for n in _run()["notes"] if n.startswith("loss:")]
    assert len(said) == 1 and "--loss te" in said[0]
    assert not [n for n in _run("--loss", "te")["notes"] if n.startswith("loss:")]
    r = runner.invoke(app, ["estimate", "-m", "llama-3-8b", "--seq", str(T), "--json"])
    assert not [n for n in json.loads(r.stdout)["notes"] if n.startswith("loss:")]
