"""``--fp8-all-gather``'s collectives (``memplan.time.comm.dp._titan_fsdp2_rows``), by hand on the tiny model
(presets/models/tiny.toml: h 64, 4 heads, 2 kv heads, d 16, f 128, v 256, 2 layers, untied), ZeRO-3 over
dp 2, 4 micro-batches, ``--reduce-dtype fp32``.

Every block linear is converted (every dim a multiple of 16): wqkv (4 + 2·2)·16 × 64 = 8,192, wo 64 × 64 =
4,096, w1, w3, w2 3 × 128 × 64 = 24,576: 36,864 elements all-gathered in float8 (1 B, torchao's
``fsdp_pre_all_gather`` returns the float8 data), the two norms 2 × 64 in bf16; the embedding (16,384) and
[norm, lm_head] (16,448) stay bf16. Per micro-batch:
  forward   16,384·2 + 2·(36,864 + 128·2) + 16,448·2 = 32,768 + 74,240 + 32,896 = 139,904 B
  backward  again, but [norm, lm_head]: 139,904 − 32,896                         = 107,008 B
The reduce-scatter is the gradients' (fp32), unchanged: 106,816 · 4 B. After the step torchtitan's
``precompute_float8_dynamic_scale_for_fsdp``: one all-reduce of the 10 converted weights' fp32 amaxes, 40 B.
"""

from __future__ import annotations

from memplan.api import Options, build
from memplan.presets import load_gpu
from memplan.time.comm.collectives import communication
from memplan.time.comm.fabric import Collective
from memplan.time.comm.rows import Overlap, Phase, Row

H100 = load_gpu("h100")
AG, RS, AR = Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_REDUCE


def dp_rows(**options: object) -> list[Row]:
    o = Options(
        model="tiny",
        seq=32,
        batch=2,
        impl="torchtitan",
        reduce_dtype="fp32",
        fp8="tensorwise",
        **options,  # type: ignore[arg-type]
    )
    return [r for r in communication(build(o).result, H100.topology)[1] if r.dimension == "dp"]


def test_weights_gathered_in_float8_and_the_amaxes_reduced_once() -> None:
    rows = dp_rows(zero=3, dp=2, gpus=2, grad_accum=4, fp8_all_gather=True)
    got = {(r.collective, r.phase): (r.bytes, r.count, r.overlap) for r in rows}
    assert got == {
        (AG, Phase.FORWARD): (139_904, 4, Overlap.FORWARD),
        (AG, Phase.BACKWARD): (107_008, 4, Overlap.BACKWARD),
        (RS, Phase.BACKWARD): (106_816 * 4, 4, Overlap.BACKWARD),
        (AR, Phase.STEP): (40, 1, Overlap.NONE),
    }


def test_without_it_the_weights_are_gathered_in_bf16() -> None:
    """The same layout without the flag: 106,816 elements · 2 B forward, 90,368 · 2 B backward, no amax
    all-reduce (tests/plan/test_titan_fsdp2_comm.py's figures)."""
    rows = dp_rows(zero=3, dp=2, gpus=2, grad_accum=4)
    got = {(r.collective, r.phase): r.bytes for r in rows}
    assert got == {(AG, Phase.FORWARD): 213_632, (AG, Phase.BACKWARD): 180_736, (RS, Phase.BACKWARD): 427_264}


def test_all_gather_stream_units_by_hand() -> None:
    """FSDP2's all-gather stream (``analytic.fsdp.buffers.gather_units``), the tiny model on dp 2: each
    block's output 36,864 float8 elements + 128 bf16 = 37,120 B (the resize measured on the rank,
    tests/hf/test_fp8_all_gather.py's figures at the tiny widths), against 36,992 · 2 = 73,984 B in bf16;
    the embedding 16,384 · 2 and [norm, lm_head] 16,448 · 2 unchanged."""
    from memplan.analytic.fsdp.buffers import gather_units

    def units(flag: bool) -> list[tuple[int, bool]] | None:
        o = Options(
            model="tiny", seq=32, impl="torchtitan", fp8="tensorwise", zero=3, dp=2, fp8_all_gather=flag
        )  # type: ignore[arg-type]
        return gather_units(build(o).result.setup, 2, True, True)

    assert units(True) == [(32_768, True), (37_120, True), (37_120, True), (32_896, False)]
    assert units(False) == [(32_768, True), (73_984, True), (73_984, True), (32_896, False)]


def test_weight_casts_move_to_the_shard() -> None:
    """``time.fp8.cast_bytes``: the tiny block's weights are 8,192 (wqkv) + 4,096 (wo) + 3 · 8,192 (w1, w3,
    w2) = 36,864 elements, each cast in the linear at 2·2 + 1 = 5 B (tensorwise, bf16: amax read, scaled
    read, float8 write) in forward and again in backward. Under the float8 all-gather the linear casts no
    weight; FSDP2's pre-all-gather casts the rank's fp32 shard, 36,864 / 2 elements at 4 + 1 B, before each
    gather (forward, backward). Each phase: − 36,864 · 5 + 18,432 · 5 = − 92,160 B."""
    from memplan.time.fp8 import cast_bytes

    def casts(flag: bool) -> tuple[int, int]:
        o = Options(
            model="tiny", seq=32, impl="torchtitan", fp8="tensorwise", zero=3, dp=2, fp8_all_gather=flag
        )  # type: ignore[arg-type]
        return cast_bytes(build(o).result.setup)

    (f1, b1), (f0, b0) = casts(True), casts(False)
    assert (f1 - f0, b1 - b0) == (-92_160, -92_160)
