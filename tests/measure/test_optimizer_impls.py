"""The optimizer step's temporaries by implementation (``--optimizer-impl``) vs the real optimizers' step.

torch.optim.AdamW (for-loop, foreach, fused) and bitsandbytes' AdamW8bit step the reference model's real
parameters on CPU (memplan/measure/runs/optim_impls.py: the second step, every storage tracked). Expected
bytes are derived by hand below from the model's shapes and analytic/optimizer_step.py's derivations
(torch/optim/adam.py), then compared with the estimate and the measurement.

Model: h 64, 2 layers, 4 heads of 16, 2 kv heads (kv width 32), SwiGLU ffn 160, vocab 1000, untied.
Parameters in ``parameters()`` order: embed [1000, 64] = 64,000, head [1000, 64] = 64,000, then per
layer attn_norm 64, mlp_norm 64, q 4,096, k 2,048, v 2,048, o 4,096, gate / up / down 10,240 each
(43,136 a layer), then the final norm 64: Σ = 128,000 + 2·43,136 + 64 = 214,336 elements.
"""

from __future__ import annotations

import pytest
import torch

from memplan.analytic.optimizer_step import (
    bnb_state_bytes,
    optimizer_impl,
    parameter_shapes,
    step_tensors,
    step_transient,
    trainable_shapes,
)
from memplan.api import build_setup
from memplan.config import (
    DType,
    Impl,
    ImplConfig,
    Method,
    ModelConfig,
    OptimizerImpl,
    Precision,
    Setup,
    StrategyConfig,
    finetune_from,
)
from memplan.engine import estimate
from memplan.measure.reference.model import Reference
from memplan.measure.runs.optim_impls import make_optimizer
from memplan.measure.runs.optim_impls import step_transient as measured_step

LLAMA = ModelConfig(
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    ffn_size=160,
    vocab_size=1000,
    max_positions=512,
)
SUM = 128_000 + 2 * 43_136 + 64
# for-loop: the head [64,000] follows the embed [64,000]: N_{i-1} + 2·N_i = 3 · 64,000 elements.
FOR_LOOP = 3 * 64_000


def setup(precision: Precision, impl: OptimizerImpl, optimizer: str = "adamw", dp: int = 1) -> Setup:
    s = build_setup(LLAMA, seq=16, precision=precision, optimizer=optimizer, optimizer_impl=impl)  # type: ignore[arg-type]
    if dp == 1:
        return s
    return s.model_copy(update={"strategy": StrategyConfig(zero=1, dp=dp)})


def real_params(s: Setup, dp: int = 1) -> list[torch.Tensor]:
    torch.manual_seed(0)
    params = [p.detach() for p in Reference(s).parameters()]
    local = [torch.chunk(p, dp, dim=0)[0].clone() for p in params]  # rank 0's FSDP2 shards
    for p in local:
        p.grad = torch.randn_like(p)
    return local


def test_parameter_order_is_the_reference_models() -> None:
    s = setup(Precision.FP32, OptimizerImpl.FOREACH)
    assert parameter_shapes(s) == [tuple(p.shape) for p in Reference(s).parameters()]
    assert sum(step_tensors(s)) == SUM


@pytest.mark.parametrize(
    ("precision", "impl", "expected"),
    [
        (Precision.FP32, OptimizerImpl.FOR_LOOP, 4 * FOR_LOOP),
        (Precision.FP32, OptimizerImpl.FOREACH, 4 * SUM),  # _foreach_sqrt: one [N_i] per parameter
        (Precision.FP32, OptimizerImpl.FUSED, 0),
        (Precision.BF16, OptimizerImpl.FOR_LOOP, 2 * FOR_LOOP),
        (Precision.BF16, OptimizerImpl.FOREACH, 2 * SUM),
        (Precision.BF16, OptimizerImpl.FUSED, 0),
        # mixed: the fp32 masters are stepped (their fp32 gradients alive before the step)
        (Precision.BF16_MIXED, OptimizerImpl.FOR_LOOP, 4 * FOR_LOOP),
        (Precision.BF16_MIXED, OptimizerImpl.FOREACH, 4 * SUM),
    ],
)
def test_torch_adamw_step_is_exact(precision: Precision, impl: OptimizerImpl, expected: int) -> None:
    s = setup(precision, impl)
    assert step_transient(s) == expected
    assert estimate(s).peak.moments["optimizer step"]["transient"] == expected
    measured, _ = measured_step(real_params(s), precision, impl)
    assert measured == expected


@pytest.mark.parametrize(
    ("impl", "expected"),
    [(OptimizerImpl.FOR_LOOP, 4 * FOR_LOOP), (OptimizerImpl.FOREACH, 4 * SUM), (OptimizerImpl.FUSED, 0)],
)
def test_torchs_mem_tracker_agrees(impl: OptimizerImpl, expected: int) -> None:
    """torch's own tracker (torch.distributed._tools.mem_tracker.MemTracker, by storage on CPU): the
    step's peak above what is live after it (the states exist; the step frees what it made)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    s = setup(Precision.FP32, impl)
    model = Reference(s)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt = make_optimizer(list(model.parameters()), impl)
    opt.step()  # creates the states
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        opt.step()
    cpu = torch.device("cpu")
    peak, now = tracker.get_tracker_snapshot("peak")[cpu], tracker.get_tracker_snapshot("current")[cpu]
    assert peak["Total"] - now["Total"] == expected


def test_for_loop_under_zero_steps_one_ranks_shards() -> None:
    # ZeRO-1 over 4 ranks: embed and head shards [250, 64] = 16,000 each, in a row: 3 · 16,000.
    s = setup(Precision.FP32, OptimizerImpl.FOR_LOOP, dp=4)
    assert step_transient(s) == 4 * 3 * 16_000
    measured, _ = measured_step(real_params(s, dp=4), Precision.FP32, OptimizerImpl.FOR_LOOP)
    assert measured == 4 * 3 * 16_000


def test_bitsandbytes_states_are_exact() -> None:
    pytest.importorskip("bitsandbytes")
    s = setup(Precision.FP32, OptimizerImpl.BITSANDBYTES, optimizer="adamw-8bit")
    # ≥ 4096 elements: 2 bytes + two fp32 absmax per 256 — embed, head 2·64,000 + 8·250; q, o 2·4,096 + 8·16;
    # gate / up / down 2·10,240 + 8·40. Below 4096: fp32 m and v (8 bytes) — k, v 2,048, the norms 64.
    big = 2 * (2 * 64_000 + 8 * 250) + 2 * (2 * (2 * 4_096 + 8 * 16) + 3 * (2 * 10_240 + 8 * 40))
    small = 2 * (2 * 8 * 2_048 + 2 * 8 * 64) + 8 * 64
    expected = big + small + 2 * 256 * 4  # + the two shared fp32 [256] qmaps
    assert bnb_state_bytes(step_tensors(s)) == expected
    assert estimate(s).states.optimizer_states == expected
    _, states = measured_step(real_params(s), Precision.FP32, OptimizerImpl.BITSANDBYTES)
    assert states == expected


@pytest.mark.parametrize(
    ("impl", "message"),
    [
        (OptimizerImpl.FUSED, "optimizer_impl: fused steps torch.optim.AdamW"),
        (OptimizerImpl.BITSANDBYTES, "adamw-8bit"),
    ],
)
def test_impl_must_fit_the_optimizer(impl: OptimizerImpl, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        setup(Precision.FP32, impl, optimizer="sgd")


# transformers' order under --impl hf: the lm head comes after model.norm [64], not after the embedding.
@pytest.mark.parametrize("preset", ["llama-3-8b", "mistral-7b", "gpt2"])
def test_hf_parameter_order_is_transformers(preset: str) -> None:
    pytest.importorskip("transformers")
    from memplan.measure.frameworks.hf import build
    from tests.hf.harness import hf_setup

    s = hf_setup(preset, layers=1, seq=64)
    with torch.device("meta"):
        model = build(s)
    assert parameter_shapes(s) == [tuple(p.shape) for p in model.parameters()]


def test_hf_llama_for_loop_step_is_exact() -> None:
    pytest.importorskip("transformers")
    from memplan.measure.frameworks.hf import build
    from tests.hf.harness import hf_setup

    s = hf_setup(LLAMA, layers=2, seq=16)
    # the Trainer's own default is torch's fused AdamW (test_optimizer_shapes); the for-loop asked for
    update = {"precision": Precision.FP32, "optimizer_impl": OptimizerImpl.FOR_LOOP}
    s = s.model_copy(update={"training": s.training.model_copy(update=update)})
    expected = 4 * (64 + 2 * 64_000)  # lm_head [1000, 64] after model.norm [64]
    assert step_transient(s) == expected
    torch.manual_seed(0)
    params = list(build(s).parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    measured, _ = measured_step(params, Precision.FP32, OptimizerImpl.FOR_LOOP)
    assert measured == expected


def test_fine_tuning_steps_the_trainable_tensors_of_peft() -> None:
    """Issue #20: under LoRA an explicit torch / bitsandbytes optimizer steps what trains — peft's
    ``requires_grad`` parameters on transformers' Llama, in its order — and the real for-loop AdamW over
    them allocates the estimate's temporaries (the frozen [V, H] embedding and head are never stepped)."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    s = build_setup(LLAMA, seq=16, finetune=finetune_from(Method.LORA, {}, False, DType.BF16))
    hf = s.model_copy(update={"impl": ImplConfig(impl=Impl.HF)})
    assert optimizer_impl(hf) is OptimizerImpl.REFERENCE  # the default under fine-tuning
    loop = hf.model_copy(
        update={"training": hf.training.model_copy(update={"optimizer_impl": OptimizerImpl.FOR_LOOP})}
    )
    assert optimizer_impl(loop) is OptimizerImpl.FOR_LOOP
    m = LLAMA
    config = transformers.LlamaConfig(
        hidden_size=m.hidden_size,
        intermediate_size=m.ffn,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.kv_heads,
        vocab_size=m.vocab_size,
        max_position_embeddings=m.max_positions,
    )
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(config)
    lora = peft.get_peft_model(base, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    trainable = [p for p in lora.parameters() if p.requires_grad]
    assert [tuple(p.shape) for p in trainable] == trainable_shapes(loop)
    params = [p.detach().to(torch.bfloat16).clone() for p in trainable]
    for p in params:
        p.grad = torch.randn_like(p)
    measured, _ = measured_step(params, loop.training.precision, OptimizerImpl.FOR_LOOP)
    assert measured == step_transient(loop)
