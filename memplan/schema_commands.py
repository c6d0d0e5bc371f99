"""The JSON Schemas of every command's ``--json`` output: ``memplan schema --command NAME``.

One schema per command (draft 2020-12), each with the estimate's object under ``$defs.estimate``
(``memplan.schema``): ``compare --json`` (one estimate per row, ``plan``), ``fit --json`` (one estimate per
configuration that fits), ``trace --json`` and ``profile --json`` (the estimate beside the measurement, and
their difference), ``profile --nproc N --json`` (every rank beside the estimate: the second alternative
of profile's schema). Objects stay open to added keys, as the estimate's do.

Sizes (bytes, FLOPs, parameters, counts) are integers ≥ 0 and times are numbers ≥ 0; differences
(``delta``, ``headroom``, ``peak_relative_error``) are signed. JSON itself has no NaN or infinity
(memplan writes with ``allow_nan=False``), so every number that validates is finite.

Pure Python, no torch. Known limitations (NB): the per-rank objects of ``profile --nproc`` are checked for
their top-level keys only (the rank reports' inner shapes are the distributed harness's, documented in
docs/distributed.md); a row's ``values`` in ``compare`` holds strings for settings and numbers for figures,
typed here by name for the figures only.
"""

from __future__ import annotations

import copy
from typing import Any

from memplan.schema import SCHEMA_DRAFT, estimate_schema

COMMANDS = ("estimate", "compare", "fit", "trace", "profile")
"""The commands with ``--json`` output, in the order ``memplan schema --command`` lists them."""

_BYTES: dict[str, Any] = {"type": "integer", "minimum": 0}
_COUNT: dict[str, Any] = {"type": "integer", "minimum": 0}
_POSITIVE: dict[str, Any] = {"type": "integer", "minimum": 1}
_SECONDS: dict[str, Any] = {"type": "number", "minimum": 0, "description": "seconds"}
_RATE: dict[str, Any] = {"type": "number", "minimum": 0}
_NAME: dict[str, Any] = {"type": "string", "minLength": 1}
_ESTIMATE_REF: dict[str, Any] = {"$ref": "#/$defs/estimate"}
_VERDICT_REF: dict[str, Any] = {"$ref": "#/$defs/estimate/properties/fit/oneOf/0"}


def _obj(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    """An object with these properties, all required unless ``required`` names fewer; more keys allowed."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
    }


def _estimate_def() -> dict[str, Any]:
    """The estimate's schema as a definition: without ``$schema`` and ``$id`` (one base URI per document)."""
    body = estimate_schema()
    del body["$schema"], body["$id"]
    return body


def _document(command: str, description: str, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "$schema": SCHEMA_DRAFT,
        "$id": f"urn:memplan:schema:{command}:1",
        "title": f"memplan {command} --json",
        "description": description,
        **body,
        "$defs": {"estimate": _estimate_def()},
    }


# ----------------------------------------------------------------------------------------------------
# compare
# ----------------------------------------------------------------------------------------------------
_COMPARE_VALUES = {
    **{k: _BYTES for k in ("weights", "gradients", "optimizer_memory", "activations", "transient", "peak")},
    "params": _COUNT,
    "flops": {**_COUNT, "description": "all FLOPs of one step on every device (total × micro-batches × dp)"},
    "step_time": {"type": ["number", "null"], "minimum": 0, "description": "seconds (null without --gpu)"},
    "tokens_per_s": {"type": ["number", "null"], "minimum": 0},
    "step_mfu": {"type": ["number", "null"], "minimum": 0},
    "fits": {"type": ["boolean", "null"]},
}

_COMPARE = _obj(
    {
        "columns": {"type": "array", "items": _NAME},
        "rows": {
            "type": "array",
            "items": _obj(
                {
                    "settings": {"type": "object", "additionalProperties": {"type": "string"}},
                    "values": _obj(_COMPARE_VALUES),
                    "plan": _ESTIMATE_REF,
                }
            ),
        },
    }
)

# ----------------------------------------------------------------------------------------------------
# fit
# ----------------------------------------------------------------------------------------------------
_FAMILY = _obj(
    {
        "method": _NAME,
        "offload": _NAME,
        "loss": _NAME,
        "checkpointing": _NAME,
        "attention": _NAME,
        "zero": {"type": "integer", "minimum": 0, "maximum": 3},
        **{k: _POSITIVE for k in ("tp", "pp", "ep", "cp", "dp", "micro_batch")},
        "sp": {"type": "boolean"},
    }
)

_FIT = _obj(
    {
        "model": _NAME,
        "gpu": _NAME,
        "gpus": _POSITIVE,
        "seq_len": _POSITIVE,
        "global_batch": _POSITIVE,
        "reserve": _BYTES,
        "searched": _COUNT,
        "evaluated": _COUNT,
        "peaks": _COUNT,
        "seconds": _SECONDS,
        "max_seq": {"type": ["integer", "null"], "minimum": 1},
        "fitting": _COUNT,
        "configs": {
            "type": "array",
            "items": {
                "allOf": [_ESTIMATE_REF, _obj({"settings": _FAMILY}, required=["settings", "fit", "time"])]
            },
        },
        "methods": {
            "type": "array",
            "items": _obj(
                {
                    "method": _NAME,
                    "fits": {"type": "boolean"},
                    "settings": _FAMILY,
                    "peak": _BYTES,
                    "tokens_per_s": _RATE,
                    "trainable": _COUNT,
                },
                required=["method", "fits"],
            ),
        },
        "rejected": {"type": "array", "items": {"allOf": [_FAMILY, _obj({"fit": _VERDICT_REF})]}},
    }
)

# ----------------------------------------------------------------------------------------------------
# trace and profile: the estimate beside the measurement
# ----------------------------------------------------------------------------------------------------
_MEASURED_TENSOR = _obj(
    {"name": _NAME, "bytes": _BYTES, "count": _COUNT, "total_bytes": _BYTES},
)
_MEASURED = _obj(
    {
        "memory": _obj(
            {
                "activations": _BYTES,
                "peak": {**_BYTES, "description": "profile: the measured peak"},
                "phase_peaks": {"type": "object", "additionalProperties": _BYTES},
            },
            required=["activations"],
        ),
        "activations": _obj(
            {"total": _BYTES, "per_layer": _BYTES, "tensors": {"type": "array", "items": _MEASURED_TENSOR}}
        ),
        "flops": _obj(
            {k: _COUNT for k in ("forward", "backward", "recompute", "total", "model", "hardware")}
        ),
    },
    required=["memory", "activations"],  # trace --impl torchtitan --pp: no FLOPs per pipeline rank
)
_DIFF_TENSOR = _obj(
    {
        "name": _NAME,
        "estimated_count": _COUNT,
        "estimated_bytes": _BYTES,
        "measured_count": _COUNT,
        "measured_bytes": _BYTES,
        "delta_bytes": {"type": "integer", "description": "measured − estimated (signed)"},
    }
)
_DIFF = _obj(
    {
        "equal": {"type": "boolean"},
        "exact": {"type": "boolean", "description": "trace --impl: every layer and the total to the byte"},
        "tolerance": {"type": "number", "minimum": 0},
        "total": _obj({"estimated": _BYTES, "measured": _BYTES, "ratio": _RATE}),
        "tensors": {"type": "array", "items": _DIFF_TENSOR},
        "flops": {
            "type": "array",
            "items": _obj(
                {"phase": _NAME, "estimated": _COUNT, "measured": _COUNT, "delta": {"type": "integer"}}
            ),
        },
        "layers": {
            "type": "array",
            "items": _obj(
                {
                    "layers": {"type": "array", "items": _COUNT},
                    "estimated": _BYTES,
                    "measured": _BYTES,
                    "ratio": _RATE,
                },
                required=["layers", "estimated", "measured"],
            ),
        },
        "peak_relative_error": {"type": "number", "description": "profile: measured / estimated peak − 1"},
        "weights": _obj(
            {"estimated": _BYTES, "measured": _BYTES, "equal": {"type": "boolean"}}
        ),  # trace --impl torchtitan over ranks: the rank's parameter bytes at rest
    },
    required=["equal", "tensors", "flops", "layers"],
)
_TRACE = _obj(
    {
        "estimated": _ESTIMATE_REF,
        "measured": _MEASURED,
        "diff": _DIFF,
        "seconds": _SECONDS,
        "ran_on": _NAME,
        # trace --impl torchtitan with tp or dp > 1: the rank traced on the fake process group
        "rank": _obj({"rank": _COUNT, "world": _COUNT, "tp": _COUNT, "dp": _COUNT}),
        # trace --impl torchtitan --pp: the pipeline rank traced (its local chunks' virtual stages)
        "stage": _obj(
            {
                "index": _COUNT,
                "pp": _POSITIVE,
                "vpp": _POSITIVE,
                "virtual_stages": {"type": "array", "items": _COUNT},
                "layers": {"type": "array", "items": _COUNT},
            }
        ),
        "stages": {"type": "array", "items": {"type": "object"}},
    },
    required=["estimated", "measured", "diff"],
)

_PROFILE_TIME = _obj(
    {
        "device": _NAME,
        "step_seconds": {"type": "array", "items": _SECONDS},
        "median_step_seconds": _SECONDS,
        "phase_seconds": {"type": "object", "additionalProperties": _SECONDS},
        "achieved_tflops": _RATE,
    }
)
_PROFILE_TIMELINE = {
    "type": "array",
    "items": {
        "allOf": [
            {"$ref": "#/$defs/estimate/properties/timeline/items"},
            _obj(
                {
                    "measured": {"type": ["integer", "null"], "minimum": 0},
                    "measured_sample": {"type": ["integer", "null"], "minimum": 0},
                }
            ),
        ]
    },
}
_PROFILE_ONE = {
    "allOf": [
        _TRACE,
        _obj(
            {
                "time": _PROFILE_TIME,
                "timeline": _PROFILE_TIMELINE,
                "measured": _obj({"memory": _obj({"peak": _BYTES})}),
            },
            required=["time", "measured"],
        ),
    ]
}
_PROFILE_RANKS = _obj(
    {
        "model": _NAME,
        "nproc": _POSITIVE,
        "launcher": {"type": "string", "enum": ["spawn", "torchrun"]},
        "layout": _obj(
            {**{k: _POSITIVE for k in ("tp", "pp", "dp")}, "sp": {"type": "boolean"}, "zero": _COUNT}
        ),
        "estimated": _obj(
            {"memory": {"type": "object"}, "stages": {"type": "array"}, "tensors": {"type": "object"}}
        ),
        "ranks": {
            "type": "array",
            "items": _obj(
                {
                    "rank": _COUNT,
                    "coords": {"type": "object"},
                    "measured": {"type": "object"},
                    "diff": {"type": "object"},
                }
            ),
        },
        "equal": {"type": "boolean"},
    }
)
_PROFILE = {"oneOf": [_PROFILE_ONE, _PROFILE_RANKS]}

_BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "compare": (
        "One row per combination of --vary values: settings, flat figures, and its estimate.",
        _COMPARE,
    ),
    "fit": (
        "The search: counts, the configurations that fit (each an estimate), each method, the rejected.",
        _FIT,
    ),
    "trace": (
        "The estimate beside what autograd saved and FlopCounterMode counted, and their difference.",
        _TRACE,
    ),
    "profile": (
        "The estimate beside a real run's saves, FLOPs, peak and seconds; with --nproc, every rank's.",
        _PROFILE,
    ),
}


def command_schema(command: str) -> dict[str, Any]:
    """The JSON Schema every ``memplan COMMAND --json`` output validates against (a fresh copy); a one-line
    ``ValueError`` for a command without ``--json``."""
    if command == "estimate":
        return estimate_schema()
    if command not in _BODIES:
        raise ValueError(f"command: {command!r} has no --json output; choose one of {', '.join(COMMANDS)}")
    description, body = _BODIES[command]
    return _document(command, description, copy.deepcopy(body))
