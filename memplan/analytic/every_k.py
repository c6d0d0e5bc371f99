"""Every-K checkpointing in the peak's layer moment, of either kind: what layer i's backward holds re-run,
and which layers' backwards can hold the most.

- Segments of K consecutive layers, each segment re-run whole in its backward (memplan's reference,
  Megatron's ``uniform``): layer i's backward holds the re-run saves of its segment's layers up to i (the
  layers above it in the segment are done, their saves freed).
- transformers' ``gradient_checkpointing_enable`` with ``every_n_layers`` K (``Profile.checkpoints_alone``):
  layer i is checkpointed alone when i % K == 0 and its backward holds its own re-run only; every other
  layer keeps its saves from the forward and re-runs nothing (``analytic.peak``'s ``layer_bytes``: each
  layer its own bytes, the checkpointed ones their input). Before, layer i was charged its segment's
  i % K + 1 re-run layers and the other layers' saves stayed alive to the end of the backward: Mistral 7B
  under every-2 (s 256, full training) 822,638,592 B over at layer 0's backward, the step's peak 2.0 %
  over (tests/hf/test_hf_peak.py).
"""

from __future__ import annotations

from memplan.analytic.layer_backward import segment_rerun_bytes
from memplan.blocks.profiles import checkpoints_alone
from memplan.config import Setup


def rerun_bytes(setup: Setup, i: int, less: int = 0) -> int:
    """What layer i's backward holds re-run: its segment's layers up to i, or under transformers' every-K its
    own when checkpointed (``less``: what a re-run layer keeps below the full-training working set that
    ``segment_rerun_bytes`` counts — fine-tuning's, MoE's: ``Pieces.rerun_less``); 0 without segments."""
    k = setup.strategy.segment
    if not k:
        return 0
    if checkpoints_alone(setup):
        return segment_rerun_bytes(setup, 1) - less if i % k == 0 else 0
    return segment_rerun_bytes(setup, i % k + 1)


def moment_layers(setup: Setup, layers: int) -> set[int]:
    """The layers whose backward can hold the most. Without segments the live set is linear in i: the top
    layer (saves dominate) or the bottom one (gradients do). With segments of k layers, one layer up inside
    a segment adds a re-run layer's saves S and has one layer's gradients G fewer: a segment peaks at its top
    (S > G) or its bottom. The full segments' tops are linear in the segment's index (one more kept input K,
    k·G fewer): the first or the last full segment's top, which is not L − 1 when k does not divide L
    (every-2 of 5 layers at T 2048 peaks at layer 3: tests/measure/test_peak.py). The bottoms are linear
    too, and K ≤ S < G makes layer 0 the largest then. L − 1 tops a partial segment. Under transformers'
    every-K the layers of one residue i % k are linear in i (k layers' gradients, one input and k − 1
    layers' saves apart): the lowest and the highest of each residue."""
    ends = {0, layers - 1}
    k = setup.strategy.segment
    if k and checkpoints_alone(setup):
        for r in range(min(k, layers)):
            ends |= {r, r + (layers - 1 - r) // k * k}
    elif k:  # (a segment of k ≥ L layers is the whole model, or pipeline chunk: no full one below)
        ends |= {min(k, layers) - 1, max(layers // k * k - 1, 0)}
    return ends
