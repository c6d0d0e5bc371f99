"""transformers' Llama-like layers at their real widths (two layers, s 512, bf16-mixed, fake tensors): the
layer backward measured (``measure.frameworks.hf_peak``) against the estimate's.

The model makes the rotary tables cos and sin once per forward (``self.rotary_emb``) and hands them to
every layer; only the layers' rotary muls keep them, so layer 0's rotary backward frees them, before its
projections' and its attention norm's backward, the moment that tops the layer backward
(``attention.constants.tables_freed_by_layer0``). Before, that moment counted them: 4·rot B a token over
without checkpointing (Llama 3 8B, Mistral 7B, Qwen3 8B, Command R: 262,144 B; Phi-3-mini, head dim 96:
196,608 B; OLMo-2 7B's fp32 tables 524,288 B, Falcon-7B's 131,072 B and StableLM 2's 32,768 B in their
own tests). Under checkpointing the checkpointed layer's ``partial`` keeps ``position_embeddings`` to its
backward's end: nothing freed, as before; the int64 [s] position ids it binds too are modelled
(``attention.constants.checkpointed_position_ids``)."""

from __future__ import annotations

import pytest

from memplan.blocks.attention.constants import tables_freed_by_layer0
from memplan.blocks.inventory import Dims
from memplan.config import Impl, Setup
from tests.hf.harness import hf_setup, layer_difference

S = 512
CASES = [
    hf_setup(name, seq=S, checkpointing=checkpointing)
    for name in ("llama-3-8b", "mistral-7b", "qwen3-8b", "phi-3-mini")
    for checkpointing in ("none", "full")
]


@pytest.mark.parametrize(
    "setup", CASES, ids=lambda s: f"{s.model.name}-{s.strategy.checkpointing.name.lower()}"
)
def test_layer_backward_is_transformers(setup: Setup) -> None:
    assert layer_difference(setup) == 0


def test_tables_freed_are_the_rotary_tables() -> None:
    """cos and sin [s, rot] in the activation dtype (bf16) or OLMo-2's fp32; none under checkpointing
    (the layers' partials keep them) nor for memplan's reference model (its tables stay to the end)."""

    def freed(name: str, **kw: str) -> int:
        setup = hf_setup(name, seq=S, **kw)
        return tables_freed_by_layer0(setup, Dims.of(setup))

    assert freed("llama-3-8b") == 2 * S * 128 * 2 == 262_144
    assert freed("phi-3-mini") == 2 * S * 96 * 2 == 196_608
    assert freed("olmo-2-7b") == 2 * S * 128 * 4 == 524_288
    assert freed("falcon-7b") == 2 * S * 64 * 2 == 131_072
    assert freed("llama-3-8b", checkpointing="full") == 0
    reference = hf_setup("llama-3-8b", seq=S, impl=Impl.REFERENCE)
    assert tables_freed_by_layer0(reference, Dims.of(reference)) == 0
