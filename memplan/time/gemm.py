"""Wave and tile quantization of the matrix products: the fraction of ``MATMUL`` a GEMM's shape reaches.

A GEMM C[rows, cols] = A[rows, inner]·B[inner, cols] runs as thread blocks, each computing one Tm×Tn tile
of the output C; an SM runs one tile at a time, so the tiles go in waves of (number of SMs) tiles
(NVIDIA, "Matrix Multiplication Background User's Guide", DU-09799-001, §2.1 "GPU Implementation",
§3.1 "Tile Quantization", §3.2 "Wave Quantization"). A partly filled edge tile, and a partly filled last
wave, take as long as full ones:

    tiles      = ⌈rows/Tm⌉ · ⌈cols/Tn⌉                          (× the count of equal GEMMs in one launch)
    efficiency = rows · cols / (⌈tiles/SMs⌉ · SMs · Tm · Tn)    (1 for a shape that fills its waves)

``MATMUL`` is the best shape's fraction of peak, measured on a sweep of large shapes whose quantization
loss is nil; a GEMM of this shape runs at ``MATMUL`` × efficiency, taking FLOPs / (``MATMUL`` · efficiency
· peak) seconds.

The tile (``TILES``): the guide (§2.3 "Typical Tile Dimensions In cuBLAS And Performance") lists the
tiles cuBLAS chooses from, 256×128 and 128×256 the most efficient, then 128×128, then smaller ones, and
says cuBLAS's heuristics pick one per shape, trading a large tile's data reuse against the parallelism
of more, smaller tiles (the list as recalled from the guide: the stored excerpts checked confirm that
larger tiles reuse more data and are more efficient, and the 256×128 tiles on A100's 108 SMs of its
wave example, not the list itself). Rule: the best of 256×128, 128×256 and 128×128 for each shape,
taken as equally efficient per tile. Chosen from the guide with the published runs of
docs/step-time.md in view (their misses motivated the model), before computing them, and not changed
after.

A class of GEMMs (one layer's forward, its backward, the lm head's) takes Σ FLOPs / (``MATMUL`` · peak ·
``efficiency``) with ``efficiency`` = Σ FLOPs / Σ (FLOPs / efficiency of each): a FLOP-weighted
harmonic mean (``class_efficiency``).

Known limitations (NB): 128×128 is taken to run a tile as fast per element as the large tiles (it
reuses less data; the guide ranks it below them), so a shape that fits 128×128 better is credited
slightly too much; the smaller tiles (64×128, 64×64, …) and split-K, stream-K or persistent kernels
(which cuBLAS uses on narrow or long-K shapes, e.g. a weight gradient's) are not modelled; neither is
the reduction dimension's quantization (a partial last step along K costs a fraction of one tile's
work).
A mixture of experts' router [h, E] and shared-expert gate [h, 1] are narrow GEMMs (memory-bound in
truth) charged a whole 128-wide tile, which makes them slow per FLOP; they are few FLOPs. Every
tensor-parallel rank runs them whole, while ``compute.stage_flops`` cuts every FLOP by tp: their shapes
here weigh the efficiency, their FLOPs stay the cut ones. Routing is taken as balanced: every expert
gets S/E slots (under expert parallelism a rank's E/ep experts S·ep/E each, the same FLOPs); Llama 4's
code runs every token through every expert (``MoEConfig.slots``: T rows each). NB a model of two layer
kinds (Llama 4 Maverick's dense layers between MoE ones) weighs its efficiency by the MoE layer's GEMMs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from memplan.blocks import mm
from memplan.blocks.moe import rank_slots
from memplan.blocks.profiles import profile_of
from memplan.config import LossKind, MlpType, Setup
from memplan.config.trainable import adapters, head_trains

TILES: tuple[tuple[int, int], ...] = ((256, 128), (128, 256), (128, 128))
"""Output tiles Tm × Tn (module docstring: the guide's §2.3, the three largest)."""


@dataclass(frozen=True)
class Gemm:
    """``count`` equal products [rows, inner]·[inner, cols] run in one launch (an expert's grouped GEMM)."""

    rows: int
    inner: int
    cols: int
    count: int = 1

    @property
    def flops(self) -> int:
        return self.count * mm(self.rows, self.inner, self.cols)


def tiles(g: Gemm, tile: tuple[int, int]) -> int:
    """Thread blocks of ``tile`` covering the outputs: ⌈rows/Tm⌉ · ⌈cols/Tn⌉ per product."""
    tm, tn = tile
    return g.count * -(-g.rows // tm) * -(-g.cols // tn)


def waves(g: Gemm, tile: tuple[int, int], sms: int) -> int:
    """Waves of ``sms`` concurrent tiles: ⌈tiles/SMs⌉."""
    return -(-tiles(g, tile) // sms)


def tile_efficiency(g: Gemm, tile: tuple[int, int], sms: int) -> float:
    """Useful output elements over what the waves' tiles compute: rows·cols / (waves · SMs · Tm·Tn)."""
    tm, tn = tile
    return g.count * g.rows * g.cols / (waves(g, tile, sms) * sms * tm * tn)


@dataclass(frozen=True)
class Roofline:
    """Where a GEMM turns memory-bound: ``ridge`` FLOPs per byte, (``MATMUL`` · peak) / (``MEMORY`` · HBM
    bandwidth), its operands ``element_bytes`` each."""

    ridge: float
    element_bytes: int


def gemm_bytes(g: Gemm, element_bytes: int) -> int:
    """The least traffic of a GEMM: each operand read once, the output written once,
    (rows·inner + inner·cols + rows·cols) elements per product."""
    return g.count * (g.rows * g.inner + g.inner * g.cols + g.rows * g.cols) * element_bytes


def efficiency(g: Gemm, sms: int | None, roof: Roofline | None = None) -> float:
    """The shape's fraction of the best shape's speed: the best tile's (module docstring; 1 where the
    GPU's SM count is not known), and at most its arithmetic intensity over the ridge (a narrow GEMM is
    memory-bound: its time is max(FLOPs / (MATMUL · wave · peak), bytes / (MEMORY · HBM)))."""
    wave = 1.0 if sms is None else max(tile_efficiency(g, t, sms) for t in TILES)
    if roof is None or g.flops == 0:
        return wave
    intensity = g.flops / gemm_bytes(g, roof.element_bytes)
    return min(wave, intensity / roof.ridge)


def class_efficiency(gemms: list[Gemm], sms: int | None, roof: Roofline | None = None) -> float:
    """Σ FLOPs / Σ (FLOPs / efficiency): the class's time is Σ FLOPs / (MATMUL · this · peak)."""
    return _class_efficiency(tuple(gemms), sms, roof)


@functools.lru_cache(maxsize=1 << 12)
def _class_efficiency(gemms: tuple[Gemm, ...], sms: int | None, roof: Roofline | None) -> float:
    """``class_efficiency``, memoised: ``fit`` asks for the same shapes under many layouts."""
    flops = [g.flops for g in gemms]
    total = sum(flops)
    if total == 0:
        return 1.0
    return total / sum(f / efficiency(g, sms, roof) for f, g in zip(flops, gemms, strict=True))


def backward(g: Gemm) -> list[Gemm]:
    """The gradients of Y[M, N] = X[M, K]·W[K, N]: dX[M, K] = dY[M, N]·Wᵀ and dW[K, N] = Xᵀ·dY[M, N]
    (2× the forward's FLOPs)."""
    return [Gemm(g.rows, g.cols, g.inner, g.count), Gemm(g.inner, g.rows, g.cols, g.count)]


def backward_all(gemms: list[Gemm]) -> list[Gemm]:
    return [b for g in gemms for b in backward(g)]


def attention_gemms(setup: Setup, tokens: int) -> list[Gemm]:
    """W_Q, W_K, W_V (one [h, (a + 2·kv)·d/t] GEMM where the code fuses them) and W_O on one
    tensor-parallel rank: column-parallel ones split their outputs, W_O its inputs."""
    m, t = setup.model, setup.parallel.tp
    if m.mla is not None:
        return mla_gemms(setup, tokens)
    p = profile_of(setup)
    q, kv = m.num_heads * m.dim // t, m.kv_heads * m.dim // t
    qkv = (
        [Gemm(tokens, m.hidden_size, q + 2 * kv)]
        if p.fused_qkv or p.qkv_views
        else [
            Gemm(tokens, m.hidden_size, q),
            Gemm(tokens, m.hidden_size, kv),
            Gemm(tokens, m.hidden_size, kv),
        ]
    )
    return [*qkv, Gemm(tokens, q, m.hidden_size)]


def mla_gemms(setup: Setup, tokens: int) -> list[Gemm]:
    """Multi-head latent attention's projections (``blocks.attention.mla``; one rank: tensor parallelism of
    MLA is refused): q_a [h, r_q] and q_b [r_q, a·d_q] (or q_proj [h, a·d_q]), kv_a [h, r_kv + d_r], kv_b
    [r_kv, a·(d_n + d_v)] and o [a·d_v, h]."""
    m = setup.model
    c, h, a = m.mla, m.hidden_size, m.num_heads
    assert c is not None  # NB: called for MLA models only
    q_out = a * c.qk_head_dim
    rq = c.q_lora_rank
    q = [Gemm(tokens, h, q_out)] if rq is None else [Gemm(tokens, h, rq), Gemm(tokens, rq, q_out)]
    kv = [
        Gemm(tokens, h, c.kv_lora_rank + c.qk_rope_head_dim),
        Gemm(tokens, c.kv_lora_rank, a * (c.qk_nope_head_dim + c.v_head_dim)),
    ]
    return [*q, *kv, Gemm(tokens, a * c.v_head_dim, h)]


def mlp_gemms(setup: Setup, rows: int, width: int, experts: int = 0) -> list[Gemm]:
    """An MLP of ``width`` on ``rows`` tokens (or ``experts`` of them in one launch): gate and up (one
    [h, 2f/t] GEMM where fused; GELU: up alone), then down [f/t, h]; experts split over ``expert_tp``."""
    count = max(experts, 1)
    m, t = setup.model, setup.parallel.expert_tp if experts else setup.parallel.tp
    p = profile_of(setup)
    f, h = width // t, m.hidden_size
    if m.mlp is not MlpType.SWIGLU:
        ins = [Gemm(rows, h, f, count)]
    elif p.fused_gate_up or p.fused_swiglu or (experts and p.experts_gate_up_fused):
        ins = [Gemm(rows, h, 2 * f, count)]
    else:
        ins = [Gemm(rows, h, f, count), Gemm(rows, h, f, count)]
    return [*ins, Gemm(rows, f, h, count)]


def adapter_gemms(setup: Setup, tokens: int) -> list[Gemm]:
    """LoRA's adapters on one layer (peft, rank r): A [in, r] then B [r, out] per adapter
    (``config.trainable.adapters``) — narrow, memory-bound GEMMs (none without LoRA)."""
    ft = setup.finetune
    if not ft.lora:
        return []
    return [
        g
        for a in adapters(setup)
        for g in (Gemm(tokens, a.fan_in, ft.rank), Gemm(tokens, ft.rank, a.fan_out))
    ]


def attention_core_gemms(setup: Setup) -> list[Gemm]:
    """Eager attention's batched products on one rank, b·a/t heads each: QKᵀ [s/cp, d]·[d, s] and
    P·V [s/cp, s]·[s, d]."""
    m, tr, par = setup.model, setup.training, setup.parallel
    heads = tr.micro_batch * m.num_heads // par.tp
    q = tr.seq_len // par.cp
    dq, dv = (m.mla.qk_head_dim, m.mla.v_head_dim) if m.mla else (m.dim, m.dim)  # MLA: d_n + d_r and d_v
    return [Gemm(q, dq, tr.seq_len, heads), Gemm(q, tr.seq_len, dv, heads)]


def layer_gemms(setup: Setup) -> list[Gemm]:
    """One layer's forward GEMMs on one rank, T = b·s/cp tokens (with sequence parallelism the
    column-parallel linears run on the gathered sequence: T rows all the same). A mixture of experts:
    the router [h, E], the rank's E/ep experts on S·ep/E slots each (one grouped launch), the shared
    experts and their gate [h, 1]."""
    tr = setup.training
    tokens = tr.micro_batch * tr.seq_len // setup.parallel.cp
    moe = setup.model.moe
    if moe is None:
        return (
            attention_gemms(setup, tokens)
            + mlp_gemms(setup, tokens, setup.model.ffn)
            + adapter_gemms(setup, tokens)
        )
    h = setup.model.hidden_size
    out = [*attention_gemms(setup, tokens), Gemm(tokens, h, moe.experts)]
    ep = setup.parallel.ep  # a rank's E/ep experts take the slots of ep ranks' tokens: S·ep/E rows each
    rows = -(-rank_slots(setup, moe, tokens) * ep // moe.experts)
    out += mlp_gemms(setup, rows, setup.model.ffn, moe.experts // ep)
    if moe.shared_experts:
        out += mlp_gemms(setup, tokens, moe.shared_width(setup.model))
    return out + ([Gemm(tokens, h, 1)] if moe.shared_gate else [])


def head_gemms(setup: Setup) -> list[Gemm]:
    """The lm head's logits on one rank: [T, h]·[h, ⌈v/t⌉] (vocabulary-parallel; the largest shard)."""
    tr, m = setup.training, setup.model
    tokens = tr.micro_batch * tr.seq_len // setup.parallel.cp
    return [Gemm(tokens, m.hidden_size, -(-m.vocab_size // setup.parallel.tp))]


@dataclass(frozen=True)
class Efficiencies:
    """``class_efficiency`` of one layer's and the lm head's GEMMs, forward and backward (dX and dW)."""

    layer_forward: float
    layer_backward: float
    head_forward: float
    head_backward: float


FULL = Efficiencies(1.0, 1.0, 1.0, 1.0)
"""Every class at full waves (``compute.KernelTime.matmul_full_s``)."""


def efficiencies(setup: Setup, sms: int | None, roof: Roofline | None = None) -> Efficiencies:
    """The four classes' efficiencies on a GPU of ``sms`` SMs (1 each where unknown), memory-bound
    shapes slowed to their intensity where ``roof`` is given."""
    layer, head = layer_gemms(setup), head_gemms(setup)
    # a frozen head (LoRA, --freeze lm_head) runs dX alone (``strategies.lora_flops``)
    grads = backward_all(head) if head_trains(setup) else [backward(g)[0] for g in head]
    # the fused loss runs the head's gradient products in its forward (blocks/head.py::head_flops)
    head_in_forward = head + grads if setup.loss is LossKind.FUSED else head
    return Efficiencies(
        layer_forward=class_efficiency(layer, sms, roof),
        layer_backward=class_efficiency(backward_all(layer), sms, roof),
        head_forward=class_efficiency(head_in_forward, sms, roof),
        head_backward=class_efficiency(grads, sms, roof),
    )
