"""Issue #22 item 1: FSDP2's all-gather stream (``memplan.analytic.fsdp.buffers``), its order of
allocations and frees read from torch's _fsdp_param_group.py and its reserved bytes derived by hand from
the caching allocator's documented rules (2 MiB rounding of large segments, best fit, splitting)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from memplan.alloc_stream import stream_inputs
from memplan.analytic.allocator import Allocator
from memplan.analytic.fsdp.buffers import (
    backward_order,
    codes,
    gather_units,
    reduce_scatter_codes,
    reduce_scatter_outputs,
    reduce_scatter_reserved,
    stream_reserved,
)
from memplan.analytic.fsdp.reduce import reduce_scatter_input
from memplan.analytic.peak import TERMS
from memplan.api import Options, build
from memplan.config import ReduceDtype, ZeroStage

MIB = 2**20


def test_the_order_of_gathers_and_frees() -> None:
    """Units E, L, L, H (torchtitan's wrapping; H not resharded after forward). Forward: each unit's buffer
    is allocated, then the one kept before it freed (``all_gather_state``); the root's post-forward frees
    H's. Backward, from the last unit: H is still unsharded (nothing gathered); its pre_backward prefetches
    the unit before; each pre_backward frees its unit's buffer after the copy-out, then prefetches the
    next."""
    a, b, c = 100, 200, 300
    units = [(a, True), (b, True), (b, True), (c, False)]
    forward = [a, b, -1, b, -2, c, -3, -4]  # allocations numbered 0, 1, …; −k − 1 frees k
    backward = [b, -5, b, -6, a, -7]  # 4 (unit 2, prefetched by H), 5 (unit 1), 6 (unit 0)
    assert codes(units, steps=1) == forward + backward
    # the next step starts with nothing kept: unit 0's gather (allocation 7), unit 1's, then 7 freed
    assert codes(units, steps=2)[14:17] == [a, b, -8]


def test_a_root_that_wraps_the_others_runs_its_backward_first() -> None:
    """The reference's root R (embedding, final norm, head) wrapping layers L0, L1: the forward gathers R
    first, but R's forward ends last (FSDP2's ``post_forward_order``: L0, L1, R), so the backward, which
    walks that order back, runs R's pre-backward first (at the loss: gathered again, freed after the
    copy-out, then L1 prefetched), then L1's (prefetching L0), then L0's. Measured on the fake process
    group: tests/measure/test_fsdp_streams.py."""
    r, b = 100, 200
    units = [(r, True), (b, True), (b, True)]
    assert backward_order(3, root=True) == [0, 2, 1] and backward_order(3) == [2, 1, 0]
    forward = [r, b, -1, b, -2, -3]
    assert codes(units, steps=1, root=True) == [*forward, r, -4, b, -5, b, -6]
    assert codes(units, steps=1) == [*forward, b, -4, b, -5, r, -6]


def test_llama2_13b_over_64_ranks_by_hand() -> None:
    """Llama-2-13B, ZeRO-3 over 64 ranks, wrapped as torchtitan 0.3.0 wraps it. Each all-gather output in
    bf16, every dim 0 divisible by 64 (no padding):
      embedding [32000, 5120]                                       = 163,840,000 el → 327,680,000 B
      layer: 2 norms [5120] + q, k, v, o [5120, 5120]
             + gate, up [13824, 5120] + down [5120, 13824]          = 317,204,480 el → 634,408,960 B
      final norm [5120] + head [32000, 5120]                        = 163,845,120 el → 327,690,240 B
    Segments (> 10 MiB: rounded up to 2 MiB): 314 MiB, 606 MiB, 314 MiB. The forward takes the embedding's
    314 MiB, layer 0's 606 MiB, layer 1's another 606 MiB (the free 314 MiB is too small), then every
    later layer the 606 MiB freed before it; the head fits in the embedding's free 314 MiB. The backward
    and the second step reuse them (best fit, splitting): 314 + 2 × 606 = 1,526 MiB."""
    r = build(Options(model="llama-2-13b", seq=4096, batch=2, zero=3, gpus=64, impl="torchtitan")).result
    units = gather_units(r.setup, 40, True, True)
    assert units is not None and len(units) == 42
    assert units[0] == (327_680_000, True) and units[1] == (634_408_960, True)
    assert units[-1] == (327_690_240, False)
    got = stream_reserved(units)
    assert got.reserved_peak == (314 + 2 * 606) * MIB == 1_600_126_976
    # at most two layers' buffers are live at once, the forward's kept one and the next; each handed out
    # as its whole 606 MiB block (the 1,028,096 B left is under 1 MiB: not split)
    assert got.requested_peak == 2 * 634_408_960
    assert 606 * MIB - 634_408_960 == 1_028_096 and got.allocated_peak == 2 * 606 * MIB


def test_the_root_unit_of_the_reference_and_of_the_2024_torchtitan_by_hand() -> None:
    """--impl reference (and the 2024 torchtitan that ran: each block, then ``fully_shard(model)``): one root
    unit of the embedding, the final norm and the head, gathered first; the reference passes
    ``reshard_after_forward=True`` to it (torch 2.13 honours it: gathered again, last, in backward), the
    2024 torchtitan passed none (not resharded). Llama-2-13B over 64 ranks, bf16:
      root: 163,840,000 + 163,845,120 el → 655,370,240 B; its segment rounds up to 2 MiB:
            ⌈655,370,240 / 2,097,152⌉ = 313 → 626 MiB = 656,408,576 B (1,038,336 B left: under 1 MiB, the
            block is handed out whole)
      layer: 634,408,960 B in a 606 MiB segment (1,028,096 B left: whole)
    Forward: the root's 626 MiB, layer 0's 606 MiB beside it (the root's is still kept), then layer 1 in
    the root's freed 626 MiB (split: 21,999,616 B left), layer 2 in layer 0's, and so on; the root's
    post-forward frees the last. The backward gathers one unit at a time (each freed after its copy-out
    before the next is prefetched): the root first (its forward ended last: ``backward_order``), in its
    own free 626 MiB, then each layer in the 606 MiB (best fit). The second step reuses them:
    626 + 606 = 1,232 MiB — the same with the root not gathered again (the 2024 run)."""
    r = build(Options(model="llama-2-13b", seq=4096, batch=2, zero=3, gpus=64)).result
    units = gather_units(r.setup, 40, True, True)
    assert units is not None and len(units) == 41
    assert units[0] == (655_370_240, True) and units[1:] == [(634_408_960, True)] * 40
    for root_again in (True, False):
        got = stream_reserved([(655_370_240, root_again), *units[1:]], root=True)
        assert got.reserved_peak == (626 + 606) * MIB == 1_291_845_632
        assert got.requested_peak == 655_370_240 + 634_408_960
        assert got.allocated_peak == (626 + 606) * MIB
    # a middle pipeline stage holds neither the embedding nor the head: no root unit
    assert gather_units(r.setup, 10, False, False) == [(634_408_960, True)] * 10


def test_padding_and_the_stages_that_gather() -> None:
    """Dim 0 padded to a multiple of the ranks: Llama-2-13B's vocabulary 32,000 over 3 ranks is
    ⌈32000/3⌉ = 10,667 rows each, 32,001 gathered. ZeRO-2 gathers only in forward; ZeRO-1 not at all."""
    setup = build(Options(model="llama-2-13b", zero=3, dp=3, impl="torchtitan")).result.setup
    units = gather_units(setup, 40, True, True)
    assert units is not None and units[0] == (32_001 * 5120 * 2, True)
    two = setup.model_copy(
        update={"strategy": setup.strategy.model_copy(update={"zero": ZeroStage.GRADIENTS})}
    )
    assert {again for _, again in gather_units(two, 40, True, True) or []} == {False}
    one = setup.model_copy(
        update={"strategy": setup.strategy.model_copy(update={"zero": ZeroStage.OPTIMIZER})}
    )
    assert gather_units(one, 40, True, True) == []


def test_estimate_reports_it_beside_the_replay() -> None:
    b = build(Options(model="llama-2-13b", seq=4096, batch=2, zero=3, gpus=64, gpu="a100-80gb"))
    assert b.fsdp_all_gather == (626 + 606) * MIB  # the reference's root unit (test above)
    megatron = build(Options(model="llama-2-13b", zero=3, dp=4, impl="megatron"))
    assert megatron.fsdp_all_gather == 0  # Megatron's distributed optimizer, not FSDP2


def test_tensor_parallel_ranks_gather_their_local_shards_by_hand() -> None:
    """Under tp FSDP2 shards each DTensor parameter's TP-local tensor over dp (torch 2.13
    ``_init_sharding_spec_tp``: ``param._local_tensor``); measured on the fake process group at the tiny
    widths (tests/measure/test_fsdp_streams.py). Llama-2-13B on tp 2 × dp 4, the reference, bf16:
      root: embedding and head [16000, 5120] (vocabulary-parallel) + final norm [5120]
            = 163,845,120 el → 327,690,240 B: ⌈156.25⌉ = 157 × 2 MiB = 314 MiB (1,562,624 B left: split)
      layer: 2 norms 10,240 + q, k, v 3 × [2560, 5120] + o [5120, 2560] + gate, up 2 × [6912, 5120]
             + down [5120, 6912] = 158,607,360 el → 317,214,720 B: ⌈151.26⌉ = 152 × 2 MiB = 304 MiB
    (every dim 0 divisible by 4). Forward: R in 314 MiB, L0 in a new 304 MiB, then each layer in the
    free segment of the two that fits best (L1 in R's 314 MiB, L2 in L0's 304 MiB, …); backward: R
    (327,690,240 B > 304 MiB) in its 314 MiB, every layer in the 304 MiB: 314 + 304 = 618 MiB.
    torchtitan's units: the embedding [16000, 5120] 163,840,000 B (⌈78.13⌉ = 79 × 2 MiB = 158 MiB); a
    block, ``wqkv`` fused [7680, 5120], the same 158,607,360 el (304 MiB); [norm, head] 5,120 +
    81,920,000 el = 163,850,240 B (158 MiB). Forward: E in 158 MiB, L0 in 304 MiB, L1 in a second
    304 MiB (E's 158 MiB is too small), then the two 304 MiB in turn; H in E's; the backward reuses
    them: 158 + 2 × 304 = 766 MiB."""
    tp = build(Options(model="llama-2-13b", zero=3, tp=2, dp=4))
    assert tp.fsdp_all_gather == (314 + 304) * MIB
    titan = build(Options(model="llama-2-13b", zero=3, tp=2, dp=4, impl="torchtitan"))
    assert titan.fsdp_all_gather == (158 + 2 * 304) * MIB


def test_the_verdict_keeps_the_stream_back() -> None:
    """The verdict judges the default stream's replay in the driver's memory less the CUDA context, NCCL's
    buffers and the all-gather stream's reserved bytes (its segments, reached at the forward's second
    unit, are held through the backward's peak). Llama-2-13B on 64 A100-80GB: 81,920 MiB (nvidia-smi's
    total) − 767 MiB (context) − 288 MiB (one data-parallel ring of 24 channels × 12 MiB,
    docs/published-memory.md) − 1,232 MiB (above) = 79,633 MiB; the replay reserves 80,924 MiB: 1,291 MiB
    over (tests/test_published_memory.py: DeepSpeed's split, not the run that ran)."""
    v = build(Options(model="llama-2-13b", seq=4096, batch=2, zero=3, gpus=64, gpu="a100-80gb")).verdict
    assert v is not None
    assert (v.nccl, v.fsdp_all_gather_stream, v.ddp_buckets) == (288 * MIB, 1232 * MIB, 0)
    assert v.usable_bytes == (81_920 - 767 - 288 - 1232) * MIB
    assert v.reserved_peak == 80_924 * MIB and not v.fits and v.headroom == -1_291 * MIB


def test_ddp_buckets_are_a_second_copy_of_the_gradients() -> None:
    """torch DDP under --impl hf (transformers' Trainer wraps the model in it), ZeRO 0 over dp 4:
    gradient_as_bucket_view=False keeps one more copy of every gradient, "equal to the total gradients
    size". Llama-3-8B: 8,030,261,248 parameters (Meta's model card), bf16 gradients 2 B each. The
    reference model all-reduces in place (0), and ZeRO 1 is not DDP (0)."""
    hf = build(Options(model="llama-3-8b", impl="hf", dp=4))
    assert hf.result.params.total == 8_030_261_248
    assert hf.ddp_buckets == 2 * 8_030_261_248
    assert build(Options(model="llama-3-8b", dp=4)).ddp_buckets == 0
    assert build(Options(model="llama-3-8b", impl="hf", dp=4, zero=1)).ddp_buckets == 0
    assert build(Options(model="llama-3-8b", impl="hf")).ddp_buckets == 0  # one rank: no DDP


def test_the_verdict_keeps_the_buckets_back() -> None:
    """The same layout (ZeRO 0 over dp 4, one data-parallel communicator) under --impl hf (DDP) and the
    reference (in place): the memory left to the allocator differs by the buckets, 2 × 8,030,261,248 B."""
    hf = build(Options(model="llama-3-8b", impl="hf", dp=4, gpu="h100-sxm")).verdict
    ref = build(Options(model="llama-3-8b", dp=4, gpu="h100-sxm")).verdict
    assert hf is not None and ref is not None and hf.nccl == ref.nccl
    assert hf.ddp_buckets == 2 * 8_030_261_248 and ref.ddp_buckets == 0
    assert ref.usable_bytes - hf.usable_bytes == 2 * 8_030_261_248


def test_torchtitan_zero3_with_pp_regathers_nothing() -> None:
    """torchtitan's ZeRO-3 runs its trainer's ``reshard_after_forward_policy="default"``: without pp the
    embedding and blocks are resharded after forward (gathered again in backward) and [norm, lm_head] not;
    with pp no unit is (torchtitan/distributed/fsdp.py ``get_fsdp_reshard_after_forward_policy``:
    ``not pp_enabled``). Llama-2-13B over dp 2 (no padding: 32,000 and 5,120 even):
      embedding [32000, 5120] bf16 = 327,680,000 B; a layer 317,204,480 el = 634,408,960 B (as above)."""
    flat = build(Options(model="llama-2-13b", zero=3, dp=2, impl="torchtitan")).result.setup
    units = gather_units(flat, 40, True, True)
    assert units is not None and len(units) == 42
    assert units[0] == (327_680_000, True) and units[1] == (634_408_960, True)
    assert units[-1] == (327_690_240, False)
    piped = build(Options(model="llama-2-13b", zero=3, dp=2, pp=2, impl="torchtitan")).result.setup
    first = gather_units(piped, 20, True, False)  # the first stage: embedding and 20 layers, no head
    assert first is not None and len(first) == 21
    assert first[:2] == [(327_680_000, False), (634_408_960, False)]
    assert {again for _, again in first} == {False}


def test_torchtitan_zero3_pipeline_stage_keeps_its_units_gathered() -> None:
    """With pp, torchtitan's default policy reshards no unit after forward and torch's stage reshards after
    backward only at the last micro-batch: each stage's moments hold its unsharded weights beside its shards
    (``analytic.fsdp.moments.zero3_kept_gathered``). The tiny model (h 64, 4 heads, 2 kv, d 16, f 128, v 256,
    2 layers, untied), pp 2 × dp 2, bf16. A layer: wqkv (4 + 2·2)·16 × 64 = 8,192, wo 64 × 64 = 4,096,
    w1 w3 w2 3 × 128 × 64 = 24,576, two norms 128: 36,992. Stage 0: embedding 256 × 64 + a layer = 53,376
    elements; stage 1: a layer + final norm 64 + head 256 × 64 = 53,440. Unsharded 2 B each (bf16 while
    gathered), the shards half the elements in fp32 (FSDP2's mixed precision): 4 · n / 2 = 2 · n bytes,
    as many as the unsharded (every dim 0 even)."""
    r = build(Options(model="tiny", seq=32, batch=2, zero=3, dp=2, pp=2, impl="torchtitan")).result
    first, last = r.stages
    unsharded0, unsharded1 = 2 * 53_376, 2 * 53_440
    for stage, unsharded in ((first, unsharded0), (last, unsharded1)):
        moments = stage.peak.moments
        shards = 4 * (unsharded // 2) // 2
        assert stage.states.weights == shards
        assert moments["layer backward"]["weights"] == shards + unsharded
        assert moments["optimizer step"]["weights"] == shards  # resharded after the last backward
    assert last.peak.moments["loss backward"]["weights"] == 4 * (unsharded1 // 2) // 2 + unsharded1


# ----------------------------------------------------------------------------------------------------
# The reduce-scatter side under FSDP2's mixed precision (torch 2.13's ``foreach_reduce``)
# ----------------------------------------------------------------------------------------------------
LLAMA_FSDP2 = Options(
    model="llama-2-13b", seq=4096, batch=2, zero=3, gpus=64, gpu="a100-80gb", precision="fsdp2-mixed"
)


def test_the_reduce_scatter_streams_order() -> None:
    """Each unit's output allocated on the reduce-scatter stream, in backward order; with a cast (reduce
    dtype ≠ the fp32 parameters') the cast's block, then the output freed; the first micro-batch's results
    kept as the sharded gradients to the step's end, a later micro-batch's added into them and freed."""
    a, b, c = 100, 200, 50
    assert reduce_scatter_codes([(a, 0), (b, 0)], steps=1) == [a, b, -1, -2]
    assert reduce_scatter_codes([(a, c)], steps=1) == [a, c, -1, -2]
    assert reduce_scatter_codes([(a, 0)], micro_batches=2, steps=1) == [a, a, -2, -1]


def test_llama2_13b_reduce_scatter_by_hand() -> None:
    """Llama-2-13B under --precision fsdp2-mixed over 64 ranks (torch 2.13, _fsdp_collectives.py
    ``foreach_reduce``). The reduce-scatter output (fp32, reduce_dtype) on the reduce-scatter stream is the
    sharded gradient itself (orig dtype fp32: no cast): a layer's 317,204,480 / 64 = 4,956,320 el × 4 B =
    19,825,280 B; the root's (163,840,000 + 163,845,120) / 64 = 5,120,080 el × 4 B = 20,480,320 B; the
    reference's root reduces last. Each over 10 MiB: its segment rounds up to 2 MiB, 20 MiB each (a
    layer's leaves 1,146,240 B, split off but too small for the next), held to the step's end: 41 × 20 MiB
    = 820 MiB. The input (fp32 copy of a layer's unsharded gradients, 317,204,480 × 4 B) is the default
    stream's, held beside the next unit's backward: beside layer 38's and (layer 0's) the embedding's,
    none beside the top layer's (the root reduces last)."""
    b = build(LLAMA_FSDP2)
    setup = b.result.setup
    outputs = reduce_scatter_outputs(setup, 40, True, True)
    assert outputs == [(19_825_280, 0)] * 40 + [(20_480_320, 0)]
    assert b.fsdp_reduce_scatter == 41 * 20 * MIB == 41 * 20_971_520
    assert reduce_scatter_input(setup, 38, 40) == reduce_scatter_input(setup, -1, 40) == 1_268_817_920
    assert reduce_scatter_input(setup, 39, 40) == 0
    # the embedding's backward moment holds layer 0's input, fp32, where bf16-mixed's (no policy: no
    # cast) holds it in bf16, 317,204,480 × 2 B (analytic.fsdp.root, measured on the fake process group)
    mixed = build(Options(model="llama-2-13b", seq=4096, batch=2, zero=3, gpus=64)).result
    moment = "embedding backward"
    got = b.result.peak.moments[moment]["transient"] - mixed.peak.moments[moment]["transient"]
    assert got == 1_268_817_920 - 634_408_960
    # the sharded gradients are not the default stream's: its replay holds none
    assert {dict(zip(TERMS, p, strict=True))["gradients"] for p in stream_inputs(b.result).points} == {0}
    assert max(dict(zip(TERMS, p, strict=True))["gradients"] for p in stream_inputs(mixed).points) > 0


def test_a_bf16_reduce_casts_on_the_reduce_scatter_stream_by_hand() -> None:
    """--reduce-dtype bf16 under fsdp2-mixed: each output bf16 (a layer's 4,956,320 × 2 = 9,912,640 B, the
    root's 5,120,080 × 2 = 10,240,160 B), cast to the fp32 sharded gradient (19,825,280 B; 20,480,320 B)
    on the same stream, then freed. The outputs are under 10 MiB: the first opens a 20 MiB segment and
    every later output reuses it (freed, it merges back whole); each cast (over 10 MiB) finds no free
    block that large and opens its own 20 MiB segment, held as the gradient: (1 + 41) × 20 MiB."""
    options = LLAMA_FSDP2.model_copy(update={"reduce_dtype": ReduceDtype.BF16})
    b = build(options)
    outputs = reduce_scatter_outputs(b.result.setup, 40, True, True)
    assert outputs == [(9_912_640, 19_825_280)] * 40 + [(10_240_160, 20_480_320)]
    assert b.fsdp_reduce_scatter == 42 * 20 * MIB


def test_only_fsdp2_mixed_precision_models_the_reduce_scatter() -> None:
    # the reference's bf16-mixed (DeepSpeed's split, bf16 gradients): not modelled
    assert build(Options(model="llama-2-13b", zero=3, dp=8)).fsdp_reduce_scatter == 0
    # torchtitan on tp 2 × dp 4: each rank's TP-local units (tests/measure/test_fsdp_streams.py), a block
    # 158,607,360 / 4 el and the embedding 81,920,000 / 4, [norm, head] 81,925,120 / 4, fp32: the same
    # elements per rank as dp 8 without tp, the same segments (below)
    tp = build(Options(model="llama-2-13b", zero=3, dp=4, tp=2, impl="torchtitan"))
    assert tp.fsdp_reduce_scatter == (40 * 152 + 2 * 80) * MIB
    # the reference's moments under tp are not measured with FSDP2's mixed precision: not modelled
    ref = build(Options(model="llama-2-13b", zero=3, dp=4, tp=2, precision="fsdp2-mixed"))
    assert ref.fsdp_reduce_scatter == 0
    # torchtitan's bf16-mixed is FSDP2's, its units its own: a layer 317,204,480 / 8 × 4 B = 158,602,240 B
    # (⌈158,602,240 / 2,097,152⌉ = 76 → 152 MiB), the embedding 163,840,000 / 8 × 4 = 81,920,000 B and
    # the [norm, lm head] unit 163,845,120 / 8 × 4 = 81,925,120 B (⌈39.06⌉ = 40 → 80 MiB each), every
    # one held as a gradient to the step's end: 40 × 152 + 2 × 80 = 6,240 MiB
    titan = build(Options(model="llama-2-13b", zero=3, dp=8, impl="torchtitan"))
    assert titan.fsdp_reduce_scatter == (40 * 152 + 2 * 80) * MIB


@settings(max_examples=200, deadline=None)
@given(
    units=st.lists(
        st.tuples(st.one_of(st.integers(1, 3 << 20), st.integers(1, 50 << 20)), st.booleans()),
        min_size=1,
        max_size=6,
    ),
    micro_batches=st.integers(1, 5),
    root=st.booleans(),
)
def test_the_stream_stops_replaying_once_a_micro_batch_opens_no_segment(
    units: list[tuple[int, bool]], micro_batches: int, root: bool
) -> None:
    """``stream_reserved`` stops at the first micro-batch that opens no segment: the same counters as the
    whole stream replayed (every micro-batch frees what it made, so the next one finds the same state)."""
    whole = Allocator().replay_codes(codes(units, micro_batches, root=root))
    assert stream_reserved(units, micro_batches, root) == whole


@settings(max_examples=100, deadline=None)
@given(
    outputs=st.lists(
        st.tuples(
            st.one_of(st.integers(1, 3 << 20), st.integers(1, 50 << 20)), st.sampled_from([0, 1 << 20])
        ),
        min_size=1,
        max_size=5,
    ),
    micro_batches=st.integers(1, 7),
)
def test_the_reduce_scatter_stream_stops_once_a_micro_batch_opens_no_segment(
    outputs: list[tuple[int, int]], micro_batches: int
) -> None:
    """``reduce_scatter_reserved`` stops replaying longer streams once one more micro-batch opens no
    segment: the reserved peak of the whole stream."""
    whole = Allocator().replay_codes(reduce_scatter_codes(outputs, micro_batches)).reserved_peak
    assert reduce_scatter_reserved(outputs, micro_batches) == whole
