"""The vocabulary of model states: one device's bytes of weights, gradients, master copy and optimizer states
(``ModelStates``), and the elements of one device's shard of a buffer (``shard``). The ZeRO stages that
decide what is sharded are a strategy (memplan/strategies/zero.py); the step's accounting (analytic/) reads
only this vocabulary.

A sharded buffer is padded to a multiple of Nd (DeepSpeed pads the flat buffer), so a shard holds
ceil(Ψ / Nd) elements.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ModelStates(BaseModel):
    """Bytes of model states on one device."""

    model_config = ConfigDict(frozen=True)
    weights: int
    gradients: int
    master_weights: int
    optimizer_states: int

    @property
    def optimizer(self) -> int:
        """What the optimizer owns: master copy + its states (ZeRO's KΨ)."""
        return self.master_weights + self.optimizer_states

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer


def shard(elements: int, dp: int, sharded: bool) -> int:
    """Elements of one device's shard: ceil(elements / dp) when sharded, all of them otherwise."""
    return -(-elements // dp) if sharded else elements
