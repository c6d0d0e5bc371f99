"""torchtitan's FSDP2 on a pipeline rank in the estimate's moments (``analytic.fsdp.moments``,
``analytic.peak``), by hand on the tiny model; the same figures are measured per rank on torch's fake
process group in tests/hf/test_torchtitan_vpp.py.

torch 2.13's ``PipelineStage`` runs every micro-batch's backward with ``set_reshard_after_backward(False)``
and ``set_requires_gradient_sync(False)`` and reduce-scatters once, in ``perform_reduce_grad`` after the
stage's last backward; FSDP2 meanwhile casts each unsharded gradient to the reduce dtype (fp32) and
accumulates into it (``FSDPParam.to_accumulated_grad_if_needed``, ``accumulate_unsharded_grad_if_needed``).

The tiny model (h 64, 4 heads, 2 kv heads, d 16, f 128, v 256, untied), elements: a layer wqkv
(4 + 2·2)·16 × 64 = 8,192, wo 64 × 64 = 4,096, w1 w3 w2 3 × 128 × 64 = 24,576, two norms 128: 36,992;
the embedding 256 × 64 = 16,384; the final norm and lm head 64 + 16,384 = 16,448.
"""

from __future__ import annotations

from typing import Any

from memplan.api import build_setup
from memplan.config import Impl, ImplConfig, ModelConfig, Setup
from memplan.engine import Result, estimate
from memplan.presets import load_model_preset

LAYER, EMBED, HEAD = 36_992, 16_384, 16_448


def tiny(layers: int, zero: int, pp: int = 2, n: int = 4, **parallel: Any) -> Result:
    """The tiny model cut to ``layers`` under torchtitan, ZeRO-``zero`` over dp 2, ``n`` micro-batches."""
    m = ModelConfig.model_validate({**load_model_preset("tiny").model.model_dump(), "num_layers": layers})
    data = build_setup(m, seq=32, batch=2, impl=ImplConfig(impl=Impl.TORCHTITAN)).model_dump()
    data["parallel"] = {**data["parallel"], "pp": pp, **parallel}
    data["training"] = {**data["training"], "grad_accum": n}
    data["strategy"] = {**data["strategy"], "dp": 2, "zero": zero}
    return estimate(Setup.model_validate(data))


def test_zero2_shards_beside_are_the_stages_own() -> None:
    """ZeRO-2 (``reshard_after_forward=False``), pp 2 × dp 2, 2 layers: stage 0 holds the embedding and
    layer 0 (16,384 + 36,992 = 53,376 el), stage 1 layer 1 and [norm, lm_head] (36,992 + 16,448 = 53,440).
    The fp32 shards beside the bf16 units are each stage's own half: 4 B · E/2 — stage 0 not the head's
    (+32,896 B counted before), stage 1 not the embedding's (+32,768 B)."""
    r = tiny(2, zero=2)
    for plan, elements in zip(r.stages, (EMBED + LAYER, LAYER + HEAD), strict=True):
        moment = plan.peak.moments["layer backward"]
        bf16_units = 2 * elements  # the estimate's ZeRO-2 weights: the gathered copy
        assert plan.states.weights == bf16_units
        assert moment["weights"] == bf16_units + 4 * elements // 2


def test_zero2_shards_beside_cover_every_chunk_of_the_rank() -> None:
    """pp 2 × vpp 2 over 6 layers (torchtitan's cut: 1, 2, 2, 1 layers; rank 0 holds virtual stages 0
    and 2: the embedding + layer 0, layers 3 and 4): 16,384 + 3 · 36,992 = 127,360 el, all its chunks'
    shards (4 B · E/2 = 254,720 B), not its largest chunk's with the embedding and head."""
    r = tiny(6, zero=2, vpp=2, pp_layers=(1, 2, 2, 1))
    first = r.stages[0]
    assert first.stage.index == 0 and first.stage.chunks_of == (1, 2)
    elements = EMBED + 3 * LAYER
    assert first.peak.moments["layer backward"]["weights"] == 2 * elements + 4 * elements // 2


def test_unsharded_gradients_are_held_until_the_reduce() -> None:
    """ZeRO-3, pp 2 × dp 2, 4 micro-batches. Stage 1 (53,440 el): in every backward moment the stage's
    unsharded fp32 gradients of the earlier micro-batches (4 B · 53,440 = 213,760 B), not its fp32 shards
    (106,880 B); at the optimizer step only the shards. Its units are gathered in bf16 throughout, the
    embedding's backward included (rank 0: 2 B · 53,376 beside its shards)."""
    r = tiny(2, zero=3)
    first, last = r.stages
    for plan, elements in ((first, EMBED + LAYER), (last, LAYER + HEAD)):
        moments = plan.peak.moments
        shards = 4 * elements // 2
        assert plan.states.gradients == shards
        for name in ("layer backward", "embedding backward"):
            assert moments[name]["gradients"] == 4 * elements
            assert moments[name]["weights"] == shards + 2 * elements
        assert moments["optimizer step"]["gradients"] == shards
    assert last.peak.moments["loss backward"]["gradients"] == 4 * (LAYER + HEAD)


def test_bf16_reduction_accumulates_in_bf16() -> None:
    """``--reduce-dtype bf16``: the reduce dtype is the gathered parameters' (``to_accumulated_grad_if_
    needed`` returns early), the gradients accumulate in ``.grad`` in bf16: 2 B · 53,440 on stage 1."""
    m = ModelConfig.model_validate({**load_model_preset("tiny").model.model_dump(), "num_layers": 2})
    data = build_setup(m, seq=32, batch=2, impl=ImplConfig(impl=Impl.TORCHTITAN)).model_dump()
    data["parallel"] = {**data["parallel"], "pp": 2}
    data["training"] = {**data["training"], "grad_accum": 4}
    data["strategy"] = {**data["strategy"], "dp": 2, "zero": 3, "reduce_dtype": "bf16"}
    last = estimate(Setup.model_validate(data)).stages[1]
    assert last.peak.moments["layer backward"]["gradients"] == 2 * (LAYER + HEAD)


def test_without_a_pipeline_the_gradients_stay_sharded() -> None:
    """No pp (ZeRO-3 over dp 2, 4 micro-batches): the trainer reduce-scatters every micro-batch, the
    moments hold the fp32 shards of the earlier ones (4 B · 106,816/2 = 213,632 B)."""
    r = tiny(2, zero=3, pp=1)
    assert r.stages[0].peak.moments["layer backward"]["gradients"] == 4 * (EMBED + 2 * LAYER + HEAD) // 2


def test_the_allocation_stream_holds_the_unsharded_gradients() -> None:
    """The replayed stream (``alloc_stream``) reaches the estimate's default-stream peak (plus cuBLAS's
    workspaces) on a pipeline rank too: its moments' gradients are the unsharded ones FSDP2 accumulates
    on the default stream until the stage's last backward, not the reduce-scatter stream's shards (which
    the stream leaves to that stream's pool off a pipeline). Llama 3 8B at 2,048 tokens, pp 2 × dp 4,
    ZeRO-2/3, with and without FullAC, 1F1B and interleaved, tp 2 + SP: before, the replay's allocated peak
    was 22.75 GiB for a 37.64 GiB peak (the 14.96 GiB of unsharded fp32 gradients missing)."""
    from memplan.alloc_stream import stream
    from memplan.analytic.allocator import replay
    from memplan.config import Parallel
    from memplan.presets import load_gpu
    from memplan.reserved import cublas_workspace, cublas_workspaces

    gpu = load_gpu("h100-sxm")
    titan = ImplConfig(impl=Impl.TORCHTITAN)
    for zero, par, ckpt in [
        (3, Parallel(pp=2), "full"),
        (3, Parallel(pp=2), "none"),
        (3, Parallel(pp=2, vpp=2), "full"),
        (2, Parallel(pp=2, tp=2, sp=True), "full"),
    ]:
        setup = build_setup(
            "llama-3-8b",
            seq=2048,
            dp=4,
            zero=zero,
            parallel=par,
            grad_accum=4,
            impl=titan,
            checkpointing=ckpt,
        )
        p = estimate(setup)
        requested = replay(stream(p, cublas_workspace(gpu))).requested_peak
        assert requested == p.device.peak.default_stream_bytes + cublas_workspaces(gpu), (zero, par, ckpt)
