"""Collectives on the fabric: the time of one call of a collective on n ranks, and the link a group of
ranks runs on given where they sit (``comm`` lists a step's calls; this module times one).

Time of one call on n ranks (Patarasuk & Yuan 2009; NCCL's bus bandwidth, nccl-tests PERFORMANCE.md), B
bytes, β the achieved bandwidth per rank and direction (``ring_bandwidth``), α the latency per step:
ring all-reduce 2(n−1)/n·B/β + latency of 2(n−1) steps; all-gather, reduce-scatter (n−1)/n·B/β +
latency of n−1 steps; point-to-point B/β_own + α. An all-reduce takes the faster of the ring and NCCL's
tree, 2B/β + 2·((k−1)·α_intra + ⌊log₂ N⌋·α_inter) (``tree_seconds``): NCCL models every algorithm per size
and picks the fastest (NVIDIA/nccl issue #457), the tree winning at thousands of ranks and small buffers.

Fabric (``placed``): a group of n ranks with k of them on each of N nodes
- inside one node (k = n): β = NVLink × ``NETWORK_INTRA``, every step α_intra;
- across nodes: NCCL runs one channel per NIC and each ring crosses the node on its own rail, so the ring
  gets the k ranks' NICs together, β = min(k × the GPU's NIC share × ``NETWORK_INTER``, NVLink ×
  ``NETWORK_INTRA``) (the NVLink hops of the same ring bound it); "Ring and Tree both use all NICs in
  parallel" (NVIDIA/nccl issue #530); nccl-tests issue #119 measures 84.8 GB/s of bus bandwidth across
  nodes whose 4 HDR NICs give 100 GB/s together. Of a ring's steps, 2(N−1) (all-reduce) or N−1 (the
  others) cross the network at α_inter and the rest NVLink at α_intra (NCCL ``src/graph/tuning.cc``,
  ``ncclTopoTuneModel``, ``nInterSteps``). A point-to-point send leaves through the sender's own NIC; an
  all-to-all sends each rank's (n−k)/n through its own NIC (NCCL's PXN routes a rail's traffic over
  NVLink first) while (k−1)/n stays on NVLink.

Known limitations (NB): NCCL's protocols (LL, LL128, Simple) share one α per level; NVLS / NVLSTree
(NVSwitch SHARP), CollNet, PAT and compression are not modelled; the fabric is taken as non-blocking
(rail-optimised, no oversubscribed spine).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from enum import StrEnum

from memplan.presets import Topology
from memplan.time import efficiency


class Collective(StrEnum):
    ALL_REDUCE = "all-reduce"
    ALL_GATHER = "all-gather"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_TO_ALL = "all-to-all"
    SEND_RECV = "send/recv"


@dataclass(frozen=True)
class Link:
    """Where a group's ring runs: inside one node, or over ``nodes`` nodes with ``per_node`` of its ranks on
    each (module docstring, "Fabric")."""

    level: str
    """``intra-node`` or ``inter-node``."""
    gbps: float
    """Per direction, GB/s (before ``network_fraction``): inside a node the GPU's NVLink; between nodes the
    ``per_node`` GPUs' NICs together (k × the GPU's share of the node's NICs)."""
    latency_us: float
    """Per ring step over this level (between nodes: the network's)."""
    nodes: int = 1
    per_node: int = 0
    """Ranks of the group on one node (0: inside one node, all of them)."""
    intra_gbps: float = 0.0
    """The NVLink hops' bandwidth of a group that leaves the node (0 inside a node)."""
    intra_latency_us: float = 0.0
    """Per intra-node ring step of a group that leaves the node."""


def network_fraction(link: Link) -> float:
    """The achieved fraction of the link's bandwidth: ``efficiency.NETWORK_INTRA`` or ``NETWORK_INTER``."""
    return efficiency.NETWORK_INTRA if link.level == "intra-node" else efficiency.NETWORK_INTER


def send_rate(link: Link) -> float:
    """Achieved bytes/s of one rank's send to one rank over ``link``: its own NIC (the node's NICs shared by
    its ranks on the group) or NVLink, at ``network_fraction``."""
    return link.gbps / max(1, link.per_node) * 1e9 * network_fraction(link)


def ring_bandwidth(link: Link) -> float:
    """Achieved bytes/s per rank and direction of a ring (or tree) over ``link``: inside a node the GPU's
    NVLink; between nodes the group's NICs on one node together (NCCL runs one channel per NIC, every
    ring crossing the node on its own rail), no faster than the NVLink hops the ring also takes."""
    beta = link.gbps * 1e9 * network_fraction(link)
    if link.per_node > 1:
        beta = min(beta, link.intra_gbps * 1e9 * efficiency.NETWORK_INTRA)
    return beta


def ring_latency(kind: Collective, n: int, link: Link) -> float:
    """Seconds of latency of a ring over ``n`` ranks: 2(n−1) steps for an all-reduce, n−1 otherwise; over
    N nodes 2(N−1) (all-reduce) or N−1 of them cross the network, the rest NVLink (NCCL
    ``src/graph/tuning.cc``, ``ncclTopoTuneModel``: ``nInterSteps``)."""
    reduce = kind is Collective.ALL_REDUCE
    steps = 2 * (n - 1) if reduce else n - 1
    if link.level == "intra-node":
        return steps * link.latency_us * 1e-6
    inter = 2 * (link.nodes - 1) if reduce else link.nodes - 1
    return ((steps - inter) * link.intra_latency_us + inter * link.latency_us) * 1e-6


def tree_seconds(nbytes: int, n: int, link: Link) -> float:
    """NCCL's tree all-reduce: a chain inside each node and a double binary tree between nodes (reduce up,
    broadcast down), every rank moving ≈ 2B (NVIDIA/nccl issue #457) at the ring's bandwidth ("Ring and
    Tree both use all NICs in parallel", #530); latency 2·((k−1)·α_intra + ⌊log₂ N⌋·α_inter) for k ranks
    on each of N nodes (``tuning.cc``, ``NCCL_ALGO_TREE``)."""
    if link.level == "intra-node":
        k, nodes, intra, inter = n, 1, link.latency_us, link.latency_us
    else:
        k, nodes, intra, inter = link.per_node, link.nodes, link.intra_latency_us, link.latency_us
    latency = 2 * ((k - 1) * intra + (nodes.bit_length() - 1) * inter) * 1e-6
    return 2 * nbytes / ring_bandwidth(link) + latency


def collective_seconds(kind: Collective, nbytes: int, n: int, link: Link) -> float:
    """Time of one call of ``nbytes`` over ``n`` ranks on ``link`` (module docstring): a ring, or for an
    all-reduce the faster of ring and tree (NCCL picks per size from the same models, #457)."""
    alpha = link.latency_us * 1e-6
    if kind is Collective.SEND_RECV:
        return nbytes / send_rate(link) + alpha
    if kind is Collective.ALL_TO_ALL and link.level == "inter-node":
        # each rank's (n − k)/n of the buffer leaves the node through its own NIC (NCCL's PXN gathers a
        # rail's traffic over NVLink first), its (k − 1)/n stays on NVLink, both at once
        k = link.per_node
        out = (n - k) / n * nbytes / (link.gbps / k * 1e9 * efficiency.NETWORK_INTER)
        inside = (k - 1) / n * nbytes / (link.intra_gbps * 1e9 * efficiency.NETWORK_INTRA) if k > 1 else 0.0
        return max(out, inside) + ring_latency(kind, n, link)
    steps = 2 * (n - 1) if kind is Collective.ALL_REDUCE else n - 1
    ring = steps / n * nbytes / ring_bandwidth(link) + ring_latency(kind, n, link)
    if kind is Collective.ALL_REDUCE:
        return min(ring, tree_seconds(nbytes, n, link))
    return ring


def per_node(room: int, dims: tuple[tuple[int, int], ...]) -> int:
    """Ranks of a group on the first node: the index tuples with Σ iⱼ·strideⱼ < ``room`` (GPUs per node);
    ``dims`` are the group's (stride, degree) pairs, innermost first."""
    if not dims:
        return 1
    stride_, degree = dims[-1]
    total = 0
    for i in range(degree):
        left = room - i * stride_
        if left <= 0:
            break
        total += per_node(left, dims[:-1])
    return total


def placed(topo: Topology, dims: tuple[tuple[int, int], ...]) -> Link:
    """The link a group spanning ``dims`` ((stride, degree) pairs, innermost first) runs on: inside one node
    when all its ranks are on one, otherwise over ⌈n/k⌉ nodes with k of its ranks on each (module
    docstring). Memoised on the five numbers of ``topo`` it reads and ``dims`` (``_placed``)."""
    intra = (topo.intra_node_gbps, topo.intra_node_latency_us)
    return _placed(topo.gpus_per_node, intra, (topo.inter_node_gbps, topo.inter_node_latency_us), dims)


@functools.lru_cache(maxsize=4096)
def _placed(
    gpus_per_node: int,
    intra: tuple[float, float],
    inter: tuple[float, float],
    dims: tuple[tuple[int, int], ...],
) -> Link:
    """``placed`` on a topology of ``gpus_per_node`` GPUs a node, NVLink's (GB/s, µs) ``intra`` and the
    network's ``inter``: a pure function of them (a ``Link`` is frozen), which the search asks thousands of
    times with a few dozen distinct groups (``clear_placed``)."""
    n = math.prod(d for _, d in dims)
    k = per_node(gpus_per_node, dims)
    if k >= n:
        return Link("intra-node", *intra)
    return Link(
        "inter-node",
        k * inter[0],
        inter[1],
        nodes=-(-n // k),
        per_node=k,
        intra_gbps=intra[0],
        intra_latency_us=intra[1],
    )


def clear_placed() -> None:
    """Forget ``placed``'s memo (``search.fit`` starts each search without it: cold benchmarks)."""
    _placed.cache_clear()


def link(topo: Topology, group_stride: int, n: int) -> Link:
    """The link a group of ``n`` ranks ``group_stride`` apart runs on (``placed``)."""
    return placed(topo, ((group_stride, n),))
