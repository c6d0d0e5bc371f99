"""DTensor's choice of a sharding strategy by its own cost model, where the choice decides memory: the
weight gradient of a row-parallel linear whose output gradient is ``Partial`` (torchtitan's TP without
sequence parallelism, ``blocks.torchtitan.partial_grad_elements``).

DTensor picks, among an op's strategies, the one whose input redistributions cost the least
(``_sharding_prop._select_min_cost_strategy``: a strategy needing no redistribution first, else the
lowest sum, the first of equals). The costs are torch 2.13's
``torch/distributed/tensor/_collective_utils.py``: per collective 6.6 µs + hops × the link's latency +
bytes × hops / devices / bandwidth, with GB = 2³⁰ bytes; all-gather and reduce-scatter t − 1 hops,
all-reduce 2(t − 1); a link inside a host 87.7 GB/s and 0.6 µs (``MeshTopoInfo.build_from_mesh``), between
hosts 0.22 × 87.7 GB/s and 2.7 µs; a shard-to-shard move is costed as an all-gather of the shard plus 1.0
(``_compute_placement_transition_cost``).

The op: the weight gradient of ``x [T, in] @ Wᵀ`` is ``mm(xᵀ, g)`` ("mk,kn->mn", m = in, k = T, n = out)
with xᵀ ``Shard(0)`` (x is the column-parallel ``Shard(1)`` activation) and g, the output gradient
[T, out], ``Partial``. Its strategies on the tp mesh dimension (``_matrix_ops``'s einsum strategies with
per-input linearity), [out, xᵀ, g], and what each redistributes:

- [R, R, R]: xᵀ all-gathered (x's bytes), g all-reduced (g's bytes);
- [P, S(1), S(0)] (contracting): xᵀ shard-to-shard (x/t), g reduce-scattered: the gradient ``Partial``;
- [S(0), S(0), R] (m free): g all-reduced: the gradient ``Shard`` as the parameter;
- [S(1), R, S(1)] (n free): xᵀ all-gathered, g reduce-scattered;
- [P, R, P] (linearity): xᵀ all-gathered: the gradient ``Partial``, the whole [out, in] on each rank
  ([P, P, R] needs ``Shard`` → ``Partial``: refused, infinite).

Measured on the fake process group (tests/hf/test_torchtitan_ranks.py): the tiny model's W_O and W2 and
Llama 3 8B's W_O come out ``Partial`` whole. Known limitations: the harness runs on a CPU mesh, whose
``device_count()`` is 1 (every tp group "between hosts"); it is run as a node of ``HOST_DEVICES`` GPUs
(``measure.distributed.titan.fake_world``), the tp group inside it, as torchtitan places TP.
"""

from __future__ import annotations

from memplan.presets.topology import HGX_NODE_GPUS

GIB = 2**30
BASE_LATENCY_US = 6.6
"""Every collective's base latency, µs (``allgather_cost``, ``allreduce_cost``, ``reduce_scatter_cost``)."""
HOST_BW_GBS = 87.7
"""``MeshTopoInfo``'s bandwidth of a mesh dimension inside a host, GB/s."""
HOST_LATENCY_US = 0.6
"""Its latency per hop inside a host (NVLink), µs."""
BETWEEN_HOSTS_BW = 0.22
"""The factor on the bandwidth of a mesh dimension that spans hosts."""
BETWEEN_HOSTS_LATENCY_US = 2.7
"""Its latency per hop between hosts, µs."""
SHARD_TO_SHARD_PENALTY_US = 1.0
"""``_compute_placement_transition_cost``'s penalty on a shard-to-shard move (no all-to-all cost yet)."""
HOST_DEVICES = HGX_NODE_GPUS
"""GPUs a host holds where DTensor asks ``device_count()`` (``MeshTopoInfo``): an HGX / DGX node's."""


def _link(devices: int) -> tuple[float, float]:
    """(bandwidth GB/s, latency µs per hop) of a mesh dimension of ``devices`` ranks."""
    if devices > HOST_DEVICES:
        return HOST_BW_GBS * BETWEEN_HOSTS_BW, BETWEEN_HOSTS_LATENCY_US
    return HOST_BW_GBS, HOST_LATENCY_US


def _cost(nbytes: float, devices: int, hops: int) -> float:
    bw, latency = _link(devices)
    return BASE_LATENCY_US + hops * latency + (nbytes / GIB * hops / devices) / bw * 1e6


def all_gather_us(nbytes: float, devices: int) -> float:
    """DTensor's cost of all-gathering ``nbytes`` (the gathered tensor's) over ``devices`` ranks."""
    return _cost(nbytes, devices, devices - 1)


def reduce_scatter_us(nbytes: float, devices: int) -> float:
    """DTensor's cost of reduce-scattering ``nbytes`` (the whole tensor's)."""
    return _cost(nbytes, devices, devices - 1)


def all_reduce_us(nbytes: float, devices: int) -> float:
    """DTensor's cost of all-reducing ``nbytes``."""
    return _cost(nbytes, devices, 2 * (devices - 1))


def rowwise_weight_grad_whole(tokens: int, out_features: int, in_features: int, tp: int, nbytes: int) -> bool:
    """Whether DTensor leaves the weight gradient of a row-parallel linear (``in_features`` split over
    ``tp``) ``Partial`` — the whole [out, in] on each rank — when its output gradient over ``tokens`` rows
    comes in ``Partial`` (module docstring); elements of ``nbytes`` bytes."""
    x = tokens * in_features * nbytes  # the input's whole bytes
    g = tokens * out_features * nbytes  # the output gradient's
    costs = [  # (whole on each rank, cost) of [out, xᵀ, g] in torch's order; the first of equals wins
        (True, all_gather_us(x, tp) + all_reduce_us(g, tp)),  # [R, R, R]: replicated
        (True, all_gather_us(x / tp, tp) + SHARD_TO_SHARD_PENALTY_US + reduce_scatter_us(g, tp)),
        (False, all_reduce_us(g, tp)),  # [S(0), S(0), R]
        (False, all_gather_us(x, tp) + reduce_scatter_us(g, tp)),  # [S(1), R, S(1)]
        (True, all_gather_us(x, tp)),  # [P, R, P]
    ]
    whole, _ = min(costs, key=lambda c: c[1])
    return whole


def rowwise_input_grad_weight_whole(
    tokens: int, out_features: int, in_features: int, tp: int, nbytes: int
) -> bool:
    """Whether DTensor all-gathers a row-parallel linear's weight (``in_features`` split over ``tp``: the
    ``Shard(1)`` [out, in]) for its input gradient ``mm(g, W)`` ("mk,kn->mn", m = ``tokens``, k = out,
    n = in) when the output gradient g comes in ``Partial`` — the strategies as for the weight gradient
    (``rowwise_weight_grad_whole``), [dX, g, W]:

    - [R, R, R]: g all-reduced, W all-gathered;
    - [P, S(1), S(0)] (contracting): g reduce-scattered, W shard-to-shard;
    - [S(0), S(0), R] (m free): g reduce-scattered, W all-gathered;
    - [S(1), R, S(1)] (n free): g all-reduced, W as it is;
    - [P, P, R] (linearity): W all-gathered, g as it is.

    Measured (the compiled tp rank without SP, tests/hf/test_torchtitan_compile_tp.py): the tiny model's
    W_O gathered, Llama 3 8B's not."""
    w = out_features * in_features * nbytes  # the weight's whole bytes
    g = tokens * out_features * nbytes
    costs = [  # (W gathered whole, cost) in torch's order; the first of equals wins
        (True, all_reduce_us(g, tp) + all_gather_us(w, tp)),
        (False, reduce_scatter_us(g, tp) + all_gather_us(w / tp, tp) + SHARD_TO_SHARD_PENALTY_US),
        (True, reduce_scatter_us(g, tp) + all_gather_us(w, tp)),
        (False, all_reduce_us(g, tp)),
        (True, all_gather_us(w, tp)),
    ]
    whole, _ = min(costs, key=lambda c: c[1])
    return whole
