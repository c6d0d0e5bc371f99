"""User-facing error messages: one line that names the field and the fix.

The CLI prints a ``ValueError``'s text as is and exits 2, so every message here is a single line of the form
``<where>: <field path>: <what is wrong>; <fix>``. Pure Python, no torch.
"""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import ValidationError

# Fixes for the pydantic error types whose own message does not say what to do.
_FIXES = {
    "missing": "add it",
    "extra_forbidden": "remove it or fix its spelling",
}
# Fixes appended after the echoed input (``Input should be a valid integer, got True; write …``).
_TYPE_FIXES = {
    "int_type": "write a whole number (not true/false, a decimal or a string)",
    "int_parsing": "write a whole number",
}
# Error types whose message already says what is wrong with the input (no need to echo it).
_NO_ECHO = frozenset({"missing", "extra_forbidden", "value_error", "assertion_error"})
_ECHO_CHARS = 40


def field_path(loc: tuple[int | str, ...]) -> str:
    """``('model', 'layers', 0)`` → ``model.layers[0]``; the empty path (a whole-model check) → ``(top)``."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top)"


def _echo(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _ECHO_CHARS else text[: _ECHO_CHARS - 1] + "…"


def _misspelt(error: Any, errors: list[Any]) -> str | None:
    """For an unknown field, the closest required field missing beside it (``layers`` → ``num_layers``)."""
    loc = tuple(error["loc"])
    missing = [
        str(e["loc"][-1]) for e in errors if e["type"] == "missing" and tuple(e["loc"][:-1]) == loc[:-1]
    ]
    close = difflib.get_close_matches(str(loc[-1]), missing, n=1, cutoff=0.5) if loc else []
    return close[0] if close else None


def _describe(error: Any, errors: list[Any]) -> str:
    """One pydantic error dict → ``field: message; fix``."""
    kind: str = error["type"]
    msg = str(error["msg"]).removeprefix("Value error, ").removeprefix("Assertion failed, ")
    loc = tuple(error["loc"])
    guess = _misspelt(error, errors) if kind == "extra_forbidden" else None
    if guess is not None:
        msg = f"unknown field; did you mean {guess}?"
    elif kind in _FIXES:
        msg = f"{msg.lower()}; {_FIXES[kind]}"
    elif kind not in _NO_ECHO and "input" in error:
        msg = f"{msg}, got {_echo(error['input'])}"
        if kind in _TYPE_FIXES:
            msg = f"{msg}; {_TYPE_FIXES[kind]}"
    # Model-level validators (memplan.config) already start their message with the field they check.
    return msg if not loc else f"{field_path(loc)}: {msg}"


def one_line_validation_error(exc: ValidationError, prefix: str) -> str:
    """Turn a pydantic ``ValidationError`` into one line: ``prefix: field.path: message; fix``.

    Only one error is spelled out (an unknown field if there is one, since a misspelt field is also
    reported missing; else the first), with the count of the others appended as ``(+N more)``.
    Newlines inside messages are folded so the result is always one line.
    """
    errors: list[Any] = list(exc.errors(include_url=False))
    if not errors:  # NB: pydantic never raises an empty ValidationError, but stay total.
        return f"{prefix}: invalid ({exc.title})"
    # An unknown field first: a misspelt name also reports the real one as missing.
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    text = f"{prefix}: {_describe(first, errors)}{more}"
    return " ".join(text.split())


# Setup field → (the option's name in messages, how to fix it).
_OPTION_FIXES: dict[str, tuple[str, str]] = {
    "training.seq_len": ("seq", "use --seq N with 1 ≤ N ≤ 16777216, e.g. --seq 4096"),
    "training.micro_batch": ("batch", "use --batch N with 1 ≤ N ≤ 1048576"),
    "training.grad_accum": ("grad-accum", "use --grad-accum N with 1 ≤ N ≤ 1048576"),
    "strategy.zero": ("zero", "use --zero 0, 1, 2 or 3"),
    "strategy.dp": ("dp", "use --dp N with 1 ≤ N ≤ 1048576 data-parallel devices"),
    "strategy.hsdp": ("hsdp", "use --hsdp R with R dividing --dp, e.g. --hsdp 8 (one node's ranks)"),
    "strategy.checkpoint_every": ("checkpointing", "use --checkpointing every-K with K ≥ 1"),
    "model.attn_dropout": ("dropout", "use --dropout P with 0 ≤ P < 1"),
    "model.resid_dropout": ("dropout", "use --dropout P with 0 ≤ P < 1"),
    "model.embd_dropout": ("dropout", "use --dropout P with 0 ≤ P < 1"),
    "parallel.tp": ("tp", "use --tp N with 1 ≤ N ≤ 4096"),
    "parallel.pp": ("pp", "use --pp N with 1 ≤ N ≤ 4096"),
    "parallel.vpp": ("vpp", "use --vpp M with 1 ≤ M ≤ 4096"),
    "parallel.ep": ("ep", "use --ep N with 1 ≤ N ≤ 4096"),
    "parallel.etp": ("etp", "use --etp 1 (parallel folding) or drop --etp (the tp degree)"),
    "parallel.cp": ("cp", "use --cp N with 1 ≤ N ≤ 4096"),
    "loss_chunks": ("loss", "use --loss chunked:N with 1 ≤ N ≤ 1048576, e.g. --loss chunked:8"),
    "finetune.rank": ("lora-rank", "use --lora-rank R with 1 ≤ R ≤ 65536, e.g. --lora-rank 16"),
    "finetune.alpha": ("lora-alpha", "use --lora-alpha A with 0 < A ≤ 1048576, e.g. --lora-alpha 32"),
    "finetune.dropout": ("lora-dropout", "use --lora-dropout P with 0 ≤ P < 1, e.g. --lora-dropout 0.05"),
    "parallel.pp_layers": ("pp-layers", "give each stage's layers, e.g. --pp-layers 7,8,8,7"),
}
# The same options checked one level up: ``api.Options`` (dp, gpus, global-batch) and ``Parallel`` built
# on its own (``api.setup_of``), whose errors carry the bare field name.
_OPTION_FIXES |= {
    "tp": _OPTION_FIXES["parallel.tp"],
    "pp": _OPTION_FIXES["parallel.pp"],
    "vpp": _OPTION_FIXES["parallel.vpp"],
    "ep": _OPTION_FIXES["parallel.ep"],
    "etp": _OPTION_FIXES["parallel.etp"],
    "cp": _OPTION_FIXES["parallel.cp"],
    "dp": _OPTION_FIXES["strategy.dp"],
    "hsdp": _OPTION_FIXES["strategy.hsdp"],
    "batch": _OPTION_FIXES["training.micro_batch"],
    "model": ("model", "pass --model NAME, e.g. --model 70b (`memplan presets` lists them)"),
    "gpus": ("gpus", "use --gpus N with N ≥ 1 devices, e.g. --gpus 8"),
    "global_batch": ("global-batch", "use --global-batch B with B ≥ 1 sequences, e.g. --global-batch 512"),
}


def _option_error(error: Any, under: tuple[str, ...]) -> str | None:
    """``zero: must be 0, 1, 2 or 3, got 5 (use --zero 0, 1, 2 or 3)`` for a field an option sets."""
    where = _OPTION_FIXES.get(field_path((*under, *error["loc"])))
    if where is None:
        return None
    name, fix = where
    msg = str(error["msg"]).replace("Input should be", "must be")
    return f"{name}: {msg}, got {error.get('input')!r} ({fix})"


def describe_validation_error(exc: ValidationError, under: tuple[str, ...] = ()) -> str:
    """One line for a ``Setup`` validation error, phrased in terms of the CLI options (``under``: where in
    a ``Setup`` the failing model sits, e.g. ``("finetune",)`` for a ``FineTune`` validated on its own).

    Field errors of a value an option sets name the option and its fix; the config's own checks
    (``value_error``) already read ``field: what; fix``; anything else goes through
    ``errors.one_line_validation_error``.
    """
    errors: list[Any] = list(exc.errors(include_url=False))
    lines: list[str] = []
    for error in errors:
        line = _option_error(error, under)
        if line is None and error["type"] == "value_error":
            line = str(error["msg"]).removeprefix("Value error, ")
        if line is None:
            return one_line_validation_error(exc, "setup")
        lines.append(line)
    # One message per option: the three dropout fields fail together for one --dropout.
    distinct = list(dict.fromkeys(line.split(":", 1)[0] for line in lines))
    more = f" (+{len(distinct) - 1} more)" if len(distinct) > 1 else ""
    return lines[0] + more
