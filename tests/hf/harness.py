"""Shared by the tests that run a framework's own models (transformers against ``--impl hf``, torchtitan
against ``--impl torchtitan``): a setup with a few layers at a family's real widths, measured under fake
tensors on CPU, compared to the byte per layer, in total and tensor by tensor (an unpaired tensor fails,
where ``memplan trace --impl`` accepts 1 %: ``memplan.measure.compare.impl.TOLERANCE``); a case whose
tensors knowingly do not pair is named in ``EXPECTED_DIFFERENCES`` with its reason, its bytes still
exact. The exact bytes are in the failure message."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from memplan.api import build_setup
from memplan.config import AttentionChoice, Device, ExpertsImpl, Impl, ImplConfig, ModelConfig, Setup
from memplan.engine import Result, estimate
from memplan.measure.compare.impl import paired_tensors
from memplan.measure.compare.tensors import estimated_layers
from memplan.measure.frameworks.dispatch import check_traceable
from memplan.measure.frameworks.hf import measure_hf
from memplan.measure.frameworks.hf_peak import measure_hf_peak
from memplan.measure.frameworks.titan import measure_titan
from memplan.measure.instruments.measured import Measured
from memplan.measure.instruments.moments import estimated_moments
from memplan.presets import load_model_preset
from memplan.presets.hf import model_from_hf_config
from tests.grids import grid

if TYPE_CHECKING:
    from memplan.measure.distributed.titan import RankRun

F = TypeVar("F", bound=Callable[..., None])


def hf_setup(
    model: str | ModelConfig,
    *,
    layers: int = 2,
    seq: int = 512,
    batch: int = 1,
    attention: str = "flash",
    checkpointing: str = "none",
    reentrant: bool = False,
    use_cache: bool = True,
    impl: Impl = Impl.HF,
    **fields: Any,
) -> Setup:
    """``model`` (a preset or a config) cut to ``layers`` layers (``fields`` replaced), CPU kernels."""
    m = load_model_preset(model).model if isinstance(model, str) else model
    m = ModelConfig.model_validate({**m.model_dump(), "num_layers": layers, **fields})
    return build_setup(
        m,
        seq=seq,
        batch=batch,
        attention=AttentionChoice(attention),
        checkpointing=checkpointing,
        device=Device.CPU,
        impl=ImplConfig(impl=impl, reentrant=reentrant, use_cache=use_cache),
    )


TINY: dict[str, Any] = {
    "hidden_size": 256,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 64,
    "ffn_size": 512,
    "vocab_size": 1000,
}
"""The tiny widths an imported family's layer is cut to (``tiny_hf``): what it keeps, at a cost fake tensors
and transformers' own code run in well under a second."""
MOE_WIDTHS: dict[str, Any] = {
    "hidden_size": 64,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 16,
    "ffn_size": 32,
    "vocab_size": 128,
}
"""The small widths the mixtures of experts run at against transformers (its ``moe`` set by each test)."""
CHECKPOINTING = [("none", False), ("full", False), ("full", True)]
"""(checkpointing, reentrant): none, transformers' full checkpointing non-reentrant and reentrant."""


def tiny_hf(config: Mapping[str, Any], name: str, **fields: Any) -> Setup:
    """A family's ``config.json`` through the importer, cut to ``TINY`` widths (``fields`` replaced),
    s = 256."""
    return hf_setup(model_from_hf_config(config, name), seq=256, **(TINY | fields))


def each_case(test: F | None = None, /, **leading: Sequence[Any]) -> Any:
    """``test`` parametrized over what every family's exactness runs — attention (flash, eager),
    ``CHECKPOINTING``, the KV cache (on, off) and any ``leading`` axes (``name=CONFIGS``) — as a pairwise
    covering array (``tests.grids``: every pair of two switches' values run; the whole product under
    ``MEMPLAN_FULL_GRIDS=1``). ``@each_case`` or ``@each_case(name=[...])``."""
    axes = [*map(list, leading.values()), ["flash", "eager"], CHECKPOINTING, [True, False]]
    cases = [(*c[:-2], *c[-2], c[-1]) for c in grid(*axes)]
    mark = pytest.mark.parametrize([*leading, "attention", "checkpointing", "reentrant", "use_cache"], cases)
    return mark(test) if test is not None else mark


def with_experts(setup: Setup, experts: str) -> Setup:
    """``setup`` with transformers' experts implementation ``experts`` (grouped_mm or eager)."""
    return setup.model_copy(update={"impl": setup.impl.model_copy(update={"experts": ExpertsImpl(experts)})})


def check_exact(setup: Setup) -> None:
    """Per layer, in total and FLOPs per phase: the estimate equals transformers' own run."""
    est, meas = estimate(setup), measure_hf(setup)
    layers = [meas.layer_bytes(i) for i in range(setup.model.num_layers)]
    assert (estimated_layers(est), est.activations) == (layers, meas.activations)
    flops = (est.flops.forward, est.flops.backward, est.flops.recompute)
    assert flops == tuple(meas.flops.get(p, 0) for p in ("forward", "backward", "recompute"))


def check_titan(setup: Setup) -> tuple[Result, Measured]:
    """torchtitan's own run (``measure_titan``) equals the estimate per layer, in total and FLOPs per phase
    (the tensors that do not pair named on failure); both returned for further checks."""
    est, meas = estimate(setup), measure_titan(setup)
    unpaired = [r["name"] for r in paired_tensors(est, meas) if r["delta_bytes"]]
    layers = [meas.layer_bytes(i) for i in range(setup.model.num_layers)]
    assert estimated_layers(est) == layers, unpaired
    assert est.activations == meas.activations, unpaired
    flops = (est.flops.forward, est.flops.backward, est.flops.recompute)
    assert flops == (meas.flops["forward"], meas.flops["backward"], meas.flops["recompute"])
    return est, meas


_EAGER_EXPERTS = (
    "transformers' eager experts loop (one torch.where per expert) keeps E pieces of each [T·k, ·] tensor, "
    "rows as the router chose; the estimate keeps each whole. Bytes equal per layer and in total; the "
    "pieces cannot pair one to one with the whole tensors, so the MoE's tensors stay unpaired"
)
EXPECTED_DIFFERENCES: dict[str, tuple[str, tuple[str, ...]]] = {
    "mixtral-8x7b hf flash none experts eager": (_EAGER_EXPERTS, ("moe.", "mlp.experts")),
    "qwen1.5-moe-a2.7b hf flash none experts eager": (_EAGER_EXPERTS, ("moe.", "mlp.experts")),
}
"""The cases (``case_name``) whose tensors knowingly do not pair one to one, each with its reason and the
names (estimated or measured prefixes) that may stay unpaired. Their bytes are still exact per layer and
in total; every other case is exact tensor by tensor too."""


def case_name(setup: Setup) -> str:
    """``model impl attention checkpointing [experts IMPL]``: the key of ``EXPECTED_DIFFERENCES``."""
    s = setup.strategy
    ckpt = f"every-{s.checkpoint_every}" if s.checkpoint_every > 1 else s.checkpointing.name.lower()
    experts = f" experts {setup.impl.experts.value}" if setup.model.moe else ""
    return f"{setup.model.name} {setup.impl.impl.value} {s.attention.name.lower()} {ckpt}{experts}"


def _names(row: dict[str, Any]) -> list[str]:
    """The real names of an unpaired row ``est ↔ meas`` (``—`` is the missing side)."""
    return [n for n in str(row["name"]).split(" ↔ ") if n != "—"]


def check_hf(setup: Setup, fake: bool = True) -> tuple[Result, Measured]:
    """The estimate equals the framework's own run (``setup.impl``) to the byte: per layer, in total and
    tensor by tensor, none unpaired (``fake``: under fake tensors, else real ones, transformers only); an
    ``EXPECTED_DIFFERENCES`` case may leave its named tensors unpaired. Both returned for further checks."""
    measure = check_traceable(setup)
    meas = measure(setup) if fake else measure_hf(setup, fake=False)
    est = estimate(setup)
    est_layers = estimated_layers(est)
    meas_layers = [meas.layer_bytes(i) for i in range(setup.model.num_layers)]
    moe = setup.model.moe
    kinds = (0, moe.dense_layers) if moe and moe.dense_layers else (0,)  # DeepSeek: a dense and an MoE layer
    unpaired = [r for i in kinds for r in paired_tensors(est, meas, i) if r["delta_bytes"]]
    report = (
        f"{case_name(setup)}: layers est {est_layers} meas {meas_layers}; total est {est.activations:,} "
        f"meas {meas.activations:,}; unpaired {[r['name'] for r in unpaired]}"
    )
    assert est_layers == meas_layers, report
    assert est.activations == meas.activations, report
    _, allowed = EXPECTED_DIFFERENCES.get(case_name(setup), ("", ()))
    assert all(n.startswith(allowed) for r in unpaired for n in _names(r)) if allowed else not unpaired, (
        report
    )
    return est, meas


def exact_moe(est: Result, meas: Measured, paired: bool = True) -> None:
    """Every layer's bytes, the total and the FLOPs per phase equal; every tensor paired (``paired``: the
    eager experts loop keeps E pieces per buffer, whose rows sum to the estimate's S = T·k rows, so they
    pair by bytes per layer, not by name)."""
    layers = [meas.layer_bytes(i) for i in range(len(estimated_layers(est)))]
    rows = paired_tensors(est, meas) if paired else []
    unpaired = [r["name"] for r in rows if r["delta_bytes"]]
    assert estimated_layers(est) == layers and est.activations == meas.activations and not unpaired, (
        estimated_layers(est),
        layers,
        est.activations,
        meas.activations,
        unpaired,
    )
    f = est.flops
    assert (f.forward, f.backward, f.recompute) == tuple(
        meas.flops[k] for k in ("forward", "backward", "recompute")
    )


def exact_realised_routing(setup: Setup, experts: str, routed: int) -> None:
    """Real tensors, the router's own choice with ``experts``: every layer's tokens per expert sum to
    ``routed`` (T·k, dropless) and are unbalanced, and the bytes and FLOPs are the estimate's still
    (``exact_moe``; the eager loop's E pieces pair by bytes per layer, not by name)."""
    setup = with_experts(setup, experts)
    meas = measure_hf(setup, fake=False)
    assert all(sum(c) == routed and max(c) > min(c) for c in meas.routing)
    exact_moe(estimate(setup), meas, paired=experts == "grouped_mm")


def layer_difference(setup: Setup) -> int:
    """The layer backward's highest point on transformers' step (``measure_hf_peak``, fake tensors), its
    model's buffers taken off, less the estimate's, in bytes."""
    measured, buffers = measure_hf_peak(setup)
    layer = measured["layer backward"]
    assert layer is not None
    return layer - buffers - estimated_moments(estimate(setup))["layer backward"]


def hf_moment_deltas(setup: Setup) -> dict[str, int]:
    """transformers' step against the estimate at each of its moments: measured (``measure_hf_peak``, the
    model's buffers taken off) minus estimated, bytes."""
    est = estimated_moments(estimate(setup))
    measured, buffers = measure_hf_peak(setup)
    return {name: measured[name] - buffers - value for name, value in est.items()}  # type: ignore[operator]


@functools.cache
def titan_rank(setup: Setup, fake: bool = True, windows: bool = False) -> RankRun:
    """``measure_titan_rank`` once per arguments in a process (its ``RankRun`` is frozen, its trace
    deterministic): tests/hf/test_torchtitan_peak.py and test_torchtitan_ranks.py read one rank's step
    several ways — its saves, its moments, its shards — and ran the same trace up to nine times (15 s of
    the suite's test time). Both files carry ``xdist_group("titan_rank")`` so that one worker holds the
    cache."""
    from memplan.measure.distributed.titan import measure_titan_rank  # torchtitan: only where asked

    return measure_titan_rank(setup, fake=fake, windows=windows)
