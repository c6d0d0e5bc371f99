"""torchtitan's Llama 3 (``torchtitan/models/llama3``, 0.3.0) against ``--impl torchtitan``: SDPA, without
and with torchtitan's ``FullAC``, at Llama-2-7B's and Llama-3-8B's widths; saved bytes per layer and in
total, and FLOPs per phase, equal to the byte and the FLOP."""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan.models.llama3")  # needs spmd_types, tyro, torch_checkpointing, triton

from memplan.config import Fp8Recipe, Impl
from memplan.engine import estimate
from memplan.measure.compare.impl import paired_tensors
from memplan.measure.compare.tensors import estimated_layers
from memplan.measure.frameworks.dispatch import check_traceable
from memplan.measure.frameworks.titan import measure_titan
from tests.hf.harness import check_titan, hf_setup

# Tied embeddings (enable_weight_tying) and a head dim apart from h / a (GQAttention's head_dim).
TIED = {"tied_embeddings": True, "head_dim": 64, "num_heads": 16, "num_kv_heads": 4}


@pytest.mark.parametrize(("preset", "fields"), [("llama-2-7b", {}), ("llama-3-8b", {}), ("llama-3-8b", TIED)])
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_llama3_sdpa(preset: str, fields: dict[str, object], checkpointing: str) -> None:
    setup = hf_setup(preset, seq=256, checkpointing=checkpointing, impl=Impl.TORCHTITAN, **fields)
    check_titan(setup)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"mlp": "gelu"}, "mlp"),
        ({"qkv_bias": True}, "qkv_bias"),
        ({"attn_dropout": 0.1}, "dropout"),
    ],
)
def test_unmappable_models_are_refused(fields: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_traceable(hf_setup("llama-3-8b", seq=256, impl=Impl.TORCHTITAN, **fields))


@pytest.mark.parametrize(
    ("options", "match"),
    [({"attention": "eager"}, "attention"), ({"checkpointing": "every-2"}, "every-K")],
)
def test_unmodelled_strategies_are_refused(options: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_traceable(hf_setup("llama-3-8b", seq=256, impl=Impl.TORCHTITAN, **options))


@pytest.mark.parametrize("fields", [{}, TIED])
def test_llama3_selective_ac(fields: dict[str, object]) -> None:
    """torchtitan's SelectiveAC: the block input and the cached mm outputs (sac · aten.mm) per layer, and
    the re-run FLOPs (W_O, W3, the attention core), equal to the byte and the FLOP."""
    setup = hf_setup("llama-3-8b", seq=256, checkpointing="selective", impl=Impl.TORCHTITAN, **fields)
    check_titan(setup)


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_llama3_float8_rowwise_keeps_what_bf16_keeps(checkpointing: str) -> None:
    """torchtitan's ``Float8LinearConverter`` (rowwise, lm_head filtered as its llama3_405b config) swaps
    every layer linear for torchao's Float8Linear, which saves the bf16 input and the weight's view: the
    saves equal the estimate's and bf16's, to the byte, at Llama-3-8B's widths."""
    pytest.importorskip("torchao.float8")
    plain = hf_setup("llama-3-8b", seq=256, checkpointing=checkpointing, impl=Impl.TORCHTITAN)
    setup = plain.model_copy(update={"impl": plain.impl.model_copy(update={"fp8": Fp8Recipe.ROWWISE})})
    est, meas = estimate(setup), measure_titan(setup)
    unpaired = [r["name"] for r in paired_tensors(est, meas) if r["delta_bytes"]]
    assert estimated_layers(est) == [meas.layer_bytes(i) for i in range(2)], unpaired
    assert est.activations == meas.activations == estimate(plain).activations, unpaired
    # The casts join the peak: above bf16 training's.
    assert est.peak.phases["layer backward"] > estimate(plain).peak.phases["layer backward"]


@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_llama3_compiled_blocks_keep_what_the_estimate_says(checkpointing: str) -> None:
    """``apply_compile``: each torchtitan block under AOTAutograd's min-cut partitioner (fake tensors, no
    kernel compiled) keeps the bytes of the compiled profile (``Profile.compiled_block`` with torchtitan's
    switches), every layer, the total and the FLOPs exact, at Llama-3-8B's widths."""
    from memplan.measure.frameworks.titan import measure_titan_compiled
    from memplan.measure.runs.compiled import compiled_comparison_json

    plain = hf_setup("llama-3-8b", seq=256, checkpointing=checkpointing, impl=Impl.TORCHTITAN)
    setup = plain.model_copy(update={"impl": plain.impl.model_copy(update={"compile": True})})
    est = estimate(setup)
    out = compiled_comparison_json(est, measure_titan_compiled(setup))
    assert out["diff"]["exact"], [r for r in out["diff"]["tensors"] if r["delta_bytes"]]
    if checkpointing == "none":  # the partitioner recomputes the fp32 norm upcasts and silu(g)
        assert est.activations < estimate(plain).activations
    if checkpointing == "selective":  # SelectiveAC's cache of W2's output, which no backward reads, is not
        # kept (dynamo's selective-checkpoint op through the partitioner); the CPU flash op's re-run keeps
        # the generator's state instead
        t, h, layers = 256, setup.model.hidden_size, setup.model.num_layers
        assert estimate(plain).activations - est.activations == layers * (2 * t * h - 5056)
