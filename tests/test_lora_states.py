"""Fine-tuning's parameter counts and model states, by hand, on a model small enough to count.

tests/measure/test_finetune.py measures these against peft and bitsandbytes (torch); this file pins them in
the fast, torch-free suite, which is what the mutation run (docs/mutation.md) runs. Every expected value is
counted here from the shapes (SwiGLU Llama layout: W_Q [h, h], W_K/W_V [h, kv·d], W_O [h, h], gate/up
[h, f], down [f, h], two RMSNorm weights [h]), never read from the code.
"""

from __future__ import annotations

from typing import Any

import pytest

from memplan.analytic.params import count_params
from memplan.config import DType, FineTune, Method, ModelConfig, Setup, TrainingConfig
from memplan.config.finetune import Target
from memplan.strategies import lora_states as ls

H, HEADS, KV_HEADS, F, V, L = 64, 4, 2, 160, 1000, 4
KV = KV_HEADS * (H // HEADS)  # 32: k and v widths
LINEARS = {"q": H * H, "k": H * KV, "v": H * KV, "o": H * H, "gate": H * F, "up": H * F, "down": F * H}
LAYER = 2 * H + sum(LINEARS.values())  # 43,136: two norms and seven linears
EMBEDDING = V * H
TOTAL = EMBEDDING + L * LAYER + H + V * H  # untied head, final norm: 300,608


def model(**kw: Any) -> ModelConfig:
    base = {"hidden_size": H, "num_layers": L, "num_heads": HEADS, "num_kv_heads": KV_HEADS}
    return ModelConfig(**base, ffn_size=F, vocab_size=V, max_positions=64, **kw)


def setup(m: ModelConfig | None = None, **ft: Any) -> Setup:
    return Setup(
        model=m or model(),
        training=TrainingConfig(micro_batch=1, seq_len=64),
        finetune=FineTune.model_validate(ft),
    )


def test_the_hand_count_is_the_models() -> None:
    assert count_params(model()).total == TOTAL == 300_608


@pytest.mark.parametrize(
    ("n", "plain", "double"),
    [
        # n = 101: ⌈101/2⌉ = 51 packed bytes, ⌈101/64⌉ = 2 blocks. Plain: + 4·2 absmax + 64 (16 fp32 levels).
        # Double: + 2 uint8 absmax + 4 (fp32 offset) + 4·⌈2/256⌉ + 1024 (256 fp32 levels) + 64.
        (101, 51 + 8 + 64, 51 + 2 + 4 + 4 + 1024 + 64),
        # n = 64·257 = 16,448: 8,224 packed, 257 blocks; the second level needs ⌈257/256⌉ = 2 absmax.
        (64 * 257, 8224 + 4 * 257 + 64, 8224 + 257 + 4 + 4 * 2 + 1024 + 64),
    ],
)
def test_4bit_storage_rounds_every_block_up(n: int, plain: int, double: int) -> None:
    assert ls.quantized_bytes(n, double_quant=False) == plain
    assert ls.quantized_bytes(n, double_quant=True) == double


def test_adapters_are_r_times_in_plus_out_per_target() -> None:
    """peft's A [r, in] and B [out, r]: W_K is [64 → 32], so r·(64 + 32); freezing layers 1-2 leaves 2."""
    s = setup(method=Method.LORA, rank=8, targets=(Target.K, Target.O), freeze_layers=(1, 2))
    assert ls.adapter_params(s) == 8 * (H + KV) + 8 * (H + H)
    assert ls.adapted_layers(s) == 2
    assert ls.trainable_params(s, count_params(s.model)) == 2 * (8 * (H + KV) + 8 * (H + H))


def test_full_training_has_no_adapted_layer() -> None:
    assert ls.adapted_layers(setup()) == 0


@pytest.mark.parametrize(
    ("m", "freeze", "frozen"),
    [
        (model(), {"freeze_lm_head": True}, V * H),
        (model(), {"freeze_embeddings": True, "freeze_lm_head": True}, EMBEDDING + V * H),
        # A tied head is the embedding: freezing the head freezes the one shared table.
        (model(tied_embeddings=True), {"freeze_lm_head": True}, EMBEDDING),
        # Learned positions (GPT-2 style) freeze with the token embedding: v·h + positions·h.
        (model(position="learned"), {"freeze_embeddings": True}, EMBEDDING + 64 * H),
        # layers 1-2: two whole layers.
        (model(), {"freeze_layers": (1, 2)}, 2 * LAYER),
    ],
)
def test_full_finetuning_trains_all_but_the_frozen_parts(m: ModelConfig, freeze: Any, frozen: int) -> None:
    s = setup(m, **freeze)
    params = count_params(m)
    assert ls.trainable_params(s, params) == params.total - frozen
    assert ls.frozen_params(s, params) == frozen


def test_lora_keeps_the_whole_base_frozen_and_its_weights_in_the_states() -> None:
    """LoRA r 8 on q, v over 4 layers: 4·(8·(64+64) + 8·(64+32)) = 7,168 adapter parameters; the frozen base
    is every model parameter (peft's "all params" less the adapters); the weights are both in bf16."""
    s = setup(method=Method.LORA, rank=8, targets=(Target.Q, Target.V))
    params = count_params(s.model)
    adapters = L * (8 * (H + H) + 8 * (H + KV))
    assert ls.trainable_params(s, params) == adapters == 7168
    assert ls.frozen_params(s, params) == TOTAL
    assert ls.finetune_states(s, params).weights == 2 * adapters + 2 * TOTAL


def test_qlora_stores_the_layers_linears_in_4bit() -> None:
    """QLoRA (NF4, no double quantisation): each linear weight of n elements is n/2 packed bytes, a fp32
    absmax per 64 and 64 bytes of code book; the rest (embedding, head, norms) stays bf16."""

    def nf4(n: int) -> int:
        return n // 2 + 4 * (n // 64) + 64  # every linear here is a multiple of 64

    s = setup(method=Method.QLORA)
    linears = sum(LINEARS.values())
    expected = 2 * (TOTAL - L * linears) + L * sum(nf4(n) for n in LINEARS.values())
    assert ls.base_weight_bytes(s, count_params(s.model)) == expected == 355_712
    # bitsandbytes dequantises one weight at a time for its matmul: the largest, [64, 160], in bf16.
    assert ls.dequant_transient(s) == H * F * 2
    assert ls.dequant_transient(setup(method=Method.QLORA, compute_dtype=DType.FP32)) == H * F * 4


def test_the_dequantised_weight_joins_every_moment_but_the_optimizer_step() -> None:
    """bitsandbytes dequantises in the forward and again for dX in the backward; the step touches only the
    adapters. The largest linear here is [64, 160]: 20,480 bytes in bf16."""
    moments = {"loss backward": {"transient": 10, "activations": 3}, "optimizer step": {"transient": 7}}
    assert ls.with_dequant(moments, setup(method=Method.QLORA)) == {
        "loss backward": {"transient": 10 + H * F * 2, "activations": 3},
        "optimizer step": {"transient": 7},
    }
    assert ls.with_dequant(moments, setup(method=Method.LORA)) == moments
