"""The building blocks of memplan's JSON Schemas (draft 2020-12), shared by the estimate's (estimate.py) and
the other commands' (commands.py): an open object, a described copy, and the number types.

Sizes (bytes, FLOPs, counts) are integers ≥ 0, seconds and fractions numbers ≥ 0; only differences are
signed (``SIGNED``). Known limitations: none; these are data.
"""

from __future__ import annotations

from typing import Any

SCHEMA_DRAFT = "https://json-schema.org/draft/2020-12/schema"

COUNT: dict[str, Any] = {"type": "integer", "minimum": 0}
BYTES: dict[str, Any] = {"type": "integer", "minimum": 0, "description": "bytes on one device"}
FLOPS: dict[str, Any] = {"type": "integer", "minimum": 0, "description": "floating-point operations"}
POSITIVE: dict[str, Any] = {"type": "integer", "minimum": 1}
SECONDS: dict[str, Any] = {"type": "number", "minimum": 0, "description": "seconds"}
FRACTION: dict[str, Any] = {"type": "number", "minimum": 0, "description": "a fraction (1 = 100 %)"}
SIGNED: dict[str, Any] = {"type": "integer", "description": "bytes, negative when short"}
NAME: dict[str, Any] = {"type": "string", "minLength": 1}


def obj(properties: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    """An object with these properties, all required unless ``required`` names fewer; more keys allowed."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        **extra,
    }


def described(base: dict[str, Any], description: str) -> dict[str, Any]:
    """``base`` with its description."""
    return {**base, "description": description}
