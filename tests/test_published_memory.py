"""Published runs that trained on 80 GB GPUs (benchmarks/published_memory.py, docs/published-memory.md): the
one memplan can express as the code that ran is not called "does not fit", and each "does not fit" of a
configuration typed otherwise is explained, by hand, by the op where memplan's options differ from that code.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.published_memory import CASES, DOC, END, START, built, markdown

GIB = 2**30


def test_runs_expressed_as_the_code_that_ran_fit() -> None:
    for case in CASES:
        if case.ran_code:
            v = built(case).verdict
            assert v is not None and v.fits, case.name


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


def test_mpt_760m_overflow_is_the_standard_losss_fp32_vocabulary_tensors() -> None:
    """memplan's standard loss keeps the fp32 log-probs [T, v] and, in the loss backward, nll_loss's and
    log_softmax's fp32 [T, v] gradients beside them: 3 × 4·T·v bytes. What ran, flash_attn's fused
    cross-entropy (ComposerMPTCausalLM's default ``loss_fn: fused_crossentropy``), keeps the bf16 logits
    and writes a bf16 gradient of them: 2 × 2·T·v. T = 24 × 2048 tokens, v = 50,368. That difference,
    8·T·v = 18.4 GiB, is more than the overflow (the reserved peak with the CUDA context over the device)."""
    (case,) = [c for c in CASES if c.name.startswith("MPT-760M")]
    v = built(case).verdict
    assert v is not None and v.reserved_peak is not None and not v.fits
    tokens, vocab = 24 * 2048, 50368
    difference = 3 * 4 * tokens * vocab - 2 * 2 * tokens * vocab
    assert difference == 8 * tokens * vocab
    overflow = v.reserved_peak + v.cuda_context - v.device_bytes
    assert 0 < overflow < difference


def test_the_doc_holds_this_table() -> None:
    text = Path(DOC).read_text(encoding="utf-8")
    assert text.split(START + "\n", 1)[1].split(END, 1)[0] == markdown()
