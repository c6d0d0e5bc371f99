"""One estimate: parameters, model states, the activation inventory, FLOPs and the peak, for one device.

Pure Python (no torch). ``estimate(setup)`` computes; ``Estimate.to_json()`` gives the machine-readable
contract of DESIGN.md (integers for bytes and FLOPs); rendering lives in report.py.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from memplan.analytic import activations as act
from memplan.analytic.flops import Flops, flops, six_n
from memplan.analytic.inventory import Kept
from memplan.analytic.params import ParamCount, count_params
from memplan.analytic.peak import Peak, peak
from memplan.analytic.states import ModelStates, model_states
from memplan.config import Setup, checkpointing_label


class Estimate(BaseModel):
    model_config = ConfigDict(frozen=True)
    setup: Setup
    params: ParamCount
    states: ModelStates
    tensors: list[Kept]
    flops: Flops
    six_n: int
    peak: Peak

    @property
    def activations(self) -> int:
        return act.total_bytes(self.tensors)

    @property
    def per_layer(self) -> int:
        """Bytes one transformer layer keeps (layer-scope entries / layers)."""
        return act.per_layer_bytes(self.tensors, self.setup.model.num_layers)

    def to_json(self) -> dict[str, Any]:
        s, t = self.setup, self.setup.training
        p = self.params
        return {
            "model": s.model.name,
            "setup": {
                "micro_batch": t.micro_batch,
                "seq_len": t.seq_len,
                "precision": t.precision.value,
                "optimizer": t.optimizer.value,
                "grad_accum": t.grad_accum,
                "checkpointing": checkpointing_label(s.strategy),
                "attention": s.strategy.attention.name.lower(),
                "reversible": s.strategy.reversible,
                "zero": int(s.strategy.zero),
                "dp": s.strategy.dp,
                "device": s.device.value,
            },
            "params": {
                "total": p.total,
                "active": p.active,
                "embedding": p.embedding,
                "positions": p.positions,
                "per_layer": p.layer.total,
                "layers": p.layers,
                "final_norm": p.final_norm,
                "lm_head": p.lm_head,
            },
            "memory": {
                "weights": self.states.weights,
                "gradients": self.states.gradients,
                "optimizer": self.states.optimizer,
                "master_weights": self.states.master_weights,
                "optimizer_states": self.states.optimizer_states,
                "activations": self.activations,
                "peak": self.peak.bytes,
                "peak_phase": self.peak.phase,
                "phases": dict(self.peak.phases),
            },
            "activations": {
                "total": self.activations,
                "per_layer": self.per_layer,
                "tensors": [
                    {
                        "name": k.name,
                        "shape": list(k.shape),
                        "dtype": k.dtype.value,
                        "bytes": k.bytes,
                        "count": k.count,
                        "total_bytes": k.total_bytes,
                        "scope": k.scope.value,
                        "reason": k.reason,
                    }
                    for k in self.tensors
                ],
            },
            "flops": {
                "forward": self.flops.forward,
                "backward": self.flops.backward,
                "recompute": self.flops.recompute,
                "kernel_recompute": self.flops.kernel_recompute,
                "total": self.flops.total,
                "model": self.flops.model,
                "hardware": self.flops.total,
                "two_n": self.six_n // 3,
                "four_n": 2 * self.six_n // 3,
                "six_n": self.six_n,
                "per_step": self.flops.total * t.grad_accum,
            },
        }


def head_gradient_bytes(params: ParamCount, setup: Setup) -> int:
    """Gradients made before the top layer's backward: lm head (or tied embedding) and final norm."""
    head = params.lm_head or params.embedding
    return (head + params.final_norm) * setup.training.precision.grad_bytes


def estimate(setup: Setup) -> Estimate:
    params = count_params(setup.model)
    t, s = setup.training, setup.strategy
    states = model_states(params.total, t.precision, t.optimizer, s.zero, s.dp)
    kept = act.inventory(setup)
    return Estimate(
        setup=setup,
        params=params,
        states=states,
        tensors=kept,
        flops=flops(setup),
        six_n=six_n(setup),
        peak=peak(setup, states, kept, params, head_gradient_bytes(params, setup)),
    )
