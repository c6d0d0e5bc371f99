"""Issue #22 item 1: NCCL's buffers per communicator (``memplan.analytic.nccl``, ``memplan.time.
comm.buffers``), every figure derived here by hand from NCCL's defaults.

Per connection, NCCL's three protocols (src/init.cc, src/include/device.h):
  LL    = 8 lines/thread × 512 threads × 8 steps × 16 B           =   524,288
  LL128 = 120 elems/thread × 640 threads × 8 steps × 8 B          = 4,915,200
  Simple = 1 << 22                                                 = 4,194,304
The receiver holds a 4,096-byte header and the three: 9,637,888 B → 10 MiB in cuMem's 2 MiB granules
(10,485,760, the size NVIDIA/nccl#1685 logs); the sender one 4,096-byte page → 2 MiB (2,097,152, ditto).
A ring channel on a rank: one of each, 12 MiB.
"""

from __future__ import annotations

import json

from typer.testing import CliRunner

from memplan.analytic import nccl
from memplan.analytic.nccl import Communicator, buffers
from memplan.api import Options, build
from memplan.cli.app import app
from memplan.presets import load_gpu
from memplan.reserved import CUDA_CONTEXT
from memplan.search.budget import verdict
from memplan.time.comm.buffers import communicators, nccl_bytes

MIB = 2**20
RING = 12 * MIB  # 10 MiB receive + 2 MiB send (module docstring)


def test_one_connection_is_the_sizes_nccl_allocates() -> None:
    assert (nccl.LL_BUFFSIZE, nccl.LL128_BUFFSIZE, nccl.SIMPLE_BUFFSIZE) == (524_288, 4_915_200, 4_194_304)
    assert 4096 + 524_288 + 4_915_200 + 4_194_304 == 9_637_888 <= 10 * MIB
    assert nccl.RECV_CONNECTION == 10_485_760 and nccl.SEND_CONNECTION == 2_097_152
    assert nccl.RING_CHANNEL == RING


def test_a_ring_per_collective_communicator() -> None:
    # Hopper 16 channels (nccl#892), Ampere 24 (nccl-tests#100), a PCIe GPU 2: 12 MiB each
    tp8 = Communicator("tp", 8, 0, False)
    assert buffers(tp8, "hopper").bytes == 16 * RING == 192 * MIB
    assert buffers(tp8, "ampere").bytes == 24 * RING == 288 * MIB
    assert buffers(tp8, "ada").bytes == buffers(tp8, None).bytes == 2 * RING
    # inter-node rings have as many channels (nccl#1453: 3 nodes of H100, "Channel 00/16")
    assert buffers(Communicator("dp", 64, 0, True), "hopper").bytes == 192 * MIB
    # one rank connects nothing
    assert buffers(Communicator("dp", 1, 0, False), "hopper").bytes == 0


def test_point_to_point_channels_per_peer() -> None:
    # inside a node: the collective channels rounded up to a power of two (Hopper 16 → 16, Ampere 24 → 32)
    pp = Communicator("pp", 4, 2, False)
    assert buffers(pp, "hopper").p2p_channels == 16 and buffers(pp, "hopper").bytes == 2 * 16 * RING
    assert buffers(pp, "ampere").p2p_channels == 32 and buffers(pp, "ampere").bytes == 2 * 32 * RING
    # between nodes: 2 per peer (nccl#1189, NCCL_NCHANNELS_PER_NET_PEER)
    assert buffers(Communicator("pp", 4, 2, True), "hopper").bytes == 2 * 2 * RING
    # all-to-all over 8 ranks of one node: 7 peers × 16 channels × 12 MiB = 1,344 MiB
    assert buffers(Communicator("ep", 8, 7, False), "hopper").bytes == 1344 * MIB


def test_the_groups_of_a_3d_layout() -> None:
    """tp 8 × pp 4 × dp 4 on 8-GPU H100 nodes: tp inside a node (stride 1), pp's neighbours 8 ranks apart
    (another node), dp 32 apart. A middle stage talks to two stages, the first to one."""
    r = build(Options(model="llama-3-8b", gpu="h100", tp=8, pp=4, dp=4, zero=1)).result
    topo = load_gpu("h100").topology
    middle = communicators(r.setup, 1, topo)
    assert [(c.name, c.ranks, c.peers, c.inter_node) for c in middle] == [
        ("tp", 8, 0, False),
        ("pp", 4, 2, True),
        ("dp", 4, 0, True),
    ]
    assert [c.peers for c in communicators(r.setup, 0, topo) if c.name == "pp"] == [1]
    # the most loaded device's stage decides: tp ring 16 × 12 + dp ring 16 × 12 + pp peers × 2 × 12 MiB
    peers = 1 if r.device.stage.index in (0, 3) else 2
    assert nccl_bytes(r, load_gpu("h100")) == (16 + 16 + peers * 2) * RING
    assert nccl_bytes(r, None) == 0
    # the verdict judges that rank; when only a stage's lower bound is needed, that stage's rank
    assert verdict(r, load_gpu("h100")).nccl == (16 + 16 + peers * 2) * RING
    tiny = load_gpu("h100").model_copy(update={"device_mib": None, "memory_bytes": 2**30})
    lower = verdict(r, tiny, exact=False)
    assert not lower.exact and lower.phase == "lower bound"
    assert lower.nccl == (16 + 16 + (1 if lower.stage in (0, 3) else 2) * 2) * RING


def test_interleaving_gives_the_first_stage_two_peers() -> None:
    r = build(Options(model="llama-3-8b", gpu="h100", pp=4, vpp=2, dp=2, global_batch=8)).result
    topo = load_gpu("h100").topology
    assert [c.peers for c in communicators(r.setup, 0, topo) if c.name == "pp"] == [2]


def test_hsdp_has_a_shard_and_a_replicate_group() -> None:
    """dp 16 with --hsdp 8 on 8-GPU nodes: the shard group is one node, the 2 replicas 8 ranks apart."""
    r = build(Options(model="llama-3-8b", gpu="h100", dp=16, hsdp=8, zero=3)).result
    got = [
        (c.name, c.ranks, c.peers, c.inter_node) for c in communicators(r.setup, 0, load_gpu("h100").topology)
    ]
    assert got == [("dp (shard)", 8, 0, False), ("dp (replicate)", 2, 0, True)]


def test_context_parallel_rotation_is_point_to_point() -> None:
    topo = load_gpu("h100").topology
    gather = build(Options(model="llama-3-8b", gpu="h100", cp=4, seq=8192)).result
    rotate = build(Options(model="llama-3-8b", gpu="h100", cp=4, seq=8192, cp_rotate="alltoall")).result
    # the all-gather runs the cp ring; the rotation sends to the next rank and receives from the previous:
    # one send and one receive connection per channel, one peer's worth. Gradients reduce over dp × cp = 4.
    assert [(c.name, c.peers) for c in communicators(gather.setup, 0, topo)] == [("cp", 0), ("dp", 0)]
    assert [(c.name, c.peers) for c in communicators(rotate.setup, 0, topo)] == [("cp", 1), ("dp", 0)]


def test_expert_parallelism_all_to_all_and_the_experts_dp_group() -> None:
    """Mixtral on 16 H100s, ep 8: all-to-all with 7 peers of one node (stride 1 inside dp) and the routed
    experts' gradients over dp/ep = 2 ranks 8 apart (another node)."""
    r = build(Options(model="mixtral-8x7b", gpu="h100", dp=16, ep=8, zero=3)).result
    got = [
        (c.name, c.ranks, c.peers, c.inter_node) for c in communicators(r.setup, 0, load_gpu("h100").topology)
    ]
    assert got == [("dp", 16, 0, True), ("dp experts", 2, 0, True), ("ep", 8, 7, False)]
    # rings: dp 16 × 12 + experts 16 × 12; all-to-all 7 × 16 × 12 MiB
    assert nccl_bytes(r, load_gpu("h100")) == (16 + 16 + 7 * 16) * RING


def test_estimate_shows_and_judges_with_them() -> None:
    """The JSON reports NCCL's buffers beside the CUDA context; the device holds reserved + both; the
    verdict's usable memory leaves them out. tp 2 × dp 4 on H100: two rings, 2 × 16 × 12 = 384 MiB."""
    out = CliRunner().invoke(
        app, ["estimate", "-m", "llama-3-8b", "--gpu", "h100", "--tp", "2", "--dp", "4", "--json"]
    )
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output)
    mem = doc["memory"]
    assert mem["nccl"]["total"] == 384 * MIB
    assert [(c["group"], c["channels"], c["bytes"]) for c in mem["nccl"]["communicators"]] == [
        ("tp", 16, 192 * MIB),
        ("dp", 16, 192 * MIB),
    ]
    alloc = mem["allocator"]
    assert alloc["nccl"] == 384 * MIB and alloc["cuda_context"] == CUDA_CONTEXT
    assert alloc["device_peak"] == alloc["reserved_peak"] + CUDA_CONTEXT + 384 * MIB
    assert doc["fit"]["nccl"] == 384 * MIB
    assert mem["device_usable"] == doc["fit"]["usable_bytes"] == (81559 - 767 - 384) * MIB
