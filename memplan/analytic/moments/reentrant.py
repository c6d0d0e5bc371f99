"""What transformers' reentrant checkpointing (``gradient_checkpointing_kwargs={'use_reentrant': True}``:
torch.utils.checkpoint's ``CheckpointFunction``) holds through a checkpointed layer's backward beyond what
the non-reentrant checkpoint does, which ``analytic.moments.layer_backward``'s moments add.

``CheckpointFunction.backward(ctx, *args)`` re-runs the layer whole under ``enable_grad`` on detached
inputs (views of the saved ones: no new bytes), ``outputs = ctx.run_function(*detached_inputs)``, then
runs the re-run graph's backward itself, ``torch.autograd.backward(outputs_with_grad, args_with_grad)``.
Its frame holds two [b, s, h] tensors (activation dtype) until that backward returns:

- ``outputs``: the re-run layer's output, the residual stream's next value. The non-reentrant re-run
  stops early once it has made the last save (the layer's last residual ``add`` saves nothing), and no
  frame keeps what it made: nothing of it is alive in the backward (``held_output``);
- ``args``: the layer's output gradient. Under the non-reentrant checkpoint autograd frees it once its
  last user has run — the residual sum below the MLP's norm, where the MLP's branch and the residual's
  meet (``d(h) = dY + norm's dX``): from then on (the attention's backward, its norm's) the frame keeps
  it beside that sum (``held_gradient``). In a parallel layer (``ModelConfig.parallel_residual``: GPT-J,
  Falcon, Cohere) the residual's gradient is dY itself until the layer's one sum at its input, alive
  either way.

Measured at the families' real widths (two layers, s 512, bf16-mixed, fake tensors; tests/hf/
test_reentrant_peak.py): Llama 3 8B's layer backward tops at the attention's backward, two [T, h] above
the estimate before (8,388,608 B); GPT-2's at the GELU's backward in its MLP, Falcon-7B's at W_QKV's dX
matmul in its parallel layer, one [T, h] each (786,432 B, 4,653,056 B).
"""

from __future__ import annotations

from memplan.blocks.inventory import Dims
from memplan.blocks.profiles import reentrant_checkpoint as reentrant
from memplan.config import Setup


def held_output(setup: Setup, dims: Dims) -> int:
    """The re-run layer's output [T, h] the Function's backward frame holds (``outputs``); 0 elsewhere."""
    return dims.tokens * dims.h * dims.act.bytes if reentrant(setup) else 0


def held_gradient(setup: Setup, dims: Dims) -> int:
    """The layer's output gradient [T, h] the frame holds (``args``) past the residual sum below the MLP's
    norm, which would free it: the moments after it (the attention's side); 0 in a parallel layer, whose
    residual gradient it stays, and without reentrant checkpointing."""
    return 0 if setup.model.parallel_residual else held_output(setup, dims)
