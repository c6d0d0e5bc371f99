"""What FSDP2 (torch 2.13's ``fully_shard``) holds at the peak model's moments on memplan's reference model
under ZeRO-3, as measure/distributed/parallelize.py ``shard_dp`` wraps it: one unit per layer and the root
unit (the embedding, learned positions, the final norm and the lm head), every unit given
``reshard_after_forward=True`` explicitly — and on torchtitan's model as its 2024 ``parallelize_llama``
wrapped it (``--fsdp-wrap root``, ``measure.distributed.titan.wrap_2024``): the same units (a block with
its fused ``wqkv``, ``reduce.block_shapes``), but neither the root nor the top block resharded after
forward (``kept_after_forward``): the root is gathered from the forward's start, the top block from its
forward, and the backward gathers neither again — the same bytes at the loss as the reference's
re-gathered root and prefetched top layer, but the top block's on the default stream (its copy-out's),
and no copy-out at the top block's backward. Measured per rank on the fake process group
(tests/hf/test_torchtitan_peak.py: the loss-, final-norm- and embedding-backward moments exact; the layer
backward as torchtitan's own layer model).

What torch 2.13 does with that wrapping (torch/distributed/fsdp/_fully_shard/):
- The root is resharded after its forward: ``FSDPState._lazy_init`` clears the root's
  ``post_forward_mesh_info`` only when the user left ``reshard_after_forward`` unset
  (``if self._auto_reshard_after_forward``; ``fully_shard``: ``auto_reshard_after_forward =
  reshard_after_forward is None``), and ``shard_dp`` sets it. Its pre-backward hook on the loss gathers it
  again at once, and that hook's default prefetch (``FSDPParamGroup._backward_prefetch``: the unit before
  it in ``post_forward_order``) starts the top layer's all-gather: at the loss's backward and the final
  norm's, the root unit is unsharded and the top layer's flat all-gather output is in flight.
- The root's post-backward never runs in autograd: its inputs (ids, labels) need no gradient, so
  ``RegisterPostBackwardFunction`` has nothing to hook, and ``_root_post_backward_final_callback`` runs it
  at the backward's end ("Run post-backward in case forward inputs did not require gradient"). Until
  then the root's parameters stay unsharded and their gradients unsharded: the lm head's [v, h] and the
  final norm's from the head's backward on, the embedding's [v, h] from its own.
- A layer's pre-backward copies its prefetched all-gather output out into its unsharded parameters
  (``wait_for_unshard``: ``foreach_all_gather_copy_out``, then the output freed) and then prefetches the
  layer below (none below layer 0: the first in ``post_forward_order``); its post-backward reshards it
  and reduce-scatters its gradients, whose flat input ``comm_ctx.reduce_scatter_states`` keeps until the
  next unit's reduce-scatter (``post_backward``: the oldest state popped before the new reduce).
- At the backward's end the root reshards and reduce-scatters (layer 0's input popped first): its
  unsharded gradients, the flat input and the output alive at once.

Each unsharded parameter is a view of its unit's padded all-gather output, every dim 0 padded to the
shard count (``blocks.torchtitan.fsdp2_flat_elements``); the unsharded gradients are the parameters'
shapes, unpadded. Measured on the fake process group at each moment (tests/measure/test_reference_fsdp2.py,
measure/distributed/reference_peak.py).

Known limitations (NB): measured with dense layers (an MoE layer's unit is sized the same way,
``analytic.optimizer_step._layer_shapes``, not measured: the distributed run refuses MoE); modelled on one
pipeline stage without context parallelism (and, for the reference, without tensor parallelism:
torchtitan's 2024 wrapping is measured on tp 2 + SP ranks, its units TP-local), every parameter trained,
an untied head, no parameter offload (``root_gathered``); elsewhere the peak keeps ZeRO-3's one gathered
unit (``analytic.step.zero3_gather``). The reference's measured without activation checkpointing (the
distributed run refuses it; torchtitan's with SelectiveAC and FullAC too) and with one micro-batch (with
accumulation the root's gradients accumulate unsharded: not checked).
Measured with the moments' dims divisible by dp: where they are not, the model states' flat shard
(``analytic.states.shard``) differs from FSDP2's per-parameter padded one (+1 row of a [250, 64] bf16
embedding on 4 ranks: +128 B), which this module does not correct. The layer moments are the layer model's
(``analytic.peak``) with these buffers added; the layer below's prefetched output is counted beside the
whole layer's backward (it is issued at the layer's pre-backward, before any of its compute).
"""

from __future__ import annotations

import math

from memplan.analytic.fsdp.reduce import (
    block_shapes,
    reduce_bytes,
    root_wrapped,
    sharded_grad_bytes,
    unsharded_grad_bytes,
)
from memplan.analytic.optimizer_step import Shape, _norm_shapes
from memplan.blocks.torchtitan import fsdp2_flat_elements, fsdp2_mixed
from memplan.config import Impl, Offload, PositionType, Setup, ZeroStage


def root_gathered(setup: Setup) -> bool:
    """The reference model under FSDP2's ZeRO-3 as ``shard_dp`` wraps it, or torchtitan's model as its
    2024 code wrapped it (``--fsdp-wrap root``), where this module models it (module NB)."""
    s, par, m = setup.strategy, setup.parallel, setup.model
    return (
        root_wrapped(setup)
        and s.zero >= ZeroStage.PARAMETERS
        and s.shard_group > 1
        and (par.tp == 1 or setup.impl.impl is Impl.TORCHTITAN)  # the reference's under tp: not measured
        and par.cp == 1
        and par.pp == 1
        and Offload.PARAMS not in setup.offload
        and setup.finetune.trains_everything
        and not m.tied_embeddings
    )


def root_shapes(setup: Setup, embedding: bool = True) -> list[Shape]:
    """The root unit's parameters: embed [v, h], learned positions [P, h], the final norm, the lm head
    [v, h] (``embedding=False``: the head's part only, the final norm and the lm head)."""
    m = setup.model
    h = m.hidden_size
    shapes: list[Shape] = [(m.vocab_size, h)] if embedding else []
    shapes += [(m.max_positions, h)] if embedding and m.position is PositionType.LEARNED else []
    return shapes + _norm_shapes(m) + [(m.vocab_size, h)]


def _elements(shapes: list[Shape]) -> int:
    return sum(math.prod(shape) for shape in shapes)


def _shards(setup: Setup) -> int:
    return setup.strategy.shard_group


def root_unit(setup: Setup) -> int:
    """Bytes of the root unit's unsharded parameters (views of its padded all-gather output), in the
    gathered dtype (bf16 under FSDP2's mixed precision)."""
    flat = fsdp2_flat_elements(root_shapes(setup), _shards(setup))
    return flat * setup.training.precision.weight_bytes


def layer_flat(setup: Setup) -> int:
    """Bytes of one layer's flat all-gather output, or of its unsharded parameters (views of it)."""
    return fsdp2_flat_elements(block_shapes(setup), _shards(setup)) * setup.training.precision.weight_bytes


def kept_after_forward(setup: Setup) -> bool:
    """torchtitan's 2024 wrapping: the root and the top block are not resharded after their forward, so
    the backward gathers neither again — the top block's unsharded parameters are the default stream's
    from its forward's copy-out on (no all-gather output of it in flight at the loss, no copy-out at its
    own backward); the reference's root and layers are resharded and gathered again."""
    return setup.impl.impl is Impl.TORCHTITAN


def _reduce_bytes(setup: Setup) -> int:
    """A reduce-scatter input's element: ``reduce_dtype`` under FSDP2's mixed precision
    (``fsdp.reduce.reduce_bytes``), else the gradients' own dtype (no policy: no cast)."""
    return reduce_bytes(setup) if fsdp2_mixed(setup) else setup.training.precision.grad_bytes


def root_grads(setup: Setup, embedding: bool) -> int:
    """Bytes of the root's unsharded gradients held to the backward's end: the final norm's and the lm
    head's, and (``embedding``) the embedding's and the learned positions'."""
    return _elements(root_shapes(setup, embedding)) * unsharded_grad_bytes(setup)


def last_grad(setup: Setup) -> int:
    """Bytes of the root's last parameter's unsharded gradient, the lm head's [v, h] (``root_shapes``'
    order), which torch 2.13's ``foreach_reduce`` keeps bound to its loop variable (``for i,
    (fsdp_param, unsharded_grad) in enumerate(...)``) until it returns: alive beside the reduce-scatter's
    output where the unit's other gradients were freed after the copy-in."""
    return _elements(root_shapes(setup)[-1:]) * unsharded_grad_bytes(setup)


def root_sharded_grads(setup: Setup) -> int:
    """Bytes of the root's sharded gradients (its dim-0 shards), which the model states count and which do
    not exist before its reduce-scatter at the backward's end."""
    n = _shards(setup)
    element = sharded_grad_bytes(setup)
    return sum(-(-s[0] // n) * math.prod(s[1:]) for s in root_shapes(setup)) * element


def layer_reduce_input(setup: Setup) -> int:
    """Bytes of one layer's flat reduce-scatter input, held until the next unit's reduce-scatter."""
    return fsdp2_flat_elements(block_shapes(setup), _shards(setup)) * _reduce_bytes(setup)


def root_reduce_input(setup: Setup) -> int:
    """Bytes of the root's flat reduce-scatter input at the backward's end."""
    return fsdp2_flat_elements(root_shapes(setup), _shards(setup)) * _reduce_bytes(setup)


def layer_buffers(setup: Setup, i: int, layers: int, compute: int, incoming: int) -> tuple[int, int]:
    """FSDP2's buffers beside layer i's backward and the largest of its two peaks: the reduce-scatter
    input of layer i + 1 (none above the top layer: the root reduces last) held throughout, and either
    the copy-out at its pre-backward (the prefetched flat all-gather output beside the new unsharded
    parameters, with the ``incoming`` output gradient) or its ``compute`` transient with layer i − 1's
    flat all-gather output prefetched beside it. Returns the transient to count (buffers included) and,
    of it, the flat all-gather output (the all-gather stream's block: ``analytic.peak.Peak``)."""
    held = layer_reduce_input(setup) if i + 1 < layers else 0
    prefetched = layer_flat(setup) if i > 0 else 0
    copy_out = incoming + layer_flat(setup)
    if i == layers - 1 and kept_after_forward(setup):  # still unsharded from its forward: no copy-out
        copy_out = 0
    if compute + prefetched >= copy_out:
        return held + compute + prefetched, prefetched
    return held + copy_out, layer_flat(setup)
