"""Published training runs, predicted from their configuration alone: the table of docs/step-time.md.

``python -m memplan.time.published`` prints the table; tests/plan/test_published.py checks that the docs
hold exactly this output. Each run is built from what its paper states (model shape, precision, layout,
batch, recompute, GPU); nothing of the measured result goes in. The metric is the paper's own:
Korthikanti et al. 2022 Table 5 reports seconds per iteration; Narayanan et al. 2021 TFLOP/s per GPU
counted with their formula F = 96·B·s·l·h²·(1 + s/(6h) + V/(16lh)) (full recompute included); Llama 3
(Dubey et al. 2024, Table 4) TFLOP/s per GPU of model FLOPs (BF16 MFU × 989 TFLOP/s).

Readings of the papers (stated, not fitted):
- Korthikanti Table 5 and Narayanan: GPT layout (LayerNorm, GELU MLP 4h, biases, learned positions,
  dropout 0.1), v 51200, s 2048, fp16 mixed precision, Megatron-LM's code (``impl=megatron``: its fused
  scale-mask-softmax, eager attention — no flash kernel in 2021–22 —, its fused QKV and kernels; typed
  as memplan's reference code before its eager core was counted op by op), micro-batch 1, plain 1F1B;
  Korthikanti with sequence parallelism and selective recompute, Narayanan with full recompute and no
  sequence parallelism. Megatron's optimizer is Apex's ``FusedAdam`` (``megatron/optimizer/__init__.py``:
  ``from apex.optimizers import FusedAdam as Adam``):
  typed ``optimizer_impl=fused``, one kernel over the fp32 master (``time.optimizer``), with Megatron's
  passes around it under fp16 (``time.optimizer.framework_ops``: the fp16 → fp32 gradient copy, the loss
  scaler's unscale, the fp32 → fp16 weight copy, 20 bytes a parameter, and the gradient buffer zeroed).
- Llama 3 405B (§3.3.2, Table 4): the llama-3.1-405b preset, bf16, s 8192, 16M tokens per step (2,048
  sequences), micro-batch 1, TP 8 with sequence parallelism, PP 16 (126 layers, first and last stage one
  fewer), flash attention, no recompute, FSDP that does not reshard weights after the forward (ZeRO 2:
  gradients and optimizer sharded, weights gathered once per step), the interleaved schedule with one
  layer per model chunk: 8 chunks per rank, the first rank's first chunk the embedding alone and the last
  rank's last chunk the head alone (``LLAMA_VIRTUAL_STAGES``); gradients reduce-scattered in fp32
  (``--reduce-dtype fp32``; §3.3.2, "Numerical stability": "we use FP32 gradient accumulation during
  backward computation over multiple micro-batches and also reduce-scatter gradients in FP32 across data
  parallel workers in FSDP").
"""

from __future__ import annotations

from dataclasses import dataclass

from memplan.config import (
    Attention,
    Checkpointing,
    CpRotate,
    Impl,
    ImplConfig,
    MlpType,
    ModelConfig,
    NormType,
    OptimizerImpl,
    Parallel,
    PositionType,
    Precision,
    ReduceDtype,
    Setup,
    StrategyConfig,
    TrainingConfig,
    ZeroStage,
)
from memplan.engine import estimate
from memplan.presets import load_gpu, load_model_preset
from memplan.time.timing import Timing, timing

GPT_SEQ, GPT_VOCAB = 2048, 51200
LLAMA_VIRTUAL_STAGES = (0, *[1] * 126, 0)
"""Llama 3 405B's 128 virtual stages (16 ranks × 8 chunks, model order): one layer each, the first chunk
the embedding alone and the last the head alone (Dubey et al. 2024 §3.3.2)."""


@dataclass(frozen=True)
class Run:
    """One published run: how to build it, what was published and in which unit."""

    name: str
    source: str
    setup: Setup
    parallel: Parallel
    gpu: str
    published: float
    unit: str
    """``s`` (seconds per iteration) or ``TFLOP/s`` (per GPU)."""


def gpt(h: int, heads: int, layers: int, vocab: int = GPT_VOCAB) -> ModelConfig:
    """The GPT layout Megatron's papers train (module docstring)."""
    return ModelConfig(
        name=f"gpt-h{h}-l{layers}",
        hidden_size=h,
        num_layers=layers,
        num_heads=heads,
        vocab_size=vocab,
        norm=NormType.LAYERNORM,
        mlp=MlpType.GELU,
        qkv_bias=True,
        out_bias=True,
        mlp_bias=True,
        position=PositionType.LEARNED,
        max_positions=GPT_SEQ,
        attn_dropout=0.1,
        resid_dropout=0.1,
    )


def _megatron(model: ModelConfig, checkpointing: Checkpointing, dp: int, micro_batches: int) -> Setup:
    return Setup(
        model=model,
        training=TrainingConfig(
            seq_len=GPT_SEQ,
            precision=Precision.FP16_MIXED,
            grad_accum=micro_batches,
            optimizer_impl=OptimizerImpl.FUSED,
        ),
        strategy=StrategyConfig(checkpointing=checkpointing, attention=Attention.EAGER, dp=dp),
        impl=ImplConfig(impl=Impl.MEGATRON),
    )


def _korthikanti(name: str, h: int, heads: int, layers: int, p: int, batch: int, seconds: float) -> Run:
    setup = _megatron(gpt(h, heads, layers), Checkpointing.SELECTIVE, 1, batch)
    return Run(name, "Korthikanti 2022 T5", setup, Parallel(tp=8, sp=True, pp=p), "a100-80gb", seconds, "s")


def _llama(dp: int, tflops: float, seq: int = 8192, cp: int = 1) -> Run:
    """16M tokens per step (2,048 sequences of 8,192; 128 of 131,072 in the long-context stage)."""
    setup = Setup(
        model=load_model_preset("llama-3.1-405b").model,
        training=TrainingConfig(
            seq_len=seq, precision=Precision.BF16_MIXED, grad_accum=(1 << 24) // seq // dp
        ),
        strategy=StrategyConfig(
            attention=Attention.FLASH, zero=ZeroStage.GRADIENTS, dp=dp, reduce_dtype=ReduceDtype.FP32
        ),
    )
    name = f"Llama 3 405B, {128 * cp * dp:,} GPUs" + (f", CP {cp}, s {seq:,}" if cp > 1 else "")
    # Llama 3's context parallelism all-gathers K/V and computes each local Q chunk against them (Dubey et
    # al. 2024 §3.3.2): --cp-rotate kv-gather, not torch's ring
    rotate = CpRotate.KV_GATHER if cp > 1 else CpRotate.ALLGATHER
    parallel = Parallel(tp=8, sp=True, pp=16, vpp=8, pp_layers=LLAMA_VIRTUAL_STAGES, cp=cp, cp_rotate=rotate)
    return Run(name, "Dubey 2024 T4", setup, parallel, "h100-sxm", tflops, "TFLOP/s")


RUNS: tuple[Run, ...] = (
    _korthikanti("22B, 8 GPUs", 6144, 64, 48, 1, 4, 1.10),
    _korthikanti("175B, 64 GPUs", 12288, 96, 96, 8, 64, 13.75),
    _korthikanti("530B, 280 GPUs", 20480, 128, 105, 35, 280, 37.83),
    _korthikanti("1T, 512 GPUs", 25600, 160, 128, 64, 512, 71.49),
    Run(
        "1T, 3,072 GPUs",
        "Narayanan 2021 T1",
        _megatron(gpt(25600, 160, 128), Checkpointing.FULL, 6, 512),
        Parallel(tp=8, pp=64),
        "a100-80gb",
        163,
        "TFLOP/s",
    ),
    _llama(64, 430),
    _llama(128, 400),
    _llama(8, 380, seq=131_072, cp=16),
)
PENDING: tuple[tuple[str, str, str, str], ...] = ()
"""Runs the table names but cannot predict yet: (name, source, published, why)."""


def predicted_timing(run: Run) -> Timing:
    setup = run.setup.model_copy(update={"parallel": run.parallel})
    return timing(estimate(setup), load_gpu(run.gpu))


def narayanan_flops(setup: Setup) -> int:
    """F = 96·B·s·l·h²·(1 + s/(6h) + V/(16lh)) per iteration (Narayanan et al. 2021 §5.1), B the global
    batch."""
    m, t = setup.model, setup.training
    b, s, layers, h = t.micro_batch * t.grad_accum * setup.strategy.dp, t.seq_len, m.num_layers, m.hidden_size
    return 96 * b * s * layers * h * h + 16 * b * s * s * layers * h + 6 * b * s * h * m.vocab_size


def metric(run: Run, seconds: float, t: Timing) -> float:
    """The run's published metric for a step of ``seconds``."""
    if run.unit == "s":
        return seconds
    if run.source.startswith("Narayanan"):
        return narayanan_flops(run.setup) / (seconds * t.devices) / 1e12
    return t.model_flops_per_step / (seconds * t.devices) / 1e12


def rows() -> list[tuple[str, ...]]:
    """The table: run, source, published, predicted, difference, and the prediction's parts."""
    out = []
    for run in RUNS:
        t = predicted_timing(run)
        pr = t.prediction
        got = metric(run, t.step_time_s, t)
        comm = ", ".join(f"{k} {v:.2f}" for k, v in pr.exposed_s.items() if v >= 0.005)
        cells = [
            run.name,
            run.source,
            f"{run.published:g} {run.unit}",
            f"{got:.2f} {run.unit}" if run.unit == "s" else f"{got:.0f} {run.unit}",
            f"{(got / run.published - 1):+.1%}",
            f"{pr.compute_s:.2f}",
            comm or "–",
            f"{pr.bubble_s:.2f}",
            f"{pr.optimizer_s:.2f}",
            f"{t.mfu:.1%}",
        ]
        out.append(tuple(cells))
    for name, source, published, why in PENDING:
        out.append((name, source, published, f"pending ({why})", "", "", "", "", "", ""))
    return out


HEADER = (
    "run",
    "source",
    "published",
    "predicted",
    "Δ",
    "compute s",
    "exposed comm s",
    "bubble s",
    "optimizer s",
    "MFU",
)


def markdown() -> str:
    """The table as docs/step-time.md holds it."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in rows()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # pragma: no cover
    print(markdown(), end="")
