"""The forward work checkpointing re-runs in backward, by hand (strategies/checkpointing.py ``recompute``
and ``segments``); torch-free, in the mutation selection (docs/mutation.md). tests/measure/ counts the same
re-runs with torch's FLOP counter on the real model.

One layer of the tiny model (h = 64, 4 heads of d = 16, f = 160, SwiGLU, b = 2, s = 32: T = 64 tokens,
4 layers), forward FLOPs at 2 per multiply-add:
- q, k, v, o projections, 4 · 2·T·h·h = 2,097,152;
- W_gate, W_up, W_down, 3 · 2·T·h·f = 3,932,160;
- attention core, QKᵀ and P·V, 2 · 2·b·heads·d·s² = 524,288 (causal not halved);
so 6,553,600 a layer. W_down alone is 2·T·f·h = 1,310,720.

What a re-run skips (torch.utils.checkpoint's early stop, on by default): the re-run stops once the last
tensor backward needs is saved again. A matmul saves its input before it runs, so a segment whose last save
is W_down's input never re-runs W_down. It does re-run W_down when something after it saves: residual
dropout's mask, or a norm after the MLP (``post_norms``). A checkpoint without early stop (Megatron's own,
transformers' reentrant one) re-runs everything.
"""

from __future__ import annotations

from typing import Any

import pytest
from tiny_setup import A, B, F, H, L, S, T, tiny_setup

from memplan.blocks.inventory import Dims, Scope
from memplan.config import Impl, ImplConfig, MoEConfig, Setup
from memplan.config.impl import Family
from memplan.config.strategy import Attention, Checkpointing
from memplan.engine import estimate
from memplan.strategies import checkpointing

D = H // A
PROJECTIONS = 4 * 2 * T * H * H
MLP = 3 * 2 * T * H * F
CORE = 2 * 2 * B * A * D * S * S
LAYER = PROJECTIONS + MLP + CORE
W_DOWN = 2 * T * F * H


def test_the_sizes_written_out() -> None:
    assert (PROJECTIONS, MLP, CORE, LAYER, W_DOWN) == (2_097_152, 3_932_160, 524_288, 6_553_600, 1_310_720)


def rerun(s: Setup) -> int:
    return checkpointing.recompute(s, Dims.of(s))


FULL = {"checkpointing": Checkpointing.FULL}


def every(k: int) -> dict[str, Any]:
    return {"checkpointing": Checkpointing.EVERY_K, "checkpoint_every": k}


# ----------------------------------------------------------------------------------------------------
# Segments: ⌈L / k⌉ checkpoint inputs; none without segment checkpointing.
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("strategy", "n"),
    [
        ({}, 0),
        ({"checkpointing": Checkpointing.SELECTIVE}, 0),
        (FULL, L),
        (every(1), L),
        (every(3), 2),  # layers 0-2 and 3
        (every(4), 1),
    ],
)
def test_segments(strategy: dict[str, Any], n: int) -> None:
    assert checkpointing.segments(tiny_setup(strategy=strategy)) == n


# ----------------------------------------------------------------------------------------------------
# Whole layers re-run, less what early stop skips
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("model", "flops"),
    [
        ({}, L * (LAYER - W_DOWN)),  # 20,971,520: every layer's W_down skipped
        # The embedding's dropout is before the first layer: the segments still end in W_down.
        ({"embd_dropout": 0.1}, L * (LAYER - W_DOWN)),
        # Residual dropout saves its mask after W_down ran: the re-run reaches W_down.
        ({"resid_dropout": 0.1}, L * LAYER),  # 26,214,400
        # GELU's fc2 is the last matmul as W_down is: skipped; two [T, h]·[h, f] matrices instead of three.
        ({"mlp": "gelu"}, L * (PROJECTIONS + 2 * 2 * T * H * F + CORE - W_DOWN)),
    ],
)
def test_full_checkpointing_re_runs_each_layer_but_its_last_matmul(model: dict[str, Any], flops: int) -> None:
    assert rerun(tiny_setup(model, FULL)) == flops


def test_a_norm_after_the_mlp_makes_the_re_run_reach_w_down() -> None:
    # Gemma 2's post-feedforward RMSNorm saves W_down's output (transformers' code; its gated GELU MLP has
    # three matrices, as SwiGLU).
    def gemma2(post_norms: bool) -> Setup:
        model = {"family": Family.GEMMA2, "post_norms": post_norms}
        return tiny_setup(model, FULL, impl=ImplConfig(impl=Impl.HF))

    assert rerun(gemma2(post_norms=True)) == L * LAYER
    assert rerun(gemma2(post_norms=False)) == L * (LAYER - W_DOWN)


def test_every_k_re_runs_every_layer_and_skips_one_matmul_per_segment() -> None:
    # every-3 on 4 layers: segments [0, 1, 2] and [3]; each re-runs whole but its last W_down.
    assert rerun(tiny_setup(strategy=every(3))) == L * LAYER - 2 * W_DOWN  # 23,592,960
    assert rerun(tiny_setup({"resid_dropout": 0.1}, every(3))) == L * LAYER


def hf_llama(strategy: dict[str, Any], reentrant: bool = False) -> Setup:
    return tiny_setup({"family": Family.LLAMA}, strategy, impl=ImplConfig(impl=Impl.HF, reentrant=reentrant))


def test_transformers_every_k_re_runs_only_the_checkpointed_layers() -> None:
    # transformers' every_n_layers checkpoints layers 0 and 3 alone; the other two keep their saves.
    assert rerun(hf_llama(every(3))) == 2 * (LAYER - W_DOWN)  # 10,485,760
    assert rerun(hf_llama(FULL)) == L * (LAYER - W_DOWN)


def test_a_checkpoint_without_early_stop_re_runs_everything() -> None:
    # transformers' reentrant checkpoint (torch.utils.checkpoint's reentrant variant has no early stop),
    # Megatron's own checkpoint and torchtitan's FullAC.
    assert rerun(hf_llama(FULL, reentrant=True)) == L * LAYER
    assert rerun(hf_llama(every(3), reentrant=True)) == 2 * LAYER
    for impl in (Impl.MEGATRON, Impl.TORCHTITAN):
        assert rerun(tiny_setup(strategy=FULL, impl=ImplConfig(impl=impl))) == L * LAYER


# ----------------------------------------------------------------------------------------------------
# Mixtures of experts: the last save of a layer decides what is skipped (blocks/moe.py early_stop_skip)
# ----------------------------------------------------------------------------------------------------
E, K = 4, 2
ROUTER = 2 * T * H * E
EXPERTS = 3 * 2 * (T * K) * H * F  # every token through its k experts, dropless


@pytest.mark.parametrize(
    ("moe", "flops"),
    [
        # The routed combine (index_add_) saves nothing after the experts' W_down ran: nothing skipped.
        ({}, L * (PROJECTIONS + CORE + ROUTER + EXPERTS)),
        # A shared expert [f] last: its W_down input is the last save, its W_down skipped.
        ({"shared_experts": 1}, L * (PROJECTIONS + CORE + ROUTER + EXPERTS + MLP - W_DOWN)),
        # Qwen2-MoE's gate h→1 multiplies the shared output after its W_down: nothing skipped.
        (
            {"shared_experts": 1, "shared_gate": True},
            L * (PROJECTIONS + CORE + ROUTER + EXPERTS + MLP + 2 * T * H),
        ),
    ],
)
def test_moe_layers_skip_the_shared_experts_w_down_when_it_is_last(moe: dict[str, Any], flops: int) -> None:
    s = tiny_setup({"moe": MoEConfig(experts=E, top_k=K, **moe)}, FULL)
    assert rerun(s) == flops


# ----------------------------------------------------------------------------------------------------
# Selective: the attention core alone
# ----------------------------------------------------------------------------------------------------
def test_selective_re_runs_the_flash_core_whole_and_half_the_eager_one() -> None:
    selective = {"checkpointing": Checkpointing.SELECTIVE}
    # flash saves its outputs, so it re-runs both products; eager's last save is P (P·V's input), so the
    # early stop skips P·V.
    assert rerun(tiny_setup(strategy={**selective, "attention": Attention.FLASH})) == L * CORE
    assert rerun(tiny_setup(strategy={**selective, "attention": Attention.EAGER})) == L * CORE // 2
    # Megatron's own checkpoint has no early stop: its unfused core re-runs P·V as well.
    eager = {**selective, "attention": Attention.EAGER}
    assert rerun(tiny_setup(strategy=eager, impl=ImplConfig(impl=Impl.MEGATRON))) == L * CORE


def test_no_checkpointing_re_runs_nothing() -> None:
    assert rerun(tiny_setup()) == 0
    assert rerun(tiny_setup({"resid_dropout": 0.1})) == 0


def test_transformers_every_k_checkpoints_single_layers_and_the_others_keep_their_saves() -> None:
    # every_n_layers = 3 of 4 layers: layers 0 and 3 are checkpointed alone (⌈4/3⌉ = 2 kept inputs), layers
    # 1 and 2 keep every save; the reference model's segments {0, 1, 2} and {3} keep their inputs alone.
    def layer_counts(s: Setup) -> dict[str, int]:
        return {k.name: k.count for k in estimate(s).tensors if k.scope is Scope.LAYER}

    hf = layer_counts(hf_llama(every(3)))
    assert hf.pop("layer.input") == 2
    assert hf and set(hf.values()) == {2}  # every other layer save: layers 1 and 2
    assert layer_counts(tiny_setup(strategy=every(3))) == {"layer.input": 2}


def test_re_run_flops_are_whole_numbers() -> None:
    for strategy in (
        {"checkpointing": Checkpointing.SELECTIVE, "attention": Attention.EAGER},
        FULL,
        every(3),
    ):
        assert type(rerun(tiny_setup(strategy=strategy))) is int


@pytest.mark.parametrize(("device", "rng"), [("cuda", 0), ("cpu", checkpointing.CPU_GENERATOR_STATE)])
def test_compiled_selective_ac_keeps_no_w2_output(device: str, rng: int) -> None:
    """torchtitan's SelectiveAC under ``--compile``: the partitioner keeps what the backward reads; W2's
    output (cached by the eager policy, every other mm) is read by none: T·h bf16 less a layer. On CPU
    the flash op is re-run, its generator state kept (5,056 B); on CUDA the cached SDPA op is not."""
    from memplan.config import Device

    sac = {"checkpointing": Checkpointing.SELECTIVE, "attention": Attention.FLASH}
    eager = tiny_setup(strategy=sac, impl=ImplConfig(impl=Impl.TORCHTITAN))
    eager = eager.model_copy(update={"device": Device(device)})
    compiled = eager.model_copy(update={"impl": eager.impl.model_copy(update={"compile": True})})
    saved = [estimate(x).activations for x in (eager, compiled)]
    assert saved[0] - saved[1] == L * (2 * T * H - rng)


def test_compiled_selective_ac_with_tensorwise_float8_keeps_fewer_amaxes_and_four_inverse_scales() -> None:
    """The same under ``--fp8 tensorwise`` on CUDA: W2's output goes, and the eager cache's 10 amaxes
    (2 B each) give way to 7 amaxes and 4 fp32 inverse scales (``fp8.compiled_sac_scale_rules``)."""
    from memplan.config import Device, Fp8Recipe

    sac = {"checkpointing": Checkpointing.SELECTIVE, "attention": Attention.FLASH}
    impl = ImplConfig(impl=Impl.TORCHTITAN, fp8=Fp8Recipe.TENSORWISE)
    eager = tiny_setup(strategy=sac, impl=impl).model_copy(update={"device": Device.CUDA})
    compiled = eager.model_copy(update={"impl": eager.impl.model_copy(update={"compile": True})})
    saved = [estimate(x).activations for x in (eager, compiled)]
    assert saved[0] - saved[1] == L * (2 * T * H + 10 * 2 - (7 * 2 + 4 * 4))
