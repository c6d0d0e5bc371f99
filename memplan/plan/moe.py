"""Mixture of experts: routed experts with top-k routing, shared experts, a capacity factor.

``MoEConfig`` sits beside ``ModelConfig`` (which forbids extra fields): the model's ``ffn_size`` is the
width of ONE routed expert; every layer's MLP is replaced by a router (h×E, no bias), E routed experts of
that width (each a full MLP of the model's kind) and optionally shared experts every token goes through.

Parameters (Jiang et al. 2024, Mixtral; Qwen1.5-MoE): total counts all E experts, active the k a token is
routed to plus everything else (router included), which is what 6N counts (``six_n`` uses the active N).

Activations follow the Hugging Face modules (``MixtralSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock``) with
Megatron-Core's sort-based dispatch, as the reference model (memplan/measure/moe.py) runs them, with
T = b·s tokens and S expert slots (T·k when dropless; E·⌈c·T·k/E⌉ with capacity factor c, the slots of
token-dropping Megatron/GShard with padding to capacity):
- router: linear on the MLP input (already kept as ``mlp.input``), softmax in fp32 → saves [T, E] fp32;
  top-k → saves its [T, k] int64 indices; renormalised (``norm_topk_prob``: Mixtral) the division saves
  the top-k probabilities [T, k] and their sum [T, 1], fp32;
- dispatch: the slots sorted by expert; ``hidden.index_select(token)`` saves the token of each slot [S]
  int64 (index_add's backward reuses it), the routing-weight gather the slot order [S] int64;
- each expert: its input [S, h] and, like a dense MLP, gate / act / up / down-input [S, f] (SwiGLU), one
  tensor per name (the experts' outputs concatenated, as a grouped GEMM lays them out);
- combine: ``expert(x) · weight`` saves the expert output [S, h] and the weight [S, 1]; ``index_add_``
  back to the tokens keeps its source, the product [S, h] (its backward reads the shape via expand_as);
- shared experts: a dense MLP of width n·f_s on every token, and with a shared gate (Qwen2-MoE)
  ``sigmoid(x·w_g) · shared(x)`` saves the sigmoid [T, 1] and the shared output [T, h].

Checked against autograd: per tensor name and per FLOP phase, the estimate equals the reference model's
measurement (tests/measure/test_moe.py: no / full / selective / every-k checkpointing, flash and eager,
SwiGLU and GELU experts, shared experts with and without a gate; real tiny tensors and fake ones at
Mixtral-8x7B's size).

Known limitations (NB): routing is assumed balanced (each device of an expert-parallel group processes
S slots on average; the most loaded expert can take more; on one device the split changes no total);
the capacity factor's token dropping is estimated but not measured (the reference model refuses it);
the router's auxiliary loss and the MoE backward's extra gradient buffers beyond one expert MLP's are
not counted; tensor and sequence parallelism are not measured (plan/shard.py's rules for the MoE names).
"""

from __future__ import annotations

import math
from typing import Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from memplan.analytic import activations as act
from memplan.analytic.flops import Flops, mm
from memplan.analytic.inventory import Dims, Kept, Scope
from memplan.analytic.params import count_params, mlp_params
from memplan.config import DType, MlpType, ModelConfig, Setup


class MoEConfig(BaseModel):
    """Mixture-of-experts fields of a model (``[moe]`` in a preset file)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    experts: int = Field(ge=2, le=1 << 16, description="routed experts E per layer")
    top_k: int = Field(ge=1, description="experts each token is routed to")
    shared_experts: int = Field(default=0, ge=0, description="experts every token goes through")
    shared_ffn: int | None = Field(
        default=None, gt=0, description="width of each shared expert; = the routed expert's ffn_size"
    )
    shared_gate: bool = Field(default=False, description="sigmoid gate h→1 on the shared output (Qwen2-MoE)")
    capacity_factor: float | None = Field(
        default=None, gt=0, description="expert capacity c·T·k/E slots (token dropping); none: dropless"
    )
    norm_topk_prob: bool | None = Field(
        default=None,
        description="renormalise the top-k probabilities to sum to 1; none: as the imported families do "
        "(Mixtral always; Qwen2-MoE, which has shared experts, by default not)",
    )

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.top_k > self.experts:
            raise ValueError(f"top_k: {self.top_k} exceeds the {self.experts} experts; use top_k ≤ experts")
        if (self.shared_ffn is not None or self.shared_gate) and self.shared_experts == 0:
            raise ValueError(
                "shared_experts: shared_ffn / shared_gate need shared_experts ≥ 1; set it or drop them"
            )
        return self

    @property
    def renormalises(self) -> bool:
        """Whether the top-k probabilities are divided by their sum (``norm_topk_prob``, derived when unset:
        Mixtral renormalises, Qwen2-MoE's ``norm_topk_prob`` defaults to false)."""
        return self.shared_experts == 0 if self.norm_topk_prob is None else self.norm_topk_prob

    def shared_width(self, model: ModelConfig) -> int:
        """Width of all shared experts together, n·f_s (0 without shared experts)."""
        return self.shared_experts * (self.shared_ffn or model.ffn)

    def widths(self, model: ModelConfig) -> tuple[int, ...]:
        """MLP widths tensor parallelism must divide beside ``ffn_size``."""
        return (self.shared_ffn,) if self.shared_experts and self.shared_ffn else ()

    def for_tp(self, tp: int) -> MoEConfig:
        """This MoE as one tensor-parallel rank holds it (shared width split like the experts' f/t)."""
        if tp == 1 or self.shared_ffn is None:
            return self
        return self.model_copy(update={"shared_ffn": self.shared_ffn // tp})

    def slots(self, tokens: int) -> int:
        """Expert slots S for T tokens: T·k dropless, or E·⌈(T·k/E)·c⌉ padded to capacity (Megatron-Core
        ``moe_utils.get_capacity``: ``math.ceil((num_tokens / num_experts) * capacity_factor)``)."""
        routed = tokens * self.top_k
        if self.capacity_factor is None:
            return routed
        return self.experts * math.ceil((routed / self.experts) * self.capacity_factor)

    def label(self) -> str:
        shared = f"+{self.shared_experts} shared" if self.shared_experts else ""
        return f"{self.experts} experts top-{self.top_k}{shared}"


# ----------------------------------------------------------------------------------------------------
# Parameters
# ----------------------------------------------------------------------------------------------------
class MoELayerParams(BaseModel):
    """One MoE layer's MLP parameters, split by who shards them: dense (ZeRO over dp) vs routed experts."""

    model_config = ConfigDict(frozen=True)
    router: int
    expert: int
    """One routed expert's MLP."""
    shared: int
    """All shared experts and their gate."""

    def dense(self) -> int:
        return self.router + self.shared

    def local_experts(self, moe: MoEConfig, ep: int) -> int:
        """Routed-expert parameters on one expert-parallel rank (E/ep experts)."""
        return self.expert * (moe.experts // ep)


def moe_layer_params(model: ModelConfig, moe: MoEConfig) -> MoELayerParams:
    """Router h×E, one routed expert (an MLP of the model's kind and ffn_size), shared experts and gate."""
    h = model.hidden_size
    width = moe.shared_width(model)
    shared = mlp_params(model.model_copy(update={"ffn_size": width})) if width else 0
    return MoELayerParams(
        router=h * moe.experts,
        expert=mlp_params(model),
        shared=shared + (h if moe.shared_gate else 0),
    )


class MoEParamCount(BaseModel):
    model_config = ConfigDict(frozen=True)
    total: int
    active: int
    per_layer: int
    """One transformer layer, every expert included."""


def param_counts(model: ModelConfig, moe: MoEConfig | None) -> MoEParamCount:
    """Total and active parameters of the whole model (equal for a dense one)."""
    if moe is None:
        dense = count_params(model)
        return MoEParamCount(total=dense.total, active=dense.total, per_layer=dense.layer.total)
    return count_moe_params(model, moe)


def count_moe_params(model: ModelConfig, moe: MoEConfig) -> MoEParamCount:
    """Total (all experts) and active (top-k experts) parameters of the whole model."""
    base = count_params(model)
    layer = moe_layer_params(model, moe)
    rest = base.total - base.num_layers * base.layer.mlp  # everything but the dense MLPs
    return MoEParamCount(
        total=rest + base.num_layers * (layer.dense() + moe.experts * layer.expert),
        active=rest + base.num_layers * (layer.dense() + moe.top_k * layer.expert),
        per_layer=base.layer.total - base.layer.mlp + layer.dense() + moe.experts * layer.expert,
    )


# ----------------------------------------------------------------------------------------------------
# Activations
# ----------------------------------------------------------------------------------------------------
DENSE_MLP_INNER = ("mlp.gate", "mlp.act", "mlp.up", "mlp.down_input")
FP32, INT64 = DType.FP32, DType.INT64


def _mlp_inner(setup: Setup, dims: Dims, prefix: str, rows: int, width: int) -> list[act.Rule]:
    """An MLP's inner saves over ``rows`` tokens: ``activations.mlp_rules`` (its input dropped, since the
    MoE layer keeps that once as ``mlp.input`` or ``moe.expert_input``), renamed, laid out [rows, width]."""
    dense = act.mlp_rules(setup, dims.model_copy(update={"b": 1, "s": rows, "f": width}))
    return [(prefix + name.removeprefix("mlp"), (rows, width), dt, why) for name, _, dt, why in dense[1:]]


def moe_rules(setup: Setup, moe: MoEConfig) -> list[tuple[str, tuple[int, ...], DType, str]]:
    """What one MoE layer keeps beyond ``mlp.input`` (which the router, experts and shared experts share)."""
    dims = Dims.of(setup)
    t, h, a = dims.tokens, dims.h, dims.act
    s = moe.slots(t)
    k = moe.top_k
    rules: list[act.Rule] = [
        ("moe.router_probs", (t, moe.experts), FP32, "router softmax in fp32: its backward needs the output"),
        ("moe.topk_indices", (t, k), INT64, "top-k backward scatters into [T, E] at these indices"),
    ]
    if moe.renormalises:  # weights / weights.sum(-1, keepdim=True), in fp32 before the cast
        rules += [
            ("moe.topk_sum", (t, 1), FP32, "sum of the top-k probabilities, divisor: d(numerator) needs it"),
            ("moe.topk_weights", (t, k), FP32, "top-k probabilities, dividend: d(divisor) needs them"),
        ]
    rules += [
        ("moe.weight_index", (s,), INT64, "top-k slot of each expert slot: the weight gather's backward"),
        ("moe.dispatch_index", (s,), INT64, "token of each expert slot: gather / index_add backward"),
        ("moe.expert_input", (s, h), a, "tokens dispatched to the experts, input of W_gate/W_up"),
        *_mlp_inner(setup, dims, "moe", s, dims.f),
        ("moe.expert_output", (s, h), a, "expert output × routing weight: d(weight) needs it"),
        ("moe.routing_weights", (s, 1), a, "routing weight of each slot: d(expert output) needs it"),
        ("moe.weighted_output", (s, h), a, "source of index_add_: its backward (expand_as) keeps it"),
    ]
    width = moe.shared_width(setup.model)
    if width:
        rules += _mlp_inner(setup, dims, "moe.shared", t, width)
    if moe.shared_gate:
        rules += [
            ("moe.shared_gate", (t, 1), a, "sigmoid of the shared-expert gate: d(shared output) needs it"),
            ("moe.shared_output", (t, h), a, "shared experts' output × gate: d(gate) needs it"),
        ]
    return rules


def with_moe(kept: list[Kept], setup: Setup, moe: MoEConfig | None) -> list[Kept]:
    """The inventory with each layer's dense MLP inner saves replaced by the MoE layer's (same count)."""
    if moe is None:
        return kept
    out: list[Kept] = []
    done = False
    for k in kept:
        if k.scope is not Scope.LAYER or k.name not in DENSE_MLP_INNER:
            out.append(k)
            continue
        if not done:
            out += [
                Kept(name=n, shape=sh, dtype=dt, scope=Scope.LAYER, count=k.count, reason=why)
                for n, sh, dt, why in moe_rules(setup, moe)
            ]
            done = True
    return out


# ----------------------------------------------------------------------------------------------------
# FLOPs
# ----------------------------------------------------------------------------------------------------
def mlp_forward_delta(setup: Setup, moe: MoEConfig) -> int:
    """Forward FLOPs of one MoE layer's MLP minus the dense MLP's (router, S expert slots, shared)."""
    dims = Dims.of(setup)
    t, h, f = dims.tokens, dims.h, dims.f
    mats = 3 if setup.model.mlp is MlpType.SWIGLU else 2
    moe_mlp = mm(t, h, moe.experts) + mats * mm(moe.slots(t), h, f)
    moe_mlp += mats * mm(t, h, moe.shared_width(setup.model)) + (mm(t, h, 1) if moe.shared_gate else 0)
    return moe_mlp - mats * mm(t, h, f)


def with_moe_flops(f: Flops, setup: Setup, moe: MoEConfig | None) -> Flops:
    """Whole-model FLOPs of one micro-batch with every MLP an MoE layer: backward 2× the forward change;
    recompute changes with it when whole layers are re-run (full / every-k checkpointing, reversible)."""
    if moe is None:
        return f
    delta = setup.model.num_layers * mlp_forward_delta(setup, moe)
    rerun = bool(setup.strategy.segment) or setup.strategy.reversible
    return f.model_copy(
        update={
            "forward": f.forward + delta,
            "backward": f.backward + 2 * delta,
            "recompute": f.recompute + (delta if rerun else 0) + early_stop_delta(setup, moe),
            "layer_linear": f.layer_linear + delta,
        }
    )


def early_stop_delta(setup: Setup, moe: MoEConfig) -> int:
    """Recompute FLOPs MoE layers add back: what the checkpoint's early stop skips in a dense segment
    (``flops.recompute_flops``: a segment whose last save is W_down's input never re-runs W_down, [T, f]·
    [f, h]) minus what it skips in an MoE one, per segment.

    A segment's last save is the last layer's last one: without residual dropout, the shared gate's product
    (nothing skipped), else the shared experts' W_down input (their W_down, [T, n·f_s]·[n·f_s, h], is
    skipped), else the routed combine (``index_add_``: nothing skipped). With residual dropout the mask is
    saved after everything runs in either case. Reversible layers re-run everything (no early stop).
    """
    segment = setup.strategy.segment
    if not segment or setup.model.resid_dropout > 0:
        return 0
    dims = Dims.of(setup)
    t, h = dims.tokens, dims.h
    width = moe.shared_width(setup.model)
    skipped = mm(t, width, h) if width and not moe.shared_gate else 0
    segments = -(-dims.layers // segment)
    return segments * (mm(t, dims.f, h) - skipped)


def mlp_backward_extra(setup: Setup, moe: MoEConfig | None) -> int:
    """What the MLP backward's [T, f] gradient buffers (``peak.mlp_backward_transient``) grow by when the
    experts' gate/up/product gradients cover S slots instead of T tokens."""
    if moe is None:
        return 0
    dims = Dims.of(setup)
    buffers = 3 if setup.model.mlp is MlpType.SWIGLU else 2
    return buffers * (moe.slots(dims.tokens) - dims.tokens) * dims.f * dims.act.bytes
