"""NCCL's own device memory: the buffers of the connections a rank's communicators open.

NCCL allocates these itself (``ncclCudaCalloc``, with cuMem since 2.19), outside torch's caching
allocator: ``nvidia-smi`` counts them, ``torch.cuda.memory_reserved()`` does not. Pure arithmetic on the
communicators a rank belongs to (``time.comm.buffers`` lists them from the layout); no torch.

One connection (one channel to one peer, one direction) holds a buffer per protocol (src/init.cc,
``computeBuffSizes``; ``NCCL_BUFFSIZE``, ``NCCL_LL_BUFFSIZE``, ``NCCL_LL128_BUFFSIZE`` override them):
Simple 4 MiB, LL 512 KiB, LL128 4,800 KiB. The P2P transport puts them in the receiver's
``ncclRecvMem`` after a one-page header, and gives the sender an ``ncclSendMem`` of one page (src/include/
comm.h: ``MEM_ALIGN`` 4096; src/transport/p2p.cc, ``p2pRecvSetup``/``p2pSendSetup``; with P2P read, on
NVLink from Ampere on, the Simple buffer moves to the sender's side: the same bytes, split 6 + 6 MiB
below). cuMem rounds every allocation up to its granularity, 2 MiB (``CUDA_IPC_MIN``, comm.h): the
receiver's 9,633,792 + 4,096 bytes take 10 MiB, the sender's page 2 MiB. NVIDIA/nccl#1685 (8 × H100,
``NCCL_DEBUG_SUBSYS=ALLOC``) shows exactly these two allocation sizes, 10,485,760 and 2,097,152 bytes.
So a rank that receives from one peer and sends to one peer on a channel — a ring — holds 12 MiB per
channel (``RING_CHANNEL``).

Connections are made lazily (``NCCL_RUNTIME_CONNECT``, default since NCCL 2.22, NCCL user guide): a
communicator holds only the connections of the algorithms it runs. memplan connects every collective
communicator's ring (all-gather, reduce-scatter and all-reduce all run it) and the point-to-point
channels of the peers a rank sends to (pipeline stages, all-to-all).

Channels: NCCL's topology search finds k rings and ``ncclTopoPostset`` doubles them (src/graph/
connect.cc: ``nChannels = std::min(MAXCHANNELS, nChannels*2)``); what it logs per GPU (``CHANNELS``).
Point-to-point channels per peer are a power of two (src/include/device.h, ``ncclP2pChannelForPart``:
"Only works because nP2pChannels is pow2"): the collective channels rounded up inside a node; between
nodes ``NET_P2P_CHANNELS_PER_PEER``.

Known limitations:
- NB: the tree (NCCL picks it for some multi-node all-reduces), NVLS (H100's NVSwitch multicast, on by
  default for intra-node all-reduce where the fabric supports it) and CollNet connect their own buffers
  when the tuner picks them: not counted. Eager connection (NCCL < 2.22, or ``NCCL_RUNTIME_CONNECT=0``)
  connects ring and tree of every communicator at init: about twice the figure here (NVIDIA/nccl#964:
  544 MB for a 2-rank group on 4 × A100).
- NB: the NET transport (between nodes) places LL buffers in host memory and shares point-to-point
  buffers between peers (``NCCL_NET_SHARED_BUFFERS``; NVIDIA/nccl#1450: "For send/recv operations
  however, we have a single shared buffer"): its connections are counted as the P2P transport's, an
  upper figure.
- NB: NCCL's per-communicator structures (device-side channel arrays, work FIFO, proxy), its kernels'
  module, and communicators a program opens but this layout does not list (the world group's barrier)
  are not counted. RCCL (MI300X) is counted with NCCL's figures.
"""

from __future__ import annotations

from dataclasses import dataclass

NCCL_STEPS = 8
"""Slots of a connection's buffer (src/include/device.h, ``NCCL_STEPS``)."""
SIMPLE_BUFFSIZE = 1 << 22
"""Simple protocol: ``DEFAULT_BUFFSIZE`` = 4 MiB (src/init.cc; ``NCCL_BUFFSIZE``, NCCL user guide:
"default is 4194304 (4 MiB)")."""
LL_BUFFSIZE = 8 * 512 * NCCL_STEPS * 16
"""LL protocol: ``DEFAULT_LL_BUFFSIZE`` = ``NCCL_LL_LINES_PER_THREAD`` 8 × ``NCCL_LL_MAX_NTHREADS`` 512 ×
``NCCL_STEPS`` 8 × sizeof(``ncclLLFifoLine``) 16 = 524,288 (src/init.cc, src/include/device.h)."""
LL128_BUFFSIZE = 120 * 640 * NCCL_STEPS * 8
"""LL128 protocol: ``DEFAULT_LL128_BUFFSIZE`` = ``NCCL_LL128_ELEMS_PER_THREAD`` 120 ×
``NCCL_LL128_MAX_NTHREADS`` 640 × ``NCCL_STEPS`` 8 × sizeof(uint64_t) 8 = 4,915,200 (same files)."""
MEM_ALIGN = 4096
"""``ncclSendMem`` is one page; ``ncclRecvMem``'s header before the buffers too (src/include/comm.h)."""
GRANULARITY = 2 << 20
"""cuMem's allocation granularity, 2 MiB (``CUDA_IPC_MIN`` 2097152, src/include/comm.h): NCCL ≥ 2.19
allocates with cuMem by default (``NCCL_CUMEM_ENABLE``) and rounds every buffer up to it."""


def granular(size: int) -> int:
    """``size`` rounded up to cuMem's 2 MiB granularity."""
    return -(-size // GRANULARITY) * GRANULARITY


RECV_CONNECTION = granular(MEM_ALIGN + LL_BUFFSIZE + LL128_BUFFSIZE + SIMPLE_BUFFSIZE)
"""The receiving side of one connection: header + LL + LL128 + Simple = 9,637,888 → 10 MiB."""
SEND_CONNECTION = granular(MEM_ALIGN)
"""The sending side: ``ncclSendMem``'s page → 2 MiB."""
RING_CHANNEL = RECV_CONNECTION + SEND_CONNECTION
"""One channel of a ring on one rank: receive from the previous rank, send to the next = 12 MiB (also one
peer's send and receive on one point-to-point channel)."""

CHANNELS: dict[str, int] = {
    "ampere": 24,  # HGX A100, 8 GPUs on NVSwitch: "Channel 19/24 : 0 1 2 3 4 5 6 7" (NVIDIA/nccl-tests#100)
    "hopper": 16,  # 8 × H800: "16 coll channels, 0 nvls channels, 16 p2p channels, 16 p2p channels per
    # peer" (NVIDIA/nccl#892); 3 nodes × 8 H100: "Channel 00/16" (NVIDIA/nccl#1453)
    "blackwell": 16,  # NB: no log found; B200 has Hopper's 18 NVLinks per GPU, and "the number of NCCL
    # channels is directly related to that" (NVIDIA/nccl#1429, of Hopper): Hopper's count
}
"""Collective channels NCCL logs per GPU architecture (its search's rings, doubled)."""
PCIE_CHANNELS = 2
"""Any other GPU (PCIe boards, the CDNA3 preset): the search finds one ring over PCIe ("Pattern 4,
crossNic 0, nChannels 1", NVIDIA/nccl#1358's log of two PCIe GPUs), doubled by ``ncclTopoPostset``."""
NET_P2P_CHANNELS_PER_PEER = 2
"""Point-to-point channels to a peer on another node (``NCCL_NCHANNELS_PER_NET_PEER``): "8 p2p channels,
2 p2p channels per peer" in a 2-node log (NVIDIA/nccl#1189)."""


def channels(arch: str | None) -> int:
    """Collective channels of a communicator on ``arch`` (``CHANNELS``, else ``PCIE_CHANNELS``)."""
    return CHANNELS.get(arch or "", PCIE_CHANNELS)


def p2p_channels(arch: str | None, inter_node: bool) -> int:
    """Point-to-point channels to one peer: between nodes ``NET_P2P_CHANNELS_PER_PEER``; inside a node
    the collective channels rounded up to a power of two (module docstring)."""
    if inter_node:
        return NET_P2P_CHANNELS_PER_PEER
    return 1 << (channels(arch) - 1).bit_length()


@dataclass(frozen=True)
class Communicator:
    """One NCCL communicator a rank belongs to and how it uses it."""

    name: str
    """The process group, e.g. ``tp``, ``dp (shard)``."""
    ranks: int
    peers: int
    """Ranks it connects to point-to-point (0: collectives only, on the ring)."""
    inter_node: bool


@dataclass(frozen=True)
class NcclBuffers:
    """NCCL's buffers for one communicator on one rank (bytes)."""

    communicator: Communicator
    channels: int
    """Ring channels connected (0 for a point-to-point-only group)."""
    p2p_channels: int
    """Point-to-point channels per peer (0 without peers)."""
    bytes: int

    def to_json(self) -> dict[str, object]:
        c = self.communicator
        return {
            "group": c.name,
            "ranks": c.ranks,
            "peers": c.peers,
            "inter_node": c.inter_node,
            "channels": self.channels,
            "p2p_channels_per_peer": self.p2p_channels,
            "bytes": self.bytes,
        }


def buffers(c: Communicator, arch: str | None) -> NcclBuffers:
    """NCCL's buffers for ``c``: a ring of ``channels`` when it runs collectives (peers == 0), else
    ``p2p_channels`` per peer, each 12 MiB (``RING_CHANNEL``: a send and a receive connection). A group
    of one rank connects nothing."""
    if c.ranks <= 1:
        return NcclBuffers(c, 0, 0, 0)
    if c.peers == 0:
        ring = channels(arch)
        return NcclBuffers(c, ring, 0, ring * RING_CHANNEL)
    per_peer = p2p_channels(arch, c.inter_node)
    return NcclBuffers(c, 0, per_peer, c.peers * per_peer * RING_CHANNEL)
