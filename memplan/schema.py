"""The published JSON Schema of ``memplan estimate --json`` (``api.to_json``: ``contract.to_json`` with
``fit``, ``time``, ``host_fit`` and, with --timeline, ``timeline``). The other commands' schemas
(``memplan schema --command compare|fit|trace|profile``) hold this one under ``$defs.estimate``
(memplan/schema_commands.py).

The contract of docs/architecture.md ("Machine-readable output"): the keys below must exist and byte and
FLOP figures are integers. Every object allows further keys (``additionalProperties`` is left open): the
contract says "add keys freely; never rename these", so a consumer validating against this schema keeps
working when memplan adds a key, and breaks when one of these is renamed or changes type.

Pure Python, no torch. ``estimate_schema()`` returns a fresh copy (callers may mutate it);
``memplan schema`` prints it. Sizes (bytes, FLOPs, counts) are integers ≥ 0, seconds and fractions numbers
≥ 0; only ``headroom`` (usable − peak) is signed.

Known limitations (NB): the schema checks types, required keys and signs, not the arithmetic between keys
(``flops.total = forward + backward + recompute``, ``activations.total = Σ bytes × count``): JSON Schema
cannot express sums. tests/test_properties.py checks those.
"""

from __future__ import annotations

import copy
from enum import Enum
from typing import Any, get_args

from pydantic.fields import FieldInfo

from memplan.config import Device, ImplConfig, Parallel, StrategyConfig, TrainingConfig, ZeroStage
from memplan.config.finetune import Method
from memplan.config.setup import json_value

SCHEMA_DRAFT = "https://json-schema.org/draft/2020-12/schema"
SCHEMA_ID = "urn:memplan:schema:estimate:1"

_BYTES: dict[str, Any] = {"type": "integer", "minimum": 0, "description": "bytes on one device"}
_FLOPS: dict[str, Any] = {"type": "integer", "minimum": 0, "description": "floating-point operations"}
_COUNT: dict[str, Any] = {"type": "integer", "minimum": 0}
_POSITIVE: dict[str, Any] = {"type": "integer", "minimum": 1}


def _obj(properties: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    """An object with these properties, all required unless ``required`` names fewer; more keys allowed."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        **extra,
    }


def _with(base: dict[str, Any], description: str) -> dict[str, Any]:
    return {**base, "description": description}


_TENSOR = _obj(
    {
        "name": {"type": "string", "minLength": 1, "description": "data-flow name, e.g. attn.q"},
        "shape": {"type": "array", "items": _COUNT, "description": "elements per dimension (() = scalar)"},
        "dtype": {"type": "string", "minLength": 1},
        "bytes": _with(_BYTES, "bytes of one instance"),
        "count": _with(_COUNT, "instances kept (one per layer for layer-scope entries)"),
        "total_bytes": _with(_BYTES, "bytes × count"),
        "scope": {"type": "string", "enum": ["layer", "model"]},
        "reason": {"type": "string"},
    },
    required=["name", "shape", "dtype", "bytes", "count"],
)

_PARAMS = _obj(
    {
        "total": _with(_COUNT, "all parameters"),
        "active": _with(_COUNT, "parameters touched per token (= total for dense models)"),
        "embedding": _COUNT,
        "positions": _COUNT,
        "per_layer": _COUNT,
        "layers": _COUNT,
        "final_norm": _COUNT,
        "lm_head": _COUNT,
        "trainable": _with(_COUNT, "parameters that train (LoRA: the adapters, as peft counts them)"),
        "frozen": _with(_COUNT, "parameters that do not train (the base under LoRA)"),
    },
    required=["total", "active"],
)

_MEMORY = _obj(
    {
        "weights": _BYTES,
        "gradients": _BYTES,
        "optimizer": _with(_BYTES, "master weights + optimizer states"),
        "master_weights": _BYTES,
        "optimizer_states": _BYTES,
        "activations": _with(_BYTES, "everything autograd keeps for backward, one micro-batch"),
        "peak": _with(_BYTES, "the largest modelled moment of the step"),
        "peak_phase": {"type": "string"},
        "phases": {"type": "object", "additionalProperties": _BYTES},
        "optimizer_impl": _with({"type": "string"}, "whose code steps the optimizer (--optimizer-impl)"),
        "optimizer_step_transient": _with(_BYTES, "what the optimizer step allocates above the states"),
        "allocated_peak": _with(
            _BYTES,
            "torch's allocated_bytes.all.peak: the step's allocations replayed through the caching "
            "allocator (512-byte rounding, blocks handed out unsplit; with --gpu its cuBLAS workspace)",
        ),
        "reserved_peak": _with(
            _BYTES, "torch's reserved_bytes.all.peak: the segments the caching allocator holds at most"
        ),
        "allocator": _obj(
            {
                "requested_peak": _with(_BYTES, "the peak plus the cuBLAS workspace"),
                "allocated_peak": _BYTES,
                "reserved_peak": _BYTES,
                "segments": _COUNT,
                "cublas_workspace": _BYTES,
                "cuda_context": _with(_BYTES, "outside the allocator (with --gpu)"),
                "device_peak": _with(_BYTES, "reserved peak + CUDA context"),
                "expandable_segments": {"type": "boolean"},
            }
        ),
        "device_bytes": _with(_BYTES, "the GPU's memory as the driver reports it (nvidia-smi), with --gpu"),
        "device_usable": _with(
            _BYTES, "what the allocator may reserve: device_bytes − CUDA context − --reserve (with --gpu)"
        ),
        "host": _obj(
            {
                "weights": _with(_BYTES, "16-bit weights offloaded (--offload params)"),
                "gradients": _with(_BYTES, "the fp32 host gradient buffer (--offload optimizer)"),
                "optimizer": _with(_BYTES, "master weights + optimizer states (--offload optimizer)"),
                "activations": _with(_BYTES, "saved tensors copied to the host (--offload activations)"),
                "total": _BYTES,
            },
            required=["weights", "gradients", "optimizer", "activations", "total"],
        ),
    },
    required=["weights", "gradients", "optimizer", "activations", "peak"],
)

_ACTIVATIONS = _obj(
    {
        "total": _BYTES,
        "per_layer": _with(_BYTES, "one transformer layer on one device"),
        "tensors": {"type": "array", "items": _TENSOR},
    },
    required=["tensors", "per_layer"],
)

_FLOPS_OBJ = _obj(
    {
        "forward": _FLOPS,
        "backward": _FLOPS,
        "recompute": _with(_FLOPS, "forward work re-run in backward (checkpointing, reversible)"),
        "total": _with(_FLOPS, "forward + backward + recompute: what FlopCounterMode counts"),
        "model": _with(_FLOPS, "forward + backward, without recompute (for MFU)"),
        "hardware": _with(_FLOPS, "= total (for HFU)"),
        "six_n": _FLOPS,
        "per_step": _with(_FLOPS, "total × grad_accum"),
    },
    required=["forward", "backward", "recompute", "total", "model"],
)


_ARGS: dict[str, Any] = {"type": "array", "items": {"type": "string"}}
_VERDICT = _obj(
    {
        "gpu": _with({"type": "string"}, "the GPU judged against: --gpu, else a GPU preset"),
        "gpu_given": {"type": "boolean"},
        "memory_bytes": _BYTES,
        "usable_bytes": _with(_BYTES, "memory_bytes − the reserve (--reserve)"),
        "peak": _BYTES,
        "phase": {"type": "string"},
        "fits": {"type": "boolean"},
        "headroom": {"type": "integer", "description": "usable − peak, bytes (negative: does not fit)"},
        "devices": _POSITIVE,
        "terms": _with(
            {"type": "object", "additionalProperties": _BYTES, "maxProperties": 3},
            "the three largest terms of the peak moment, bytes",
        ),
        "counts": {
            "type": "array",
            "items": _obj(
                {
                    "gpu": {"type": "string"},
                    "usable_bytes": _BYTES,
                    "devices": {"type": ["integer", "null"], "minimum": 1},
                    "dp": {"type": ["integer", "null"], "minimum": 1},
                    "args": _ARGS,
                    "peak": _BYTES,
                }
            ),
        },
        "notes": {"type": "array", "items": {"type": "string"}},
        "suggestions": {
            "type": "array",
            "items": _obj(
                {
                    "args": _ARGS,
                    "command": _ARGS,
                    "peak": _BYTES,
                    "fits": {"type": "boolean"},
                    "devices": _POSITIVE,
                    "why": {"type": "string"},
                }
            ),
        },
    }
)
"""``estimate --json``'s ``verdict`` (``memplan.advice.Advice``): the answer the panel leads with."""


def _setting(field: FieldInfo) -> dict[str, Any]:
    """The schema of one setting, from its config field: what ``Setup.settings`` writes for it."""
    kind = field.annotation
    if kind is bool:
        return {"type": "boolean"}
    if isinstance(kind, type) and issubclass(kind, Enum):
        values = [json_value(member) for member in kind]
        return {"type": "integer" if kind is ZeroStage else "string", "enum": values}
    members = [k for k in get_args(kind) if k is not type(None)]
    if len(members) == 1 and isinstance(members[0], type) and issubclass(members[0], Enum):
        # An optional choice (``--optimizer-impl``): one of its values, or null when not given. Typed by
        # its values, never as an array (the bug that failed every output given --optimizer-impl).
        values = [json_value(member) for member in members[0]]
        return {"type": ["string", "null"], "enum": [*values, None]}
    if kind is not int:  # a list of whole numbers or nothing (pipeline stages' layers; with --vpp a
        # virtual stage of the embedding or head alone holds 0: Parallel.pp_layers)
        return {"type": ["array", "null"], "items": _COUNT}
    bounds = [getattr(m, "gt", None) for m in field.metadata]
    above = next((b for b in bounds if b is not None), None)
    return {"type": "integer", **({"minimum": above + 1} if above is not None else {})}


def _setup_schema() -> dict[str, Any]:
    """``setup``: every setting of ``Setup.settings``, typed from the config fields it comes from."""
    fields = {
        **TrainingConfig.model_fields,
        **StrategyConfig.model_fields,
        **Parallel.model_fields,
        **ImplConfig.model_fields,
    }
    del fields["checkpoint_every"]
    properties = {name: _setting(field) for name, field in fields.items()}
    properties["checkpointing"] = {"type": "string", "pattern": "^(none|selective|full|every-[1-9][0-9]*)$"}
    properties["device"] = {"type": "string", "enum": [d.value for d in Device]}
    offload = "(none|optimizer|params|activations)(,(optimizer|params|activations))*"
    properties["offload"] = {"type": "string", "pattern": f"^{offload}$"}
    properties["loss"] = {"type": "string", "pattern": "^(standard|xentropy|fused|chunked:[1-9][0-9]*)$"}
    properties["finetune"] = {"type": "string", "enum": [m.name.lower() for m in Method]}
    return _obj(properties, required=[])


_SETUP = _setup_schema()

_SECONDS: dict[str, Any] = {"type": "number", "minimum": 0, "description": "seconds"}
_FRACTION: dict[str, Any] = {"type": "number", "minimum": 0, "description": "a fraction (1 = 100 %)"}
_SIGNED: dict[str, Any] = {"type": "integer", "description": "bytes, negative when short"}
_NAME: dict[str, Any] = {"type": "string", "minLength": 1}
_TERMS = ["weights", "optimizer", "gradients", "activations", "transient"]  # search.budget.terms

_FINETUNE = _obj(
    {
        "method": {"type": "string", "enum": [m.name.lower() for m in Method]},
        "label": _NAME,
        "rank": _POSITIVE,
        "alpha": {"type": "number", "exclusiveMinimum": 0},
        "dropout": {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
        "targets": {"type": "array", "items": _NAME},
        "adapter_params": _with(_COUNT, "trainable adapter parameters (= params.trainable)"),
        "quant": _NAME,
        "double_quant": {"type": "boolean"},
        "compute_dtype": _NAME,
        "frozen": _obj(
            {
                "embeddings": {"type": "boolean"},
                "lm_head": {"type": "boolean"},
                "layers": {"type": ["array", "null"], "items": _COUNT},
            }
        ),
    },
    required=["method", "label", "frozen"],
)

_PARALLEL = _obj(
    {
        **{k: _POSITIVE for k in ("tp", "pp", "vpp", "ep", "cp")},
        "sp": {"type": "boolean"},
        "pp_layers": {
            "type": ["array", "null"],
            "items": _COUNT,
        },  # 0: a virtual stage of the embedding or head alone
        "label": _NAME,
    },
)

_STAGE_MEMORY = _obj(
    {k: _MEMORY["properties"][k] for k in ("weights", "gradients", "optimizer", "activations", "peak")}
    | {
        "peak_phase": {"type": "string"},
        "phases": {"type": "object", "additionalProperties": _BYTES},
        "host": _MEMORY["properties"]["host"],
    },
)

_STAGE = _obj(
    {
        "stage": _COUNT,
        "layers": _with(_COUNT, "layers of this pipeline stage"),
        "in_flight_chunks": _COUNT,
        "in_flight_layers": _COUNT,
        "params": _COUNT,
        "memory": _STAGE_MEMORY,
    }
)

_FIT_VERDICT = _obj(
    {
        "gpu": _NAME,
        "memory_bytes": _with(_BYTES, "the GPU's capacity"),
        "reserve": _with(_BYTES, "kept back for the CUDA context and the allocator (--reserve)"),
        "usable_bytes": _with(_BYTES, "memory_bytes − reserve"),
        "peak": _BYTES,
        "exact": {"type": "boolean"},
        "stage": _COUNT,
        "phase": {"type": "string"},
        "fits": {"type": "boolean"},
        "headroom": _with(_SIGNED, "usable − peak (negative when it does not fit)"),
        "overflow": {"type": ["string", "null"], "enum": [*_TERMS, None]},
    }
)

_HOST_FIT = _obj(
    {
        "host_memory_bytes": _BYTES,
        "per_device": _BYTES,
        "devices": _POSITIVE,
        "need": _BYTES,
        "fits": {"type": "boolean"},
        "headroom": _SIGNED,
    }
)

_COMMUNICATION = _obj(
    {
        "dimension": _NAME,
        "collective": _NAME,
        "phase": _NAME,
        "bytes": _with(_BYTES, "bytes one call moves"),
        "count": _with(_COUNT, "calls per step"),
        "group": _POSITIVE,
        "link": _NAME,
        "time_s": _with(_SECONDS, "count × one call's seconds"),
        "overlapped": {"type": "boolean"},
        "overlaps": _NAME,
        "what": {"type": "string"},
    }
)

_PREDICTED = _obj(
    {
        "stage": _COUNT,
        "stage_layers": _COUNT,
        "matmul_s": _SECONDS,
        "matmul_wave_efficiency": _FRACTION,
        "attention_s": _SECONDS,
        "elementwise_s": _SECONDS,
        "compute_s": _SECONDS,
        "exposed_s": {"type": "object", "additionalProperties": _SECONDS},
        "bubble_s": _SECONDS,
        "optimizer_s": _SECONDS,
        "step_time_s": _SECONDS,
        "mfu": _FRACTION,
    }
)

_TIME = _obj(
    {
        "devices": _POSITIVE,
        "peak_flops_per_device": {"type": "number", "exclusiveMinimum": 0},
        "global_batch": _POSITIVE,
        "tokens_per_step": _POSITIVE,
        "model_flops_per_step": _FLOPS,
        "hardware_flops_per_step": _FLOPS,
        "recompute_flops_per_step": _FLOPS,
        "bubble": _with(_FRACTION, "pipeline bubble / busy time, (p − 1)/(v·m)"),
        "step_time_s": _SECONDS,
        "tokens_per_s": {"type": "number", "minimum": 0},
        "mfu": _FRACTION,
        "hfu": _FRACTION,
        "assumed_mfu": {"type": ["number", "null"], "exclusiveMinimum": 0},
        "basis": {"type": "string", "enum": ["predicted", "assumed", "measured"]},
        "training_tokens": {"type": ["integer", "null"], "minimum": 1},
        "training_days": {"type": ["number", "null"], "minimum": 0},
        "predicted": _PREDICTED,
        "communication": {"type": "array", "items": _COMMUNICATION},
    }
)

_TIMELINE = {
    "type": "array",
    "items": _obj(
        {"label": _NAME, "bytes": _BYTES, **{k: _BYTES for k in _TERMS}},
        # profile --timeline adds the measured curve at each point (null where it has no sample)
        required=["label", "bytes", *_TERMS],
    ),
}

_ESTIMATE: dict[str, Any] = {
    "$schema": SCHEMA_DRAFT,
    "$id": SCHEMA_ID,
    "title": "memplan estimate",
    "description": (
        "One training micro-batch of a transformer on one device: parameters, memory (bytes), the "
        "activation inventory and FLOPs (whole model). Keys may be added; these are never renamed."
    ),
    **_obj(
        {
            "model": {"type": "string"},
            "setup": _SETUP,
            "params": _PARAMS,
            "memory": _MEMORY,
            "activations": _ACTIVATIONS,
            "flops": _FLOPS_OBJ,
            "finetune": _FINETUNE,
            "parallel": _PARALLEL,
            "moe": {
                "type": ["object", "null"],
                "description": "the mixture of experts' settings and routing",
            },
            "stages": {"type": "array", "items": _STAGE, "description": "every pipeline stage's device"},
            "fit": {"oneOf": [_FIT_VERDICT, {"type": "null"}], "description": "with --gpu: the memory fit"},
            "time": {"oneOf": [_TIME, {"type": "null"}], "description": "with --gpu: the step time"},
            "host_fit": _with(_HOST_FIT, "with --host-memory or offload on a GPU preset with a host"),
            "timeline": _with(_TIMELINE, "with --timeline: memory at each moment of the step"),
            "verdict": _VERDICT,
            "notes": _with(
                {"type": "array", "items": {"type": "string"}},
                "settings that pass but deserve a word (a sequence past the model's positions, …)",
            ),
        },
        required=["params", "memory", "activations", "flops"],
    ),
}


def estimate_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) every ``memplan estimate --json`` output validates against."""
    return copy.deepcopy(_ESTIMATE)


def contract_keys() -> list[str]:
    """Dotted paths of the keys the contract requires (``activations.tensors[].name`` for array items)."""
    keys: list[str] = []

    def walk(node: dict[str, Any], prefix: str) -> None:
        for key in node.get("required", []):
            path = f"{prefix}{key}"
            keys.append(path)
            child = node["properties"][key]
            if child.get("type") == "object":
                walk(child, f"{path}.")
            elif child.get("type") == "array" and child["items"].get("type") == "object":
                walk(child["items"], f"{path}[].")

    walk(_ESTIMATE, "")
    return keys
