"""The published JSON Schema of ``memplan estimate --json`` (``api.to_json``: ``contract.to_json`` with
``fit``, ``time``, ``host_fit`` and, with --timeline, ``timeline``). The other commands' schemas
(``memplan schema --command compare|fit|trace|profile``) hold this one under ``$defs.estimate``
(commands.py). The estimate's parts: parts.py (the number types), settings.py (``setup``, from the
config fields), fit_time.py (``verdict``, ``fit``, ``time``, ``host_fit``, ``timeline``); this module the
contract's own keys and the whole.

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
from typing import Any

from memplan.config.finetune import Method
from memplan.schema.fit_time import FIT_VERDICT, HOST_FIT, TIME, TIMELINE, VERDICT
from memplan.schema.parts import BYTES, COUNT, FLOPS, NAME, POSITIVE, SCHEMA_DRAFT, described, obj
from memplan.schema.settings import setup_schema

SCHEMA_ID = "urn:memplan:schema:estimate:1"

_TENSOR = obj(
    {
        "name": {"type": "string", "minLength": 1, "description": "data-flow name, e.g. attn.q"},
        "shape": {"type": "array", "items": COUNT, "description": "elements per dimension (() = scalar)"},
        "dtype": {"type": "string", "minLength": 1},
        "bytes": described(BYTES, "bytes of one instance"),
        "count": described(COUNT, "instances kept (one per layer for layer-scope entries)"),
        "total_bytes": described(BYTES, "bytes × count"),
        "scope": {"type": "string", "enum": ["layer", "model"]},
        "reason": {"type": "string"},
    },
    required=["name", "shape", "dtype", "bytes", "count"],
)

_PARAMS = obj(
    {
        "total": described(COUNT, "all parameters"),
        "active": described(COUNT, "parameters touched per token (= total for dense models)"),
        "embedding": COUNT,
        "positions": COUNT,
        "per_layer": COUNT,
        "layers": COUNT,
        "final_norm": COUNT,
        "lm_head": COUNT,
        "trainable": described(COUNT, "parameters that train (LoRA: the adapters, as peft counts them)"),
        "frozen": described(COUNT, "parameters that do not train (the base under LoRA)"),
    },
    required=["total", "active"],
)

_MEMORY = obj(
    {
        "weights": BYTES,
        "gradients": BYTES,
        "optimizer": described(BYTES, "master weights + optimizer states"),
        "master_weights": BYTES,
        "optimizer_states": BYTES,
        "activations": described(BYTES, "everything autograd keeps for backward, one micro-batch"),
        "peak": described(BYTES, "the largest modelled moment of the step"),
        "peak_phase": {"type": "string"},
        "peak_default_stream": described(
            BYTES,
            "the peak less FSDP2's flat all-gather outputs in it (the all-gather stream's pool, replayed "
            "and kept back apart): what the default stream's allocator is asked for",
        ),
        "phases": {"type": "object", "additionalProperties": BYTES},
        "optimizer_impl": described({"type": "string"}, "whose code steps the optimizer (--optimizer-impl)"),
        "optimizer_step_transient": described(BYTES, "what the optimizer step allocates above the states"),
        "allocated_peak": described(
            BYTES,
            "torch's allocated_bytes.all.peak: the step's allocations replayed through the caching "
            "allocator (512-byte rounding, blocks handed out unsplit; with --gpu its cuBLAS workspace)",
        ),
        "reserved_peak": described(
            BYTES, "torch's reserved_bytes.all.peak: the segments the caching allocator holds at most"
        ),
        "allocator": obj(
            {
                "requested_peak": described(BYTES, "the peak plus the cuBLAS workspaces"),
                "allocated_peak": BYTES,
                "reserved_peak": BYTES,
                "segments": COUNT,
                "cublas_workspace": described(
                    BYTES, "cuBLAS's workspaces: the forward thread's and autograd's backward thread's"
                ),
                "cuda_context": described(BYTES, "outside the allocator (with --gpu)"),
                "nccl": described(BYTES, "NCCL's buffers, outside the allocator (with --gpu; memory.nccl)"),
                "te_userbuffers": described(
                    BYTES, "TE's userbuffers (--tp-comm-overlap), outside the allocator"
                ),
                "symm_mem_workspace": described(
                    BYTES, "torch's symmetric-memory workspace (--async-tp), outside the allocator"
                ),
                "device_peak": described(
                    BYTES,
                    "reserved peak + CUDA context + NCCL buffers + TE's userbuffers + the symmetric-memory "
                    "workspace",
                ),
                "expandable_segments": {"type": "boolean"},
            }
        ),
        "device_bytes": described(
            BYTES, "the GPU's memory as the driver reports it (nvidia-smi), with --gpu"
        ),
        "device_usable": described(
            BYTES,
            "what the allocator may reserve: device_bytes − CUDA context − NCCL buffers − FSDP2's all-gather "
            "stream − DDP's buckets − TE's userbuffers − the symmetric-memory workspace − --reserve (with "
            "--gpu; the verdict's)",
        ),
        "fsdp_all_gather_stream": described(
            {"type": ["integer", "null"], "minimum": 0},
            "what the caching allocator reserves on FSDP2's all-gather stream (its own pool; judged: kept "
            "back from the default stream's allocator; 0 without FSDP2's gathers, null where not modelled: "
            "tensor parallelism, fine-tuning — then not judged)",
        ),
        "ddp_buckets": described(
            BYTES,
            "torch DDP's gradient buckets (ZeRO 0 over dp > 1, --impl hf or torchtitan): a second copy of "
            "the gradients with gradient_as_bucket_view=False; judged: kept back from the allocator",
        ),
        "te_userbuffers": described(
            BYTES,
            "Transformer Engine's userbuffers under --tp-comm-overlap: ten [s·b/cp, h] buffers registered "
            "outside the allocator (float8 for the all-gathers under --fp8); judged: kept back; 0 without",
        ),
        "symm_mem_workspace": described(
            BYTES,
            "torch's symmetric-memory workspace under --async-tp: the tp group's, the largest fused op's "
            "request (two [s·b/(cp·t), h] output chunks of a fused reduce-scatter) rounded to 2 MiB with its "
            "signal pad, allocated outside the caching allocator; judged: kept back; 0 without",
        ),
        "fsdp_reduce_scatter_stream": described(
            BYTES,
            "what the caching allocator reserves on FSDP2's reduce-scatter stream (its own pool: the sharded "
            "gradients, one block per unit, under FSDP2's mixed precision; reported, not kept back: its "
            "segments are wholly free at every moment without gradients; 0 where not modelled)",
        ),
        "nccl": obj(
            {
                "total": described(BYTES, "NCCL's buffers of the most loaded device, outside the allocator"),
                "communicators": {
                    "type": "array",
                    "items": obj(
                        {
                            "group": {"type": "string"},
                            "ranks": COUNT,
                            "peers": described(COUNT, "point-to-point peers (0: collectives, on the ring)"),
                            "inter_node": {"type": "boolean"},
                            "channels": described(COUNT, "ring channels connected"),
                            "p2p_channels_per_peer": COUNT,
                            "bytes": BYTES,
                        }
                    ),
                },
            }
        ),
        "host": obj(
            {
                "weights": described(BYTES, "16-bit weights offloaded (--offload params)"),
                "gradients": described(BYTES, "the fp32 host gradient buffer (--offload optimizer)"),
                "optimizer": described(BYTES, "master weights + optimizer states (--offload optimizer)"),
                "activations": described(BYTES, "saved tensors copied to the host (--offload activations)"),
                "total": BYTES,
            },
            required=["weights", "gradients", "optimizer", "activations", "total"],
        ),
    },
    required=["weights", "gradients", "optimizer", "activations", "peak"],
)

_ACTIVATIONS = obj(
    {
        "total": BYTES,
        "per_layer": described(BYTES, "one transformer layer on one device"),
        "tensors": {"type": "array", "items": _TENSOR},
    },
    required=["tensors", "per_layer"],
)

_FLOPS_OBJ = obj(
    {
        "forward": FLOPS,
        "backward": FLOPS,
        "recompute": described(FLOPS, "forward work re-run in backward (checkpointing, reversible)"),
        "total": described(FLOPS, "forward + backward + recompute: what FlopCounterMode counts"),
        "model": described(
            FLOPS, "forward + backward, without recompute (for MFU), as one device counts them at any cp"
        ),
        "cp_skipped": described(
            FLOPS,
            "attention FLOPs in model that no context-parallel rank runs (its causal split's masked blocks)",
        ),
        "hardware": described(FLOPS, "= total (for HFU)"),
        "six_n": FLOPS,
        "per_step": described(FLOPS, "total × grad_accum"),
    },
    required=["forward", "backward", "recompute", "total", "model"],
)

_FINETUNE = obj(
    {
        "method": {"type": "string", "enum": [m.name.lower() for m in Method]},
        "label": NAME,
        "rank": POSITIVE,
        "alpha": {"type": "number", "exclusiveMinimum": 0},
        "dropout": {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
        "targets": {"type": "array", "items": NAME},
        "adapter_params": described(COUNT, "trainable adapter parameters (= params.trainable)"),
        "quant": NAME,
        "double_quant": {"type": "boolean"},
        "compute_dtype": NAME,
        "frozen": obj(
            {
                "embeddings": {"type": "boolean"},
                "lm_head": {"type": "boolean"},
                "layers": {"type": ["array", "null"], "items": COUNT},
            }
        ),
    },
    required=["method", "label", "frozen"],
)

_PARALLEL = obj(
    {
        **{k: POSITIVE for k in ("tp", "pp", "vpp", "ep", "cp")},
        "etp": {"type": ["integer", "null"], "minimum": 1},  # null: the tp degree (Megatron's default)
        "sp": {"type": "boolean"},
        "pp_layers": {
            "type": ["array", "null"],
            "items": COUNT,
        },  # 0: a virtual stage of the embedding or head alone
        "label": NAME,
    },
)

_STAGE_MEMORY = obj(
    {k: _MEMORY["properties"][k] for k in ("weights", "gradients", "optimizer", "activations", "peak")}
    | {
        "peak_phase": {"type": "string"},
        "phases": {"type": "object", "additionalProperties": BYTES},
        "host": _MEMORY["properties"]["host"],
    },
)

_STAGE = obj(
    {
        "stage": COUNT,
        "layers": described(COUNT, "layers of this pipeline stage"),
        "in_flight_chunks": COUNT,
        "in_flight_layers": COUNT,
        "params": COUNT,
        "memory": _STAGE_MEMORY,
    }
)

_ESTIMATE: dict[str, Any] = {
    "$schema": SCHEMA_DRAFT,
    "$id": SCHEMA_ID,
    "title": "memplan estimate",
    "description": (
        "One training micro-batch of a transformer on one device: parameters, memory (bytes), the "
        "activation inventory and FLOPs (whole model). Keys may be added; these are never renamed."
    ),
    **obj(
        {
            "model": {"type": "string"},
            "setup": setup_schema(),
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
            "fit": {"oneOf": [FIT_VERDICT, {"type": "null"}], "description": "with --gpu: the memory fit"},
            "time": {"oneOf": [TIME, {"type": "null"}], "description": "with --gpu: the step time"},
            "host_fit": described(HOST_FIT, "with --host-memory or offload on a GPU preset with a host"),
            "timeline": described(TIMELINE, "with --timeline: memory at each moment of the step"),
            "verdict": VERDICT,
            "notes": described(
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
