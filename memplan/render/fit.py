"""Rendering of ``memplan fit``: the search's summary, the configurations that fit, fastest first, and the
rejected families with the memory term that overflows. Units as in ``memplan.render.estimate``."""

from __future__ import annotations

from collections import Counter

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.text import Text

from memplan.config import CpRotate, Method, Parallel
from memplan.render.estimate import BYTE_UNITS, fmt_bytes, fmt_in, fmt_int, unit_of
from memplan.render.fitted import Col, Fitted
from memplan.render.time import fp8_mfu_note
from memplan.search.budget import Verdict
from memplan.search.command import impl_args
from memplan.search.fit import Family, FitResult, estimate_command
from memplan.search.methods import SAVERS
from memplan.search.results import Outcome


def _plain(families: list[Family]) -> bool:
    """Full training without savers in every row: the method and savers columns are left out unsaid."""
    return all(f.finetune.method is Method.FULL and f.saver == 0 for f in families)


def _family_cells(f: Family, plain: bool) -> list[str]:
    par, saver = f.layout.parallel, SAVERS[f.saver]
    method = [] if plain else [f.finetune.method.name.lower(), saver.label()]
    return [
        *method,
        f.checkpointing.name.lower(),
        f.attention.name.lower(),
        str(int(f.zero)),
        f"{par.tp}" + ("+sp" if par.sp else "") + _cp_cell(par),
        f"{par.pp}" + (f"×{par.vpp}" if par.vpp > 1 else ""),
        str(par.ep) + (f" etp{par.expert_tp}" if par.fold > 1 else ""),
        f"{f.layout.dp}" + (f"/{f.layout.hsdp}" if f.layout.hsdp else ""),
    ]


def _cp_cell(par: Parallel) -> str:
    """``·cpN``, with the kind of context parallelism where it is not torch's default ring."""
    if par.cp == 1:
        return ""
    return f"·cp{par.cp}" + ("" if par.cp_rotate is CpRotate.ALLGATHER else f" {par.cp_rotate.value}")


def fit_report(r: FitResult, top: int) -> Group:
    s = r.setup
    head = Text()
    head.append(s.model.name, style="bold cyan")
    head.append(
        f" on {r.gpus} × {r.gpu.name} ({fmt_bytes(r.gpu.memory_bytes)} each), "
        f"seq {fmt_int(s.training.seq_len)}, global batch {fmt_int(r.global_batch)} sequences, "
        f"{s.training.precision.value}, {s.training.optimizer.value}"
    )
    if given := impl_args(s):  # whose code and the kernels asked for, held for every layout
        head.append(", " + " ".join(given))
    if r.cp_rotate != (CpRotate.ALLGATHER,):
        head.append(", cp > 1 as " + ", ".join(k.value for k in r.cp_rotate))
    speed = r.searched / r.seconds if r.seconds else 0.0
    assumed = next((c.timing.assumed_mfu for c in r.fitting), None)  # --mfu: every row's basis
    timed = "at the assumed MFU" if assumed is not None else "predicted"
    lines: list[RenderableType] = [
        head,
        Text(
            f"searched {fmt_int(r.searched)} configurations in {r.seconds * 1000:,.0f} ms ({speed:,.0f}/s): "
            f"{fmt_int(r.evaluated)} evaluated, {fmt_int(r.peaks)} needed their peak, {fmt_int(r.pruned)} "
            f"pruned (step time slower than the rows shown, by its bound or {timed}), "
            f"{fmt_int(r.states_only)} too big by their model states alone; "
            f"{len(r.fitting):,} judged to fit, {len(r.rejected):,} families rejected",
            style="dim",
        ),
    ]
    if assumed is not None:
        lines.append(
            Text(
                f"step times at an assumed MFU of {assumed * 100:g} % (--mfu): the model FLOPs and "
                "the checkpoint recompute at that fraction of the peak, stretched by the pipeline bubble; "
                "rows as fast are ordered by fewer model-parallel devices, the lower ZeRO stage, the "
                "larger micro-batch"
            )
        )
    if r.unsplit_dp:
        lines.append(Text(_unsplit_text(r), style="yellow"))
    if r.best is not None and r.max_seq is not None:
        lines.append(
            Text(f"longest sequence for the best configuration (micro-batch 1): {fmt_int(r.max_seq)}")
        )
    lines += _method_lines(r)
    if r.best is None:
        lines.append(Text("nothing fits: see the rejected families below", style="bold red"))
    parts: list[RenderableType] = [Panel(Group(*lines), title="memplan fit", title_align="left")]
    if r.fitting:
        parts.append(_fitting_table(r, top))
        parts.append(_commands(r, top))
    if r.rejected:
        parts.append(_rejected_table(r, top))
    return Group(*parts)


def _method_lines(r: FitResult) -> list[RenderableType]:
    """Each training method searched: the cheapest way it fits (its lowest saver level, fastest
    configuration there), or that it does not; only when more than one method or a saver was needed."""
    plain = len(r.methods) == 1 and (r.best is None or r.best.family.saver == 0)
    if plain:
        return []
    out: list[RenderableType] = [Text("the cheapest way each training method fits:")]
    for m in r.methods:
        name = m.finetune.method.name.lower()
        if m.refused is not None:
            why = m.refused.removeprefix("finetune: ")
            out.append(Text(f"  {name}: not searched: {why}", style="yellow"))
            continue
        if m.best is None:
            out.append(Text(f"  {name}: does not fit, {_unsearched(m)}", style="red"))
            continue
        b = m.best
        savers = SAVERS[b.family.saver].label()
        how = "without savers" if b.family.saver == 0 else f"with {savers}"
        out.append(
            Text(
                f"  {name}: fits {how}: {b.family.layout.label()}, ZeRO-{int(b.family.zero)}, "
                f"checkpointing {b.family.checkpointing.name.lower()}, {_judged(b.verdict)}, "
                f"{b.timing.tokens_per_s:,.0f} tokens/s, {fmt_int(b.result.params_trainable)} trainable"
            )
        )
    return out


def _judged(v: Verdict) -> str:
    """A listed configuration's memory as its verdict judges it: the allocator's reserved peak, then the
    tensors' peak (the verdict's headline, ``render.verdict``)."""
    if v.reserved_peak is None:
        return f"peak {fmt_bytes(v.peak)}"
    return f"reserved {fmt_bytes(v.reserved_peak)} (tensors' peak {fmt_bytes(v.peak)})"


def _unsearched(m: Outcome) -> str:
    """Which savers a method that fits nothing was searched with, and why not the others: every one, or
    those memplan models for it (fine-tuning: the fused loss, ``check_finetune``; offload: the node's host
    memory)."""
    if len(m.levels) == len(SAVERS):
        return "even with every saver"
    tried = "without savers" if m.levels in ((), (0,)) else "with " + SAVERS[m.levels[-1]].label()
    if not m.finetune.trains_everything:
        why = f"memplan models {m.finetune.method.name.lower()} without offload"
    elif m.no_offload is not None:
        why = m.no_offload
    else:
        why = "the other savers are not modelled for it"
    return f"{tried} ({why})"


def _family_columns(plain: bool) -> list[Col]:
    """The family's settings: keys (never cut), each left out when equal in every row (said below); the
    method and savers only when some row is not plain full training (``_plain``)."""
    method = [] if plain else [Col("method", "left", same=True), Col("savers", "left", same=True)]
    return [
        *method,
        Col("ckpt", "left", same=True),
        Col("attention", "left", same=True),
        Col("ZeRO", same=True),
        Col("tp", same=True),
        Col("pp", same=True),
        Col("ep", same=True),
        Col("dp", same=True),
    ]


def _unsplit_text(r: FitResult) -> str:
    """The data-parallel degrees left out because the global batch does not split over them."""
    dps = ", ".join(map(str, r.unsplit_dp))
    fix = (
        f"; --global-batch {fmt_int(r.splitting_batch)} splits over every one"
        if r.splitting_batch is not None
        else ""
    )
    return (
        f"not searched: the layouts with dp {dps}, over which the global batch of "
        f"{fmt_int(r.global_batch)} sequences does not split into whole micro-batches{fix}"
    )


def _fitting_table(r: FitResult, top: int) -> Fitted:
    shown = r.fitting[:top] if top else r.fitting
    peak_unit = unit_of([c.verdict.peak for c in shown] + [c.verdict.reserved_peak or 0 for c in shown])
    room_unit = unit_of([c.verdict.headroom for c in shown])
    plain = _plain([c.family for c in shown])
    cols = [
        Col("#"),
        *_family_columns(plain),
        Col("micro-\nbatch", priority=1),
        Col(f"peak\n{peak_unit[1]}", priority=2),
        Col(f"reserved\n{peak_unit[1]}", priority=1),
        Col(f"headroom\n{room_unit[1]}", priority=2),
        Col("step s", priority=2),
        Col("tokens/s", priority=1),
        Col("MFU", priority=3),
    ]
    table = Fitted(
        cols, title=f"Configurations that fit, fastest first ({len(shown)} of {len(r.fitting)}; {BYTE_UNITS})"
    )
    for i, c in enumerate(shown, 1):
        t, v = c.timing, c.verdict
        table.add(
            str(i),
            *_family_cells(c.family, plain),
            f"{c.micro_batch} × {c.result.micro_batches}",
            fmt_in(v.peak, peak_unit[0]),
            "–" if v.reserved_peak is None else fmt_in(v.reserved_peak, peak_unit[0]),
            fmt_in(v.headroom, room_unit[0]),
            f"{t.step_time_s:,.2f}",
            f"{t.tokens_per_s:,.0f}",
            f"{t.mfu:.1%}",
        )
    fp8 = fp8_mfu_note([c.timing for c in shown])
    table.caption = (
        "micro-batch: size × micro-batches per step; peak: the most loaded device's tensors; reserved: its "
        "caching allocator's reserved peak, what fits is judged on; headroom: the memory the allocator may "
        "use less reserved; ZeRO: the fastest stage that fits (ties: the lowest); the higher stages of a "
        "listed configuration fit too" + (f"; {fp8}" if fp8 else "")
    )
    return table


def _commands(r: FitResult, top: int) -> Text:
    """Each listed row's ``memplan estimate`` command (``fit.estimate_command``), by its number."""
    shown = r.fitting[:top] if top else r.fitting
    text = Text("to reproduce a row:\n", style="dim")
    for i, c in enumerate(shown, 1):
        text.append(f"{i}: {estimate_command(c, r)}\n")
    return text


def _rejected_table(r: FitResult, top: int) -> Fitted:
    closest = sorted(r.rejected, key=lambda x: x.verdict.peak)
    shown = closest[:top] if top else closest
    reasons = Counter(x.verdict.overflow for x in r.rejected)
    summary = ", ".join(f"{n} {term}" for term, n in reasons.most_common())
    size, unit = unit_of([x.verdict.peak for x in shown] + [x.verdict.reserved_peak or 0 for x in shown])
    plain = _plain([x.family for x in shown])
    cols = [
        *_family_columns(plain),
        Col(f"peak\n{unit}"),
        Col(f"reserved\n{unit}", priority=2),
        Col("overflows", "left"),
        Col("stage", priority=1),
    ]
    title = f"Rejected families, closest first ({len(shown)} of {len(r.rejected)}: {summary})"
    table = Fitted(cols, title=title)
    for x in shown:
        v = x.verdict
        peak = fmt_in(v.peak, size) if v.exact else f"≥ {fmt_in(v.peak, size)}"
        reserved = "–" if v.reserved_peak is None else fmt_in(v.reserved_peak, size)
        table.add(*_family_cells(x.family, plain), peak, reserved, v.overflow or "–", str(v.stage))
    table.caption = (
        "at micro-batch 1 (≥: a lower bound that already passes the memory"
        + (
            "; reserved: the caching allocator's reserved peak where it was replayed"
            if any(x.verdict.reserved_peak is not None for x in shown)
            else ""
        )
        + "); overflows: the "
        "first of weights, optimizer, gradients, activations, transient whose running sum passes the memory; "
        "allocator: the peak fits, the caching allocator's reserved segments do not; families slower than "
        "the rows shown at every micro-batch size are not judged"
    )
    return table
