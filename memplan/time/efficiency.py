"""The achievable fractions of a GPU's peak the step-time prediction uses: one set, for every GPU and run.

Each is read off a public measurement of the kernel class alone, not of a training run, and was checked
against that source (docs/step-time.md quotes them). ``MATMUL``, ``ATTENTION`` and ``MEMORY`` were written
down with the published runs of docs/step-time.md in view and were not adjusted to them;
``NETWORK_INTRA`` and ``NETWORK_INTER`` replaced a single 0.80 (quoted from memory) when the sources were
checked, also with the runs in view, and are the sources' figures, not fitted ones.

- ``MATMUL`` 0.80: the best bf16 ``matmul`` over a sweep of shapes (the "Maximum Achievable Matmul FLOPS",
  torch 2.6–2.7, CUDA 12.6) reaches 794.5 of 989 TFLOP/s on H100 SXM (80.3 %) and 271.2 of 312 on A100 SXM
  (86.9 %) (S. Bekman, ml-engineering, compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS
  comparison table"); the H100's, the lower, for every GPU: a training step's shapes are not the best one.
  Capped at each GPU's own row of that table where it is lower (``GpuPreset.matmul_best``, ``matmul``): a
  GEMM cannot run above the best shape a sweep found on its GPU. The table's later BF16 rows: B300 78.6 %
  (torch 2.9.1+cu130), B200 77.6 % (2.7.1+cu128), GB200 72.9 % (2.10.0.dev+cu130), MI300X 51.4 % of
  1,300 (2.5.1, ROCm 6.3, TunableOp; 668.4 TFLOP/s, 0.511 of its preset's 1,307.4): each preset holds the
  measured TFLOP/s over its own peak. The cap binds on these four (H100 and H200, "the same", at 80.3 %,
  A100 at 86.9 %, do not). Chosen with the held-out runs in view (docs/step-time.md: the Blackwell rows
  predicted too fast), the source's figures, not adjusted.
- ``MATMUL_FP8`` 0.709: the same table's float8 (``float8_e4m3fn``) sweep: 1402.6 of 1979 TFLOP/s on H100
  SXM (70.9 %, torch 2.7.0+cu126), H200 73.4 %, GH200 77.6 %, B200 76.3 %, B300 74.5 %, GB200 72.3 %; the
  H100's, the lowest of the NVIDIA rows, for every GPU (as ``MATMUL`` takes the H100's) — the layers' GEMMs
  under ``--fp8`` at the FP8 peak (``time.fp8``). Before, ``MATMUL`` carried to the FP8 peak (no float8
  figure was in view); chosen with NeMo's float8 held-out rows in view (docs/step-time.md), the source's
  figure, not adjusted.
- ``ATTENTION`` 0.50: FlashAttention-2 (Dao 2023, arXiv 2307.08691, abstract): "reaching 50-73% of the
  theoretical maximum FLOPs/s on A100", the backward (2.5× the forward's FLOPs) at the low end; eager
  attention's batched matmuls are charged the same, its softmax and dropout as memory traffic (``MEMORY``).
- ``MEMORY`` 0.80: element-wise kernels (norms, residual adds, activation functions, dropout, rotary, an
  eager softmax, the optimizer step) are memory-bound and stream at ≈ 80 % of the HBM bandwidth (a
  device-to-device copy or STREAM triad on A100/H100; not re-checked against a stored measurement).
- ``NETWORK_INTRA`` 0.67: nccl-tests ``all_reduce_perf`` bus bandwidth on 8 A100-SXM4-80GB over NVLink
  plateaus at ≈ 200 GB/s of the 300 GB/s per direction (NVIDIA/nccl-tests issue #149, 2023; issue #178
  reports 208 GB/s on an NVLink pair). Where a preset states NCCL's measured ring bandwidth of its own link
  (``Topology.intra_node_busbw_gbps``: NVLink 4, 370 of 450 GB/s, NVIDIA/nccl-tests issue #212, NCCL's
  maintainer), that replaces it (``calibration.calibrated_topology``); chosen with the Llama 3 runs in view.
- ``NETWORK_INTER`` 0.85: nccl-tests ``all_reduce_perf`` over 3 nodes of 8 A100-SXM4-40GB with 4 × 200 Gb/s
  HDR per node (100 GB/s per node and direction) averages 84.8 GB/s, peaking at 96 (NVIDIA/nccl-tests
  issue #119, 2022).

- ``FA2_HOPPER`` 0.35 forward, ``FA2_HOPPER_BACKWARD`` 0.32 backward: FlashAttention-2 on H100
  (FlashAttention-3, Shah et al. 2024: the abstract's 35 %; the backward figure's 318 of 989 TFLOP/s at
  8k, head dimension 128); ``FA3_SPEEDUP`` 1.5 over both (the abstract's 1.5–2.0×, the low end).
- ``FA2_HOPPER_BY_SEQUENCE``: how FA2's rate on Hopper falls below those figures at shorter sequences and
  narrower heads, measured alone on an H200 (torch 2.11's SDPA flash kernel; docs/gpu-profile.md): 0.80
  forward and 0.65 backward of the long-sequence rate at s 2,048 with heads of 128.
- ``FA1`` 0.25: FlashAttention-1 and flash-attn's Triton version (the FA2 paper's "25-40%" for FA1 on
  A100, the low end; on Hopper scaled as FA2 falls from A100 to H100 at the same length).

- ``HOST_LINK`` 0.80: CUDA's ``bandwidthTest`` on an A100-SXM4-40GB (PCIe Gen4 x16, 32 GB/s per direction),
  pinned 32 MB copies: host to device 26.1 GB/s, device to host 25.6 GB/s (a published run log; the
  lower, 25.6/32 = 0.80). Offload's copies (``time.offload``).
- ``HOST_MEMORY`` 0.78: the CPU optimizer step streams the host's DRAM as STREAM's triad does (read two
  arrays, write one). Texas Instruments' published STREAM run (SPRAD45A, "AM62x Processor Benchmarks",
  Table 3-3: triad 2,493 MB/s on DDR4-1600 ×16, 78 % of the wire rate; copy 77 %, add 78 %). NB: an
  embedded SoC's controller, not a dual-socket server's; no server STREAM figure was at hand, and
  ``memplan calibrate`` does not measure the host. No published offload run was in view when it was
  chosen.

- ``LAUNCH_GAP_S`` 1.1 µs: the GPU's time per kernel of a queue of tiny back-to-back kernels with the
  host's overhead taken out (pytorch/pytorch issue #161104, 2025: 2,000 eager ``x + y`` on 1,024 elements
  captured in one CUDA graph run at 0.0011–0.0013 ms each; the lower). Charged once per kernel of eager,
  unfused element-wise code (``layer_elementwise.elementwise_kernels``) on top of its bytes; ``memplan
  calibrate`` measures it on the user's device (``launch_us``). No published run was in view when it was
  chosen.

``MATMUL`` is the best shape's: a GEMM of another shape (a narrow tensor-parallel shard, a short
sequence) runs at ``MATMUL`` × its wave efficiency, from wave and tile quantization on the GPU's SMs
(``gemm``: NVIDIA's "Matrix Multiplication Background User's Guide" §3; the tile rule, the best of
256×128, 128×256 and 128×128 per shape, was chosen from the guide with the published runs in view, before
computing them, and not changed after).

NB: one fraction per class for every GPU: FP8 and newer attention kernels (FlashAttention-3) run above
``ATTENTION``; H100's NVLink SHARP (NVLS) all-reduce runs above the ring's bus bandwidth. ``MATMUL`` is a
sweep's best, not a sustained rate: one large bf16 GEMM back to back for 4 s on the lent H200 held
673 TFLOP/s (0.68) at the 700 W limit (1,440 MHz; 817 TFLOP/s at 1,740 MHz with zeros, docs/gpu-profile.md).
Not adopted: at 0.68 the Llama 3 H100 runs (docs/step-time.md) would move −4.8 → −6.4, −11.1 → −13.6
and −13.7 → −17.7 %, further below their published figures; the H200's HBM3e takes more of the same
700 W than an H100's HBM3; and which of a step's GEMMs reach the limit depends on its mix. ``memplan
calibrate`` measures the user's own — of 16-bit GEMMs: a calibrated device's float8 GEMMs keep
``MATMUL_FP8``.
"""

from memplan.presets import GpuPreset

MATMUL = 0.80
"""Achieved fraction of the dense peak FLOP/s for matrix products."""
MATMUL_FP8 = 0.709
"""Achieved fraction of the dense FP8 peak FLOP/s for float8 matrix products (``--fp8``'s layers)."""
ATTENTION = 0.50
"""Achieved fraction of the dense peak FLOP/s for the attention core's products."""
MEMORY = 0.80
"""Achieved fraction of the HBM bandwidth for memory-bound element-wise kernels."""
NETWORK_INTRA = 0.67
"""Achieved bus bandwidth of a ring collective inside a node (NVLink/NVSwitch, Infinity Fabric, PCIe), as a
fraction of the link's per-direction peak."""
NETWORK_INTER = 0.85
"""Achieved bus bandwidth of a ring collective between nodes (InfiniBand/RoCE), as a fraction of the GPU's
share of the node's NICs."""
HOST_LINK = 0.80
"""Achieved fraction of the GPU's host link (PCIe) per direction for pinned copies."""
HOST_MEMORY = 0.78
"""Achieved fraction of the host's memory bandwidth for the CPU optimizer step."""
FA2_HOPPER = 0.35
"""FlashAttention-2 on Hopper (and later) GPUs, both directions: "FlashAttention-2 achieving only 35%
utilization on the H100 GPU" (Shah et al. 2024, FlashAttention-3, arXiv 2407.08608, abstract). FA2 is
written for Ampere's mma instructions; Blackwell is taken as Hopper (no published figure)."""
FA2_HOPPER_BACKWARD = 0.32
"""FlashAttention-2's backward on Hopper (and later) GPUs: 318 TFLOP/s of H100 SXM's 989 at sequence
length 8k, head dimension 128 (Shah et al. 2024, FlashAttention-3, the backward-pass speed figure, H100
80GB SXM5: FA2 291, 310, 318, 322 TFLOP/s at 2k, 4k, 8k, 16k) — below its forward (``FA2_HOPPER``; the
same paper's forward figures at 8k: 370 non-causal, 333 causal). The 8k figure: the sequence length of
the published runs that use it (Llama 3), read before computing them."""
FA2_HOPPER_BY_SEQUENCE: dict[int, tuple[tuple[int, float, float], ...]] = {
    128: (
        (1024, 0.268, 0.168),
        (2048, 0.306, 0.212),
        (4096, 0.328, 0.251),
        (8192, 0.339, 0.277),
        (16384, 0.342, 0.306),
        (32768, 0.343, 0.320),
        (65536, 0.351, 0.327),
    ),
    64: (
        (1024, 0.163, 0.103),
        (2048, 0.194, 0.157),
        (4096, 0.232, 0.197),
        (8192, 0.257, 0.225),
        (16384, 0.251, 0.257),
        (32768, 0.290, 0.273),
        (65536, 0.311, 0.283),
    ),
}
"""FlashAttention-2's rate on Hopper by head dimension and sequence length: (s, forward, backward) as
fractions of the dense bf16 peak, measured alone (no training step) on one H200 — GH100, the H100 SXM's
132 SMs and 989.5 TFLOP/s; attention is compute-bound, so HBM3e does not enter — with torch 2.11's SDPA
flash backend (the FlashAttention-2 torch vendors), bf16, causal, b·s = 16,384 tokens (b = 1 from 16k), 32
heads of 128 and 12 of 64, the median of five (two from 16k) after two warm-ups (CUDA events):
benchmarks/hopper_kernels.py, docs/gpu-profile.md "Kernel classes alone". Heads of 128 up to 8k: the later
back-to-back timing (``FA2_HOPPER_GRID``'s full-grid rows, 31 query tiles per SM); from 16k and heads of 64
one call a timing (the host's gap before the first kernel: ≤ 1 % of a 16k kernel, up to ≈ 6 % at 1k).
FLOPs counted as FlashAttention's
benchmark does (causal half, backward 2.5 × forward). Its long-sequence end, 0.351 and 0.327 at 64k, is the
FlashAttention-3 paper's 35 % and 318/989 for FA2 on H100 (``FA2_HOPPER``, ``FA2_HOPPER_BACKWARD``); the
table gives how the rate falls below it for shorter rows, whose every query tile runs fewer key tiles
against the same fixed work (loading Q, the final rescale and write of O; the backward's dQ
accumulation), and for the narrower head, whose tiles do half the FLOPs per byte moved. The model uses
the table's ratio to its 64k head-128 end, times the paper's figures (``time.attention``). No published
run of docs/step-time.md or the held-out set was compared while it was measured; the held-out runs' shapes
chose which lengths were measured, and both tables were computed with it before it was kept (it moved the
held-out median |error| 22.2 → 16.3 % and Llama 3's CP run −6.8 → −10.9 %: docs/step-time.md)."""
FA2_HOPPER_GRID: dict[int, tuple[tuple[int, float, float], ...]] = {
    1024: (
        (64, 0.074, 0.034),
        (128, 0.124, 0.072),
        (256, 0.162, 0.112),
        (512, 0.184, 0.136),
        (1024, 0.222, 0.153),
        (2048, 0.251, 0.164),
        (4096, 0.268, 0.168),
    ),
    2048: (
        (128, 0.138, 0.116),
        (256, 0.168, 0.141),
        (512, 0.208, 0.176),
        (1024, 0.254, 0.197),
        (2048, 0.286, 0.211),
        (4096, 0.306, 0.212),
    ),
    4096: (
        (256, 0.175, 0.165),
        (512, 0.217, 0.206),
        (1024, 0.274, 0.231),
        (2048, 0.307, 0.249),
        (4096, 0.328, 0.251),
    ),
    8192: (
        (512, 0.232, 0.232),
        (1024, 0.285, 0.256),
        (2048, 0.319, 0.268),
        (4096, 0.339, 0.277),
    ),
}
"""FlashAttention-2's causal rate on Hopper (heads of 128) by sequence length and grid: (tiles, forward,
backward), tiles = b · heads · s/128 query tiles on the H200's 132 SMs, measured (back-to-back timing) at
b from 1 to 16,384/s with 32 heads and, for the smallest grids, 8 (a tensor-parallel rank's share; at
equal tiles the two agree within 0.01): benchmarks/hopper_kernels.py ``grid_rows``,
benchmarks/data/h200-kernels.jsonl (``"grid": true``). A grid of a few tiles per SM leaves SMs idle at the
causal tail (a query tile's work grows with its row); the 4,096-tile rows (31 a SM) are
``FA2_HOPPER_BY_SEQUENCE``'s. The model takes each length's ratio to its full-grid rate
(``attention.grid_factor``)."""
FA2_HOPPER_NONCAUSAL: tuple[tuple[int, float, float], ...] = (
    (1024, 0.309, 0.214),
    (2048, 0.333, 0.251),
    (4096, 0.348, 0.280),
    (8192, 0.355, 0.295),
    (16384, 0.357, 0.303),
    (32768, 0.356, 0.317),
    (65536, 0.354, 0.323),
)
"""The same kernel without the causal mask (heads of 128; same run): the blocks a context-parallel rank
runs against other ranks' K/V."""
FA2_HOPPER_NONCAUSAL_GRID: tuple[tuple[int, float, float], ...] = (
    (16, 0.631, 0.511),
    (32, 0.812, 0.758),
    (64, 0.846, 0.829),
    (128, 0.801, 0.868),
    (256, 0.987, 0.899),
)
"""The non-causal kernel on small grids: (query tiles, forward, backward), its rate over
``FA2_HOPPER_NONCAUSAL``'s full-grid rate at the same key length, the median over the measured shapes with
that many tiles (heads 8–64 of 128, 256–2,048 queries, 8,192 and 65,536 keys; b 1), measured alone on the
H200 (benchmarks/ring_kernels.py ``smallgrid``, benchmarks/data/h200-ring.jsonl). From 512 tiles it is
the full grid's (measured 1.004 / 0.979 at 512, 1.005 / 0.985 at 1,024: ``longkv``). Unlike the causal
kernel's (``FA2_HOPPER_GRID``) the forward holds 0.8 of its rate down to 32 tiles — fewer tiles than SMs:
the kernel splits the keys (FlashAttention-2's split-KV heuristic) — and the backward, parallel over key
blocks, 0.76–0.90. No published run was in view; it rates ``kv-gather``'s chunks and the ring's
non-causal blocks on a small grid."""
CUDNN_HOPPER: tuple[tuple[int, float, float], ...] = (
    (1024, 0.432, 0.244),
    (2048, 0.482, 0.368),
    (4096, 0.527, 0.458),
    (8192, 0.611, 0.516),
    (16384, 0.656, 0.569),
    (32768, 0.671, 0.545),
    (65536, 0.615, 0.521),
)
"""cuDNN's fused attention (torch's SDPA ``CUDNN_ATTENTION`` backend, cuDNN 9.19) on Hopper: (s, forward,
backward) fractions of the dense bf16 peak, causal, heads of 128, measured in the same H200 run and the
same way as ``FA2_HOPPER_BY_SEQUENCE`` (benchmarks/data/h200-kernels.jsonl): 1.7–1.9× FlashAttention-2.
torch's default order tries flash first; torchtitan 0.3.0 runs SDPA with cuDNN first
(``--attention-kernel cudnn``). No published figure in view; narrower heads are scaled as FA2's are."""
CUDNN_HOPPER_NONCAUSAL: tuple[tuple[int, float, float], ...] = (
    (1024, 0.494, 0.368),
    (2048, 0.581, 0.480),
    (4096, 0.650, 0.533),
    (8192, 0.656, 0.556),
    (16384, 0.669, 0.571),
    (32768, 0.622, 0.554),
    (65536, 0.628, 0.556),
)
"""The same kernel without the causal mask (a context-parallel rank's blocks against others' K/V)."""
FA3_SPEEDUP = 1.5
"""FlashAttention-3 over FlashAttention-2 on H100: "speedup on H100 GPUs by 1.5-2.0×" (the same
abstract); the low end, as ``ATTENTION`` takes FlashAttention-2's low end on A100. FA3 at
1.5 × ``FA2_HOPPER`` = 0.525 of peak (its best case is 740 TFLOP/s, 75 %, forward, long sequences)."""
FA1 = 0.25
"""FlashAttention-1 (flash-attn 1.x's CUDA kernels) on A100, both directions: "FlashAttention ... reaching
only 25-40% of the theoretical maximum FLOPs/s" (Dao 2023, FlashAttention-2, arXiv 2307.08691, abstract);
the low end, as ``ATTENTION`` takes FlashAttention-2's. Its Triton version (flash-attn's
``flash_attn_triton.py``, "tested on A100"; llm-foundry's ``attn_impl: triton``) is taken as the same
kernel: its docstring says "Triton forward + backward is slightly slower than CUDA forward + backward".
No published run of docs/step-time.md uses it; the held-out MPT runs (llm-foundry, Triton) were in view
when it was added, and the figure is the paper's, not adjusted."""
ELEMENTWISE_STREAM: dict[str, tuple[float, float]] = {
    "rmsnorm": (0.584, 0.664),
    "layernorm": (0.526, 0.463),
    "rotary": (0.295, 0.348),
    "swiglu": (0.872, 0.877),
    "gelu": (0.759, 1.112),
    "eager_core": (0.34, 0.388),
    "rmsnorm_compiled": (0.705, 0.703),
    "layernorm_compiled": (0.516, 0.459),
    "rotary_compiled": (0.755, 0.402),
    "swiglu_compiled": (0.851, 0.988),
    "gelu_compiled": (0.702, 0.955),
}
"""The element-wise chains of a layer, (forward, backward): the fraction of the HBM bandwidth at which each
moves the bytes ``time.elementwise`` counts for it, measured alone on one H200 (torch 2.11, bf16;
benchmarks/hopper_kernels.py ``chain_rows`` and ``core_rows``, benchmarks/data/h200-chains.jsonl;
docs/gpu-profile.md "Kernel classes alone"; each timing calls the chain back to back for ≥ 5 ms between
two CUDA events). Eager, the median of Llama 3.1 8B's and MPT-7B's shapes (16,384 and 12,288 tokens of
4,096): Llama's RMSNorm as its code writes it (eight kernels, the broadcast ``x · rsqrt`` and weight
products among them), ``native_layer_norm`` (a row reduction; its backward also reduces the weight's and
bias's gradients over the tokens), the ``rotate_half`` rotary embedding on the transposed q and k
(broadcast [s, d] tables, a ``cat``, strided reads), ``silu(gate)·up``, the tanh GELU, and the reference's
eager attention core between its two products (the scale, the causal ``masked_fill``, the softmax, on
Llama-2-7B's [1, 32, s, s] scores at s 1,024, 2,048 and 3,072). ``*_compiled``: the same chains through
``torch.compile`` (Inductor's fused kernels, ``--compile``), at Llama 3.1 8B's shape, the process's first
compile (the second shape's recompile ran up to 2× slower and is not used). Each is charged its bytes at
``MEMORY`` × (fraction / ``MEMORY``) of the device's bandwidth (``memory(gpu)`` scales them when
calibrated); a plain add ran at 0.87–0.89 of HBM and a copy at 0.83–0.85 in the same session (``MEMORY``
0.80). No published figure of PyTorch's kernels' bandwidth was found; the held-out runs' shapes chose which
shapes were measured, and no training run was compared while measuring. NB: the rotary backward measured
lacks the copy of the gradient back to the projection's layout (2e of its 17e); the GELU's backward is
counted at twice its forward's bytes (4e, where it reads two tensors and writes one), so its fraction of
that count exceeds 1; one GPU's figures for every GPU."""


OVERLAP_SLOWDOWN = 0.189
"""How much longer compute runs while a collective runs beside it on the same GPU: "overlapping
computation and communication can result in an average computational slowdown of 18.9%, with a maximum
of 40.0%" (Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning,
arXiv 2507.03114, 2025, abstract: GPT and LLaMA layers beside NCCL/RCCL collectives on 4 A100, H100,
MI250 and MI210 of one node). The collective's kernels hold SMs and HBM bandwidth the compute would use
(NVIDIA's developer forum, "Compute-communication overlap causes severe GEMM performance degradation
because of tail effect": an all-gather's 24 blocks on H100's 132 SMs push a one-wave GEMM into two).
Charged on the compute a collective whose ring runs over NVLink overlaps (``predict.exposed``,
``predict.slows_compute``): inside the node, or across nodes with several of the group's ranks on each
(their ring crosses each node over NVLink, at NVLink's rate); the average, as measured there. NB: not
charged for groups with one rank per node (their kernels feed one NIC, a seventh of the traffic; no
measurement in view); the Llama 3 runs of docs/step-time.md were in view when it was first scoped to
single-node groups, the held-out set when it was widened to multi-node groups with several ranks per node
(held-out median |error| 14.2 → 13.1 %; the published runs, whose groups that leave the node have one rank
per node, unchanged)."""


LAUNCH_GAP_S = 1.1e-6
"""Seconds per kernel launch of eager element-wise code beyond its bytes (module docstring: a CUDA-graph
queue of tiny ``x + y`` kernels, pytorch/pytorch #161104)."""


def launch_gap(gpu: GpuPreset) -> float:
    """``LAUNCH_GAP_S``, or the seconds per kernel ``memplan calibrate`` measured on the device."""
    measured = gpu.calibrated.launch_us if gpu.calibrated else None
    return measured * 1e-6 if measured is not None else LAUNCH_GAP_S


def matmul(gpu: GpuPreset) -> float:
    """What ``memplan calibrate`` measured on the device, else ``MATMUL`` capped at the GPU's own best
    measured matmul (``GpuPreset.matmul_best``: no GEMM runs faster than the best shape of a sweep on that
    GPU; module docstring)."""
    if gpu.calibrated:
        return gpu.calibrated.matmul
    return MATMUL if gpu.matmul_best is None else min(MATMUL, gpu.matmul_best)


def memory(gpu: GpuPreset) -> float:
    """``MEMORY``, or what ``memplan calibrate`` measured on the device."""
    return gpu.calibrated.memory if gpu.calibrated else MEMORY
