"""LoRA's small rules by hand (strategies/lora.py): what trains, one adapter's saves, the residual dropout
mask; in the fast, torch-free suite the mutation run uses (docs/mutation.md). The layer-by-layer gradient
flow is measured per tensor by tests/measure/test_finetune.py (torch)."""

from __future__ import annotations

from typing import Any

import pytest
from tiny_setup import tiny_setup

from memplan.blocks.inventory import Block, Dims, Role
from memplan.config import DType, FineTune, Method, ModelConfig, Setup, TrainingConfig, trainable
from memplan.config.finetune import Target, parse_freeze
from memplan.config.trainable import adapters
from memplan.engine import estimate
from memplan.strategies import lora

H, F, B, S = 64, 160, 2, 32


def setup(tied: bool = False, **ft: Any) -> Setup:
    m = ModelConfig(
        hidden_size=H,
        num_layers=4,
        num_heads=4,
        ffn_size=F,
        vocab_size=1000,
        max_positions=S,
        tied_embeddings=tied,
    )
    return Setup(
        model=m, training=TrainingConfig(micro_batch=B, seq_len=S), finetune=FineTune.model_validate(ft)
    )


@pytest.mark.parametrize(
    ("tied", "ft", "embedding", "head", "norm"),
    [
        (False, {}, True, True, True),
        (False, {"freeze_embeddings": True}, False, True, True),
        (False, {"freeze_lm_head": True}, True, False, True),
        # tied: one tensor, frozen when either name freezes it
        (True, {"freeze_lm_head": True}, False, False, True),
        (True, {"freeze_embeddings": True}, False, False, True),
        (True, {}, True, True, True),
        # LoRA: only the adapters train
        (False, {"method": Method.LORA}, False, False, False),
    ],
)
def test_what_trains(tied: bool, ft: dict[str, Any], embedding: bool, head: bool, norm: bool) -> None:
    s = setup(tied, **ft)
    assert (trainable.embedding_trains(s), trainable.head_trains(s), trainable.final_norm_trains(s)) == (
        embedding,
        head,
        norm,
    )


def test_frozen_layers_train_nothing_and_carry_no_adapter() -> None:
    full = setup(freeze_layers=(1, 2))
    assert [trainable.base_trains(full, i) for i in range(4)] == [True, False, False, True]
    adapted = setup(method=Method.LORA, targets=(Target.Q, Target.DOWN), freeze_layers=(0, 0))
    assert [trainable.adapted(adapted, i) for i in range(2)] == [frozenset(), {Target.Q, Target.DOWN}]
    assert trainable.adapted(setup(), 0) == frozenset()


@pytest.mark.parametrize(
    ("target", "block", "fan_in"), [(Target.O, Block.ATTN, H), (Target.DOWN, Block.MLP, F)]
)
def test_an_adapter_with_dropout_keeps_mask_dropped_input_and_rank_output(
    target: Target, block: Block, fan_in: int
) -> None:
    """peft's lora_dropout(x) → A → B: the bool mask [b, s, in] (when x needs a gradient), the dropped x
    [b, s, in] (A's input, bf16) and A·x [b, s, r] (B's input); r = 8."""
    s = setup(method=Method.LORA, dropout=0.1, targets=(target,))
    dims = Dims.of(s)
    (ad,) = adapters(s)
    assert ad.targets == (target,) and ad.fan_in == fan_in
    got = [(r.name, r.shape, r.dtype, r.block, r.role) for r in lora.adapter_rules(s, dims, ad, True)]
    p = f"{block.value}.{target.value}"
    assert got == [
        (f"{p}_lora_mask", (B, S, fan_in), DType.BOOL, block, Role.DROPOUT_MASK),
        (f"{p}_lora_input", (B, S, fan_in), DType.BF16, block, Role.LINEAR_INPUT),
        (f"{p}_lora_mid", (B, S, 8), DType.BF16, block, Role.LORA_RANK),
    ]
    # x needs no gradient: no mask; without dropout A reads x itself (its linear's save): A·x only.
    assert [r.name for r in lora.adapter_rules(s, dims, ad, False)] == [
        f"{p}_lora_input",
        f"{p}_lora_mid",
    ]
    plain = setup(method=Method.LORA, targets=(target,))
    assert [r.name for r in lora.adapter_rules(plain, Dims.of(plain), ad, True)] == [f"{p}_lora_mid"]


def test_residual_dropout_mask_is_a_bool_per_activation() -> None:
    s = setup()
    dims = Dims.of(s)
    r = lora._resid_mask(s, Block.MLP, dims)
    assert (r.name, r.shape, r.dtype, r.block, r.role) == (
        "mlp.resid_dropout_mask",
        (B, S, H),
        DType.BOOL,
        Block.MLP,
        Role.DROPOUT_MASK,
    )


# ----------------------------------------------------------------------------------------------------
# The inventory's counts under fine-tuning (lora.keeps): a layer save kept in n layers has count n
# ----------------------------------------------------------------------------------------------------
def test_lora_counts_each_layer_save_in_the_layers_that_keep_it() -> None:
    kept = {
        k.name: (k.scope.value, k.count)
        for k in estimate(tiny_setup(finetune=FineTune(method=Method.LORA))).tensors
    }
    # Adapters on q and v in every layer: A·x, B's input, is kept in all 4 layers (tests/tiny_setup.py).
    assert kept["attn.q_lora_mid"] == kept["attn.v_lora_mid"] == ("layer", 4)
    # The attention norm's input and rstd serve its dX only, which layer 0 does not need (the frozen
    # embedding below takes no gradient): layers 1-3.
    assert kept["attn_norm.input"] == kept["attn_norm.rstd"] == ("layer", 3)
    # Model-level saves once (the engine counts model-scope groups itself, engine.group_counts): q·cos /
    # rotate_half(q)·sin before the layers, the loss's after.
    assert kept["rope.cos"] == kept["rope.sin"] == ("model", 1)
    assert kept["loss.log_probs"] == kept["final_norm.input"] == ("model", 1)


def test_a_trained_final_norm_alone_keeps_its_normed_input_and_the_losss_saves() -> None:
    # Full training with the embedding, every layer and the lm head frozen: only the final norm's weight
    # trains. Its dW = Σ dY·n needs n, and dY needs the logits' gradient: the loss keeps its log-probs,
    # labels and total weight; the frozen head's dX needs only its weight (no save); nothing below the
    # final norm needs a gradient, so neither its fp32 input nor rstd (they serve dX) is kept.
    ft = FineTune.model_validate({"method": Method.FULL, **parse_freeze("embeddings,lm_head,layers:0-3")})
    names = [k.name for k in estimate(tiny_setup(finetune=ft)).tensors]
    assert names == ["final_norm.normed", "loss.log_probs", "loss.labels", "loss.total_weight"]
