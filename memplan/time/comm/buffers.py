"""The NCCL communicators one rank of a layout belongs to, and their buffers (``analytic.nccl``).

The groups are those ``time.comm.collectives`` places, one NCCL communicator per process group (torch's
``ProcessGroupNCCL`` opens one per group and device; torchtitan's device mesh one per dimension and per
flattened dimension it communicates over):

- ``tp``: tp ranks, collectives (their ring);
- ``cp``: cp ranks, torch's ring attention: an all-gather (the ring) with ``--cp-rotate allgather``, a
  rotation to the next rank with ``alltoall`` (point-to-point: a send to one peer and a receive from
  another per channel, one peer's worth);
- ``pp``: point-to-point with the neighbouring stages: one peer for the first and last stage (and when
  pp = 2), two for the others; the interleaved schedule wraps the last stage's chunks to the first
  stage's next ones, so every stage has two;
- ``dp``: ZeRO's / DDP's collectives over dp × cp ranks (torchtitan's ``dp_shard_cp``); with HSDP the
  shard group (R × cp) and the replicate group (dp/R); routed experts over dp/ep when ep > 1;
- ``ep``: the all-to-alls of the routed tokens: point-to-point with all ep − 1 peers;
- ``fp8 amax``: Transformer Engine's delayed scaling (``--impl megatron --fp8 delayed``) all-reduces its
  amax buffers over Megatron's amax reduction group, tp × dp × cp (``time.comm.fp8_rows``), a process
  group of its own (``_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP``) whatever other group has its ranks.

A group's ranks are ``placed`` on the topology as ``time.comm.collectives`` places them (inside a node or
not).

NB: the world group torch creates first (``init_process_group``) holds no buffers until a collective runs
on it (lazy connection, ``analytic.nccl``); a barrier on it would connect its ring.
"""

from __future__ import annotations

from memplan.analytic.fsdp.buffers import all_gather_stream, reduce_scatter_stream
from memplan.analytic.nccl import Communicator, NcclBuffers, buffers
from memplan.blocks import te_fp8
from memplan.config import CpRotate, Impl, Setup, ZeroStage
from memplan.engine import Result
from memplan.presets import GpuPreset, Topology
from memplan.stage_plan import StagePlan, partial_grads
from memplan.time.async_tp import workspace_bytes
from memplan.time.comm.fabric import link, placed
from memplan.time.comm.rows import expert_groups, stride
from memplan.time.tp_overlap import userbuffer_bytes


def _inter(topo: Topology, group_stride: int, n: int) -> bool:
    return link(topo, group_stride, n).level == "inter-node"


def pipeline_peers(setup: Setup, stage: int) -> int:
    """Stages the rank at ``stage`` exchanges activations and gradients with (module docstring)."""
    p = setup.parallel.pp
    if p == 1:
        return 0
    if p == 2:
        return 1
    ends = stage in (0, p - 1)
    return 1 if ends and setup.parallel.vpp == 1 else 2


def communicators(setup: Setup, stage: int, topo: Topology) -> list[Communicator]:
    """The communicators of a rank of pipeline stage ``stage`` with more than one rank (module docstring)."""
    par, st = setup.parallel, setup.strategy
    out: list[Communicator] = []
    if par.tp > 1:
        out.append(Communicator("tp", par.tp, 0, _inter(topo, 1, par.tp)))
    if par.cp > 1:
        rotate = par.cp_rotate is CpRotate.ALLTOALL
        out.append(Communicator("cp", par.cp, 1 if rotate else 0, _inter(topo, stride(setup, "cp"), par.cp)))
    if (peers := pipeline_peers(setup, stage)) > 0:
        out.append(Communicator("pp", par.pp, peers, _inter(topo, stride(setup, "pp"), 2)))
    at = stride(setup, "dp")
    shard = setup.state_shards
    if shard > 1:
        inter = placed(topo, ((stride(setup, "cp"), par.cp), (at, st.shard_group))).level == "inter-node"
        out.append(Communicator("dp" if st.replicas == 1 else "dp (shard)", shard, 0, inter))
    if st.replicas > 1:
        out.append(
            Communicator("dp (replicate)", st.replicas, 0, _inter(topo, at * st.shard_group, st.replicas))
        )
    if setup.model.moe is not None and par.ep > 1:
        (ep_at, ep), (edp_at, edp) = expert_groups(setup)
        if edp > 1:
            out.append(Communicator("dp experts", edp, 0, _inter(topo, edp_at, edp)))
        out.append(Communicator("ep", ep, ep - 1, _inter(topo, ep_at, ep)))
    amax = par.tp * par.cp * st.dp
    if te_fp8.delayed(setup) and amax > 1:
        dims = ((1, par.tp), (stride(setup, "cp"), par.cp), (at, st.dp))
        out.append(Communicator("fp8 amax", amax, 0, placed(topo, dims).level == "inter-node"))
    return out


def nccl_buffers(r: Result, gpu: GpuPreset, stage: int | None = None) -> list[NcclBuffers]:
    """NCCL's buffers on a rank of pipeline stage ``stage`` of ``r`` (default: the most loaded device's)
    on ``gpu``."""
    index = r.device.stage.index if stage is None else stage
    return [buffers(c, gpu.arch) for c in communicators(r.setup, index, gpu.topology)]


def nccl_bytes(r: Result, gpu: GpuPreset | None, stage: int | None = None) -> int:
    """Bytes of NCCL's buffers on a rank of ``stage`` (``nccl_buffers``; 0 without a GPU)."""
    return 0 if gpu is None else sum(b.bytes for b in nccl_buffers(r, gpu, stage))


def ddp_bucket_bytes(r: Result, sp: StagePlan | None = None) -> int:
    """Bytes of torch DDP's gradient buckets on a device of stage plan ``sp`` (default: the most loaded
    device): with ZeRO 0 over dp > 1 under
    ``--impl hf`` (transformers' Trainer and Accelerate wrap the model in
    ``torch.nn.parallel.DistributedDataParallel``) and ``--impl torchtitan`` (its DDP path,
    ``replicate``, the same reducer). The reducer allocates one flat buffer per bucket at construction
    (``bucket_cap_mb`` 25 MiB, the first ``dist._DEFAULT_FIRST_BUCKET_BYTES`` 1 MiB) and, with the default
    ``gradient_as_bucket_view=False``, copies each gradient into it: "the saved memory size will be equal
    to the total gradients size" (the parameter's docstring) — one more copy of the rank's gradients,
    alive for the whole run. 0 elsewhere: memplan's reference model all-reduces each gradient in place,
    Megatron's DDP keeps the gradients in its contiguous buffer (``param_and_grad_buffer``: the
    ``main_grad`` are views of it, no second copy), ZeRO ≥ 1 runs FSDP2 or Megatron's distributed
    optimizer. Judged as held for the whole run (``comm_buffer_bytes``).
    NB: default-stream allocations made before the first step, kept apart from the step's replay: the
    segments their 25 MiB buckets round to (2 MiB) are not counted, nor any reuse of their segments."""
    s = r.setup
    if s.strategy.zero is not ZeroStage.NONE or s.strategy.dp == 1:
        return 0
    if s.impl.impl not in (Impl.HF, Impl.TORCHTITAN):
        return 0
    plan = sp or r.device
    # the buckets are the parameters' (local shards); not the whole Partial gradients DTensor leaves
    # under torchtitan's TP without SP (``stage_plan.partial_grads``)
    return plan.states.gradients - partial_grads(s, plan.stage) * s.training.precision.grad_bytes


def fsdp_stream_bytes(r: Result, sp: StagePlan | None = None) -> int | None:
    """What the caching allocator reserves on FSDP2's all-gather stream on a device of stage plan ``sp``
    (default: the most loaded device), where FSDP2 runs its gathers (``--impl reference`` and
    ``torchtitan``; Megatron and transformers' stacks use their own): ``analytic.fsdp.buffers``, memoised
    there; 0 elsewhere, None where not modelled."""
    if r.setup.impl.impl not in (Impl.REFERENCE, Impl.TORCHTITAN):
        return 0
    st = (sp or r.device).stage
    return all_gather_stream(r.rank_setup, st.layers, st.first, st.last, r.micro_batches)


def fsdp_reduce_scatter_bytes(r: Result, sp: StagePlan | None = None) -> int:
    """What the caching allocator reserves on FSDP2's reduce-scatter stream on a device of stage plan
    ``sp`` (default: the most loaded device): the sharded gradients' blocks under FSDP2's mixed precision
    (``analytic.fsdp.buffers.reduce_scatter_stream``; 0 where not modelled). Reported, not kept back: its
    segments hold only the sharded gradients, which the moments count, and are wholly free — released by
    the allocator's out-of-memory path — at every moment without them (``search.budget``'s NB)."""
    st = (sp or r.device).stage
    return reduce_scatter_stream(r.rank_setup, st.layers, st.first, st.last, r.micro_batches)


def beside_replay(r: Result) -> tuple[int | None, int, int, int]:
    """What ``estimate`` reports beside the default stream's replay on ``r``'s most loaded device: FSDP2's
    all-gather stream (None where not modelled), DDP's buckets, FSDP2's reduce-scatter stream and TE's
    userbuffers (``api.Built``'s order)."""
    return fsdp_stream_bytes(r), ddp_bucket_bytes(r), fsdp_reduce_scatter_bytes(r), userbuffer_bytes(r.setup)


def comm_buffer_bytes(r: Result, sp: StagePlan | None = None) -> int:
    """The communication buffers a device of ``sp`` holds beside the step's replay, which the verdict and
    ``fit`` keep back from the default stream's allocator: FSDP2's all-gather stream (its own pool, held
    from the forward's second unit to the end of the run: ``analytic.fsdp.buffers``), DDP's buckets
    (allocated before the first step, never freed) and TE's userbuffers under ``--tp-comm-overlap``
    (registered outside the allocator at start-up: ``time.tp_overlap.userbuffer_bytes``) or torch's
    symmetric-memory workspace under ``--async-tp`` (``time.async_tp.workspace_bytes``). NB: FSDP2's
    stream where it is not modelled (fine-tuning, a mixture of experts under tensor parallelism) counts 0:
    ``--reserve`` is where memory is kept back for it."""
    outside = userbuffer_bytes(r.setup) + workspace_bytes(r.setup)
    return (fsdp_stream_bytes(r, sp) or 0) + ddp_bucket_bytes(r, sp) + outside
