"""Planning commands registered on the main typer app: ``plan``, ``compare`` and ``fit``.

``plan`` is ``estimate`` under tensor / sequence / pipeline / expert / data parallelism, with a GPU verdict
and the step time; ``compare`` tabulates models × strategy variations; ``fit`` searches the layouts that
fit a GPU count. The shared options, the ``Setup`` builder and the one-line errors come from
``memplan.cli_common``; computing lives in ``memplan.plan``, rendering in ``memplan.plan.render``.
torch is never imported here.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.console import Console

from memplan.cli_common import (
    AttentionChoice,
    AttentionOpt,
    BatchOpt,
    CheckpointingOpt,
    DeviceOpt,
    DropoutOpt,
    ModelOpt,
    OptimizerOpt,
    PrecisionOpt,
    ReversibleOpt,
    SeqOpt,
    ZeroOpt,
    build_setup,
    handle_user_errors,
    load_model,
)
from memplan.config import (
    Attention,
    Checkpointing,
    Device,
    Optimizer,
    Precision,
    ZeroStage,
    parse_checkpointing,
)
from memplan.plan.defaults import DEFAULT_MFU
from memplan.presets import load_gpu

# NB: the rest of memplan.plan is imported inside the commands: `memplan estimate` does not pay for it.

_PARALLEL = "Parallelism"
_GPU = "GPU and time"
_OUTPUT = "Output"

TpOpt = Annotated[
    int, typer.Option("--tp", metavar="N", help="Tensor-parallel degree t", rich_help_panel=_PARALLEL)
]
SpOpt = Annotated[
    bool,
    typer.Option(
        "--sp/--no-sp", help="Sequence parallelism over the tensor-parallel ranks", rich_help_panel=_PARALLEL
    ),
]
PpOpt = Annotated[
    int, typer.Option("--pp", metavar="N", help="Pipeline stages p (1F1B)", rich_help_panel=_PARALLEL)
]
VppOpt = Annotated[
    int,
    typer.Option(
        "--vpp",
        metavar="M",
        help="Virtual stages per pipeline rank (interleaved 1F1B)",
        rich_help_panel=_PARALLEL,
    ),
]
EpOpt = Annotated[
    int,
    typer.Option(
        "--ep", metavar="N", help="Expert-parallel degree (MoE; ranks from dp)", rich_help_panel=_PARALLEL
    ),
]
PlanDpOpt = Annotated[
    int | None,
    typer.Option(
        "--dp",
        metavar="N",
        help="Data-parallel degree [default: --gpus / (tp·pp), else 1]",
        show_default=False,
        rich_help_panel=_PARALLEL,
    ),
]
GpusOpt = Annotated[
    int | None,
    typer.Option(
        "--gpus",
        metavar="N",
        help="Devices in all: tp · pp · dp",
        show_default=False,
        rich_help_panel=_PARALLEL,
    ),
]
GlobalBatchOpt = Annotated[
    int | None,
    typer.Option(
        "--global-batch",
        metavar="B",
        help="Sequences per optimizer step; micro-batches per step = B / (batch · dp)",
        show_default=False,
        rich_help_panel=_PARALLEL,
    ),
]
GradAccumPlanOpt = Annotated[
    int | None,
    typer.Option(
        "--grad-accum",
        metavar="N",
        help="Micro-batches per step (the pipeline's, or gradient accumulation) [default: 1]",
        show_default=False,
        rich_help_panel=_PARALLEL,
    ),
]
GpuOpt = Annotated[
    str | None,
    typer.Option(
        "--gpu",
        metavar="NAME",
        help="GPU preset: marks fit / not fit, gives the time (`memplan gpus`)",
        show_default=False,
        rich_help_panel=_GPU,
    ),
]
MfuOpt = Annotated[
    float | None,
    typer.Option(
        "--mfu",
        metavar="F",
        help=f"Assumed model FLOPs utilisation for the step time [default: {DEFAULT_MFU}]",
        show_default=False,
        rich_help_panel=_GPU,
    ),
]
StepTimeOpt = Annotated[
    float | None,
    typer.Option(
        "--step-time",
        metavar="S",
        help="Measured seconds per step: gives the achieved MFU and HFU instead",
        show_default=False,
        rich_help_panel=_GPU,
    ),
]
TokensOpt = Annotated[
    float | None,
    typer.Option(
        "--tokens",
        metavar="T",
        help="Training tokens (e.g. 300e9): gives the training days",
        show_default=False,
        rich_help_panel=_GPU,
    ),
]
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Print one JSON object and nothing else", rich_help_panel=_OUTPUT)
]

PLAN_HELP = """\
Memory per device, FLOPs and step time of one training step under parallelism, without torch.

Tensor (--tp), sequence (--sp), pipeline (--pp, --vpp), expert (--ep) and data parallelism (--dp or --gpus,
with --zero): the weights, gradients, optimizer states and activations of the most loaded device (the
first pipeline stage holds pp micro-batches in flight), its peak, and with --gpu whether it fits and how
long a step takes. MoE presets: mixtral-8x7b, qwen1.5-moe-a2.7b (or a mixtral / qwen2_moe config.json).

Examples:

  memplan plan -m gpt3-175b --seq 2048 --tp 8 --sp --pp 8 --gpus 1024 --global-batch 1536 --gpu a100

  memplan plan -m 70b --seq 8192 --tp 8 --sp --checkpointing selective --gpus 64 --zero 1 --gpu h100

  memplan plan -m mixtral --seq 4096 --ep 8 --gpus 32 --zero 1 --gpu h100 --json | jq .time.mfu
"""


def _console() -> Console:
    return Console()


def _tokens(tokens: float | None) -> int | None:
    from memplan.plan.timing import check_time_inputs

    """``--tokens`` (read as a float so that 300e9 works) as a whole number, checked first."""
    check_time_inputs(None, None, tokens)
    return None if tokens is None else int(tokens)


def _required(model: str | None) -> str:
    """``--model``'s value; the shared "model: required" one-line error when it is missing."""
    if model is None:
        load_model(None)  # raises
    assert model is not None
    return model


def register(app: typer.Typer) -> None:
    """Add ``plan``, ``compare`` and ``fit`` to ``app``."""
    app.command("plan", help=PLAN_HELP)(plan_command)
    app.command("compare", help=COMPARE_HELP)(compare_command)
    app.command("fit", help=FIT_HELP)(fit_command)


@handle_user_errors
def plan_command(
    model: ModelOpt = None,
    seq: SeqOpt = None,
    batch: BatchOpt = 1,
    precision: PrecisionOpt = Precision.BF16_MIXED,
    optimizer: OptimizerOpt = Optimizer.ADAMW,
    grad_accum: GradAccumPlanOpt = None,
    global_batch: GlobalBatchOpt = None,
    checkpointing: CheckpointingOpt = "none",
    attention: AttentionOpt = AttentionChoice.FLASH,
    reversible: ReversibleOpt = False,
    zero: ZeroOpt = 0,
    dp: PlanDpOpt = None,
    gpus: GpusOpt = None,
    tp: TpOpt = 1,
    sp: SpOpt = False,
    pp: PpOpt = 1,
    vpp: VppOpt = 1,
    ep: EpOpt = 1,
    dropout: DropoutOpt = None,
    device: DeviceOpt = Device.CUDA,
    gpu: GpuOpt = None,
    mfu: MfuOpt = None,
    step_time: StepTimeOpt = None,
    tokens: TokensOpt = None,
    as_json: JsonOpt = False,
) -> None:
    from memplan.plan import render
    from memplan.plan.options import PlanOptions, build

    options = PlanOptions(
        model=_required(model),
        seq=seq,
        batch=batch,
        precision=precision,
        optimizer=optimizer,
        grad_accum=grad_accum,
        global_batch=global_batch,
        checkpointing=checkpointing,
        attention=attention,
        reversible=reversible,
        zero=zero,
        dp=dp,
        gpus=gpus,
        tp=tp,
        sp=sp,
        pp=pp,
        vpp=vpp,
        ep=ep,
        dropout=dropout,
        device=device,
        gpu=gpu,
        mfu=mfu,
        step_time=step_time,
        tokens=_tokens(tokens),
    )
    built = build(options)
    if as_json:
        typer.echo(json.dumps(built.to_json()))
        return
    _console().print(render.plan_report(built))


# ----------------------------------------------------------------------------------------------------
# compare
# ----------------------------------------------------------------------------------------------------
COMPARE_HELP = """Compare models and strategy variations side by side: one row per combination.

--model takes a comma-separated list; each --vary KEY=A,B,… varies one setting of `memplan plan` (any of
its options: checkpointing, attention, zero, tp, sp, pp, dp, gpus, batch, seq, precision, gpu, mfu, …);
the rows are the cartesian product. Columns: the memory terms and the peak of the most loaded device with
a stacked bar, FLOPs per step, the step time and whether it fits (with --gpu).

Examples:

  memplan compare -m 7b,70b,405b --seq 4096 --gpus 64 --zero 3 --gpu h100

  memplan compare -m 70b --vary checkpointing=none,selective,full --vary attention=eager,flash --gpu h100

  memplan compare -m 8b --vary tp=1,2,4,8 --sp --gpus 8 --gpu a100 --sort -tokens_per_s --markdown
"""


@handle_user_errors
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
    seq: SeqOpt = None,
    batch: BatchOpt = 1,
    precision: PrecisionOpt = Precision.BF16_MIXED,
    optimizer: OptimizerOpt = Optimizer.ADAMW,
    grad_accum: GradAccumPlanOpt = None,
    global_batch: GlobalBatchOpt = None,
    checkpointing: CheckpointingOpt = "none",
    attention: AttentionOpt = AttentionChoice.FLASH,
    zero: ZeroOpt = 0,
    dp: PlanDpOpt = None,
    gpus: GpusOpt = None,
    tp: TpOpt = 1,
    sp: SpOpt = False,
    pp: PpOpt = 1,
    ep: EpOpt = 1,
    gpu: GpuOpt = None,
    mfu: MfuOpt = None,
    as_json: JsonOpt = False,
    as_csv: Annotated[
        bool, typer.Option("--csv", help="Print CSV (raw numbers)", rich_help_panel=_OUTPUT)
    ] = False,
    as_markdown: Annotated[
        bool, typer.Option("--markdown", help="Print a Markdown table", rich_help_panel=_OUTPUT)
    ] = False,
) -> None:
    from memplan.plan import compare as cmp
    from memplan.plan import render

    if sum((as_json, as_csv, as_markdown)) > 1:
        raise ValueError("output: choose one of --json, --csv and --markdown")
    models = [m.strip() for m in (model or "").split(",") if m.strip()]
    base = {
        "seq": seq,
        "batch": batch,
        "precision": precision,
        "optimizer": optimizer,
        "grad_accum": grad_accum,
        "global_batch": global_batch,
        "checkpointing": checkpointing,
        "attention": attention,
        "zero": zero,
        "dp": dp,
        "gpus": gpus,
        "tp": tp,
        "sp": sp,
        "pp": pp,
        "ep": ep,
        "gpu": gpu,
        "mfu": mfu,
    }
    rows = cmp.sort_rows(cmp.rows(base, models, cmp.parse_vary(vary or [])), sort)
    keys = cmp.columns(rows)
    if as_json:
        typer.echo(json.dumps({"columns": keys, "rows": [cmp.row_json(r) for r in rows]}))
    elif as_csv:
        typer.echo(render.to_csv(rows, keys), nl=False)
    elif as_markdown:
        typer.echo(render.to_markdown(rows, keys), nl=False)
    else:
        _console().print(render.compare_table(rows, keys))


# ----------------------------------------------------------------------------------------------------
# fit
# ----------------------------------------------------------------------------------------------------
FIT_HELP = """Search the layouts and strategies that fit a model on N GPUs, fastest first.

Searches checkpointing (none, selective, full), attention (eager, flash), ZeRO stage (0-3), the tp × pp × dp
splits of --gpus (tp ≤ --tp-max, sequence parallel when tp > 1, ep for MoE) and the micro-batch size, at a
fixed global batch; ranks what fits by tokens/s at --mfu (recompute and the pipeline bubble cost time,
communication is not modelled), and says for every rejected family which memory term overflows. Also
reports the longest sequence the best configuration fits.

Examples:

  memplan fit -m 70b --seq 4096 --gpu h100 --gpus 64

  memplan fit -m mixtral --seq 8192 --gpu h100 --gpus 32 --global-batch 512 --json | jq '.configs[0].settings'
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
}


@handle_user_errors
def fit_command(
    model: ModelOpt = None,
    seq: SeqOpt = None,
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
            help="Sequences per step [default: ≈ 4M tokens, at least one per GPU]",
            show_default=False,
        ),
    ] = None,
    precision: PrecisionOpt = Precision.BF16_MIXED,
    optimizer: OptimizerOpt = Optimizer.ADAMW,
    dropout: DropoutOpt = None,
    device: DeviceOpt = Device.CUDA,
    mfu: MfuOpt = None,
    checkpointing: Annotated[
        str | None,
        typer.Option(
            "--checkpointing",
            metavar="LIST",
            help="Checkpointing modes to search [default: none,selective,full]",
            show_default=False,
        ),
    ] = None,
    attention: Annotated[
        str | None,
        typer.Option(
            "--attention",
            metavar="LIST",
            help="Attention kernels to search [default: eager,flash]",
            show_default=False,
        ),
    ] = None,
    zero: Annotated[
        str | None,
        typer.Option(
            "--zero", metavar="LIST", help="ZeRO stages to search [default: 0,1,2,3]", show_default=False
        ),
    ] = None,
    micro_batches: Annotated[
        str | None,
        typer.Option(
            "--micro-batches",
            metavar="LIST",
            help="Micro-batch sizes to search [default: 1,2,4,8,16,32]",
            show_default=False,
        ),
    ] = None,
    tp_max: Annotated[
        int, typer.Option("--tp-max", metavar="N", help="Largest tensor-parallel degree to search")
    ] = 8,
    top: Annotated[
        int, typer.Option("--top", metavar="N", help="Rows shown (and configurations in --json); 0: all")
    ] = 10,
    as_json: JsonOpt = False,
) -> None:
    from memplan.plan import render
    from memplan.plan.fit import Space, fit
    from memplan.plan.options import model_of

    if gpu is None or gpus is None:
        raise ValueError("gpu: fit needs --gpu NAME and --gpus N (e.g. --gpu h100 --gpus 64)")
    if top < 0:
        raise ValueError(f"top: must be 0 (every configuration) or more, got {top}; e.g. --top 10")
    pm = model_of(_required(model))
    base = build_setup(
        pm.model, seq=seq, precision=precision, optimizer=optimizer, dropout=dropout, device=device
    )
    defaults = Space()
    space = Space(
        checkpointing=_list(checkpointing, "checkpointing", _whole_layer_mode) or defaults.checkpointing,
        attention=_list(attention, "attention", lambda v: Attention[AttentionChoice(v.lower()).name])
        or defaults.attention,
        zero=_list(zero, "zero", lambda v: ZeroStage(int(v))) or defaults.zero,
        micro_batches=_list(micro_batches, "micro-batches", _positive) or defaults.micro_batches,
        tp_max=tp_max,
    )
    result = fit(base, pm.moe, load_gpu(gpu), gpus, global_batch=global_batch, mfu=mfu, space=space)
    if as_json:
        typer.echo(json.dumps(result.to_json(top)))
        return
    _console().print(render.fit_report(result, top))


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
