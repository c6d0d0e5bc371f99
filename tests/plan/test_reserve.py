"""Issue #13 item 4: a plan fits in a GPU's memory less a reserve (CUDA context, allocator), ``--reserve``."""

from __future__ import annotations

import pytest

from memplan.api import Options, build
from memplan.presets import load_gpu
from memplan.search.budget import DEFAULT_RESERVE, reserve_bytes, verdict
from memplan.search.fit import fit


def test_default_reserve_is_one_gib_off_the_usable_memory() -> None:
    b = build(Options(model="7b", gpu="h100", zero=3, dp=8))
    v = b.verdict
    assert v is not None and DEFAULT_RESERVE == 2**30
    assert v.reserve == DEFAULT_RESERVE and v.usable_bytes == v.memory_bytes - 2**30
    assert v.headroom == v.usable_bytes - v.peak and v.fits == (v.peak <= v.usable_bytes)


def test_a_peak_between_usable_and_nominal_memory_does_not_fit() -> None:
    b = build(Options(model="7b", gpu="h100", zero=3, dp=8, reserve=0))
    assert b.verdict is not None and b.verdict.fits
    # Keep back the headroom and half a GiB more: the same plan no longer fits.
    gib = (b.verdict.memory_bytes - b.verdict.peak) / 2**30 + 0.5
    tight = verdict(b.result, load_gpu("h100"), reserve=reserve_bytes(gib, load_gpu("h100")))
    assert not tight.fits and tight.peak < tight.memory_bytes and tight.overflow is not None


def test_fit_searches_the_usable_memory() -> None:
    setup = build(Options(model="7b", seq=4096)).result.setup
    gpu = load_gpu("a100-40gb")
    result = fit(setup, gpu, 8, reserve=4 * 2**30, max_seq=False)
    assert result.usable == gpu.memory_bytes - 4 * 2**30
    assert all(c.verdict.peak <= result.usable and c.verdict.reserve == 4 * 2**30 for c in result.fitting)
    assert all(r.verdict.peak > result.usable for r in result.rejected)


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
    gpu = load_gpu("h100").model_copy(update={"memory_bytes": dev.peak.bytes - 1})
    v = verdict(r, gpu, reserve=0)
    assert not v.fits and 16 * psi + dev.activations > v.usable_bytes  # the old rule named activations
    assert v.overflow == "transient"
