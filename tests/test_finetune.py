"""Fine-tuning's analytic side: full training unchanged, the published bit counts of QLoRA's storage, ZeRO
over the trainable states, the JSON contract and the CLI (the measurement is tests/measure/test_finetune.py,
the real libraries tests/test_finetune_libraries.py)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from typer.testing import CliRunner

from memplan.api import Options, build_setup, setup_of
from memplan.cli.app import app
from memplan.config import (
    DType,
    FineTune,
    Method,
    ModelConfig,
    Optimizer,
    Setup,
    finetune_from,
    parse_freeze,
    parse_targets,
)
from memplan.contract import to_json
from memplan.engine import clear_caches, estimate
from memplan.schema import estimate_schema
from memplan.strategies.lora_states import quantized_bytes


def with_finetune(setup: Setup, **ft: object) -> Setup:
    return Setup.model_validate({**setup.model_dump(), "finetune": FineTune.model_validate(ft).model_dump()})


def test_full_training_is_unchanged() -> None:
    """The default FineTune is full training: the same numbers as a setup that never names it."""
    setup = build_setup("llama-2-7b", seq=1024)
    explicit = setup_of(Options(model="llama-2-7b", seq=1024, finetune="full"))
    clear_caches()
    a, b = estimate(setup), estimate(explicit)
    assert to_json(a) == to_json(b)
    assert a.params_trainable == a.params.total and a.params_frozen == 0


def test_qlora_bits_per_weight_as_published() -> None:
    """Dettmers et al. 2023 §3: 4-bit codes + a fp32 absmax per 64 = 4.5 bits per weight; double
    quantisation brings the constants to 8/64 + 32/(64·256) bits: 4.127 bits (the code books negligible)."""
    n = 4096 * 4096
    assert quantized_bytes(n, False) * 8 / n == pytest.approx(4 + 32 / 64, abs=1e-4)
    assert quantized_bytes(n, True) * 8 / n == pytest.approx(4 + 8 / 64 + 32 / (64 * 256), abs=1e-3)


def test_zero_shards_the_trainable_states_only() -> None:
    """ZeRO-3 over 4 ranks: each holds ⌈P/4⌉ of the trainable parameters' gradients (2 bytes), master
    weights (4) and AdamW states (8), and a quarter of the frozen base."""
    base = build_setup("llama-2-7b", seq=512, zero=3, dp=4)
    lora = with_finetune(base, method=Method.LORA, rank=8, targets=parse_targets("q,v"))
    est = estimate(lora)
    p = 4_194_304  # peft's count for this configuration (tests/test_finetune_libraries.py)
    assert (est.states.gradients, est.states.master_weights, est.states.optimizer_states) == (
        p // 4 * 2,
        p // 4 * 4,
        p // 4 * 8,
    )
    assert est.states.weights == p // 4 * 2 + -(-est.params.total * 2 // 4)


def test_freezing_counts_what_still_trains() -> None:
    setup = with_finetune(
        build_setup("llama-2-7b", seq=512), method=Method.FULL, **parse_freeze("embeddings,layers:0-15")
    )
    est = estimate(setup)
    p = est.params
    assert est.params_trainable == p.total - p.embedding - 16 * p.layer.total
    assert est.states.gradients == est.params_trainable * 2
    assert est.states.weights == p.total * 2


def test_json_validates_and_carries_trainable() -> None:
    args = "estimate -m 7b --finetune lora --lora-targets q,k,v,o --freeze layers:0-3 --lora-dropout 0.05"
    out = CliRunner().invoke(app, [*args.split(), "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    jsonschema.validate(data, estimate_schema())
    assert data["setup"]["finetune"] == "lora"
    assert data["finetune"]["targets"] == ["q", "k", "v", "o"]
    assert data["params"]["trainable"] == 28 * 4 * 8 * (4096 + 4096)  # 28 adapted layers, r (in + out)


def test_lora_lowers_backward_flops_and_states() -> None:
    """Frozen matmuls have no dW: LoRA's backward is about half of full training's; its states are tiny."""
    full = estimate(build_setup("llama-2-7b", seq=2048))
    lora = estimate(with_finetune(build_setup("llama-2-7b", seq=2048), method=Method.LORA))
    assert lora.flops.backward < 0.6 * full.flops.backward
    assert lora.states.optimizer < full.states.optimizer / 1000


def test_qlora_65b_fits_one_48gb_gpu() -> None:
    """Dettmers et al. 2023 (QLoRA), abstract: a 65B model fine-tuned on a single 48 GB GPU — NF4 with
    double quantisation, LoRA r = 64 on every linear, paged 8-bit AdamW, gradient checkpointing. LLaMA-65B's
    shapes (Touvron et al. 2023, Table 2: d 8192, 64 heads, 80 layers; ffn 22016, vocab 32000)."""

    llama_65b = ModelConfig(
        name="llama-65b",
        hidden_size=8192,
        num_layers=80,
        num_heads=64,
        ffn_size=22016,
        vocab_size=32000,
        max_positions=2048,
    )
    setup = build_setup(
        llama_65b,
        seq=512,
        optimizer=Optimizer.ADAMW_8BIT,
        checkpointing="full",
        finetune=finetune_from(
            Method.QLORA, {"lora_rank": 64, "lora_targets": "all-linear"}, True, DType.BF16
        ),
    )
    est = estimate(setup)
    assert 65.0e9 < est.params.total < 65.5e9  # LLaMA-65B: 65.2B
    gpu_bytes = 48 * 10**9  # "48 GB"
    assert est.peak.bytes < gpu_bytes
    assert estimate(setup.model_copy(update={"finetune": FineTune()})).states.total > 10 * gpu_bytes


def test_gpt2_lora_with_checkpointing_on_cuda_keeps_the_fused_buffer() -> None:
    """GPT-2's q, k, v are views of c_attn's output; on CUDA's flash kernel the core keeps them as views,
    so the projection's saves are its input and the buffer alone. LoRA's flow picked them by position as
    if q, k and v were three tensors: ``estimate --impl hf --finetune lora`` with checkpointing full or
    every-K ended in an AssertionError traceback. Every part of the layer needs a gradient here, so the
    core's saves are full training's."""
    from memplan.api import build_setup
    from memplan.blocks.attention.core import projection_rules
    from memplan.blocks.inventory import Dims
    from memplan.config import Checkpointing, Device, FineTune, Impl, ImplConfig, Method
    from memplan.config.finetune import parse_targets
    from memplan.engine import estimate
    from memplan.strategies import lora

    impl = ImplConfig(impl=Impl.HF)
    for ckpt in ("full", "every-2"):
        setup = build_setup("gpt2", seq=256, checkpointing=ckpt, device=Device.CUDA, impl=impl)
        ft = FineTune(method=Method.LORA, rank=8, targets=parse_targets("all-linear"), dropout=0.0)
        setup = setup.model_copy(update={"finetune": ft})
        assert estimate(setup).peak.bytes > 0
        none = setup.strategy.model_copy(update={"checkpointing": Checkpointing.NONE, "checkpoint_every": 1})
        plain = setup.model_copy(update={"strategy": none})
        dims = Dims.of(plain)
        kept = {r.name for r in lora.layer_rules(plain, dims, lora.flows(plain)[1])}
        views = {r.name for r in projection_rules(plain, dims)[1:]}  # the input is the adapters' concern
        assert "attn.qkv" in views and views <= kept


@pytest.mark.parametrize("model", ["gpt2", "phi-3-mini", "pythia-160m", "falcon-7b", "gemma-3-4b"])
@pytest.mark.parametrize("checkpointing", ["full", "every-2"])
def test_hf_all_linear_lora_with_checkpointing_estimates(model: str, checkpointing: str) -> None:
    """Fused projections (GPT-2's c_attn, Phi-3's qkv_proj, GPT-NeoX's and Falcon's query_key_value) and a
    model of two layer kinds under transformers' checkpointing and all-linear LoRA, as a user types it: an
    estimate, valid JSON, exit 0 (GPT-2's had ended in a traceback; the hypothesis fuzz never drew it)."""
    from typer.testing import CliRunner

    from memplan.cli.app import app

    args = ["estimate", "-m", model, "--seq", "512", "--impl", "hf", "--finetune", "lora"]
    args += ["--lora-targets", "all-linear", "--checkpointing", checkpointing, "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["memory"]["peak"] > 0
