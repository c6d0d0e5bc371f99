"""Issue #21 item 6: the search's memos and shortcuts around the Python model give the same numbers.

- ``layer_backward.layer_terms`` (the layer moment's backward transient and re-run working set,
  memoised without ZeRO, dp and the micro-batch count) against the two functions it memoises, evaluated
  afresh on each setup — with the memo filled first by another ZeRO stage / micro-batch count of the same
  configuration, so that the value read back is one computed for a different setup.
- ``activations.layer_working_set`` (memoised on ``rank_key``) against one layer's rules.
- ``engine.unplanned`` (an estimate without its stage plans) gives ``search.bound.stages_bound`` the
  same bound, bit for bit, as the full estimate, and the same pieces, FLOPs and parameters.
"""

from __future__ import annotations

import pytest

from memplan.analytic.activations import clear_working_sets, kept, layer_rules, layer_working_set, setup_key
from memplan.analytic.moments.layer_backward import (
    clear_terms,
    layer_backward_transient,
    layer_terms,
    recompute_working_set,
)
from memplan.api import build_setup
from memplan.blocks.inventory import Dims, Scope
from memplan.config import Parallel, Setup
from memplan.config.strategy import AttentionChoice
from memplan.engine import estimate, unplanned
from memplan.presets import load_gpu
from memplan.search.bound import stages_bound
from memplan.search.space import virtual_layers

H100 = load_gpu("h100-sxm")

CASES = [
    # (model, seq, checkpointing, attention, parallel)
    ("gpt2", 1024, "none", "eager", Parallel()),
    ("gpt2", 1024, "full", "flash", Parallel()),
    ("qwen3-0.6b", 2048, "selective", "eager", Parallel(tp=2, sp=True)),
    ("qwen3-0.6b", 2048, "selective", "flash", Parallel(tp=2, sp=True, pp=2)),
    ("llama-3.2-1b", 4096, "every-2", "flash", Parallel(pp=2)),
    ("llama-3.2-1b", 2048, "full", "flash", Parallel(tp=2, sp=True, cp=2)),
]
"""Each checkpointing (segments, selective eager and flash), tp + sp, pp and cp."""

VARIANTS = [(0, 1, 1), (1, 8, 1), (2, 8, 4), (3, 16, 8)]
"""(ZeRO stage, dp, micro-batches per step): what the memo's key leaves out."""


def _setup(
    name: str, seq: int, ckpt: str, attention: str, par: Parallel, zero: int, dp: int, n: int
) -> Setup:
    return build_setup(
        name,
        seq=seq,
        checkpointing=ckpt,
        attention=AttentionChoice(attention),
        zero=zero,
        dp=dp,
        parallel=par,
        grad_accum=n,
    )


@pytest.mark.parametrize(("name", "seq", "ckpt", "attention", "par"), CASES)
def test_layer_terms_memo_is_the_functions(
    name: str, seq: int, ckpt: str, attention: str, par: Parallel
) -> None:
    """The memo read back for every ZeRO stage, dp and micro-batch count equals the two functions on that
    setup (the layer moments' terms as ``analytic.peak`` read them before the memo: the working set 0
    with segments), whichever variant filled it."""
    for first in VARIANTS:
        clear_terms()
        layer_terms(
            _setup(name, seq, ckpt, attention, par, *first),
            estimate(_setup(name, seq, ckpt, attention, par, *first)).stages[0].params,
        )
        for variant in VARIANTS:
            setup = _setup(name, seq, ckpt, attention, par, *variant)
            params = estimate(setup).stages[0].params
            working = 0 if setup.strategy.segment else recompute_working_set(setup)
            fresh = (layer_backward_transient(setup, Dims.of(setup), params), working)
            assert layer_terms(setup, params) == fresh


def test_peaks_unchanged_by_the_memo() -> None:
    """Every stage's peak moments with the memo filled by another ZeRO stage equal those computed on a
    cold memo (the peak of each setup alone)."""
    name, seq, ckpt, attention, par = CASES[3]
    cold = {}
    for variant in VARIANTS:
        clear_terms()
        r = estimate(_setup(name, seq, ckpt, attention, par, *variant))
        cold[variant] = [sp.peak.moments for sp in r.stages]
    clear_terms()
    for variant in VARIANTS:
        r = estimate(_setup(name, seq, ckpt, attention, par, *variant))
        assert [sp.peak.moments for sp in r.stages] == cold[variant]


@pytest.mark.parametrize(
    ("tp", "pp", "vpp", "cp", "hsdp", "ckpt"),
    [
        (8, 16, 8, 1, 0, "none"),  # interleaved pipeline over 126 layers, tp + sp
        (4, 16, 1, 4, 0, "full"),  # context parallelism, re-run layers
        (8, 1, 1, 2, 8, "selective"),  # HSDP
        (8, 1, 1, 1, 0, "none"),
    ],
)
def test_unplanned_gives_the_same_stages_bound(
    tp: int, pp: int, vpp: int, cp: int, hsdp: int, ckpt: str
) -> None:
    """``stages_bound`` reads no stage plan: from ``unplanned`` it is the full estimate's, bit for bit."""
    gpus, batch = 16384, 2048
    dp = gpus // (tp * pp * cp)
    virtual = virtual_layers(126, pp, vpp) if vpp > 1 else None
    par = Parallel(tp=tp, sp=tp > 1, pp=pp, vpp=vpp, pp_layers=virtual, cp=cp)
    setup = build_setup(
        "405b", seq=8192, checkpointing=ckpt, zero=1 if hsdp else 0, dp=dp, parallel=par,
        grad_accum=batch // dp, hsdp=hsdp,
    )  # fmt: skip
    bare, full = unplanned(setup), estimate(setup)
    assert bare.stages == ()
    assert (bare.pieces, bare.flops, bare.params) == (full.pieces, full.flops, full.params)
    assert stages_bound(bare, H100) == stages_bound(full, H100)


@pytest.mark.parametrize(("name", "seq", "ckpt", "attention", "par"), CASES)
def test_layer_working_set_memo_is_the_rules(
    name: str, seq: int, ckpt: str, attention: str, par: Parallel
) -> None:
    """One layer's saves read back for every ZeRO stage, dp and micro-batch count — the memo filled by
    another of them — are its rules' on that setup."""
    for first in VARIANTS:
        clear_working_sets()
        layer_working_set(_setup(name, seq, ckpt, attention, par, *first))
        for variant in VARIANTS:
            setup = _setup(name, seq, ckpt, attention, par, *variant)
            fresh = tuple(kept(layer_rules(setup, Dims.of(setup)), Scope.LAYER, 1))
            assert layer_working_set(setup) == fresh


def test_setup_key_is_every_field_but_those_left_out() -> None:
    """``setup_key`` reads the fields pydantic iterates, in its order, less the ones named (a field added
    to ``Setup``, ``TrainingConfig`` or ``StrategyConfig`` joins the keys)."""
    setup = _setup(*CASES[3], 2, 8, 4)
    without = frozenset({"grad_accum", "zero", "dp"})
    expected = (
        *(v for n, v in setup if n not in ("training", "strategy")),
        *(v for n, v in setup.training if n not in without),
        *(v for n, v in setup.strategy if n not in without),
    )
    assert setup_key(setup, without) == expected
    assert len(setup_key(setup, frozenset())) == len(expected) + 3
