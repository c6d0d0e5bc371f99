"""The machine-readable result (``--json``): the contract in docs/architecture.md, integers for bytes and
FLOPs.

Keys that other tools build on and that are never renamed: ``params.total``, ``params.active``,
``memory.weights|gradients|optimizer|activations|peak`` (bytes on one device: the most loaded one),
``activations.tensors[]`` (``name``, ``shape``, ``dtype``, ``bytes``, ``count``), ``activations.per_layer``,
``flops.forward|backward|recompute|total|model`` (one micro-batch, whole model). Keys may be added:
``memory.host.weights|gradients|optimizer|activations|total`` are the bytes one device's offloaded tensors
take in host memory (``--offload``; zeros without it).
"""

from __future__ import annotations

from typing import Any

from memplan.analytic.optimizer_step import optimizer_impl
from memplan.blocks.moe import routing
from memplan.config import Method
from memplan.engine import Result
from memplan.stage_plan import StagePlan


def finetune_json(r: Result) -> dict[str, Any]:
    """The fine-tuning settings (LoRA's only when it is used)."""
    ft = r.setup.finetune
    out: dict[str, Any] = {"method": ft.method.name.lower(), "label": ft.label()}
    if ft.lora:
        out |= {
            "rank": ft.rank,
            "alpha": ft.alpha,
            "dropout": ft.dropout,
            "targets": [t.value for t in ft.targets],
            "adapter_params": r.params_trainable,
        }
    if ft.method is Method.QLORA:
        out |= {
            "quant": ft.quant.value,
            "double_quant": ft.double_quant,
            "compute_dtype": ft.compute_dtype.value,
        }
    out["frozen"] = {
        "embeddings": ft.freeze_embeddings,
        "lm_head": ft.freeze_lm_head,
        "layers": list(ft.freeze_layers) if ft.freeze_layers else None,
    }
    return out


def to_json(r: Result) -> dict[str, Any]:
    """The JSON contract (docs/architecture.md) for ``r``'s most loaded device (bytes on it; FLOPs of one
    micro-batch, whole model), plus ``parallel``, ``stages`` and ``moe``."""
    s, t = r.setup, r.setup.training
    p, dev = r.params, r.device
    return {
        "model": s.model.name,
        "setup": {
            **s.settings(),
            "devices": r.devices,
            "micro_batches": r.micro_batches,
            "global_batch": r.global_batch,
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
            "device": dev.params.total,
            "trainable": r.params_trainable,
            "frozen": r.params_frozen,
        },
        "finetune": finetune_json(r),
        "memory": {
            "weights": r.states.weights,
            "gradients": r.states.gradients,
            "optimizer": r.states.optimizer,
            "master_weights": r.states.master_weights,
            "optimizer_states": r.states.optimizer_states,
            "activations": r.activations,
            "peak": r.peak.bytes,
            "peak_phase": r.peak.phase,
            "peak_default_stream": r.peak.default_stream_bytes,
            "phases": dict(r.peak.phases),
            "optimizer_impl": optimizer_impl(r.setup).value,
            "optimizer_step_transient": r.peak.moments["optimizer step"]["transient"],
            "stage": dev.stage.index,
            "host": _host_json(dev),
        },
        "activations": {
            "total": r.activations,
            "per_layer": r.per_layer,
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
                for k in r.tensors
            ],
        },
        "flops": {
            "forward": r.flops.forward,
            "backward": r.flops.backward,
            "recompute": r.flops.recompute,
            "kernel_recompute": r.flops.kernel_recompute,
            "total": r.flops.total,
            "model": r.flops.model,
            "cp_skipped": r.flops.cp_skipped,
            "hardware": r.flops.total,
            "two_n": r.six_n // 3,
            "four_n": 2 * r.six_n // 3,
            "six_n": r.six_n,
            "per_step": r.flops.total * t.grad_accum,
            "global_per_step": r.flops.total * r.micro_batches * s.strategy.dp,
        },
        "parallel": {**s.parallel.model_dump(), "label": s.parallel.label()},
        "moe": {**s.model.moe.model_dump(), "routing": routing(s, s.model.moe)} if s.model.moe else None,
        "stages": [_stage_json(sp) for sp in r.stages],
    }


def _host_json(sp: StagePlan) -> dict[str, int]:
    """Host memory of one device's offloaded tensors (``strategies.offload``; zeros without offload)."""
    h = sp.host
    return {
        "weights": h.weights,
        "gradients": h.gradients,
        "optimizer": h.optimizer,
        "activations": h.activations,
        "total": h.total,
    }


def _stage_json(sp: StagePlan) -> dict[str, Any]:
    st = sp.stage
    return {
        "stage": st.index,
        "layers": st.layers,
        "in_flight_chunks": st.chunks,
        "in_flight_layers": st.in_flight_layers,
        "params": sp.params.total,
        "memory": {
            "weights": sp.states.weights,
            "gradients": sp.states.gradients,
            "optimizer": sp.states.optimizer,
            "activations": sp.activations,
            "peak": sp.peak.bytes,
            "peak_phase": sp.peak.phase,
            "phases": dict(sp.peak.phases),
            "host": _host_json(sp),
        },
    }
