"""Search commands registered on the main typer app: ``compare`` and ``fit``.

``compare`` tabulates models × strategy variations (each a ``memplan estimate``); ``fit`` searches the
layouts that fit a GPU count. Options come from ``memplan.cli.common``, computing from ``memplan.api`` and
``memplan.search``, rendering from ``memplan.render.plan``. torch is never imported here.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any

import typer

from memplan.advice import flags
from memplan.api import Options, build_setup, gpu_of, impl_of, load_model
from memplan.cli.common import (
    JsonOpt,
    console,
    handle_user_errors,
    option_default,
    options_of,
    plain,
    with_options,
)
from memplan.config import (
    Attention,
    AttentionChoice,
    Checkpointing,
    CpRotate,
    ModelConfig,
    Setup,
    ZeroStage,
    default_cp_rotate,
    parse_checkpointing,
)
from memplan.fit_options import FIT_OPTIONS, FIT_PASSTHROUGH

# NB: memplan.search and memplan.render.plan are imported inside the commands.

_OUTPUT = "Output"


def register(app: typer.Typer) -> None:
    """Add ``compare`` and ``fit`` to ``app``."""
    app.command("compare", help=COMPARE_HELP)(compare_command)
    app.command("fit", help=FIT_HELP)(fit_command)


# ----------------------------------------------------------------------------------------------------
# compare
# ----------------------------------------------------------------------------------------------------
COMPARE_HELP = """Compare models and strategy variations side by side: one row per combination.

--model takes a comma-separated list; each --vary KEY=A,B,… varies one setting of `memplan estimate` (any of
its options: checkpointing, attention, zero, tp, sp, pp, dp, gpus, batch, seq, precision, gpu, mfu, …);
the rows are the cartesian product; a list-valued setting (offload, pp-layers, freeze, lora-targets) joins
the entries of one value with +, e.g. --vary pp-layers=16+16,8+24. Columns: the memory terms and the peak of
the most loaded device with a stacked bar, FLOPs per step, the step time and whether it fits (with --gpu).

Examples:

  memplan compare -m 7b,70b,405b --seq 4096 --gpus 64 --zero 3 --gpu h100

  memplan compare -m 70b --vary checkpointing=none,selective,full --vary attention=eager,flash --gpu h100

  memplan compare -m 8b --vary tp=1,2,4,8 --sp --gpus 8 --gpu a100 --sort -tokens_per_s --markdown
"""


# Every option of `memplan estimate` but the model (a list here) and the measured step time.
_COMPARE_OPTIONS = tuple(name for name in Options.model_fields if name not in ("model", "step_time"))


@handle_user_errors
@with_options(*_COMPARE_OPTIONS)
def compare_command(
    model: Annotated[
        str | None,
        typer.Option(
            "--model", "-m", help="Model presets, comma-separated (e.g. 7b,70b,405b)", show_default=False
        ),
    ] = None,
    vary: Annotated[
        list[str] | None,
        typer.Option(
            "--vary", metavar="KEY=A,B", help="A setting and its values; repeat for more", show_default=False
        ),
    ] = None,
    sort: Annotated[
        str | None,
        typer.Option(
            "--sort", metavar="COLUMN", help="Sort by a column (-COLUMN: descending)", show_default=False
        ),
    ] = None,
    as_json: JsonOpt = False,
    as_csv: Annotated[
        bool, typer.Option("--csv", help="Print CSV (raw numbers)", rich_help_panel=_OUTPUT)
    ] = False,
    as_markdown: Annotated[
        bool, typer.Option("--markdown", help="Print a Markdown table", rich_help_panel=_OUTPUT)
    ] = False,
    **options: Any,
) -> None:
    from memplan import compare as cmp
    from memplan.render import plan as render

    if sum((as_json, as_csv, as_markdown)) > 1:
        raise ValueError("output: choose one of --json, --csv and --markdown")
    models = [m.strip() for m in (model or "").split(",") if m.strip()]
    # Only what the user set: a --vary value then replaces it, and defaults stay Options' own.
    base = {k: v for k, v in options.items() if v != option_default(k)}
    varies = cmp.parse_vary(vary or [])
    from memplan.cli.progress import Bar

    with Bar("estimating", total=cmp.row_count(models, varies), unit="rows") as bar:
        built = cmp.rows(base, models, varies, on_row=lambda: bar.advance())
    rows = cmp.sort_rows(built, sort)
    keys = cmp.columns(rows)
    if as_json:
        typer.echo(json.dumps({"columns": keys, "rows": [cmp.row_json(r) for r in rows]}, allow_nan=False))
    elif as_csv:
        typer.echo(render.to_csv(rows, keys), nl=False)
    elif as_markdown:
        typer.echo(render.to_markdown(rows, keys), nl=False)
    else:
        console().print(render.compare_table(rows, keys, cmp.common_settings(rows)))


# ----------------------------------------------------------------------------------------------------
# fit
# ----------------------------------------------------------------------------------------------------
FIT_HELP = """Search the layouts and strategies that fit a model on N GPUs, fastest first.

Searches checkpointing (none, selective, full), attention (eager, flash), ZeRO stage (0-3), the tp × pp × dp
splits of --gpus (tp ≤ --tp-max, sequence parallel when tp > 1, ep for MoE) and the micro-batch size, at a
fixed global batch; ranks what fits by predicted tokens/s (kernels, the communication on the GPU's
topology, the pipeline bubble; or at --mfu when given), and says for every rejected family which memory
term overflows. Also
reports the longest sequence the best configuration fits.

Examples:

  memplan fit -m 70b --seq 4096 --gpu h100 --gpus 64

  memplan fit -m mixtral --seq 8192 --gpu h100 --gpus 32 --global-batch 512 --json | jq '.configs[0].settings'

Environment: MEMPLAN_JIT=1 replays the caching allocator compiled by numba (pip install 'memplan[jit]'; its
load, ≈ 0.7 CPU s, pays off in a process that runs many searches, not in one command), auto does once the
replays in Python have spent that load, 0 (the default) never does.
"""


def _list(text: str | None, what: str, parse: Any) -> tuple[Any, ...] | None:
    if text is None:
        return None
    try:
        return tuple(parse(v.strip()) for v in text.split(",") if v.strip())
    except (KeyError, ValueError):
        raise ValueError(
            f"{what}: cannot read {text!r}; give a comma-separated list, e.g. --{what} {FIT_LISTS[what]}"
        ) from None


FIT_LISTS = {
    "checkpointing": "none,selective,full",
    "attention": "eager,flash",
    "zero": "0,1,2,3",
    "micro-batches": "1,2,4,8",
    "cp-rotate": "allgather,kv-gather",
}


@handle_user_errors
@with_options("model", *FIT_OPTIONS)
def fit_command(
    gpu: Annotated[
        str | None,
        typer.Option(
            "--gpu", metavar="NAME", help="GPU preset (required; `memplan gpus`)", show_default=False
        ),
    ] = None,
    gpus: Annotated[
        int | None, typer.Option("--gpus", metavar="N", help="Number of GPUs (required)", show_default=False)
    ] = None,
    global_batch: Annotated[
        int | None,
        typer.Option(
            "--global-batch",
            metavar="B",
            help=plain("Sequences per step [default: ≈ 4M tokens, at least one per GPU]"),
            show_default=False,
        ),
    ] = None,
    checkpointing: Annotated[
        str | None,
        typer.Option(
            "--checkpointing",
            metavar="LIST",
            help=plain("Checkpointing modes to search [default: none,selective,full]"),
            show_default=False,
        ),
    ] = None,
    attention: Annotated[
        str | None,
        typer.Option(
            "--attention",
            metavar="LIST",
            help=plain("Attention kernels to search [default: eager,flash]"),
            show_default=False,
        ),
    ] = None,
    zero: Annotated[
        str | None,
        typer.Option(
            "--zero",
            metavar="LIST",
            help=plain("ZeRO stages to search [default: 0,1,2,3]"),
            show_default=False,
        ),
    ] = None,
    micro_batches: Annotated[
        str | None,
        typer.Option(
            "--micro-batches",
            metavar="LIST",
            help=plain("Micro-batch sizes to search [default: 1,2,4,8,16,32]"),
            show_default=False,
        ),
    ] = None,
    tp_max: Annotated[
        int, typer.Option("--tp-max", metavar="N", help="Largest tensor-parallel degree to search")
    ] = 8,
    cp_max: Annotated[
        int,
        typer.Option(
            "--cp-max",
            metavar="N",
            help="Largest context-parallel degree to search (powers of two, flash attention) beside every "
            "layout; 1: never",
        ),
    ] = 16,
    cp_rotate: Annotated[
        str | None,
        typer.Option(
            "--cp-rotate",
            metavar="LIST",
            help=plain(
                "Kinds of context parallelism to search for every cp > 1: allgather, alltoall (torch's "
                "ring), kv-gather (Llama 3's, Transformer Engine's all_gather: no ring) [default: the "
                "implementation's own: alltoall under --impl megatron, else allgather]"
            ),
            show_default=False,
        ),
    ] = None,
    method: Annotated[
        str | None,
        typer.Option(
            "--method",
            metavar="full,lora,qlora",
            help=plain(
                "Training methods to search, each with the memory savers it needs (fused loss, "
                "optimizer/parameter/activation offload) [default: the --finetune method, then LoRA and "
                "QLoRA when it fits only with savers or not at all]"
            ),
            show_default=False,
        ),
    ] = None,
    top: Annotated[
        int, typer.Option("--top", metavar="N", help="Rows shown (and configurations in --json); 0: all")
    ] = 10,
    as_json: JsonOpt = False,
    **options: Any,
) -> None:
    from memplan.config import FINETUNE_OPTIONS
    from memplan.search.budget import reserve_bytes
    from memplan.search.fit import Space, fit
    from memplan.search.methods import finetunes, parse_methods

    if gpu is None or gpus is None:
        raise ValueError("gpu: fit needs --gpu NAME and --gpus N (e.g. --gpu h100 --gpus 64)")
    if top < 0:
        raise ValueError(f"top: must be 0 (every configuration) or more, got {top}; e.g. --top 10")
    o = options_of(options)
    if o.precision == "fsdp2-mixed":  # the base is one device; the search's layouts without FSDP2 too
        raise ValueError(
            "precision: fsdp2-mixed needs FSDP2 (ZeRO-2/3 over more ranks than one) and fit searches layouts "
            "without it too; fit with bf16-mixed, then estimate a ZeRO-2/3 layout with fsdp2-mixed"
        )
    model = load_model(o.model).model
    defaults = Space()
    space = Space(
        checkpointing=_list(checkpointing, "checkpointing", _whole_layer_mode) or defaults.checkpointing,
        attention=_list(attention, "attention", lambda v: Attention[AttentionChoice(v.lower()).name])
        or defaults.attention,
        zero=_list(zero, "zero", lambda v: ZeroStage(int(v))) or defaults.zero,
        micro_batches=_list(micro_batches, "micro-batches", _positive) or defaults.micro_batches,
        tp_max=tp_max,
        cp_max=cp_max,
        # the implementation's own kind of context parallelism unless a list is given
        cp_rotate=_list(cp_rotate, "cp-rotate", CpRotate) or (default_cp_rotate(impl_of(o, model).impl),),
        keep=top,  # the rows shown are found exactly; slower configurations may be pruned
    )
    base = _fit_base(o, model, space.attention)
    given = {name: getattr(o, name) for name in FINETUNE_OPTIONS}
    tunes, escalate = finetunes(o.finetune.method, parse_methods(method), given, o.double_quant, base)
    device = gpu_of(o, gpu)
    if o.host_memory is not None:
        device = device.model_copy(update={"host_memory_gib": o.host_memory})
    reserve = reserve_bytes(o.reserve, device)
    from memplan.cli.progress import Bar

    with Bar("searching", enabled=True) as bar:
        bar.advance(0, f"layouts of {gpus:,} × {device.name}")
        result = fit(
            base,
            device,
            gpus,
            global_batch=global_batch,
            mfu=o.mfu,
            space=space,
            reserve=reserve,
            expandable=o.expandable_segments,
            finetunes=tunes,
            escalate=escalate,
        )
    # what the rows' commands must repeat that no setup holds: the GPU as typed, and these options as given
    held = {name: getattr(o, name) for name in FIT_PASSTHROUGH}
    passthrough = tuple(flags(Options.model_validate({"model": o.model, **held}))[2:])
    result = dataclasses.replace(result, model_typed=o.model, gpu_typed=gpu, passthrough=passthrough)
    if as_json:
        typer.echo(json.dumps(result.to_json(top), allow_nan=False))
        return
    from memplan.render.fit import fit_report

    console().print(fit_report(result, top))


def _fit_base(o: Options, model: ModelConfig, kinds: tuple[Attention, ...]) -> Setup:
    """The search's base (one device; each family sets its own layout, checkpointing and attention), at the
    first attention kernel searched that the model's code runs — transformers' Gemma-2 (softcaps) and
    gpt-oss (sinks) run eager only; the flash families are then not modelled and not searched
    (``search.methods.valid``). When none runs, the last one's one-line error."""
    from memplan.search.methods import layout_free_impl

    error: ValueError | None = None
    impl = impl_of(o, model)  # whose code, and the kernels asked for: held for every layout
    free = layout_free_impl(impl)  # the base (one device) without FSDP2's switches: each family has them
    for kind in kinds:
        try:
            return build_setup(
                model,
                seq=o.seq,
                precision=o.precision,
                optimizer=o.optimizer,
                optimizer_impl=o.optimizer_impl,
                clip_grad=o.clip_grad,
                reduce_dtype=o.reduce_dtype,
                dropout=o.dropout,
                device=o.device,
                attention=AttentionChoice[kind.name],
                impl=free,
            ).replaced(impl=impl)
        except ValueError as e:
            error = e
    assert error is not None  # the space searches at least one attention kernel
    raise error


def _whole_layer_mode(text: str) -> Checkpointing:
    mode, _ = parse_checkpointing(text)
    if mode is Checkpointing.EVERY_K:
        raise ValueError(text)  # fit searches none, selective and full only
    return mode


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise ValueError(text)
    return n
