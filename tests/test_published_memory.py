"""Published runs that trained on 80 GB GPUs (benchmarks/published_memory.py, docs/published-memory.md): the
ones memplan expresses as the code that ran are not called "does not fit", and each "does not fit" of a
configuration typed otherwise is explained, by hand, by the op where those options differ from that code.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.published_memory import CASES, DOC, END, START, Case, built, markdown

MIB = 2**20


LLAMA_OVER = (
    "Llama-2-13B (2024 torchtitan) is called 'does not fit' by 333 MiB once FSDP2's all-gather stream "
    "(1,232 MiB) is judged: reserved 80,010 + context 723 + NCCL 288 + stream 1,232 MiB > 81,920 MiB; the "
    "term memplan counts too high is not found yet (docs/published-memory.md)"
)


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=LLAMA_OVER))
        if c.name.startswith("Llama-2-13B")
        else c
        for c in CASES
        if c.ran_code
    ],
    ids=lambda c: c.name,
)
def test_runs_expressed_as_the_code_that_ran_fit(case: Case) -> None:
    v = built(case).verdict
    assert v is not None and v.fits, case.name


def test_llama2_13b_misses_by_the_stream_less_its_headroom() -> None:
    """The gap, by hand (MiB): judged without the stream the run had 81,920 − 723 − 288 − 80,010 = 899
    to spare (the replay's reserved peak 80,010); the stream's 1,232 (tests/test_fsdp_buffers.py) takes
    it to 899 − 1,232 = −333."""
    v = built(CASES[0]).verdict
    assert v is not None and v.reserved_peak == 80_010 * MIB
    assert v.fsdp_all_gather_stream == 1_232 * MIB
    assert v.headroom == (81_920 - 723 - 288 - 80_010 - 1_232) * MIB == -333 * MIB


def test_llama2_13b_torchtitan_0_3_differs_by_its_norm_and_rope_cache() -> None:
    """--impl torchtitan (0.3.0: nn.RMSNorm, whose decomposition keeps the normalised x in fp32, and a
    complex64 RoPE cache per layer) against the 2024 torchtitan that ran (norms.py's RMSNorm:
    ``self._norm(x.float()).type_as(x) * weight`` keeps the normalised x in bf16 — memplan's reference).
    By hand: 2L + 1 = 81 norms × b·s·h × (4 − 2) B, plus L = 40 caches [s, d/2] complex64 (8 B), less the
    reference's shared cos and sin [s, d] bf16, plus torchtitan's int64 token count (8 B)."""
    ran, titan = (built(c).result for c in CASES[:2])
    b, s, h, layers, d = 2, 4096, 5120, 40, 128
    by_hand = (2 * layers + 1) * b * s * h * (4 - 2) + layers * s * (d // 2) * 8 - 2 * s * d * 2 + 8
    assert titan.activations - ran.activations == by_hand
    # At the loss's backward (both peaks) the reference holds its largest gathered unit, a layer's bf16
    # weights: 2 norms [5120] + q, k, v, o [5120, 5120] + gate, up [13824, 5120] + down [5120, 13824] =
    # 317,204,480 el; torchtitan's ZeRO-3 ("default": [norm, lm_head] not resharded after forward) the
    # head unit: [5120] + [32000, 5120] = 163,845,120 el (over 64 ranks no dim 0 is padded).
    moment = "loss backward"
    held = 2 * 163_845_120 - 2 * 317_204_480
    # And the states: torchtitan's FSDP2 mixed precision holds fp32 shards (4 B) and no master copy where
    # the reference's bf16-mixed holds bf16 shards (2 B) and an fp32 master (4 B): 2 B less per shard
    # element, gradients not yet made. Ψ = 40 × 317,204,480 + 2 × 32,000 × 5,120 + 5,120 =
    # 13,015,864,320; every dim 0 divisible by 64: 203,372,880 elements per rank.
    states = -2 * (40 * 317_204_480 + 2 * 32_000 * 5_120 + 5_120) // 64
    assert titan.peak.phases[moment] - ran.peak.phases[moment] == by_hand + held + states


def test_mpt_760m_default_loss_differs_by_its_fp32_vocabulary_tensors() -> None:
    """memplan's standard loss keeps the fp32 log-probs [T, v] (+ nll_loss's fp32 total weight) and makes
    two fp32 [T, v] gradients in the loss backward; flash_attn's kernel, what ran (ComposerMPTCausalLM's
    default ``loss_fn: fused_crossentropy``), keeps the bf16 logits [T, v], the fp32 lse [T] and an int64
    count, and writes one bf16 [T, v] gradient. At the loss-backward moment, by hand:
    (4·T·v + 4 − 2·T·v − 4·T − 8) + (8·T·v − 2·T·v) = 8·T·v − 4·T − 4, T = 24 × 2048, v = 50,368."""
    ran, standard = (built(c) for c in CASES if c.name.startswith(("MPT-760M", "same, typed with")))
    tokens, vocab = 24 * 2048, 50368
    by_hand = 8 * tokens * vocab - 4 * tokens - 4
    moment = "loss backward"
    assert standard.result.peak.phases[moment] - ran.result.peak.phases[moment] == by_hand
    assert standard.verdict is not None and not standard.verdict.fits


def test_the_doc_holds_this_table() -> None:
    text = Path(DOC).read_text(encoding="utf-8")
    assert text.split(START + "\n", 1)[1].split(END, 1)[0] == markdown()
