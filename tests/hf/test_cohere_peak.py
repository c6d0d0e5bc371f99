"""transformers' Cohere (Command R) step at its real widths under fake tensors: the final norm's and the
layers' backward moments against the estimate's (``measure.frameworks.hf_peak``).

``CohereLayerNorm`` runs in Python fp32 ops: its backward tops at its weight's product
(``blocks.norm.python_layernorm_backward``: dY in fp32, d(normed) and dY · normed [T, h] fp32 and their
fp32 [h] sum, every save still held), not at native layer_norm's dY and dX. Before, the final norm's
backward read 33,570,816 B under the measured step (without and with checkpointing), the layer's
50,380,800 B under without checkpointing (the one norm of the parallel layer, at layer 0's backward) and
58,736,640 B under full checkpointing (the re-run's norm keeps no input of its own: one [T, h] more,
``layer_saves.checkpoint_shared_bytes``; its weight's [h] sum after the re-run's saves are returned)."""

from __future__ import annotations

from typing import Any

import pytest

from memplan.config import ModelConfig, Setup
from memplan.engine import estimate
from memplan.measure.frameworks.hf_peak import measure_hf_peak
from memplan.measure.instruments.moments import estimated_moments
from memplan.presets import load_model_preset
from memplan.presets.hf import model_from_hf_config
from tests.hf.harness import hf_setup
from tests.hf.test_cohere import COMMAND_R_PLUS

S = 512
CASES = [hf_setup("command-r", seq=S), hf_setup("command-r", seq=S, checkpointing="full")]


def assert_norm_moments_exact(setup: Setup) -> None:
    """transformers' step against the estimate: the final norm's moment 8 B under (``hf_peak``'s NB: the
    labels at one sequence a micro-batch), the layer's exact."""
    est = estimated_moments(estimate(setup))
    measured, buffers = measure_hf_peak(setup)
    final, layer = measured["final norm backward"], measured["layer backward"]
    assert final is not None and layer is not None
    assert final - buffers - est["final norm backward"] == -8
    assert layer - buffers - est["layer backward"] == 0


@pytest.mark.parametrize("setup", CASES, ids=lambda s: s.strategy.checkpointing.name.lower())
def test_norm_backward_moments(setup: Setup) -> None:
    """Exact but for the known NB (``hf_peak``): at one sequence a micro-batch the final norm's moment 8 B
    under. (Under checkpointing the int64 [s] position ids the checkpointed layers hold are modelled:
    ``constants.checkpointed_position_ids``, 8·s B under before.) Without
    checkpointing the layer's moment follows layer 0's rotary backward, which frees the rotary tables cos
    and sin [s, 128] bf16 (``constants.tables_freed_by_layer0``: 262,144 B over before)."""
    assert_norm_moments_exact(setup)


def lora(checkpointing: str) -> Setup:
    """Command R under LoRA (peft's q, v adapters): every norm frozen."""
    from memplan.config import FineTune, Method

    setup = hf_setup("command-r", seq=S, checkpointing=checkpointing)
    return setup.model_copy(update={"finetune": FineTune(method=Method.LORA)})


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_frozen_final_norm_backward_tops_at_pow(checkpointing: str) -> None:
    """A frozen ``CohereLayerNorm`` makes no weight gradient: its backward tops at ``pow``'s, five fp32
    [T, h] beside the first x − mean and rstd, the second x − mean and the weight copy freed by then
    (``norm.python_layernorm_frozen_backward``: 16·T·h − 4·h beyond the saves). Read before as native
    layer_norm's dY and dX (4·T·h at 16 bits): 50,298,880 B under. Exact now but for the labels' 8 B."""
    from memplan.blocks.inventory import Dims
    from memplan.blocks.norm import python_layernorm_frozen_backward

    setup = lora(checkpointing)
    h = setup.model.hidden_size
    assert python_layernorm_frozen_backward(Dims.of(setup)) == 16 * S * h - 4 * h
    assert_norm_moments_exact(setup)


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_long_sequence_tops_at_the_fp32_rotary_backward(checkpointing: str) -> None:
    """At s 4,096 Command R's layer tops in its rotary embedding's backward, which runs in fp32
    (``apply_rotary_pos_emb``'s ``q.float()``, ``k.float()``): at k's ``rotate_half`` backward sum, q's and
    k's fp32 gradients, the two ``slice_backward`` halves and their sum, the attention core's saves and the
    kernel's dq, dk and dO gone (``analytic.moments.rotary_backward``). Before: 69,173,248 B under
    (67,108,864 B under full checkpointing); exact now, and at s 8,192 (checked, not in the suite)."""
    setup = hf_setup("command-r", seq=4096, checkpointing=checkpointing)
    assert_norm_moments_exact(setup)


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_narrow_layer_tops_at_the_fp32_rotary_backward(checkpointing: str) -> None:
    """The same moment tops a narrow layer (h 64, 4 heads of 16, s 64): 31,744 B under before the shared
    norm's waiting MLP gradient and this moment were modelled, 7,168 B with the first alone."""
    m = load_model_preset("command-r").model
    fields = {"hidden_size": 64, "num_heads": 4, "num_kv_heads": 4, "head_dim": 16, "ffn_size": 128}
    narrow = m.model_copy(update={**fields, "vocab_size": 256, "num_layers": 2})
    assert_norm_moments_exact(hf_setup(narrow, seq=64, checkpointing=checkpointing))


def command_r_plus(**fields: Any) -> ModelConfig:
    """Command R+ (96 heads, 8 kv heads of 128, its q/k LayerNorms) from its config.json, ``fields``
    replaced."""
    return model_from_hf_config({**COMMAND_R_PLUS, **fields}, "command-r-plus")


@pytest.mark.parametrize(
    ("fields", "seq", "checkpointing"),
    [
        ({}, 4096, "none"),
        ({}, 4096, "full"),
        (
            {
                "hidden_size": 1024,
                "num_attention_heads": 16,
                "num_key_value_heads": 4,
                "intermediate_size": 2816,
            },
            512,
            "none",
        ),
    ],
    ids=["command-r-plus-none", "command-r-plus-full", "narrow-gqa"],
)
def test_grouped_query_layer_tops_at_qs_rotary_backward(
    fields: dict[str, Any], seq: int, checkpointing: str
) -> None:
    """Under grouped-query attention k's rotation is narrow, and the top is q's ``rotate_half`` backward
    after k's: q's upcast gradient, dq·sin and its two ``slice_backward`` halves, 4 fp32 [T, a·d], beside
    k's finished fp32 [T, kv·d] gradient; without checkpointing layer 0's sin table is released by then
    (``rotary_backward.fp32_rotary_moment``). Before, the moment was modelled under multi-head attention
    alone: Command R+ at s 4,096 207,142,912 B under (208,191,488 B under full checkpointing), the narrow
    layer (h 1,024, 16 heads, 4 kv heads) at s 512 1,282,048 B under; exact now, and at s 2,048 and 8,192
    (checked, not in the suite)."""
    setup = hf_setup(command_r_plus(**fields), seq=seq, checkpointing=checkpointing)
    assert_norm_moments_exact(setup)


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_a_shared_norm_has_no_mlp_norm_moment(checkpointing: str) -> None:
    """Cohere's one norm feeds the attention and the MLP: its backward runs once, after both branches',
    so the moment of a separate MLP norm's backward (the MLP's gradients made, the norm's chain beside
    them) never happens. It had been a candidate, and topped a layer whose MLP is narrower than its width
    (h 512, f 256, 8 heads, 2 kv heads, s 2,048): 1,112,064 B over; exact now."""
    fields = {
        "hidden_size": 512,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 256,
    }
    assert_norm_moments_exact(hf_setup(command_r_plus(**fields), seq=2048, checkpointing=checkpointing))
