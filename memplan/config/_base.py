"""The base of every configuration model: pydantic v2, frozen, unknown fields refused.

``defer_build=True``: pydantic builds a model's validator (its core schema and the Rust
``SchemaValidator``) on first use instead of at class creation. ``memplan estimate`` validates only the
models it needs (``Options``, a ``ModelPreset``, the ``Setup`` and what they nest); ``GpuPreset``,
``PeakTflops`` and the models of other commands are then never built. Validation is the same either way
(pydantic's ``ConfigDict.defer_build``; measured in benchmarks/bench_estimate.py, docs/benchmarks.md).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)
