"""What transformers' code models (``--impl hf``): the structures only its families' code has and which
family has each, the implementation and attention kernel a model defaults to, and each family's own
layout (its norm, MLP, parallel layer, partial rotary, q/k norms) — a layout its code cannot run is an
error, not an estimate of other code. ``Setup``'s validator (``config.setup.check_setup``) and
``config.impl_rules.check_impl`` call these; one-line ``ValueError``s naming the field and the fix."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memplan.config.impl import Family, Impl
from memplan.config.model import MlpType, ModelConfig, NormType
from memplan.config.strategy import Attention, Device

if TYPE_CHECKING:
    from memplan.config.setup import Setup


_DEEPSEEK = (Family.DEEPSEEK_V2, Family.DEEPSEEK_V3)
HF_STRUCTURE = {
    "post_norms": (Family.GEMMA2, Family.GEMMA3, Family.OLMO2),
    "attn_softcap": (Family.GEMMA2, Family.GEMMA3),
    "final_softcap": (Family.GEMMA2, Family.GEMMA3),
    "sliding_window_pattern": (Family.GEMMA2, Family.GEMMA3, Family.GPT_OSS),
    "rope_local_theta": (Family.GEMMA3,),
    "attn_sinks": (Family.GPT_OSS,),
    "gate_act": (Family.GPT_OSS,),
    "moe.router_bias": (Family.GPT_OSS,),
    "moe.expert_bias": (Family.GPT_OSS,),
    "mla": _DEEPSEEK,
    "moe.dense_layers": _DEEPSEEK,
    "moe.scoring": (Family.DEEPSEEK_V3,),
    "moe.groups": _DEEPSEEK,
    "pre_norms": (Family.OLMO2,),
    "qk_norm_whole": (Family.OLMO2, Family.COHERE, Family.STABLELM),
    "shared_norm": (Family.COHERE, Family.STABLELM, Family.FALCON),
    "norm_bias": (Family.COHERE,),
    "head_bias": (Family.PHIMOE,),
    "moe.input_jitter": (Family.PHIMOE,),
    "moe.router_sigmoid": (Family.LLAMA4,),
    "moe_every": (Family.LLAMA4,),
    "nope_every": (Family.LLAMA4,),
    "attn_chunk": (Family.LLAMA4,),
    "qk_l2_norm": (Family.LLAMA4,),
    "attn_temperature": (Family.LLAMA4,),
}
"""The transformers families whose code has each ``ModelConfig.hf_only`` structure."""


def hf_code_only(m: ModelConfig) -> list[str]:
    """The fields of ``m`` whose structure memplan models in transformers' code only (``--impl hf``):
    ``ModelConfig.hf_only``'s, and partial rotary / parallel residual (``check_setup``)."""
    names = [name for name, used in m.hf_only.items() if used]
    return names + [
        n
        for n, used in (("rotary_pct", m.rotary_pct < 1), ("parallel_residual", m.parallel_residual))
        if used
    ]


def hf_only_code(m: ModelConfig) -> str:
    """ "``m``'s … only in transformers' code" when ``hf_code_only`` names fields (then no --impl but hf
    runs it, and a refusal of hf's can only be mended by dropping the setting), else ""."""
    only = hf_code_only(m)
    return f"{m.name}'s {', '.join(only)} only in transformers' code" if only else ""


def default_impl(m: ModelConfig) -> Impl:
    """``--impl`` when it is not given: memplan's reference model, or transformers' code (``hf``) for a model
    with structure only that is modelled for (``hf_code_only``: MLA, softcaps, sliding-window patterns,
    Llama 4's chunked attention, …), which the reference would refuse."""
    return Impl.HF if hf_code_only(m) else Impl.REFERENCE


def no_flash(m: ModelConfig, impl: Impl, device: Device) -> str | None:
    """Why the model's code runs no flash attention that memplan models, or None: transformers has no
    SDPA path with Gemma-2's softcaps or gpt-oss's sinks (``Gemma2PreTrainedModel._supports_sdpa =
    False``, ``GptOssPreTrainedModel._supports_sdpa = False``: eager only), and torch's CUDA SDPA runs
    DeepSeek's MLA (v narrower than q, k) in its memory-efficient kernel, not modelled. What refuses
    ``--attention flash`` there (``check_hf_only``, ``blocks.hf.deepseek``) and what ``--attention``
    defaults to eager for (``default_attention``)."""
    if impl is Impl.HF and m.attn_softcap is not None:
        return "transformers has no SDPA path with attn_softcap (Gemma-2)"
    if impl is Impl.HF and m.attn_sinks:
        return "transformers has no SDPA path with attention sinks (gpt-oss)"
    if m.mla is not None and device is Device.CUDA:
        return (
            f"torch's CUDA SDPA runs {m.code_family.value}'s MLA (v narrower than q, k) in its "
            "memory-efficient kernel, not modelled"
        )
    return None


def default_attention(m: ModelConfig, impl: Impl, device: Device) -> Attention:
    """``--attention`` when it is not given: flash, or eager where the model's code runs no flash path
    memplan models (``no_flash``)."""
    return Attention.EAGER if no_flash(m, impl, device) else Attention.FLASH


_USED: list[tuple[ModelConfig, tuple[str, ...]]] = []
"""``hf_only_used``'s last model (by identity: a ``ModelConfig`` is frozen) and its answer."""


def hf_only_used(m: ModelConfig) -> tuple[str, ...]:
    """The ``ModelConfig.hf_only`` structures ``m`` uses, in their order; the last model's answer kept
    (``fit`` checks thousands of setups of one model: the dict of two dozen entries was 1.6 % of its
    405B search)."""
    if _USED and _USED[0][0] is m:
        return _USED[0][1]
    used = tuple(name for name, on in m.hf_only.items() if on)
    _USED[:] = [(m, used)]
    return used


def check_hf_only(setup: Setup) -> None:
    """Structure only transformers' code has (``ModelConfig.hf_only``) needs ``--impl hf`` and a family
    whose code has it; softcapped attention runs eager only (``Gemma2PreTrainedModel._supports_sdpa =
    False``). SDPA with a window ≤ seq on alternating layers: the two layer kinds' saves differ
    (``blocks.attention.full_layer_setup``)."""
    m, impl = setup.model, setup.impl.impl
    for name in hf_only_used(m):
        if impl is not Impl.HF:
            raise ValueError(f"{name}: modelled for transformers' code only; add --impl hf or drop it")
        families = HF_STRUCTURE.get(name, ())
        if m.code_family not in families:
            names = ", ".join(f.value for f in families)
            raise ValueError(f"{name}: transformers' {m.code_family.value} code has none; set family {names}")
    why = no_flash(m, impl, setup.device)
    if why is not None and m.mla is None and setup.strategy.attention is not Attention.EAGER:
        raise ValueError(f"attention: {why}; use --attention eager")  # MLA: its profile's error
    if m.attn_sinks and m.attn_dropout > 0:
        raise ValueError("attn_dropout: dropout with attention sinks is not modelled; set it to 0")


_LN_CODE = (
    Family.GPT2,
    Family.GPT_NEOX,
    Family.STARCODER2,
    Family.COHERE,
    Family.STABLELM,
    Family.FALCON,
    Family.PHIMOE,
)
"""The transformers families whose decoder layers are LayerNorms (the others: RMSNorm)."""
_GELU_CODE = (Family.GPT2, Family.GPT_NEOX, Family.STARCODER2, Family.FALCON)
"""The transformers families whose MLP is fc → GELU → fc (the others: gated, SwiGLU's matrices)."""
_LAYOUT_CODE = {
    "parallel_residual": (Family.GPT_NEOX, Family.COHERE, Family.STABLELM, Family.FALCON),
    "rotary_pct": (Family.GPT_NEOX, Family.STABLELM, Family.GLM),
}
"""The families whose code has a parallel layer, and a partial rotary (``ModelConfig.rotary_pct`` < 1)."""


def check_qk_norm(m: ModelConfig) -> None:
    """``qk_norm`` as the family's transformers code has it: Qwen3's always, Llama's, Mistral's and
    Qwen2's never; OLMo-2's over the whole projection widths, with its post-norm-only layout."""
    family = m.code_family
    if family in (Family.QWEN3, Family.QWEN3_MOE) and not m.qk_norm:
        raise ValueError(
            f"qk_norm: Qwen3's code always normalises q and k; set qk_norm true for family {family.value}"
        )
    olmo2 = m.qk_norm_whole and m.post_norms and not m.pre_norms
    if family is Family.OLMO2 and not olmo2:
        raise ValueError(
            "post_norms: OLMo-2's code normalises after attention and the MLP only, and q and k over "
            "their whole width; set post_norms true, pre_norms false, qk_norm and qk_norm_whole true"
        )
    if family in (Family.COHERE, Family.STABLELM) and m.qk_norm != m.qk_norm_whole:
        raise ValueError(
            f"qk_norm_whole: {family.value}'s q/k norms have [heads, d] weights; "
            "set qk_norm and qk_norm_whole alike"
        )
    no_qk_norm = (Family.LLAMA, Family.MISTRAL, Family.QWEN2, Family.GRANITE, Family.STARCODER2, Family.GLM)
    if m.qk_norm and family in (*no_qk_norm, Family.FALCON, Family.GPT2, Family.GPT_NEOX, Family.PHI3):
        raise ValueError(
            f"qk_norm: {family.value}'s code has no q_norm/k_norm; set family qwen3 or qk_norm false"
        )


def check_family_layout(m: ModelConfig) -> None:
    """The norm, the MLP, a parallel layer and a partial rotary as the family's transformers code has
    them: a layout its code cannot run is an error, not an estimate of other code."""
    family = m.code_family
    norm = NormType.LAYERNORM if family in _LN_CODE else NormType.RMSNORM
    if m.norm is not norm:
        raise ValueError(
            f"norm: transformers' {family.value} code has {norm.value}; set norm = '{norm.value}'"
        )
    mlp = MlpType.GELU if family in _GELU_CODE else MlpType.SWIGLU
    if m.mlp is not mlp and m.moe is None:  # a mixture's experts: blocks.hf.moe.check
        raise ValueError(
            f"mlp: transformers' {family.value} code has a {mlp.value} MLP; set mlp = '{mlp.value}'"
        )
    used = {"parallel_residual": (m.parallel_residual, "false"), "rotary_pct": (m.rotary_pct < 1, "1")}
    for name, (on, off) in used.items():
        if on and family not in _LAYOUT_CODE[name]:
            names = ", ".join(f.value for f in _LAYOUT_CODE[name])
            raise ValueError(
                f"{name}: transformers' {family.value} code has none ({names} do); set {name} {off}"
            )


def check_flash_attn(setup: Setup) -> None:
    """``--flash-attn`` is transformers' flash_attention_2: the hf profile's, a flash kernel, on CUDA."""
    if setup.impl.impl is not Impl.HF:
        raise ValueError("flash_attn: --flash-attn is transformers' flash_attention_2; add --impl hf")
    if setup.strategy.attention is not Attention.FLASH:
        raise ValueError("flash_attn: flash_attention_2 is a flash kernel; use --attention flash")
    if setup.device is not Device.CUDA:
        raise ValueError("flash_attn: the flash-attn package runs on CUDA only; use --device cuda")
