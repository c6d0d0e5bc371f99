"""Fine-tuning against the real libraries (no downloads): peft's trainable counts on transformers' Llama built
from memplan's presets on the meta device, bitsandbytes' ``Linear4bit`` storage on CPU, and the tensors a
peft-LoRA tiny Llama keeps for its adapters.

Published: Llama-2-7B with r = 8 on q, v trains 4,194,304 parameters; Llama-3-8B with r = 16 on every
linear 41,943,040 (peft's ``print_trainable_parameters`` for those configurations).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from memplan.api import build_setup  # noqa: E402
from memplan.config import Device, FineTune, Method, ModelConfig, Setup, parse_targets  # noqa: E402
from memplan.engine import estimate  # noqa: E402
from memplan.strategies.lora_states import quantized_bytes  # noqa: E402

HF_TARGETS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj"}
HF_TARGETS |= {"up": "up_proj", "down": "down_proj"}


def llama_config(m: ModelConfig) -> Any:
    return transformers.LlamaConfig(
        hidden_size=m.hidden_size,
        intermediate_size=m.ffn,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_key_value_heads=m.kv_heads,
        vocab_size=m.vocab_size,
        tie_word_embeddings=m.tied_embeddings,
        max_position_embeddings=m.max_positions,
    )


def with_lora(setup: Setup, rank: int, targets: str) -> Setup:
    ft = FineTune(method=Method.LORA, rank=rank, targets=parse_targets(targets))
    return Setup.model_validate({**setup.model_dump(), "finetune": ft.model_dump()})


def peft_model(m: ModelConfig, rank: int, targets: str, device: str = "meta", **lora: Any) -> Any:
    modules: Any = "all-linear" if targets == "all-linear" else [HF_TARGETS[t] for t in targets.split(",")]
    with torch.device(device), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(llama_config(m))
        return peft.get_peft_model(model, peft.LoraConfig(r=rank, target_modules=modules, **lora))


@pytest.mark.parametrize(
    ("preset", "rank", "targets", "published"),
    [("llama-2-7b", 8, "q,v", 4_194_304), ("llama-3-8b", 16, "all-linear", 41_943_040)],
)
def test_trainable_parameters_equal_peft(preset: str, rank: int, targets: str, published: int) -> None:
    setup = with_lora(build_setup(preset, seq=128), rank, targets)
    trainable, total = peft_model(setup.model, rank, targets).get_nb_trainable_parameters()
    est = estimate(setup)
    assert trainable == published
    assert est.params_trainable == trainable
    assert est.params_frozen + est.params_trainable == total  # peft's "all params": base + adapters


def storage_bytes(layer: Any) -> int:
    """Bytes of a Linear4bit's weight and every tensor of its QuantState (and the nested one)."""
    w = layer.weight
    qs = w.quant_state
    tensors = [w, qs.absmax, qs.code]
    if qs.offset is not None:
        tensors.append(qs.offset)
    if qs.state2 is not None:
        tensors += [qs.state2.absmax, qs.state2.code]
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("quant", ["nf4", "fp4"])
@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize(("fan_out", "fan_in"), [(1024, 4096), (96, 64), (352, 160)])
def test_4bit_storage_equals_bitsandbytes(quant: str, double_quant: bool, fan_out: int, fan_in: int) -> None:
    bnb = pytest.importorskip("bitsandbytes")
    weight = torch.randn(fan_out, fan_in, dtype=torch.bfloat16)
    layer = bnb.nn.Linear4bit(fan_in, fan_out, bias=False, compute_dtype=torch.bfloat16, quant_type=quant)
    layer.weight = bnb.nn.Params4bit(
        weight, requires_grad=False, quant_type=quant, compress_statistics=double_quant, blocksize=64
    )
    layer = layer.to("cpu")  # quantises on the CPU backend
    assert storage_bytes(layer) == quantized_bytes(fan_out * fan_in, double_quant)


def test_4bit_linear_keeps_nothing_and_runs_a_frozen_linears_backward() -> None:
    """bitsandbytes' MatMul4Bit keeps no tensor for autograd (its packed weight sits on ctx) and its backward
    is a frozen linear's: dX only, dequantise then matmul. Its forward is the fused
    ``bitsandbytes::gemm_4bit`` op, which FlopCounterMode does not see (0); memplan counts it as the
    2·T·in·out matmul it computes."""
    bnb = pytest.importorskip("bitsandbytes")
    from torch.utils.flop_counter import FlopCounterMode

    layer = bnb.nn.Linear4bit(64, 32, bias=False, compute_dtype=torch.float32, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(torch.randn(32, 64), requires_grad=False, quant_type="nf4", blocksize=64)
    layer = layer.to("cpu")
    x = torch.randn(2, 3, 64, requires_grad=True)
    saved: list[Any] = []
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t)
    with FlopCounterMode(display=False) as forward, hooks:
        y = layer(x)
    with FlopCounterMode(display=False) as backward:
        y.sum().backward()
    assert saved == []
    assert forward.get_total_flops() == 0
    assert backward.get_total_flops() == 2 * 6 * 64 * 32  # dX = dY·W: [6, 32]·[32, 64]; no dW


def test_peft_lora_keeps_the_adapters_tensors_of_the_estimate() -> None:
    """A tiny peft-LoRA Llama on CPU keeps, per adapter, A's output [b, s, r] (for dB), exactly as many and
    as large as the estimate's ``*_lora_mid`` tensors."""
    tiny = ModelConfig(
        name="tiny-llama",
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        ffn_size=96,
        vocab_size=128,
        max_positions=64,
    )
    rank, b, s = 5, 2, 16
    setup = with_lora(Setup(model=tiny, device=Device.CPU), rank, "q,v,down")
    setup = Setup.model_validate(
        {**setup.model_dump(), "training": {"micro_batch": b, "seq_len": s, "precision": "fp32"}}
    )
    model = peft_model(tiny, rank, "q,v,down", device="cpu")
    ids = torch.randint(0, tiny.vocab_size, (b, s))
    saved: list[Any] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    # F.linear keeps its 3-d input flattened to [b·s, in]: A's output is a [b·s, r] tensor (its weight's
    # transpose is [in, r], in ≠ b·s here).
    mids = {t.data_ptr(): t for t in saved if tuple(t.shape) in ((b, s, rank), (b * s, rank))}
    est = [k for k in estimate(setup).tensors if k.name.endswith("_lora_mid")]
    assert len(mids) == sum(k.count for k in est) == 3 * tiny.num_layers
    assert sum(t.numel() * t.element_size() for t in mids.values()) == sum(k.total_bytes for k in est)
    assert math.prod(est[0].shape) == b * s * rank


TINY = {"hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "ffn_size": 96}
TINY |= {"vocab_size": 128}
B, S, RANK = 1, 32, 4
WIDTHS: dict[str, dict[str, Any]] = {"gpt2": {"num_kv_heads": 4, "ffn_size": 256}}
WIDTHS["pythia-160m"] = {"num_kv_heads": 4, "ffn_size": 256}  # GPT-NeoX: every head keeps k, v
WIDTHS["falcon-7b"] = {"num_kv_heads": 1, "ffn_size": 256}  # Falcon-7B's multi-query attention


def hf_lora_setup(
    preset: str,
    precision: str,
    targets: str,
    dropout: float,
    attention: str = "flash",
    checkpointing: str = "none",
    vocab: int = 128,
    **fields: Any,
) -> Setup:
    """``--impl hf`` with LoRA (rank 4) on ``preset``'s family at tiny widths, 2 layers, b = 1, s = 32
    (``vocab``: above the preset's pad token id, which transformers' embedding refuses beyond it; GPT-2's
    heads all keep k and v, its MLP 4·h wide: ``WIDTHS``)."""
    from tests.hf.harness import hf_setup

    widths = {**TINY, **WIDTHS.get(preset, {}), "vocab_size": vocab, **fields}
    setup = hf_setup(preset, layers=2, seq=S, attention=attention, checkpointing=checkpointing, **widths)
    ft = FineTune(method=Method.LORA, rank=RANK, targets=parse_targets(targets), dropout=dropout)
    training = {**setup.training.model_dump(), "precision": precision}
    return Setup.model_validate({**setup.model_dump(), "finetune": ft.model_dump(), "training": training})


def peft_on_transformers(setup: Setup) -> Any:
    """peft's defaults (``get_peft_model``: ``autocast_adapter_dtype=True``) on transformers' own model for
    ``setup``, built in the activation dtype; the adapted causal LM."""
    from memplan.measure.frameworks.hf import build

    modules = [HF_TARGETS[t.value] for t in setup.finetune.targets]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ft = setup.finetune
        lora = peft.LoraConfig(r=ft.rank, lora_alpha=16, target_modules=modules, lora_dropout=ft.dropout)
        return peft.get_peft_model(build(setup), lora).base_model.model


def exact_step(setup: Setup, model: Any) -> tuple[Any, Any]:
    """One step of transformers' ``model`` (peft's adapters on it, or its frozen parameters) on CPU, and
    the estimate of ``setup``: every layer's bytes, the total and the forward and backward FLOPs equal.
    Both returned for further checks."""
    from memplan.measure.compare.tensors import estimated_layers
    from memplan.measure.frameworks.hf import layers_of
    from memplan.measure.frameworks.step import run_step
    from memplan.measure.runs.run import make_batch

    ids, labels = make_batch(setup, "cpu")
    layers = [(layer, "_gradient_checkpointing_func") for layer in layers_of(model)]
    meas = run_step(model, layers, lambda: model(input_ids=ids, labels=labels).loss, False)
    est = estimate(setup)
    assert estimated_layers(est) == [meas.layer_bytes(i) for i in range(2)]
    assert est.activations == meas.activations
    assert (est.flops.forward, est.flops.backward) == (meas.flops["forward"], meas.flops["backward"])
    return meas, est


@pytest.mark.parametrize(
    ("preset", "precision", "targets", "dropout", "attention"),
    [
        ("llama-3-8b", "fp32", "q,v", 0.0, "flash"),
        ("llama-3-8b", "bf16", "all-linear", 0.0, "flash"),
        ("llama-3-8b", "bf16-mixed", "q,v", 0.1, "flash"),
        ("llama-3-8b", "bf16", "q,v", 0.0, "eager"),
        ("qwen3-8b", "fp32", "all-linear", 0.0, "flash"),
        ("qwen3-8b", "bf16", "q,v", 0.0, "flash"),
        ("qwen3-8b", "fp32", "q,v", 0.1, "flash"),
        ("qwen3-8b", "bf16", "all-linear", 0.0, "eager"),
        ("gemma-2-2b", "bf16", "all-linear", 0.0, "eager"),
        ("gemma-3-1b", "bf16", "all-linear", 0.0, "flash"),
        ("granite-3.0-8b", "fp32", "q,v", 0.0, "flash"),
        ("stablelm-2-1.6b", "bf16", "all-linear", 0.0, "flash"),
        ("stablelm-2-1.6b", "bf16-mixed", "q,v", 0.0, "eager"),
        ("stablelm-2-1.6b", "fp32", "all-linear", 0.1, "flash"),
        ("olmo-2-7b", "bf16", "all-linear", 0.0, "flash"),
        ("olmo-2-7b", "fp32", "q,v", 0.1, "eager"),
        ("command-r", "bf16", "all-linear", 0.0, "flash"),
        ("command-r", "fp32", "q,v", 0.1, "eager"),
    ],
)
def test_peft_on_transformers_keeps_the_estimate_under_impl_hf(
    preset: str, precision: str, targets: str, dropout: float, attention: str
) -> None:
    """``--impl hf`` with LoRA: peft's adapters (its defaults) on transformers' own models, run on CPU,
    keep every layer's bytes and the total the estimate gives, and run its FLOPs. In bf16 peft keeps the
    adapters in fp32 and casts their inputs up (``config.trainable.fp32_adapters``); Qwen3's and
    Gemma-3's q/k norms keep x32 and rstd when an adapter sits on q_proj / k_proj; LoRA dropout on CPU
    keeps its noise (``Profile.cpu_dropout_noise``); eager attention in bf16 keeps the fp32 softmax
    output and its bf16 copy apart; Gemma-2/3's post norms and fp32 1 + w, Gemma-2's softcaps; Granite
    (attention dropout 0.1: SDPA's math fallback on CPU) keeps per operand as eager does; StableLM-2's
    LayerNorms, biased q, k, v and partial rotary (its ``torch.cat`` of the rotated and passed dims: a
    head-major flash output, so a frozen o_proj keeps no copy of it); OLMo-2's post norms only (its
    sublayers read the residual) and whole-width q/k norms; Cohere's one Python LayerNorm feeding attention
    and MLP side by side (``Flow.parallel``: the MLP reads the layer's input)."""

    setup = hf_lora_setup(preset, precision, targets, dropout, attention, vocab=VOCAB.get(preset, 128))
    meas, _ = exact_step(setup, peft_on_transformers(setup))
    if precision != "fp32" and dropout == 0:
        # By hand: each adapter's A keeps its own fp32 copy of its input, [b·s, in] · 4 bytes (q and v
        # read the hidden state, in = h = 64): 1·32·64·4 = 8192 bytes, and B keeps A's fp32 output
        # [b·s, r]: 1·32·4·4 = 512 bytes.
        a_inputs = [r for r in meas.records if r.layer == 0 and "q_proj.lora_A" in r.name]
        b_inputs = [r for r in meas.records if r.layer == 0 and "q_proj.lora_B" in r.name]
        assert [(r.dtype, r.bytes) for r in a_inputs] == [("fp32", B * S * 64 * 4)]
        assert [(r.dtype, r.bytes) for r in b_inputs] == [("fp32", B * S * RANK * 4)]


PEFT_FUSED: dict[str, dict[str, Any]] = {
    "phi-3-mini": {"q,k,v": ["qkv_proj"], "all-linear": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]},
    "glm-4-9b": {"all-linear": "all-linear", "q,v": ["q_proj", "v_proj"]},
}
PEFT_FUSED["glm-4-9b"]["q,k,v,o,gate,up"] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj"]
PEFT_FUSED["gpt2"] = {"q,k,v": ["c_attn"], "q,k,v,o,up,down": ["c_attn", "attn.c_proj", "c_fc", "mlp.c_proj"]}
PEFT_FUSED["gpt2"]["all-linear"] = "all-linear"  # every linear a GELU MLP has: no gate
PEFT_FUSED["starcoder2-3b"] = {"q,v": ["q_proj", "v_proj"], "all-linear": "all-linear"}
PEFT_FUSED["pythia-160m"] = PEFT_FUSED["falcon-7b"] = {
    "q,k,v": ["query_key_value"],
    "all-linear": "all-linear",
}
VOCAB = {"phi-3-mini": 32064, "glm-4-9b": 151552, "gpt2": 50257, "starcoder2-3b": 50304}
VOCAB |= {"olmo-2-7b": 100352, "command-r": 256000}
"""Above each preset's pad token id (Phi-3's 32000, GLM-4's 151329, OLMo-2's 100277; GPT-2's own
vocabulary; StarCoder2's bos and eos 50256, Command-R's eos 255001), which transformers' embedding (its
config check) needs."""


@pytest.mark.parametrize(
    ("preset", "precision", "targets", "dropout", "attention"),
    [
        ("phi-3-mini", "bf16", "q,k,v", 0.0, "flash"),
        ("phi-3-mini", "bf16", "all-linear", 0.0, "flash"),
        ("phi-3-mini", "fp32", "all-linear", 0.1, "eager"),
        ("glm-4-9b", "bf16", "all-linear", 0.0, "flash"),
        ("glm-4-9b", "bf16-mixed", "q,v", 0.0, "eager"),
        ("glm-4-9b", "fp32", "q,k,v,o,gate,up", 0.1, "flash"),
        ("gpt2", "fp32", "q,k,v", 0.0, "flash"),
        ("gpt2", "bf16", "q,k,v,o,up,down", 0.0, "eager"),
        ("gpt2", "fp32", "all-linear", 0.0, "eager"),
        ("starcoder2-3b", "bf16", "q,v", 0.0, "flash"),
        ("starcoder2-3b", "fp32", "all-linear", 0.1, "eager"),
        ("pythia-160m", "fp32", "q,k,v", 0.0, "flash"),
        ("pythia-160m", "bf16", "all-linear", 0.1, "eager"),
        ("falcon-7b", "fp32", "q,k,v", 0.0, "flash"),
        ("falcon-7b", "bf16", "all-linear", 0.0, "eager"),
    ],
)
def test_peft_adapts_a_fused_projection_as_one_module_under_impl_hf(
    preset: str, precision: str, targets: str, dropout: float, attention: str
) -> None:
    """transformers' Phi-3 computes q, k, v in one ``qkv_proj`` and gate, up in one ``gate_up_proj`` (GLM-4
    the latter; its per-layer rotary tables kept where q or k needs a gradient): peft adapts each whole — one
    A [r, h] and one B [out, r], one fp32 copy of the input and one [b·s, r] A·x each — where memplan's
    reference model has an adapter per linear (``config.finetune.FUSED_LINEARS``). peft's adapters named as
    its users name them (``qkv_proj``, ``gate_up_proj``, or ``all-linear``) on transformers' own model: every
    layer's bytes, the total, the FLOPs and the trainable count are the estimate's. The flash kernel's output
    is head-major there (Phi-3's fused q, GLM's cat rotary: ``head_major_output``), so a frozen o_proj keeps
    no copy of it."""
    from memplan.measure.frameworks.hf import build

    setup = hf_lora_setup(preset, precision, targets, dropout, attention, vocab=VOCAB.get(preset, 128))
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = peft.LoraConfig(
            r=RANK, lora_alpha=16, target_modules=PEFT_FUSED[preset][targets], lora_dropout=dropout
        )
        peft_model = peft.get_peft_model(build(setup), config)
    model = peft_model.base_model.model
    meas, est = exact_step(setup, model)
    assert est.params_trainable == peft_model.get_nb_trainable_parameters()[0]
    if preset == "phi-3-mini" and precision == "bf16":
        # By hand, layer 0 of the tiny Phi-3 (h 64, 4 heads and 2 kv heads of 16): qkv_proj's one A keeps
        # one fp32 copy of its input [b·s, h] = 1·32·64·4 = 8192 B; its B reads A·x [b·s, r] = 512 B
        a_inputs = [r for r in meas.records if r.layer == 0 and "qkv_proj.lora_A" in r.name]
        b_inputs = [r for r in meas.records if r.layer == 0 and "qkv_proj.lora_B" in r.name]
        assert [(r.dtype, r.bytes) for r in a_inputs] == [("fp32", B * S * 64 * 4)]
        assert [(r.dtype, r.bytes) for r in b_inputs] == [("fp32", B * S * RANK * 4)]


def test_qlora_quantises_a_fused_projection_as_one_linear4bit() -> None:
    """QLoRA under ``--impl hf`` on Phi-3-mini: bitsandbytes quantises each ``nn.Linear`` (its storage by
    shape: ``test_4bit_storage_equals_bitsandbytes``), so qkv_proj [9216, 3072] and gate_up_proj [16384,
    3072] are one ``Linear4bit`` each, with one code book, where the reference model's q, k, v and gate, up
    have one each. By hand, per layer: the modules' 4-bit storage; the rest (embeddings, head, norms) bf16."""
    from memplan.config import Impl, ImplConfig
    from memplan.engine import param_counts
    from memplan.strategies.lora_states import base_weight_bytes

    ft = FineTune(method=Method.QLORA, targets=parse_targets("all-linear"))
    hf = build_setup("phi-3-mini", seq=128, finetune=ft, impl=ImplConfig(impl=Impl.HF))
    ref = build_setup("phi-3-mini", seq=128, finetune=ft)
    h, f, layers = 3072, 8192, 32
    modules = [(9216, h), (h, h), (2 * f, h), (h, f)]  # qkv_proj, o_proj, gate_up_proj, down_proj
    linear = sum(o * i for o, i in modules)
    params = param_counts(hf.model)
    quant = sum(quantized_bytes(o * i, double_quant=False) for o, i in modules)
    assert base_weight_bytes(hf, params) == (params.total - layers * linear) * 2 + layers * quant
    separate = [(h, h), (h, h), (h, h), (h, h), (f, h), (f, h), (h, f)]  # q, k, v, o, gate, up, down
    quant_ref = sum(quantized_bytes(o * i, double_quant=False) for o, i in separate)
    assert base_weight_bytes(hf, params) - base_weight_bytes(ref, params) == layers * (quant - quant_ref) < 0


def test_stablelms_parallel_layer_keeps_the_estimate_under_impl_hf() -> None:
    """StableLM with ``use_parallel_residual`` (StableLM-2-12B's layer: one LayerNorm feeding attention
    and MLP side by side, ``Flow.parallel``), LoRA on every linear: peft on transformers' model keeps every
    layer's bytes, the total and the FLOPs of the estimate."""

    setup = hf_lora_setup(
        "stablelm-2-1.6b", "bf16", "all-linear", 0.0, parallel_residual=True, shared_norm=True
    )
    exact_step(setup, peft_on_transformers(setup))


@pytest.mark.parametrize("frozen", ["embeddings", "embeddings and layer 0"])
def test_freezing_gpt2_under_impl_hf_keeps_the_estimate(frozen: str) -> None:
    """Freezing on transformers' GPT-2 (fp32, tiny widths, its dropouts on CPU keeping their noise): the
    frozen parameters' ``requires_grad`` off on the model itself, one step; every layer's bytes, the total
    and the FLOPs are the estimate's (a frozen layer keeps nothing)."""
    from memplan.measure.frameworks.hf import build
    from tests.hf.harness import hf_setup

    layer0 = frozen.endswith("layer 0")
    setup = hf_setup("gpt2", layers=2, seq=S, **{**TINY, **WIDTHS["gpt2"], "vocab_size": VOCAB["gpt2"]})
    ft = FineTune(method=Method.FULL, freeze_embeddings=True, freeze_layers=(0, 0) if layer0 else None)
    training = {**setup.training.model_dump(), "precision": "fp32"}
    setup = Setup.model_validate({**setup.model_dump(), "finetune": ft.model_dump(), "training": training})
    torch.manual_seed(0)
    model = build(setup)
    frozen_params = [model.transformer.wte.weight, model.transformer.wpe.weight]
    frozen_params += list(model.transformer.h[0].parameters()) if layer0 else []
    for p in frozen_params:
        p.requires_grad_(False)
    meas, _ = exact_step(setup, model)
    assert layer0 is (meas.layer_bytes(0) == 0)


def test_fused_targets_are_adapted_whole() -> None:
    """LoRA on part of a fused projection is what peft cannot make: one line naming the group."""
    said = r"none of them \(the default targets are q,v\): e\.g\. --lora-targets q,k,v or all-linear"
    with pytest.raises(ValueError, match=r"lora-targets: phi-3-mini's q,k,v are one linear .*" + said):
        hf_lora_setup("phi-3-mini", "bf16", "q,v", 0.0)  # memplan's default, peft's for Llama
    with pytest.raises(
        ValueError, match=r"lora-targets: phi-3-mini's gate,up are one linear .* them: e\.g\."
    ):
        hf_lora_setup("phi-3-mini", "bf16", "up,down", 0.0)


def test_gemma3s_full_layer_keeps_its_own_saves_under_lora() -> None:
    """Gemma-3 with a window shorter than the sequence (16 of 32) and every second layer full: under SDPA
    the sliding layer passes a mask and k and v repeated to the query heads, the full layer neither
    (``attention.full_layer_setup``). Under LoRA each layer is now charged its own kind's saves
    (``strategies.lora.layer_bytes``); before, the full layer a sliding one's: 6,144 B over here, 6 MiB a
    full layer at Gemma-3-4B's widths and s 1,024, where ``trace --impl hf --finetune lora`` failed. The
    saves' total and the FLOPs equal peft's step (per layer, the step counts each shared rotary table in
    the first layer that multiplies by it, the estimate in the model's constants)."""
    from memplan.blocks.attention.windows import is_sliding
    from memplan.measure.frameworks.hf import layers_of
    from memplan.measure.frameworks.step import run_step
    from memplan.measure.runs.run import make_batch

    setup = hf_lora_setup("gemma-3-1b", "bf16", "q,v", 0.0, sliding_window=16, sliding_window_pattern=2)
    assert [is_sliding(setup.model, i) for i in range(2)] == [True, False]
    model = peft_on_transformers(setup)
    ids, labels = make_batch(setup, "cpu")
    layers = [(layer, "_gradient_checkpointing_func") for layer in layers_of(model)]
    meas = run_step(model, layers, lambda: model(input_ids=ids, labels=labels).loss, False)
    est = estimate(setup)
    assert est.activations == meas.activations
    assert (est.flops.forward, est.flops.backward) == (meas.flops["forward"], meas.flops["backward"])


def test_qwen3_lora_keeps_the_q_k_norms_saves() -> None:
    """LoRA on q and k of Qwen3 in fp32: q_norm and k_norm (RMSNorm over head_dim on q_proj's and k_proj's
    outputs, frozen weights) keep x32 and rstd. By hand per layer: q [b, s, a, d] = 1·32·4·16·4 = 8192 and
    its rstd [b, s, a, 1] 1·32·4·4 = 512; k [b, s, kv, d] 1·32·2·16·4 = 4096 and rstd 1·32·2·4 = 256."""
    setup = hf_lora_setup("qwen3-8b", "fp32", "q,k", 0.0)
    norms = {k.name: k.total_bytes // k.count for k in estimate(setup).tensors if "_norm." in k.name}
    assert {k: v for k, v in norms.items() if k.startswith("attn.q_norm") or k.startswith("attn.k_norm")} == {
        "attn.q_norm.input": 8192,
        "attn.q_norm.rstd": 512,
        "attn.k_norm.input": 4096,
        "attn.k_norm.rstd": 256,
    }


@pytest.mark.parametrize("precision", ["bf16", "bf16-mixed"])
def test_peft_fp32_adapters_states_under_impl_hf(precision: str) -> None:
    """peft's default keeps bf16 models' adapters in fp32: the weights are the bf16 base plus the fp32
    adapters, the gradients and AdamW's two states fp32 per adapter parameter, no master copy — counted
    on the real peft model after one optimizer step."""
    from memplan.measure.runs.run import make_batch

    setup = hf_lora_setup("llama-3-8b", precision, "q,v", 0.0)
    model = peft_on_transformers(setup)
    ids, labels = make_batch(setup, "cpu")
    model(input_ids=ids, labels=labels).loss.backward()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, foreach=False)
    opt.step()
    states = estimate(setup).device.states
    assert {p.dtype for p in trainable} == {torch.float32}
    assert states.weights == sum(p.numel() * p.element_size() for p in model.parameters())
    assert states.gradients == sum(p.grad.numel() * p.grad.element_size() for p in trainable)
    moments = [opt.state[p][k] for p in trainable for k in ("exp_avg", "exp_avg_sq")]
    assert states.optimizer_states == sum(t.numel() * t.element_size() for t in moments)
    assert states.master_weights == 0


def test_reference_lora_in_bf16_says_its_adapters_are_bf16() -> None:
    """memplan's reference model runs its adapters in the activation dtype; outside ``--impl hf`` a 16-bit
    LoRA estimate says so (peft's default is fp32), and says nothing under --impl hf or in fp32."""
    from memplan.config import Impl
    from memplan.strategies.lora import adapter_note

    hf = hf_lora_setup("llama-3-8b", "bf16", "q,v", 0.0)
    ref = Setup.model_validate({**hf.model_dump(), "impl": {**hf.impl.model_dump(), "impl": Impl.REFERENCE}})
    fp32 = hf_lora_setup("llama-3-8b", "fp32", "q,v", 0.0)
    note = adapter_note(ref)
    assert note is not None and note.startswith("lora: the adapters are counted in bf16")
    assert adapter_note(hf) is None and adapter_note(fp32) is None


def test_peft_adapters_on_the_mlp_say_where_their_backward_is_not_modelled() -> None:
    """peft's fp32 adapters on the MLP's linears make fp32 pieces in their backward (docs/peak-accuracy.md,
    "All-linear LoRA": measured 1-9 [T, h] under where not replayed); ``analytic.moments.lora_mlp`` replays
    them for
    a gated MLP's gate, up and down adapters after an RMSNorm (Phi-3's fused gate_up too), and the estimate
    says so where it does not: a GELU MLP (GPT-2), a subset of the three, a parallel layer (Command R). Not
    for the attention targets (exact), nor in fp32 training, where no cast runs (measured at Llama 3 8B's
    widths, s 256: 8,192 B over)."""
    from memplan.analytic.moments import lora_mlp
    from memplan.strategies.lora import mlp_adapter_note

    llama = hf_lora_setup("llama-3-8b", "bf16", "all-linear", 0.0)
    assert lora_mlp.modelled(llama) and mlp_adapter_note(llama) is None
    assert mlp_adapter_note(hf_lora_setup("llama-3-8b", "bf16", "gate,up,down", 0.0)) is None
    assert mlp_adapter_note(hf_lora_setup("phi-3-mini", "bf16", "all-linear", 0.0)) is None
    for preset, targets in (
        ("gpt2", "all-linear"),
        ("llama-3-8b", "up,down"),
        ("command-r", "all-linear"),
    ):
        note = mlp_adapter_note(hf_lora_setup(preset, "bf16", targets, 0.0))
        assert note is not None and note.startswith("lora: peft's adapters on this MLP"), (preset, targets)
    assert mlp_adapter_note(hf_lora_setup("llama-3-8b", "bf16", "q,k,v,o", 0.0)) is None
    assert mlp_adapter_note(hf_lora_setup("llama-3-8b", "fp32", "all-linear", 0.0)) is None


@pytest.mark.parametrize(
    ("preset", "precision", "targets", "checkpointing"),
    [
        ("llama-3-8b", "bf16", "all-linear", "none"),
        ("qwen3-8b", "bf16-mixed", "q,k,down", "full"),
        ("llama-3-8b", "fp32", "q,v", "every-2"),
        ("gpt2", "fp32", "q,k,v", "full"),
        ("phi-3-mini", "bf16", "all-linear", "full"),
    ],
)
def test_trace_impl_hf_runs_peft_under_fake_tensors(
    preset: str, precision: str, targets: str, checkpointing: str
) -> None:
    """``memplan trace --impl hf --finetune lora`` runs peft's adapters on transformers' model under fake
    tensors (``measure.frameworks.hf.with_peft``): every layer, the total and the FLOPs the estimate
    gives — the adapters fp32 in bf16 (peft's default): layer 0's A of q_proj keeps a fp32 [b·s, h].
    Under transformers' checkpointing the embedding's output requires grad (``enable_input_require_grads``,
    ``strategies.lora.input_grads_hooked``): layer 0 runs its dX; every-K re-runs the checkpointed layers
    only; GPT-2's embedding dropout after the hooked output keeps its noise though the embedding is frozen
    (``strategies.lora.model_rules``); Phi-3's fused projections one adapter each, re-run too."""
    from memplan.measure.compare.tensors import estimated_layers
    from memplan.measure.frameworks.hf import measure_hf

    vocab = VOCAB.get(preset, 128)
    setup = hf_lora_setup(preset, precision, targets, 0.0, checkpointing=checkpointing, vocab=vocab)
    meas = measure_hf(setup)
    est = estimate(setup)
    assert estimated_layers(est) == [meas.layer_bytes(i) for i in range(2)]
    assert est.activations == meas.activations
    assert est.flops.forward == meas.flops["forward"]
    assert (est.flops.backward, est.flops.recompute) == (meas.flops["backward"], meas.flops["recompute"])
    if checkpointing == "none" and preset != "gpt2":  # by hand: 1·32·64 fp32 elements = 8192 bytes
        a = [r for r in meas.records if r.layer == 0 and "q_proj.lora_A" in r.name]
        assert [(r.dtype, r.bytes) for r in a] == [("fp32", B * S * 64 * 4)]
