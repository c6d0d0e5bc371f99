"""Strategies: what a memory-saving or parallel technique does to one rank's inventory and FLOPs.

Every strategy is one module with the interface of ``Strategy``: ``applies(setup)``, ``keeps(kept, setup)``
(the inventory one rank keeps under it, from the one before) and ``recompute(setup, dims)`` (the forward
FLOPs it re-runs in backward). The engine applies ``pieces.STRATEGIES`` in order to the blocks' inventory
(``analytic.activations.inventory``, with ``blocks.moe`` swapped in). Rules inside a strategy key on the
typed tags of each kept tensor (``Block``, ``Role``), never on its name.

- ``checkpointing``: full / every-k segments keep one input per segment and re-run it; selective
  re-runs the attention core (whose saves the attention block already leaves out under it);
- ``reversible``: RevNet layers keep the stack's last outputs only and re-run every layer;
- ``sequence_parallel``: splits the roles that tensor parallelism leaves whole along the sequence;
- ``tensor_parallel``: the rank's narrower model (``tp_model``) and the layout checks — a model transform,
  applied before the inventory is built;
- ``zero``: the model states per device (weights, gradients, master weights, optimizer states).

Adding one (context parallelism, LoRA, offload): a module here with these three functions, its field in
``config`` and ``api.Options``, its place in ``pieces.STRATEGIES``, and its tests (docs/architecture.md).
"""

from __future__ import annotations

from typing import Protocol

from memplan.blocks.inventory import Dims, Kept
from memplan.config import Setup


class Strategy(Protocol):
    """The interface every strategy module implements."""

    def applies(self, setup: Setup) -> bool:
        """Whether ``setup`` uses the strategy (``keeps`` and ``recompute`` are identities otherwise)."""
        ...

    def keeps(self, kept: list[Kept], setup: Setup) -> list[Kept]:
        """The inventory one rank keeps under the strategy, from the inventory before it."""
        ...

    def recompute(self, setup: Setup, dims: Dims) -> int:
        """Forward FLOPs the strategy re-runs in backward, whole model, one micro-batch."""
        ...
