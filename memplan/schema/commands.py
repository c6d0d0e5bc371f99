"""The JSON Schemas of every command's ``--json`` output: ``memplan schema --command NAME``.

One schema per command (draft 2020-12), each with the estimate's object under ``$defs.estimate``
(estimate.py): ``compare --json`` (one estimate per row, ``plan``), ``fit --json`` (one estimate per
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

from memplan.schema.estimate import estimate_schema
from memplan.schema.parts import BYTES, COUNT, NAME, POSITIVE, SCHEMA_DRAFT, SECONDS, described, obj

COMMANDS = ("estimate", "compare", "fit", "trace", "profile")
"""The commands with ``--json`` output, in the order ``memplan schema --command`` lists them."""

_BYTES = COUNT  # integers ≥ 0, without the estimate's "bytes on one device"
_RATE: dict[str, Any] = {"type": "number", "minimum": 0}
_ESTIMATE_REF: dict[str, Any] = {"$ref": "#/$defs/estimate"}
_VERDICT_REF: dict[str, Any] = {"$ref": "#/$defs/estimate/properties/fit/oneOf/0"}


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
    "params": COUNT,
    "flops": {**COUNT, "description": "all FLOPs of one step on every device (total × micro-batches × dp)"},
    "step_time": {"type": ["number", "null"], "minimum": 0, "description": "seconds (null without --gpu)"},
    "tokens_per_s": {"type": ["number", "null"], "minimum": 0},
    "step_mfu": {"type": ["number", "null"], "minimum": 0},
    "reserved": {
        "type": ["integer", "null"],
        "minimum": 0,
        "description": "bytes: the caching allocator's reserved peak on the most loaded device, what fits is "
        "judged on (null without --gpu)",
    },
    "fits": {"type": ["boolean", "null"]},
}

_COMPARE = obj(
    {
        "columns": {"type": "array", "items": NAME},
        "rows": {
            "type": "array",
            "items": obj(
                {
                    "settings": {"type": "object", "additionalProperties": {"type": "string"}},
                    "values": obj(_COMPARE_VALUES),
                    "plan": _ESTIMATE_REF,
                }
            ),
        },
    }
)

# ----------------------------------------------------------------------------------------------------
# fit
# ----------------------------------------------------------------------------------------------------
_FAMILY = obj(
    {
        "method": NAME,
        "offload": NAME,
        "loss": NAME,
        "checkpointing": NAME,
        "attention": NAME,
        "zero": {"type": "integer", "minimum": 0, "maximum": 3},
        **{k: POSITIVE for k in ("tp", "pp", "ep", "etp", "cp", "dp", "micro_batch")},
        "sp": {"type": "boolean"},
    }
)

_FIT = obj(
    {
        "model": NAME,
        "gpu": NAME,
        "gpus": POSITIVE,
        "seq_len": POSITIVE,
        "global_batch": POSITIVE,
        "unsplit_dp": described(
            {"type": "array", "items": POSITIVE},
            "data-parallel degrees the global batch does not split over into whole micro-batches: their "
            "layouts are not searched",
        ),
        "splitting_global_batch": described(
            {"type": ["integer", "null"], "minimum": 1},
            "the nearest global batch that splits over every data-parallel degree, where some do not "
            "(null: all do, or none is within 25 %)",
        ),
        "reserve": _BYTES,
        "expandable_segments": described(
            {"type": "boolean"},
            "memory judged with the caching allocator under expandable_segments:True (--expandable-segments)",
        ),
        "searched": COUNT,
        "evaluated": COUNT,
        "peaks": COUNT,
        "pruned": COUNT,
        "states_only": COUNT,
        "seconds": SECONDS,
        "max_seq": {"type": ["integer", "null"], "minimum": 1},
        "fitting": COUNT,
        "configs": {
            "type": "array",
            "items": {
                "allOf": [_ESTIMATE_REF, obj({"settings": _FAMILY}, required=["settings", "fit", "time"])]
            },
        },
        "methods": {
            "type": "array",
            "items": obj(
                {
                    "method": NAME,
                    "fits": {"type": "boolean"},
                    "settings": _FAMILY,
                    "peak": {**_BYTES, "description": "the most loaded device's tensors' peak"},
                    "reserved": {
                        **_BYTES,
                        "description": "the caching allocator's reserved peak, what fits is judged on",
                    },
                    "tokens_per_s": _RATE,
                    "trainable": COUNT,
                    "savers_searched": described(
                        {"type": "array", "items": {"type": "string"}},
                        "the saver levels searched for the method (fine-tuning: none; offload: with the "
                        "node's host memory, and a GPU that times it)",
                    ),
                    "offload_not_searched": described(
                        {"type": ["string", "null"]},
                        "why offload's saver levels were not searched: the GPU states no host memory, or "
                        "not what times the offload (null: searched where needed)",
                    ),
                    "not_searched": described(
                        {"type": ["string", "null"]},
                        "why the method was not searched at all: memplan models it on no layout of this "
                        "model with these options, e.g. QLoRA with a mixture of experts (null: searched)",
                    ),
                },
                required=["method", "fits", "savers_searched", "offload_not_searched", "not_searched"],
            ),
        },
        "rejected": {"type": "array", "items": {"allOf": [_FAMILY, obj({"fit": _VERDICT_REF})]}},
    }
)

# ----------------------------------------------------------------------------------------------------
# trace and profile: the estimate beside the measurement
# ----------------------------------------------------------------------------------------------------
_MEASURED_TENSOR = obj(
    {"name": NAME, "bytes": _BYTES, "count": COUNT, "total_bytes": _BYTES},
)
_MEASURED = obj(
    {
        "memory": obj(
            {
                "activations": _BYTES,
                "peak": {**_BYTES, "description": "profile: the measured peak"},
                "phase_peaks": {"type": "object", "additionalProperties": _BYTES},
            },
            required=["activations"],
        ),
        "activations": obj(
            {"total": _BYTES, "per_layer": _BYTES, "tensors": {"type": "array", "items": _MEASURED_TENSOR}}
        ),
        "flops": obj({k: COUNT for k in ("forward", "backward", "recompute", "total", "model", "hardware")}),
    },
    required=["memory", "activations"],  # trace --impl torchtitan --pp: no FLOPs per pipeline rank
)
_DIFF_TENSOR = obj(
    {
        "name": NAME,
        "estimated_count": COUNT,
        "estimated_bytes": _BYTES,
        "measured_count": COUNT,
        "measured_bytes": _BYTES,
        "delta_bytes": {"type": "integer", "description": "measured − estimated (signed)"},
    }
)
_DIFF = obj(
    {
        "equal": {"type": "boolean"},
        "exact": {"type": "boolean", "description": "trace --impl: every layer and the total to the byte"},
        "tolerance": {"type": "number", "minimum": 0},
        "total": obj({"estimated": _BYTES, "measured": _BYTES, "ratio": _RATE}),
        "tensors": {"type": "array", "items": _DIFF_TENSOR},
        "flops": {
            "type": "array",
            "items": obj(
                {"phase": NAME, "estimated": COUNT, "measured": COUNT, "delta": {"type": "integer"}}
            ),
        },
        "layers": {
            "type": "array",
            "items": obj(
                {
                    "layers": {"type": "array", "items": COUNT},
                    "estimated": _BYTES,
                    "measured": _BYTES,
                    "ratio": _RATE,
                },
                required=["layers", "estimated", "measured"],
            ),
        },
        "peak_relative_error": {"type": "number", "description": "profile: measured / estimated peak − 1"},
        "weights": obj(
            {"estimated": _BYTES, "measured": _BYTES, "equal": {"type": "boolean"}}
        ),  # trace --impl torchtitan over ranks: the rank's parameter bytes at rest
        "gradients": obj(
            {"estimated": _BYTES, "measured": _BYTES, "equal": {"type": "boolean"}}
        ),  # and its gradients after the step
        # trace --impl torchtitan --pp with FSDP2: what it holds through the schedule (compare.stage)
        "fsdp2": obj(
            {
                k: obj({"estimated": _BYTES, "measured": _BYTES, "equal": {"type": "boolean"}})
                for k in ("unsharded_weights", "unsharded_gradients", "gradients")
            }
        ),
    },
    required=["equal", "tensors", "flops", "layers"],
)

_PEAK_MOMENTS = {
    "type": "array",
    "items": obj(
        {
            "moment": NAME,
            "estimated": BYTES,
            # null: the measured curve has no such stretch
            "measured": {"type": ["integer", "null"], "minimum": 0},
            "delta": {"type": ["integer", "null"]},
        }
    ),
}
"""A peak's moments, each estimated and measured (the curve's highest point in its stretch)."""

_TRACE = obj(
    {
        "estimated": _ESTIMATE_REF,
        "measured": _MEASURED,
        "diff": _DIFF,
        "seconds": SECONDS,
        "ran_on": NAME,
        # trace --impl torchtitan with tp or dp > 1: the rank traced on the fake process group (its cp rank
        # is --cp-rank's)
        "rank": obj({"rank": COUNT, "world": COUNT, "tp": COUNT, "cp": COUNT, "dp": COUNT}),
        # and its peak of forward and backward beside the estimate's moments, without the optimizer's states
        "peak": obj(
            {
                "estimated": BYTES,
                "estimated_phase": NAME,
                "moments": _PEAK_MOMENTS,
                "measured": BYTES,
                "measured_phase": NAME,
                "measured_op": NAME,
                "measured_parts": {"type": "object", "additionalProperties": BYTES},
                "measured_transient": {"type": "object", "additionalProperties": BYTES},
                "delta": {"type": "integer"},
                "equal": {"type": "boolean"},
            }
        ),
        # trace --impl hf: the peak of transformers' step (peft's under LoRA) at the estimate's moments, the
        # model's buffers (which the estimate does not count) taken off the measured curve; shown, not judged
        "step_peak": obj(
            {
                "moments": _PEAK_MOMENTS,
                "buffers": BYTES,
                "estimated": BYTES,
                "estimated_phase": NAME,
                "measured": BYTES,
                "delta": {"type": "integer"},
                "equal": {"type": "boolean"},
            }
        ),
        # trace --impl torchtitan --pp: the pipeline rank traced (its local chunks' virtual stages)
        "stage": obj(
            {
                "index": COUNT,
                "pp": POSITIVE,
                "vpp": POSITIVE,
                "virtual_stages": {"type": "array", "items": COUNT},
                "layers": {"type": "array", "items": COUNT},
            }
        ),
        "stages": {"type": "array", "items": {"type": "object"}},
    },
    required=["estimated", "measured", "diff"],
)

_PROFILE_TIME = obj(
    {
        "device": NAME,
        "step_seconds": {"type": "array", "items": SECONDS},
        "median_step_seconds": SECONDS,
        "phase_seconds": {"type": "object", "additionalProperties": SECONDS},
        "achieved_tflops": _RATE,
    }
)
_PROFILE_TIMELINE = {
    "type": "array",
    "items": {
        "allOf": [
            {"$ref": "#/$defs/estimate/properties/timeline/items"},
            obj(
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
        obj(
            {
                "time": _PROFILE_TIME,
                "timeline": _PROFILE_TIMELINE,
                "measured": obj({"memory": obj({"peak": _BYTES})}),
            },
            required=["time", "measured"],
        ),
    ]
}
_PROFILE_RANKS = obj(
    {
        "model": NAME,
        "nproc": POSITIVE,
        "launcher": {"type": "string", "enum": ["spawn", "torchrun"]},
        "layout": obj(
            {**{k: POSITIVE for k in ("tp", "pp", "dp")}, "sp": {"type": "boolean"}, "zero": COUNT}
        ),
        "estimated": obj(
            {"memory": {"type": "object"}, "stages": {"type": "array"}, "tensors": {"type": "object"}}
        ),
        "ranks": {
            "type": "array",
            "items": obj(
                {
                    "rank": COUNT,
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
