"""A lower bound of a configuration's step time at an assumed ``--mfu``: what lets ``fit --mfu`` prune by
time as the predicted search does (``bound``).

At an assumed MFU u the step is (``time.timing.assumed_seconds``)

    step = (M + R) / (N · peak · u) · (1 + (p − 1)/(m·n))

for the model FLOPs M and the checkpoint recompute R of the step's B sequences, on N devices, with n
micro-batches a data-parallel rank through p stages of m virtual stages each. The model FLOPs of one
sequence (``flops.model``: forward and backward of the whole model, no re-computation, as one device counts
them at any cp: ``Flops.cp_skipped``) read the model, the sequence, the method and the loss, not tp, pp,
cp, ep, the micro-batch size or the ZeRO stage; so M = B · M₁ with M₁ the one-sequence reference's
(``bound.reference_setup``: b = 1, the layout's cp and rotation, which the bound's memo shares), and
R ≥ 0:

    step ≥ B · M₁ / (N · peak · u) · (1 + (p − 1)/(m·n))

which is the step itself without checkpointing. Every ZeRO stage of one configuration has the same step
(none of its terms reads the stage), so ``assumed_seconds`` of one estimate without stage plans
(``engine.unplanned``) is each stage's: the search's second key is exact and it judges memory next
(``families._Group``). tests/plan/test_fit_mfu.py checks the bound against every configuration's
assumed step over whole searches and the pruned search's rows against a search that prunes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memplan.config import Attention, Checkpointing, Parallel, Setup
from memplan.engine import unplanned
from memplan.presets import GpuPreset
from memplan.search.bound import reference_key, reference_setup
from memplan.search.methods import valid
from memplan.time.timing import peak_flops


@dataclass
class MfuBound:
    """Lower bounds of the step times at an assumed ``mfu`` for the search of ``global_batch`` sequences on
    ``gpus`` × ``gpu`` (the module docstring); ``seconds`` as ``bound.Bound``'s."""

    gpu: GpuPreset
    gpus: int
    global_batch: int
    mfu: float
    _flops: dict[tuple[object, ...], int] = field(default_factory=dict)
    """One sequence's model FLOPs by ``bound.reference_key`` (0 where the reference cannot be built)."""

    def sequence_flops(self, base: Setup, ckpt: Checkpointing, attention: Attention, par: Parallel) -> int:
        """M₁: the model FLOPs of one sequence of ``base`` at ``par``'s context parallelism."""
        key = reference_key(base, ckpt, attention, par)
        if key not in self._flops:
            setup = reference_setup(base, ckpt, attention, par)
            try:
                self._flops[key] = unplanned(setup).flops.model if valid(setup) else 0
            except ValueError:
                self._flops[key] = 0
        return self._flops[key]

    def seconds(self, base: Setup, ckpt: Checkpointing, attention: Attention, par: Parallel, n: int) -> float:
        """The bound for layout ``par`` with ``n`` micro-batches per step."""
        model = self.sequence_flops(base, ckpt, attention, par) * self.global_batch
        capacity = self.gpus * peak_flops(self.gpu, base.training.precision)
        # less a billionth: ``assumed_seconds`` multiplies the same figures in another order (rounding)
        return model / (capacity * self.mfu) * (1 + (par.pp - 1) / (par.vpp * n)) * (1 - 1e-9)
