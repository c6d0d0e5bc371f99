"""memplan vs the real code: run each framework's own model under fake tensors on CPU and set its saved bytes
beside ``memplan estimate --impl …``, per layer and in total, for every family × attention × checkpointing.

    python benchmarks/impl_table.py            # print the Markdown table
    python benchmarks/impl_table.py --write    # and replace README's table between its markers
    python benchmarks/impl_table.py --json     # the figures as JSON

Each case is 2 layers (Gemma-2: 4, two of each layer type) at the model's real widths, seq 512, bf16,
CPU kernels (what ``memplan trace --impl hf`` / ``--impl torchtitan`` runs); the families without a
shipped preset are read from their published config.json as tests/ holds them. "reference" is what
memplan's reference model (``--impl reference``) estimates for the same model, i.e. what memplan said
before the profiles existed ("not modelled": the reference refuses the model's structure).
Ratios are measured / estimated.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
START, END = "<!-- impl:start -->", "<!-- impl:end -->"


@dataclass(frozen=True)
class Case:
    """One family: a shipped preset, or a published config.json (as the tests hold it: ``source`` names
    the dict in tests/), the code whose run is the truth, and the attention kernels that code runs."""

    family: str
    preset: str
    impl: str = "hf"
    source: str | None = None
    attention: tuple[str, ...] = ("flash", "eager")
    fields: tuple[tuple[str, Any], ...] = ()


CASES = (
    Case("Llama-2", "llama-2-7b"),
    Case("Llama-3", "llama-3-8b"),
    Case("Mistral-v0.1", "mistral-7b"),
    Case("Qwen2.5", "qwen2.5-7b"),
    Case("Qwen3", "qwen3-8b"),
    Case("Gemma", "gemma-2b", source="tests.test_hf_config:GEMMA_2B"),
    Case(
        "Gemma-2 (eager)",
        "gemma-2-9b",
        source="tests.hf.test_gemma2:GEMMA2_9B",
        attention=("eager",),
        fields=(("num_layers", 4),),  # two of each layer type: each mask is shared, as at full depth
    ),
    Case("Gemma-3 text", "gemma-3-4b", source="tests.hf.test_gemma3:GEMMA3_4B"),
    Case("Phi-3-mini", "phi-3-mini", source="tests.test_hf_config:PHI3_MINI"),
    Case("GPT-2 (dropout 0.1)", "gpt2"),
    Case("Pythia (GPT-NeoX)", "pythia-160m", source="tests.test_hf_config:PYTHIA_160M"),
    Case("OLMo-2", "olmo-2-7b", source="tests.hf.test_olmo2:OLMO2_7B"),
    Case(
        "Granite-3.0 (attention dropout 0.1)", "granite-3.0-8b", source="tests.hf.test_granite:GRANITE_3_8B"
    ),
    Case("StarCoder2 (dropout 0.1)", "starcoder2-3b", source="tests.hf.test_starcoder2:STARCODER2_3B"),
    Case("Command R (Cohere)", "command-r", source="tests.hf.test_cohere:COMMAND_R"),
    Case("StableLM-2", "stablelm-2-1.6b", source="tests.hf.test_stablelm:STABLELM_2_1_6B"),
    Case("GLM-4", "glm-4-9b", source="tests.hf.test_glm:GLM4_9B"),
    Case("Falcon-7B", "falcon-7b", source="tests.hf.test_falcon:FALCON_7B"),
    Case("Falcon-40B", "falcon-40b", source="tests.hf.test_falcon:FALCON_40B"),
    Case("Mixtral", "mixtral-8x7b"),
    Case("Qwen1.5-MoE", "qwen1.5-moe-a2.7b"),
    Case("DeepSeek-V2-Lite", "deepseek-v2-lite"),
    Case("DeepSeek-V3", "deepseek-v3", fields=(("num_layers", 4),)),  # 3 dense layers, then an MoE one
    Case("torchtitan Llama 3", "llama-3-8b", impl="torchtitan", attention=("flash",)),
)
CHECKPOINTING = ("none", "full")


def model_of(case: Case) -> Any:
    """The case's ModelConfig: its preset, or its config.json read by the importer."""
    import importlib

    from memplan.presets import load_model_preset
    from memplan.presets.hf import model_from_hf_config

    if case.source is None:
        return load_model_preset(case.preset).model
    if str(ROOT) not in sys.path:  # the config.json dicts live in tests/ (run as a script: benchmarks/)
        sys.path.insert(0, str(ROOT))
    module, name = case.source.split(":")
    return model_from_hf_config(getattr(importlib.import_module(module), name), case.preset)


def run(case: Case, attention: str, checkpointing: str, seq: int = 512) -> dict[str, Any]:
    """One case: the framework's run and memplan's estimate (profile and reference) per layer and in total."""
    from memplan.api import build_setup
    from memplan.config import AttentionChoice, Device, Impl, ImplConfig, ModelConfig
    from memplan.engine import estimate
    from memplan.measure.compare.tensors import estimated_layers
    from memplan.measure.frameworks.dispatch import check_traceable

    m = ModelConfig.model_validate({**model_of(case).model_dump(), "num_layers": 2, **dict(case.fields)})

    def setup(impl: Impl) -> Any:
        kind = AttentionChoice(attention)
        return build_setup(
            m,
            seq=seq,
            attention=kind,
            checkpointing=checkpointing,
            device=Device.CPU,
            impl=ImplConfig(impl=impl),
        )

    profiled = estimate(setup(Impl(case.impl)))
    try:  # the structure memplan's reference model lacks (Gemma-2's post norms, partial rotary) is refused
        reference: Any = estimate(setup(Impl.REFERENCE))
    except ValueError:
        reference = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        profiled_setup = setup(Impl(case.impl))
        meas = check_traceable(profiled_setup)(profiled_setup)
    return {
        "family": case.family,
        "preset": case.preset,
        "impl": case.impl,
        "attention": "sdpa" if attention == "flash" else "eager",
        "checkpointing": checkpointing,
        "measured_layer": meas.layer_bytes(0),
        "estimated_layer": estimated_layers(profiled)[0],
        "reference_layer": estimated_layers(reference)[0] if reference else None,
        "measured_total": meas.activations,
        "estimated_total": profiled.activations,
        "reference_total": reference.activations if reference else None,
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    head = (
        "| family (preset) | attention | HF checkpointing | layer 0: measured B | `--impl hf` ratio | "
        "`--impl reference` ratio | total: measured B | `--impl hf` ratio |\n" + "|---" * 8 + "|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['family']} ({r['preset']}) | {r['attention']} | {r['checkpointing']} | "
            f"{r['measured_layer']:,} | {_ratio(r['measured_layer'], r['estimated_layer'])} | "
            f"{_ratio(r['measured_layer'], r['reference_layer'])} | {r['measured_total']:,} | "
            f"{_ratio(r['measured_total'], r['estimated_total'])} |"
        )
    return "\n".join(lines)


def _ratio(measured: int, estimated: int | None) -> str:
    if estimated is None:
        return "not modelled"
    return "1 (exact)" if measured == estimated else f"{measured / max(estimated, 1):.4f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="replace README's table between its markers")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args(argv)
    rows = [run(c, a, k) for c in CASES for a in c.attention for k in CHECKPOINTING]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    table = markdown(rows)
    print(table)
    if args.write:
        text = README.read_text()
        if START not in text or END not in text:
            print(f"README.md has no {START} … {END} markers", file=sys.stderr)
            return 2
        before, rest = text.split(START, 1)
        after = rest.split(END, 1)[1]
        README.write_text(f"{before}{START}\n{table}\n{END}{after}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
