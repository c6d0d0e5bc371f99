"""``time.compute.layer_rates``: the per-layer rates ``kernel_times`` charges, memoised on the pieces
(``Pieces.rates``), are those of every setup that shares the pieces — other pipeline layouts, ZeRO stages,
dp and micro-batches per step. A setup's kernel times read from rates another setup made equal those
made afresh, field by field, over setups of every rate's branch (eager and flash attention, full and
selective checkpointing, sequence and context parallelism, an MoE, QLoRA's dequantisation, fp8)."""

from __future__ import annotations

import pytest

from memplan.api import build_setup
from memplan.config import AttentionChoice, Impl, ImplConfig, Method, Parallel, ZeroStage
from memplan.config.finetune import FineTune
from memplan.config.impl import Fp8Recipe
from memplan.engine import estimate
from memplan.presets import load_gpu
from memplan.time.comm.rows import critical_stage
from memplan.time.compute import kernel_times
from memplan.time.timing import peak_flops

H100 = load_gpu("h100-sxm")

SETUPS = [
    # (model, seq, options of build_setup) of the first setup; the other differs in fields no rate reads
    ("gpt2", 1024, {"dp": 8, "grad_accum": 4, "attention": AttentionChoice.EAGER}),
    ("llama-3.2-1b", 2048, {"dp": 4, "checkpointing": "full", "parallel": Parallel(tp=2, sp=True)}),
    ("qwen3-0.6b", 8192, {"dp": 4, "checkpointing": "selective", "parallel": Parallel(cp=2), "batch": 2}),
    ("mixtral-8x7b", 4096, {"dp": 8, "parallel": Parallel(tp=2, ep=4)}),
    ("llama-3.2-1b", 2048, {"dp": 4, "finetune": FineTune(method=Method.QLORA)}),
    ("llama-3.2-1b", 2048, {"dp": 8, "impl": ImplConfig(impl=Impl.TORCHTITAN, fp8=Fp8Recipe.TENSORWISE)}),
]


@pytest.mark.parametrize(("name", "seq", "options"), SETUPS)
def test_rates_made_for_another_layout_are_the_setups_own(name: str, seq: int, options: dict) -> None:
    first = build_setup(name, seq=seq, **options)
    lora = first.finetune.method is not Method.FULL  # fine-tuning: data parallelism only
    layout = first.parallel if lora else first.parallel.model_copy(update={"pp": 2})
    other = first.model_copy(
        update={
            "parallel": layout,
            "strategy": first.strategy.model_copy(update={"zero": ZeroStage.PARAMETERS, "dp": 16}),
            "training": first.training.model_copy(update={"grad_accum": 8}),
        }
    )
    peak = peak_flops(H100, first.training.precision)
    made = kernel_times(critical_stage(estimate(first)), H100, peak)  # the memo made here
    r = estimate(other)
    assert r.pieces is estimate(first).pieces  # the same pieces: the other setup reads the first's rates
    c = critical_stage(r)
    memoised = kernel_times(c, H100, peak)
    r.pieces.rates.clear()
    assert memoised == kernel_times(c, H100, peak)  # afresh
    assert made == kernel_times(critical_stage(estimate(first)), H100, peak)
