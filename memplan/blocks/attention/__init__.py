"""The attention room: what an attention layer keeps, makes and runs, one job a module.

- ``core``: the layer's saved tensors by attention kind (eager, flash, sliding windows, GQA), its
  parameters and the per-layer rules the inventory reads;
- ``flops``: the core's FLOPs (QKᵀ and P·V, causal and windowed);
- ``eager_locals``: the eager core's locals alive during its forward (the forward's peak);
- ``workspace``: the CUDA kernels' backward transients (softmax backward's scratch, FlashAttention-2's
  workspace);
- ``constants``: what a forward makes once for every layer (rotary tables, masks);
- ``rope``: the rotary tables by implementation;
- ``windows``: sliding-window and chunked-attention spans;
- ``ring_memory``: torch's ring attention backward replayed per context-parallel rank;
- ``mla``: DeepSeek's multi-head latent attention.

Layers inside the room (pyproject.toml's import-linter contract): mla and ring_memory build on the rest;
workspace, constants, eager_locals and flops on core; core on rope and windows.
"""
