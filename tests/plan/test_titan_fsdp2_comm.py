"""torchtitan's FSDP2 collectives per step follow its reshard policy and torch's pipeline stage
(``memplan.time.comm.dp._titan_fsdp2_rows``), derived by hand on the tiny model.

Sources read (torch 2.13, torchtitan 0.3.0):
- torchtitan/distributed/fsdp.py ``apply_fsdp_to_decoder``: the embedding and every block with
  ``reshard_after_forward = get_fsdp_reshard_after_forward_policy("default", pp_enabled)`` (True without
  pp, False with it); [norm, lm_head] with ``reshard_after_forward_policy == "always"`` (False).
- FSDP2 (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py): a unit not resharded after forward
  is still unsharded at its pre-backward (no all-gather); every unit reshards after backward by default.
- torch/distributed/pipelining/stage.py: ``backward_maybe_with_nosync`` sets
  ``set_reshard_after_backward(False)`` and ``set_requires_gradient_sync(False)`` on every micro-batch's
  backward; ``perform_reduce_grad`` (after the schedule's last backward) runs each unit's
  ``post_backward`` with both True: one reduce-scatter per unit per step.

The tiny model (presets/models/tiny.toml: h 64, 4 heads, 2 kv heads, d 16, f 128, v 256, 2 layers,
untied), by FSDP2 unit:
  embedding          256 × 64                                   = 16,384
  a layer            wqkv (4 + 2·2)·16 × 64 = 8,192, wo 64 × 64 = 4,096,
                     w1, w3, w2: 3 × 128 × 64 = 24,576, two norms 2 × 64 = 128   = 36,992
  [norm, lm_head]    64 + 256 × 64                              = 16,448
  all                16,384 + 2 · 36,992 + 16,448               = 106,816
Weights all-gathered in bf16 (2 B), gradients reduce-scattered in fp32 (``--reduce-dtype fp32``, 4 B).
"""

from __future__ import annotations

from memplan.api import Options, build, build_setup
from memplan.config import Impl, ImplConfig, ModelConfig, Setup
from memplan.engine import Result, estimate
from memplan.presets import load_gpu, load_model_preset
from memplan.time.comm.collectives import communication
from memplan.time.comm.fabric import Collective
from memplan.time.comm.rows import Overlap, Phase, Row
from memplan.time.predict import predict
from memplan.time.timing import peak_flops

H100 = load_gpu("h100")
ALL = 106_816
HEAD_UNIT = 64 + 256 * 64  # [norm, lm_head]: 16,448
AG, RS = Collective.ALL_GATHER, Collective.REDUCE_SCATTER


def dp_rows(**options: object) -> list[Row]:
    o = Options(model="tiny", seq=32, batch=2, impl="torchtitan", reduce_dtype="fp32", **options)  # type: ignore[arg-type]
    return [r for r in communication(build(o).result, H100.topology)[1] if r.dimension == "dp"]


def per_step(rows: list[Row], kind: Collective) -> int:
    """Bytes of one kind of collective one device runs in a step: Σ bytes per call × calls."""
    return sum(r.bytes * r.count for r in rows if r.collective is kind)


def test_zero3_does_not_gather_the_kept_unit_again() -> None:
    """ZeRO-3 over dp 2, 4 micro-batches, no pipeline: per micro-batch every unit gathered in forward
    (106,816 el), every unit but [norm, lm_head] again in backward (106,816 − 16,448 = 90,368 el), every
    unit's gradients reduce-scattered (106,816 el, the trainer syncs each micro-batch).
      all-gather     4 · (106,816 + 90,368) · 2 B = 4 · 394,368 = 1,577,472 B
      reduce-scatter 4 · 106,816 · 4 B            = 1,709,056 B"""
    rows = dp_rows(zero=3, dp=2, gpus=2, grad_accum=4)
    got = {(r.collective, r.phase): (r.bytes, r.count, r.overlap) for r in rows}
    assert got == {
        (AG, Phase.FORWARD): (ALL * 2, 4, Overlap.FORWARD),
        (AG, Phase.BACKWARD): ((ALL - HEAD_UNIT) * 2, 4, Overlap.BACKWARD),
        (RS, Phase.BACKWARD): (ALL * 4, 4, Overlap.BACKWARD),
    }
    assert per_step(rows, AG) == 1_577_472
    assert per_step(rows, RS) == 1_709_056


def test_zero3_pipeline_gathers_and_reduces_once_per_step() -> None:
    """pp 2 × dp 2, ZeRO-3, 4 micro-batches. The busiest stage is the last (a layer and the head; the
    first has a layer and the embedding, no matmul): 36,992 + 16,448 = 53,440 el. Nothing resharded
    after forward ("default" with pp) nor after a micro-batch's backward: one all-gather of the stage per
    step, at its first forward; the gradients accumulate unsharded and are reduce-scattered once after the
    last backward, exposed.
      all-gather     53,440 · 2 B = 106,880 B, once
      reduce-scatter 53,440 · 4 B = 213,760 B, once"""
    rows = dp_rows(zero=3, dp=2, pp=2, gpus=4, grad_accum=4)
    got = {(r.collective, r.phase): (r.bytes, r.count, r.overlap) for r in rows}
    assert got == {
        (AG, Phase.STEP): (106_880, 1, Overlap.FIRST_FORWARD),
        (RS, Phase.STEP): (213_760, 1, Overlap.NONE),
    }
    # ZeRO-2 ("never") behaves the same under the pipeline
    assert dp_rows(zero=2, dp=2, pp=2, gpus=4, grad_accum=4) == rows


def test_zero2_gathers_every_micro_batch_without_a_pipeline() -> None:
    """ZeRO-2 (``reshard_after_forward=False``), dp 2, 3 micro-batches, no pipeline: each unit is
    resharded after its backward, so every micro-batch's forward gathers it (3 · 106,816 · 2 B =
    640,896 B), never a backward; 3 reduce-scatters of 106,816 · 4 B."""
    rows = dp_rows(zero=2, dp=2, gpus=2, grad_accum=3)
    assert per_step(rows, AG) == 640_896
    assert [(r.phase, r.count) for r in rows if r.collective is AG] == [(Phase.FORWARD, 3)]
    assert per_step(rows, RS) == 3 * 427_264


def test_the_reference_impl_keeps_zero3_symmetric() -> None:
    """--impl reference (memplan's own FSDP: every unit resharded after forward) still gathers the whole
    model twice per micro-batch: 2 · 2 · 106,816 · 2 B."""
    o = Options(model="tiny", seq=32, batch=2, zero=3, dp=2, gpus=2, grad_accum=2, reduce_dtype="fp32")
    rows = [r for r in communication(build(o).result, H100.topology)[1] if r.dimension == "dp"]
    assert per_step(rows, AG) == 2 * 2 * ALL * 2


def test_llama3_8b_zero3_step_time_shows_the_policy() -> None:
    """On an 8B torchtitan ZeRO-3 estimate the backward all-gathers carry the model less the [norm,
    lm_head] unit (h 4,096 + v 128,256 × h = 525,340,672 el), and under pp 2 the step's data-parallel time
    is one exposed reduce-scatter instead of four hidden ones."""
    base = {"model": "llama-3-8b", "seq": 4096, "batch": 1, "impl": "torchtitan", "reduce_dtype": "fp32"}
    flat = build(Options(**base, zero=3, gpus=8, grad_accum=2)).result  # type: ignore[arg-type]
    rows = communication(flat, H100.topology)[1]
    (fwd,) = [r for r in rows if r.collective is AG and r.phase is Phase.FORWARD]
    (bwd,) = [r for r in rows if r.collective is AG and r.phase is Phase.BACKWARD]
    assert fwd.bytes - bwd.bytes == (4096 + 128_256 * 4096) * 2
    piped = build(Options(**base, zero=3, gpus=16, pp=2, grad_accum=4)).result  # type: ignore[arg-type]
    p = predict(piped, H100, peak_flops(H100, piped.setup.training.precision))
    (rs,) = [r for r in p.communication if r.collective is RS]
    # exposed: the reduce-scatter's whole time (no compute hides it), the all-gather's beyond one forward
    assert p.exposed_s["dp"] >= rs.time_s > 0


def tiny_pipeline(layers: int, **parallel: object) -> Result:
    """The tiny model cut to ``layers`` layers under torchtitan, ZeRO-3 over dp 2, 4 micro-batches, fp32
    gradient reduction, on ``parallel``'s pipeline."""
    m = ModelConfig.model_validate({**load_model_preset("tiny").model.model_dump(), "num_layers": layers})
    data = build_setup(m, seq=32, batch=2, impl=ImplConfig(impl=Impl.TORCHTITAN)).model_dump()
    data["parallel"] = {**data["parallel"], **parallel}
    data["training"] = {**data["training"], "grad_accum": 4}
    data["strategy"] = {**data["strategy"], "dp": 2, "zero": 3, "reduce_dtype": "fp32"}
    return estimate(Setup.model_validate(data))


def test_interleaved_chunks_beyond_three_are_gathered_again() -> None:
    """pp 2 × vpp 4 (torchtitan's cut of 14 layers + the embedding and head into 8 virtual stages: 1, 2 × 6,
    1), 4 micro-batches. torch's runtime lowers rank 0's order with ``_add_unshard_reshard``
    (max_active_stages 3): its chunks are all-gathered 4, 3, 3, 1 times (``fsdp_unshards``, checked against
    torch's own lowering in tests/hf/test_torchtitan_vpp.py). Rank 0's chunks: the embedding + 1 layer
    (16,384 + 36,992 = 53,376 el), then three of 2 layers (73,984 el); rank 1's: three of 2 layers, then a
    layer + [norm, lm_head] (36,992 + 16,448 = 53,440 el), gathered 3, 3, 1, 2 times. The busiest stage is
    rank 1 (the head's FLOPs): once each (first forward), then again 2 + 2 + 0 times a 2-layer chunk and 1
    time the head's chunk:
      4 · 73,984 · 2 B = 591,872 B, 1 · 53,440 · 2 B = 106,880 B"""
    r = tiny_pipeline(14, pp=2, vpp=4, pp_layers=(1, 2, 2, 2, 2, 2, 2, 1))
    rows = [x for x in communication(r, H100.topology)[1] if x.dimension == "dp"]
    stage = 3 * 73_984 + 53_440
    got = {(x.collective, x.bytes, x.count, x.overlap) for x in rows}
    assert got == {
        (AG, stage * 2, 1, Overlap.FIRST_FORWARD),
        (AG, 73_984 * 2, 4, Overlap.BACKWARD),
        (AG, 53_440 * 2, 1, Overlap.BACKWARD),
        (RS, stage * 4, 1, Overlap.NONE),
    }
    assert per_step(rows, AG) == (stage + 4 * 73_984 + 53_440) * 2


def test_torchtitan_reduces_in_fp32_by_default() -> None:
    """Without ``--reduce-dtype`` torchtitan's FSDP2 reduces in fp32 (torchtitan 0.3.0
    ``training.mixed_precision_reduce = "float32"``), not in the bf16 gradients' dtype: ZeRO-3 over dp 2,
    2 micro-batches, each reduce-scatter 106,816 · 4 B; with ``--reduce-dtype bf16`` 106,816 · 2 B."""
    o = {"model": "tiny", "seq": 32, "batch": 2, "impl": "torchtitan", "zero": 3, "dp": 2, "gpus": 2}
    default = communication(build(Options(**o, grad_accum=2)).result, H100.topology)[1]  # type: ignore[arg-type]
    bf16 = communication(build(Options(**o, grad_accum=2, reduce_dtype="bf16")).result, H100.topology)[1]  # type: ignore[arg-type]
    assert [(r.bytes, r.count) for r in default if r.collective is RS] == [(ALL * 4, 2)]
    assert [(r.bytes, r.count) for r in bf16 if r.collective is RS] == [(ALL * 2, 2)]


def test_the_2024_root_wrapping_gathers_neither_the_root_nor_the_top_block_again() -> None:
    """``--fsdp-wrap root`` (torchtitan's parallelize_llama of 2024), ZeRO-3 over dp 2, 4 micro-batches:
    the units are the root (embedding, final norm, lm head: 16,384 + 16,448 = 32,832 el) and each block.
    Per micro-batch every unit gathered in forward (106,816 el); in backward every block but the top one
    (not resharded after forward), the root neither: 106,816 − 32,832 − 36,992 = 36,992 el, one block;
    the blocks' gradients reduce-scattered behind the backward (73,984 el) and the root's at the backward's
    end, in FSDP2's final callback, which the step waits for (32,832 el, exposed).
      all-gather     4 · (106,816 + 36,992) · 2 B = 1,150,464 B
      reduce-scatter 4 · (73,984 + 32,832) · 4 B  = 1,709,056 B (as 0.3.0's wrapping: each gradient once)"""
    rows = dp_rows(zero=3, dp=2, gpus=2, grad_accum=4, fsdp_wrap="root")
    got = {(r.collective, r.phase, r.overlap): (r.bytes, r.count) for r in rows}
    root, block = 16_384 + HEAD_UNIT, 36_992
    assert got == {
        (AG, Phase.FORWARD, Overlap.FORWARD): (ALL * 2, 4),
        (AG, Phase.BACKWARD, Overlap.BACKWARD): ((ALL - root - block) * 2, 4),
        (RS, Phase.BACKWARD, Overlap.BACKWARD): ((ALL - root) * 4, 4),
        (RS, Phase.BACKWARD, Overlap.NONE): (root * 4, 4),
    }
    assert per_step(rows, AG) == 1_150_464
    assert per_step(rows, RS) == 1_709_056
