"""Issue #13 item 4, issue #22 item 7: a plan fits in the memory the driver reports less the CUDA context
and a reserve (``--reserve``), judged on what the caching allocator reserves."""

from __future__ import annotations

import pytest

from memplan.api import Options, build
from memplan.presets import load_gpu
from memplan.reserved import CUDA_CONTEXT, fits_reserved
from memplan.search.budget import DEFAULT_RESERVE, reserve_bytes, verdict
from memplan.search.fit import fit


def test_usable_memory_is_the_drivers_less_the_context_and_the_reserve() -> None:
    """Issue #22 item 7: nvidia-smi's 81,559 MiB on an H100 SXM (the preset's cited figure), less the
    CUDA context's 767 MiB (reserved.CUDA_CONTEXT's measurement), NCCL's buffers and the default reserve,
    now 0. NCCL: dp 8 on one 8-GPU node is one communicator, its ring on Hopper's 16 channels, each a
    receive connection (4 KiB header + 512 KiB LL + 4,800 KiB LL128 + 4 MiB Simple → 10 MiB in cuMem's
    2 MiB granules) and a send connection (a 4 KiB page → 2 MiB): 16 × 12 MiB = 192 MiB.
    FSDP2's all-gather stream (memplan.analytic.fsdp.buffers), its own pool, bf16: the root unit (embedding
    and head [32000, 4096], final norm [4096]: 262,148,096 el → 524,296,192 B, a ⌈/2 MiB⌉ = 251 × 2 MiB =
    502 MiB segment) and a layer (4 × 4096² + 3 × 11008 × 4096 + 2 × 4096 = 202,383,360 el → 404,766,720 B,
    194 × 2 MiB = 388 MiB) live together at the forward's start; every later layer reuses one of the
    two: 502 + 388 = 890 MiB."""
    b = build(Options(model="7b", gpu="h100", zero=3, dp=8))
    v = b.verdict
    assert v is not None and DEFAULT_RESERVE == 0 and v.reserve == 0
    assert v.device_bytes == 81559 * 2**20 and v.memory_bytes == 80 * 2**30
    assert v.nccl == 192 * 2**20 and v.fsdp_all_gather_stream == 890 * 2**20 and v.ddp_buckets == 0
    assert v.usable_bytes == (81559 - 767 - 192 - 890) * 2**20
    # judged on the allocator's reserved peak, which holds at least the tensors' peak on the default stream
    # (the peak less FSDP2's flat all-gather outputs in it, the all-gather stream's: kept back above)
    assert v.reserved_peak is not None and v.allocated_peak is not None
    default = b.result.device.peak.default_stream_bytes
    assert v.reserved_peak >= v.allocated_peak >= default and v.peak >= default
    assert v.headroom == v.usable_bytes - v.reserved_peak and v.fits == (v.reserved_peak <= v.usable_bytes)


def test_the_verdict_replays_at_capacity_before_it_refuses() -> None:
    h100 = load_gpu("h100")
    b = build(Options(model="7b", gpu="h100", zero=3, dp=8))
    v = b.verdict
    assert v is not None and v.fits and v.reserved_peak is not None and v.allocated_peak is not None
    # Between the allocated and the reserved peak of the unlimited replay: it fits if the allocator, refused
    # a new segment, can release wholly free cached segments and retry (release_cached_blocks; by hand in
    # tests/test_allocator.py).
    squeeze = (v.headroom + (v.reserved_peak - v.allocated_peak) // 2) / 2**30
    tight = verdict(b.result, h100, reserve=reserve_bytes(squeeze, h100))
    assert tight.allocated_peak is not None and tight.allocated_peak <= tight.usable_bytes < v.reserved_peak
    capped = fits_reserved(b.result, h100, tight.usable_bytes)
    assert tight.fits == (capped is not None)
    if capped is not None:  # what it reserved then stays within the capacity
        assert tight.reserved_peak == capped.reserved_peak <= tight.usable_bytes
    # Below the allocated peak nothing can help: the blocks handed out alone pass it, the tensors' peak
    # does not (the overflow is the allocator's rounding and unsplit blocks).
    below = (v.usable_bytes - v.allocated_peak + 2**20) / 2**30
    short = verdict(b.result, h100, reserve=reserve_bytes(below, h100))
    default = b.result.device.peak.default_stream_bytes  # the tensors' peak on the default stream
    assert not short.fits and default <= short.usable_bytes and short.overflow == "allocator"


def test_fit_searches_the_usable_memory() -> None:
    setup = build(Options(model="7b", seq=4096)).result.setup
    gpu = load_gpu("a100-40gb")
    result = fit(setup, gpu, 8, reserve=4 * 2**30, max_seq=False)
    assert result.usable == gpu.device_bytes - CUDA_CONTEXT - 4 * 2**30
    assert all(c.verdict.fits and c.verdict.reserve == 4 * 2**30 for c in result.fitting)
    assert all(not r.verdict.fits for r in result.rejected)


@pytest.mark.parametrize("gib", [-1.0, 80.0, float("nan"), float("inf")])
def test_reserve_out_of_range_is_refused(gib: float) -> None:
    with pytest.raises(ValueError, match=r"^reserve: "):
        reserve_bytes(gib, load_gpu("h100"))


def test_the_overflowing_term_is_one_alive_at_the_peak() -> None:
    """Issue #20: at the optimizer step the activations are freed, so they cannot be what overflows.
    Llama-2-7B at seq 2048 without checkpointing peaks at the optimizer step; its model states are 16 B per
    parameter (bf16 weights 2 + fp32 master 4 + fp32 m, v 8 + bf16 gradients 2), far above the ids and
    labels the moment holds, so a GPU just under the peak overflows in the step's temporaries — while
    weights + optimizer + gradients + all activations (the bar) pass it already."""
    r = build(Options(model="7b", seq=2048)).result
    dev, psi = r.device, r.params.total
    assert dev.peak.phase == "optimizer step"
    st = dev.states
    assert (st.weights, st.optimizer, st.gradients) == (2 * psi, 12 * psi, 2 * psi)
    # A GPU whose usable memory (its memory less the CUDA context) is one byte under the peak.
    gpu = load_gpu("h100").model_copy(
        update={"device_mib": None, "memory_bytes": dev.peak.bytes - 1 + CUDA_CONTEXT}
    )
    v = verdict(r, gpu, reserve=0)
    assert not v.fits and 16 * psi + dev.activations > v.usable_bytes  # the old rule named activations
    assert v.overflow == "transient"


def test_expandable_segments_are_replayed_when_asked() -> None:
    plain = build(Options(model="7b", gpu="h100", zero=3, dp=8))
    grown = build(Options(model="7b", gpu="h100", zero=3, dp=8, expandable_segments=True))
    assert plain.reserved is not None and grown.reserved is not None and grown.verdict is not None
    assert not plain.reserved.expandable and grown.reserved.expandable
    # the same requests (the stream does not depend on the allocator's setting)
    assert grown.reserved.requested_peak == plain.reserved.requested_peak
    # the verdict judges the expandable replay
    assert grown.verdict.reserved_peak == grown.reserved.reserved_peak
