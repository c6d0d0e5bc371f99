"""What trains under fine-tuning (``--finetune``, ``--freeze``): one fact each, read by the saves
(``strategies.lora``), the optimizer step (``analytic.optimizer_step``) and the reference model
(``measure.lora``). Full training outside ``--freeze`` trains everything; LoRA trains only its adapters,
in fp32 under ``--impl hf`` with 16-bit activations (peft's default, ``fp32_adapters``).
"""

from __future__ import annotations

from memplan.config.finetune import Adapter, Method, Target, adapter_modules, linear_modules
from memplan.config.impl import Impl
from memplan.config.setup import Setup
from memplan.config.strategy import Checkpointing
from memplan.config.training import DType


def base_trains(setup: Setup, layer: int) -> bool:
    """Whether layer ``layer``'s own weights (linears, norms) train: full training outside --freeze."""
    ft = setup.finetune
    return ft.method is Method.FULL and not ft.layer_frozen(layer)


def adapted(setup: Setup, layer: int) -> frozenset[Target]:
    """The linears of layer ``layer`` with a LoRA adapter (none in frozen layers or without LoRA)."""
    ft = setup.finetune
    if not ft.lora or ft.layer_frozen(layer):
        return frozenset()
    return frozenset(ft.targets)


def adapters(setup: Setup, targets: frozenset[Target] | None = None) -> tuple[Adapter, ...]:
    """The LoRA adapters on a layer with ``targets`` adapted (default: every target): peft's modules under
    ``--impl hf`` (a fused projection one adapter, ``FUSED_LINEARS``), else one per linear."""
    wanted = frozenset(setup.finetune.targets) if targets is None else targets
    return adapter_modules(setup.model, setup.impl.impl is Impl.HF, wanted)


def adapter_params(setup: Setup, targets: frozenset[Target] | None = None) -> int:
    """LoRA parameters of one layer with ``targets`` adapted (default: every target): A [r, in] and B
    [out, r] per adapter (peft: no bias; a fused projection one adapter under ``--impl hf``)."""
    r = setup.finetune.rank
    return sum(r * (a.fan_in + a.fan_out) for a in adapters(setup, targets))


def base_linears(setup: Setup) -> list[tuple[int, int]]:
    """(in, out) of one layer's linear modules as the code builds them: under ``--impl hf`` a fused
    projection one module (``FUSED_LINEARS``), else one per linear."""
    return linear_modules(setup.model, setup.impl.impl is Impl.HF)


def embedding_trains(setup: Setup) -> bool:
    ft = setup.finetune
    tied = setup.model.tied_embeddings and ft.freeze_lm_head  # one tensor: frozen as the head is
    return ft.method is Method.FULL and not ft.freeze_embeddings and not tied


def head_trains(setup: Setup) -> bool:
    """The lm head (the embedding itself when tied) trains."""
    if setup.model.tied_embeddings:
        return embedding_trains(setup)
    ft = setup.finetune
    return ft.method is Method.FULL and not ft.freeze_lm_head


def final_norm_trains(setup: Setup) -> bool:
    return setup.finetune.method is Method.FULL


def input_grads_hooked(setup: Setup) -> bool:
    """transformers' ``gradient_checkpointing_enable`` on a causal LM calls ``enable_input_require_grads()``
    (modeling_utils.py: ``needs_embedding_grads = self.main_input_name == "input_ids"``, "When using PEFT +
    gradient checkpointing ... the input has requires_grad=True"): a forward hook makes the embedding's
    output require grad, so under ``--impl hf`` with checkpointing full or every-K layer 0's input needs a
    gradient even with a frozen embedding (its linears run dX in backward)."""
    ckpt = setup.strategy.checkpointing in (Checkpointing.FULL, Checkpointing.EVERY_K)
    return setup.impl.impl is Impl.HF and ckpt


def layer_input_grad(setup: Setup, layer: int) -> bool:
    """Whether layer ``layer``'s input requires grad: the embedding's output does (it trains, or
    transformers' checkpointing hooks it, ``input_grads_hooked``), or a layer below trains or is adapted
    (its output then does) — ``strategies.lora_flow.flows``' ``g_in``, read without the flows."""
    if embedding_trains(setup) or input_grads_hooked(setup):
        return True
    return any(base_trains(setup, i) or adapted(setup, i) for i in range(layer))


def fp32_adapters(setup: Setup) -> bool:
    """peft's default under ``--impl hf`` with 16-bit activations: ``get_peft_model``'s
    ``autocast_adapter_dtype=True`` upcasts bf16/fp16 adapter weights to fp32
    (tuners_utils.py ``cast_adapter_dtype``: ``dtypes_to_convert_to_fp32 = {float16, bfloat16}``), and each
    adapter's forward casts its input to A's dtype (lora/layer.py ``Linear.forward``:
    ``x = self._cast_input_dtype(x, lora_A.weight.dtype)``; QLoRA's lora/bnb.py ``Linear4bit.forward``
    alike). memplan's reference model keeps its adapters in the activation dtype
    (``strategies.lora.adapter_note``). Read by the saves (``strategies.lora``) and the model states
    (``strategies.lora_states``)."""
    act = setup.training.precision.activation_dtype
    return setup.impl.impl is Impl.HF and setup.finetune.lora and act is not DType.FP32
