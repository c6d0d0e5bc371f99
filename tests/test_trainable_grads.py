"""``analytic.trainable_grads``: the parameters whose gradients exist above each layer under fine-tuning."""

from __future__ import annotations

import pytest

from memplan.analytic.params import count_params
from memplan.analytic.trainable_grads import layer_trainable, shares, trainable
from memplan.api import build_setup
from memplan.config import FineTune, Method, Setup
from memplan.config.finetune import parse_targets
from memplan.strategies.lora_states import trainable_params


def tuned(model: str, **fields: object) -> Setup:
    setup = build_setup(model, seq=256)
    ft = FineTune.model_validate({**FineTune().model_dump(), **fields})
    return setup.model_copy(update={"finetune": ft})


SETUPS = [
    tuned("llama-3-8b", method=Method.LORA, targets=parse_targets("q,v")),
    tuned(
        "llama-3-8b", method=Method.LORA, targets=parse_targets("q,k,v,o,gate,up,down"), freeze_layers=(0, 7)
    ),
    tuned("gpt2", method=Method.LORA, targets=parse_targets("q,k,v,o")),
    tuned("llama-3-8b", freeze_layers=(0, 15)),
    tuned("llama-3-8b", freeze_embeddings=True),
    tuned("gpt2", freeze_lm_head=True),  # tied: the embedding frozen with it
    tuned("llama-3-8b", freeze_embeddings=True, freeze_lm_head=True, freeze_layers=(30, 31)),
    tuned("mixtral-8x7b", freeze_layers=(0, 3)),
]


@pytest.mark.parametrize("setup", SETUPS, ids=lambda s: f"{s.model.name}-{s.finetune.label()}")
def test_trainable_is_the_optimizers_count(setup: Setup) -> None:
    """The share's whole is what the states count as trainable (peft's count under LoRA)."""
    params = count_params(setup.model)
    assert trainable(setup, params) == trainable_params(setup, params)


def test_lora_layers_above_count_their_adapters_only() -> None:
    """Under LoRA on q, v at Llama 3 8B (r 8): each layer's A and B, 8·(4,096 + 4,096) + 8·(4,096 + 1,024)
    = 106,496 parameters; the layers above layer i hold (31 − i) of them out of 32."""
    setup = SETUPS[0]
    params = count_params(setup.model)
    assert layer_trainable(setup, params, 0) == 8 * (4096 + 4096) + 8 * (4096 + 1024) == 106_496
    above, whole = shares(setup, params)
    assert whole == 32 * 106_496
    assert [above(i) for i in (0, 30, 31)] == [31 * 106_496, 106_496, 0]


def test_frozen_layers_make_no_share_and_full_training_keeps_every_parameter() -> None:
    frozen = SETUPS[3]  # layers 0-15 frozen
    params = count_params(frozen.model)
    above, whole = shares(frozen, params)
    assert above(0) == above(15) == 16 * params.layer.total
    assert whole == params.total - 16 * params.layer.total
    plain = build_setup("llama-3-8b", seq=256)
    above, whole = shares(plain, params)
    assert whole == params.total and above(0) == 31 * params.layer.total
    # a pipeline stage's chunk: its indices are not the model's, every parameter's share kept
    chunk, everything = shares(frozen, params, whole_model=False), shares(plain, params)
    assert chunk[1] == everything[1]
    assert [chunk[0](i) for i in range(32)] == [everything[0](i) for i in range(32)]
