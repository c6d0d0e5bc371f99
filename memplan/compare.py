"""``memplan compare``: one row per model × strategy variation, the same columns for every row.

Rows are the cartesian product of the models (``--model 7b,70b``) and of every ``--vary KEY=A,B,…``; a
vary key is any ``api.Options`` field (the option name, ``-`` or ``_``), so ``--vary tp=1,8 --vary
checkpointing=none,full`` gives 4 rows per model. A row whose settings cannot be planned (a bad value, tp not
dividing the model's heads) is an error naming that row, not a row without numbers.
"""

from __future__ import annotations

import difflib
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from memplan.api import Built, Options, build, load_model, to_json
from memplan.config import MethodChoice, checkpointing_label
from memplan.errors import describe_validation_error, one_line_validation_error
from memplan.search.budget import terms

VARY_KEYS = tuple(name.replace("_", "-") for name in Options.model_fields if name != "model")

# (column key, header): the numbers every row has, in display order. Keys never equal a setting's name
# (``--vary optimizer=…`` and ``--vary mfu=…`` are settings; the figures are ``optimizer_memory`` and
# ``step_mfu``).
NUMBERS: tuple[tuple[str, str], ...] = (
    ("params", "params"),
    ("weights", "weights"),
    ("gradients", "gradients"),
    ("optimizer_memory", "optimizer"),
    ("activations", "activations"),
    ("peak", "peak"),
    ("reserved", "reserved"),
    ("flops", "FLOPs/step"),
    ("step_time", "step s"),
    ("tokens_per_s", "tokens/s"),
    ("step_mfu", "MFU"),
    ("fits", "fits"),
)


NUMBER_KEYS = frozenset(k for k, _ in NUMBERS)
"""NB: ``optimizer`` and ``mfu`` name a setting and a figure; in the flat row the figure wins (the
setting is said in the title when every row shares it)."""


LIST_KEYS = frozenset({"offload", "pp-layers", "freeze", "lora-targets"})
"""Settings whose one value is itself a comma-separated list: in ``--vary`` its entries are joined with
``+`` (``--vary pp-layers=16+16,8+24``: two values), as the commas separate the values."""


def parse_vary(specs: list[str]) -> list[tuple[str, list[str]]]:
    """``["tp=1,8", "attention=eager,flash"]`` → ``[("tp", ["1", "8"]), …]`` (field names), checked."""
    out: list[tuple[str, list[str]]] = []
    for spec in specs:
        key, eq, values = spec.partition("=")
        key = key.strip().lower().replace("_", "-")
        if not eq or not key:
            raise ValueError(f"vary: expected KEY=V1,V2 (e.g. --vary checkpointing=none,full), got {spec!r}")
        if key == "model":
            raise ValueError("vary: models are listed with --model 7b,70b, not --vary model=…")
        if key not in VARY_KEYS:
            close = difflib.get_close_matches(key, VARY_KEYS, n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ValueError(f"vary: unknown setting {key!r}; {hint}choose from {', '.join(VARY_KEYS)}")
        items = [v.strip() for v in values.split(",") if v.strip()]
        if key in LIST_KEYS:  # one value of a list-valued setting joins its entries with "+"
            items = [v.replace("+", ",") for v in items]
        if not items:
            raise ValueError(f"vary: {key} has no values; list them, e.g. --vary {key}=A,B")
        field = key.replace("-", "_")
        if any(field == f for f, _ in out):
            raise ValueError(f"vary: {key} is given twice; list all its values in one --vary {key}=A,B")
        out.append((field, items))
    return out


@dataclass(frozen=True)
class Row:
    settings: dict[str, str]
    """The model and the varied settings, as given."""
    built: Built

    def values(self) -> dict[str, Any]:
        """The row as flat columns: settings (as given, then every other one the row ran with), then
        numbers (None where unknown)."""
        out: dict[str, Any] = dict(self.settings)
        derived = effective_settings(self.built)
        out.update({k: v for k, v in derived.items() if k not in out and k not in NUMBER_KEYS})
        p, t, v = self.built.result, self.built.timing, self.built.verdict
        dev = p.device
        parts = terms(dev, dev.peak.bytes)
        out.update(
            params=p.params_total,
            weights=parts["weights"],
            gradients=parts["gradients"],
            optimizer_memory=parts["optimizer"],
            activations=parts["activations"],
            transient=parts["transient"],
            peak=dev.peak.bytes,
            # the caching allocator's reserved peak (its replay): the figure ``fits`` is judged on, against
            # the GPU's usable memory (``budget.verdict``); None without a GPU
            reserved=v.reserved_peak if v else None,
            flops=p.flops.total * p.micro_batches * p.setup.strategy.dp,
            step_time=t.step_time_s if t else None,
            tokens_per_s=t.tokens_per_s if t else None,
            step_mfu=t.mfu if t else None,
            fits=v.fits if v else None,
        )
        return out


# Every setting a row runs with, by its option name: what `columns` compares across the rows.
SETTINGS = (
    "seq",
    "batch",
    "grad-accum",
    "global-batch",
    "precision",
    "optimizer",
    "checkpointing",
    "attention",
    "reversible",
    "zero",
    "device",
    "tp",
    "sp",
    "pp",
    "vpp",
    "ep",
    "dp",
    "gpus",
    "gpu",
    "mfu",
)


def effective_settings(built: Built) -> dict[str, str]:
    """Every setting the row ran with (defaults and derived ones included), as text, by option name."""
    p = built.result
    t, st, par = p.setup.training, p.setup.strategy, p.parallel
    mfu = built.timing.assumed_mfu if built.timing else None
    values = {
        "seq": t.seq_len,
        "batch": t.micro_batch,
        "grad-accum": t.grad_accum,
        "global-batch": p.global_batch,
        "precision": t.precision.value,
        "optimizer": t.optimizer.value,
        "checkpointing": checkpointing_label(st),
        "attention": st.attention.name.lower(),
        "reversible": "yes" if st.reversible else "no",
        "zero": int(st.zero),
        "device": p.setup.device.value,
        "tp": par.tp,
        "sp": "yes" if par.sp else "no",
        "pp": par.pp,
        "vpp": par.vpp,
        "ep": par.ep,
        "dp": st.dp,
        "gpus": p.devices,
        "gpu": built.gpu.name if built.gpu else "none",
        "mfu": "–" if mfu is None else f"{mfu:.3g}",
    }
    return {k: str(values[k]) for k in SETTINGS}


def common_settings(table_rows: list[Row]) -> dict[str, str]:
    """The settings every planned row shares (not given with --vary): said once, not as a column."""
    built = [effective_settings(r.built) for r in table_rows]
    given = set(table_rows[0].settings)
    return {k: built[0][k] for k in SETTINGS if k not in given and len({v[k] for v in built}) == 1}


def row_json(row: Row) -> dict[str, Any]:
    """A row for ``--json``: its settings, flat values, and the plan's keys (``estimate``'s contract)."""
    return {
        "settings": row.settings,
        "values": row.values(),
        "plan": to_json(row.built),
    }


QLORA_ONLY = ("quant", "double_quant")
"""Options that describe QLoRA's 4-bit base: under ``--vary finetune=…`` they apply to the qlora rows only."""
ADAPTERS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets")
"""Options of the adapters: under ``--vary finetune=…`` they apply to the lora and qlora rows only."""


def _for_method(base: dict[str, Any], change: dict[str, str]) -> dict[str, Any]:
    """``base`` without the fine-tuning options that do not apply to the row's method, when the method is
    what varies (``--vary finetune=lora,qlora --double-quant``: double quantisation on the qlora row); a
    method given once keeps them, and a mismatch stays the user's error."""
    method = change.get("finetune", "").strip().lower()
    if method not in {m.value for m in MethodChoice}:
        return base
    drop = set(QLORA_ONLY) if method != MethodChoice.QLORA else set()
    if method == MethodChoice.FULL:
        drop |= set(ADAPTERS)
    return {k: v for k, v in base.items() if k not in drop}


def _options(base: dict[str, Any], model: str, change: dict[str, str]) -> Options:
    try:
        return Options.model_validate({**_for_method(base, change), "model": model, **change})
    except ValidationError as exc:
        raise ValueError(one_line_validation_error(exc, "vary")) from None


def row_count(models: list[str], varies: list[tuple[str, list[str]]]) -> int:
    """How many rows ``rows`` builds: the models × each vary's values."""
    return len(models) * math.prod(len(values) for _, values in varies)


def rows(
    base: dict[str, Any],
    models: list[str],
    varies: list[tuple[str, list[str]]],
    on_row: Callable[[], None] | None = None,
) -> list[Row]:
    """Every combination, built (``on_row`` is called after each: the progress bar). A combination that
    cannot be planned (a bad value, a layout that does not fit its model) is the user's mistake: a one-line
    ``ValueError`` with the reason of the first such row and that row's settings, never a row of dashes."""
    if not models:
        raise ValueError("model: required; pass --model NAME or a list, e.g. --model 7b,70b")
    for model in models:
        load_model(model)  # an unknown model is the user's mistake, not a row that does not fit
    keys = [k for k, _ in varies]
    out = []
    for model, *values in itertools.product(models, *(v for _, v in varies)):
        change = dict(zip(keys, values, strict=True))
        settings = {"model": model, **{k.replace("_", "-"): v for k, v in change.items()}}
        options = _options(base, model, change)  # a value of the wrong type is the user's error: raise
        try:
            out.append(Row(settings, build(options)))
            if on_row is not None:
                on_row()
        except ValidationError as exc:  # a ValueError too: first
            raise ValueError(_in_row(describe_validation_error(exc), settings)) from None
        except ValueError as exc:
            raise ValueError(_in_row(str(exc), settings)) from None
    return out


def _in_row(message: str, settings: dict[str, str]) -> str:
    """``message`` (one line) and the row it comes from: ``… [row model=7b, zero=5]``."""
    row = ", ".join(f"{k}={v}" for k, v in settings.items())
    return f"{' '.join(message.split())} [row {row}]"


def columns(table_rows: list[Row]) -> list[str]:
    """Column keys: the settings given (the model and each --vary), every other setting that differs
    between the rows (a model's default seq, the dp that --gpus leaves), then the numbers."""
    given = list(table_rows[0].settings)
    built = [r.values() for r in table_rows]
    differ = [
        k for k in SETTINGS if k not in given and k not in NUMBER_KEYS and len({v[k] for v in built}) > 1
    ]
    return given + differ + [k for k, _ in NUMBERS]


def sort_rows(table_rows: list[Row], column: str | None) -> list[Row]:
    """Sorted by ``column`` (``-column``: descending); rows without a value last."""
    if column is None:
        return table_rows
    key = column.lstrip("-").replace("-", "_")
    known = list(table_rows[0].values())
    if key not in known:
        raise ValueError(f"sort: unknown column {column!r}; choose from {', '.join(known)}")
    present = [r for r in table_rows if r.values()[key] is not None]
    missing = [r for r in table_rows if r.values()[key] is None]
    values = [r.values()[key] for r in present]
    if all(isinstance(v, str) for v in values) and all(_is_number(v) for v in values):
        values = [float(v) for v in values]  # settings are text: "16" after "8"
    order = sorted(range(len(present)), key=lambda i: values[i], reverse=column.startswith("-"))
    return [present[i] for i in order] + missing


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
