"""FSDP's room: what FSDP2 (torch's ``fully_shard``, torchtitan's and the reference's wrapping) holds beside
a rank's tensors — ``moments`` (torchtitan's units at the peak's moments), ``root`` (the reference's root
unit), ``buffers`` (the all-gather and reduce-scatter streams' pools, replayed), all on ``reduce`` (the
reduce-scatter's inputs and dtype)."""
