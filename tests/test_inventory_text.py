"""The words of the inventory: every kept tensor's name, role and "why kept" text, per setup, pinned by
syrupy snapshots (tests/__snapshots__/test_inventory_text.ambr; ``pytest --snapshot-update`` rewrites them
after a deliberate change). `memplan estimate` prints these in its table; `trace` pairs estimated and
measured tensors by name (tests/measure/, tests/hf/). Torch-free, in the mutation selection: a mangled name
or reason (docs/mutation.md) is a visible bug the numbers' tests cannot see.

No number is pinned here: shapes, dtypes, counts and bytes are derived by hand in the rule tests
(tests/test_*_rules.py, tests/test_lora_flow.py) and measured in tests/measure/.
"""

from __future__ import annotations

from typing import Any

import pytest
from syrupy.assertion import SnapshotAssertion
from tiny_setup import tiny_setup

from memplan.config import (
    Device,
    ExpertsImpl,
    FineTune,
    Impl,
    ImplConfig,
    LossKind,
    MoEConfig,
    Offload,
    Parallel,
    Setup,
)
from memplan.config.finetune import Method, Target
from memplan.config.impl import Family
from memplan.config.strategy import Attention, Checkpointing
from memplan.engine import estimate

EAGER = {"attention": Attention.EAGER}
DROPOUT = {"attn_dropout": 0.1, "resid_dropout": 0.1, "embd_dropout": 0.1}
GPT2 = {"family": Family.GPT2, "position": "learned", "mlp": "gelu", "norm": "layernorm", **DROPOUT}
HF = ImplConfig(impl=Impl.HF)


def on(s: Setup, **update: Any) -> Setup:
    return s.model_copy(update=update)


SETUPS: dict[str, Setup] = {
    "reference-flash": tiny_setup(),
    "reference-eager-dropout-cuda": tiny_setup(DROPOUT, EAGER),
    "reference-eager-dropout-cpu": on(tiny_setup(DROPOUT, EAGER), device=Device.CPU),
    "reference-selective": tiny_setup(strategy={"checkpointing": Checkpointing.SELECTIVE}),
    "reference-every-3": tiny_setup(strategy={"checkpointing": Checkpointing.EVERY_K, "checkpoint_every": 3}),
    "reference-reversible": tiny_setup(strategy={"reversible": True}),
    "reference-moe": tiny_setup({"moe": MoEConfig(experts=4, top_k=2, shared_experts=1, shared_gate=True)}),
    "reference-chunked-loss": on(tiny_setup(), loss=LossKind.CHUNKED, loss_chunks=4),
    "reference-fused-loss": on(tiny_setup(), loss=LossKind.FUSED),
    "reference-tp2-sp": on(tiny_setup(), parallel=Parallel(tp=2, sp=True)),
    "reference-cp2": on(tiny_setup(), parallel=Parallel(cp=2)),
    "reference-offload-activations": on(tiny_setup(), offload=Offload.ACTIVATIONS),
    "reference-lora-dropout": tiny_setup(
        DROPOUT,
        finetune=FineTune(method=Method.LORA, dropout=0.1, targets=(Target.Q, Target.V, Target.DOWN)),
    ),
    "hf-llama-eager-cpu": on(
        tiny_setup({"family": Family.LLAMA, **DROPOUT}, EAGER, impl=HF), device=Device.CPU
    ),
    "hf-llama-flash-full": tiny_setup(
        {"family": Family.LLAMA}, {"checkpointing": Checkpointing.FULL}, impl=HF
    ),
    "hf-llama-flash-attn-2": tiny_setup(
        {"family": Family.LLAMA}, impl=ImplConfig(impl=Impl.HF, flash_attn=True)
    ),
    "hf-gpt2-eager-cpu": on(tiny_setup(GPT2, EAGER, impl=HF), device=Device.CPU),
    "hf-gpt2-math-cpu": on(tiny_setup(GPT2, impl=HF), device=Device.CPU),
    "hf-neox-flash-cpu": on(
        tiny_setup({"family": Family.GPT_NEOX, "mlp": "gelu", "norm": "layernorm"}, impl=HF),
        device=Device.CPU,
    ),
    "hf-mistral-window-cpu": on(
        tiny_setup({"family": Family.MISTRAL, "sliding_window": 16}, impl=HF), device=Device.CPU
    ),
    "hf-gemma2-eager": tiny_setup(
        {"family": Family.GEMMA2, "post_norms": True, "attn_softcap": 50.0, "final_softcap": 30.0},
        EAGER,
        impl=HF,
    ),
    "hf-gemma3-two-rotary-tables": tiny_setup(
        {"family": Family.GEMMA3, "sliding_window": 64, "sliding_window_pattern": 2, "rope_local_theta": 1e4},
        impl=HF,
    ),
    "hf-qwen3-qk-norm": tiny_setup({"family": Family.QWEN3, "qk_norm": True}, impl=HF),
    "hf-qwen2-moe-grouped-mm": tiny_setup(
        {
            "family": Family.QWEN2_MOE,
            "moe": MoEConfig(experts=4, top_k=2, shared_experts=1, shared_gate=True, norm_topk_prob=True),
        },
        impl=HF,
    ),
    "hf-mixtral-eager-experts": tiny_setup(
        {"family": Family.MIXTRAL, "moe": MoEConfig(experts=4, top_k=2)},
        impl=ImplConfig(impl=Impl.HF, experts=ExpertsImpl.EAGER),
    ),
    "hf-neox-parallel-residual": tiny_setup(
        {"family": Family.GPT_NEOX, "mlp": "gelu", "norm": "layernorm", "parallel_residual": True}, impl=HF
    ),
    "hf-llama-every-3": tiny_setup(
        {"family": Family.LLAMA}, {"checkpointing": Checkpointing.EVERY_K, "checkpoint_every": 3}, impl=HF
    ),
    "megatron-layernorm": tiny_setup({"norm": "layernorm"}, impl=ImplConfig(impl=Impl.MEGATRON)),
    "megatron-eager-gqa": tiny_setup({"num_kv_heads": 2}, EAGER, impl=ImplConfig(impl=Impl.MEGATRON)),
    "megatron-selective": tiny_setup(
        strategy={"checkpointing": Checkpointing.SELECTIVE}, impl=ImplConfig(impl=Impl.MEGATRON)
    ),
    "torchtitan": on(tiny_setup(impl=ImplConfig(impl=Impl.TORCHTITAN)), device=Device.CPU),
}


@pytest.mark.parametrize("name", list(SETUPS))
def test_every_kept_tensors_name_role_and_reason(name: str, snapshot: SnapshotAssertion) -> None:
    tensors = estimate(SETUPS[name]).tensors
    assert all(k.reason for k in tensors)  # every kept tensor says why (DESIGN.md)
    assert [f"{k.block.value}/{k.name} ({k.role.value}): {k.reason}" for k in tensors] == snapshot


@pytest.mark.parametrize("name", list(SETUPS))
def test_every_kept_entry_is_what_validation_would_build(name: str) -> None:
    """``activations.kept`` builds the entries without pydantic's validation (``config.unvalidated``, for
    ``fit``'s speed): each passes validation unchanged, field for field, type for type."""
    from memplan.blocks.inventory import Kept

    for k in estimate(SETUPS[name]).tensors:
        checked = Kept.model_validate(k.model_dump())
        assert checked == k and hash(checked) == hash(k)
        assert all(type(getattr(checked, f)) is type(getattr(k, f)) for f in Kept.model_fields)
        assert list(k.__dict__) == list(Kept.model_fields) and k.__pydantic_fields_set__ == set(
            Kept.model_fields
        )
