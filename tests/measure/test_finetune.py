"""Fine-tuning (LoRA, QLoRA, frozen parts): estimate == measurement of the reference model, per tensor, per
layer and per FLOP phase (real CPU tensors, tiny shapes), and the torch behaviour the estimate rests on.

The cases cross the axes the gradient flow depends on: which linears carry adapters (none in frozen
layers), LoRA dropout, eager vs flash attention (eager's bmms keep an operand only for the other's
gradient), RMSNorm vs LayerNorm (one node keeps all) and SwiGLU vs GELU, partial freezing under full
fine-tuning (the first trainable layer's input needs no gradient), tied embeddings, precisions.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from memplan.config import (
    Attention,
    Device,
    FineTune,
    LossKind,
    Method,
    ModelConfig,
    MoEConfig,
    Setup,
    StrategyConfig,
    TrainingConfig,
    parse_checkpointing,
    parse_targets,
)
from memplan.engine import estimate
from memplan.measure.compare.tensors import compare
from memplan.measure.runs.run import measure


def saved_shapes(fn: Any) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        out.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return out


def test_torch_saves_only_what_a_needed_gradient_reads() -> None:
    """The facts strategies/lora.py builds on (autograd guards each save by the gradients it computes)."""
    x = torch.randn(2, 3, 8, requires_grad=True)
    frozen, trained = torch.randn(16, 8), torch.randn(16, 8, requires_grad=True)
    # A frozen linear keeps its weight only (a [8, 16] view of the parameter), never its input.
    assert saved_shapes(lambda: F.linear(x, frozen, torch.randn(16))) == [(8, 16)]
    # A trainable linear on an input without gradient keeps the input (for dW) only.
    assert saved_shapes(lambda: F.linear(x.detach(), trained)) == [(6, 8)]
    # w·n keeps n only when w trains; a @ b keeps a only when b needs a gradient.
    assert saved_shapes(lambda: torch.ones(8) * x) == [(8,)]
    q, k = torch.randn(1, 2, 4, 8, requires_grad=True), torch.randn(1, 2, 8, 4)
    assert saved_shapes(lambda: q @ k) == [(2, 8, 4)]
    # An op with no input needing a gradient keeps nothing (the frozen embedding).
    assert saved_shapes(lambda: F.embedding(torch.tensor([1, 2]), torch.randn(10, 8))) == []


def setup_for(
    attn: str = "flash",
    norm: str = "rmsnorm",
    mlp: str = "swiglu",
    p: float = 0.0,
    precision: str = "fp32",
    tied: bool = False,
    loss: str = "standard",
    moe: MoEConfig | None = None,
    **ft: Any,
) -> Setup:
    gpt = norm == "layernorm"
    model = ModelConfig(
        name="finetune",
        hidden_size=32,
        num_layers=3,
        num_heads=4,
        num_kv_heads=2,
        ffn_size=48,
        vocab_size=64,
        norm=norm,
        mlp=mlp,
        qkv_bias=gpt,
        mlp_bias=gpt,
        position="learned" if gpt else "rope",
        max_positions=64,
        attn_dropout=p if attn == "eager" else 0.0,
        resid_dropout=p,
        embd_dropout=p,
        tied_embeddings=tied,
        moe=moe,
    )
    return Setup(
        model=model,
        training=TrainingConfig(micro_batch=2, seq_len=8, precision=precision),
        strategy=StrategyConfig(attention=Attention[attn.upper()]),
        device=Device.CPU,
        finetune=FineTune(**ft),
        loss=LossKind[loss.upper()],
    )


LORA, FULL, QLORA = Method.LORA, Method.FULL, Method.QLORA
MIXTRAL_LIKE = MoEConfig(experts=4, top_k=2)  # tests/measure/test_moe.py's
QWEN_LIKE = MoEConfig(experts=4, top_k=2, shared_experts=1, shared_ffn=40, shared_gate=True)
SHARED = MoEConfig(experts=3, top_k=1, shared_experts=2)
CASES: list[dict[str, Any]] = [
    {"method": LORA},
    {"method": LORA, "targets": parse_targets("all-linear"), "dropout": 0.1},
    {"method": LORA, "attn": "eager", "targets": parse_targets("k,o")},
    {"method": LORA, "attn": "eager", "targets": parse_targets("q,o,down"), "freeze_layers": (1, 1)},
    {
        "method": LORA,
        "attn": "eager",
        "p": 0.1,
        "targets": parse_targets("q,down"),
        "dropout": 0.1,
        "freeze_layers": (0, 0),
    },
    {"method": LORA, "norm": "layernorm", "mlp": "gelu", "targets": parse_targets("up,v"), "tied": True},
    # all-linear on a GELU MLP: every linear it has (no gate), as peft's all-linear
    {
        "method": LORA,
        "norm": "layernorm",
        "mlp": "gelu",
        "attn": "eager",
        "targets": parse_targets("all-linear"),
    },
    {"method": LORA, "precision": "bf16-mixed", "targets": parse_targets("gate,up"), "rank": 3},
    {"method": QLORA, "targets": parse_targets("all-linear"), "precision": "bf16-mixed"},
    {"method": QLORA, "double_quant": True, "norm": "layernorm", "mlp": "gelu", "attn": "eager", "p": 0.1},
    {"method": FULL, "freeze_embeddings": True, "freeze_layers": (0, 1)},
    {"method": FULL, "freeze_lm_head": True, "freeze_layers": (1, 2), "norm": "layernorm", "mlp": "gelu"},
    {"method": FULL, "attn": "eager", "p": 0.1, "freeze_layers": (2, 2), "tied": True},
    {"method": FULL, "freeze_embeddings": True, "precision": "bf16"},
    # Liger's fused loss under a frozen head: dL/dX alone kept and made in the forward (no [v, h] gradient)
    {"method": LORA, "loss": "fused", "precision": "bf16-mixed"},
    {"method": QLORA, "loss": "fused", "targets": parse_targets("all-linear"), "tied": True},
    {
        "method": LORA,
        "loss": "fused",
        "attn": "eager",
        "p": 0.1,
        "dropout": 0.1,
        "norm": "layernorm",
        "mlp": "gelu",
    },
    {"method": FULL, "loss": "fused", "freeze_lm_head": True, "freeze_layers": (0, 0)},
    {"method": FULL, "loss": "fused", "freeze_embeddings": True},  # the head still trains: dL/dW kept
    # torchtune's chunked loss: a frozen head's chunk matmuls keep no input (b > 1: no copies kept)
    {"method": LORA, "loss": "chunked", "precision": "bf16-mixed"},
    {"method": QLORA, "loss": "chunked", "targets": parse_targets("all-linear"), "tied": True},
    {"method": FULL, "loss": "chunked", "freeze_lm_head": True, "freeze_layers": (0, 0)},
    # a mixture of experts, frozen whole (router, experts, shared experts): no linear input kept, its dX
    {"method": LORA, "moe": MIXTRAL_LIKE},
    {"method": LORA, "moe": QWEN_LIKE, "targets": parse_targets("q,k,v,o"), "precision": "bf16-mixed"},
    {"method": LORA, "moe": SHARED, "attn": "eager", "dropout": 0.1, "loss": "fused"},
    {"method": FULL, "moe": QWEN_LIKE, "freeze_embeddings": True, "freeze_layers": (0, 1)},
    {"method": LORA, "moe": MIXTRAL_LIKE, "norm": "layernorm", "mlp": "gelu", "tied": True},
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_estimate_equals_measurement(case: dict[str, Any]) -> None:
    setup = setup_for(**case)
    c = compare(estimate(setup), measure(setup, fake=False))
    assert [r for r in c.tensors if not r.equal] == []
    assert [r for r in c.flops if not r.equal] == []
    assert c.est_layers == c.meas_layers
    assert c.equal


CHECKPOINTED: list[dict[str, Any]] = [
    {"method": LORA, "targets": parse_targets("all-linear"), "dropout": 0.1},
    {"method": QLORA, "loss": "fused", "precision": "bf16-mixed"},
    # a mixture of experts frozen whole: the re-run stops after its last save (the shared experts' act and
    # up before their W_down without a gate; the gate's product with one; the combine's source without)
    {"method": LORA, "moe": MIXTRAL_LIKE},
    {"method": LORA, "moe": SHARED, "targets": parse_targets("q,k,v,o")},
    {"method": LORA, "moe": QWEN_LIKE, "precision": "bf16-mixed"},
    {"method": LORA, "attn": "eager", "p": 0.1, "targets": parse_targets("q,down")},
    {"method": QLORA, "norm": "layernorm", "mlp": "gelu", "targets": parse_targets("down")},
    {"method": LORA, "attn": "eager", "targets": parse_targets("gate")},
]


@pytest.mark.parametrize("checkpointing", ["full", "every-2"])
@pytest.mark.parametrize("case", CHECKPOINTED, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_checkpointed_lora_equals_measurement(case: dict[str, Any], checkpointing: str) -> None:
    """Segment checkpointing with LoRA on every layer: one input per segment, and the re-run forward with
    the adapters up to each segment's last save (torch's early stop), per FLOP phase."""
    mode, k = parse_checkpointing(checkpointing)
    base = setup_for(**case)
    strategy = base.strategy.model_copy(update={"checkpointing": mode, "checkpoint_every": k})
    setup = Setup.model_validate({**base.model_dump(), "strategy": strategy.model_dump()})
    c = compare(estimate(setup), measure(setup, fake=False))
    assert [r for r in c.tensors if not r.equal] == []
    assert [r for r in c.flops if not r.equal] == []
    assert c.equal and c.flops[2].est_bytes > 0  # something re-runs


def test_frozen_prefix_keeps_nothing_and_runs_no_backward() -> None:
    """Layers before the first trainable parameter keep nothing; frozen linears' backward is dX only."""
    setup = setup_for(method=FULL, freeze_embeddings=True, freeze_layers=(0, 1))
    est, meas = estimate(setup), measure(setup, fake=False)
    assert [meas.layer_bytes(i) for i in range(3)][:2] == [0, 0]
    assert est.flops.backward == meas.flops["backward"]
    full = measure(setup.model_copy(update={"finetune": FineTune()}), fake=False)
    assert meas.flops["backward"] < full.flops["backward"] // 2


def test_lora_at_scale_under_fake_tensors() -> None:
    """Llama-2-7B's shapes (two layers) with LoRA on all linears: the same equality under fake tensors."""
    from memplan.api import build_setup

    base = build_setup("llama-2-7b", seq=256, device=Device.CPU)
    model = base.model.model_copy(update={"num_layers": 2})
    lora = FineTune(method=LORA, rank=16, targets=parse_targets("all-linear"))
    setup = base.model_copy(update={"model": model, "finetune": lora})
    setup = Setup.model_validate(setup.model_dump())
    assert compare(estimate(setup), measure(setup, fake=True)).equal


@pytest.mark.parametrize(("method", "double_quant"), [(QLORA, False), (QLORA, True), (LORA, False)])
def test_weights_equal_the_reference_models_storage(method: Method, double_quant: bool) -> None:
    """The estimate's weights = the reference model's bytes: under QLoRA its 4-bit storage buffers (laid
    out as bitsandbytes' Linear4bit, tests/test_finetune_libraries.py), the other parameters in the compute
    dtype and the adapters; under LoRA the base and the adapters in the weight dtype."""
    from memplan.measure.reference.lora import FourBitWeight
    from memplan.measure.reference.model import Reference

    setup = setup_for(method=method, double_quant=double_quant, precision="bf16-mixed", rank=4)
    model = Reference(setup)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    storage = [m.storage_bytes() for m in model.modules() if isinstance(m, FourBitWeight)]
    assert len(storage) == (7 * setup.model.num_layers if method is QLORA else 0)
    assert estimate(setup).states.weights == params + sum(storage)


OPTIMIZER_CASES: list[dict[str, Any]] = [
    {"method": LORA, "precision": "bf16-mixed"},
    {"method": QLORA, "targets": parse_targets("all-linear"), "precision": "bf16-mixed", "rank": 3},
    {"method": FULL, "freeze_embeddings": True, "freeze_layers": (0, 1), "precision": "bf16-mixed"},
]


@pytest.mark.parametrize("case", OPTIMIZER_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_optimizer_step_over_what_trains_equals_measurement(case: dict[str, Any]) -> None:
    """The step's temporaries (reference optimizer) and the torch for-loop / foreach AdamW over the reference
    model's requires_grad parameters, measured, equal the estimate (issue #20: the frozen embedding was
    counted)."""
    from memplan.analytic.optimizer_step import step_transient, trainable_shapes
    from memplan.config import OptimizerImpl
    from memplan.measure.reference.model import Reference
    from memplan.measure.reference.optim import step_transient as reference_step
    from memplan.measure.runs.optim_impls import step_transient as torch_step

    setup = setup_for(**case)
    torch.manual_seed(0)
    trainable = [p for p in Reference(setup).parameters() if p.requires_grad]
    assert [tuple(p.shape) for p in trainable] == trainable_shapes(setup)
    for p in trainable:
        p.grad = torch.randn_like(p)
    precision, optimizer = setup.training.precision, setup.training.optimizer
    assert reference_step(trainable, precision, optimizer) == step_transient(setup)
    for impl in (OptimizerImpl.FOR_LOOP, OptimizerImpl.FOREACH):
        t = setup.training.model_copy(update={"optimizer_impl": impl})
        explicit = Setup.model_validate({**setup.model_dump(), "training": t.model_dump()})
        assert torch_step(trainable, precision, impl)[0] == step_transient(explicit)
