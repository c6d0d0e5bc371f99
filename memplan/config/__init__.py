"""Configuration models: what the model is, how it is trained, with which strategy and parallel layout.

Pydantic v2, ``frozen=True, extra="forbid"``, each field declared once. Derived defaults (kv heads, head
dim, ffn size) are filled in validators; a user mistake raises ``ValueError`` naming the field and the fix
(pydantic turns it into a ``ValidationError``; the CLI prints one line of it and exits 2).

- ``Frozen``: the base of every configuration model (also ``api.Options`` and the presets);
  ``unvalidated``: a model built without validation, for hot paths;
- ``model``: ``ModelConfig`` (dense, or a mixture of experts through ``MoEConfig``) and its enums;
- ``moe``: ``MoEConfig`` (routed and shared experts, the router), ``RouterScoring``; ``mla``: ``MLAConfig``;
- ``training``: ``TrainingConfig``, ``Precision``, ``Optimizer``, ``DType``;
- ``strategy``: ``StrategyConfig``, ``Checkpointing``, ``Attention``, ``ZeroStage``, ``Device``;
- ``offload``: ``Offload`` (host offload) and ``LossKind`` (the loss variant);
- ``finetune``: ``FineTune`` (full, LoRA, QLoRA; freezing), ``Method``, ``Target``, ``Quant``;
- ``impl``: ``Impl`` (whose code runs the step), ``ImplConfig`` (its switches), ``Family``; what each
  implementation's code models: ``impl_rules`` (the frameworks' profiles, torchtitan, float8) and
  ``hf_rules`` (transformers' structures and families, the default implementation and attention);
- ``setup``: ``Parallel`` and ``Setup``, everything one estimate depends on.
"""

from memplan.config._base import Frozen, unvalidated
from memplan.config.finetune import (
    FINETUNE_OPTIONS,
    FULL_TRAINING,
    FineTune,
    Method,
    MethodChoice,
    Quant,
    Target,
    finetune_from,
    parse_freeze,
    parse_targets,
)
from memplan.config.hf_rules import default_attention, default_impl, hf_code_only, no_flash
from memplan.config.impl import (
    AttentionKernel,
    ExpertsImpl,
    Family,
    Fp8Recipe,
    FsdpWrap,
    Impl,
    ImplConfig,
    NormKernel,
)
from memplan.config.mla import MLAConfig
from memplan.config.model import (
    GateActivation,
    Gelu,
    MlpType,
    ModelConfig,
    NormType,
    PositionType,
)
from memplan.config.moe import MoEConfig, RouterScoring
from memplan.config.offload import LossKind, Offload, loss_label, offload_label, parse_loss, parse_offload
from memplan.config.setup import CpRotate, Parallel, Setup, default_cp_rotate
from memplan.config.strategy import (
    Attention,
    AttentionChoice,
    Checkpointing,
    Device,
    ReduceDtype,
    StrategyConfig,
    ZeroStage,
    checkpointing_label,
    parse_checkpointing,
)
from memplan.config.training import TORCH_ADAMW, DType, Optimizer, OptimizerImpl, Precision, TrainingConfig

__all__ = [
    "FINETUNE_OPTIONS",
    "FULL_TRAINING",
    "TORCH_ADAMW",
    "Attention",
    "AttentionChoice",
    "AttentionKernel",
    "Checkpointing",
    "CpRotate",
    "DType",
    "Device",
    "ExpertsImpl",
    "Family",
    "FineTune",
    "Fp8Recipe",
    "Frozen",
    "FsdpWrap",
    "GateActivation",
    "Gelu",
    "Impl",
    "ImplConfig",
    "LossKind",
    "MLAConfig",
    "Method",
    "MethodChoice",
    "MlpType",
    "MoEConfig",
    "ModelConfig",
    "NormKernel",
    "NormType",
    "Offload",
    "Optimizer",
    "OptimizerImpl",
    "Parallel",
    "PositionType",
    "Precision",
    "Quant",
    "ReduceDtype",
    "RouterScoring",
    "Setup",
    "StrategyConfig",
    "Target",
    "TrainingConfig",
    "ZeroStage",
    "checkpointing_label",
    "default_attention",
    "default_cp_rotate",
    "default_impl",
    "finetune_from",
    "hf_code_only",
    "loss_label",
    "no_flash",
    "offload_label",
    "parse_checkpointing",
    "parse_freeze",
    "parse_loss",
    "parse_offload",
    "parse_targets",
    "unvalidated",
]
