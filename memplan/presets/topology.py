"""Where a GPU sits: its node and the links between GPUs (``[topology]`` in a GPU preset).

Bandwidths are per GPU and per direction, in GB/s (10⁹ bytes/s): what one GPU can send while it receives
as much, the figure NCCL's bus bandwidth (``busbw`` in nccl-tests) is compared with. A datasheet's
"900 GB/s NVLink" counts both directions: 450 per direction. Inter-node bandwidth is the GPU's share of
the node's network cards (DGX H100: eight 400 Gb/s ConnectX-7, one per GPU: 50 GB/s each); a group with
k ranks on a node gets k shares (``time.comm.fabric.placed``: NCCL spreads its channels over the NICs).

Latencies are per ring step (one send to the neighbour), in µs: what a ring collective pays
``steps × latency`` of, on top of its bytes.

Known limitations (NB): one bandwidth per level (inside a node, between nodes); the fabric is taken as
rail-optimised and non-blocking (oversubscribed spines are not modelled); NVLink domains larger than a
node (GB200 NVL72) and NVSwitch's in-network reduction (NVLS/SHARP) are not modelled.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

HGX_NODE_GPUS = 8
"""GPUs in one node where no GPU preset says: the 8 of an HGX / DGX board (DGX A100, H100, H200, B200).
Host memory shared by a node's devices (``search.budget``) and the device count DTensor prices a
tensor-parallel group by (``blocks.dtensor_cost``)."""


class Topology(BaseModel):
    """GPUs per node, and the bandwidth and latency inside a node and between nodes, per GPU."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)  # finite figures only

    gpus_per_node: int = Field(gt=0, le=1 << 12, description="GPUs in one node (one NVLink/xGMI domain)")
    intra_node: str = Field(min_length=1, description="the link inside a node, e.g. 'NVSwitch, NVLink 4'")
    intra_node_gbps: float = Field(gt=0, description="per GPU, per direction, GB/s, inside a node")
    intra_node_latency_us: float = Field(ge=0, description="per ring step inside a node, µs")
    inter_node: str = Field(min_length=1, description="the network between nodes, e.g. '8 × 400 Gb/s NDR'")
    inter_node_gbps: float = Field(gt=0, description="per GPU, per direction, GB/s, between nodes")
    inter_node_latency_us: float = Field(ge=0, description="per ring step between nodes, µs")
    source: str = Field(min_length=1, description="where the figures come from")
    intra_node_busbw_gbps: float | None = Field(
        default=None,
        gt=0,
        description="NCCL's achieved bus bandwidth of a ring inside the node (what nccl-tests reports as "
        "busbw for the non-all-reduce collectives, or with NCCL_ALGO=RING), GB/s per GPU and direction, "
        "sourced in the file; the collectives inside a node run at it (time.calibration."
        "calibrated_topology); absent: intra_node_gbps × NETWORK_INTRA",
    )

    def with_overrides(
        self, gpus_per_node: int | None, intra_node_gbps: float | None, inter_node_gbps: float | None
    ) -> Topology:
        """This topology with the ``--gpus-per-node``, ``--intra-node-bw`` and ``--inter-node-bw`` given
        (None keeps the preset's); a one-line ``ValueError`` for a value out of range."""
        for name, value in (("intra-node-bw", intra_node_gbps), ("inter-node-bw", inter_node_gbps)):
            if value is not None and not (value > 0 and value < float("inf")):
                raise ValueError(
                    f"{name}: must be positive finite GB/s per GPU, got {value}; e.g. --{name} 50"
                )
        if gpus_per_node is not None and gpus_per_node < 1:
            raise ValueError(
                f"gpus-per-node: must be at least 1, got {gpus_per_node}; e.g. --gpus-per-node 8"
            )
        update: dict[str, object] = {
            k: v
            for k, v in (
                ("gpus_per_node", gpus_per_node),
                ("intra_node_gbps", intra_node_gbps),
                ("inter_node_gbps", inter_node_gbps),
            )
            if v is not None
        }
        if intra_node_gbps is not None:  # the preset's measured bus bandwidth was of its own link
            update["intra_node_busbw_gbps"] = None
        return self.model_copy(update=update)
