"""A mixture of experts (``ModelConfig.moe``, ``[model.moe]`` in a preset file): every MoE layer's MLP becomes
a router, E routed experts of the model's ``ffn_size`` (the width of ONE routed expert) and optional shared
experts (Jiang et al. 2024, Mixtral; Qwen1.5-MoE; DeepSeek-V2/V3's dense first layers and group-limited
routing; gpt-oss's biases; PhiMoE's input jitter; Llama 4's sigmoid-scaled inputs).

Known limitations: NB the routing itself is data-dependent; the estimate assumes dropless routing
(``slots``: T·k) unless ``capacity_factor`` pads every expert to its capacity.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import TYPE_CHECKING, Self

from pydantic import Field, model_validator

from memplan.config._base import Frozen

if TYPE_CHECKING:
    from memplan.config.model import ModelConfig


class RouterScoring(StrEnum):
    """How the router turns its logits into scores."""

    SOFTMAX = "softmax"
    """softmax over the E experts in fp32 (Mixtral, Qwen-MoE, DeepSeek-V2)."""
    SIGMOID = "sigmoid"
    """an independent sigmoid per expert, plus a correction bias for the choice only (DeepSeek-V3)."""


class MoEConfig(Frozen):
    """Mixture-of-experts fields of a model (``[model.moe]`` in a preset file): every layer's MLP is a
    router (h×E, no bias), E routed experts of the model's ``ffn_size`` and optional shared experts."""

    experts: int = Field(strict=True, ge=2, le=1 << 16, description="routed experts E per layer")
    top_k: int = Field(strict=True, ge=1, description="experts each token is routed to")
    shared_experts: int = Field(strict=True, default=0, ge=0, description="experts every token goes through")
    shared_ffn: int | None = Field(
        strict=True,
        default=None,
        gt=0,
        description="width of each shared expert; = the routed expert's ffn_size",
    )
    shared_gate: bool = Field(default=False, description="sigmoid gate h→1 on the shared output (Qwen2-MoE)")
    router_bias: bool = Field(default=False, description="the router h→E has a bias, E parameters (gpt-oss)")
    expert_bias: bool = Field(
        default=False, description="each routed expert's gate/up and down carry biases, 2f + h (gpt-oss)"
    )
    input_jitter: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="PhiMoE's input_jitter_noise ε: in training the MLP input is multiplied in place by "
        "uniform(1 − ε, 1 + ε) noise twice (the block, then the router), each [T, h] noise kept",
    )
    dense_layers: int = Field(
        strict=True,
        default=0,
        ge=0,
        description="the first k layers keep a dense MLP of dense_ffn (DeepSeek's first_k_dense_replace)",
    )
    dense_ffn: int | None = Field(
        strict=True,
        default=None,
        gt=0,
        description="MLP width of the dense_layers (DeepSeek's intermediate_size)",
    )
    scoring: RouterScoring = Field(
        default=RouterScoring.SOFTMAX, description="router scores: softmax over E, or sigmoid (DeepSeek-V3)"
    )
    groups: int | None = Field(
        strict=True,
        default=None,
        ge=1,
        description="group-limited routing: experts in n groups, top-k chosen within topk_groups of them "
        "(DeepSeek's n_group); none: plain top-k",
    )
    topk_groups: int | None = Field(
        strict=True,
        default=None,
        ge=1,
        description="groups a token's experts come from (DeepSeek's topk_group)",
    )
    router_sigmoid: bool = Field(
        default=False,
        description="sigmoid of the top-k router logits scales each expert's input, not its output "
        "(Llama 4's Llama4Router); --impl hf",
    )
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
        self._check_deepseek()
        if (self.shared_ffn is not None or self.shared_gate) and self.shared_experts == 0:
            raise ValueError(
                "shared_experts: shared_ffn / shared_gate need shared_experts ≥ 1; set it or drop them"
            )
        return self

    def _check_deepseek(self) -> None:
        """DeepSeek's dense first layers and group-limited routing, as its config classes allow them."""
        if self.dense_layers and self.dense_ffn is None:
            raise ValueError("dense_ffn: dense_layers need the dense MLP's width; set dense_ffn")
        if (self.groups is None) != (self.topk_groups is None):
            raise ValueError(
                "groups: group-limited routing needs both groups and topk_groups; set both or neither"
            )
        if self.groups is not None and self.topk_groups is not None:
            if self.experts % self.groups or self.topk_groups > self.groups:
                raise ValueError(
                    f"groups: {self.groups} groups must divide the {self.experts} experts and be ≥ "
                    f"topk_groups {self.topk_groups}; choose a divisor"
                )
            if self.top_k > self.topk_groups * (self.experts // self.groups):
                raise ValueError(
                    "top_k: more experts than the topk_groups hold; raise topk_groups or lower top_k"
                )

    @property
    def sigmoid(self) -> bool:
        """Sigmoid router scores (DeepSeek-V3's ``scores = router_logits.sigmoid()``)."""
        return self.scoring is RouterScoring.SIGMOID

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
        ``moe_utils.get_capacity``: ``math.ceil((num_tokens / num_experts) * capacity_factor)``); with
        ``router_sigmoid`` E·T, every token through every expert (Llama 4's code, ``Llama4TextMoe``)."""
        if self.router_sigmoid:
            return tokens * self.experts
        routed = tokens * self.top_k
        if self.capacity_factor is None:
            return routed
        return self.experts * math.ceil((routed / self.experts) * self.capacity_factor)

    def label(self) -> str:
        shared = f"+{self.shared_experts} shared" if self.shared_experts else ""
        return f"{self.experts} experts top-{self.top_k}{shared}"
