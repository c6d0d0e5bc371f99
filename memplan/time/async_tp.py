"""torchtitan's asynchronous tensor parallelism (``--async-tp``: torchtitan's
``parallelism.enable_async_tensor_parallel``): torch's micro-pipelined TP, what it fuses, the kernels it adds
and the symmetric memory it holds outside torch's caching allocator.

What runs (torchtitan's ``apply_tp``: ``torch._inductor.config._micro_pipeline_tp = True`` and
``enable_symm_mem_for_group`` on the tp group; it needs ``--compile``). Inductor's post-grad pass
(torch/_inductor/fx_passes/micro_pipeline_tp.py, ``micro_pipeline_tp_pass``) rewrites, in each compiled
graph:
- an all-gather whose result feeds matmuls as their A operand (``fuse_all_gather_matmul``) into
  ``symm_mem.fused_all_gather_matmul(A_shard, [B_0, B_1, …])``: the block's gathered norm outputs into W_Q,
  W_K, W_V (one op, three B) and into W_1, W_3 (two), and in backward the gathered output gradients of W_O
  and W_2 into their input-gradient matmuls (the weight gradient takes the gathered tensor transposed, not
  as A: not fused; the op returns the gathered A for it, ``return_A``);
- a reduce-scatter whose input is one matmul's output with no other user (``fuse_matmul_reduce_scatter``)
  into ``symm_mem.fused_matmul_reduce_scatter``: W_O's and W_2's outputs in forward. The backward's
  reduce-scatter of the column-parallel input gradients takes a sum of two or three matmuls (W_Q, W_K, W_V;
  W_1, W_3), not a matmul: it stays NCCL's, under the weight gradients as before
  (``comm.collectives.tp_rows``).
A re-run block (full checkpointing) runs its forward's fused ops again. torchtitan compiles each block
(``apply_compile``); the embedding, the final norm and the output are eager: the head's all-gather and the
embedding's reduce-scatter stay NCCL's. These are the collectives TE's userbuffers run under their GEMMs
(``time.tp_overlap``), and they hide the same way: the rank's own shard's matmul first, then each peer's
shard copied over NVLink (``_pipelined_all_gather_and_consume``: two streams, the next shard's copy under
the current shard's matmul) or each peer's output chunk made and copied (``_pipelined_produce_and_all2all``):
(t − 1)/t of the GEMMs a window (``tp_overlap.windows``), charged as every overlapped NVLink collective is.

Kernels it adds, memory-bound, on the critical path (``local_bytes``; T = b·s/cp tokens of the tp group, t
the tp degree, h the hidden size, e the activation bytes, g the gathered bytes: 1 for ``--fp8-tp``'s float8
gathers, else e):
- each fused all-gather first copies the rank's shard into its symmetric buffer and waits on a barrier
  before the first matmul ("we are giving up the chance to overlap mv and b with the first
  shard_consumer"): a read and a write of [T/t, h], 2·(T/t)·h·g (its copy into the gathered output runs
  under the last matmul: not charged);
- each fused reduce-scatter sums the t partial chunks it received (``reduce_fn`` over ``stacked_partials``
  [T, h]): a read of T·h·e and a write of (T/t)·h·e, where NCCL's reduce-scatter reduces inside the
  collective.
Per layer: forward 2 all-gathers and 2 reduce-scatters; backward 2 all-gathers; a re-run layer its
forward's again.

Memory (``workspace_bytes``): one workspace per tp group (``get_symm_mem_workspace``), grown to the largest
request — an all-gather's shard (T/t)·h·g, a reduce-scatter's two output chunks 2·(T/t)·h·e (``p2p_workspace
_size_req = out_chunks[0].numel() * out_chunks[0].element_size() * 2``) — allocated by
``_SymmetricMemory.empty_strided_p2p``: ``CUDASymmetricMemoryAllocator::alloc`` cuMemCreate's the size
rounded to 16 B plus the signal pad (torch 2.13: 32 channels × 72 ranks × 4 B, ``default_signal_pad_size``)
rounded up to the allocation granularity (2 MiB, ``analytic.nccl.granular``). Outside torch's caching
allocator (``reserved_bytes`` does not count it); the device holds it from the first step. Inside the
allocator the fused ops allocate what the unfused code did: the gathered A and each matmul's output, the
[T, h] partial products and the [T/t, h] sum.

NB, not modelled: the matmuls split into t chunks of T/t rows (their wave efficiency taken as the whole
GEMM's, as TE's); the barriers' latency; the rowwise float8 gathers' [T/t] fp32 scales beside the shard.
NB, not measured: which collectives the pass fuses is read from its rules above. Run on CPU (the fake
process group, AOTAutograd's graphs of torchtitan 0.3.0's tp 2 + SP block, the pass forced on), it fused
none after Inductor's own post-grad passes. With only the views canonicalised by hand it fused the MLP's
gather, both forward reduce-scatters, W_2's gradient gather and the attention's input-gradient
reduce-scatter. 0.3.0's fused W_QKV makes that a single matmul; the runs' separate W_Q, W_K, W_V do not.
The CPU graphs are not CUDA's: SDPA's CPU kernel, no Inductor lowering. The published speed-ups
(docs/step-time.md) are the check.
"""

from __future__ import annotations

from memplan.analytic.nccl import granular
from memplan.config import Setup
from memplan.presets import Topology
from memplan.time.comm.rows import rank_tokens

SIGNAL_PAD = 32 * 72 * 4
"""The symmetric allocation's signal pad (torch 2.13, torch/csrc/distributed/c10d/symm_mem:
``symm_max_nblocks`` 32 × ``max_cuda_p2p_domain_size`` 72 × ``sizeof(uint32_t)``,
``default_signal_pad_size``)."""

GATHERS_FORWARD, SCATTERS_FORWARD, GATHERS_BACKWARD = 2, 2, 2
"""Fused ops of one layer (module docstring): the forward's all-gathers into W_Q/W_K/W_V and W_1/W_3, its
reduce-scatters of W_O's and W_2's outputs, the backward's all-gathers of their output gradients."""


def applies(setup: Setup) -> bool:
    """``--async-tp`` (its rules, ``config.impl_rules.check_async_tp``: torchtitan, compile, tp with sp)."""
    return setup.impl.async_tp


def check_node(setup: Setup, topo: Topology) -> None:
    """A one-line ``ValueError`` where the tp group leaves a node: symmetric memory maps the peers' memory
    over NVLink (CUDA peer access within one node)."""
    if applies(setup) and setup.parallel.tp > topo.gpus_per_node:
        raise ValueError(
            f"async_tp: torch's symmetric memory maps the tp ranks' memory over one node's NVLink; --tp "
            f"{setup.parallel.tp} spans more than its {topo.gpus_per_node} GPUs: use --tp ≤ "
            f"{topo.gpus_per_node} or drop --async-tp"
        )


def _shard_elements(setup: Setup) -> int:
    """[T/t, h]: one rank's sequence shard of the tp group's hidden states (T = b·s/cp, ``rank_tokens``)."""
    return rank_tokens(setup) // setup.parallel.tp * setup.model.hidden_size


def _gathered_bytes(setup: Setup) -> int:
    """Bytes of a gathered element: float8 under ``--fp8-tp`` (the layers' gathers), else the activations'."""
    return 1 if setup.impl.fp8_tp else setup.training.precision.activation_dtype.bytes


def local_bytes(setup: Setup) -> tuple[int, int]:
    """(forward, backward) bytes of one layer's added kernels (module docstring): the fused all-gathers'
    copies of the rank's shard, the fused reduce-scatters' sums; (0, 0) without ``--async-tp``. A re-run
    layer moves the forward's again."""
    if not applies(setup):
        return 0, 0
    shard, e, t = _shard_elements(setup), setup.training.precision.activation_dtype.bytes, setup.parallel.tp
    copy = 2 * shard * _gathered_bytes(setup)
    reduce = shard * t * e + shard * e
    return GATHERS_FORWARD * copy + SCATTERS_FORWARD * reduce, GATHERS_BACKWARD * copy


def workspace_bytes(setup: Setup) -> int:
    """The tp group's symmetric-memory workspace on one rank (module docstring); 0 without ``--async-tp``."""
    if not applies(setup):
        return 0
    shard = _shard_elements(setup)
    size = max(shard * _gathered_bytes(setup), 2 * shard * setup.training.precision.activation_dtype.bytes)
    return granular(-(-size // 16) * 16 + SIGNAL_PAD)
