"""Data parallelism's own copy kernels on the compute stream — FSDP2's all-gather copy-outs and
reduce-scatter copy-ins, DDP's bucket copies — memory-bound work the step runs beside its layers (issue #21:
"every kernel of the step"). The part ``dp copies`` of the predicted step.

FSDP2 (``torch.distributed.fsdp.fully_shard``; torch 2.13 torch/distributed/fsdp/_fully_shard/
_fsdp_collectives.py) moves every gathered parameter and every reduced gradient through HBM twice more than
the collective itself does:

- **all-gather copy-out** (``foreach_all_gather_copy_out``, called by ``FSDPParamGroup.wait_for_unshard`` on
  the current stream after it waits for the all-gather's event): ``torch.ops.fsdp.split_with_sizes_copy(
  all_gather_output, all_gather_input_split_sizes, dim=1, out=out)`` reads the flat all-gather output —
  W shards of each parameter, in the gathered dtype — and writes each unsharded parameter: 2 × the
  output's bytes per gather, one kernel per unit;
- **reduce-scatter copy-in** (``foreach_reduce``): ``foreach_reduce_scatter_copy_in`` →
  ``torch.ops.fsdp.chunk_cat(unsharded_grads, dim=0, num_chunks=world_size, out=reduce_scatter_input)``
  reads the unit's unsharded gradients (the gathered parameters' dtype) and writes the flat input in the
  reduce dtype. It runs *before* ``reduce_scatter_stream.wait_stream(current_stream)`` and outside the
  ``with device_handle.stream(reduce_scatter_stream)`` block, i.e. on the compute stream ("Only after the
  copy-in finishes can we free the gradients"): (e_gathered + e_reduce) bytes an element per
  reduce-scatter, one kernel per unit. No division pass: for fp32 and bf16 ``_get_gradient_divide_factors``
  returns no pre- or post-divide factor and reduces with ``ReduceOp.AVG`` ("use NCCL's built-in division to
  avoid separate div kernels").

Both run on the stream the layers compute on, so the step waits for them: they are charged whole, at
``MEMORY`` × the HBM bandwidth (``compute.hbm_bytes_per_s``, as every memory-bound kernel), their counts and
sizes read off data parallelism's rows (``time.comm.dp``: each all-gather row's bytes are the gathered
output, each reduce-scatter row's the reduce input, already counted per the reshard policy, the pipeline's
once-per-step gathers and the interleaved schedule's re-gathers). Not charged: the all-gather copy-in on
its own stream (the rank's 1/W shards cast to the parameter dtype and copied into the input: 1/W of the
output), the post-reduce accumulation on the reduce-scatter stream (1/W), the kernels' launches (one per
unit, large).

DDP (``ddp``: ZeRO 0 over dp > 1 under ``--impl hf`` — transformers' Trainer and Accelerate wrap the model in
``torch.nn.parallel.DistributedDataParallel`` — and ``--impl torchtitan``, whose DDP path ``replicate`` runs
the same reducer; ``time.comm.buffers.ddp_bucket_bytes`` holds their buckets in memory): with the default
``gradient_as_bucket_view=False`` the reducer copies each gradient into its bucket as autograd makes it,
dividing by the world size on the way (torch/csrc/distributed/c10d/reducer.cpp ``mark_variable_ready_dense``:
``at::mul_out(bucket_view, grad, wrapped)`` "Divides while copying into the bucket view to save one scan
over all the input parameters"), and after the bucket's all-reduce copies it back (``finalize_bucket_dense``
→ ``copy_bucket_to_grad``: ``grad.copy_(bucket_view)``): 4 × the reduced gradients' bytes per all-reduce,
both on the compute stream (the autograd hook, the final callback). NB: DDP's opt-in
``batched_grad_copy=True`` (torch 2.13, default False) defers the copy-in to one ``_foreach_copy_`` and a flat
``div_`` per bucket (2 more bytes an element): not modelled.

Where FSDP2 runs (``fsdp2``): ``--impl torchtitan``'s FSDP2 (``analytic.fsdp.moments.titan_fsdp2``: ZeRO-2
or 3 over more than one rank) and the reference's ZeRO-3 (``measure.distributed.parallelize``:
``fully_shard`` per layer and on the root), whose rows are FSDP2's (gathers in every forward and backward,
a reduce-scatter every micro-batch). NB: the reference's ZeRO-1/2 rows are DeepSpeed's (one gradient
reduce-scatter, one gather of the updated weights into the flat buffer, no copy-out), Megatron's
distributed optimizer gathers into and reduces from its contiguous buffers, and transformers' stacks
run DDP or DeepSpeed: none charged. NB: Composer's FSDP1 (the llm-foundry runs) gathers into the flat
parameter the layers view (no copy-out) but builds the flat gradient by autograd's ``cat`` and casts and
pre-divides it on its post-backward stream; typed as ZeRO-3, those runs are charged FSDP2's kernels.

Megatron FSDP with float8 primary weights on Hopper (``fp8_transposed``): after each backward all-gather TE
transposes the layer's float8 data for the dgrad GEMM (``nvte_transpose``, 2 bytes an element, on the
compute stream); Blackwell reads the data as it is. Its gathers' own buffers are not charged (they are
the collective's).
"""

from __future__ import annotations

from memplan.analytic.fsdp.moments import titan_fsdp2
from memplan.analytic.fsdp.reduce import reduce_bytes
from memplan.blocks import te_fp8
from memplan.config import Impl, ModelConfig, Setup, ZeroStage
from memplan.presets import GpuPreset
from memplan.time.comm.dp import gradient_bytes
from memplan.time.comm.fabric import Collective
from memplan.time.comm.rows import Phase, Row
from memplan.time.compute import hbm_bytes_per_s


def fsdp2(setup: Setup) -> bool:
    """Whether data parallelism's rows are FSDP2's collectives, whose copies this module charges (module
    docstring): torchtitan's FSDP2, or the reference's ZeRO-3 over more than one rank."""
    if setup.impl.impl is Impl.TORCHTITAN:
        return titan_fsdp2(setup)
    sharded = setup.state_shards > 1
    return setup.impl.impl is Impl.REFERENCE and setup.strategy.zero is ZeroStage.PARAMETERS and sharded


def ddp(setup: Setup) -> bool:
    """Whether the gradients' all-reduce is torch DDP's reducer, whose bucket copies this module charges
    (module docstring): ZeRO 0 over dp > 1 under ``--impl hf`` or ``torchtitan``."""
    impl = setup.impl.impl
    return (
        impl in (Impl.HF, Impl.TORCHTITAN) and setup.strategy.zero is ZeroStage.NONE and setup.strategy.dp > 1
    )


def copy_bytes(setup: Setup, rows: list[Row], transposed: int = 0) -> int:
    """Bytes data parallelism's own copies move in one step on the device ``rows`` are for (module
    docstring): FSDP2's (``fsdp2_bytes``) or DDP's (4 × each gradient all-reduce's bytes); Megatron FSDP's
    float8 transposes, 2 bytes each of ``transposed`` elements per backward all-gather
    (``fp8_transposed``)."""
    if ddp(setup):
        reduced = [r for r in rows if r.dimension.startswith("dp") and r.collective is Collective.ALL_REDUCE]
        return sum(4 * r.bytes * r.count for r in reduced)
    gathered = [r for r in rows if r.dimension.startswith("dp") and r.collective is Collective.ALL_GATHER]
    again = sum(r.count for r in gathered if r.phase is Phase.BACKWARD)
    return fsdp2_bytes(setup, rows) + 2 * transposed * again


def fp8_transposed(setup: Setup, layers: int, rank: ModelConfig) -> int:
    """Megatron FSDP's float8 primary weights (``te_fp8.fsdp_primary``) on a GPU whose float8 GEMMs take
    TN operands only (``te_fp8.copies`` 2: Hopper): each backward all-gather of a stage's ``layers`` is
    followed by TE's ``nvte_transpose`` of its linears' float8 data (the dgrad GEMM's operand; kept until
    the layer reshards, ``keep_fp8_transpose_cache = False``), 1 byte read and 1 written an element, on
    the compute stream; ``rank`` the tensor-parallel rank's model. 0 elsewhere."""
    if not te_fp8.fsdp_primary(setup) or te_fp8.copies(setup.impl) == 1:
        return 0
    return layers * te_fp8.primary_elements(setup, rank)


def fsdp2_bytes(setup: Setup, rows: list[Row]) -> int:
    """Bytes FSDP2's copy-outs and copy-ins move in one step (module docstring): 2 × each all-gather's
    output; each reduce-scatter's input elements × (the unsharded gradients' bytes + the reduce dtype's).
    0 where FSDP2 does not run."""
    if not fsdp2(setup):
        return 0
    gathered, titan = setup.training.precision.weight_bytes, titan_fsdp2(setup)
    total = 0
    for r in rows:
        if not r.dimension.startswith("dp"):
            continue
        # the reduce dtype as ``comm.dp`` counts the row: torchtitan's FSDP2 policy on the dense "dp" rows
        reduced = reduce_bytes(setup) if titan and r.dimension == "dp" else gradient_bytes(setup)
        if r.collective is Collective.ALL_GATHER:
            total += 2 * r.bytes * r.count
        elif r.collective is Collective.REDUCE_SCATTER:
            total += r.bytes // reduced * (gathered + reduced) * r.count
    return total


def copy_seconds(setup: Setup, rows: list[Row], gpu: GpuPreset, transposed: int = 0) -> float:
    """``copy_bytes`` at ``MEMORY`` × the HBM bandwidth: seconds per step on the compute stream."""
    return copy_bytes(setup, rows, transposed) / hbm_bytes_per_s(gpu)
