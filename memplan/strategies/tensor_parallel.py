"""Model parallelism: the degrees, their checks against the model, and one tensor-parallel rank's model.

``config.Parallel`` holds the degrees (``Setup.parallel``); this module checks them against the model and
builds one tensor-parallel rank's model.

Tensor parallelism as one rank sees it (Shoeybi et al. 2019, Megatron-LM §3; Korthikanti et al. 2022 §4.2.2):
W_Q/W_K/W_V and the MLP's first matrices are column-parallel (each rank a/t query heads, kv/t key/value
groups, f/t MLP columns, their biases split too), W_O and the MLP's last matrix are row-parallel (the
inputs split, the bias whole on every rank), norms are replicated, the embedding and the lm head are
vocabulary-parallel (v/t rows each). That rank therefore computes, keeps and owns exactly what a model of
a/t heads, kv/t key/value heads (same head_dim), f/t MLP width and ⌈v/t⌉ vocabulary does: ``tp_model``
builds that model, and the whole analytic core (inventory, parameters, FLOPs, peak transients) runs on it
unchanged. Sequence parallelism then divides what that model still holds whole (``shard.py``).

Known limitations (NB): Megatron pads the vocabulary to a multiple of 128·t (``make-vocab-size-divisible-
by``); memplan uses ⌈v/t⌉ rows per rank, so at tp = 1 the plan equals the single-device estimate. Uneven
pipeline stages (``--decoder-first-pipeline-num-layers``) are not modelled: pp must divide the layers.
"""

from __future__ import annotations

import math

from memplan.config import Impl, ModelConfig, Parallel, Setup
from memplan.strategies.context_parallel import check_context


def divisors(n: int, limit: int = 1 << 12) -> list[int]:
    """The divisors of n up to ``limit``, ascending."""
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _choices(values: list[int], most: int = 8) -> str:
    shown = [str(v) for v in values[:most]]
    return ", ".join(shown) + (" …" if len(values) > most else "")


def tp_widths(model: ModelConfig, extra: tuple[int, ...] = ()) -> dict[str, int]:
    """The widths a tensor-parallel degree must divide, by field name (``extra``: MoE expert widths)."""
    widths = {"num_heads": model.num_heads, "num_kv_heads": model.kv_heads, "ffn_size": model.ffn}
    for i, width in enumerate(extra):
        widths[f"moe width {i}"] = width
    return widths


def check_parallel(setup: Setup, parallel: Parallel, extra_widths: tuple[int, ...] = ()) -> None:
    """Raise a one-line ``ValueError`` (field, what is wrong, the fix) when the degrees do not fit the model.

    ``extra_widths``: further MLP widths tp must divide (routed and shared expert widths of an MoE).
    """
    m, t = setup.model, setup.training
    widths = tp_widths(m, extra_widths)
    good_tp = divisors(math.gcd(*widths.values()))
    for field, width in widths.items():
        if width % parallel.tp:
            why = " (whole key/value groups per rank)" if field == "num_kv_heads" else ""
            raise ValueError(
                f"tp: {parallel.tp} does not divide {field} {width} of {m.name}{why}; "
                f"use --tp {_choices(good_tp)}"
            )
    if parallel.sp and t.seq_len % parallel.tp:
        lower = t.seq_len - t.seq_len % parallel.tp
        fix = f"--seq {lower} or {lower + parallel.tp}" if lower else f"--seq {parallel.tp}"
        raise ValueError(
            f"seq: {t.seq_len} is not a multiple of --tp {parallel.tp}, which sequence parallelism "
            f"splits it by; use {fix}"
        )
    layers = parallel.pp_layers
    if layers is not None and sum(layers) != m.num_layers:
        raise ValueError(
            f"pp-layers: the stages hold {sum(layers)} layers, {m.name} has {m.num_layers}; "
            "make the counts add up"
        )
    if parallel.pp > m.num_layers:
        raise ValueError(
            f"pp: {parallel.pp} stages for the {m.num_layers} layers of {m.name}; use --pp {m.num_layers} "
            "or fewer"
        )
    listed = layers is not None and len(layers) == parallel.pp * parallel.vpp > parallel.pp
    if parallel.vpp > 1 and not listed:
        uneven = layers is not None or m.num_layers % parallel.pp
        per_stage = m.num_layers // parallel.pp
        if uneven or per_stage % parallel.vpp:
            raise ValueError(
                f"vpp: {parallel.vpp} virtual stages need the same layers on every stage, a multiple of "
                f"{parallel.vpp}; use a --pp that divides the {m.num_layers} layers "
                f"({_choices(divisors(m.num_layers))}) and a --vpp that divides the layers per stage, or "
                f"list the {parallel.pp * parallel.vpp} virtual stages' layers with --pp-layers"
            )
    # torchtitan runs torch's ScheduleInterleaved1F1B, whose rounds take any multiple of max(1, ⌊n/p⌋)
    # micro-batches (config.impl_rules.check_titan_interleaved)
    if parallel.vpp > 1 and t.grad_accum % parallel.pp and setup.impl.impl is not Impl.TORCHTITAN:
        raise ValueError(
            f"grad-accum: the interleaved schedule runs micro-batches in groups of --pp {parallel.pp}, "
            f"got {t.grad_accum}; use a multiple of {parallel.pp} micro-batches per step"
        )


def tp_model(model: ModelConfig, tp: int, etp: int | None = None) -> ModelConfig:
    """The model one tensor-parallel rank holds: a/t heads, kv/t key/value heads, f/t MLP (and shared
    experts), ⌈v/t⌉ vocabulary; the routed experts f/``etp`` wide where the experts' own degree is given
    (``Parallel.expert_tp``: 1 under parallel folding, whole experts).

    Call ``check_parallel`` first (t must divide heads, kv heads and ffn). head_dim and hidden size stay.
    """
    if tp == 1:
        return model
    return model.model_copy(
        update={
            "num_heads": model.num_heads // tp,
            "num_kv_heads": model.kv_heads // tp,
            "head_dim": model.dim,
            "ffn_size": model.ffn // (tp if etp is None else etp),
            "vocab_size": -(-model.vocab_size // tp),
            "moe": model.moe.for_tp(tp) if model.moe else None,
        }
    )


def check_layout(setup: Setup) -> None:
    """One-line ``ValueError`` when the parallel degrees or the MoE do not fit the model and the setup."""
    parallel, moe = setup.parallel, setup.model.moe
    check_context(setup)
    check_parallel(setup, parallel, moe.widths(setup.model) if moe else ())
    if parallel.fold > 1:
        check_folding(setup)
    if parallel.ep == 1:
        return
    if moe is None:
        raise ValueError(
            f"ep: {setup.model.name} is dense; expert parallelism needs a mixture of experts, drop --ep"
        )
    if moe.experts % parallel.ep:
        raise ValueError(
            f"ep: {parallel.ep} does not divide the {moe.experts} experts of {setup.model.name}; "
            f"use --ep {', '.join(str(d) for d in range(1, moe.experts + 1) if moe.experts % d == 0)}"
        )
    dp = setup.strategy.dp
    if parallel.fold > 1 and (parallel.fold * dp) % parallel.ep:
        raise ValueError(
            f"ep: with --etp {parallel.expert_tp} expert parallelism takes its {parallel.ep} ranks from "
            f"tp/etp × dp = {parallel.fold * dp}; use an --ep that divides {parallel.fold * dp}"
        )
    if parallel.fold == 1 and dp % parallel.ep:
        raise ValueError(
            f"ep: expert parallelism takes its {parallel.ep} ranks from data parallelism, but --dp is {dp}; "
            f"use a --dp that is a multiple of {parallel.ep}, or --etp 1 (parallel folding, ranks from "
            "tp × dp) under --impl megatron"
        )


def every_layer_moe(m: ModelConfig) -> bool:
    """Every layer of ``m`` a mixture of experts: no dense first layers, no dense layers between."""
    return m.moe is not None and not (m.moe.dense_layers or m.moe_every)


def routed_only(m: ModelConfig) -> bool:
    """Every MLP of ``m`` routed experts alone: every layer an MoE (``every_layer_moe``) without shared
    experts (what parallel folding is modelled for)."""
    return every_layer_moe(m) and not (m.moe is not None and m.moe.shared_experts)


def foldable(setup: Setup, sp: bool, cp: int) -> bool:
    """Whether ``setup``'s model and implementation, on a layout with ``sp`` and ``cp``, can run parallel
    folding as memplan models it (``check_folding``'s conditions; ``search.space`` tries it where so)."""
    return setup.impl.impl is Impl.MEGATRON and routed_only(setup.model) and sp and cp == 1


def check_folding(setup: Setup) -> None:
    """MoE parallel folding (``--etp E`` below tp, ``Parallel.fold``) as memplan models it: Megatron-core's
    MoE layer, under sequence parallelism (Megatron-LM's arguments.py: "When using MoE and tensor
    parallelism, sequence parallelism must be used"), every layer an MoE without shared experts (their
    MLP is split over tp and gathers its input over tp, which ``time.comm`` does not count beside
    folded experts yet), without context parallelism (Megatron folds cp into the experts' ranks too: not
    modelled)."""
    m, par = setup.model, setup.parallel
    if m.moe is None:
        raise ValueError(f"etp: {m.name} is dense; expert tensor parallelism needs a mixture of experts")
    if setup.impl.impl is not Impl.MEGATRON:
        raise ValueError(
            f"etp: --etp {par.expert_tp} with --tp {par.tp} (MoE parallel folding) is Megatron-core's; add "
            "--impl megatron or drop --etp"
        )
    if not par.sp:
        raise ValueError(
            "etp: Megatron runs a mixture of experts under tensor parallelism with --sp; add --sp"
        )
    if par.cp > 1:
        raise ValueError("etp: parallel folding with context parallelism is not modelled; drop --cp or --etp")
    if not routed_only(m):
        raise ValueError(
            f"etp: parallel folding is modelled for models whose every MLP is routed experts alone; "
            f"{m.name} has shared experts or dense layers: drop --etp"
        )
