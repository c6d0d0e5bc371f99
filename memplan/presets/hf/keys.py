"""Typed reads of a parsed ``config.json``'s keys, shared by every family's reader.

Each read returns the value or a default for an absent (or null) key, and refuses a value of the wrong
type in one line naming the key (``ValueError``: the caller prefixes where the config came from).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

Cfg = Mapping[str, Any]
"""A parsed ``config.json`` (or one of its nested objects, e.g. ``rope_parameters``)."""


def first(cfg: Cfg, keys: tuple[str, ...]) -> tuple[str, Any]:
    """The first of ``keys`` present with a non-null value, as (key, value); ('', None) if none is."""
    for key in keys:
        if cfg.get(key) is not None:
            return key, cfg[key]
    return "", None


def integer(cfg: Cfg, *keys: str, default: int | None = None) -> int | None:
    """The first of ``keys`` present, a whole number (a bool is refused), else ``default``."""
    key, value = first(cfg, keys)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key}: expected a whole number, got {value!r}; fix config.json")
    return value


def required(cfg: Cfg, *keys: str) -> int:
    """A whole number the parameter count needs: absent is an error naming the first key."""
    value = integer(cfg, *keys)
    if value is None:
        raise ValueError(f"{keys[0]}: missing; add it to config.json (required for the count)")
    return value


def number(cfg: Cfg, *keys: str, default: float) -> float:
    """The first of ``keys`` present, an int or a float (a bool is refused), else ``default``."""
    key, value = first(cfg, keys)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key}: expected a number, got {value!r}; fix config.json")
    return float(value)


def flag(cfg: Cfg, key: str, default: bool) -> bool:
    """A true / false key, else ``default``."""
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{key}: expected true or false, got {value!r}; fix config.json")
    return value


def nullable(cfg: Cfg, key: str, default: float | None) -> float | None:
    """A number whose explicit null turns the feature off (Gemma-2's softcaps), absent → the default."""
    if cfg.get(key) is None:
        return None if key in cfg else default
    return number(cfg, key, default=0.0)


def nested(cfg: Cfg, key: str) -> Cfg:
    """An object-valued key (``rope_parameters``, ``rope_scaling``); absent, null or empty → {}."""
    value = cfg.get(key) or {}
    if not isinstance(value, Mapping):
        raise ValueError(f"{key}: expected an object, got {value!r}; fix config.json")
    return value


def rope_kind(cfg: Cfg) -> str | None:
    """The ``rope_scaling`` (or transformers 5's ``rope_parameters``) type other than "default", or None."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = (rope.get("rope_type") or rope.get("type")) if isinstance(rope, Mapping) else None
    return None if kind in (None, "default") else str(kind)


def partial_rotary(cfg: Cfg, *keys: str, default: float) -> float:
    """The rotated fraction of each head: ``rope_parameters["partial_rotary_factor"]`` (transformers 5)
    over the config's top-level ``keys`` (GPT-NeoX's ``rotary_pct``, ``partial_rotary_factor``) over
    ``default`` (the config class's)."""
    default = number(cfg, *keys, default=default)
    return number(nested(cfg, "rope_parameters"), "partial_rotary_factor", default=default)
