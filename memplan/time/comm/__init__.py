"""The communication room: every collective a device of the busiest stage runs in one step, and its time.

- ``collectives``: the table of one step (``communication``), the rows of tensor, context, pipeline and
  expert parallelism, and the order the dimensions are placed in;
- ``dp``: data parallelism's rows (ZeRO's stages, torchtitan's FSDP2 by its reshard policy, HSDP);
- ``rows``: a row (one kind of collective, its bytes, count, group, link and overlap) and the busiest
  stage it is for (``Critical``);
- ``fabric``: one call's time on the topology (ring and tree, a group's NICs, latency per step);
- ``buffers``: the memory the communicators hold (NCCL's buffers, FSDP2's streams, DDP's buckets).

Layers inside the room (pyproject.toml's import-linter contract): collectives above buffers, above dp,
above rows, above fabric.
"""
