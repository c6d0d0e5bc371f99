"""Gradient-norm clipping in the step time (``--clip-grad``; ``time.optimizer.clips`` / ``clip_ops``,
``time.compute.clip_seconds``), every figure derived by hand.

Sources read:
- torch 2.13 torch/nn/utils/clip_grad.py ``clip_grad_norm_``: ``_get_total_norm`` (``torch._foreach_norm``
  over the gradients: each read once) then ``_clip_grads_with_norm_`` (``clip_coef_clamped =
  torch.clamp(clip_coef, max=1.0)``, ``torch._foreach_mul_(grads, clip_coef_clamped)``: each read and
  written, whatever the coefficient): 3 × the gradient's bytes an element;
- Megatron-LM megatron/core/optimizer/clip_grads.py ``clip_grad_norm_fp32``: ``multi_tensor_l2norm`` over
  the fp32 main gradients, ``multi_tensor_scale`` only ``if clip_coeff < 1.0``: 4 bytes an element;
- the defaults: Megatron-LM ``--clip-grad`` 1.0, torchtitan ``training.max_norm`` 1.0, transformers'
  ``TrainingArguments.max_grad_norm`` 1.0; memplan's reference step (measure/reference/) does not clip.

Llama 3 8B: 8,030,261,248 parameters; over 8 ranks under ZeRO ≥ 1 a device owns ⌈P/8⌉ = 1,003,782,656.
H100 SXM: MEMORY 0.80 × 3,350 GB/s.
"""

from __future__ import annotations

import json
import shlex

import pytest
from typer.testing import CliRunner

from memplan.cli.app import app

runner = CliRunner()
OWNED = 1_003_782_656
HBM = 0.80 * 3350e9
BASE = "estimate -m llama-3-8b --seq 4096 --gpus 8 --zero 3 --gpu h100-sxm --json"


def predicted(extra: str) -> dict:  # type: ignore[type-arg]
    out = runner.invoke(app, shlex.split(f"{BASE} {extra}"))
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    return {"setup": data["setup"], **data["time"]["predicted"]}


def test_the_reference_does_not_clip_unless_asked() -> None:
    """The reference step has no clipping: 0, the setting null; ``--clip-grad``: torch's clip on its bf16
    gradients (the reference optimizer reads the recipe's 2-byte gradients), 3 × 2 B an owned element."""
    plain = predicted("")
    assert plain["setup"]["clip_grad"] is None
    assert plain["clip_s"] == 0 and plain["parts"]["gradient clipping"] == 0
    clipped = predicted("--clip-grad")
    assert clipped["setup"]["clip_grad"] is True
    assert clipped["clip_s"] == pytest.approx(OWNED * 3 * 2 / HBM, rel=1e-12)
    assert clipped["step_time_s"] == pytest.approx(plain["step_time_s"] + clipped["clip_s"], rel=1e-12)


def test_torchtitan_clips_its_fp32_sharded_gradients_by_default() -> None:
    """torchtitan (FSDP2's fp32 sharded gradients, torch.optim's foreach): 3 × 4 B; ``--no-clip-grad``: 0."""
    assert predicted("--impl torchtitan")["clip_s"] == pytest.approx(OWNED * 12 / HBM, rel=1e-12)
    assert predicted("--impl torchtitan --no-clip-grad")["clip_s"] == 0


def test_megatron_clips_by_its_norm_pass() -> None:
    """Megatron's norm over the fp32 main gradients: 4 B an owned element (the scale pass runs only when
    the norm exceeds the threshold)."""
    assert predicted("--impl megatron")["clip_s"] == pytest.approx(OWNED * 4 / HBM, rel=1e-12)


def test_offloaded_optimizer_clips_off_the_gpu() -> None:
    """Under optimizer offload the step and its clipping run on the host: nothing charged on the GPU."""
    assert predicted("--zero 2 --offload optimizer --clip-grad")["clip_s"] == 0


def test_parts_add_up_with_clipping() -> None:
    p = predicted("--impl torchtitan")
    assert sum(p["parts"].values()) == pytest.approx(p["step_time_s"], rel=1e-12)
    assert p["parts"]["gradient clipping"] == p["clip_s"] > 0
