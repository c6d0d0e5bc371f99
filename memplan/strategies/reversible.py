"""Reversible layers: RevNet coupling y1 = x1 + F(x2), y2 = x2 + G(y1) (Gomez et al. 2017; Reformer).

No layer keeps its saves: the stack keeps its last outputs y1, y2 (``Block.REVERSIBLE`` residuals, once per
model) and backward rebuilds every layer's inputs from its outputs, re-running each layer's forward.
"""

from __future__ import annotations

from memplan.analytic import activations as act
from memplan.analytic.flops import layer_linear_flops
from memplan.blocks.attention.flops import attention_core_flops
from memplan.blocks.inventory import Block, Dims, Kept, Role, Scope, save
from memplan.config import Setup


def applies(setup: Setup) -> bool:
    return setup.strategy.reversible


def keeps(kept: list[Kept], setup: Setup) -> list[Kept]:
    """The layers' saves give way to the stack's two outputs, among the model-level saves before them."""
    if not applies(setup):
        return kept
    dims = Dims.of(setup)
    why = "reversible stack output: backward rebuilds every layer's input"
    shape = (dims.b, dims.s, dims.h)
    outputs = [
        save(Block.REVERSIBLE, "y1", shape, dims.act, Role.RESIDUAL, why),
        save(Block.REVERSIBLE, "y2", shape, dims.act, Role.RESIDUAL, why),
    ]
    first = next(i for i, k in enumerate(kept) if k.scope is Scope.LAYER)
    rest = [k for k in kept if k.scope is not Scope.LAYER]
    return rest[:first] + act.kept(outputs, Scope.MODEL, 1) + rest[first:]


def recompute(setup: Setup, dims: Dims) -> int:
    """Every layer's forward, once."""
    if not applies(setup):
        return 0
    return dims.layers * (layer_linear_flops(setup, dims) + attention_core_flops(dims))
