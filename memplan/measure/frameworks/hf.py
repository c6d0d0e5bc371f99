"""Run Hugging Face transformers' own model for a setup (``--impl hf``) and record what it keeps.

``measure_hf(setup)`` builds ``AutoModelForCausalLM.from_config`` for the model's family (its
``modeling_<model_type>.py``; no weights, no network, no ``trust_remote_code``) under ``FakeTensorMode`` on
CPU, runs forward with labels (transformers' own loss) and backward, and records every storage autograd
saves and still holds when the forward ends (a save on a node that died with a discarded output, freed
before backward, is dropped by ``step.run_step``: ``SavedTensorRecorder.forget_freed``), named by the
module that saved it and the op (``self_attn.q_proj · Mm``), per decoder layer; and the FLOPs per phase
(``FlopMeter``). The attention kernel is ``attn_implementation``: ``eager`` for ``--attention eager``,
``sdpa`` for flash (on CPU torch's flash kernel, as the reference model); ``--checkpointing full`` /
``every-K`` is transformers' ``gradient_checkpointing_enable`` (``every_n_layers`` K, ``use_reentrant``
from ``--reentrant``).

Mixtures of experts run transformers' default ``grouped_mm`` experts, whose buffers are [T·k, ·] whatever
the routing, so fake tensors run them at any size; on real tensors (``fake=False``) a forward hook on each
router records the tokens per expert it chose (``Measured.routing``).

The recording loop is ``memplan.measure.frameworks.step.run_step`` (shared with ``--impl torchtitan``).

``--finetune lora`` runs peft's ``get_peft_model`` (its defaults: fp32 adapters under 16-bit weights) on the
model, adapting the ``q_proj``…``down_proj`` linears ``--lora-targets`` names (``with_peft``).

Known limitations:
- NB: transformers is an optional extra (``pip install 'memplan[hf]'``); ``require_transformers`` says so.
- NB: ``--finetune qlora`` (bitsandbytes' 4-bit storage cannot be built under fake tensors) and ``--freeze``
  are not traced here (``check_peft``): trace them with ``--impl reference``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memplan.config import Attention, Checkpointing, ExpertsImpl, Family, Setup
from memplan.config.finetune import Adapter, Method, Target
from memplan.config.trainable import adapters
from memplan.measure.frameworks.hf_config import hf_config, hf_config_of_file, require_transformers
from memplan.measure.frameworks.step import activation_dtype, run_step
from memplan.measure.instruments.measured import Measured
from memplan.measure.runs.run import make_batch


def attn_implementation(setup: Setup) -> str:
    return "eager" if setup.strategy.attention is Attention.EAGER else "sdpa"


def build(setup: Setup, document: Mapping[str, Any] | None = None) -> Any:
    """transformers' causal LM for ``setup`` in the activation dtype, in training mode (call under a fake
    mode: no memory is allocated); from the user's own config.json ``document`` when given
    (``hf_config_of_file``), else from memplan's model (``hf_config``)."""
    transformers = require_transformers()
    config = hf_config(setup) if document is None else hf_config_of_file(setup, document)
    dtype = activation_dtype(setup)
    transformers.logging.set_verbosity_error()  # e.g. "use_cache=True is incompatible with checkpointing"
    # Llama 4's experts are its own bmm over every token: no experts_implementation to choose
    choose = setup.model.moe and setup.model.code_family is not Family.LLAMA4
    experts = {"experts_implementation": setup.impl.experts.value} if choose else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attn_implementation(setup), **experts
        )
    model.train()
    return model


PEFT_TARGETS = {
    Target.Q: "q_proj",
    Target.K: "k_proj",
    Target.V: "v_proj",
    Target.O: "o_proj",
    Target.GATE: "gate_proj",
    Target.UP: "up_proj",
    Target.DOWN: "down_proj",
}
"""peft's ``target_modules`` for memplan's targets: transformers' Llama-style module names (the families
``config.finetune_rules.check_finetune`` lets through under ``--impl hf``)."""


def check_peft(setup: Setup) -> None:
    """One-line errors before tracing fine-tuning under ``--impl hf``: LoRA only, through peft."""
    if setup.finetune.trains_everything:
        return
    ft = setup.finetune
    if ft.method is Method.FULL:  # --freeze: requires_grad off on transformers' own modules (``freeze``)
        return
    if ft.method is not Method.LORA:
        raise ValueError(
            "finetune: trace --impl hf runs peft's LoRA; --finetune qlora is not traced there: trace it "
            "with --impl reference"
        )
    try:
        import peft  # noqa: F401
    except ImportError:
        raise ValueError("finetune: trace --impl hf --finetune lora runs peft; pip install peft") from None


_H4H = {Target.UP: "dense_h_to_4h", Target.DOWN: "dense_4h_to_h"}
FAMILY_MODULES: dict[Family, dict[Target, str]] = {
    Family.GPT2: {Target.Q: "c_attn", Target.O: "attn.c_proj", Target.UP: "c_fc", Target.DOWN: "mlp.c_proj"},
    Family.STARCODER2: {Target.UP: "c_fc", Target.DOWN: "c_proj"},
    Family.GPT_NEOX: {Target.Q: "query_key_value", Target.O: "attention.dense"} | _H4H,
    Family.FALCON: {Target.Q: "query_key_value", Target.O: "self_attention.dense"} | _H4H,
}
"""Modules named otherwise than Llama's: GPT-2's ``Conv1D`` ones (modeling_gpt2.py), ``c_attn`` the fused q,
k, v, attention's and the MLP's ``c_proj`` told apart by their parent (peft matches a target that ends the
module's name); StarCoder2's biased GELU MLP (modeling_starcoder2.py); GPT-NeoX's and Falcon's fused
``query_key_value``, their attention's ``dense`` told apart from the MLP's by its parent."""


def peft_module(setup: Setup, adapter: Adapter) -> str:
    """peft's ``target_modules`` entry for one adapter: a fused projection's own module
    (``config.finetune.FUSED_LINEARS``: Phi-3's ``qkv_proj``, ``gate_up_proj``, GLM's ``gate_up_proj``,
    GPT-2's ``c_attn``), else the linear's."""
    first, own = adapter.targets[0], FAMILY_MODULES.get(setup.model.code_family, {})
    if first in own:
        return own[first]
    return f"{adapter.name}_proj" if len(adapter.targets) > 1 else PEFT_TARGETS[first]


def with_peft(setup: Setup, model: Any) -> Any:
    """``model`` with peft's LoRA adapters (``peft.get_peft_model`` with its defaults) on the targets; the
    adapted transformers model (``base_model.model``), whose decoder layers ``layers_of`` finds."""
    import peft

    ft = setup.finetune
    modules = [peft_module(setup, a) for a in adapters(setup)]
    lora: Any = {"r": ft.rank, "lora_alpha": ft.alpha, "lora_dropout": ft.dropout, "target_modules": modules}
    if ft.freeze_layers is not None:  # --freeze layers:A-B: no adapters there (peft's layers_to_transform)
        lora["layers_to_transform"] = [i for i in range(setup.model.num_layers) if not ft.layer_frozen(i)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(model, peft.LoraConfig(**lora)).base_model.model


def freeze(setup: Setup, model: Any) -> None:
    """``--freeze`` under full fine-tuning as a training script freezes transformers' model:
    ``requires_grad_(False)`` on the token embedding (and GPT-2's learned positions), the lm head (tied:
    the one weight) and the layers A … B (``config.trainable``'s parts). LoRA's frozen layers get no
    adapters instead (``with_peft``)."""
    ft = setup.finetune
    if ft.method is not Method.FULL:
        return
    if ft.freeze_embeddings or (setup.model.tied_embeddings and ft.freeze_lm_head):
        model.get_input_embeddings().requires_grad_(False)
        positions = getattr(model.base_model, "wpe", None)
        if positions is not None:
            positions.requires_grad_(False)
    if ft.freeze_lm_head:
        model.get_output_embeddings().requires_grad_(False)
    for i, layer in enumerate(layers_of(model)):
        if ft.layer_frozen(i):
            layer.requires_grad_(False)


def layers_of(model: Any) -> list[Any]:
    """The decoder layers, in order (``model.layers`` or GPT-2's ``transformer.h``). Llama 4's causal LM
    names ``language_model`` its base-model prefix but holds the text model as ``model``
    (``Llama4ForCausalLM``), so ``base_model`` is the LM itself there."""
    base = model.base_model
    if base is model and hasattr(model, "model"):
        base = model.model
    return list(base.layers if hasattr(base, "layers") else base.h)


def measure_hf(setup: Setup, fake: bool = True, document: Mapping[str, Any] | None = None) -> Measured:
    """One forward (transformers' loss) and backward of the real HF model for ``setup`` on CPU; built from
    the user's config.json ``document`` when the model came from one."""
    if fake and setup.model.moe and setup.impl.experts is ExpertsImpl.EAGER:
        raise ValueError(
            "experts: transformers' eager experts loop has data-dependent shapes (torch.where) that fake "
            "tensors cannot run; trace --experts grouped_mm, or measure eager on real tensors (tests/hf)"
        )
    if fake and document is not None and rope_type(document) == "longrope":
        raise ValueError(
            "rope_scaling: longrope reads the positions' values (torch.max(position_ids)), which fake "
            "tensors cannot trace; trace a copy of config.json without rope_scaling (it changes the rotary "
            "tables' values only: the same bytes and FLOPs)"
        )
    torch.manual_seed(0)
    lora = setup.finetune.method is Method.LORA
    if lora and fake:
        # peft moves each new adapter to its base layer's device and dtype (``.to``), which a fake
        # parameter refuses (``_apply``'s swap_tensors): adapted on the meta device, then made fake below.
        with torch.device("meta"):
            meta = with_peft(setup, build(setup, document))
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else nullcontext():
        if lora and fake:
            model = meta.to_empty(device="cpu")
        else:
            model = build(setup, document)
            model = with_peft(setup, model) if lora else model
        s = setup.strategy
        freeze(setup, model)
        enable_checkpointing(setup, model)
        ids, labels = make_batch(setup, "cpu")
        layers = [(layer, "_gradient_checkpointing_func") for layer in layers_of(model)]

        routing: list[list[int]] = []

        def forward() -> torch.Tensor:
            with nullcontext() if fake else _routing(model, routing):
                return model(input_ids=ids, labels=labels, use_cache=setup.impl.use_cache).loss

        with _one_sequence_per_row(fake):
            checkpointed = s.checkpointing is not Checkpointing.NONE
            meas = run_step(model, layers, forward, checkpointed)
        meas.routing = routing
        return meas


def enable_checkpointing(setup: Setup, model: Any) -> None:
    """transformers' activation checkpointing under ``--checkpointing full`` or every-K (``--reentrant``)."""
    s = setup.strategy
    if s.checkpointing in (Checkpointing.FULL, Checkpointing.EVERY_K):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model._activation_checkpointing_enable(
                {"use_reentrant": setup.impl.reentrant}, every_n_layers=s.segment
            )


def rope_type(document: Mapping[str, Any]) -> str | None:
    """The rope type of a config.json (``rope_scaling`` or transformers 5's ``rope_parameters``: its
    ``rope_type``, or the legacy ``type``), None without one."""
    from memplan.presets.hf import text_config

    doc = text_config(document)
    rope = doc.get("rope_scaling") or doc.get("rope_parameters") or {}
    kind = rope.get("rope_type") or rope.get("type") if isinstance(rope, Mapping) else None
    return str(kind) if kind else None


@contextmanager
def _one_sequence_per_row(fake: bool) -> Iterator[None]:
    """transformers' ``find_packed_sequence_indices`` (masking_utils) as a real run answers for
    ``make_batch``'s rows (one sequence each, positions 0…s−1: ``None``, no packing mask).

    Under fake tensors it cannot read the positions (``is_tracing`` is true for a FakeTensor) and returns
    a packed-sequence index, so ``create_causal_mask`` would build an explicit [b, 1, s, s] mask whenever
    no cache is passed (``use_cache`` off, or gradient checkpointing) where the real run lets SDPA's
    ``is_causal`` do it."""
    if not fake:
        yield
        return
    import transformers.masking_utils as masking

    find = masking.find_packed_sequence_indices
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = find


@contextmanager
def _routing(model: Any, out: list[list[int]]) -> Iterator[None]:
    """Per MoE layer, the tokens per expert its router chose: a forward hook on each ``*TopKRouter``
    (``MixtralTopKRouter`` / ``Qwen2MoeTopKRouter`` return logits, scores and the [T, k] expert indices)."""
    routers = [
        m for m in model.modules() if type(m).__name__.lower().endswith("topkrouter")
    ]  # Deepseek: Topk
    handles = [r.register_forward_hook(partial(_count, out)) for r in routers]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _count(out: list[list[int]], module: Any, args: Any, result: Any) -> None:
    indices = result[2]
    out.append(torch.bincount(indices.reshape(-1), minlength=module.num_experts).tolist())
