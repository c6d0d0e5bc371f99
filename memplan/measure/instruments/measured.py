"""What one measured forward + backward did: the saved-tensor records, FLOPs per phase and per op, and
the router's choices (shared by the reference runs and the framework runners)."""

from __future__ import annotations

from dataclasses import dataclass, field

from memplan.measure.instruments.record import NameTotal, SavedRecord, totals_by_name


@dataclass
class Measured:
    """What one forward + backward of the reference model did."""

    records: list[SavedRecord]
    flops: dict[str, int]
    by_op: dict[str, dict[str, int]] = field(default_factory=dict)
    routing: list[list[int]] = field(default_factory=list)
    """Tokens each expert got, per MoE layer, as the router chose (real tensors only: fake ones hold
    no data)."""

    def by_name(self) -> dict[str, NameTotal]:
        return totals_by_name(self.records)

    @property
    def activations(self) -> int:
        return sum(r.bytes for r in self.records)

    def layer_bytes(self, layer: int) -> int:
        return sum(r.bytes for r in self.records if r.layer == layer)
