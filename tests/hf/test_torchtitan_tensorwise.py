"""``--impl torchtitan --fp8 tensorwise``: torchtitan with torchao's tensorwise dynamic scaling, the float8
recipe of its Dec-2024 converter (torchtitan/float8.py of that time: ``Float8LinearConfig()`` — tensorwise,
torchao's default — through ``convert_to_float8_training`` on every linear but ``output``), which the
published Grand Teton runs trained with (pytorch/torchtitan docs/performance.md at eaea6f6). Built here
through 0.3.0's converter with the tensorwise ``Float8LinearConfig`` (``measure.frameworks.titan
.float8_config``) and traced on one process and on one rank of torch's fake process group, against the
estimate, to the byte.

torchao's float8 matmul saves the bf16 input and weight (blocks/fp8.py), so without checkpointing and
under FullAC the saves are bf16's. Under ``SelectiveAC`` the policy's save list holds ``aten.max.default``,
which is tensorwise's amax (``torch.max(torch.abs(x))``): 10 0-d bf16 amaxes a block are cached beside
bf16's SAC saves (``blocks.fp8.sac_amax_rules``)."""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan.models.llama3")
pytest.importorskip("torchao.float8")

from memplan.config import Fp8Recipe, Impl, Setup
from memplan.engine import estimate
from memplan.measure.compare.tensors import estimated_layers
from memplan.measure.distributed.titan import measure_titan_rank
from memplan.measure.frameworks.titan import measure_titan
from tests.hf.harness import hf_setup
from tests.hf.test_torchtitan_ranks import ranked

AMAXES = 5 * 2 * 2
"""Per block under SelectiveAC: 5 linears (wqkv, wo, w1, w2, w3) × their input's and weight's amax × 2 B
(a 0-d bf16 tensor: ``torch.max`` keeps the input's dtype)."""


def tensorwise(setup: Setup) -> Setup:
    return setup.model_copy(update={"impl": setup.impl.model_copy(update={"fp8": Fp8Recipe.TENSORWISE})})


@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_one_process_saves_what_the_estimate_says(checkpointing: str) -> None:
    """Llama-3-8B's widths, 2 layers, seq 256: every layer and the total exact; bf16's saves, plus under
    SelectiveAC the cached amaxes."""
    plain = hf_setup("llama-3-8b", seq=256, checkpointing=checkpointing, impl=Impl.TORCHTITAN)
    setup = tensorwise(plain)
    est, meas = estimate(setup), measure_titan(setup)
    assert estimated_layers(est) == [meas.layer_bytes(i) for i in range(2)]
    assert est.activations == meas.activations
    extra = AMAXES if checkpointing == "selective" else 0
    bf16 = measure_titan(plain)
    assert [meas.layer_bytes(i) for i in range(2)] == [bf16.layer_bytes(i) + extra for i in range(2)]
    # The casts' temporaries join the peak, above bf16 training's.
    assert est.peak.phases["layer backward"] > estimate(plain).peak.phases["layer backward"]


def test_selective_amaxes_by_hand() -> None:
    """The SAC block by hand (b 1, s 256, h 4096, a 32, kv 8, d 128, f 14336, bf16): the block input, W_QKV's,
    W1's and W2's outputs (test_torchtitan's SelectiveAC facts), and the 10 amaxes."""
    setup = tensorwise(hf_setup("llama-3-8b", seq=256, checkpointing="selective", impl=Impl.TORCHTITAN))
    meas = measure_titan(setup)
    t, h = 256, 4096
    block = t * h * 2 + t * (32 + 2 * 8) * 128 * 2 + t * 14336 * 2 + t * h * 2
    assert meas.layer_bytes(0) == block + AMAXES


@pytest.mark.parametrize("checkpointing", ["selective", "none"])
def test_fsdp2_tp_rank_saves_what_the_estimate_says(checkpointing: str) -> None:
    """One rank of tp 2 (+ SP) × FSDP2 over dp 2 (ZeRO-3), torchtitan's plan on the fake process group: the
    DTensor weights' amax is the rank's local 0-d bf16 scalar, so the SAC block is the tp rank's bf16 block
    (test_torchtitan_ranks) plus the 20 bytes; every layer and the total exact."""
    base = hf_setup("llama-3-8b", seq=256, impl=Impl.TORCHTITAN, checkpointing=checkpointing)
    setup = ranked(tensorwise(base), 2, True, 2, 3)
    est, run = estimate(setup), measure_titan_rank(setup)
    meas = run.measured
    assert estimated_layers(est) == [meas.layer_bytes(i) for i in range(2)]
    assert est.activations == meas.activations
    if checkpointing == "selective":
        b, s, h, t = 1, 256, 4096, 2
        local = b * (s // t) * h * 2  # the block's input: the sequence shard
        mms = b * s * (16 + 2 * 4) * 128 * 2 + b * s * 7168 * 2 + b * s * h * 2  # W_QKV, W1, W2 (partial)
        scattered = 2 * b * (s // t) * h * 2  # reduce_scatter_tensor after W_O and W2
        assert meas.layer_bytes(0) == local + mms + scattered + AMAXES
    assert est.device.states.weights == run.param_bytes  # the fp32 FSDP2 shards: float8 changes no state


def test_linears_are_tensorwise_float8() -> None:
    """Every block linear is torchao's Float8Linear with tensorwise scaling on its three casts; the lm head
    (the Dec-2024 converter's ``fqn != "output"``, 0.3.0's ``filter_fqns=["lm_head"]``) stays bf16."""
    import torch
    from torchao.float8.config import ScalingGranularity

    from memplan.measure.frameworks.titan import float8_config, titan_config

    setup = tensorwise(hf_setup("llama-3-8b", layers=1, seq=256, impl=Impl.TORCHTITAN))
    with torch.device("meta"):
        model = float8_config(setup, titan_config(setup)).build()
    kinds = {n: type(m).__name__ for n, m in model.named_modules() if "Linear" in type(m).__name__}
    assert sum(k == "Float8Linear" for k in kinds.values()) == 5 and kinds["lm_head"] == "Linear"
    f8 = next(m for m in model.modules() if type(m).__name__ == "Float8Linear")
    cfg = f8.config
    casts = (cfg.cast_config_input, cfg.cast_config_weight, cfg.cast_config_grad_output)
    assert all(c.scaling_granularity is ScalingGranularity.TENSORWISE for c in casts)


def test_context_parallel_rank_saves_what_the_estimate_says() -> None:
    """cp 2 (torch's ring, all-gather rotation), batch 2, SelectiveAC: rank 0 of torchtitan's
    ``apply_cp_to_forward`` keeps what the estimate says, the amaxes included, to the byte
    (tests/measure/test_titan_context's comparison: tensors, layers, total, FLOPs)."""
    from tests.measure.test_titan_context import unequal, with_cp

    base = hf_setup("llama-3-8b", seq=256, batch=2, checkpointing="selective", impl=Impl.TORCHTITAN)
    setup = with_cp(tensorwise(base), 2)
    assert not unequal(setup, measure_titan(setup, cp_rank=0))


def test_linears_the_converter_skips_cache_no_amax() -> None:
    """ffn 14,344 (not a multiple of 16): 0.3.0's ``module_filter_fn`` leaves W1, W2, W3 in bf16, so the
    SelectiveAC block caches the amaxes of W_QKV and W_O only: 4 × 2 B (``blocks.fp8.titan_linears``).
    By hand (b 1, s 256, h 4096, (a + 2·kv)·d = 6,144, bf16): block input, W_QKV's, W1's and W2's outputs."""
    base = hf_setup("llama-3-8b", seq=256, checkpointing="selective", impl=Impl.TORCHTITAN, ffn_size=14344)
    setup = tensorwise(base)
    est, meas = estimate(setup), measure_titan(setup)
    t, h = 256, 4096
    block = t * h * 2 + t * 6144 * 2 + t * 14344 * 2 + t * h * 2
    assert [meas.layer_bytes(i) for i in range(2)] == estimated_layers(est) == [block + 4 * 2] * 2
    assert est.activations == meas.activations


def test_compiled_selective_keeps_the_scales_its_backward_reads() -> None:
    """``--compile`` (dynamo's selective-checkpoint op through AOTAutograd's min-cut partitioner, fake
    tensors): the block by hand (b 1, s 256, Llama-3-8B's widths, bf16) — its input, W_QKV's and W1's
    outputs (W2's, which no backward reads, not kept), the CPU generator's state for the flash op's re-run,
    5 weight amaxes and the amaxes of W_O's and of W1/W3's input (bf16 0-d), 4 fp32 inverse scales."""
    from memplan.measure.frameworks.titan import measure_titan_compiled
    from memplan.measure.runs.compiled import compiled_comparison_json

    plain = hf_setup("llama-3-8b", seq=256, checkpointing="selective", impl=Impl.TORCHTITAN)
    setup = tensorwise(plain.model_copy(update={"impl": plain.impl.model_copy(update={"compile": True})}))
    est, meas = estimate(setup), measure_titan_compiled(setup)
    out = compiled_comparison_json(est, meas)
    assert out["diff"]["exact"], [r for r in out["diff"]["tensors"] if r["delta_bytes"]]
    t, h = 256, 4096
    block = t * h * 2 + t * (32 + 2 * 8) * 128 * 2 + t * 14336 * 2 + 5056
    assert meas.layer_bytes(0) == block + 7 * 2 + 4 * 4
