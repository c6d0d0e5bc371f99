"""Model and GPU presets, one loader for all of them: the shipped data files, preset files named by path
and Hugging Face ``config.json`` files, validated through the same pydantic models.

A model preset is ``presets/models/<name>.toml`` (top level of the repository, shipped in the wheel as the
data package ``memplan._presets``): ``name``, ``aliases``, ``source`` (where the numbers come from),
``published_params`` (the published count, which ``count_params`` must reproduce), for a mixture of experts
``published_active_params``, ``notes`` and a ``[model]`` table validated by ``ModelConfig`` (dense, or with a
``[model.moe]`` table). A GPU preset is ``presets/gpus/<name>.toml``.

Everything is read lazily: nothing is loaded at import time; the shipped files are parsed once, on first use
(``functools.cache``). Files named by path are re-read on every call and capped at 1 MB.

A Hugging Face Hub id (``org/name`` that names no file) is read from the repository's config.json,
fetched through ``huggingface_hub`` (``presets/hub.py``: its cache, ``HF_HUB_OFFLINE``, ``HF_TOKEN``).

Known limitations: a Hugging Face config.json is imported for the families in
``memplan.presets.hf.SUPPORTED_MODEL_TYPES``; its ``published_params`` is unknown (None).
"""

from __future__ import annotations

import difflib
import functools
import re
import tomllib
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, Self, TypeVar

from pydantic import ConfigDict, Field, ValidationError, model_validator

from memplan.config import Frozen, ModelConfig
from memplan.errors import one_line_validation_error
from memplan.presets._files import looks_like_json, parse_document, read_text
from memplan.presets.hub import hub_config, is_hub_id, snapshot_of
from memplan.presets.topology import Topology

__all__ = [
    "GpuPreset",
    "ModelPreset",
    "PeakTflops",
    "Topology",
    "gpu_names",
    "hf_document",
    "load_gpu",
    "load_model_preset",
    "model_names",
]

_LISTS = "(`memplan presets` lists them)"
_LISTS_OF = {"models": _LISTS, "gpus": "(`memplan gpus` lists them)"}


class _Preset(Frozen):
    model_config = ConfigDict(**Frozen.model_config, allow_inf_nan=False)  # a file's inf / nan is refused
    name: str = Field(min_length=1, description="canonical name, = the file name without .toml")
    aliases: tuple[str, ...] = Field(default=(), description="other names it answers to, case-insensitive")
    source: str = Field(min_length=1, description="where the numbers come from (URL or citation)")
    notes: str = ""


class ModelPreset(_Preset):
    """A published model: its architecture and the parameter count its authors report."""

    published_params: int | None = Field(gt=0, description="published count; None for imported configs")
    published_active_params: int | None = Field(
        default=None, gt=0, description="parameters a token uses (mixture of experts: the top-k experts)"
    )
    model: ModelConfig

    @model_validator(mode="before")
    @classmethod
    def _name_the_model(cls, data: Any) -> Any:
        """``[model].name`` defaults to the preset's name."""
        if isinstance(data, dict) and isinstance(data.get("model"), dict) and "name" not in data["model"]:
            return {**data, "model": {**data["model"], "name": data.get("name")}}
        return data

    @model_validator(mode="after")
    def _same_name(self) -> Self:
        if self.model.name != self.name:
            raise ValueError(
                f"model.name: {self.model.name!r} differs from the preset name {self.name!r}; "
                "make them equal or drop model.name"
            )
        if self.published_active_params is not None and self.model.moe is None:
            raise ValueError(
                "published_active_params: only a mixture of experts has fewer active parameters; "
                "drop it or add a [model.moe] table"
            )
        return self


class PeakTflops(Frozen):
    """Dense peak throughput in TFLOP/s (10¹² FLOP/s) per dtype, without 2:4 sparsity."""

    model_config = ConfigDict(**Frozen.model_config, allow_inf_nan=False)

    fp32: float = Field(gt=0, description="non-tensor-core fp32")
    tf32: float = Field(gt=0)
    bf16: float = Field(gt=0, description="fp32 accumulate")
    fp16: float = Field(gt=0, description="fp32 accumulate")
    fp8: float | None = Field(default=None, gt=0, description="absent where the GPU has no fp8 units")


class Calibration(Frozen):
    """What ``memplan calibrate`` measured on the device (``[calibrated]`` in a GPU file): fractions the
    step-time prediction uses instead of ``time.efficiency``'s published ones."""

    matmul: float = Field(gt=0, le=1, description="best GEMM of the sweep / the dense peak (MATMUL)")
    memory: float = Field(
        gt=0, le=1, description="a device copy's bytes read and written / the HBM bandwidth (MEMORY)"
    )
    attention: float | None = Field(
        default=None, gt=0, le=1, description="SDPA forward and backward / the dense peak (the flash kernel)"
    )
    launch_us: float | None = Field(
        default=None,
        gt=0,
        description="seconds per tiny kernel in a queue, µs (the launch gap of eager kernels)",
    )
    network_intra: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="an all-reduce's bus bandwidth over the node's ranks / intra_node_gbps (NETWORK_INTRA)",
    )
    device: str = Field(default="", description="the device it ran on")
    attention_curve: tuple[tuple[int, float, float], ...] | None = Field(
        default=None,
        description="SDPA's causal pick by length: (s, forward, backward) / the dense peak, the causal "
        "half of the cells counted (the flash kernel's length factor)",
    )
    elementwise: dict[str, tuple[float, float]] | None = Field(
        default=None,
        description="per eager element-wise chain, forward and backward: its counted bytes' rate / the HBM "
        "bandwidth (ELEMENTWISE_STREAM; the GELU backward's count exceeds what it moves, so may pass 1)",
    )


class GpuPreset(_Preset):
    """One accelerator as its vendor's datasheet describes it."""

    memory_bytes: int = Field(gt=0, description="device memory in bytes (the vendor's GB, see the file)")
    peak_tflops: PeakTflops
    hbm_bandwidth_gbps: float = Field(gt=0, description="device memory bandwidth, GB/s (10⁹ bytes/s)")
    interconnect: str = Field(min_length=1, description="GPU-to-GPU link, e.g. 'NVLink 4, 900 GB/s'")
    interconnect_gbps: float = Field(gt=0, description="GPU-to-GPU bandwidth, GB/s, both directions")
    topology: Topology
    """The node and the links, per GPU and direction (``[topology]``; communication and step time)."""
    sms: int | None = Field(
        default=None,
        gt=0,
        description="streaming multiprocessors (AMD: compute units), for the GEMMs' wave quantization "
        "(time/gemm.py); absent: every GEMM shape taken at the best shape's speed",
    )
    host_memory_gib: float | None = Field(
        default=None,
        gt=0,
        description="host (CPU) memory of one node, GiB: the vendor's reference system (a DGX), for offload",
    )
    calibrated: Calibration | None = None
    """Measured fractions (``memplan calibrate``); None: the published ones (``time.efficiency``)."""
    arch: str | None = Field(
        default=None,
        description="the GPU's architecture (ampere, ada, hopper, blackwell, cdna3): which attention "
        "kernels run and at what fraction of peak (time/attention.py); absent: FlashAttention-2's A100 "
        "figure",
    )
    host_link_gbps: float | None = Field(
        default=None,
        gt=0,
        description="the GPU's link to the host (PCIe), GB/s per direction, for offload's transfers "
        "(time/offload.py)",
    )
    host_memory_gbps: float | None = Field(
        default=None,
        gt=0,
        description="host (CPU) memory bandwidth of one node, GB/s, shared by its GPUs: the CPU optimizer "
        "step of optimizer offload (time/offload.py)",
    )
    device_mib: int | None = Field(
        default=None,
        gt=0,
        description="memory the driver reports (nvidia-smi's total, rocm-smi's VRAM total; MiB = 2²⁰ bytes), "
        "with its source in the file: what a process can have; absent: the vendor's figure (memory_bytes)",
    )
    cuda_bytes: int | None = Field(
        default=None,
        gt=0,
        description="the total cudaMemGetInfo reports (bytes), measured on the GPU, with its source in the "
        "file: what a process can allocate at most, where it is below nvidia-smi's total (device_mib)",
    )
    matmul_best: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="the best 16-bit matmul measured on this GPU / its dense bf16 peak (a published sweep of "
        "shapes, cited in the file): the most any of its GEMMs reaches; the step caps MATMUL at it "
        "(time/efficiency.py); absent: MATMUL uncapped",
    )
    compute_capability: str | None = Field(
        default=None,
        pattern=r"^\d+\.\d+$",
        description="CUDA compute capability, e.g. '9.0' (NVIDIA's CUDA GPUs list); torch's cuBLAS workspace "
        "size depends on it (memplan/reserved.py); absent on non-NVIDIA GPUs",
    )

    @property
    def device_bytes(self) -> int:
        """What the driver hands out: CUDA's measured total (cudaMemGetInfo) when the preset states it, else
        nvidia-smi's total, else the vendor's figure."""
        if self.cuda_bytes is not None:
            return self.cuda_bytes
        return self.device_mib * 2**20 if self.device_mib is not None else self.memory_bytes

    @property
    def fp8_any_layout(self) -> bool:
        """Whether its float8 GEMMs take operands in any layout: Transformer Engine's
        ``is_non_tn_fp8_gemm_supported`` (transformer_engine/pytorch/utils.py), compute capability 10.x or
        13.0 and above (datacenter Blackwell); Hopper's take TN only. False where not stated."""
        if self.compute_capability is None:
            return False
        major = int(self.compute_capability.split(".")[0])
        return 10 <= major < 12 or major >= 13


P = TypeVar("P", bound=_Preset)


# ----------------------------------------------------------------------------------------------------
# Shipped presets
# ----------------------------------------------------------------------------------------------------
def _folder(kind: str) -> Traversable:
    """``presets/<kind>``: the data package ``memplan._presets`` (pyproject maps it to presets/)."""
    return resources.files("memplan._presets") / kind


@functools.cache
def _names(kind: str) -> tuple[str, ...]:
    return tuple(
        sorted(f.name.removesuffix(".toml") for f in _folder(kind).iterdir() if f.name.endswith(".toml"))
    )


def _load_shipped(cls: type[P], kind: str, name: str) -> P:
    where = f"{kind} preset {name}.toml"
    doc = parse_document((_folder(kind) / f"{name}.toml").read_text(encoding="utf-8"), where, as_json=False)
    preset = _validate(cls, doc, where)
    if preset.name != name:
        raise ValueError(f"{where}: name: {preset.name!r} differs from the file name; rename one of them")
    return preset


@functools.cache
def _shipped_model(name: str) -> ModelPreset:
    return _load_shipped(ModelPreset, "models", name)


@functools.cache
def _shipped_gpu(name: str) -> GpuPreset:
    return _load_shipped(GpuPreset, "gpus", name)


_TABLE_HEADER = re.compile(r"^\[", re.MULTILINE)


def _aliases(kind: str, name: str) -> tuple[str, ...]:
    """A shipped preset's ``aliases``, read without validating the whole preset: a name lookup then
    parses and validates only the preset it names (start-up). TOML puts every top-level key before the
    first table header (``[model]``), so only the text above the first line starting with ``[`` is
    parsed; anything unexpected there (a multi-line array, aliases that are not strings) falls back to
    loading the whole preset, which reports it."""
    text = (_folder(kind) / f"{name}.toml").read_text(encoding="utf-8")
    head = _TABLE_HEADER.split(text, maxsplit=1)[0]
    try:
        aliases = tomllib.loads(head).get("aliases", ())
    except tomllib.TOMLDecodeError:
        aliases = None
    if isinstance(aliases, list | tuple) and all(isinstance(a, str) for a in aliases):
        return tuple(aliases)
    return (_shipped_model if kind == "models" else _shipped_gpu)(name).aliases


@functools.cache
def _index(kind: str) -> dict[str, str]:
    """Lower-cased name or alias → canonical name."""
    index: dict[str, str] = {}
    for name in _names(kind):
        for key in (name, *_aliases(kind, name)):
            other = index.setdefault(key.lower(), name)
            if other != name:
                raise ValueError(f"{kind} preset {name}.toml: aliases: {key!r} is taken by {other}; drop it")
    return index


def _validate(cls: type[P], doc: dict[str, Any], where: str) -> P:
    try:
        return cls.model_validate(doc)
    except ValidationError as exc:
        raise ValueError(one_line_validation_error(exc, where)) from None


# ----------------------------------------------------------------------------------------------------
# Lookup
# ----------------------------------------------------------------------------------------------------
def _looks_like_path(text: str) -> bool:
    return text.lower().endswith((".toml", ".json")) or "/" in text or "\\" in text or Path(text).exists()


def _unknown(what: str, kind: str, query: str) -> ValueError:
    index = _index(kind)
    close = difflib.get_close_matches(query.lower(), list(index), n=6, cutoff=0.5)
    names = list(dict.fromkeys(index[c] for c in close))[:4]  # aliases → canonical, deduplicated
    if names:
        return ValueError(
            f"{what}: unknown preset {query!r}; did you mean {', '.join(names)}? {_LISTS_OF[kind]}"
        )
    files = "a preset .toml or a config.json" if kind == "models" else "a preset .toml"
    return ValueError(
        f"{what}: unknown preset {query!r}; choose one of {', '.join(_names(kind))}, "
        f"or pass the path of {files} {_LISTS_OF[kind]}"
    )


def _resolve(what: str, kind: str, name_or_path: str) -> str | Path:
    """The canonical preset name, or the path of a file to read."""
    query = name_or_path.strip()
    if not query:
        raise ValueError(f"{what}: empty name; pass a preset name or a file path {_LISTS_OF[kind]}")
    name = _index(kind).get(query.lower())
    if name is not None:
        return name
    if _looks_like_path(query):
        return Path(query).expanduser()
    raise _unknown(what, kind, query)


def model_names() -> list[str]:
    """Canonical names of the shipped model presets, sorted."""
    return list(_names("models"))


def gpu_text(name_or_path: str) -> str:
    """The TOML text of a shipped GPU preset (by name or alias) or of a GPU .toml file."""
    target = _resolve("gpu", "gpus", name_or_path)
    if isinstance(target, str):
        return (_folder("gpus") / f"{target}.toml").read_text(encoding="utf-8")
    return read_text(target, f"gpu file {target}")


def gpu_names() -> list[str]:
    """Canonical names of the shipped GPU presets, sorted."""
    return list(_names("gpus"))


def load_model_preset(name_or_path: str) -> ModelPreset:
    """A shipped preset by name or alias (case-insensitive), or a file: a preset .toml (or the same as JSON)
    or a Hugging Face config.json (recognised by its ``model_type`` key). Raises a one-line ``ValueError``."""
    target = _resolve("model", "models", name_or_path)
    if isinstance(target, str):
        return _shipped_model(target)
    if is_hub_id(name_or_path):
        return _from_hub(name_or_path.strip())
    where = f"model file {target}"
    text = read_text(target, where)
    doc = parse_document(text, where, looks_like_json(target, text))
    if "model_type" in doc or _HF_KEYS & doc.keys():  # a config.json: its model_type is checked there
        return _from_hf(doc, target, where)
    return _validate(ModelPreset, doc, where)


def hf_document(name_or_path: str) -> dict[str, Any] | None:
    """The Hugging Face config.json ``--model`` names, parsed, every key as the file has it (a file, or a Hub
    id's cached config.json); None for a shipped preset or a preset file. ``trace --impl hf`` builds
    transformers' model from it, so a key memplan does not read still reaches transformers."""
    target = _resolve("model", "models", name_or_path)
    if isinstance(target, str):
        return None
    if is_hub_id(name_or_path):
        target, where = hub_config(name_or_path.strip()), f"model {name_or_path.strip()} (config.json)"
    else:
        where = f"model file {target}"
    text = read_text(target, where)
    doc = parse_document(text, where, looks_like_json(target, text))
    return doc if "model_type" in doc or _HF_KEYS & doc.keys() else None


def _from_hub(repo_id: str) -> ModelPreset:
    """A Hub id's config.json (``presets/hub.py``: only that file is fetched), named by the id."""
    path = hub_config(repo_id)
    where = f"model {repo_id} (config.json)"
    text = read_text(path, where)
    doc = parse_document(text, where, as_json=True)
    snapshot = snapshot_of(path)
    source = f"https://huggingface.co/{repo_id}" + (f" (config.json at {snapshot})" if snapshot else "")
    return _from_hf(doc, path, where, name=repo_id, source=source)


_HF_KEYS = frozenset({"architectures", "num_attention_heads", "num_hidden_layers", "hidden_size"})
"""Top-level keys of a Hugging Face config.json (a preset file has them under ``[model]``, if at all)."""


def _hf_name(path: Path) -> str:
    """``<repo>/config.json`` → repo; the hub cache's ``models--org--repo/snapshots/<sha>/config.json``
    → repo; any other ``<name>.json`` → name."""
    if path.stem != "config":
        return path.stem
    folder = path.resolve().parent
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        return folder.parent.parent.name.split("--")[-1]
    return folder.name or path.stem


def _from_hf(
    cfg: dict[str, Any], path: Path, where: str, name: str | None = None, source: str | None = None
) -> ModelPreset:
    """A preset for an imported config.json (``published_params`` unknown)."""
    from memplan.presets.hf import hf_notes, model_from_hf_config  # here: only config.json needs it

    name = name or _hf_name(path)
    model = model_from_hf_config(cfg, name, where)  # checks model_type before hf_notes reads it
    return ModelPreset(
        name=name, source=source or str(path), published_params=None, notes=hf_notes(cfg), model=model
    )


def load_gpu(name_or_path: str) -> GpuPreset:
    """A shipped GPU preset by name or alias (case-insensitive), or a GPU preset .toml/.json file."""
    target = _resolve("gpu", "gpus", name_or_path)
    if isinstance(target, str):
        return _shipped_gpu(target)
    where = f"gpu file {target}"
    text = read_text(target, where)
    return _validate(GpuPreset, parse_document(text, where, looks_like_json(target, text)), where)
