"""Shipped model and GPU presets, the loader, and its one-line errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict, ValidationError

from memplan.analytic.params import count_params
from memplan.errors import field_path, one_line_validation_error
from memplan.presets import (
    GpuPreset,
    ModelPreset,
    gpu_names,
    load_gpu,
    load_model_preset,
    model_names,
)

# Published parameter counts, independent of the preset files.
GOLDEN = {
    # Hugging Face safetensors counts on the model pages (Llama 2 paper: 7B/13B/70B).
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,  # exact count from the official config.json shapes
    "llama-2-70b": 68_976_648_192,  # exact count from the official config.json shapes
    "llama-3-8b": 8_030_261_248,  # huggingface.co/meta-llama/Meta-Llama-3-8B: 8.03B
    "llama-3-70b": 70_553_706_496,  # huggingface.co/meta-llama/Meta-Llama-3-70B: 70.6B
    "llama-3.1-405b": 405_853_388_800,  # huggingface.co/meta-llama/Llama-3.1-405B: 406B
    "llama-65b": 65_285_660_672,  # LLaMA paper 65.2B; exact count from the converted config.json shapes
    "mistral-7b": 7_241_732_096,  # huggingface.co/mistralai/Mistral-7B-v0.1: 7.24B
    "qwen2.5-7b": 7_615_616_512,  # huggingface.co/Qwen/Qwen2.5-7B: 7.62B
    "qwen2.5-72b": 72_706_203_648,
    # computed from huggingface.co/Qwen/Qwen3-8B config.json shapes (page: 8.19B)
    "qwen3-8b": 8_190_735_360,  # Qwen2.5-72B model card: 72.7B (exact from config.json)
    # transformers GPT2LMHeadModel: sum(p.numel() for p in model.parameters()), tied head counted once.
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
    # Brown et al. 2020 Table 2.1 (175.0B): d_model 12288, 96 layers, n_ctx 2048, vocab 50257, tied.
    "gpt3-175b": 174_604_259_328,
    "tiny": 106_816,  # test fixture: 2·256·64 + 2·36,992 + 64
    # Mixtures of experts, every expert counted (safetensors counts on the Hugging Face pages).
    "mixtral-8x7b": 46_702_792_704,  # huggingface.co/mistralai/Mixtral-8x7B-v0.1: 46.7B
    "qwen1.5-moe-a2.7b": 14_315_784_192,  # huggingface.co/Qwen/Qwen1.5-MoE-A2.7B: 14.3B
    # Current releases: transformers' own count, sum(p.numel() for p in model.parameters()) of
    # AutoModelForCausalLM.from_config(<the published config.json>) on the meta device
    # (scripts/make_presets.py), beside the rounded figure of the model page.
    "llama-3.1-8b": 8_030_261_248,  # huggingface.co/meta-llama/Llama-3.1-8B: 8.03B
    "llama-3.1-70b": 70_553_706_496,  # huggingface.co/meta-llama/Llama-3.1-70B: 70.6B
    "llama-3.3-70b": 70_553_706_496,  # huggingface.co/meta-llama/Llama-3.3-70B-Instruct: 70.6B
    "llama-3.2-1b": 1_235_814_400,  # huggingface.co/meta-llama/Llama-3.2-1B: 1.24B (tied)
    "llama-3.2-3b": 3_212_749_824,  # huggingface.co/meta-llama/Llama-3.2-3B: 3.21B (tied)
    "qwen3-0.6b": 596_049_920,  # huggingface.co/Qwen/Qwen3-0.6B: 0.6B (tied)
    "qwen3-1.7b": 1_720_574_976,  # huggingface.co/Qwen/Qwen3-1.7B: 1.7B (tied)
    "qwen3-4b": 4_022_468_096,  # huggingface.co/Qwen/Qwen3-4B: 4.0B (tied)
    "qwen3-14b": 14_768_307_200,  # huggingface.co/Qwen/Qwen3-14B: 14.8B
    "qwen3-32b": 32_762_123_264,  # huggingface.co/Qwen/Qwen3-32B: 32.8B
    "gemma-2b": 2_506_172_416,  # huggingface.co/google/gemma-2b: 2.51B
    "gemma-7b": 8_537_680_896,  # huggingface.co/google/gemma-7b: 8.54B
    "gemma-2-2b": 2_614_341_888,  # huggingface.co/google/gemma-2-2b: 2.61B
    "gemma-2-9b": 9_241_705_984,  # huggingface.co/google/gemma-2-9b: 9.24B
    "gemma-2-27b": 27_227_128_320,  # huggingface.co/google/gemma-2-27b: 27.2B
    "gemma-3-1b": 999_885_952,  # huggingface.co/google/gemma-3-1b-pt: 1B (text only)
    # gemma-3-4b-pt's text_config (Gemma3ForCausalLM); the page's 4.3B adds the SigLIP vision tower.
    "gemma-3-4b": 3_880_263_168,
    "phi-3-mini": 3_821_079_552,  # huggingface.co/microsoft/Phi-3-mini-4k-instruct: 3.82B
    "phi-3.5-mini": 3_821_079_552,  # huggingface.co/microsoft/Phi-3.5-mini-instruct: 3.82B
    "phi-3-medium": 13_960_238_080,  # huggingface.co/microsoft/Phi-3-medium-4k-instruct: 14B
    "phi-4": 14_659_507_200,  # huggingface.co/microsoft/phi-4: 14.7B
    "pythia-160m": 162_322_944,  # huggingface.co/EleutherAI/pythia-160m: 162M
    "mixtral-8x22b": 140_630_071_296,  # huggingface.co/mistralai/Mixtral-8x22B-v0.1: 141B
    "qwen3-30b-a3b": 30_532_122_624,  # huggingface.co/Qwen/Qwen3-30B-A3B: 30.5B (by hand: test_qwen3_moe)
    "qwen3-235b-a22b": 235_093_634_560,  # huggingface.co/Qwen/Qwen3-235B-A22B: 235B
    "gpt-oss-20b": 20_914_757_184,  # huggingface.co/openai/gpt-oss-20b: 21B (by hand: tests/hf/test_gpt_oss)
    "gpt-oss-120b": 116_829_156_672,  # huggingface.co/openai/gpt-oss-120b: 117B
    # DeepSeek: transformers' counts of the published config.json (by hand: tests/hf/test_deepseek.py)
    "deepseek-v3": 671_026_404_352,  # huggingface.co/deepseek-ai/DeepSeek-V3: 671B (the MTP module apart)
    "deepseek-v2": 235_741_434_880,  # huggingface.co/deepseek-ai/DeepSeek-V2: 236B
    "deepseek-v2-lite": 15_706_484_224,  # huggingface.co/deepseek-ai/DeepSeek-V2-Lite: 15.7B
    # transformers' own counts on the published config.json (scripts/make_presets.py --count), each also
    # derived by hand in its tests/hf/test_<family>.py
    "olmo-2-7b": 7_298_617_344,  # allenai/OLMo-2-1124-7B: 7.3B
    "granite-3.0-8b": 8_170_848_256,  # ibm-granite/granite-3.0-8b-base: 8.17B
    "starcoder2-3b": 3_030_371_328,  # bigcode/starcoder2-3b: 3.03B
    "command-r": 34_980_831_232,  # CohereForAI/c4ai-command-r-v01: 35B
    "stablelm-2-1.6b": 1_644_515_328,  # stabilityai/stablelm-2-1_6b: 1.64B
    "glm-4-9b": 9_399_951_360,  # THUDM/glm-4-9b-hf: 9.4B
    "falcon-7b": 6_921_720_704,  # tiiuae/falcon-7b: 7B
    "falcon-40b": 41_303_293_952,  # tiiuae/falcon-40b: 40B
    # Llama 4's text models (by hand: tests/hf/test_llama4.py); the pages' 109B / 400B add the vision tower
    "llama-4-scout-17b-16e": 107_769_861_120,  # meta-llama/Llama-4-Scout-17B-16E: 109B
    "llama-4-maverick-17b-128e": 400_711_848_960,  # meta-llama/Llama-4-Maverick-17B-128E: 400B
    "phi-3.5-moe": 41_873_153_344,  # microsoft/Phi-3.5-MoE-instruct: 41.9B (by hand: tests/hf/test_phimoe.py)
}
# Active parameters of the mixtures of experts: the total less the (E − k)/E of the routed experts a token
# skips. Mixtral-8x22B: 56 layers · 6 unused experts · 3 matrices 6144 × 16384 = 101,468,602,368 skipped
# (the announcement's 39B active of 141B).
# Qwen3-30B-A3B: 48 layers · 120 unused of 128 experts · 3 · 2048 · 768 (the page's 3.3B activated);
# Qwen3-235B-A22B: 94 layers · 120 · 3 · 4096 · 1536 (the page's 22B activated).
ACTIVE = {
    "mixtral-8x22b": 140_630_071_296 - 56 * 6 * 3 * 6144 * 16384,
    "qwen3-30b-a3b": 30_532_122_624 - 48 * 120 * 3 * 2048 * 768,
    "qwen3-235b-a22b": 235_093_634_560 - 94 * 120 * 3 * 4096 * 1536,
    # gpt-oss: an expert is gate_up 2880·5760 + 5760 and down 2880·2880 + 2880 (with biases); the cards'
    # 3.6B / 5.1B active leave out the 201,088·2880 input embedding, which memplan's active count keeps.
    "gpt-oss-20b": 20_914_757_184 - 24 * 28 * (2880 * 5760 + 5760 + 2880 * 2880 + 2880),
    "gpt-oss-120b": 116_829_156_672 - 36 * 124 * (2880 * 5760 + 5760 + 2880 * 2880 + 2880),
    # DeepSeek: the MoE layers (all but first_k_dense_replace) skip E − k experts of 3·h·f each. V3: 58
    # layers · 248 · 3·7168·2048 (the card's 37B activated); V2: 59 · 154 · 3·5120·1536 (21B); V2-Lite:
    # 26 · 58 · 3·2048·1408 (the card's 2.4B leaves out the 102,400·2048 input embedding).
    "deepseek-v3": 671_026_404_352 - 58 * 248 * 3 * 7168 * 2048,
    "deepseek-v2": 235_741_434_880 - 59 * 154 * 3 * 5120 * 1536,
    "deepseek-v2-lite": 15_706_484_224 - 26 * 58 * 3 * 2048 * 1408,
    # Llama 4: top-1 of 16 (Scout, 48 MoE layers) or 128 (Maverick, 24 MoE layers) experts of 3·5120·8192;
    # the shared expert always runs (the pages' 17B active).
    "llama-4-scout-17b-16e": 107_769_861_120 - 48 * 15 * 3 * 5120 * 8192,
    "llama-4-maverick-17b-128e": 400_711_848_960 - 24 * 127 * 3 * 5120 * 8192,
    # Phi-3.5-MoE: 32 layers · 14 unused of 16 experts · 3·4096·6400 (the page's 6.6B active)
    "phi-3.5-moe": 41_873_153_344 - 32 * 14 * 3 * 4096 * 6400,
}
README_NAMES = ("gemma-2b", "gemma-2-9b", "gemma-3-4b", "phi-3-mini", "pythia-160m", "llama-3.1-8b")
"""Names README.md's comparison table and the issue use: each one a shipped preset."""
GPUS = {
    "a100-40gb",
    "a100-80gb",
    "h100-sxm",
    "h100-teton",
    "h200",
    "b200",
    "b300",
    "gb200",
    "gb300",
    "mi300x",
    "l40s",
    "rtx-4090",
    "rtx-a6000",
    "h100-pcie",
}

VALID_TOML = """\
name = "mine"
aliases = ["m"]
source = "test"
published_params = 106816
[model]
hidden_size = 64
num_layers = 2
num_heads = 4
num_kv_heads = 2
ffn_size = 128
vocab_size = 256
"""


# ----------------------------------------------------------------------------------------------------
# Shipped presets
# ----------------------------------------------------------------------------------------------------
def test_the_expected_presets_ship() -> None:
    assert set(model_names()) == set(GOLDEN)
    assert set(gpu_names()) == GPUS
    assert model_names() == sorted(model_names())


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_model_preset_count_equals_published(name: str) -> None:
    preset = load_model_preset(name)
    assert isinstance(preset, ModelPreset)
    assert preset.name == preset.model.name == name
    assert preset.published_params == GOLDEN[name]
    assert count_params(preset.model).total == preset.published_params
    # Active parameters: published for mixtures of experts, all of them for dense models.
    assert count_params(preset.model).active == (preset.published_active_params or GOLDEN[name])
    if name in ACTIVE:
        assert preset.published_active_params == ACTIVE[name]
    assert preset.source


@pytest.mark.parametrize("name", README_NAMES)
def test_readme_names_resolve(name: str) -> None:
    assert load_model_preset(name).name == name
    assert f"({name})" in (Path(__file__).parents[1] / "README.md").read_text() or name == "llama-3.1-8b"


def test_every_model_readme_names_resolves() -> None:
    """The presets README's comparison table names (``| family (preset) |``) and its commands' ``-m`` /
    ``--model`` values: each one a shipped preset or alias (``MODEL`` and the header are placeholders)."""
    text = (Path(__file__).parents[1] / "README.md").read_text()
    table = set(re.findall(r"^\| [^|\n]+ \(([a-z0-9][a-z0-9.\-]*)\) \|", text, re.MULTILINE))
    commands = r"memplan [a-z]+ [^`\n]*?(?:-m|--model) ([A-Za-z0-9][A-Za-z0-9.\-]*)(?=[\s`])"
    names = (table | set(re.findall(commands, text))) - {"preset", "MODEL"}
    assert {"gemma-2b", "gemma-2-9b", "gemma-3-4b", "phi-3-mini", "pythia-160m", "70b"} <= names
    for name in names:
        load_model_preset(name)  # raises "unknown preset" otherwise


@pytest.mark.parametrize(
    ("alias", "name"),
    [
        ("7b", "llama-2-7b"),
        ("8b", "llama-3-8b"),
        ("13b", "llama-2-13b"),
        ("70b", "llama-3-70b"),
        ("405b", "llama-3.1-405b"),
        ("175b", "gpt3-175b"),
        ("7B", "llama-2-7b"),
        ("  Llama-3-8B ", "llama-3-8b"),
        ("GPT2", "gpt2"),
    ],
)
def test_aliases_resolve_case_insensitively(alias: str, name: str) -> None:
    assert load_model_preset(alias).name == name


def test_every_alias_resolves_to_its_own_preset() -> None:
    for name in model_names():
        for alias in load_model_preset(name).aliases:
            assert load_model_preset(alias).name == name
    for name in gpu_names():
        for alias in load_gpu(name).aliases:
            assert load_gpu(alias).name == name


def test_architecture_details() -> None:
    gpt2, qwen, gpt3 = (load_model_preset(n).model for n in ("gpt2", "qwen2.5-7b", "gpt3-175b"))
    assert (gpt2.attn_dropout, gpt2.resid_dropout, gpt2.embd_dropout) == (0.1, 0.1, 0.1)
    assert gpt2.qkv_bias and gpt2.out_bias and gpt2.mlp_bias and gpt2.tied_embeddings
    assert gpt2.max_positions == 1024 and gpt3.max_positions == 2048 and gpt3.dim == 128
    assert qwen.qkv_bias and not qwen.out_bias and not qwen.tied_embeddings and qwen.norm_eps == 1e-6
    assert load_model_preset("llama-3-8b").model.rope_theta == 500000.0


@pytest.mark.parametrize("name", sorted(GPUS))
def test_gpu_preset_loads(name: str) -> None:
    gpu = load_gpu(name)
    assert isinstance(gpu, GpuPreset) and gpu.name == name
    assert gpu.memory_bytes % 2**30 == 0  # vendors' GB are binary (see each file's comment)
    peak = gpu.peak_tflops
    assert peak.bf16 == peak.fp16 >= peak.tf32 >= peak.fp32 > 0
    assert gpu.source.startswith("https://")


def test_gpu_figures() -> None:
    h100, a100 = load_gpu("h100"), load_gpu("a100")
    assert a100.name == "a100-80gb" and a100.memory_bytes == 80 * 2**30 and a100.peak_tflops.bf16 == 312
    assert a100.peak_tflops.fp8 is None
    assert h100.name == "h100-sxm" and h100.peak_tflops.bf16 == 989.5 and h100.interconnect_gbps == 900


def test_workstation_and_pcie_presets_by_their_clocks() -> None:
    """The RTX A6000 and the H100 PCIe, the 48 GiB and PCIe cards fine-tuning users name: their dense 16-bit
    peaks are tensor cores × FLOP per clock × boost clock (A6000: 336 × 256 × 1,800 MHz; H100 PCIe: 456 ×
    1,024 × 1,620 MHz, the SXM5's 528 × 1,024 × 1,830 MHz its 989.5); TF32 half of it."""
    a6000, pcie, sxm = load_gpu("a6000"), load_gpu("h100-pcie"), load_gpu("h100")
    assert a6000.name == "rtx-a6000" and a6000.memory_bytes == 48 * 2**30 and a6000.device_mib is None
    assert round(336 * 256 * 1.800e9 / 1e12, 1) == a6000.peak_tflops.bf16 == 2 * a6000.peak_tflops.tf32
    assert a6000.peak_tflops.fp8 is None and a6000.arch == "ampere" and a6000.sms == 84
    assert round(456 * 1024 * 1.620e9 / 1e12) == pcie.peak_tflops.bf16 == 2 * pcie.peak_tflops.tf32
    assert abs(528 * 1024 * 1.830e9 / 1e12 - sxm.peak_tflops.bf16) < 0.1  # 989.4 by the clock
    assert pcie.peak_tflops.fp8 == 3026 / 2  # the datasheet's sparse figure, halved
    assert pcie.device_bytes == sxm.device_bytes and pcie.sms == 114 and pcie.hbm_bandwidth_gbps == 2000


def test_gb200_figures_are_the_racks_over_72_gpus() -> None:
    """GB200 NVL72 (presets/gpus/gb200.toml): NVIDIA's rack figures over its 72 GPUs — 720 PFLOPS of sparse
    FP8 (5,000 dense a GPU, twice BF16's 2,500), 576 TB/s of HBM3e (8,000 GB/s), 13.4 TB (186 GB) —; one
    NVLink domain of 72; the host memory of its 36 Grace CPUs (480 GiB, 512 GB/s each); the driver's
    189,471 MiB; no host link stated, so offload's copies ask for one."""
    gb = load_gpu("gb200-nvl72")
    assert gb.name == "gb200" and load_gpu("gb200") is gb
    assert gb.peak_tflops.fp8 == 720_000 / 72 / 2 == 2 * gb.peak_tflops.bf16
    assert gb.hbm_bandwidth_gbps == 576_000 / 72 and gb.memory_bytes == 186 * 2**30
    assert gb.device_bytes == 189_471 * 2**20
    assert gb.topology.gpus_per_node == 72 and gb.topology.intra_node_gbps == gb.interconnect_gbps / 2
    assert (gb.host_memory_gib, gb.host_memory_gbps) == (36 * 480, 36 * 512)
    assert gb.host_link_gbps is None and gb.fp8_any_layout and gb.arch == "blackwell"


def test_gb300_figures_are_the_racks_over_72_gpus() -> None:
    """GB300 NVL72 (presets/gpus/gb300.toml): the advertised 360 PF of dense FP8 and 576 TB/s over 72 GPUs,
    BF16 at half FP8; 288 GB each (the driver's 284,208 MiB); one 800 Gb/s ConnectX-8 a GPU; sm_103."""
    gb = load_gpu("gb300-nvl72")
    assert gb.name == "gb300" and gb.peak_tflops.fp8 == 360_000 / 72 == 2 * gb.peak_tflops.bf16
    assert gb.hbm_bandwidth_gbps == 576_000 / 72 and gb.memory_bytes == 288 * 2**30
    assert gb.device_bytes == 284_208 * 2**20 and gb.compute_capability == "10.3" and gb.fp8_any_layout
    assert gb.topology.gpus_per_node == 72 and gb.topology.inter_node_gbps == 800 / 8


def test_b300_figures_are_the_hgx_b300s_over_8_gpus() -> None:
    """DGX/HGX B300 (presets/gpus/b300.toml): the HGX table's 72 PF of sparse FP8, 36 of BF16, 18 of TF32 and
    600 TFLOP/s of FP32 over its 8 GPUs, sparse halved (the B200's per-GPU peaks, at 1,100 W: below gb300's
    1,400 W 5,000); 8 TB/s; 288 GB each (the driver's 275,040 MiB, below gb300's); 148 SMs; sm_103; one
    NVSwitch node of 8 with one 800 Gb/s ConnectX-8 a GPU; the DGX B300's 2 TB of host memory; no host link
    or host memory bandwidth stated, so offload asks for them."""
    b = load_gpu("hgx-b300")
    assert b.name == "b300" and load_gpu("dgx-b300") is b is load_gpu("b300-sxm")
    peak = b.peak_tflops
    assert peak.fp8 == 72_000 / 8 / 2 == 2 * peak.bf16 and peak.bf16 == 36_000 / 8 / 2 == peak.fp16
    assert peak.tf32 == 18_000 / 8 / 2 and peak.fp32 == 600 / 8
    assert peak == load_gpu("b200").peak_tflops and peak.fp8 < load_gpu("gb300").peak_tflops.fp8
    assert b.hbm_bandwidth_gbps == 8_000 and b.memory_bytes == 288 * 2**30 == load_gpu("gb300").memory_bytes
    assert b.device_bytes == 275_040 * 2**20 < load_gpu("gb300").device_bytes
    assert b.sms == 148 and b.compute_capability == "10.3" and b.fp8_any_layout and b.arch == "blackwell"
    assert b.topology.gpus_per_node == 8 and b.topology.intra_node_gbps == b.interconnect_gbps / 2 == 900
    assert b.topology.inter_node_gbps == 800 / 8
    assert b.host_memory_gib == 2 * 1024 and b.host_link_gbps is None and b.host_memory_gbps is None


def test_shipped_loads_are_cached() -> None:
    assert load_model_preset("llama-2-7b") is load_model_preset("7b")


def test_import_is_lazy_and_torch_free() -> None:
    code = (
        "import sys, memplan.presets as p; "
        "assert p._names.cache_info().currsize == 0 and p._index.cache_info().currsize == 0; "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ----------------------------------------------------------------------------------------------------
# Files named by path
# ----------------------------------------------------------------------------------------------------
def test_load_preset_toml_by_path(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text(VALID_TOML)
    preset = load_model_preset(str(path))
    assert preset.name == preset.model.name == "mine"
    assert count_params(preset.model).total == preset.published_params


def test_load_preset_by_relative_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "mine.toml").write_text(VALID_TOML)
    monkeypatch.chdir(tmp_path)
    assert load_model_preset("mine.toml").name == "mine"


def test_load_preset_json_and_sniffed_content(tmp_path: Path) -> None:
    model = {"hidden_size": 64, "num_layers": 1, "num_heads": 4, "ffn_size": 128, "vocab_size": 256}
    doc = {"name": "j", "source": "t", "published_params": None, "model": model}
    (tmp_path / "j.json").write_text(json.dumps(doc))
    (tmp_path / "noext").write_text(json.dumps(doc))
    (tmp_path / "tomlnoext").write_text(VALID_TOML)
    assert load_model_preset(str(tmp_path / "j.json")).published_params is None
    assert load_model_preset(str(tmp_path / "noext")).name == "j"
    assert load_model_preset(str(tmp_path / "tomlnoext")).name == "mine"


def test_load_gpu_by_path(tmp_path: Path) -> None:
    text = (Path(__file__).parents[1] / "presets/gpus/h100-sxm.toml").read_text()
    path = tmp_path / "my-gpu.toml"
    path.write_text(text.replace('name = "h100-sxm"', 'name = "my-gpu"'))
    assert load_gpu(str(path)).name == "my-gpu"


def _replace(old: str, new: str) -> str:
    assert old in VALID_TOML
    return VALID_TOML.replace(old, new)


MALFORMED: list[tuple[str, str, bytes, str]] = [
    ("bad toml", "x.toml", b'name = "x"\n[model\n', "invalid TOML"),
    ("bad json", "x.json", b'{"name": ', "invalid JSON"),
    ("json list", "x.json", b"[1, 2]", "expected a JSON object"),
    ("missing field", "x.toml", _replace("published_params = 106816\n", "").encode(), "published_params"),
    ("missing model field", "x.toml", _replace("hidden_size = 64\n", "").encode(), "model.hidden_size"),
    ("unknown field", "x.toml", _replace('source = "test"', 'source = "test"\nsorce = 1').encode(), "sorce"),
    ("unknown model field", "x.toml", _replace("num_layers", "layers").encode(), "model.layers"),
    (
        "wrong type",
        "x.toml",
        _replace("hidden_size = 64", 'hidden_size = "big"').encode(),
        "model.hidden_size",
    ),
    ("wrong list type", "x.toml", _replace('aliases = ["m"]', "aliases = 7").encode(), "aliases"),
    ("negative count", "x.toml", _replace("106816", "-1").encode(), "published_params"),
    ("bad architecture", "x.toml", _replace("num_heads = 4", "num_heads = 5").encode(), "num_heads"),
    (
        "name mismatch",
        "x.toml",
        _replace("hidden_size = 64", 'name = "other"\nhidden_size = 64').encode(),
        "model.name",
    ),
    ("not utf-8", "x.toml", b'name = "\xff\xfe"\n', "UTF-8"),
    ("too big", "x.toml", b"#" * 1_000_001, "1000000 byte limit"),
]


@pytest.mark.parametrize(("case", "filename", "content", "needle"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_file_one_line_error(
    tmp_path: Path, case: str, filename: str, content: bytes, needle: str
) -> None:
    path = tmp_path / filename
    path.write_bytes(content)
    with pytest.raises(ValueError) as info:
        load_model_preset(str(path))
    msg = str(info.value)
    assert "\n" not in msg, case
    assert str(path) in msg and needle in msg, msg


def test_missing_and_unknown_fields_say_the_fix(tmp_path: Path) -> None:
    (tmp_path / "a.toml").write_text(_replace("published_params = 106816\n", ""))
    (tmp_path / "b.toml").write_text(_replace("num_layers", "layers"))
    with pytest.raises(ValueError, match=r"published_params: field required; add it"):
        load_model_preset(str(tmp_path / "a.toml"))
    with pytest.raises(
        ValueError, match=r"model\.layers: unknown field; did you mean num_layers\? \(\+1 more\)"
    ):
        load_model_preset(str(tmp_path / "b.toml"))
    (tmp_path / "c.toml").write_text(_replace('source = "test"', 'source = "test"\nsorce = 1'))
    with pytest.raises(
        ValueError, match=r": sorce: extra inputs are not permitted; remove it or fix its spelling$"
    ):
        load_model_preset(str(tmp_path / "c.toml"))


def test_directory_missing_and_unreadable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="is a directory"):
        load_model_preset(str(tmp_path))
    with pytest.raises(ValueError, match="no such file"):
        load_model_preset(str(tmp_path / "nope.toml"))
    locked = tmp_path / "locked.toml"
    locked.write_text(VALID_TOML)

    def denied(self: Path, *args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "open", denied)  # chmod 000 does not stop root, so fake the refusal
    with pytest.raises(ValueError, match=r"locked\.toml: cannot read it \(Permission denied\)"):
        load_model_preset(str(locked))


def test_malformed_gpu_file(tmp_path: Path) -> None:
    text = (Path(__file__).parents[1] / "presets/gpus/a100-80gb.toml").read_text()
    path = tmp_path / "g.toml"
    path.write_text(text.replace("bf16 = 312\n", ""))
    with pytest.raises(ValueError, match=r"peak_tflops\.bf16: field required") as info:
        load_gpu(str(path))
    assert "\n" not in str(info.value)


# ----------------------------------------------------------------------------------------------------
# Suggestions
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("query", "suggested"),
    [
        ("lama-7b", "llama-2-7b"),
        ("llama3-8", "llama-3-8b"),
        ("qwen-7b", "qwen2.5-7b"),
        ("mistral", "mistral-7b"),
    ],
)
def test_near_miss_model_names_are_suggested(query: str, suggested: str) -> None:
    with pytest.raises(ValueError) as info:
        load_model_preset(query)
    msg = str(info.value)
    assert msg.startswith(f"model: unknown preset '{query}'; did you mean ")
    assert suggested in msg and "`memplan presets`" in msg and "\n" not in msg


def test_far_miss_lists_every_preset() -> None:
    with pytest.raises(ValueError, match="choose one of") as info:
        load_model_preset("zzzzzz")
    assert all(name in str(info.value) for name in model_names())


def test_near_miss_gpu_name() -> None:
    with pytest.raises(ValueError, match=r"gpu: unknown preset 'h10'; did you mean h100-sxm"):
        load_gpu("h10")
    with pytest.raises(ValueError, match="empty name"):
        load_gpu("  ")


# ----------------------------------------------------------------------------------------------------
# memplan.errors
# ----------------------------------------------------------------------------------------------------
class _Inner(BaseModel):
    model_config = ConfigDict(extra="forbid")
    x: int


class _Outer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    inner: list[_Inner]
    y: int


def test_one_line_validation_error() -> None:
    with pytest.raises(ValidationError) as info:
        _Outer.model_validate({"inner": [{"x": "no\nway"}], "y": "z"})
    msg = one_line_validation_error(info.value, "where")
    assert msg == (
        "where: inner[0].x: Input should be a valid integer, unable to parse string as an integer, "
        "got 'no\\nway'; write a whole number (+1 more)"
    )
    with pytest.raises(ValidationError) as info:
        _Outer.model_validate({"inner": [], "y": 1, "w": 1})
    assert one_line_validation_error(info.value, "at") == (
        "at: w: extra inputs are not permitted; remove it or fix its spelling"
    )
    assert field_path(()) == "(top)"


def test_h200_holds_what_cuda_measured_not_nvidia_smis_total() -> None:
    """On an H200 (docs/gpu-profile.md) cudaMemGetInfo's total was 150,109,880,320 B (143,155.94 MiB), 615 MiB
    below nvidia-smi's 143,771: a process can allocate at most CUDA's total."""
    from memplan.presets import load_gpu

    h200 = load_gpu("h200")
    assert (h200.device_mib, h200.cuda_bytes) == (143_771, 150_109_880_320)
    assert (
        h200.device_bytes == 150_109_880_320 and 143_771 * 2**20 - h200.device_bytes == 615 * 2**20 + 65_536
    )
