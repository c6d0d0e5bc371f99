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

from collections.abc import Iterable

from memplan.analytic.moments.layer_saves import checkpoint_shared_bytes, segment_rerun_bytes
from memplan.blocks.profiles import checkpoints_alone
from memplan.config import Setup


def rerun_bytes(setup: Setup, i: int, rerun_layers: tuple[int, ...] = ()) -> int:
    """What layer i's backward holds re-run: its segment's layers up to i, or under transformers' every-K its
    own when checkpointed; 0 without segments. ``rerun_layers``: what each layer keeps re-run as the rank
    holds it (``Pieces.rerun_layers``: fine-tuning's along the gradient flow, MoE's, sequence
    parallelism's); without it, the full-training working set each (``segment_rerun_bytes``). The
    segment's first layer's norm may save the kept input itself (LayerNorm, fp32): that storage is the
    checkpoint's, counted once."""
    k = setup.strategy.segment
    if not k:
        return 0
    alone = checkpoints_alone(setup)
    layers = ([i] if i % k == 0 else []) if alone else list(range(i - i % k, i + 1))
    if not layers:
        return 0
    if not rerun_layers:
        return segment_rerun_bytes(setup, len(layers))
    return sum(rerun_layers[j] for j in layers) - checkpoint_shared_bytes(setup)


def moment_layers(setup: Setup, layers: int, kinds: Iterable[int] = ()) -> set[int]:
    """The layers whose backward can hold the most. Without segments the live set is linear in i: the top
    layer (saves dominate) or the bottom one (gradients do). With segments of k layers, one layer up inside
    a segment adds a re-run layer's saves S and has one layer's gradients G fewer: a segment peaks at its top
    (S > G) or its bottom. The full segments' tops are linear in the segment's index (one more kept input K,
    k·G fewer): the first or the last full segment's top, which is not L − 1 when k does not divide L
    (every-2 of 5 layers at T 2048 peaks at layer 3: tests/measure/test_peak.py). The bottoms are linear
    too, and K ≤ S < G makes layer 0 the largest then. L − 1 tops a partial segment. Under transformers'
    every-K the layers of one residue i % k are linear in i (k layers' gradients, one input and k − 1
    layers' saves apart): the lowest and the highest of each residue. Under fine-tuning, also the layers
    about each place where the gradient flow changes: with layer 0 of 3 frozen (full checkpointing) the
    peak is layer 1's backward, which neither end is (tests/measure/test_peak.py). ``kinds``: where the layers
    differ by kind, each kind's first and last layer (the whole model's, ``layer_kinds.kind_ends``) too
    — DeepSeek-V3's first MoE layer, whose dense layers below keep more than their gradients weigh, its MoE
    layers above less (``estimate -m deepseek-v3 --impl hf``: 20.2 GB above both ends)."""
    ends = {0, layers - 1, *kinds}
    k = setup.strategy.segment
    if k and checkpoints_alone(setup):
        for r in range(min(k, layers)):
            ends |= {r, r + (layers - 1 - r) // k * k}
    elif k:  # (a segment of k ≥ L layers is the whole model, or pipeline chunk: no full one below)
        ends |= {min(k, layers) - 1, max(layers // k * k - 1, 0)}
    # Fine-tuning: the layers are alike only between where the gradient flow changes — above layer 0 (its
    # input needs no gradient under LoRA) and at ``--freeze``'s edges; each run of like layers has its own
    # ends, and its segments' (within k of an edge).
    if not setup.finetune.trains_everything:
        f = setup.finetune.freeze_layers
        edges = {1} if f is None else {1, f[0], f[1] + 1}
        near = max(k, 1)
        ends |= {j for e in edges for j in range(e - near, e + near) if 0 <= j < layers}
    return ends
