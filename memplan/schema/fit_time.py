"""The estimate's answers about a GPU and the step's course: ``verdict`` (``memplan.advice``), ``fit`` and
``time`` (with ``--gpu``), ``host_fit`` (host memory under offload) and ``timeline`` (``--timeline``).

Known limitations (NB): the schema checks types, required keys and signs, not the arithmetic between keys
(``headroom = usable − reserved``).
"""

from __future__ import annotations

from typing import Any

from memplan.schema.parts import (
    BYTES,
    COUNT,
    FLOPS,
    FRACTION,
    NAME,
    POSITIVE,
    SECONDS,
    SIGNED,
    described,
    obj,
)

TERMS = ["weights", "optimizer", "gradients", "activations", "transient"]  # search.budget.terms

_ARGS: dict[str, Any] = {"type": "array", "items": {"type": "string"}}
VERDICT = obj(
    {
        "gpu": described({"type": "string"}, "the GPU judged against: --gpu, else a GPU preset"),
        "gpu_given": {"type": "boolean"},
        "memory_bytes": BYTES,
        "usable_bytes": described(
            BYTES,
            "what the allocator may reserve: the driver's memory less the CUDA context, NCCL's buffers, "
            "FSDP2's all-gather stream, DDP's buckets and --reserve",
        ),
        "peak": described(BYTES, "the most loaded device's tensors at their peak moment, every stream's"),
        "phase": {"type": "string"},
        "reserved": described(BYTES, "the caching allocator's reserved peak on the default stream: judged"),
        "fits": {"type": "boolean"},
        "headroom": {"type": "integer", "description": "usable − reserved, bytes (negative: does not fit)"},
        "devices": POSITIVE,
        "held": described(
            {"type": "object", "additionalProperties": BYTES},
            "what is kept off the allocator's share before the step (cuda_context, nccl, "
            "fsdp_all_gather_stream, ddp_buckets, userbuffers, symm_mem, reserve), those above 0, the "
            "largest first, bytes",
        ),
        "terms": described(
            {"type": "object", "additionalProperties": BYTES, "maxProperties": 3},
            "the three largest terms of the peak moment, bytes",
        ),
        "counts": {
            "type": "array",
            "items": obj(
                {
                    "gpu": {"type": "string"},
                    "usable_bytes": BYTES,
                    "devices": {"type": ["integer", "null"], "minimum": 1},
                    "dp": {"type": ["integer", "null"], "minimum": 1},
                    "args": _ARGS,
                    "peak": BYTES,
                    "reserved": described(BYTES, "the allocator's reserved peak there (0: none planned)"),
                    "refused": described(
                        {"type": ["string", "null"]},
                        "why --zero 3 --dp N cannot be planned with the other options (null: it can)",
                    ),
                    "hsdp": described(
                        {"type": ["integer", "null"], "minimum": 1},
                        "the --hsdp R the count keeps: ZeRO-3 shards over R ranks only (null: no HSDP)",
                    ),
                }
            ),
        },
        "notes": {"type": "array", "items": {"type": "string"}},
        "suggestions": {
            "type": "array",
            "items": obj(
                {
                    "args": _ARGS,
                    "command": _ARGS,
                    "peak": BYTES,
                    "reserved": described(BYTES, "the allocator's reserved peak, what fits judges"),
                    "fits": {"type": "boolean"},
                    "devices": POSITIVE,
                    "why": {"type": "string"},
                }
            ),
        },
    }
)
"""``estimate --json``'s ``verdict`` (``memplan.advice.Advice``): the answer the panel leads with."""


FIT_VERDICT = obj(
    {
        "gpu": NAME,
        "memory_bytes": described(BYTES, "the GPU's capacity"),
        "reserve": described(BYTES, "kept back for the CUDA context and the allocator (--reserve)"),
        "usable_bytes": described(
            BYTES,
            "the driver's memory − CUDA context − NCCL buffers − fsdp_all_gather_stream − ddp_buckets "
            "− userbuffers − symm_mem − reserve",
        ),
        "fsdp_all_gather_stream": described(
            BYTES, "FSDP2's all-gather stream's reserved bytes, its own pool, kept back (0 without it)"
        ),
        "ddp_buckets": described(BYTES, "torch DDP's gradient buckets, kept back (0 without DDP)"),
        "userbuffers": described(BYTES, "TE's userbuffers (--tp-comm-overlap), kept back (0 without)"),
        "symm_mem": described(
            BYTES, "torch's symmetric-memory workspace (--async-tp), kept back (0 without)"
        ),
        "peak": BYTES,
        "exact": {"type": "boolean"},
        "stage": COUNT,
        "phase": {"type": "string"},
        "fits": {"type": "boolean"},
        "headroom": described(SIGNED, "usable − peak (negative when it does not fit)"),
        "overflow": {"type": ["string", "null"], "enum": [*TERMS, None]},
    }
)

HOST_FIT = obj(
    {
        "host_memory_bytes": BYTES,
        "per_device": BYTES,
        "devices": POSITIVE,
        "need": BYTES,
        "fits": {"type": "boolean"},
        "headroom": SIGNED,
    }
)

_COMMUNICATION = obj(
    {
        "dimension": NAME,
        "collective": NAME,
        "phase": NAME,
        "bytes": described(BYTES, "bytes one call moves"),
        "count": described(COUNT, "calls per step"),
        "group": POSITIVE,
        "link": NAME,
        "time_s": described(SECONDS, "count × one call's seconds"),
        "overlapped": {"type": "boolean"},
        "overlaps": NAME,
        "what": {"type": "string"},
    }
)

_PREDICTED = obj(
    {
        "stage": COUNT,
        "stage_layers": COUNT,
        "matmul_s": SECONDS,
        "matmul_wave_efficiency": FRACTION,
        "matmul_fraction": described(
            FRACTION, "the best shape's fraction of the dense 16-bit peak the GEMMs run at (capped per GPU)"
        ),
        "fp8_matmul_fraction": described(
            {"type": ["number", "null"], "minimum": 0, "maximum": 1},
            "--fp8's layers: the best shape's fraction of the FP8 peak; null without --fp8",
        ),
        "attention_s": SECONDS,
        "elementwise_s": SECONDS,
        "compute_s": SECONDS,
        "exposed_s": {"type": "object", "additionalProperties": SECONDS},
        "bubble_s": SECONDS,
        "optimizer_s": SECONDS,
        "step_time_s": SECONDS,
        "mfu": FRACTION,
    }
)

TIME = obj(
    {
        "devices": POSITIVE,
        "peak_flops_per_device": described(
            {"type": "number", "exclusiveMinimum": 0},
            "FLOP/s, dense, the precision's 16-bit (or fp32) compute dtype: what mfu and hfu are against, "
            "under --fp8 too",
        ),
        "fp8_peak_flops_per_device": described(
            {"type": ["number", "null"], "exclusiveMinimum": 0},
            "FLOP/s, dense FP8, that --fp8's GEMMs run at (null without --fp8): mfu can pass 1 up to this "
            "over peak_flops_per_device",
        ),
        "global_batch": POSITIVE,
        "tokens_per_step": POSITIVE,
        "model_flops_per_step": FLOPS,
        "hardware_flops_per_step": FLOPS,
        "recompute_flops_per_step": FLOPS,
        "bubble": described(FRACTION, "pipeline bubble / busy time, (p − 1)/(v·m)"),
        "step_time_s": SECONDS,
        "tokens_per_s": {"type": "number", "minimum": 0},
        "mfu": FRACTION,
        "hfu": FRACTION,
        "assumed_mfu": {"type": ["number", "null"], "exclusiveMinimum": 0},
        "basis": {"type": "string", "enum": ["predicted", "assumed", "measured"]},
        "training_tokens": {"type": ["integer", "null"], "minimum": 1},
        "training_days": {"type": ["number", "null"], "minimum": 0},
        "predicted": _PREDICTED,
        "communication": {"type": "array", "items": _COMMUNICATION},
    }
)

TIMELINE = {
    "type": "array",
    "items": obj(
        {"label": NAME, "bytes": BYTES, **{k: BYTES for k in TERMS}},
        # profile --timeline adds the measured curve at each point (null where it has no sample)
        required=["label", "bytes", *TERMS],
    ),
}
