"""The published JSON Schema of ``memplan estimate --json`` (``contract.to_json``).

The contract of docs/architecture.md ("Machine-readable output"): the keys below must exist and byte and
FLOP figures are integers. Every object allows further keys (``additionalProperties`` is left open): the
contract says "add keys freely; never rename these", so a consumer validating against this schema keeps
working when memplan adds a key, and breaks when one of these is renamed or changes type.

Pure Python, no torch. ``estimate_schema()`` returns a fresh copy (callers may mutate it);
``memplan schema`` prints it.

Known limitations (NB): the schema checks types, required keys and signs, not the arithmetic between keys
(``flops.total = forward + backward + recompute``, ``activations.total = Σ bytes × count``): JSON Schema
cannot express sums. tests/test_properties.py checks those.
"""

from __future__ import annotations

import copy
from enum import Enum
from typing import Any

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


def _setting(field: FieldInfo) -> dict[str, Any]:
    """The schema of one setting, from its config field: what ``Setup.settings`` writes for it."""
    kind = field.annotation
    if kind is bool:
        return {"type": "boolean"}
    if isinstance(kind, type) and issubclass(kind, Enum):
        values = [json_value(member) for member in kind]
        return {"type": "integer" if kind is ZeroStage else "string", "enum": values}
    if kind is not int:  # a list of whole numbers or nothing (pipeline stages' layers)
        return {"type": ["array", "null"], "items": _POSITIVE}
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
    properties["loss"] = {"type": "string", "pattern": "^(standard|fused|chunked:[1-9][0-9]*)$"}
    properties["finetune"] = {"type": "string", "enum": [m.name.lower() for m in Method]}
    return _obj(properties, required=[])


_SETUP = _setup_schema()

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
