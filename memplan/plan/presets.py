"""Models for planning: dense presets (``memplan.presets``) plus mixture-of-experts presets and imports.

An MoE preset file is a dense preset file with two more things: ``published_active_params`` and a ``[moe]``
table (``moe.MoEConfig``); its ``[model]`` table describes the attention stack and ONE routed expert
(``ffn_size`` = the expert's width). The dense loader forbids the ``[moe]`` table, and it validates every
file of ``memplan/presets/models/`` to build its alias index, so the shipped MoE presets live apart, in
``memplan/plan/models/``, and are found here first; any other name goes to ``load_model_preset``.

Hugging Face ``config.json`` files of ``model_type`` ``mixtral`` and ``qwen2_moe`` are imported here: the
dense fields through ``memplan.presets.hf`` (as ``mistral`` and ``qwen2``, their dense twins), the MoE
fields from the config's own keys. Nothing else of the file is read or run.

Known limitations (NB): Qwen2-MoE configs with ``decoder_sparse_step`` ≠ 1 or ``mlp_only_layers`` (dense
layers between MoE ones) are refused, not modelled; DeepSeek-MoE's first dense layers likewise.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Mapping
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from memplan.config import ModelConfig
from memplan.plan.moe import MoEConfig
from memplan.presets import ModelPreset, load_model_preset
from memplan.presets import _hf_name as hf_name  # shared with the dense loader (private there)
from memplan.presets import _looks_like_path as looks_like_path
from memplan.presets import _validate as validate_preset
from memplan.presets._files import looks_like_json, parse_document, read_text
from memplan.presets.hf import model_from_hf_config

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe")


class MoEPreset(ModelPreset):
    """A published mixture-of-experts model: ``[model]`` (one expert's width) and ``[moe]``."""

    published_active_params: int = Field(gt=0, description="parameters a token uses (top-k experts)")
    moe: MoEConfig


class PlanModel(BaseModel):
    """What ``--model`` names for planning: a preset and, for a mixture of experts, its MoE fields."""

    model_config = ConfigDict(frozen=True)
    preset: ModelPreset
    moe: MoEConfig | None = None

    @property
    def model(self) -> ModelConfig:
        return self.preset.model

    @property
    def name(self) -> str:
        return self.preset.name

    @model_validator(mode="after")
    def _moe_of_preset(self) -> Self:
        if isinstance(self.preset, MoEPreset) and self.moe is None:
            object.__setattr__(self, "moe", self.preset.moe)
        return self


# ----------------------------------------------------------------------------------------------------
# Shipped MoE presets
# ----------------------------------------------------------------------------------------------------
def _folder() -> Traversable:
    return resources.files(__package__) / "models"


@functools.cache
def moe_names() -> tuple[str, ...]:
    """Canonical names of the shipped MoE presets, sorted (none when the folder was not installed)."""
    folder = _folder()
    if not folder.is_dir():  # NB: pyproject's package-data does not list memplan/plan/models yet
        return ()
    return tuple(sorted(f.name.removesuffix(".toml") for f in folder.iterdir() if f.name.endswith(".toml")))


@functools.cache
def _shipped(name: str) -> MoEPreset:
    where = f"moe preset {name}.toml"
    doc = parse_document((_folder() / f"{name}.toml").read_text(encoding="utf-8"), where, as_json=False)
    preset = validate_preset(MoEPreset, doc, where)
    if preset.name != name:
        raise ValueError(f"{where}: name: {preset.name!r} differs from the file name; rename one of them")
    return preset


@functools.cache
def _index() -> dict[str, str]:
    """Lower-cased name or alias → canonical name, for the shipped MoE presets."""
    index: dict[str, str] = {}
    for name in moe_names():
        for key in (name, *_shipped(name).aliases):
            index[key.lower()] = name
    return index


def is_moe_preset(name: str) -> bool:
    """Whether ``name`` is a shipped MoE preset's name or alias (case-insensitive)."""
    return name.strip().lower() in _index()


# ----------------------------------------------------------------------------------------------------
# Hugging Face MoE configs
# ----------------------------------------------------------------------------------------------------
def _whole(cfg: Mapping[str, Any], key: str, default: int) -> int:
    value = cfg.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key}: expected a whole number, got {value!r}; fix config.json")
    return value


def moe_from_hf_config(cfg: Mapping[str, Any], name: str, where: str) -> tuple[ModelConfig, MoEConfig]:
    """The dense ``ModelConfig`` (ffn_size: one expert's) and the ``MoEConfig`` of a mixtral/qwen2_moe config.

    Defaults for absent keys follow transformers' ``MixtralConfig`` and ``Qwen2MoeConfig``.
    """
    kind = cfg.get("model_type")
    try:
        if kind == "mixtral":
            dense = {**cfg, "model_type": "mistral", "rms_norm_eps": cfg.get("rms_norm_eps", 1e-5)}
            moe = MoEConfig(
                experts=_whole(cfg, "num_local_experts", 8), top_k=_whole(cfg, "num_experts_per_tok", 2)
            )
        elif kind == "qwen2_moe":
            if _whole(cfg, "decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
                raise ValueError(
                    "decoder_sparse_step: dense layers between MoE layers are not modelled; "
                    "use a config with decoder_sparse_step 1 and no mlp_only_layers"
                )
            shared = _whole(cfg, "shared_expert_intermediate_size", 5632)
            dense = {
                **cfg,
                "model_type": "qwen2",
                "intermediate_size": _whole(cfg, "moe_intermediate_size", 1408),
            }
            dense.setdefault("max_position_embeddings", 8192)
            moe = MoEConfig(
                experts=_whole(cfg, "num_experts", 60),
                top_k=_whole(cfg, "num_experts_per_tok", 4),
                shared_experts=1 if shared else 0,
                shared_ffn=shared or None,
                shared_gate=bool(shared),
            )
        else:
            raise ValueError(
                f"model_type: {kind!r} is not a mixture of experts; use one of {', '.join(MOE_MODEL_TYPES)}"
            )
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    return model_from_hf_config(dense, name, where), moe


def _from_hf(cfg: dict[str, Any], path: Path, where: str) -> PlanModel:
    name = hf_name(path)
    model, moe = moe_from_hf_config(cfg, name, where)
    preset = ModelPreset(
        name=name,
        source=str(path),
        published_params=None,
        notes=f"imported from a Hugging Face config.json (model_type {cfg['model_type']}); {moe.label()}",
        model=model,
    )
    return PlanModel(preset=preset, moe=moe)


# ----------------------------------------------------------------------------------------------------
# Lookup
# ----------------------------------------------------------------------------------------------------
def _from_file(path: Path, name_or_path: str) -> PlanModel:
    where = f"model file {path}"
    text = read_text(path, where)
    doc = parse_document(text, where, looks_like_json(path, text))
    if "moe" in doc:
        return PlanModel(preset=validate_preset(MoEPreset, doc, where))
    if doc.get("model_type") in MOE_MODEL_TYPES:
        return _from_hf(doc, path, where)
    return PlanModel(preset=load_model_preset(name_or_path))


def load_plan_model(name_or_path: str) -> PlanModel:
    """A model for planning: a shipped MoE preset by name or alias, a file (MoE preset, mixtral or
    qwen2_moe config.json, or anything ``load_model_preset`` reads), or a dense preset.

    Raises a one-line ``ValueError`` naming the field and the fix.
    """
    query = name_or_path.strip()
    name = _index().get(query.lower())
    if name is not None:
        return PlanModel(preset=_shipped(name))
    if query and looks_like_path(query):
        return _from_file(Path(query).expanduser(), query)
    try:
        return PlanModel(preset=load_model_preset(query))
    except ValueError as exc:
        close = difflib.get_close_matches(query.lower(), list(_index()), n=1, cutoff=0.6)
        if close:
            raise ValueError(
                f"model: unknown preset {query!r}; did you mean {_index()[close[0]]}? "
                f"(mixture-of-experts presets: {', '.join(moe_names())})"
            ) from None
        raise ValueError(f"{exc} (mixture-of-experts presets: {', '.join(moe_names())})") from None
