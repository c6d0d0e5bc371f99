"""torchao's float8 tensor-parallel plan on torchtitan's Llama 3 blocks (``--fp8-tp``), as torchtitan's 2024
``apply_tp`` laid out float8 blocks (torchtitan 9dec370, ``parallelisms/parallelize_llama.py``: under
``enable_float8_linear`` the block plan's styles are torchao's ``Float8ColwiseParallel``,
``Float8RowwiseParallel`` and ``PrepareFloat8ModuleInput``, torchao/float8/float8_tensor_parallel.py).

torchtitan 0.3.0 has no such plan: its blocks are sharded by declarations (``set_llama3_sharding_config``)
that gather the bf16 input and let each ``Float8Linear`` cast the gathered tensor. Here the decoder's own
declarations (the vocabulary-parallel embedding, the final norm, the loss-parallel lm head:
``set_decoder_sharding_config``) are kept and every block is laid out by torch's ``parallelize_module``
with the 2024 plan, the module paths 0.3.0's (the fused ``attention.qkv_linear.wqkv``):

- ``attention_norm``, ``ffn_norm``: ``SequenceParallel``;
- ``attention`` and ``feed_forward``: ``PrepareFloat8ModuleInput`` from ``Shard(1)`` to ``Replicate()``: the
  norm's output cast to float8 on its sequence shard (``hp_tensor_to_float8_dynamic``, the amax all-reduced
  over the tp group) and all-gathered in float8, once for the linears that share it (W1 and W3);
- ``wqkv``, ``w1``, ``w3``: ``Float8ColwiseParallel`` (the input found cast; the output's gradient cast in
  backward by ``NoopFwToFloat8BwDynamic`` on the rank's column shard);
- ``wo``, ``w2``: ``Float8RowwiseParallel`` to ``Shard(1)``: the input [T, in/t] cast on the rank, the
  output reduce-scattered, and in backward its gradient cast on the sequence shard before the all-gather
  (which then moves float8).

NB: 0.3.0's residual stream is a DTensor (the embedding's ``Shard(1)`` output under the ``partial_dtensor``
backend), so the row-parallel outputs stay DTensors (``use_local_output=False``) where the 2024 code, whose
embedding returned a local shard, returned local tensors: the same storages.
"""

from __future__ import annotations

from typing import Any


def block_plan() -> dict[str, Any]:
    """The 2024 ``apply_tp`` block plan under float8, keyed by torchtitan 0.3.0's module paths."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import SequenceParallel
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    def rowwise() -> Any:
        return Float8RowwiseParallel(output_layouts=Shard(1), use_local_output=False)

    return {
        "attention_norm": SequenceParallel(),
        # Attention.forward(x, attention_masks, positions): only x is laid out
        "attention": PrepareFloat8ModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        "attention.qkv_linear.wqkv": Float8ColwiseParallel(),
        "attention.wo": rowwise(),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareFloat8ModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "feed_forward.w1": Float8ColwiseParallel(),
        "feed_forward.w2": rowwise(),
        "feed_forward.w3": Float8ColwiseParallel(),
    }


def set_sharding(config: Any) -> None:
    """The decoder's declarations only (embedding, final norm, lm head, sequence-parallel): the blocks are
    left undeclared for ``apply_plan``."""
    from torchtitan.models.common.decoder_sharding import set_decoder_sharding_config

    set_decoder_sharding_config(config, enable_sp=True)


def apply_plan(part: Any, dims: Any) -> None:
    """Every block of ``part`` laid out by ``block_plan`` over the tp mesh (after ``part.parallelize``)."""
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = dims.get_mesh("tp")
    for block in part.layers.values():
        parallelize_module(block, mesh, block_plan())
