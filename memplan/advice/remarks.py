"""The verdict's notes: settings that pass but deserve a word (``memplan.advice.advise``'s ``notes``), one
line each — a sequence beyond the model's positions, rope scaling, the implementation or attention chosen
for the user, Megatron's float8 (Transformer Engine), its loss, its experts split over tp where its
recipes fold them, --compile where its saved set is not modelled,
16-bit LoRA adapters outside --impl hf, selective checkpointing."""

from __future__ import annotations

from memplan.advice.candidates import result
from memplan.api import Built
from memplan.blocks import te_fp8
from memplan.blocks.profiles import compile_note, op_selective
from memplan.config import (
    Attention,
    Checkpointing,
    Device,
    Fp8Recipe,
    Impl,
    LossKind,
    hf_code_only,
    no_flash,
)
from memplan.strategies.lora import adapter_note, mlp_adapter_note
from memplan.strategies.tensor_parallel import foldable, tp_model


def notes(b: Built) -> list[str]:
    """One line each: a sequence beyond the model's positions, Megatron's float8 (Transformer Engine),
    --compile where its saved set is not modelled, 16-bit LoRA adapters outside --impl hf, selective
    checkpointing under flash."""
    r, o = b.result, b.options
    out: list[str] = []
    if b.untimed is not None:  # offload on a GPU that states no host link: the memory without a time
        out.append(f"not timed: {b.untimed.removeprefix('gpu: ')}")
    m, seq = r.setup.model, r.setup.training.seq_len
    if seq > m.max_positions:  # learned positions refuse it (config.setup); rotary ones run past it
        out.append(
            f"seq {seq:,} exceeds {m.name}'s {m.max_positions:,} positions (max_position_embeddings): "
            "training beyond them is a choice that needs RoPE scaling (e.g. rope_scaling in the config); "
            "the memory and FLOPs here do not depend on it"
        )
    if m.rope_scaling is not None:  # read for PhiMoE (presets.hf); its tables keep their shapes
        out.append(
            f"rope_scaling {m.rope_scaling}: it changes the rotary tables' values, not their shapes; the "
            "memory and FLOPs here do not depend on it"
        )
    if o.impl is None and r.setup.impl.impl is not Impl.REFERENCE:  # config.hf_rules.default_impl
        only = ", ".join(hf_code_only(m))
        out.append(
            f"impl: --impl hf chosen for {m.name}: its structure ({only}) is modelled in transformers' code "
            "only, not in memplan's reference model; give --impl to choose"
        )
    why = no_flash(m, r.setup.impl.impl, r.setup.device)
    if o.attention is None and why is not None:  # config.hf_rules.default_attention
        out.append(f"attention: eager chosen for {m.name}: {why}; give --attention to choose")
    if te_fp8.applies(r.setup):  # Megatron's float8: what it maps to, what it adds (blocks/te_fp8.py)
        recipe = r.setup.impl.fp8
        cache = te_fp8.resident_bytes(
            tp_model(m, r.setup.parallel.tp, r.setup.parallel.etp), r.setup.impl, ep=r.setup.parallel.ep
        )
        te = {Fp8Recipe.DELAYED: "DelayedScaling", Fp8Recipe.MXFP8: "MXFP8BlockScaling"}.get(
            recipe, "Float8CurrentScaling"
        )
        rows = r.setup.impl.fp8_amax_history_len
        history = (
            f", amax histories of {rows} row{'s' if rows > 1 else ''} (--fp8-amax-history-len) included, "
            "reduced over tp × dp × cp every forward and backward"
            if recipe is Fp8Recipe.DELAYED
            else ""
        )
        impl = r.setup.impl
        weights = (
            "float8 primary weights (no 16-bit copy; " if impl.fp8_param_gather else "cached float8 weights ("
        )
        weights += "one copy: the GPU's GEMMs take any layout)" if impl.fp8_any_layout else "with transposes)"
        out.append(
            f"fp8: --impl megatron --fp8 {recipe.value} is Megatron's --fp8-format hybrid --fp8-recipe "
            f"{recipe.value} (Transformer Engine {te}): the layers' linears keep float8 casts of their "
            f"inputs, and TE's {weights} and quantizer state ({cache:,} bytes a "
            f"layer{history}) are counted in weights; derived from TE's source, not measured"
        )
    if r.setup.impl.impl is Impl.MEGATRON and r.setup.loss is LossKind.STANDARD:
        out.append(
            "loss: --impl megatron with the standard loss is Megatron-LM's own vocabulary-parallel cross "
            "entropy (its default: an fp32 softmax [T, v/t] kept, two more in its backward); Megatron-Bridge "
            "and --cross-entropy-loss-fusion --cross-entropy-fusion-impl te run Transformer Engine's, "
            "--loss te"
        )
    par = r.setup.parallel
    if par.tp > 1 and par.fold == 1 and foldable(r.setup, par.sp, par.cp):
        folded = result(o.model_copy(update={"etp": 1}))
        peak = f": the peak {folded.device.peak.bytes / 2**30:.2f} GiB here" if folded else ""
        out.append(
            f"etp: the experts are split over --tp {par.tp} (Megatron-core's default expert tensor "
            "parallelism); Megatron-Bridge's MoE recipes run --etp 1, parallel folding (whole experts, each "
            f"rank routing its own tokens, --ep drawn from tp × dp){peak}"
        )
    compiled = compile_note(r.setup)  # --compile where its saved set is not modelled
    if compiled is not None:
        out.append(compiled)
    adapters = adapter_note(r.setup)  # 16-bit LoRA outside --impl hf: adapters in bf16, not peft's fp32
    if adapters is not None:
        out.append(adapters)
    mlp_adapters = mlp_adapter_note(r.setup)  # peft's fp32 adapters on the MLP: their backward not modelled
    if mlp_adapters is not None:
        out.append(mlp_adapters)
    st = r.setup.strategy
    if op_selective(r.setup):
        cached = " and cuDNN SDPA's outputs" if r.setup.device is Device.CUDA else ""
        out.append(
            "checkpointing selective is torchtitan's SelectiveAC: each block keeps its input, the outputs "
            f"of every other matmul{cached}, and re-runs the rest ({r.flops.recompute:,} FLOPs); derived "
            "from torchtitan's policy, checked under fake tensors (on CUDA with the cuDNN op's meta kernel)"
        )
    elif st.checkpointing is Checkpointing.SELECTIVE and st.attention is Attention.FLASH:
        none = result(o.model_copy(update={"checkpointing": "none"}))
        if none is None:  # no comparison to make
            return out
        saved = none.device.peak.bytes - r.device.peak.bytes
        out.append(
            f"checkpointing selective under flash attention lowers the peak by {saved:,} bytes "
            f"against none (flash keeps no s×s probabilities to drop) and re-runs the attention core "
            f"({r.flops.recompute:,} FLOPs); --checkpointing full or every-K saves memory"
        )
    return out
