"""Which fine-tuning setups memplan models (``Setup``'s validator, ``config.setup.check_setup``): LoRA,
QLoRA and frozen layers by layout, family and implementation, and each family's q/k norms as its code has
them. One-line ``ValueError``s naming the field and the fix."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memplan.config.finetune import ALL_LINEAR, FUSED_LINEARS, MLP_TARGETS, Method, Target
from memplan.config.hf_rules import hf_only_code
from memplan.config.impl import Impl
from memplan.config.model import GateActivation, MlpType
from memplan.config.offload import LossKind, Offload
from memplan.config.strategy import Checkpointing

if TYPE_CHECKING:
    from memplan.config.setup import Setup


def _moe_refusal(setup: Setup) -> str | None:
    """What keeps memplan from modelling fine-tuning of this mixture of experts; None where it does (and
    for a dense model): LoRA on the attention's linears (q, k, v, o) or freezing, with the router, the
    experts and the shared experts frozen or trained whole, under ``--impl reference`` without expert
    parallelism (``strategies.lora.moe_keep``: measured equal per tensor and FLOP, checkpointed too,
    tests/measure/test_finetune.py)."""
    m, ft = setup.model, setup.finetune
    moe = m.moe
    if moe is None:
        return None
    only = hf_only_code(m)  # no --impl but transformers' runs it
    if only:
        return only
    if m.mla is not None or moe.router_sigmoid or moe.dense_layers or moe.expert_bias or moe.input_jitter:
        return f"{m.name}'s MoE layer (MLA, Llama 4's, DeepSeek's dense layers, expert biases or jitter)"
    if m.gate_act is GateActivation.CLAMPED:
        return f"{m.name}'s clamped SwiGLU experts"
    if setup.impl.impl is not Impl.REFERENCE:
        return f"under --impl {setup.impl.impl.value}: use --impl reference"
    if ft.method is Method.QLORA:
        return "QLoRA: bitsandbytes quantises experts that are nn.Linear, not transformers' fused 3-D ones"
    if ft.lora and any(t in MLP_TARGETS for t in ft.targets):
        return "adapters on the experts: target the attention, --lora-targets q,k,v,o"
    if setup.parallel.ep > 1:
        return "expert parallelism: drop --ep"
    return None


def _split_group(setup: Setup) -> str | None:
    """Under ``--impl hf``, LoRA targets that split one of the family's fused linears (``FUSED_LINEARS``:
    peft adapts the module whole, so its linears are all adapted or none); None when none does."""
    m, ft = setup.model, setup.finetune
    if not ft.lora or setup.impl.impl is not Impl.HF:
        return None
    for group in FUSED_LINEARS.get(m.code_family, ()):
        chosen = [t for t in group if t in ft.targets]
        if chosen and len(chosen) < len(group):
            names = ",".join(t.value for t in group)
            default = " (the default targets are q,v)" if ft.targets == (Target.Q, Target.V) else ""
            return (
                f"lora-targets: {m.name}'s {names} are one linear in transformers' code, which peft adapts "
                f"whole; target {names} together or none of them{default}: e.g. --lora-targets {names} or "
                "all-linear"
            )
    return None


def check_finetune(setup: Setup) -> None:
    """The fine-tuning settings fit the model and the layouts memplan models them for; one-line errors."""
    m, ft, s, par = setup.model, setup.finetune, setup.strategy, setup.parallel
    if ft.freeze_layers is not None and ft.freeze_layers[1] >= m.num_layers:
        raise ValueError(
            f"freeze: layers:{ft.freeze_layers[0]}-{ft.freeze_layers[1]} beyond {m.name}'s "
            f"{m.num_layers} layers (0-{m.num_layers - 1}); use layers:A-B with B < {m.num_layers}"
        )
    named = set(ft.targets) != set(ALL_LINEAR)  # all-linear: every linear the model has (peft's spelling)
    if ft.lora and m.mlp is MlpType.GELU and Target.GATE in ft.targets and named:
        raise ValueError(
            f"lora-targets: {m.name}'s GELU MLP has no gate projection; target up and down (fc1, fc2) "
            "or all-linear"
        )
    split = _split_group(setup)
    if split:
        raise ValueError(split)
    if (
        ft.lora
        and ft.freeze_layers is not None
        and ft.freeze_layers[1] - ft.freeze_layers[0] + 1 >= m.num_layers
    ):
        raise ValueError("freeze: every layer frozen leaves no LoRA adapter to train; freeze fewer layers")
    # NB: refused rather than estimated wrongly: the strategies below re-run or split layers whose saves
    # and FLOPs memplan models for fine-tuning on one unsplit replica only (data parallelism and ZeRO are).
    # Segment checkpointing re-runs layers whose output needs a gradient: every one under LoRA on all layers.
    segment_ok = ft.lora and ft.freeze_layers is None and s.checkpointing is not Checkpointing.SELECTIVE
    moe = _moe_refusal(setup)
    unmodelled = {
        "--checkpointing (but full or every-K with LoRA on every layer)": s.checkpointing
        is not Checkpointing.NONE
        and not segment_ok,
        "--reversible": s.reversible,
        "--tp/--sp": par.tp > 1,
        "--pp": par.pp > 1,
        "--cp": par.cp > 1,
        f"a mixture of experts ({moe})": moe is not None,
        "--offload": setup.offload is not Offload.NONE,
        # Liger's fused loss and torchtune's chunked one follow the gradient flow (a frozen head makes no
        # weight gradient and keeps no input: ``blocks.head``); flash_attn's and Transformer Engine's
        # kernels under a frozen head are not measured
        f"--loss {setup.loss.name.lower()}": setup.loss in (LossKind.XENTROPY, LossKind.TE),
    }
    for name, used in unmodelled.items():
        if used:
            raise ValueError(
                f"finetune: fine-tuning or freezing with {name} is not modelled yet; "
                "use full training (--finetune full, no --freeze) or drop that setting"
            )
