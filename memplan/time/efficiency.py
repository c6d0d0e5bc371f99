"""The achievable fractions of a GPU's peak the step-time prediction uses: one set, for every GPU and run.

Each is a round figure read off a public benchmark of the kernel class alone, not of a training run. They
were written down with the published runs of docs/step-time.md in view (the runs were known, the
constants were not adjusted to them: each was set once from its source below and left there; the
prediction's errors are reported as they come out).

- ``MATMUL``: dense GEMMs of training shapes (bf16/fp16, fp32 accumulate) reach ≈ 80 % of the datasheet
  peak: A100 cuBLAS ≈ 250 of 312 TFLOP/s on large GEMMs (NVIDIA, "Matrix Multiplication Background User's
  Guide", Deep Learning Performance docs, A100 GEMM figures), H100 SXM ≈ 750–800 of 989 TFLOP/s (cuBLAS 12
  bf16 8192³, as widely reproduced; the clock drops under full tensor load).
- ``ATTENTION``: the attention core (QKᵀ and P·V, forward and backward) reaches ≈ 50 %: FlashAttention-2
  (Dao 2023, arXiv 2307.08691, abstract and §4.1): "50–73 % of the theoretical maximum FLOPs/s on A100",
  the backward (2.5× the forward's FLOPs) at the low end; eager attention's batched matmuls are charged the
  same, its softmax and dropout as memory traffic (``MEMORY``).
- ``MEMORY``: element-wise kernels (norms, residual adds, activation functions, dropout, rotary, an eager
  softmax) are memory-bound and stream at ≈ 80 % of the HBM bandwidth (a device-to-device copy or STREAM
  triad on A100/H100 reaches 80–90 % of the datasheet's TB/s).
- ``NETWORK``: NCCL's ring collectives reach a bus bandwidth of ≈ 80 % of the link's per-direction peak:
  nccl-tests all_reduce_perf busbw ≈ 230 of 300 GB/s on DGX A100's NVSwitch, ≈ 360 of 450 GB/s on DGX
  H100 without NVLS, ≈ 20 of 25 GB/s per HDR NIC (NVIDIA's published nccl-tests results and the NCCL
  performance notes).

NB: one fraction per class for every GPU and every shape: small GEMMs (a narrow tensor-parallel shard, a
short sequence) run below it, FP8 and newer attention kernels (FlashAttention-3) above it.
"""

MATMUL = 0.80
"""Achieved fraction of the dense peak FLOP/s for matrix products."""
ATTENTION = 0.50
"""Achieved fraction of the dense peak FLOP/s for the attention core's products."""
MEMORY = 0.80
"""Achieved fraction of the HBM bandwidth for memory-bound element-wise kernels."""
NETWORK = 0.80
"""Achieved bus bandwidth of a ring collective as a fraction of the link's per-direction peak."""
