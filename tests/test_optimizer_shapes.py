"""The tensors the optimizer steps, in order, and bitsandbytes' 8-bit states, by hand
(analytic/optimizer_step.py), in the fast, torch-free suite the mutation run uses (docs/mutation.md).

tests/measure/test_optimizer_impls.py runs torch.optim on the reference model and transformers (torch); here
the orders are written out from the module layouts: memplan/measure/reference/model.py ``Reference`` (a
module's own
parameters before its submodules': embed, positions, head, then the layers and the final norm; a layer's
attn_norm, mlp_norm, q, k, v, o, MLP), transformers' ``LlamaForCausalLM`` and ``GPT2LMHeadModel``.
"""

from __future__ import annotations

from typing import Any

import pytest
from layouts import GPT_LAYOUT

from memplan.analytic import optimizer_step as ost
from memplan.config import (
    Family,
    FineTune,
    Impl,
    ImplConfig,
    ModelConfig,
    MoEConfig,
    Optimizer,
    OptimizerImpl,
    Setup,
    StrategyConfig,
    TrainingConfig,
    ZeroStage,
)
from memplan.config.finetune import Method, Target

H, V, F, L, P = 64, 1000, 160, 2, 32
KV = 32  # 2 kv heads of 16


def setup(impl: Impl = Impl.REFERENCE, strategy: StrategyConfig | None = None, **model: Any) -> Setup:
    base: dict[str, Any] = {"hidden_size": H, "num_layers": L, "num_heads": 4, "num_kv_heads": 2}
    m = ModelConfig(**{**base, "ffn_size": F, "vocab_size": V, "max_positions": P, **model})
    return Setup(
        model=m,
        training=TrainingConfig(micro_batch=1, seq_len=P),
        impl=ImplConfig(impl=impl),
        strategy=strategy or StrategyConfig(),
    )


GPT: dict[str, Any] = {"num_kv_heads": 4, **GPT_LAYOUT}
"""A GPT-2-style layout (``layouts.GPT_LAYOUT``) with as many kv heads as heads."""


def test_reference_llama_order() -> None:
    layer = [(H,), (H,), (H, H), (KV, H), (KV, H), (H, H), (F, H), (F, H), (H, F)]
    assert ost.parameter_shapes(setup()) == [(V, H), (V, H), *layer * L, (H,)]


def test_reference_gpt_order_with_biases_learned_positions_and_a_tied_head() -> None:
    """LayerNorm weight and bias; every linear followed by its bias; fc1 [f, h], fc2 [h, f]."""
    s = setup(**GPT)
    ln = [(H,), (H,)]
    linear = [(H, H), (H,)]
    layer = [*ln, *ln, *linear * 4, (F, H), (F,), (H, F), (H,)]
    assert ost.parameter_shapes(s) == [(V, H), (P, H), *layer * L, *ln]


def test_reference_moe_layer_has_router_experts_shared_expert_and_gate() -> None:
    moe = MoEConfig(experts=3, top_k=2, shared_experts=1, shared_ffn=48, shared_gate=True)
    expert = [(F, H), (F, H), (H, F)]
    layer = [
        (H,),
        (H,),
        (H, H),
        (KV, H),
        (KV, H),
        (H, H),
        (3, H),
        *expert * 3,
        (48, H),
        (48, H),
        (H, 48),
        (1, H),
    ]
    assert ost.parameter_shapes(setup(moe=moe)) == [(V, H), (V, H), *layer * L, (H,)]
    # No gate; the shared expert's width defaults to the routed one's, f.
    attn = [(H,), (H,), (H, H), (KV, H), (KV, H), (H, H)]
    shared = MoEConfig(experts=2, top_k=1, shared_experts=1)
    layer = [*attn, (2, H), *expert * 2, *expert]
    assert ost.parameter_shapes(setup(moe=shared)) == [(V, H), (V, H), *layer * L, (H,)]
    # Neither shared experts nor a gate.
    layer = [*attn, (2, H), *expert * 2]
    assert ost.parameter_shapes(setup(moe=MoEConfig(experts=2, top_k=1))) == [
        (V, H),
        (V, H),
        *layer * L,
        (H,),
    ]


def test_transformers_llama_order_puts_the_head_after_the_final_norm() -> None:
    """model.embed_tokens, per layer self_attn (q, k, v, o; Qwen2's q/k/v biases) then mlp (gate, up,
    down) then input_layernorm, post_attention_layernorm; model.norm; lm_head."""
    layer = [(H, H), (H,), (KV, H), (KV,), (KV, H), (KV,), (H, H), (F, H), (F, H), (H, F), (H,), (H,)]
    s = setup(Impl.HF, family=Family.QWEN2, qkv_bias=True)
    assert ost.parameter_shapes(s) == [(V, H), *layer * L, (H,), (V, H)]


def test_transformers_gpt2_order_with_conv1d_weights() -> None:
    """wte, wpe, per block ln_1, c_attn [h, 3h] + bias, c_proj [h, h] + bias, ln_2, c_fc [h, f] + bias,
    c_proj [f, h] + bias; ln_f; the head tied."""
    s = setup(Impl.HF, family=Family.GPT2, **GPT)
    ln = [(H,), (H,)]
    layer = [*ln, (H, 3 * H), (3 * H,), (H, H), (H,), *ln, (H, F), (F,), (F, H), (H,)]
    assert ost.parameter_shapes(s) == [(V, H), (P, H), *layer * L, *ln]


def test_zero_steps_each_ranks_dim0_chunk() -> None:
    """ZeRO-1 over 3 ranks: ⌈rows/3⌉ rows of each parameter ([1000, 64] → 334 · 64; [64] → 22)."""
    sharded = ost.step_tensors(setup(strategy=StrategyConfig(zero=ZeroStage.OPTIMIZER, dp=3)))
    assert sharded[:3] == [334 * H, 334 * H, 22]
    assert ost.step_tensors(setup(strategy=StrategyConfig(dp=3)))[:3] == [V * H, V * H, H]


@pytest.mark.parametrize(
    ("sizes", "expected"),
    [
        # e · max(0 + 2·5, 5 + 2·3, 3 + 2·7) = 4 · 17
        ([5, 3, 7], 4 * 17),
        ([7, 3, 5], 4 * max(14, 7 + 6, 3 + 10)),
        ([], 0),
    ],
)
def test_for_loop_holds_the_previous_denominator_beside_two_new_tensors(
    sizes: list[int], expected: int
) -> None:
    assert ost.for_loop_transient(sizes, 4) == expected


@pytest.mark.parametrize(
    ("sizes", "expected"),
    [
        # 4096: uint8 state1 and state2 (2·4096) + fp32 absmax1/absmax2 per 256 (2·4·16) + the qmaps 2·256·4
        ([4096], 2 * 4096 + 2 * 4 * 16 + 2 * 256 * 4),
        # 4095 stays fp32: 2 · 4 · 4095, no qmaps
        ([4095], 8 * 4095),
        # 4097: ⌈4097/256⌉ = 17 blocks; with a small one beside it
        ([4097, 10], 2 * 4097 + 2 * 4 * 17 + 8 * 10 + 2 * 256 * 4),
    ],
)
def test_bitsandbytes_8bit_states(sizes: list[int], expected: int) -> None:
    assert ost.bnb_state_bytes(sizes) == expected


def test_transformers_tied_llama_steps_no_head() -> None:
    layer = [(H, H), (KV, H), (KV, H), (H, H), (F, H), (F, H), (H, F), (H,), (H,)]
    s = setup(Impl.HF, family=Family.LLAMA, tied_embeddings=True)
    assert ost.parameter_shapes(s) == [(V, H), *layer * L, (H,)]


def test_zero_one_over_two_ranks_shards_too() -> None:
    assert ost.step_tensors(setup(strategy=StrategyConfig(zero=ZeroStage.OPTIMIZER, dp=2)))[:3] == [
        500 * H,
        500 * H,
        32,
    ]


# Ψ = 2·1000·64 (embedding, untied head) + 2 · (2·64 + 2·64² + 2·32·64 + 3·64·160) + 64 = 214,336.
PSI = 2 * V * H + L * (2 * H + 2 * H * H + 2 * KV * H + 3 * H * F) + H


@pytest.mark.parametrize(
    ("impl", "expected"),
    [
        # the fp32 master (4 bytes): embed then head, both [v, h]: the previous denominator + two new ones
        (OptimizerImpl.FOR_LOOP, 4 * 3 * V * H),
        (OptimizerImpl.FOREACH, 4 * PSI),  # _foreach_sqrt over every parameter
        (OptimizerImpl.FUSED, 0),
    ],
)
def test_step_transient_by_implementation(impl: OptimizerImpl, expected: int) -> None:
    s = setup()
    s = s.model_copy(update={"training": s.training.model_copy(update={"optimizer_impl": impl})})
    assert ost.step_transient(s) == expected


# ----------------------------------------------------------------------------------------------------
# Which implementation steps (optimizer_impl): torch's default for AdamW is foreach when every parameter
# is on a foreach-capable device (optim/optimizer.py _default_to_fused_or_foreach(..., use_fused=False):
# cuda yes, cpu no), never fused by default; adamw-8bit is bitsandbytes'; memplan's reference model and
# the optimizers torch.optim is not modelled for step the reference optimizer, and so does fine-tuning.
# ----------------------------------------------------------------------------------------------------
def chosen(impl: Impl, optimizer: str = "adamw", device: str = "cuda", **setup: Any) -> OptimizerImpl:
    model = ModelConfig(hidden_size=H, num_layers=L, num_heads=4, ffn_size=F, vocab_size=V)
    training = TrainingConfig(seq_len=P, optimizer=optimizer)
    s = Setup(model=model, training=training, impl=ImplConfig(impl=impl), device=device, **setup)
    return ost.optimizer_impl(s)


@pytest.mark.parametrize(
    ("impl", "optimizer", "device", "expected"),
    [
        (Impl.REFERENCE, "adamw", "cuda", OptimizerImpl.REFERENCE),
        # transformers' TrainingArguments: default_optim "adamw_torch_fused" with torch >= 2.8, any device
        (Impl.HF, "adamw", "cuda", OptimizerImpl.FUSED),
        (Impl.HF, "adamw", "cpu", OptimizerImpl.FUSED),
        (Impl.TORCHTITAN, "adamw", "cuda", OptimizerImpl.FUSED),
        (Impl.REFERENCE, "adamw", "cpu", OptimizerImpl.REFERENCE),
        (Impl.MEGATRON, "adamw", "cuda", OptimizerImpl.FUSED),  # its FusedAdam (TE's or Apex's)
        # torchtitan 0.3.0's optimizer config: implementation = "fused" (components/optimizer/optimizer.py)
        (Impl.TORCHTITAN, "adamw", "cpu", OptimizerImpl.FUSED),
        (Impl.HF, "adamw-8bit", "cuda", OptimizerImpl.BITSANDBYTES),
        (Impl.HF, "adamw-8bit", "cpu", OptimizerImpl.BITSANDBYTES),
        (Impl.HF, "sgd", "cuda", OptimizerImpl.REFERENCE),
        (Impl.HF, "lion", "cuda", OptimizerImpl.REFERENCE),
    ],
)
def test_the_default_implementation(impl: Impl, optimizer: str, device: str, expected: OptimizerImpl) -> None:
    assert chosen(impl, optimizer, device) is expected


def test_fine_tuning_defaults_to_the_reference_optimizer_and_takes_a_torch_one() -> None:
    lora = FineTune(method=Method.LORA)
    assert chosen(Impl.HF, finetune=lora) is OptimizerImpl.REFERENCE
    explicit = TrainingConfig(seq_len=P, optimizer_impl=OptimizerImpl.REFERENCE)
    model = ModelConfig(hidden_size=H, num_layers=L, num_heads=4, ffn_size=F, vocab_size=V)
    s = Setup(model=model, training=explicit, impl=ImplConfig(impl=Impl.HF), finetune=lora)
    assert ost.optimizer_impl(s) is OptimizerImpl.REFERENCE
    fused = s.model_copy(
        update={"training": explicit.model_copy(update={"optimizer_impl": OptimizerImpl.FUSED})}
    )
    assert ost.optimizer_impl(fused) is OptimizerImpl.FUSED  # explicit: stepped over the adapters
    full = fused.model_copy(update={"finetune": FineTune()})
    assert ost.optimizer_impl(full) is OptimizerImpl.FUSED


# ----------------------------------------------------------------------------------------------------
# Fine-tuning: only what trains is stepped (issue #20: QLoRA's frozen embedding was counted)
# ----------------------------------------------------------------------------------------------------
Q, KVW = 64, 32  # q width (4 heads of 16) and k/v width (2 kv heads of 16) of ``setup()``'s model


def tuned(ft: FineTune, impl: OptimizerImpl | None = None, **training: Any) -> Setup:
    s = setup()
    t = s.training.model_copy(update={"optimizer_impl": impl, **training})
    return Setup.model_validate({**s.model_dump(), "finetune": ft.model_dump(), "training": t.model_dump()})


def test_lora_steps_its_adapters_only() -> None:
    """LoRA r 8 on q, v: per layer A_q [8, H], B_q [Q, 8], A_v [8, H], B_v [KV, 8] (module order; peft
    registers lora_A before lora_B); the frozen embedding [V, H] and head are never stepped."""
    s = tuned(FineTune(method=Method.LORA))
    assert ost.trainable_shapes(s) == [(8, H), (Q, 8), (8, H), (KVW, 8)] * L
    # The reference optimizer's temporaries for the largest (512 elements), bf16-mixed AdamW: the fp32
    # gradient copy (4 B) and the fp32 denominator (4 B) per element — not the [V, H] embedding's 64,000.
    assert ost.step_transient(s) == 512 * (4 + 4)


def test_all_linear_lora_with_a_frozen_layer() -> None:
    """r 4 on every linear, layer 0 frozen: layer 1's adapters in module order q, k, v, o, gate, up, down."""
    ft = FineTune(method=Method.LORA, rank=4, targets=tuple(Target), freeze_layers=(0, 0))
    s = tuned(ft)
    adapters = [(4, H), (Q, 4), (4, H), (KVW, 4), (4, H), (KVW, 4), (4, Q), (H, 4)]
    adapters += [(4, H), (F, 4), (4, H), (F, 4), (4, F), (H, 4)]
    assert ost.trainable_shapes(s) == adapters


def test_full_fine_tuning_with_frozen_parts_steps_the_rest() -> None:
    """Frozen embedding and layer 0: the untied head [V, H], layer 1 (norms, q, k, v, o, gate, up, down),
    the final norm."""
    s = tuned(FineTune(freeze_embeddings=True, freeze_layers=(0, 0)))
    layer = [(H,), (H,), (Q, H), (KVW, H), (KVW, H), (H, Q), (F, H), (F, H), (H, F)]
    assert ost.trainable_shapes(s) == [(V, H), *layer, (H,)]


def test_qlora_takes_the_torch_and_bitsandbytes_optimizers() -> None:
    """An explicit implementation steps the adapters: sizes 512, 512, 512, 256 per layer (r 8 on q, v)."""
    ft = FineTune(method=Method.QLORA)
    loop = tuned(ft, OptimizerImpl.FOR_LOOP)
    # _single_tensor_adam: e·max(N_{i-1} + 2·N_i) = 4·(512 + 2·512), the fp32 master under bf16-mixed
    assert ost.step_transient(loop) == 4 * (512 + 2 * 512)
    each = tuned(ft, OptimizerImpl.FOREACH)
    assert ost.step_transient(each) == 4 * (512 * 3 + 256) * L  # _foreach_sqrt: one copy of each
    bnb = tuned(ft, OptimizerImpl.BITSANDBYTES, optimizer=Optimizer.ADAMW_8BIT)
    # Every adapter has < 4,096 elements: bitsandbytes keeps fp32 state1 and state2 (8 B each element).
    assert bnb_states_of(bnb) == 8 * (512 * 3 + 256) * L


def bnb_states_of(s: Setup) -> int:
    from memplan.engine import estimate

    return estimate(s).device.states.optimizer_states


def test_qlora_70b_steps_no_frozen_embedding() -> None:
    """Llama-3-70B under QLoRA r 8 on q, v: the largest trainable tensor is A_q [8, 8192] (= B_q [8192, 8],
    A_v) of 65,536 elements; the step's temporaries are 8 B each (fp32 gradient copy + fp32 denominator).
    Before the fix it was the frozen [128256, 8192] embedding: 8.4 GB."""
    from memplan.api import Options, setup_of

    s = setup_of(Options(model="70b", finetune="qlora", checkpointing="full"))
    assert max(ost.step_tensors(s)) == 8 * 8192
    assert ost.step_transient(s) == 8 * 8192 * 8


def test_context_parallel_ranks_step_their_dp_x_cp_shards() -> None:
    """Under context parallelism FSDP2 shards over dp × cp (torchtitan's ``dp_shard_cp`` mesh;
    ``Setup.state_shards``), so each rank steps its dp × cp shard of every tensor.
    Llama 3.1 8B on cp 8 × dp 1, ZeRO-3, torchtitan (FSDP2's fp32 shards, foreach AdamW): the step's
    ``_foreach_sqrt`` list is one fp32 copy of the rank's shards — the weights at rest, 4 B each — not of
    the whole model (every dim 0 of Llama 3.1 8B divides by 8: no padding)."""
    from memplan.analytic.step import largest_step_tensor
    from memplan.api import Options, build

    o = Options(
        model="llama-3.1-8b", seq=262144, gpus=8, cp=8, zero=3, impl="torchtitan", device="cuda",
        optimizer_impl="foreach",  # 0.3.0's default is fused (no temporaries): the 2024 trainer's foreach
    )  # fmt: skip
    r = build(o).result
    assert r.setup.strategy.dp == 1 and r.setup.parallel.cp == 8
    assert ost.optimizer_impl(r.setup) is OptimizerImpl.FOREACH
    assert sum(ost.step_tensors(r.setup)) * 8 == r.params.total == 8_030_261_248
    step = r.device.peak.moments["optimizer step"]["transient"]
    assert step == r.device.states.weights == 4 * 8_030_261_248 // 8
    assert largest_step_tensor(r.setup) == 128_256 * 4096 // 8  # the embedding's (and lm head's) shard
