"""Issue #22: FSDP2's all-gather stream (``analytic.fsdp.buffers.codes``) against torch 2.13 run per rank on
the fake process group: every ``all_gather_output`` FSDP2 allocates and drops, in order, with its size
(``measure.distributed.fsdp_streams``), for one forward and backward — equal to the model's stream, event
for event, with tensor parallelism (DTensor parameters on a 2-D mesh: FSDP2 shards each TP-local tensor
over dp) and without.

The tiny model (presets/models/tiny.toml: h 64, 4 heads, 2 kv heads, d 16, f 128, v 256, 2 layers, untied),
bf16 all-gathers (FSDP2's ``param_dtype``), ZeRO-3. torchtitan's units: the embedding, each block
(``wqkv`` fused), [norm, lm_head] (not resharded after forward: not gathered again).
"""

from __future__ import annotations

import pytest

from memplan.analytic.fsdp.buffers import codes, gather_units, root_wraps
from memplan.api import Options, build
from memplan.config import Impl, Setup
from memplan.engine import estimate
from memplan.measure.distributed.fsdp_streams import all_gather_outputs


def titan_rank(tp: int, dp: int) -> tuple[Setup, list[int]]:
    """One torchtitan rank of tp × dp (SP with tp), ZeRO-3: its rank setup (the TP rank's model, what
    ``analytic.fsdp.buffers`` shards) and the recorded all-gather stream."""
    pytest.importorskip("torchtitan.models.llama3")
    from memplan.measure.distributed.titan import measure_titan_rank
    from tests.hf.harness import hf_setup
    from tests.hf.test_torchtitan_ranks import ranked

    setup = ranked(hf_setup("tiny", seq=32, batch=2, impl=Impl.TORCHTITAN), tp, tp > 1, dp, 3)
    with all_gather_outputs() as got:
        measure_titan_rank(setup)
    rank = setup.model_copy(update={"model": estimate(setup).pieces.setup.model})
    return rank, got


def test_torchtitan_without_tp() -> None:
    """dp 2: the embedding 256 × 64 = 16,384 el; a block wqkv 128 × 64 + wo 64 × 64 + w1, w3, w2
    3 × 128 × 64 + two norms 128 = 36,992 el; [norm, lm_head] 64 + 256 × 64 = 16,448 el; × 2 B. Forward:
    E, L0, E freed, L1, L0 freed, H, L1 freed, H freed by the root's post-forward; backward: H not
    gathered, its pre-backward prefetches L1; L1's frees it after the copy-out, prefetches L0; L0's
    prefetches E."""
    rank, got = titan_rank(1, 2)
    e, b, h = 32_768, 73_984, 32_896
    assert got == [e, b, -1, b, -2, h, -3, -4, b, -5, b, -6, e, -7]
    assert got == codes(gather_units(rank, 2, True, True) or [], steps=1)


def test_torchtitan_tp2_dp2() -> None:
    """tp 2 + SP × dp 2: each DTensor parameter's TP-local tensor (the embedding and the lm head
    ``Shard(0)`` on the vocabulary: 128 rows; ``wqkv`` colwise (2 + 2·1)·16 = 64 rows; ``wo`` rowwise
    [64, 32]; w1, w3 colwise [64, 64]; w2 rowwise [64, 64]; norms replicated [64]) gathered over dp:
    the embedding 128 × 64 = 8,192 el; a block 4,096 + 2,048 + 3 × 4,096 + 128 = 18,560 el; [norm,
    lm_head] 64 + 8,192 = 8,256 el; × 2 B — half the dp-only figures but for the replicated norms."""
    rank, got = titan_rank(2, 2)
    e, b, h = 16_384, 37_120, 16_512
    assert got == [e, b, -1, b, -2, h, -3, -4, b, -5, b, -6, e, -7]
    assert got == codes(gather_units(rank, 2, True, True) or [], steps=1)


def test_torchtitan_tp2_dp3_pads_the_local_shard() -> None:
    """tp 2 + SP × dp 3: FSDP2 pads each TP-local tensor's dim 0 to a multiple of 3 (every chunk the first
    one's ⌈rows/3⌉ rows): the embedding ⌈128/3⌉ = 43 → 129 rows × 64 = 8,256 el; a block wqkv 22 · 3 = 66
    rows × 64 = 4,224, wo 66 × 32 = 2,112, w1, w3, w2 3 × 66 × 64 = 12,672, two norms 2 × 66 = 132:
    19,140 el; [norm, lm_head] 66 + 8,256 = 8,322 el; × 2 B."""
    rank, got = titan_rank(2, 3)
    e, b, h = 16_512, 38_280, 16_644
    assert got == [e, b, -1, b, -2, h, -3, -4, b, -5, b, -6, e, -7]
    assert got == codes(gather_units(rank, 2, True, True) or [], steps=1)


@pytest.mark.parametrize("dp", [2, 3])
def test_torchtitan_tied_unit_is_gathered_once(dp: int) -> None:
    """A tied embedding (``analytic.fsdp.moments.zero3_tied``): one unit [tok_embeddings, norm, lm_head],
    the [v, h] and the norm, gathered first and never resharded, so the backward gathers only the blocks
    (the unit's pre-backward at the lm head prefetches the top block; layer 0 prefetches nothing), and
    its reduce-scatter output comes last. dp 2: the unit 256 × 64 + 64 = 16,448 el, a block 36,992 el;
    dp 3 pads each dim 0 to a multiple of 3: the unit 258 × 64 + 66 = 16,578 el, a block 37,572 el
    (``test_torchtitan_tp2_dp3_pads_the_local_shard``'s rows at tp 1); × 2 B, the reduce-scatter outputs
    × 4 B / dp."""
    pytest.importorskip("torchtitan.models.llama3")
    from memplan.analytic.fsdp.buffers import reduce_scatter_outputs as modelled
    from memplan.measure.distributed.fsdp_streams import reduce_scatter_outputs
    from memplan.measure.distributed.titan import measure_titan_rank
    from tests.hf.harness import hf_setup
    from tests.hf.test_torchtitan_ranks import ranked

    setup = ranked(
        hf_setup("tiny", seq=32, batch=2, impl=Impl.TORCHTITAN, tied_embeddings=True), 1, False, dp, 3
    )
    with all_gather_outputs() as got, reduce_scatter_outputs() as reduced:
        measure_titan_rank(setup)
    t, b = {2: (16_448, 36_992), 3: (16_578, 37_572)}[dp]
    assert got == [2 * t, 2 * b, -1, 2 * b, -2, -3, 2 * b, -4, 2 * b, -5]
    rank = estimate(setup).rank_setup
    assert got == codes(gather_units(rank, 2, True, True) or [], steps=1)
    assert reduced == [4 * b // dp, 4 * b // dp, 4 * t // dp]
    assert [(size, 0) for size in reduced] == modelled(rank, 2, True, True)


@pytest.mark.parametrize("dp", [2, 3])
def test_the_reference_roots_backward_comes_first(dp: int) -> None:
    """memplan's reference (``fully_shard`` per layer, then on the root: embedding, final norm and head
    in one unit, resharded after forward): the root's forward ends last, so its pre-backward at the loss
    gathers it first in the backward and prefetches the top layer (``backward_order``). dp 2: the root
    256 × 64 · 2 + 64 = 32,832 el (65,664 B), a layer q 64 × 64, k, v 2 × 32 × 64, o 64 × 64, gate, up,
    down 3 × 128 × 64, two norms 128 = 36,992 el (73,984 B); dp 3 pads each dim 0 to a multiple of 3:
    the root 2 × 258 × 64 + 66 = 33,090 el, a layer q, o 2 × 66 × 64 + k, v 2 × 33 × 64 + gate, up
    2 × 129 × 64 + down 66 × 128 + two norms 132 = 37,764 el (129 rows for 128, 66 for 64, 33 for 32)."""
    from memplan.measure.distributed.reference_peak import measure_reference_rank

    setup = build(Options(model="tiny", seq=32, batch=2, zero=3, dp=dp)).result.setup
    with all_gather_outputs() as got:
        measure_reference_rank(setup)
    r, b = {2: (65_664, 73_984), 3: (66_180, 75_528)}[dp]
    assert got == [r, b, -1, b, -2, -3, r, -4, b, -5, b, -6]
    assert root_wraps(setup, True, True)
    assert got == codes(gather_units(setup, 2, True, True) or [], steps=1, root=True)


@pytest.mark.parametrize(("tp", "dp"), [(1, 2), (2, 2), (2, 3)])
def test_torchtitan_reduce_scatter_outputs(tp: int, dp: int) -> None:
    """The reduce-scatter stream's blocks (``analytic.fsdp.buffers.reduce_scatter_outputs``): each unit's
    output, fp32 (torchtitan's ``reduce_dtype``), 1/dp of its padded flat elements, in the backward's order
    ([norm, lm_head], the blocks top down, the embedding), as torch 2.13's ``foreach_reduce`` allocates
    them (``measure.distributed.fsdp_streams.reduce_scatter_outputs``). By hand, each unit's padded
    elements (the all-gather outputs above) / dp × 4 B: [norm, lm_head], a block, the embedding — dp 2:
    16,448, 36,992, 16,384; tp 2 × dp 2: 8,256, 18,560, 8,192; tp 2 × dp 3: 8,322, 19,140, 8,256."""
    pytest.importorskip("torchtitan.models.llama3")
    from memplan.analytic.fsdp.buffers import reduce_scatter_outputs as modelled
    from memplan.measure.distributed.fsdp_streams import reduce_scatter_outputs
    from memplan.measure.distributed.titan import measure_titan_rank
    from tests.hf.harness import hf_setup
    from tests.hf.test_torchtitan_ranks import ranked

    setup = ranked(hf_setup("tiny", seq=32, batch=2, impl=Impl.TORCHTITAN), tp, tp > 1, dp, 3)
    with reduce_scatter_outputs() as got:
        measure_titan_rank(setup)
    units = {(1, 2): (16_448, 36_992, 16_384), (2, 2): (8_256, 18_560, 8_192), (2, 3): (8_322, 19_140, 8_256)}
    h, b, e = (4 * n // dp for n in units[(tp, dp)])
    assert got == [h, b, b, e]
    assert [(size, 0) for size in got] == modelled(estimate(setup).rank_setup, 2, True, True)


@pytest.mark.parametrize(("tp", "dp"), [(1, 2), (1, 3), (2, 2)])
def test_torchtitan_2024_root_wrapping(tp: int, dp: int) -> None:
    """``--fsdp-wrap root`` (torchtitan's parallelize_llama of 2024: each block, the last not resharded
    after forward, then ``fully_shard(model)``, the root not resharded after forward as the torch of the
    time did): forward R, L0, R freed, L1, L0 freed, L1 freed by the root's post-forward; backward: the
    root's pre-backward gathers nothing (still unsharded) and its prefetch of L1 is a no-op (kept), L1's
    prefetches L0, freed after L0's copy-out. Then each unit's fp32 reduce-scatter output, the root last.
    By hand (tiny, see the reference's test above for the padding): dp 2 the root 32,832 el, a block
    (torchtitan's fused wqkv) 36,992 el; dp 3 the root 33,090 el, a block wqkv 129 + wo 66 + w1, w3 129
    + w2 66 rows and two norms of 66 = 8,256 + 4,224 + 16,512 + 8,448 + 132 = 37,572 el; × 2 B gathered,
    / dp × 4 B reduced. tp 2 + SP × dp 2: the TP-local units (``test_torchtitan_tp2_dp2``): the root
    8,192 + 64 + 8,192 = 16,448 el, a block 18,560 el."""
    pytest.importorskip("torchtitan.models.llama3")
    from memplan.analytic.fsdp.buffers import reduce_scatter_outputs as modelled
    from memplan.measure.distributed.fsdp_streams import reduce_scatter_outputs
    from memplan.measure.distributed.titan import measure_titan_rank
    from tests.hf.harness import hf_setup
    from tests.hf.test_torchtitan_ranks import ranked

    base = hf_setup("tiny", seq=32, batch=2, impl=Impl.TORCHTITAN)
    setup = ranked(base, tp, tp > 1, dp, 3, fsdp_wrap="root")
    with all_gather_outputs() as got, reduce_scatter_outputs() as reduced:
        measure_titan_rank(setup)
    root, block = {(1, 2): (32_832, 36_992), (1, 3): (33_090, 37_572), (2, 2): (16_448, 18_560)}[(tp, dp)]
    r, b = 2 * root, 2 * block
    assert got == [r, b, -1, b, -2, -3, b, -4]
    assert root_wraps(setup, True, True)
    rank = estimate(setup).rank_setup  # the TP rank's model, what the units shard
    assert got == codes(gather_units(rank, 2, True, True) or [], steps=1, root=True)
    assert reduced == [4 * block // dp, 4 * block // dp, 4 * root // dp]
    assert [(size, 0) for size in reduced] == modelled(rank, 2, True, True)
