"""Megatron's gradient buffer and its passes around the optimizer step (``blocks.megatron.main_grad_bytes``,
``time.optimizer.framework_ops`` / ``megatron_zero_bytes``), derived by hand on the tiny model.

Sources read (Megatron-LM):
- megatron/training/arguments.py, under ``--bf16``: "bfloat16 requires gradient accumulation and all-reduce
  to be done in fp32" — ``accumulate_allreduce_grads_in_fp32 = True`` unless ``--grad-reduce-in-bf16``;
  not under ``--fp16``;
- megatron/core/distributed/param_and_grad_buffer.py: ``grad_dtype = torch.float if
  accumulate_allreduce_grads_in_fp32 else param.dtype`` — the ``main_grad`` buffer the weight gradients
  accumulate into and data parallelism reduces;
- megatron/core/optimizer/optimizer.py ``Float16OptimizerWithFloat16Params``:
  ``_copy_model_grads_to_main_grads`` (``main_grad.float()``: a cast unless already fp32), the fp16 loss
  scaler's unscale and inf check, ``_copy_main_params_to_model_params`` (fp32 master → 16-bit weight);
  megatron/training/training.py ``train_step``: ``zero_grad_buffer()`` on every chunk.

The tiny model: 106,816 parameters (tests/plan/test_titan_fsdp2_comm.py's table).
"""

from __future__ import annotations

import pytest

from memplan.api import Options, build
from memplan.engine import Result
from memplan.presets import load_gpu
from memplan.time import optimizer
from memplan.time.comm.collectives import communication
from memplan.time.compute import optimizer_step_bytes, owned_params

ALL = 106_816
H100 = load_gpu("h100")


def result(**options: object) -> Result:
    return build(Options(model="tiny", seq=32, batch=2, impl="megatron", **options)).result  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "per_param"),
    [
        ({}, 4),  # bf16: fp32 main_grad
        ({"reduce_dtype": "bf16"}, 2),  # --grad-reduce-in-bf16
        ({"precision": "fp16-mixed"}, 2),  # fp16: the parameters' dtype
        ({"precision": "fp16-mixed", "reduce_dtype": "fp32"}, 4),  # --accumulate-allreduce-grads-in-fp32
    ],
)
def test_the_gradient_buffer_is_megatrons(options: dict[str, object], per_param: int) -> None:
    r = result(**options)
    assert r.states.gradients == ALL * per_param
    reference = build(Options(model="tiny", seq=32, batch=2, **options)).result  # type: ignore[arg-type]
    assert reference.states.gradients == ALL * 2  # the recipe's 16-bit gradients


def test_data_parallelism_reduces_the_fp32_buffer() -> None:
    """ZeRO 0 over dp 2: one all-reduce of the fp32 main_grad buffer, 106,816 × 4 B."""
    _, rows = communication(result(zero=0, dp=2, gpus=2), H100.topology)
    (row,) = [r for r in rows if r.dimension == "dp"]
    assert row.bytes == ALL * 4


@pytest.mark.parametrize(
    ("options", "per_owned", "zeroed"),
    [
        # bf16: no cast (main_grad is fp32), the copy back 4 + 2; the fp32 buffer zeroed, 4 B each
        ({}, [6], 4),
        # fp16: the cast 2 + 4, the unscale 8, the copy back 4 + 2; the fp16 buffer, 2 B each
        ({"precision": "fp16-mixed"}, [6, 8, 6], 2),
    ],
)
def test_passes_around_the_step(options: dict[str, object], per_owned: list[int], zeroed: int) -> None:
    r = result(**options)
    c, _ = communication(r, H100.topology)
    assert optimizer.framework_ops(c.setup) == per_owned
    owned = owned_params(c)
    assert owned == ALL
    assert (
        optimizer_step_bytes(c)
        == owned * (optimizer.bytes_per_param(c.setup) + sum(per_owned)) + ALL * zeroed
    )


def test_none_elsewhere() -> None:
    c, _ = communication(build(Options(model="tiny", seq=32, batch=2)).result, H100.topology)
    assert optimizer.framework_ops(c.setup) == [] and optimizer.megatron_zero_bytes(c.setup, ALL) == 0


def test_megatron_steps_adamw_with_its_fused_adam() -> None:
    """megatron/core/optimizer/__init__.py imports Transformer Engine's (else Apex's) ``FusedAdam as Adam``:
    one kernel, no temporaries — not torch's foreach, whose ``_foreach_sqrt`` list is a whole fp32 copy."""
    from memplan.analytic.optimizer_step import optimizer_impl
    from memplan.config import OptimizerImpl

    r = result()
    assert optimizer_impl(r.setup) is OptimizerImpl.FUSED
    assert r.peak.moments["optimizer step"]["transient"] == 0
    foreach = result(optimizer_impl="foreach")
    assert foreach.peak.moments["optimizer step"]["transient"] > 0


@pytest.mark.parametrize("zero", [0, 1])
def test_megatron_reduces_after_the_backward_unless_told(zero: int) -> None:
    """Megatron-LM's ``--overlap-grad-reduce`` and ``--overlap-param-gather`` default to off
    (megatron/training/arguments.py: ``action='store_true', default=False``): the gradient reduction runs
    after the backward and the updated parameters are gathered after the step — exposed; with
    ``--overlap-grad-reduce`` the reduction hides behind the last backward as torch's DDP does."""
    from memplan.time.comm.fabric import Collective
    from memplan.time.comm.rows import Overlap

    def overlaps(**extra: object) -> dict[Collective, Overlap]:
        _, rows = communication(result(zero=zero, dp=2, gpus=2, **extra), H100.topology)
        return {r.collective: r.overlap for r in rows if r.dimension == "dp"}

    reduced = Collective.ALL_REDUCE if zero == 0 else Collective.REDUCE_SCATTER
    assert overlaps()[reduced] is Overlap.NONE
    assert overlaps(overlap_grad_reduce=True)[reduced] is Overlap.LAST_BACKWARD
    if zero == 1:
        assert overlaps(overlap_grad_reduce=True)[Collective.ALL_GATHER] is Overlap.NONE


def test_overlap_grad_reduce_is_megatrons_switch() -> None:
    with pytest.raises(
        ValueError, match="overlap_grad_reduce: --overlap-grad-reduce is Megatron-LM's switch"
    ):
        build(Options(model="tiny", seq=32, overlap_grad_reduce=True))


def test_overlap_param_gather_hides_the_distributed_optimizers_gather() -> None:
    """``--overlap-param-gather`` (with ``--overlap-grad-reduce``, as Megatron-LM asserts): ZeRO-1's gather of
    the updated parameters hides behind the next forward; it needs ``--overlap-grad-reduce``."""
    from memplan.time.comm.fabric import Collective
    from memplan.time.comm.rows import Overlap

    r = result(zero=1, dp=2, gpus=2, overlap_grad_reduce=True, overlap_param_gather=True)
    _, rows = communication(r, H100.topology)
    gather = [
        row.overlap for row in rows if row.dimension == "dp" and row.collective is Collective.ALL_GATHER
    ]
    assert gather == [Overlap.FIRST_FORWARD]
    with pytest.raises(ValueError, match="overlap_param_gather: Megatron's --overlap-param-gather needs"):
        result(zero=1, dp=2, gpus=2, overlap_param_gather=True)
