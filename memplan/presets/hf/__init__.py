"""Import a Hugging Face ``config.json`` (already parsed to a dict) as a ``ModelConfig``.

Only the numbers are read; no model code is ever imported or executed (no ``trust_remote_code``).
Defaults for absent keys follow the ``transformers`` config class of each ``model_type``.

One reader per ``model_type`` (``READERS``), registered by its family group's module:
- keys.py — typed reads of a key (a wrong type or a missing count is a one-line error naming the key);
- family.py — ``Family``: the keys every decoder config shares, read with the family's defaults, then
  its own (biases, dropouts, refusals, extra fields, notes); windows.py — Mistral's and Qwen's windows;
- llama.py (Llama, Mistral, Qwen2/3, Phi-3, Granite, GLM-4, OLMo-2), gemma.py (Gemma, Gemma-2/3),
  layernorm.py (GPT-2, GPT-NeoX, StarCoder2, Cohere, StableLM, Falcon), moe.py (Mixtral, Qwen2/3-MoE,
  gpt-oss, PhiMoE), llama4.py (Llama 4), deepseek.py (DeepSeek-V2/V3: MLA, read whole).
A new family: its ``Family`` (or a ``Reader``) in its group's ``FAMILIES``, and nothing else here.

A ``hidden_act`` (``activation_function``, ``hidden_activation``) outside what the family's MLP models is
refused (``Family._check_activation``): a ReLU llama is an error, not silently SiLU.

Known limitations (none changes the parameter count; each group's module lists its own):
- NB: ``rope_scaling`` (Llama 3.1, YaRN, …) is not modelled (values only); PhiMoE's is read into
  ``ModelConfig.rope_scaling`` and named in the estimate's notes, the other families' only in the preset's
  notes. The sliding window is read for Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE, Phi-3, PhiMoE,
  StarCoder2 and Gemma-2/3.
- NB: a multimodal config (Gemma-3, Llama 4) is read as its ``text_config``: the vision tower is not
  counted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from memplan.config import ModelConfig
from memplan.errors import one_line_validation_error
from memplan.presets.hf import deepseek, gemma, layernorm, llama, llama4, moe
from memplan.presets.hf.family import Family, Reader

FAMILIES: dict[str, Family] = {
    **llama.FAMILIES,
    **gemma.FAMILIES,
    **layernorm.FAMILIES,
    **moe.FAMILIES,
    **llama4.FAMILIES,
}
READERS: dict[str, Reader] = {**FAMILIES, **deepseek.READERS}
"""Every supported ``model_type``'s reader."""
SUPPORTED_MODEL_TYPES = tuple(sorted(READERS))
MOE_MODEL_TYPES = tuple(kind for kind, family in FAMILIES.items() if family.moe is not None)
"""The families read through ``Family.moe`` (Llama 4 and DeepSeek read their experts themselves)."""


def model_type_of(cfg: Mapping[str, Any]) -> str:
    """The config's ``model_type``, checked against the supported families."""
    kind = cfg.get("model_type")
    supported = ", ".join(SUPPORTED_MODEL_TYPES)
    if kind is None:
        raise ValueError(f"model_type: missing; add one of {supported}")
    if not isinstance(kind, str) or kind not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type: {kind!r} is not supported; supported: {supported} "
            "(write a preset .toml for other architectures)"
        )
    return str(kind)


def text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """A multimodal Gemma-3 / Llama 4 config (``model_type`` gemma3 / llama4) as its text model's
    (``text_config``, a ``gemma3_text`` / ``llama4_text``); NB: the vision tower's parameters are not
    counted."""
    text = cfg.get("text_config")
    if cfg.get("model_type") in ("gemma3", "llama4") and isinstance(text, Mapping):
        return {**text, "model_type": f"{cfg['model_type']}_text"}
    return cfg


def model_from_hf_config(cfg: Mapping[str, Any], name: str, where: str | None = None) -> ModelConfig:
    """Build a ``ModelConfig`` from a parsed Hugging Face ``config.json``.

    Raises ``ValueError`` (one line, starting with ``where``, default ``hf config <name>``, then the
    config key and the fix) for an unsupported ``model_type``, a missing or mistyped key, or an
    architecture ``ModelConfig`` rejects.
    """
    where = where or f"hf config {name}"
    cfg = text_config(cfg)
    try:
        kind = model_type_of(cfg)
        fields = READERS[kind].fields(kind, cfg, name)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    try:
        return ModelConfig(**fields)
    except ValidationError as exc:
        raise ValueError(one_line_validation_error(exc, f"{where} ({kind})")) from None


def hf_notes(cfg: Mapping[str, Any]) -> str:
    """Where the preset came from and the caveats of the import, for ``ModelPreset.notes``."""
    notes = ["text model only (text_config)"] if text_config(cfg) is not cfg else []
    cfg = text_config(cfg)
    kind = model_type_of(cfg)
    notes.insert(0, f"imported from a Hugging Face config.json (model_type {kind})")
    return "; ".join(notes + READERS[kind].notes(kind, cfg))
