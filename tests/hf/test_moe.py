"""transformers' mixtures of experts (``modeling_mixtral.py``, ``modeling_qwen2_moe.py``, their default
``grouped_mm`` experts) against ``--impl hf``: SDPA and eager, with and without transformers' gradient
checkpointing, under fake tensors at Mixtral-8x7B's and Qwen1.5-MoE-A2.7B's widths; and real tiny tensors
with the routing the random-init router really chose (unbalanced), where the estimate's assumption (dropless,
S = T·k slots, bytes independent of the split) must give the exact bytes and FLOPs."""

from __future__ import annotations

from typing import Any

import pytest

from memplan.config import ExpertsImpl
from memplan.contract import to_json
from memplan.engine import Result, estimate
from memplan.measure.compare.impl import paired_tensors
from memplan.measure.frameworks.hf import measure_hf
from memplan.measure.instruments.measured import Measured
from memplan.presets import load_model_preset
from tests.hf.harness import MOE_WIDTHS, check_hf, hf_setup, with_experts

PRESETS = ["mixtral-8x7b", "qwen1.5-moe-a2.7b"]
SEQ = 256
TINY_SEQ = 128  # real tensors: 128 tokens route unevenly enough


def same_flops(est: Result, meas: Measured) -> None:
    """FLOPs per phase equal (grouped_mm counted by ``instruments.grouped_mm_flop``)."""
    f = est.flops
    assert (f.forward, f.backward, f.recompute) == tuple(
        meas.flops[k] for k in ("forward", "backward", "recompute")
    )


def moe_exact(est: Result, meas: Measured) -> None:
    """Every MoE tensor of layer 0 (router, dispatch, experts, shared expert) has a partner of equal bytes,
    and nothing the experts' modules saved is left unpaired."""
    rows = paired_tensors(est, meas)
    moe = [r for r in rows if r["name"].startswith(("moe.", "mlp.", "— ↔ mlp."))]
    assert moe and all(r["delta_bytes"] == 0 for r in moe), moe


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_moe_sdpa(preset: str, checkpointing: str) -> None:
    est, meas = check_hf(hf_setup(preset, seq=SEQ, checkpointing=checkpointing))
    same_flops(est, meas)
    if checkpointing == "none":
        moe_exact(est, meas)
        assert est.activations == meas.activations  # exact: Mixtral 219,679,820 B, Qwen 250,321,388 B


@pytest.mark.parametrize("preset", PRESETS)
def test_moe_eager_full(preset: str) -> None:
    est, meas = check_hf(hf_setup(preset, seq=SEQ, attention="eager", checkpointing="full"))
    same_flops(est, meas)


@pytest.mark.parametrize("preset", PRESETS)
def test_moe_eager(preset: str) -> None:
    """The MoE block exact; the whole layer waits for the Llama family's eager-attention fact."""
    setup = hf_setup(preset, seq=SEQ, attention="eager")
    est, meas = estimate(setup), measure_hf(setup)
    moe_exact(est, meas)
    same_flops(est, meas)


@pytest.mark.parametrize("preset", PRESETS)
def test_routing_in_json(preset: str) -> None:
    """The JSON states the routing assumption: dropless, S = T·k slots."""
    setup = hf_setup(preset, seq=SEQ)
    moe = setup.model.moe
    assert moe is not None
    routing = to_json(estimate(setup))["moe"]["routing"]
    assert (routing["tokens"], routing["slots"]) == (SEQ, SEQ * moe.top_k)
    assert routing["assumption"].startswith(f"dropless top-{moe.top_k}")


def tiny(preset: str) -> dict[str, Any]:
    """The preset at toy widths (real tensors on CPU in a second): its top-k, at most 16 experts (the eager
    loop runs one step per expert), the shared expert narrowed."""
    moe = load_model_preset(preset).model.moe
    assert moe is not None
    shared = {"shared_ffn": 48} if moe.shared_experts else {}
    shared |= {"experts": min(moe.experts, 16)}
    return {**MOE_WIDTHS, "moe": moe.model_dump() | shared}


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("experts", ["grouped_mm", "eager"])
def test_moe_realised_routing(preset: str, experts: str) -> None:
    """Real tensors: whatever the router chose (unbalanced), the bytes and FLOPs are the estimate's, with
    transformers' grouped_mm experts and with its eager loop (per-expert shapes: real tensors only)."""
    setup = hf_setup(preset, seq=TINY_SEQ, **tiny(preset))
    setup = with_experts(setup, experts)
    moe = setup.model.moe
    assert moe is not None
    est, meas = check_hf(setup, fake=False)
    assert len(meas.routing) == setup.model.num_layers
    for counts in meas.routing:
        assert sum(counts) == moe.slots(TINY_SEQ) and max(counts) > min(counts)  # dropless, not balanced
    assert est.activations == meas.activations
    same_flops(est, meas)


@pytest.mark.parametrize(
    ("preset", "fields", "field"),
    [
        ("mixtral-8x7b", {"mlp": "gelu"}, "mlp"),
        ("mixtral-8x7b", {"family": "qwen2_moe"}, "shared_gate"),
        ("qwen1.5-moe-a2.7b", {"family": "mixtral"}, "shared_experts"),
        (
            "qwen1.5-moe-a2.7b",
            {"moe": {"experts": 60, "top_k": 4, "capacity_factor": 1.25}},
            "capacity_factor",
        ),
    ],
)
def test_moe_refused(preset: str, fields: dict[str, Any], field: str) -> None:
    """What transformers' MoE code cannot run is a one-line error naming the field."""
    with pytest.raises(ValueError, match=f"^{field}: "):
        estimate(hf_setup(preset, **fields))


def test_moe_expert_parallel_refused() -> None:
    setup = hf_setup("mixtral-8x7b", seq=SEQ)
    setup = setup.model_copy(update={"parallel": setup.parallel.model_copy(update={"ep": 8})})
    with pytest.raises(ValueError, match=r"^ep: "):
        estimate(setup)


def test_eager_experts_refused_under_fake() -> None:
    setup = hf_setup("mixtral-8x7b", layers=1, seq=16)
    setup = setup.model_copy(update={"impl": setup.impl.model_copy(update={"experts": ExpertsImpl.EAGER})})
    with pytest.raises(ValueError, match=r"^experts: "):
        measure_hf(setup)
