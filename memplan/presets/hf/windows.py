"""Sliding windows as transformers' Mistral and Qwen configs read them (Mistral, Qwen2, Qwen3, Qwen3-MoE).

Known limitations: Qwen2/Qwen3 configs whose window covers only the layers from ``max_window_layers`` on
import the first ones as ``full_layers`` (llama.py); another ``layer_types`` pattern is refused.
"""

from __future__ import annotations

from typing import Any

from memplan.presets.hf.keys import Cfg, flag, integer

WINDOWED = ("mistral", "qwen2", "qwen3", "qwen3_moe")
"""The model types ``sliding_window`` reads."""


def sliding_window(kind: str, cfg: Cfg, layers: int) -> int | None:
    """The sliding window as transformers reads it: MistralConfig's ``sliding_window`` (default 4096,
    null: full causal); Qwen2Config / Qwen3Config's only with ``use_sliding_window`` (default false), on
    layers i ≥ ``max_window_layers`` (default 28; configuration_qwen2.py ``layer_types``)."""
    if kind == "mistral":
        if "sliding_window" in cfg and cfg["sliding_window"] is None:
            return None  # an explicit null: full causal
        return integer(cfg, "sliding_window", default=4096)
    if not flag(cfg, "use_sliding_window", False):
        return None
    if kind == "qwen3_moe":  # Qwen3MoeConfig: every layer slides (no max_window_layers)
        return integer(cfg, "sliding_window", default=4096)
    first = integer(cfg, "max_window_layers", default=28)
    assert first is not None
    if first >= layers:
        return None  # no layer slides
    return integer(cfg, "sliding_window", default=4096)


def config_window(cfg: Cfg, fields: dict[str, Any]) -> dict[str, Any]:
    """The ``sliding_window`` as given (the config classes' default: none): Phi-3, StarCoder2, Mixtral,
    PhiMoE."""
    return {"sliding_window": integer(cfg, "sliding_window")}
