"""``--impl torchtitan --fp8 tensorwise --fp8-all-gather``: FSDP2's float8 all-gather (torchao's
``enable_fsdp_float8_all_gather``), one rank of Llama-3-8B's widths (2 layers, seq 256) under FSDP2 over
dp 2 (ZeRO-3) on torch's fake process group, its weights wrapped as ``Float8Linear.from_float`` does
(``measure.distributed.titan.wrap_float8_weights``), against the estimate and against the same rank
without the float8 all-gather.

Per block, the converted linears' weights (Llama-3-8B: h 4096, 32 heads, 8 kv heads, d 128, f 14,336):
  wqkv (32 + 2·8)·128 × 4096 = 25,165,824   wo 4096 × 4096 = 16,777,216
  w1, w3, w2  3 × 14,336 × 4096 = 176,160,768                     = 218,103,808 elements (F below)
and two bf16 norms of 4096. Gathered in bf16 a block is 2·F + 2·2·4096 = 436,224,000 B; in float8
F + 2·2·4096 = 218,120,192 B (FSDP2 all-gathers the mixed dtypes as bytes). No dim 0 is odd: no padding.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan.models.llama3")
pytest.importorskip("torchao.float8")

from memplan.config import Impl, Setup
from memplan.engine import estimate
from memplan.measure.compare.tensors import estimated_layers
from memplan.measure.distributed.titan import RankRun, measure_titan_rank
from memplan.measure.distributed.titan_peak import estimated_moments
from tests.hf.harness import hf_setup
from tests.hf.test_torchtitan_ranks import ranked
from tests.hf.test_torchtitan_tensorwise import tensorwise

F = 32 * 128 * 4096 + 2 * 8 * 128 * 4096 + 4096 * 4096 + 3 * 14336 * 4096  # a block's float8 weights
NORMS = 2 * 4096 * 2  # a block's two bf16 norm weights
SCALES = 5 * 4  # a block's five fp32 weight scales


def all_gathered(setup: Setup) -> Setup:
    return setup.model_copy(update={"impl": setup.impl.model_copy(update={"fp8_all_gather": True})})


_RUNS: dict[bool, tuple[Setup, RankRun]] = {}
pytestmark = pytest.mark.xdist_group("fp8_all_gather")  # one worker traces each rank once (``rank``)


def rank(float8_gather: bool) -> tuple[Setup, RankRun]:
    """The dp 2 ZeRO-3 rank, float8-gathered or not (each traced once for the module)."""
    if float8_gather not in _RUNS:
        setup = ranked(tensorwise(hf_setup("llama-3-8b", seq=256, impl=Impl.TORCHTITAN)), 1, False, 2, 3)
        if float8_gather:
            setup = all_gathered(setup)
        _RUNS[float8_gather] = (setup, measure_titan_rank(setup, windows=True))
    return _RUNS[float8_gather]


def test_saves_and_weights_are_unchanged() -> None:
    """The saves (every layer and the total) and the fp32 shards at rest equal the estimate and the
    bf16-gathered rank's: the float8 gather changes what is gathered, not what is kept."""
    setup, run = rank(True)
    _, plain = rank(False)
    est = estimate(setup)
    assert estimated_layers(est) == [run.measured.layer_bytes(i) for i in range(2)]
    assert est.activations == run.measured.activations == plain.measured.activations
    assert est.device.states.weights == run.param_bytes == plain.param_bytes


@pytest.mark.parametrize("checkpointing", ["full", "selective"])
def test_checkpointed_saves(checkpointing: str) -> None:
    """Under FullAC the saves are the block inputs; under SelectiveAC the block's SAC saves plus the cached
    amaxes of the five linears' inputs only, 5 × 2 B (0-d bf16): the weights arrive float8, cast in
    FSDP2's pre-all-gather hook outside the checkpointed block (tensorwise without the float8 all-gather
    caches ten, tests/hf/test_torchtitan_tensorwise.py)."""
    plain = hf_setup("llama-3-8b", seq=256, impl=Impl.TORCHTITAN, checkpointing=checkpointing)
    setup = all_gathered(ranked(tensorwise(plain), 1, False, 2, 3))
    est, run = estimate(setup), measure_titan_rank(setup)
    assert estimated_layers(est) == [run.measured.layer_bytes(i) for i in range(2)]
    assert est.activations == run.measured.activations
    if checkpointing == "selective":
        t, h = 256, 4096  # the block input, W_QKV's, W1's and W2's outputs (test_torchtitan_tensorwise)
        block = t * h * 2 + t * (32 + 2 * 8) * 128 * 2 + t * 14336 * 2 + t * h * 2
        assert run.measured.layer_bytes(0) == block + 5 * 2


def test_the_gathered_block_is_float8() -> None:
    """The unsharded block alive at the top of layer 1's backward (FSDP2's all-gather resize: layer 0's,
    prefetched, layer 1's own freed by then) is F + norms bytes, against bf16's 2·F + norms."""
    _, run = rank(True)
    _, plain = rank(False)
    op = "fsdp2 all-gather (unsharded parameter)"
    assert run.peak.windows["backward 1"][3][op] == F + NORMS == 218_120_192
    assert plain.peak.windows["backward 1"][3][op] == 2 * F + NORMS == 436_224_000


def test_moments_move_as_the_estimate_says() -> None:
    """Measured moment by moment, float8-gathered minus bf16-gathered, by hand:
    - loss backward: + 2 blocks' scales (held by the unsharded Float8TrainingTensors once gathered) = 40 B;
    - final norm's backward: the top block prefetched in float8, − F, its pre-all-gather's five new scales
      beside the held ten: 60 − F;
    - the embedding's backward: + 40 B.
    The estimate moves by the same amounts; its loss backward moment is exact in both."""
    setup, run = rank(True)
    plain_setup, plain = rank(False)
    est, est_plain = estimated_moments(estimate(setup)), estimated_moments(estimate(plain_setup))
    names = ["loss backward", "final norm backward", "embedding backward"]
    meas, meas_plain = run.peak.moments(names), plain.peak.moments(names)
    expected = {"loss backward": 2 * SCALES, "final norm backward": 3 * SCALES - F, "embedding backward": 40}
    for name in names:
        got, before = meas[name], meas_plain[name]
        assert got is not None and before is not None
        assert got - before == expected[name] == est[name] - est_plain[name], name
    assert meas["loss backward"] == est["loss backward"]
    assert meas_plain["loss backward"] == est_plain["loss backward"]
