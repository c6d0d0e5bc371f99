"""Reading user-supplied preset files safely: size-capped, UTF-8, TOML or JSON, one-line errors."""

from __future__ import annotations

import json
import stat
import tomllib
from pathlib import Path
from typing import Any

MAX_FILE_BYTES = 1_000_000
"""A config is a few kB; anything over 1 MB (10⁶ bytes) is a wrong file (weights, a log), not read."""


def _one_line(text: str) -> str:
    return " ".join(text.split())


def read_text(path: Path, where: str) -> str:
    """The UTF-8 text of a regular file of at most ``MAX_FILE_BYTES``; ``ValueError`` otherwise.

    ``where`` starts every message (e.g. ``model file ./x.toml``).
    """
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ValueError(
            f"{where}: no such file; check the path, or pass a preset name (`memplan presets` lists them)"
        ) from None
    except OSError as exc:
        raise ValueError(
            f"{where}: cannot read it ({exc.strerror}); check the path and permissions"
        ) from None
    if stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{where}: is a directory; pass a preset .toml file or the config.json inside it")
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{where}: is not a regular file; pass a preset .toml or a config.json file")
    if st.st_size > MAX_FILE_BYTES:
        raise ValueError(_too_big(where, st.st_size))
    try:
        with path.open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)  # the file may have grown since stat
    except OSError as exc:
        raise ValueError(f"{where}: cannot read it ({exc.strerror}); check its permissions") from None
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(_too_big(where, len(data)))
    try:
        return data.decode("utf-8-sig")  # a leading BOM (Windows editors) is dropped
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{where}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); save it as UTF-8"
        ) from None


def _too_big(where: str, size: int) -> str:
    return (
        f"{where}: {size} bytes is over the {MAX_FILE_BYTES} byte limit for a config; "
        "pass a preset .toml or a config.json, not weights or logs"
    )


def looks_like_json(path: Path, text: str) -> bool:
    """By extension first (.json / .toml), else by content: a JSON document starts with ``{``."""
    suffix = path.suffix.lower()
    if suffix in (".json", ".toml"):
        return suffix == ".json"
    return text.lstrip().startswith("{")


def parse_document(text: str, where: str, as_json: bool) -> dict[str, Any]:
    """Parse TOML or JSON text into a top-level table; ``ValueError`` with the position on bad syntax."""
    if not as_json:
        try:
            table = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(_one_line(f"{where}: invalid TOML: {exc}; fix the syntax")) from None
        except RecursionError:
            raise ValueError(_too_deep(where, "TOML")) from None
        _checked(table, where, "TOML")
        return table
    try:
        doc = json.loads(text)
    except RecursionError:
        raise ValueError(_too_deep(where, "JSON")) from None
    except json.JSONDecodeError as exc:
        raise ValueError(
            _one_line(
                f"{where}: invalid JSON: {exc.msg} (at line {exc.lineno}, column {exc.colno}); fix the syntax"
            )
        ) from None
    if not isinstance(doc, dict):
        raise ValueError(
            f"{where}: expected a JSON object {{...}} at the top, got a {type(doc).__name__}; "
            "pass a preset or a Hugging Face config.json"
        )
    _checked(doc, where, "JSON")
    return doc


def _checked(doc: Any, where: str, kind: str) -> None:
    try:
        check_numbers(doc, where)
    except RecursionError:  # parsed just under the limit, walked just over it
        raise ValueError(_too_deep(where, kind)) from None


def _too_deep(where: str, kind: str) -> str:
    return (
        f"{where}: invalid {kind}: nested deeper than Python's parser allows (about 1,000 levels); "
        "a config is a few levels of tables, check the file"
    )


INT_LIMIT = 2**63
"""Integers a config may hold: TOML's own range (64-bit signed, toml.io "Integer"), which JSON configs
share in practice. Beyond it a value is no size at all, and Python's arbitrary-precision ints would only
fail later, unnamed, where a float is made of them (``OverflowError`` past ~1.8e308, e.g.
``hidden_size: 10**400``)."""


def check_numbers(doc: Any, where: str, path: str = "") -> None:
    """``ValueError`` naming the key of the first integer outside ±2⁶³ (``INT_LIMIT``) in ``doc``."""
    if isinstance(doc, dict):
        for key, value in doc.items():
            check_numbers(value, where, f"{path}.{key}" if path else str(key))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            check_numbers(value, where, f"{path}[{i}]")
    elif isinstance(doc, int) and not isinstance(doc, bool) and not -INT_LIMIT <= doc < INT_LIMIT:
        digits = len(str(abs(doc)))
        raise ValueError(
            f"{where}: {path or '(top)'}: a {digits}-digit number, outside the 64-bit integers a config "
            "holds (|n| < 2**63); check the value"
        )
