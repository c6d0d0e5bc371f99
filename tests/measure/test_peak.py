"""Estimated peak vs every storage alive in real CPU training steps (``memplan profile``'s tracker).

The loss-, final-norm- and embedding-backward and optimizer-step moments are modelled exactly; the
layer-backward moment is an approximation whose measured accuracy analytic/peak.py states (and these
tests hold it to).

The optimizer step under ZeRO: a rank of a per-parameter dim-0 sharding (PyTorch FSDP2) steps only its
shards; analytic/peak.py (``largest_step_tensor``) models the largest, ⌈rows/dp⌉·cols elements. Emulated on
one CPU: rank 0's shards of the reference model's parameters, one real step, every storage tracked.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from layouts import PEAK_GPT, PEAK_LLAMA

from memplan.analytic.moments import layer_backward as lb
from memplan.analytic.params import count_params
from memplan.analytic.step import largest_step_tensor, optimizer_transient
from memplan.blocks.inventory import Dims
from memplan.config import (
    Attention,
    Device,
    LossKind,
    Method,
    ModelConfig,
    Setup,
    StrategyConfig,
    TrainingConfig,
    ZeroStage,
    parse_checkpointing,
    parse_targets,
)
from memplan.engine import estimate
from memplan.measure.instruments.tracker import OpLiveTracker
from memplan.measure.reference.model import Reference
from memplan.measure.reference.optim import rank_shards, step_transient
from memplan.measure.runs.profile import StepRunner, profile

LLAMA, GPT = PEAK_LLAMA, PEAK_GPT  # the benchmark's two models (benchmarks/bench_peak_accuracy.py)


def make(
    arch: dict[str, Any],
    vocab: int,
    attention: str = "flash",
    ckpt: str = "none",
    reversible: bool = False,
    precision: str = "bf16-mixed",
    optimizer: str = "adamw",
    b: int = 2,
    s: int = 64,
    accum: int = 1,
) -> Setup:
    mode, k = parse_checkpointing(ckpt)
    return Setup(
        model=ModelConfig(**arch, vocab_size=vocab, max_positions=512),
        training=TrainingConfig(
            micro_batch=b, seq_len=s, precision=precision, optimizer=optimizer, grad_accum=accum
        ),
        strategy=StrategyConfig(
            attention=Attention[attention.upper()],
            checkpointing=mode,
            checkpoint_every=k,
            reversible=reversible,
        ),
        device=Device.CPU,
    )


EXACT = [
    # Large vocabulary: the loss backward (two fp32 [T, v] gradients) is the peak.
    make(LLAMA, 4096),
    make(GPT, 4096, attention="eager", precision="fp32", optimizer="sgd-momentum"),
    make(LLAMA, 4096, ckpt="full", precision="fp16-mixed", optimizer="lion", accum=2),
    make(LLAMA, 4096, attention="eager", ckpt="selective", precision="bf16", optimizer="sgd"),
    make(GPT, 4096, reversible=True),
    # Small vocabulary, 16-bit: the final RMSNorm's fp32 backward pieces beside every layer's saves.
    make(LLAMA, 32, b=4, s=128),
    # Few tokens, many parameters: the optimizer step (or, tied, the embedding's gradient sum) is the peak.
    make(LLAMA, 4096, b=1, s=4, precision="bf16-mixed"),
    make(GPT, 4096, b=1, s=4, precision="fp32", optimizer="lion"),
    # Untied, no optimizer temporaries: the embedding's own backward, its [v, h] gradient made beside the
    # incoming [T, h] one (GPT: through the learned positions' and the embedding dropout's backward too).
    make(LLAMA, 4096, b=2, s=8, precision="fp32", optimizer="sgd"),
    make(dict(GPT, tied_embeddings=False), 4096, b=2, s=8, precision="fp32", optimizer="sgd"),
]


@pytest.mark.parametrize(
    "setup", EXACT, ids=lambda s: f"{s.model.norm.value}-{s.strategy.checkpointing.name}"
)
def test_loss_embedding_and_optimizer_moments_are_exact(setup: Setup) -> None:
    est = estimate(setup)
    assert est.peak.phase in ("loss backward", "final norm backward", "embedding backward", "optimizer step")
    p = profile(setup, steps=1)
    assert p.phase_peaks["optimizer step"] == est.peak.phases["optimizer step"]
    if est.peak.phase == "loss backward":
        assert p.phase_peaks["backward"] == est.peak.phases["loss backward"]
    assert p.peak == est.peak.bytes


LAYER_EXACT = [
    # Small vocabulary, more tokens: a layer's backward is the peak, its live set modelled to the byte.
    make(LLAMA, 32, precision="fp32", b=4, s=128),
    make(LLAMA, 32, attention="eager", precision="fp32", b=4, s=128),
    make(LLAMA, 32, ckpt="full", b=4, s=128),
    make(LLAMA, 32, attention="eager", ckpt="full", b=4, s=128),
    make(dict(GPT, resid_dropout=0.0, embd_dropout=0.0), 32, precision="fp32", b=4, s=128),
    # GPT with residual dropout: the down projection's backward (dropout's input gradient beside dY).
    make(GPT, 32, b=4, s=128),
    make(GPT, 32, attention="eager", ckpt="every-2", precision="fp32", b=4, s=128),
    # Every-2 of 5 layers, T 2048: a kept [T, h] input outweighs two layers' gradients, so the last full
    # segment's top (layer 3) is the peak, neither end nor the first segment's top.
    make(dict(LLAMA, num_layers=5, num_kv_heads=4), 32, ckpt="every-2", b=4, s=512),
    # A selectively checkpointed eager core re-run at its backward: the re-run softmax is the peak.
    make(LLAMA, 32, attention="eager", ckpt="selective", b=4, s=128),
    make(GPT, 32, attention="eager", ckpt="selective", b=4, s=128),
]


@pytest.mark.parametrize(
    "setup", LAYER_EXACT, ids=lambda s: f"{s.model.norm.value}-{s.strategy.attention.name}"
)
def test_layer_backward_moment_is_exact(setup: Setup) -> None:
    est = estimate(setup)
    assert est.peak.phase == "layer backward"
    p = profile(setup, steps=1)
    assert p.phase_peaks["backward"] == est.peak.phases["layer backward"]
    assert p.peak == est.peak.bytes


@pytest.mark.parametrize("arch", [LLAMA, GPT], ids=["llama", "gpt"])
def test_a_selective_cores_softmax_backward_sits_an_output_gradient_below_its_re_run(
    arch: dict[str, Any],
) -> None:
    """Live bytes after the re-run softmax and after its backward (the two moments of a selectively
    checkpointed eager core, ``layer_backward.selective_rerun_transient`` and ``selective_softmax_backward``):
    on CPU the second is the first less the core's output gradient, as the estimate's two terms differ."""
    setup = make(arch, 32, attention="eager", ckpt="selective", b=4, s=128)
    runner = StepRunner(setup, "cpu")
    mode = OpLiveTracker()
    with mode:
        mode.track([*runner.model.parameters(), *runner.batch])
        loss = runner.model(*runner.batch)
        forward = len(mode.rows)
        loss.backward()
    rows = mode.rows
    rerun = next(live for name, live in rows[forward:] if name == "aten._softmax.default")
    backward = next(live for name, live in rows[forward:] if name == "aten._softmax_backward_data.default")
    dims, params = Dims.of(setup), count_params(setup.model)
    moments = [f(setup, dims, params) for f in (lb.selective_rerun_transient, lb.selective_softmax_backward)]
    assert rerun - backward == moments[0] - moments[1] == dims.tokens * dims.a * dims.d * dims.act.bytes


# A later micro-batch sums its gradients into the earlier ones' (``blocks.profiles.accumulates_in_place``):
# a layer's own gradients are freed as their node ends, the lm head's new [v, h] comes beside the sums (a
# moment of its own with few tokens on a wide model), and a tied one waits for the embedding's.
ACCUMULATED = [
    make(LLAMA, 32, ckpt="full", b=4, s=128, accum=2),  # layer: W_down's gradient freed before SwiGLU's
    make(GPT, 32, b=4, s=128, accum=2),  # layer, tied: the lm head's gradient waits for the embedding's
    make(LLAMA, 32, precision="fp32", b=4, s=128, accum=3),  # the final norm's
    make(LLAMA, 4096, b=2, s=8, precision="fp32", optimizer="sgd", accum=2),  # the lm head's backward
    make(GPT, 4096, b=1, s=4, precision="fp32", optimizer="lion", accum=2),  # tied: three [v, h] at once
    # a selective layer's every rise is negative with its gradients summed: no moment holds its whole
    # working set (a 0 of the moments only other layers have had said one did: one [T, h] over)
    make(LLAMA, 32, attention="eager", ckpt="selective", precision="fp32", b=2, s=64, accum=2),
]


@pytest.mark.parametrize("setup", ACCUMULATED, ids=lambda s: f"{s.model.norm.value}-{s.training.grad_accum}")
def test_accumulated_micro_batches_peak_is_exact(setup: Setup) -> None:
    est = estimate(setup)
    assert est.peak.phase in (
        "layer backward",
        "lm head backward",
        "final norm backward",
        "embedding backward",
    )
    assert profile(setup, steps=1).peak == est.peak.bytes


def _lora(setup: Setup, targets: str = "q,v", dropout: float = 0.0) -> Setup:
    ft = setup.finetune.model_copy(
        update={"method": Method.LORA, "targets": parse_targets(targets), "dropout": dropout}
    )
    return setup.model_copy(update={"finetune": ft})


def _fused(setup: Setup) -> Setup:
    return Setup.model_validate({**setup.model_dump(), "loss": LossKind.FUSED})


def _chunked(setup: Setup, n: int) -> Setup:
    return Setup.model_validate({**setup.model_dump(), "loss": LossKind.CHUNKED, "loss_chunks": n})


# LoRA's peak (blocks/mlp.py ``frozen_mlp``): the frozen MLP's moment (no weight gradient made, no down input
# released), the layers' own saves (layer 0 keeps less: ``peak``'s ``layer_bytes``), the loop's ids beside
# a frozen embedding, no frozen head's or tied embedding's gradient.
WIDE = dict(LLAMA, hidden_size=1024, num_heads=8, num_kv_heads=2, ffn_size=3584)
"""A layer whose weights outweigh its activations at a short sequence (h 1,024, f 3,584, 16 tokens): the
frozen base makes no weight gradient. Charged its base weights' gradients (``blocks.profiles
.top_layer_grads``), the estimate put the peak at the layer's backward, 26,496,384 B (31 %) above the
step's measured 86,079,048 B."""
LORA_PEAKS = [
    _lora(make(WIDE, 256, b=1, s=16)),  # the final norm's, not a frozen layer's phantom weight gradients
    _lora(make(WIDE, 256, b=1, s=16), "q,k,v,o"),
    _lora(make(LLAMA, 32, b=4, s=128)),  # the final norm's
    _lora(make(LLAMA, 32, ckpt="full", b=4, s=128)),  # the layer's: the re-run beside the MLP's buffers
    _lora(make(LLAMA, 32, ckpt="full", b=4, s=128, accum=2)),
    _lora(make(GPT, 32, b=4, s=128)),  # the layer's, after the residual dropout's mask is consumed
    _lora(make(GPT, 32, ckpt="full", b=4, s=128, accum=2), "q,k,v,o"),  # tied: no pending head gradient
    _lora(make(GPT, 32, attention="eager", b=2, s=64), dropout=0.1),
    # Liger's fused loss with a frozen head (dL/dX alone kept); the final norm's moment holds the seed
    # gradient beside the loss scalar (no nll_loss total_weight stands in for it)
    _fused(_lora(make(LLAMA, 32, b=4, s=128))),
    _fused(_lora(make(LLAMA, 4096, b=4, s=128))),
    _fused(_lora(make(GPT, 32, ckpt="full", b=4, s=128, accum=2), "q,k,v,o")),
    _fused(make(LLAMA, 32, b=4, s=128)),  # full training: its dL/dW kept, the head's gradient
]


# torchtune's chunked loss (its LoRA recipes' default): every phase's highest point. The loss's forward
# holds the final norm's output, which a frozen head's chunks do not save; by the final norm's backward
# each chunk's normaliser, its labels copy (b > 1) and the count are freed, the seed gradient held.
CHUNKED_PHASES = [
    _chunked(_lora(make(LLAMA, 32, b=4, s=128)), 4),  # the final norm's
    _chunked(_lora(make(LLAMA, 4096, b=1, s=128)), 3),  # the loss's forward, its output held
    _chunked(_lora(make(GPT, 4096, ckpt="full", b=2, s=128, accum=2), "q,k,v,o"), 4),
    _chunked(make(LLAMA, 32, b=4, s=128), 4),  # full training: the final norm's, exact now too
]


@pytest.mark.parametrize(
    "setup",
    CHUNKED_PHASES,
    ids=lambda s: f"{s.finetune.method.name.lower()}-b{s.training.micro_batch}-v{s.model.vocab_size}",
)
def test_chunked_loss_phases_are_exact(setup: Setup) -> None:
    est = estimate(setup)
    measured = profile(setup, steps=1).phase_peaks
    forward = est.peak.moments.get("loss forward")
    backward = [m for name, m in est.peak.moments.items() if name not in ("loss forward", "optimizer step")]
    assert measured["backward"] == max(sum(m.values()) for m in backward)
    if forward is not None:  # one point of the forward phase: its highest where it is the step's peak
        assert measured["forward"] >= sum(forward.values())
        if est.peak.phase == "loss forward":
            assert measured["forward"] == sum(forward.values())
    assert max(measured.values()) == est.peak.bytes


@pytest.mark.parametrize(
    "setup",
    LORA_PEAKS,
    ids=lambda s: (
        f"{s.model.norm.value}-{s.strategy.checkpointing.value}-{s.training.grad_accum}-"
        f"{s.loss.name.lower()}-v{s.model.vocab_size}-{s.finetune.method.name.lower()}"
    ),
)
def test_lora_peak_is_exact(setup: Setup) -> None:
    est = estimate(setup)
    assert profile(setup, steps=1).peak == est.peak.bytes


# Where the layer-backward moment is not exact (analytic/peak.py: reversible layers; an eager core with
# attention dropout re-run by selective checkpointing): measured / estimated − 1, each within its
# measured error rounded outward to 0.1 %.
LAYER = [
    (make(LLAMA, 32, reversible=True, attention="eager", b=4, s=128), (-0.002, 0.0)),  # −0.16 %
    (
        make(LLAMA, 32, reversible=True, attention="eager", precision="fp32", b=4, s=128),
        (-0.019, 0.0),
    ),  # −1.90 %
    (make(LLAMA, 32, reversible=True, b=4, s=128), (0.0, 0.018)),  # +1.73 %
    # accumulated: the stack's Function returns every layer's gradients at its end, beside the sums
    (make(LLAMA, 32, reversible=True, b=4, s=128, accum=2), (0.0, 0.017)),  # +1.62 %
    (
        make(
            dict(GPT, attn_dropout=0.1), 32, attention="eager", ckpt="selective", precision="fp32", b=4, s=128
        ),
        (0.0, 0.007),  # +0.69 %
    ),
]


def _frozen(
    setup: Setup, layers: tuple[int, int] | None, embeddings: bool = False, head: bool = False
) -> Setup:
    ft = setup.finetune.model_copy(
        update={"freeze_layers": layers, "freeze_embeddings": embeddings, "freeze_lm_head": head}
    )
    return Setup.model_validate(setup.model_copy(update={"finetune": ft}).model_dump())


L5 = dict(LLAMA, num_layers=5)
# --freeze (and LoRA with it): every backward moment's highest point. The gradients made above a layer are
# a share of what trains (``analytic.trainable_grads.shares``), a frozen layer's own backward and the lowest
# trainable one's are their own (``as_top``: no weight gradients; no input gradient where nothing below
# trains), and no layer below the lowest one that trains runs a backward (``first_backward_layer``). Before,
# WIDE with layer 0 frozen had its layer backward 8,342,858 B over (26 MB once the share was the trainable
# one's, until a frozen layer's own terms were its own).
FROZEN = [
    _frozen(make(WIDE, 256, b=1, s=16), (0, 0)),
    _frozen(make(L5, 256, b=1, s=8), (2, 3)),  # few tokens: the gradients outweigh the saves
    _frozen(make(L5, 256, b=1, s=8), (3, 4), head=True),
    _frozen(make(L5, 32, b=4, s=128), (0, 1), embeddings=True),
    _frozen(make(L5, 32, b=4, s=128, precision="fp32"), (1, 2)),  # the layer backward is the peak
    _frozen(make(dict(GPT, num_layers=5), 32, b=4, s=128), (0, 2)),  # the layer backward is the peak
    _lora(_frozen(make(WIDE, 256, b=1, s=16), (0, 0))),
    _lora(_frozen(make(L5, 256, b=1, s=8), (1, 2)), "q,k,v,o"),
]


@pytest.mark.parametrize(
    "setup",
    FROZEN,
    ids=lambda s: (
        f"{s.model.norm.value}-L{s.model.num_layers}-{s.finetune.freeze_layers}-"
        f"{s.finetune.method.name.lower()}"
    ),
)
def test_frozen_layers_backward_is_exact(setup: Setup) -> None:
    est = estimate(setup)
    backward = [m for name, m in est.peak.moments.items() if name not in ("loss forward", "optimizer step")]
    measured = profile(setup, steps=1)
    assert measured.phase_peaks["backward"] == max(sum(m.values()) for m in backward)
    assert measured.peak == est.peak.bytes


@pytest.mark.parametrize(
    ("setup", "bounds"), LAYER, ids=lambda x: getattr(x, "model", None) and x.model.norm.value
)
def test_layer_backward_moment_within_stated_accuracy(setup: Setup, bounds: tuple[float, float]) -> None:
    est = estimate(setup)
    assert est.peak.phase == "layer backward"
    p = profile(setup, steps=1)
    error = p.peak / est.peak.bytes - 1
    assert bounds[0] <= error <= bounds[1], error


def random_setups(seed: int, n: int) -> list[Setup]:
    """Random small architectures and strategies (a fixed seed: the same setups every run)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        heads = rng.choice([3, 4, 6, 8])
        gpt = rng.random() < 0.5
        arch: dict[str, Any] = dict(GPT if gpt else LLAMA)
        arch.update(
            hidden_size=heads * rng.choice([8, 16, 32]),
            num_layers=rng.choice([2, 3, 4]),
            num_heads=heads,
            num_kv_heads=rng.choice([k for k in range(1, heads + 1) if heads % k == 0]),
            ffn_size=rng.choice([96, 160, 256]),
            tied_embeddings=rng.random() < 0.5,
            resid_dropout=0.1 if gpt and rng.random() < 0.5 else 0.0,
        )
        attention = rng.choice(["eager", "flash"])
        if attention == "eager" and gpt:
            arch["attn_dropout"] = rng.choice([0.0, 0.1])
        ckpt = rng.choice(["none", "selective", "full", "every-2", "reversible"])
        out.append(
            make(
                arch,
                rng.choice([32, 50, 100]),
                attention=attention,
                ckpt="none" if ckpt == "reversible" else ckpt,
                reversible=ckpt == "reversible",
                precision=rng.choice(["bf16-mixed", "fp32", "bf16", "fp16-mixed"]),
                optimizer=rng.choice(["adamw", "sgd", "lion"]),
                b=rng.choice([1, 2, 4]),
                s=rng.choice([32, 64, 128, 200]),
            )
        )
    return out


@pytest.mark.parametrize("setup", random_setups(seed=2026, n=12), ids=lambda s: s.model.norm.value)
def test_random_shapes_peak_within_stated_accuracy(setup: Setup) -> None:
    """On random shapes the whole peak is within −0.1 % … +0.7 %: these 12 measure 0 (11 exact) … +0.58 %,
    an eager forward's softmax at the top layer, a moment not modelled (analytic/peak.py states the
    accuracy over 160 of this seed)."""
    est = estimate(setup)
    error = profile(setup, steps=1).peak / est.peak.bytes - 1
    assert -0.001 <= error <= 0.007, (est.peak.phase, error)


def sharded(setup: Setup, zero: int, dp: int) -> Setup:
    strategy = setup.strategy.model_copy(update={"zero": ZeroStage(zero), "dp": dp})
    return setup.model_copy(update={"strategy": strategy})


CASES = [
    # (setup, ZeRO stage, dp, the largest tensor rank 0 steps, by hand from the layouts)
    # Llama, v 100, h 64, f 160: over 4 ranks gate / up [f, h]'s ⌈160/4⌉ = 40 rows of 64 (the
    # embedding's ⌈100/4⌉ = 25 rows fewer).
    (make(LLAMA, 100), 3, 4, 40 * 64),
    # Over 64 ranks gate / up keep ⌈160/64⌉ = 3 rows of 64 = 192, more than the embedding's 2 rows of 64:
    # the largest shard is not the largest tensor's.
    (make(LLAMA, 100, precision="fp32", optimizer="lion"), 1, 64, 3 * 64),
    # More ranks than rows everywhere: rank 0 holds one row of each; the widest, down [h, f]'s, is 160.
    (make(LLAMA, 100, precision="fp16-mixed", optimizer="adamw-8bit"), 2, 1000, 160),
    # GPT, learned positions [512, 64]: ⌈512/8⌉ = 64 rows of 64 beat ⌈256/8⌉ = 32 rows of up [256, 64].
    (make(GPT, 100, precision="bf16"), 3, 8, 64 * 64),
    (make(GPT, 100, optimizer="sgd"), 3, 8, 64 * 64),
    # ZeRO-0: every rank steps whole tensors, the largest the positions [512, 64].
    (make(GPT, 100), 0, 8, 512 * 64),
]


@pytest.mark.parametrize(
    ("setup", "zero", "dp", "largest"),
    CASES,
    ids=lambda x: f"{x.training.precision.value}-{x.training.optimizer.value}" if isinstance(x, Setup) else x,
)
def test_one_ranks_step_transient_is_exact(setup: Setup, zero: int, dp: int, largest: int) -> None:
    at = sharded(setup, zero, dp)
    assert largest_step_tensor(at) == largest
    torch.manual_seed(0)
    params = list(Reference(at).parameters())
    local = rank_shards(params, dp if zero >= ZeroStage.OPTIMIZER else 1)
    measured = step_transient(local, at.training.precision, at.training.optimizer)
    assert measured == optimizer_transient(at, largest)
