"""The base of every configuration model: pydantic v2, frozen, unknown fields refused.

``defer_build=True``: pydantic builds a model's validator (its core schema and the Rust
``SchemaValidator``) on first use instead of at class creation. ``memplan estimate`` validates only the
models it needs (``Options``, a ``ModelPreset``, the ``Setup`` and what they nest); ``GpuPreset``,
``PeakTflops`` and the models of other commands are then never built. Validation is the same either way
(pydantic's ``ConfigDict.defer_build``; measured in benchmarks/bench_estimate.py, docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any, Self, TypeVar

from pydantic import BaseModel, ConfigDict

_set = object.__setattr__
M = TypeVar("M", bound=BaseModel)


def unvalidated(cls: type[M], **fields: Any) -> M:
    """``cls(**fields)`` without validation, for hot paths whose every field comes typed (about 2.3× faster
    than pydantic's ``model_construct``, which also fills defaults): ``fields`` must name every field of
    ``cls``, in its order (tests/test_config_replaced.py), and ``cls`` have no private attributes."""
    new = cls.__new__(cls)
    _set(new, "__dict__", fields)
    _set(new, "__pydantic_extra__", None)
    _set(new, "__pydantic_fields_set__", set(fields))
    _set(new, "__pydantic_private__", None)
    return new


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    def replaced(self, **update: Any) -> Self:
        """``model_copy(update=update)`` without pydantic's generic copy (about 1.7× faster; ``fit`` makes
        tens of thousands): a new instance whose fields are this one's with ``update``'s, not validated.
        The same object ``model_copy`` makes — these models have no extra fields (``extra="forbid"``) and
        no private attributes (tests/test_config_replaced.py)."""
        cls = type(self)
        new = cls.__new__(cls)
        _set(new, "__dict__", {**self.__dict__, **update})
        _set(new, "__pydantic_extra__", None)
        _set(new, "__pydantic_fields_set__", self.__pydantic_fields_set__ | update.keys())
        _set(new, "__pydantic_private__", None)
        return new
