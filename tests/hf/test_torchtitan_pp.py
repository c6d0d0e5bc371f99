"""``--impl torchtitan --pp P``: torchtitan's layer placement, and one pipeline stage of torchtitan's own
split model under ``Schedule1F1B`` on torch's fake process group against the estimate for that stage —
saved bytes per layer, what the schedule holds (sent outputs, the last stage's logits, receive buffers)
and the stage's parameters, to the byte (``memplan.measure.distributed.titan_pp``)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

pytest.importorskip("torchtitan.models.llama3")

from memplan.blocks.inventory import Scope
from memplan.config import Impl, Setup
from memplan.config.impl_rules import titan_stage_layers
from memplan.engine import at_stage, estimate
from memplan.measure.distributed.titan_pp import StageRun, measure_titan_stage
from tests.hf.harness import hf_setup


def piped(setup: Setup, pp: int, n: int, **parallel: Any) -> Setup:
    """``setup`` on ``pp`` pipeline stages over ``n`` micro-batches, validated again."""
    data = setup.model_dump()
    data["parallel"] = {**data["parallel"], "pp": pp, "pp_layers": None, **parallel}
    data["training"] = {**data["training"], "grad_accum": n}
    return Setup.model_validate(data)


def held(run: StageRun) -> dict[str, tuple[tuple[int, ...], int]]:
    """The schedule's holds the run recorded: name → (shape, count)."""
    shapes = {r.name: r.shape for r in run.records if r.name.startswith("pp.")}
    counts = Counter(r.name for r in run.records if r.name.startswith("pp."))
    return {name: (shapes[name], counts[name]) for name in counts}


def estimated_layer(est: Any, layers: int) -> int:
    """One layer's bytes on the stage: its layer-scope tensors, each times its instances alive at once,
    over the stage's ``layers``."""
    total = sum(k.bytes * k.count for k in est.tensors if k.scope is Scope.LAYER)
    assert total % layers == 0
    return total // layers


def estimated_held(est: Any) -> dict[str, tuple[tuple[int, ...], int]]:
    return {k.name: (k.shape, k.count) for k in est.tensors if k.name.startswith("pp.")}


@pytest.mark.parametrize("layers", [6, 16, 32, 80, 126])
@pytest.mark.parametrize("pp", [2, 3, 4, 8, 16])
def test_placement_is_torchtitans(layers: int, pp: int) -> None:
    """``titan_stage_layers`` against torchtitan's own ``_generate_llm_fqn_per_model_part`` (weights 1, 1)."""
    from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part

    if pp > (layers + 2) // 2:  # torchtitan refuses a stage whose share is under its weight
        pytest.skip("torchtitan refuses this split")
    names = _generate_llm_fqn_per_model_part(pp, layers, 1, 1)
    assert titan_stage_layers(layers, pp) == tuple(sum(n.startswith("layers.") for n in s) for s in names)


def test_placement_by_hand() -> None:
    # 126 + 2 = 128 = 16·8: 8 each, the first and last one less (Llama 3 405B's published layout)
    assert titan_stage_layers(126, 16) == (7, *[8] * 14, 7)
    # 16 + 2 = 18 = 4·4 + 2: 5, 5, 4, 4, the first and last one less
    assert titan_stage_layers(16, 4) == (4, 5, 4, 3)
    # the setup takes it as its --pp-layers; one given is kept
    base = hf_setup("llama-3-8b", layers=16, seq=64, impl=Impl.TORCHTITAN)
    assert piped(base, 4, 4).parallel.pp_layers == (4, 5, 4, 3)
    assert piped(base, 4, 4, pp_layers=(4, 4, 4, 4)).parallel.pp_layers == (4, 4, 4, 4)
    with pytest.raises(ValueError, match="leaves a stage without a layer"):
        piped(hf_setup("tiny", seq=32, impl=Impl.TORCHTITAN), 4, 4)  # 2 + 2 = 4: 0, 1, 1, 0


B, S, H, V, F = 1, 64, 4096, 128256, 14336  # llama-3-8b's widths, bf16
X = B * S * H * 2  # one [b, s, h] bf16 boundary tensor
# One layer's saves (tests/hf/test_torchtitan_ranks.py at t = 1): two norms (fp32 x and x·rstd, rstd),
# W_QKV's and W1/W3's bf16 inputs, the RoPE cache [s, d/2] complex64, q k v out (32 + 8 + 8 + 32 heads of
# 128), the fp32 lse [32, s], the MLP's four [s, f]
ROPE = S * 64 * 8
LAYER = 2 * (2 * B * S * H * 4 + B * S * 4) + 2 * X + ROPE + 80 * B * S * 128 * 2 + 32 * B * S * 4
LAYER += 4 * B * S * F * 2
PARAMS_LAYER = 2 * ((32 + 16) * 128 * H + H * H + 3 * F * H + 2 * H)  # wqkv, wo, w1 w2 w3, two norms


@pytest.fixture(scope="module")
def small() -> tuple[Setup, Any]:
    """6 layers over pp 3 (torchtitan: 8 = 3·2 + 2 → 3, 3, 2 less the weights: 2, 3, 1), n = 5."""
    setup = piped(hf_setup("llama-3-8b", layers=6, seq=S, impl=Impl.TORCHTITAN), 3, 5)
    assert setup.parallel.pp_layers == (2, 3, 1)
    return setup, estimate(setup)


@pytest.mark.parametrize("index", [0, 1, 2])
def test_stage_saves_what_the_estimate_says(small: tuple[Setup, Any], index: int) -> None:
    setup, est = small
    e, run = at_stage(est, index), measure_titan_stage(setup, index)
    n = len(run.layers)
    assert [run.layer_bytes(i) for i in run.layers] == [estimated_layer(e, n)] * n
    assert held(run) == estimated_held(e)
    assert run.activations == e.activations
    assert run.param_bytes == e.device.states.weights
    # By hand. Stage i runs w = min(n, p − i) forwards before its first backward: 3, 2, 1; each layer keeps
    # w copies of its saves but one RoPE cache (its module buffer).
    w = (3, 2, 1)[index]
    assert [run.layer_bytes(i) for i in run.layers] == [w * (LAYER - ROPE) + ROPE] * len(run.layers)
    layers = len(run.layers) * (w * (LAYER - ROPE) + ROPE)
    if index == 0:
        # w sent outputs in fwd_cache, + send_work's (n = 5 ≥ 2w − 1); a gradient buffer per micro-batch;
        # the embedding's int64 ids per forward in flight
        assert held(run) == {"pp.output": ((B, S, H), 3 + 1), "pp.grad_recv": ((B, S, H), 5)}
        assert run.activations == layers + 4 * X + 5 * X + 3 * B * S * 8
        assert run.param_bytes == 2 * V * H + 2 * PARAMS_LAYER
    if index == 1:
        assert held(run) == {
            "pp.output": ((B, S, H), 2 + 1),
            "pp.recv": ((B, S, H), 5),
            "pp.grad_recv": ((B, S, H), 5),
        }
        assert run.activations == layers + 3 * X + 5 * X + 5 * X
        assert run.param_bytes == 3 * PARAMS_LAYER
    if index == 2:
        # the logits [b, s, v] bf16 the schedule's loss_fn reads, in fwd_cache until their backward; the
        # head: final norm (fp32 x, x·rstd; rstd), lm head input, fp32 log-probs, labels, the token count
        # (int64) and the loss's fp32 scalar
        assert held(run) == {"pp.recv": ((B, S, H), 5), "pp.logits": ((B, S, V), 1)}
        head = 2 * B * S * H * 4 + B * S * 4 + X + B * S * V * 4 + B * S * 8 + 8 + 4
        assert run.activations == layers + 5 * X + B * S * V * 2 + head
        assert run.param_bytes == PARAMS_LAYER + 2 * H + 2 * V * H


def test_send_work_output_needs_enough_micro_batches() -> None:
    """Stage 0 of pp 3 at n = 4 (< 2w − 1 = 5): B(0), F(3), B(1) ends the forwards; the output send_work
    holds is never one more beside w = 3 in flight: 3 outputs, estimated and measured."""
    setup = piped(hf_setup("llama-3-8b", layers=6, seq=S, impl=Impl.TORCHTITAN), 3, 4)
    e, run = at_stage(estimate(setup), 0), measure_titan_stage(setup, 0)
    assert held(run)["pp.output"] == estimated_held(e)["pp.output"] == ((B, S, H), 3)
    assert run.activations == e.activations


def test_real_tensors_save_what_fake_ones_do() -> None:
    """The tiny model on pp 2 (1 layer each) with real (uninitialised) tensors over the fake group."""
    setup = piped(hf_setup("tiny", layers=2, seq=32, impl=Impl.TORCHTITAN), 2, 3)
    est = estimate(setup)
    for index in (0, 1):
        real, fake = measure_titan_stage(setup, index, fake=False), measure_titan_stage(setup, index)
        assert sorted((r.shape, r.dtype, r.bytes) for r in real.records) == sorted(
            (r.shape, r.dtype, r.bytes) for r in fake.records
        )
        assert real.activations == at_stage(est, index).activations


def test_full_scale_405b_last_stage() -> None:
    """Llama 3 405B's widths and 126 layers, seq 8192, pp 16 over 16 micro-batches: torchtitan places 7
    layers on the last stage; rank 15 of 16 keeps what the estimate says, to the byte."""
    setup = piped(hf_setup("llama-3.1-405b", layers=126, seq=8192, impl=Impl.TORCHTITAN), 16, 16)
    e, run = at_stage(estimate(setup), 15), measure_titan_stage(setup, 15)
    assert len(run.layers) == 7
    assert [run.layer_bytes(i) for i in run.layers] == [estimated_layer(e, 7)] * 7
    assert held(run) == estimated_held(e)
    assert run.activations == e.activations
    assert run.param_bytes == e.device.states.weights
    h, v, s = 16384, 128256, 8192
    assert held(run) == {"pp.recv": ((1, s, h), 16), "pp.logits": ((1, s, v), 1)}


def test_tied_embeddings_with_pp_are_refused() -> None:
    """torchtitan's ``Decoder.Config.update_from_config`` raises on weight tying with pp > 1."""
    with pytest.raises(ValueError, match="tied embeddings"):
        piped(hf_setup("llama-3.2-1b", layers=4, seq=S, impl=Impl.TORCHTITAN), 2, 4)


def test_searched_layouts_place_as_torchtitan() -> None:
    """``search.space.layouts`` of a torchtitan setup: each 1F1B pipeline carries torchtitan's placement
    (what the Setup validator fills in; the search's copies are not re-validated): 32 + 2 = 34 layers'
    worth over 4 stages is 9, 9, 8, 8 less the weights."""
    from memplan.search.space import Space, layouts

    base = hf_setup("llama-3-8b", layers=32, seq=S, impl=Impl.TORCHTITAN)
    found = {x.parallel.pp: x.parallel.pp_layers for x in layouts(base, 8, Space(vpp=(1,)))}
    assert found[4] == (8, 9, 8, 7)
    assert found[1] is None


@pytest.mark.parametrize(
    "names",
    [
        ["tok_embeddings", "layers.0", "layers.1"],
        ["layers.3", "layers.5"],
        ["layers.7", "norm", "output"],
        ["tok_embeddings"],  # a virtual stage of the embedding alone: no layer kept
    ],
)
def test_split_part_is_torchtitans_split_module(names: list[str]) -> None:
    """``titan.split_part`` (a copy of only the kept layers, then ``_split_module``) makes the module
    torchtitan's ``_split_module`` of the whole model makes — the same modules, names, classes, parameters
    and buffers (shape, dtype, device), training flags and tied tensors — and leaves the model whole."""
    import torch
    from torchtitan.distributed.pipeline_parallel import _split_module

    from memplan.measure.distributed.titan import meta_model, split_part

    setup = hf_setup("llama-3-8b", layers=8, seq=S, impl=Impl.TORCHTITAN)
    model = meta_model(setup)
    before = [n for n, _ in model.named_modules()]

    def described(m: torch.nn.Module) -> list[object]:
        mods = [(n, type(x).__name__, x.training) for n, x in m.named_modules(remove_duplicate=False)]
        tensors = [
            (n, tuple(t.shape), t.dtype, t.device.type, t.requires_grad)
            for n, t in [
                *m.named_parameters(remove_duplicate=False),
                *m.named_buffers(remove_duplicate=False),
            ]
        ]
        distinct = len({id(t) for t in [*m.parameters(), *m.buffers()]})
        return [mods, tensors, distinct, sorted(k for k in vars(m) if not k.startswith("_"))]

    ours, theirs = split_part(model, names), _split_module(model, names)
    assert described(ours) == described(theirs)
    assert [n for n, _ in model.named_modules()] == before  # the whole model unchanged
    assert all(p is not q for p in ours.parameters() for q in model.parameters())  # a copy
