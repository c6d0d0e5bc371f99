"""The reference model's MLPs: the dense MLP and the mixture-of-experts block that replaces it.

The MoE block follows Hugging Face's ``MixtralSparseMoeBlock`` / ``Qwen2MoeSparseMoeBlock`` op for op where
they save something (router linear without bias; softmax in fp32; top-k; optional renormalisation of the
top-k probabilities; weights cast to the activation dtype; expert output × routing weight; ``index_add_``
back to the tokens; shared experts with a sigmoid gate), with the token dispatch of Megatron-Core's
sort-based permutation instead of HF's per-expert ``torch.where`` loop:

- the T·k slots (slot t·k + j: token t's j-th choice) are sorted by expert (a stable ``argsort``), the
  tokens gathered once into one [S, h] buffer in expert order (``index_select``, saving the token of each
  slot, ``moe.dispatch_index``), and the routing weights gathered in the same order (saving the slot order,
  ``moe.weight_index``: HF saves the same [S] int64 as its ``idx``);
- each expert runs on its slice of that buffer (views of one storage); its gate / up / down outputs are
  concatenated into one [S, ·] tensor per projection, the layout a grouped GEMM writes (Megatron-Core's
  ``GroupedMLP``, HF's ``grouped_mm`` experts), and the activation runs once over all slots. So one MoE
  layer keeps one tensor per name, whatever the routing.

Routing assumption: dropless (every slot is computed, S = T·k). Bytes and FLOPs do not depend on how the
tokens split among the experts: the buffers are [S, ·] and the experts' matmuls sum to 2·S·h·f each. On
real tensors the real per-expert counts are used; under ``FakeTensorMode`` and on the meta device they
cannot be read (routing is data), so the experts take S/E slots each (balanced, the estimate's stated
assumption; when E does not divide S the first S mod E experts take one slot more, which changes no total).

Known limitations: no capacity factor (token dropping and padding are refused with a ``ValueError``); no
router auxiliary / z-loss; HF's per-expert loop would keep E separate tensors per name (the same bytes).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

from memplan.config import GateActivation, MlpType, ModelConfig, MoEConfig
from memplan.measure.instruments.record import label


class Mlp(nn.Module):
    """An MLP of the model's kind and the given width: gate (SwiGLU only), up, down."""

    gate: nn.Linear
    up: nn.Linear
    down: nn.Linear

    def __init__(self, m: ModelConfig, width: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        h, bias = m.hidden_size, m.mlp_bias
        if m.mlp is MlpType.SWIGLU:
            self.gate = nn.Linear(h, width, bias=bias, dtype=dtype, device=device)
        self.up = nn.Linear(h, width, bias=bias, dtype=dtype, device=device)
        self.down = nn.Linear(width, h, bias=bias, dtype=dtype, device=device)


def gate_activation(m: ModelConfig) -> Callable[[Tensor], Tensor]:
    """The activation on a gated MLP's gate: SiLU, or GeGLU's tanh GELU (``gate_act``); each saves its
    input, so the saves are SwiGLU's either way."""
    if m.gate_act is GateActivation.GELU_TANH:
        return partial(F.gelu, approximate="tanh")
    return F.silu


def dense_mlp(mlp: Mlp, y: Tensor, m: ModelConfig, prefix: str) -> Tensor:
    """Gated down(act(gate(y))·up(y)) (SwiGLU, GeGLU) or GELU down(gelu(up(y))); saves named
    ``{prefix}.gate`` etc."""
    if m.mlp is MlpType.SWIGLU:
        gate = label(mlp.gate(y), f"{prefix}.gate")
        hidden = label(gate_activation(m)(gate), f"{prefix}.act") * label(mlp.up(y), f"{prefix}.up")
    else:
        hidden = F.gelu(label(mlp.up(y), f"{prefix}.up"), approximate="tanh")
    return mlp.down(label(hidden, f"{prefix}.down_input"))


def check_moe(moe: MoEConfig | None) -> None:
    """Raise a one-line ValueError for an MoE the reference model cannot run."""
    if moe is not None and moe.capacity_factor is not None:
        raise ValueError(
            "capacity_factor: the reference model routes dropless (no token dropping or padding); "
            "drop capacity_factor to measure"
        )


def expert_counts(expert_of_slot: Tensor, experts: int) -> list[int]:
    """Slots per expert: the real counts on real tensors; under fake tensors (routing is data, unreadable)
    balanced: S/E each, the first S mod E experts one more when E does not divide S."""
    if is_fake(expert_of_slot) or expert_of_slot.device.type == "meta":
        each, rest = divmod(expert_of_slot.numel(), experts)
        return [each + 1] * rest + [each] * (experts - rest)
    return [int(n) for n in torch.bincount(expert_of_slot, minlength=experts).tolist()]


def grouped(x: Tensor, linears: list[nn.Linear], counts: list[int]) -> Tensor:
    """One linear per expert on its slice of x (views), outputs concatenated: a grouped GEMM's [S, ·]."""
    return torch.cat([lin(part) for lin, part in zip(linears, x.split(counts), strict=True)])


class MoEMlp(nn.Module):
    """Router, E routed experts and the shared experts (and their gate) of one MoE layer."""

    def __init__(self, m: ModelConfig, moe: MoEConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.cfg, self.model, self.swiglu = moe, m, m.mlp is MlpType.SWIGLU
        h = m.hidden_size
        self.router = nn.Linear(h, moe.experts, bias=False, dtype=dtype, device=device)
        self.experts = nn.ModuleList(Mlp(m, m.ffn, dtype, device) for _ in range(moe.experts))
        width = moe.shared_width(m)
        self.shared = Mlp(m, width, dtype, device) if width else None
        gate = nn.Linear(h, 1, bias=False, dtype=dtype, device=device) if moe.shared_gate else None
        self.shared_gate = gate

    def forward(self, y: Tensor) -> Tensor:
        """[b, s, h] (the MLP input) → [b, s, h]."""
        x = y.view(-1, y.shape[-1])  # [T, h]: a view of mlp.input
        weights, chosen = self.route(x)
        out = self.routed(x, weights, chosen)
        if self.shared is not None:
            shared = dense_mlp(self.shared, x, self.model, "moe.shared")  # [T, h]
            if self.shared_gate is not None:
                gate = label(torch.sigmoid(self.shared_gate(x)), "moe.shared_gate")  # [T, 1]
                shared = gate * label(shared, "moe.shared_output")
            out = out + shared
        return out.view_as(y)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Router softmax (fp32) and top-k: [T, k] weights in the activation dtype, [T, k] expert ids."""
        k = self.cfg.top_k
        probs = label(F.softmax(self.router(x), dim=-1, dtype=torch.float32), "moe.router_probs")  # [T, E]
        weights, chosen = torch.topk(probs, k, dim=-1)  # [T, k]; backward scatters at `chosen`
        label(chosen, "moe.topk_indices")
        if self.cfg.renormalises:
            total = label(weights.sum(dim=-1, keepdim=True), "moe.topk_sum")  # [T, 1] fp32
            weights = label(weights, "moe.topk_weights") / total
        return weights.to(x.dtype), chosen

    def routed(self, x: Tensor, weights: Tensor, chosen: Tensor) -> Tensor:
        """Dispatch the T·k slots in expert order, run the experts, weight and add back: [T, h]."""
        k = self.cfg.top_k
        expert_of_slot = chosen.view(-1)  # [S], slot t·k + j
        order = label(torch.argsort(expert_of_slot, stable=True), "moe.weight_index")  # [S] slots
        token = label(torch.div(order, k, rounding_mode="floor"), "moe.dispatch_index")  # [S] tokens
        xs = label(x.index_select(0, token), "moe.expert_input")  # [S, h] in expert order
        counts = expert_counts(expert_of_slot, self.cfg.experts)
        experts = [cast(Mlp, e) for e in self.experts]
        if self.swiglu:
            gate = label(grouped(xs, [e.gate for e in experts], counts), "moe.gate")  # [S, f]
            up = label(grouped(xs, [e.up for e in experts], counts), "moe.up")
            hidden = label(gate_activation(self.model)(gate), "moe.act") * up
        else:
            hidden = F.gelu(label(grouped(xs, [e.up for e in experts], counts), "moe.up"), approximate="tanh")
        label(hidden, "moe.down_input")
        out = label(grouped(hidden, [e.down for e in experts], counts), "moe.expert_output")  # [S, h]
        w = label(weights.reshape(-1).index_select(0, order), "moe.routing_weights")  # [S]
        # HF: index_add_ into zeros; its backward keeps the source too (it reads its shape via expand_as).
        combined = label(out * w[:, None], "moe.weighted_output")  # [S, h]
        return x.new_zeros(x.shape).index_add_(0, token, combined)
