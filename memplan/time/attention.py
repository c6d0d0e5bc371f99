"""The attention core's time, by implementation and GPU generation (issue #21 item 2).

- eager attention (``--attention eager``: explicit ``bmm``s and a softmax, Megatron's fused softmax too)
  runs QKᵀ and P·V as batched cuBLAS GEMMs: ``MATMUL`` × their wave efficiency, and no faster than their
  bytes at ``MEMORY`` × HBM (``gemm.Roofline``: with a head dimension d ≈ 128 their intensity is ≈ d
  FLOPs per byte, memory-bound on an H100). Its softmax, mask and dropout are element-wise traffic
  (``layer_elementwise.elementwise_bytes``).
- a flash kernel (``--attention flash``) at a fraction of the dense peak that depends on the kernel and
  the GPU's architecture (``arch`` in the GPU preset):

  | kernel | Ampere, Ada, CDNA3, unknown | Hopper, Blackwell: forward, backward |
  |---|---|---|
  | FA2 (``auto``, ``fa2``) | ``ATTENTION`` 0.50 | ``FA2_HOPPER`` 0.35, ``_BACKWARD`` 0.32, × length |
  | FlashAttention-3 (``fa3``) | refused | ``FA3_SPEEDUP`` × those: 0.525, 0.48 × length |
  | FlashAttention-1 (``fa1``: flash-attn 1.x, its Triton version) | ``FA1`` 0.25 | 0.25 × FA2's / 0.50 |
  | cuDNN (``cudnn``: SDPA's ``CUDNN_ATTENTION``) | refused | ``CUDNN_HOPPER``, by length |

  "× length" (``sequence_factor``): on Hopper FA2 reaches the paper's figures only for long rows; its rate
  at the call's sequence length and head dimension was measured alone on an H200
  (``efficiency.FA2_HOPPER_BY_SEQUENCE``: at s 2,048 with heads of 128, 0.80 of it forward, 0.65
  backward), and on the call's grid (``grid_factor``, ``efficiency.FA2_HOPPER_GRID``: fewer than 4,096
  query tiles run slower). FA3 and FA1 on Hopper are scaled from FA2's at the same length and grid.

  ``auto`` is FlashAttention-2: torch's SDPA flash backend and transformers' ``flash_attention_2`` both run
  it (torch vendors FA2), on every GPU. A ``memplan calibrate`` file replaces ``auto``'s figures with what
  the device measured: SDPA's causal pick by length (``attention_curve``, through ``curve_rate``; its
  causal rows stand for the non-causal ones too), or, in older files, one shape's ``attention``.

- the causal mask: a flash kernel skips the tiles above the diagonal, so it runs about half of the s × s
  cells that FlopCounterMode (and memplan's FLOPs) count. FlashAttention's own benchmark counts a causal
  kernel's FLOPs that way, ``4·s²·heads·d // (2 if causal else 1)``
  (Dao-AILab/flash-attention benchmarks/benchmark_flash_attention.py), and the fractions above are TFLOP/s
  of that count: a kernel's seconds are its counted FLOPs × ``causal_work`` at the fraction. Under context
  parallelism (torch's load-balanced ring) a rank's local block is causal ((s/c)²/2 cells run, (s/c)²
  counted) and each of its c − 1 others a full block of (s/c)²/2 cells, so of the (c + 1)/2 · (s/c)²
  counted cells c/2 · (s/c)² run: c/(c + 1), 1/2 without cp. Eager attention's bmms run every cell.

Known limitations (NB): on Ampere and others one fraction for every sequence length (FA2 on Ampere one
fraction for both directions, the paper's low end); on Hopper the length curve was measured at b·s =
16,384 tokens (a smaller grid, b 1 at s 2,048, ran slower: 0.21 and 0.20 in the Llama-2-7B step,
docs/gpu-profile.md) and is held at its ends (1,024 and 65,536); a context-parallel rank's calls are
taken at s/c though half of torch's ring blocks have rows of s/(2c) (measured: they run at the square
non-causal rate at s/c within 3 %, benchmarks/data/h200-ring.jsonl), and ``kv-gather``'s chunk calls
(s/2c queries against up to s keys, causal at the bottom right) as their diagonal at the causal rate and
the rest at the non-causal rate of s-long rows (measured: the model 2–3 % slower); cuDNN is measured on Hopper
only (heads of 128; narrower ones scaled as FA2's) and the memory-efficient SDPA kernel is not offered
(measured on the H200 at 0.13–0.18 of peak, docs/gpu-profile.md); ``auto`` stays FlashAttention-2, what
SDPA picked on H100 up to the end of 2024 (pytorch/pytorch issue #142132, a 2.6 nightly: "SDPA is not
automatically choosing CUDNN impl" on H100, 329 against cuDNN's 631 TFLOP/s) and what the held-out runs
of that time ran, though newer torch picks cuDNN on Hopper (torchtitan pull request #1209, May 2025: the
plan "to make this the default priority list for H100 and B200"; torch 2.11 on the H200 ran SDPA's own
causal pick at cuDNN's rates, ``memplan calibrate``'s ``attention_curve``) and torchtitan 0.3.0 puts cuDNN
first: on those give ``--attention-kernel cudnn``;
CDNA3 (MI300X, Composable Kernel's flash attention) and Blackwell take the figures above without a
measurement of their own; a sliding window's further skipped tiles are not modelled (the window's cells
are counted as causal).
"""

from __future__ import annotations

import functools
import itertools
import math

from memplan.config import Attention, AttentionKernel, CpRotate, Setup
from memplan.presets import GpuPreset
from memplan.time import efficiency

Curve = tuple[tuple[int, float, float], ...]
"""Measured (s, forward, backward) fractions of the dense peak (``efficiency``'s tables)."""

HOPPER_ON = frozenset({"hopper", "blackwell"})
"""Architectures with Hopper's asynchronous tensor cores (wgmma/TMA), where FA2 runs at ``FA2_HOPPER``."""


def kernel(setup: Setup) -> AttentionKernel:
    """The flash kernel that runs: ``auto`` is FlashAttention-2."""
    k = setup.impl.attention_kernel
    return AttentionKernel.FA2 if k is AttentionKernel.AUTO else k


def flash_fraction(setup: Setup, gpu: GpuPreset, backward: bool = False) -> float:
    """The flash kernel's fraction of the dense peak on ``gpu``, forward or ``backward`` (module
    docstring's table); a one-line ``ValueError`` for FlashAttention-3 off Hopper."""
    hopper = gpu.arch in HOPPER_ON
    calibrated = gpu.calibrated if setup.impl.attention_kernel is AttentionKernel.AUTO else None
    if calibrated and calibrated.attention_curve:  # SDPA's own pick by length, measured on the device
        return curve_rate(setup, calibrated.attention_curve, calibrated.attention_curve, backward)
    if calibrated and calibrated.attention:
        return calibrated.attention  # one shape's forward and backward (``memplan calibrate``, older files)
    grids = grid_factor(setup, gpu, backward), noncausal_grid_factor(setup, gpu, backward)
    fa2 = (efficiency.FA2_HOPPER_BACKWARD if backward else efficiency.FA2_HOPPER) * sequence_factor(
        setup, backward, *grids
    )
    if kernel(setup) is AttentionKernel.FA3:
        if not hopper:
            raise ValueError(
                f"attention-kernel: FlashAttention-3 runs on Hopper GPUs only, not {gpu.name} "
                f"({gpu.arch or 'architecture unknown'}); use --attention-kernel fa2"
            )
        return efficiency.FA3_SPEEDUP * fa2
    if kernel(setup) is AttentionKernel.FA1:
        return efficiency.FA1 * fa2 / efficiency.ATTENTION if hopper else efficiency.FA1
    if kernel(setup) is AttentionKernel.CUDNN:
        if not hopper:
            raise ValueError(
                f"attention-kernel: cuDNN attention's rate is measured on Hopper only, not {gpu.name} "
                f"({gpu.arch or 'architecture unknown'}); use --attention-kernel fa2, or auto with a memplan "
                "calibrate file (SDPA's own pick measured on the device)"
            )
        return curve_rate(setup, efficiency.CUDNN_HOPPER, efficiency.CUDNN_HOPPER_NONCAUSAL, backward)
    return fa2 if hopper else efficiency.ATTENTION


def call_sequence(setup: Setup) -> int:
    """The query length of one kernel call: s, or a context-parallel rank's s/c (torch's ring calls the
    kernel on the rank's own shard against each rank's shard in turn), s/2c under ``kv-gather`` (one call
    per local chunk)."""
    return max(1, setup.training.seq_len // (setup.parallel.cp * (2 if _gathered(setup) else 1)))


def key_sequence(setup: Setup) -> int:
    """The key length of a context-parallel rank's non-causal cells: the ring's blocks are s/c long,
    ``kv-gather``'s chunks read the gathered prefix, up to s (rated at s: long rows)."""
    return setup.training.seq_len if _gathered(setup) else call_sequence(setup)


def _gathered(setup: Setup) -> bool:
    return setup.parallel.cp > 1 and setup.parallel.cp_rotate is CpRotate.KV_GATHER


def sequence_factor(
    setup: Setup, backward: bool = False, causal_grid: float = 1.0, other_grid: float = 1.0
) -> float:
    """FlashAttention-2's rate on Hopper at this call's length and head dimension (``curve_rate`` of
    ``efficiency.FA2_HOPPER_BY_SEQUENCE``), over its rate at 64k with heads of 128: 1 at long rows, 0.80
    forward and 0.65 backward at s 2,048 with heads of 128. ``causal_grid`` (``grid_factor``) scales the
    causal cells' rate, ``other_grid`` (``noncausal_grid_factor``) a context-parallel rank's others'."""
    rate = curve_rate(
        setup,
        efficiency.FA2_HOPPER_BY_SEQUENCE[128],
        efficiency.FA2_HOPPER_NONCAUSAL,
        backward,
        causal_grid,
        other_grid,
    )
    return rate / efficiency.FA2_HOPPER_BY_SEQUENCE[128][-1][2 if backward else 1]


H200_SMS = 132
"""The SMs ``efficiency.FA2_HOPPER_GRID``'s tiles ran on."""


def query_tiles(setup: Setup, gpu: GpuPreset) -> float | None:
    """One kernel call's grid as the H200 would hold it: b · (the rank's heads) · ⌈s/128⌉ query tiles,
    × 132 / the GPU's SMs (None without an SM count)."""
    if not gpu.sms:
        return None
    heads = setup.model.num_heads // setup.parallel.tp
    return setup.training.micro_batch * heads * -(-call_sequence(setup) // 128) * H200_SMS / gpu.sms


def grid_factor(setup: Setup, gpu: GpuPreset, backward: bool = False) -> float:
    """FlashAttention-2's rate on this call's grid over its full-grid rate at the same length
    (``efficiency.FA2_HOPPER_GRID``): interpolated in log₂ of the tiles within each measured length and in
    log₂ s between them; held at the ends (1 from 4,096 tiles, 31 a SM; lengths outside 1k–8k take the
    nearest length's ratios)."""
    tiles = query_tiles(setup, gpu)
    if tiles is None:
        return 1.0
    return _grid_ratio(call_sequence(setup), tiles, 2 if backward else 1)


def noncausal_grid_factor(setup: Setup, gpu: GpuPreset, backward: bool = False) -> float:
    """The non-causal kernel's rate on this call's grid over its full-grid rate
    (``efficiency.FA2_HOPPER_NONCAUSAL_GRID``, interpolated in log₂ of the tiles; 1 from 512 tiles, the
    smallest row's below 16); 1 without context parallelism (no non-causal call)."""
    if setup.parallel.cp == 1:
        return 1.0
    tiles = query_tiles(setup, gpu)
    if tiles is None or tiles >= 512:
        return 1.0
    rows = (*efficiency.FA2_HOPPER_NONCAUSAL_GRID, (512, 1.0, 1.0))
    return _log_interpolate(rows, tiles, 2 if backward else 1)


@functools.cache
def _grid_ratio(s: int, tiles: float, col: int) -> float:
    ratios = tuple(
        (float(length), _log_interpolate(rows, tiles, col) / rows[-1][col], 0.0)
        for length, rows in efficiency.FA2_HOPPER_GRID.items()
    )
    return _log_interpolate(ratios, s, 1)


def curve_rate(
    setup: Setup,
    causal_rows: Curve,
    noncausal_rows: Curve,
    backward: bool = False,
    causal_grid: float = 1.0,
    other_grid: float = 1.0,
) -> float:
    """A kernel's fraction of the dense peak at this call's length, from its measured rows (heads of 128):
    interpolated in log₂ s between the measured lengths and held at the ends. A head dimension under 96
    is scaled as FlashAttention-2's causal rows fall from heads of 128 to 64 (``FA2_HOPPER_BY_SEQUENCE``;
    the only narrow head measured). Under context parallelism a rank's local block is causal and its c − 1
    others are not (``causal_work``): 1/c of its cells at the causal rate, the rest at the non-causal one,
    a harmonic mean by cells; under ``kv-gather`` each of the rank's two chunks (s/2c queries) runs its
    diagonal causally, 1/2c of its cells, and the rest against the gathered prefix at the non-causal rate
    of long rows (``key_sequence``: s). ``causal_grid`` (``grid_factor``) scales the causal rate alone: a
    small grid slows the causal kernel (its tail of long query rows leaves SMs idle), while the non-causal
    blocks ran at their full-grid rate on 512 query tiles (0.350 / 0.272 against 0.348 / 0.280 at 4,096
    tokens, benchmarks/data/h200-ring.jsonl's ``longkv`` rows) and below it lose less (``other_grid``:
    ``noncausal_grid_factor``)."""
    narrow = (setup.model.head_dim or 0) < 96
    col = 2 if backward else 1
    cp = setup.parallel.cp
    share = 1 / (2 * cp if _gathered(setup) else cp)  # the causal cells' share of those a rank runs
    lengths = (call_sequence(setup), key_sequence(setup))
    return _curve(causal_rows, noncausal_rows, lengths, share, narrow, col, causal_grid, other_grid)


@functools.cache
def _curve(
    causal_rows: Curve,
    noncausal_rows: Curve,
    lengths: tuple[int, int],
    share: float,
    narrow_head: bool,
    col: int,
    causal_grid: float,
    other_grid: float,
) -> float:
    def rate(rows: Curve, s: int) -> float:
        narrow = 1.0
        if narrow_head:
            fa2 = efficiency.FA2_HOPPER_BY_SEQUENCE
            narrow = _log_interpolate(fa2[64], s, col) / _log_interpolate(fa2[128], s, col)
        return _log_interpolate(rows, s, col) * narrow

    causal = rate(causal_rows, lengths[0]) * causal_grid
    if share == 1:
        return causal
    other = rate(noncausal_rows, lengths[1]) * other_grid
    return 1 / (share / causal + (1 - share) / other)


def _log_interpolate(table: tuple[tuple[float, float, float], ...], s: float, col: int) -> float:
    if s <= table[0][0]:
        return table[0][col]
    for lo, hi in itertools.pairwise(table):
        if s <= hi[0]:
            w = (math.log2(s) - math.log2(lo[0])) / (math.log2(hi[0]) - math.log2(lo[0]))
            return lo[col] + w * (hi[col] - lo[col])
    return table[-1][col]


def causal_work(setup: Setup) -> float:
    """The share of its counted FLOPs a causal flash kernel runs (module docstring): c/(c + 1) of a
    context-parallel rank's, 1/2 without cp."""
    cp = setup.parallel.cp
    return cp / (cp + 1)


def is_eager(setup: Setup) -> bool:
    return setup.strategy.attention is Attention.EAGER
