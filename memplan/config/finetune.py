"""Fine-tuning: which parameters train. Full training (the default), LoRA adapters on a frozen base (Hu et
al. 2021) or QLoRA's adapters on a 4-bit base (Dettmers et al. 2023), and freezing parts of the model.

LoRA replaces a linear's update by B·A (A [r, in], B [out, r], no bias) scaled by α/r, as peft's
``LoraConfig(r, lora_alpha, lora_dropout, target_modules)`` does; the base weights do not train. Target
names follow Llama's modules (q, k, v, o, gate, up, down); a GELU MLP (GPT-2, GPT-NeoX) has ``up`` (fc1,
c_fc, dense_h_to_4h) and ``down`` (fc2, c_proj, dense_4h_to_h) only. ``all-linear`` is peft's spelling of
every linear layer but the output head.

QLoRA stores each base linear as bitsandbytes' ``Linear4bit`` (NF4 or FP4, blocks of 64 weights, optionally
double-quantised absmax) and computes in ``compute_dtype``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum, StrEnum
from typing import Any, Self

from pydantic import Field, ValidationError, model_validator

from memplan.config._base import Frozen
from memplan.config.impl import Family
from memplan.config.model import MlpType, ModelConfig
from memplan.config.training import DType
from memplan.errors import describe_validation_error


class Method(IntEnum):
    """How the model is fine-tuned, ordered by the model-state memory it saves."""

    FULL = 0
    """Every parameter (but the frozen parts) trains: gradients, master weights and optimizer states for
    all of them."""
    LORA = 1
    """Low-rank adapters B·A on the targeted linears train; the base is frozen in the weight dtype."""
    QLORA = 2
    """LoRA on a base stored in 4 bits (bitsandbytes ``Linear4bit``), dequantised layer by layer."""


class MethodChoice(StrEnum):
    """The ``--finetune`` values; ``Method`` is an ordered IntEnum, this is its spelling in options."""

    FULL = "full"
    LORA = "lora"
    QLORA = "qlora"

    @property
    def method(self) -> Method:
        return Method[self.name]


class Target(StrEnum):
    """A linear LoRA adapts (Llama's module names without ``_proj``)."""

    Q = "q"
    K = "k"
    V = "v"
    O = "o"  # noqa: E741 - the attention output projection's name
    GATE = "gate"
    UP = "up"
    DOWN = "down"


ALL_LINEAR = tuple(Target)
"""peft's ``all-linear``: every linear of every layer, the lm head excepted."""
ATTN_TARGETS = (Target.Q, Target.K, Target.V, Target.O)
"""The attention's linears."""
MLP_TARGETS = frozenset({Target.GATE, Target.UP, Target.DOWN})
"""The MLP's linears (a mixture of experts' experts)."""


class Quant(StrEnum):
    """bitsandbytes' 4-bit data types (``bnb_4bit_quant_type``)."""

    NF4 = "nf4"
    """4-bit NormalFloat: 16 levels at the quantiles of N(0, 1) (Dettmers et al. 2023, §3)."""
    FP4 = "fp4"
    """4-bit float (1 sign, 2 exponent, 1 mantissa bits)."""


QUANT_BLOCK = 64
"""Weights per absmax block (bitsandbytes' ``Params4bit`` default blocksize, what QLoRA uses)."""
QUANT_BLOCK2 = 256
"""First-level absmax values per second-level block under double quantisation (bitsandbytes)."""


class FineTune(Frozen):
    """Which parameters train and how the frozen base is stored."""

    method: Method = Method.FULL
    rank: int = Field(default=8, gt=0, le=1 << 16, description="LoRA rank r")
    alpha: float = Field(default=16.0, gt=0, le=1 << 20, description="LoRA α (the update is scaled by α/r)")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="dropout on each adapter's input")
    targets: tuple[Target, ...] = Field(default=(Target.Q, Target.V), min_length=1)
    """peft's default for Llama: q_proj and v_proj."""
    freeze_embeddings: bool = False
    freeze_lm_head: bool = False
    freeze_layers: tuple[int, int] | None = None
    """First and last frozen layer (inclusive), counted from 0."""
    quant: Quant = Quant.NF4
    double_quant: bool = False
    compute_dtype: DType = DType.BF16

    @model_validator(mode="after")
    def _check(self) -> Self:
        if len(set(self.targets)) != len(self.targets):
            raise ValueError("lora-targets: a target is named twice; name each of q,k,v,o,gate,up,down once")
        if self.freeze_layers is not None and not 0 <= self.freeze_layers[0] <= self.freeze_layers[1]:
            raise ValueError("freeze: layers:A-B needs 0 ≤ A ≤ B, e.g. --freeze layers:0-15")
        if self.method is not Method.FULL and (self.freeze_embeddings or self.freeze_lm_head):
            raise ValueError(
                "freeze: LoRA already freezes the embeddings and the lm head; "
                "with --finetune lora|qlora use --freeze layers:A-B only"
            )
        if self.compute_dtype not in (DType.BF16, DType.FP16, DType.FP32):
            raise ValueError("compute_dtype: choose bf16, fp16 or fp32")
        return self

    @property
    def lora(self) -> bool:
        return self.method >= Method.LORA

    @property
    def trains_everything(self) -> bool:
        """Plain full training: every existing number applies unchanged (LoRA's settings unused)."""
        frozen = self.freeze_embeddings or self.freeze_lm_head or self.freeze_layers is not None
        return self.method is Method.FULL and not frozen

    def label(self) -> str:
        """``lora r8 q+v`` style summary for tables (``full`` for plain full training)."""
        text = self.method.name.lower()
        if self.lora:
            targets = "all-linear" if set(self.targets) == set(ALL_LINEAR) else "+".join(self.targets)
            text += f" r{self.rank} {targets}"
        if self.method is Method.QLORA:
            text += f" {self.quant.value}{'+dq' if self.double_quant else ''}"
        if self.freeze_embeddings or self.freeze_lm_head or self.freeze_layers:
            text += " (frozen parts)"
        return text

    def layer_frozen(self, i: int) -> bool:
        """Whether layer ``i`` is in ``--freeze layers:A-B`` (no adapters there under LoRA)."""
        f = self.freeze_layers
        return f is not None and f[0] <= i <= f[1]


FULL_TRAINING = FineTune()


def parse_targets(text: str) -> tuple[Target, ...]:
    """``q,v`` or ``all-linear`` → targets; a one-line ValueError naming the choices."""
    t = text.strip().lower()
    if t == "all-linear":
        return ALL_LINEAR
    # "+" separates too: compare --vary splits its values on commas (--vary lora-targets=q+v,all-linear).
    names = [n.strip().removesuffix("_proj") for n in t.replace("+", ",").split(",") if n.strip()]
    bad = [n for n in names if n not in {x.value for x in Target}]
    if bad or not names:
        raise ValueError(
            f"lora-targets: unknown {', '.join(bad) or repr(text)}; give some of q,k,v,o,gate,up,down "
            "(separated by , or +) or all-linear"
        )
    return tuple(Target(n) for n in names)


def parse_freeze(text: str) -> dict[str, object]:
    """``embeddings,lm_head,layers:0-15`` → the ``FineTune`` freeze fields; one-line errors."""
    out: dict[str, object] = {}
    for part in (p.strip().lower() for p in text.split(",") if p.strip()):
        if part == "embeddings":
            out["freeze_embeddings"] = True
        elif part in ("lm_head", "lm-head"):
            out["freeze_lm_head"] = True
        elif part.startswith("layers:"):
            a, sep, b = part.removeprefix("layers:").partition("-")
            if not a.isdigit() or (sep and not b.isdigit()):
                raise ValueError(f"freeze: cannot read {part!r}; write layers:A-B, e.g. layers:0-15")
            out["freeze_layers"] = (int(a), int(b) if sep else int(a))
        else:
            raise ValueError(
                f"freeze: unknown {part!r}; give embeddings, lm_head and/or layers:A-B (comma-separated)"
            )
    return out


FINETUNE_OPTIONS = ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "freeze", "quant")
"""The options ``finetune_from`` reads (``api.Options`` fields), None when not given."""
_LORA_FIELDS = {"lora_rank": "rank", "lora_alpha": "alpha", "lora_dropout": "dropout"}


def finetune_from(method: Method, given: dict[str, Any], double_quant: bool, compute: DType) -> FineTune:
    """The ``FineTune`` of the fine-tuning options (``given``: ``FINETUNE_OPTIONS`` by name, None when not
    given); one-line errors for an option of another method. ``compute``: the activations' dtype, which
    bitsandbytes computes in under QLoRA (``bnb_4bit_compute_dtype``)."""
    for name in (*_LORA_FIELDS, "lora_targets"):
        if given.get(name) is not None and method < Method.LORA:
            flag = name.replace("_", "-")
            raise ValueError(
                f"{flag}: LoRA settings need --finetune lora or qlora; add one, or drop --{flag}"
            )
    if (given.get("quant") is not None or double_quant) and method is not Method.QLORA:
        raise ValueError("quant: --quant and --double-quant describe QLoRA's base; add --finetune qlora")
    fields: dict[str, Any] = {f: given[n] for n, f in _LORA_FIELDS.items() if given.get(n) is not None}
    if given.get("lora_targets") is not None:
        fields["targets"] = parse_targets(given["lora_targets"])
    if given.get("freeze") is not None:
        fields |= parse_freeze(given["freeze"])
    if method is Method.QLORA:
        fields |= {
            "quant": given.get("quant") or Quant.NF4,
            "double_quant": double_quant,
            "compute_dtype": compute,
        }
    try:
        return FineTune.model_validate({"method": method, **fields})
    except ValidationError as exc:  # the field's option and its fix, not pydantic's words
        raise ValueError(describe_validation_error(exc, under=("finetune",))) from None


def linear_shapes(model: ModelConfig) -> dict[Target, tuple[int, int]]:
    """(in, out) features of each linear of one layer (a GELU MLP has no gate: up and down only)."""
    h, qd, kvd, f = model.hidden_size, model.q_width, model.kv_width, model.ffn
    out = {
        Target.Q: (h, qd),
        Target.K: (h, kvd),
        Target.V: (h, kvd),
        Target.O: (qd, h),
        Target.GATE: (h, f),
        Target.UP: (h, f),
        Target.DOWN: (f, h),
    }
    if model.mlp is not MlpType.SWIGLU:
        del out[Target.GATE]
    return out


FUSED_LINEARS: dict[Family, tuple[tuple[Target, ...], ...]] = {
    Family.PHI3: ((Target.Q, Target.K, Target.V), (Target.GATE, Target.UP)),
    Family.GLM: ((Target.GATE, Target.UP),),
    Family.GPT2: ((Target.Q, Target.K, Target.V),),
    Family.GPT_NEOX: ((Target.Q, Target.K, Target.V),),
    Family.FALCON: ((Target.Q, Target.K, Target.V),),
}
"""memplan's linears that transformers' code of a family computes as one module (its output the
concatenation): ``Phi3Attention.qkv_proj`` [(a + 2·kv)·d, h], ``Phi3MLP.gate_up_proj`` and ``GlmMLP.
gate_up_proj`` [2·f, h] (modeling_phi3.py, modeling_glm.py), GPT-2's ``c_attn``, a ``Conv1D`` [h, 3h]
(modeling_gpt2.py), GPT-NeoX's and Falcon's ``query_key_value`` (modeling_gpt_neox.py, modeling_falcon.py).
peft adapts such a module whole: one A [r, h] and one B [out, r] for the group
(``adapter_modules``), where memplan's reference model has an adapter per linear. The forward's views of
the fused output are the profiles' (``blocks.hf.phi3``, ``blocks.hf.llama.glm``, ``blocks.hf.gpt2``:
``fused_qkv``, ``fused_gate_up``, ``qkv_views``)."""


@dataclass(frozen=True)
class Adapter:
    """One LoRA adapter as peft makes it: the module's linears (memplan's targets, one unless fused), A
    [r, fan_in] and B [fan_out, r]."""

    targets: tuple[Target, ...]
    fan_in: int
    fan_out: int

    @property
    def name(self) -> str:
        """Its saves' prefix: the target, or the fused module's (``qkv``, ``gate_up``)."""
        if self.targets == (Target.Q, Target.K, Target.V):
            return "qkv"
        return "_".join(t.value for t in self.targets)

    @property
    def attention(self) -> bool:
        return self.targets[0] in ATTN_TARGETS


def linear_modules(model: ModelConfig, fused: bool) -> list[tuple[int, int]]:
    """(in, out) features of one layer's linear modules: ``linear_shapes``, a fused group one module under
    ``fused`` (``FUSED_LINEARS``: what bitsandbytes quantises as one ``Linear4bit``)."""
    return [(a.fan_in, a.fan_out) for a in adapter_modules(model, fused, linear_shapes(model))]


def adapter_modules(model: ModelConfig, fused: bool, targets: Iterable[Target]) -> tuple[Adapter, ...]:
    """The adapters on one layer's ``targets``, in q, k, v, o, gate, up, down order; ``fused``: as peft
    adapts transformers' modules (``FUSED_LINEARS``: one adapter per fused group, whose targets are all
    adapted or none, ``finetune_rules.check_finetune``), else one per linear (memplan's reference model)."""
    shapes, wanted = linear_shapes(model), set(targets)
    groups = FUSED_LINEARS.get(model.code_family, ()) if fused else ()
    out: list[Adapter] = []
    for t in Target:  # all-linear names a gate a GELU MLP lacks: only the model's linears
        if t not in wanted or t not in shapes or any(t in a.targets for a in out):
            continue
        group = next((g for g in groups if t in g), (t,))
        out.append(Adapter(group, shapes[t][0], sum(shapes[g][1] for g in group)))
    return tuple(out)
