"""Context parallelism: ring attention over ``cp`` ranks, as torch's
``torch.distributed.tensor.experimental.context_parallel`` runs it (the implementation torchtitan uses;
read in torch 2.13, ``torch/distributed/tensor/experimental/_context_parallel/_attention.py``).

What one rank does (``_templated_ring_attention`` and its backward, default options):

- The sequence is cut into 2c chunks and rank r holds chunks r and 2c−1−r (``_HeadTailLoadBalancer``:
  the head-tail / round-robin split that balances the causal mask), so every [b, s, …] activation of a
  layer — norms, projections, q, k, v, the attention output, the MLP, the head and the loss, the
  reference model's RoPE tables (made for the rank's positions) — holds s/c tokens. torchtitan 0.3.0
  shards the positions instead (``prepare_context_parallel_input``): every layer keeps its whole RoPE
  cache and gathers the rank's rows (``blocks.attention.rope.titan_cp_rules``). memplan gets
  this by speaking in one rank's sizes: ``Dims.of`` gives s = seq_len / c (as ``tp_model`` gives a/t
  heads), so the blocks' inventory, FLOPs and peak are the rank's without another rule.
- Attention: the ring runs *inside* the dispatch of one SDPA op (the DTensor handler of
  ``aten._scaled_dot_product_flash_attention`` / ``_efficient_attention``), below autograd. Autograd
  therefore saves exactly what the one kernel saves: the rank's local q, k, v, the *merged* output
  (cast back to the activation dtype) and the *merged* fp32 logsumexp, [b, a, s/c] — not each step's
  out/lse and not the received K/V chunks, which are transients of the forward. The backward re-gathers
  K/V and runs the kernel's backward per step again.
- FLOPs: step 0 runs the causal kernel on the local q, k, v; each of the c−1 later steps a non-causal
  kernel on half of q or half of the received K/V (``blocks.attention.flops.score_cells``). Linear layers run
  on s/c tokens. The whole model's FLOPs are c × one rank's (``whole_model``).
- ``--cp-rotate kv-gather`` is not torch's ring but Llama 3's context parallelism (Transformer Engine's
  ``AttnFuncWithCPAndKVAllGather``): the same split, cells, FLOPs and saved tensors; its communication
  (``gather_exchanges``) and its own copies (``gather_bytes``) differ. The ring's own element-wise work
  (merges, fp32 accumulators, the K/V ``cat`` calls) is ``ring_bytes``; the time model charges either
  (``elementwise_bytes``).
- Communication, per layer and micro-batch (``kv_exchanges``; ``_RotateMethod.ALL_GATHER`` is torch's
  and torchtitan's default): forward, one all-gather of the rank's K/V (``torch.cat([k.flatten(),
  v.flatten()])``, activation dtype); backward, the same all-gather again plus c point-to-point rotations
  (``permute_tensor`` to rank r+1, the all-to-all rotater) of the fp32 dK/dV accumulators
  (``convert_to_f32``); a layer whose attention re-runs in backward (checkpointing) gathers K/V once more.
  With ``--cp-rotate alltoall`` (``set_rotate_method("alltoall")``) the K/V travel as c − 1 rotations to
  the next rank instead of the all-gather. Which block each exchange runs under: ``kv_exchanges``.
- Model states: weights are replicated over the cp ranks; gradients are reduced and ZeRO/FSDP shards
  over dp × cp (torchtitan's ``dp_shard_cp`` mesh: FSDP shards over data and context parallel ranks
  together), ``Setup.state_shards``.

Memory beyond the saves: the ring's backward (its fp32 accumulators, the K/V and dK/dV in flight, each
block's gradients and, on CUDA, its kernel's workspace) is a part of the layer-backward moment on the most
loaded rank, replayed from torch's code (``blocks.attention.ring_memory``, exact on CPU and on an H200).

Known limitations (NB): the ring's forward transients (the gathered K/V, the fp32 merge) are not in the
peak (the forward is not a moment of ``analytic.peak``); torch's ring runs only the SDPA flash /
efficient / cuDNN kernels, so eager attention is refused; K/V are exchanged with the kernel's kv heads,
as the reference model and torchtitan 0.3.0 pass them (``GQAttention``: ``enable_gqa``, no repeat;
measured in tests/measure/test_titan_context.py); FlopCounterMode
counts the causal step-0 kernel whole (hardware FLOPs), as everywhere in memplan.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from memplan.analytic.flops import Flops
from memplan.blocks.inventory import Dims
from memplan.config import Attention, Checkpointing, CpRotate, DType, Setup


def check_context(setup: Setup) -> None:
    """One-line ``ValueError`` when context parallelism does not fit the setup."""
    cp, s = setup.parallel.cp, setup.training.seq_len
    if cp == 1:
        return
    if setup.strategy.attention is not Attention.FLASH:
        raise ValueError(
            "cp: torch's ring attention runs the SDPA flash / efficient kernels only; "
            "use --attention flash or drop --cp"
        )
    chunks = 2 * cp
    if s % chunks:
        lower = s - s % chunks
        fix = f"--seq {lower} or {lower + chunks}" if lower else f"--seq {chunks}"
        raise ValueError(
            f"seq: {s} does not split into 2 × cp = {chunks} equal chunks (the load-balanced causal split "
            f"of torch's context_parallel); use {fix}"
        )
    tp = setup.parallel.tp
    if setup.parallel.sp and (s // cp) % tp:
        step = cp * math.lcm(2, tp)
        lower = s - s % step
        raise ValueError(
            f"seq: the {s // cp} tokens of each context-parallel rank do not split over --tp {tp} for "
            f"sequence parallelism; use --seq {lower or step} (a multiple of {step})"
        )


def whole_model(rank: Flops, cp: int, unsplit: Flops | None = None) -> Flops:
    """The whole model's FLOPs from one context-parallel rank's (every rank runs the same work);
    ``unsplit``: the same model's at cp 1 (one device, the whole sequence), whose model FLOPs the cp ranks'
    fall short of by the masked blocks they skip (``Flops.cp_skipped``; every other term is cp × the
    rank's: s/cp tokens on each)."""
    if cp == 1:
        return rank
    whole = Flops(**{name: value * cp for name, value in rank.model_dump().items()})
    if unsplit is None:
        return whole
    return whole.model_copy(update={"cp_skipped": unsplit.model - whole.model})


class Exchange(NamedTuple):
    """One kind of K/V communication of one attention layer, one micro-batch, on one rank."""

    phase: str
    """forward, backward or recompute."""
    collective: str
    """all-gather (every rank's shard to every rank) or send-recv (to rank r+1, from rank r−1)."""
    bytes: int
    """Bytes this rank contributes per call: its K/V shard (all-gather) or the buffer it sends."""
    calls: int
    """Calls per layer per micro-batch."""
    under: str = "none"
    """The ring's compute it runs under (``block_shares``): ``first`` (the first block, the local causal
    one), ``blocks`` (each of the blocks before the last: it is waited for at the next), ``none``."""


def block_shares(cp: int) -> tuple[float, float]:
    """The shares of a rank's attention work (forward or backward) in its first block and in all its
    blocks but the last: the local causal block counts (s/c)² cells (FlopCounterMode does not halve causal),
    each of the c − 1 later ones (s/c)²/2 (half of q or of k/v), so 2/(c+1) and (c+1−1)/(c+1) = c/(c+1)."""
    return 2 / (cp + 1), cp / (cp + 1)


def kv_bytes(dims: Dims, dtype: DType) -> int:
    """One rank's k and v as the kernel reads them, [b, kv, s/c, d] each, in ``dtype``."""
    return 2 * dims.b * dims.kv * dims.s * dims.d * dtype.bytes


def kv_bytes_of(setup: Setup) -> int:
    """One rank's K/V in the activation dtype: ``kv_bytes`` of the rank's dims (``Dims.of``), the same
    product read from the setup without building them (the cp ring's rows ask it of every layout)."""
    m, t = setup.model, setup.training
    s = t.seq_len // setup.parallel.cp
    return 2 * t.micro_batch * m.kv_heads * s * m.dim * t.precision.activation_dtype.bytes


def attention_reruns(setup: Setup) -> bool:
    """Whether backward re-runs the attention's forward (checkpointing, reversible layers)."""
    s = setup.strategy
    return s.checkpointing is not Checkpointing.NONE or s.reversible


def kv_exchanges(setup: Setup, rotate: CpRotate | None = None) -> list[Exchange]:
    """K/V traffic of one attention layer per micro-batch on one rank (module docstring); empty at cp 1.

    ``setup``: the rank's (``tp_model``: kv/t heads). An all-gather's output is c × ``bytes``, of which
    (c−1) × ``bytes`` arrive over the network. torch 2.13 ``_templated_ring_attention`` and its backward:
    with ``allgather`` one all-gather is issued before the first block and waited for after it; with
    ``alltoall`` a rotation is issued at every block but the last and waited for at the next. The backward's
    c fp32 dK/dV rotations (always point-to-point) each run under the next block, the last one after the
    loop, alone. A re-run's gather waits for nothing (counted exposed). ``rotate``: the user's
    ``--cp-rotate`` (the rank's setup may be a cached one's), else the setup's.
    """
    rotate = rotate or setup.parallel.cp_rotate
    cp = setup.parallel.cp
    if cp == 1:
        return []
    dims = Dims.of(setup)
    kv, grads = kv_bytes(dims, dims.act), kv_bytes(dims, DType.FP32)
    if rotate is CpRotate.KV_GATHER:
        return gather_exchanges(setup, kv)
    if rotate is CpRotate.ALLTOALL:
        out = [
            Exchange("forward", "send-recv", kv, cp - 1, "blocks"),
            Exchange("backward", "send-recv", kv, cp - 1, "blocks"),
        ]
    else:
        out = [
            Exchange("forward", "all-gather", kv, 1, "first"),
            Exchange("backward", "all-gather", kv, 1, "first"),
        ]
    out += [
        Exchange("backward", "send-recv", grads, cp - 1, "blocks"),
        Exchange("backward", "send-recv", grads, 1),
    ]
    if attention_reruns(setup):
        out.append(
            Exchange("recompute", "send-recv", kv, cp - 1)
            if rotate is CpRotate.ALLTOALL
            else Exchange("recompute", "all-gather", kv, 1)
        )
    return out


def gather_exchanges(setup: Setup, kv: int) -> list[Exchange]:
    """``--cp-rotate kv-gather`` (Transformer Engine's ``AttnFuncWithCPAndKVAllGather``, "KV all-gather
    between CP ranks is exposed"): forward, one all-gather of the rank's K/V (``gather_along_first_dim`` of
    k and of v: two calls of half the bytes, counted as one of ``kv``); backward, the same all-gather and
    one reduce-scatter of the gathered dK/dV in the activation dtype (``reduce_scatter_along_first_dim``);
    a re-run forward gathers again. None runs under a block: each is waited for before the kernels that
    need it (the backward's reduce-scatter after them)."""
    out = [
        Exchange("forward", "all-gather", kv, 1),
        Exchange("backward", "all-gather", kv, 1),
        Exchange("backward", "reduce-scatter", kv, 1),
    ]
    if attention_reruns(setup):
        out.append(Exchange("recompute", "all-gather", kv, 1))
    return out


def elementwise_bytes(setup: Setup, rotate: CpRotate | None = None) -> tuple[int, int]:
    """HBM bytes of the context-parallel attention's own element-wise work in one layer, one micro-batch,
    on one rank, (forward, backward): torch's ring (``ring_bytes``) or ``kv-gather`` (``gather_bytes``);
    (0, 0) at cp 1. ``setup``: the rank's (``tp_model``); ``rotate``: the user's ``--cp-rotate`` (the
    rank's setup may be a cached one's, ``pieces_key``), else the setup's."""
    if setup.parallel.cp == 1:
        return 0, 0
    if (rotate or setup.parallel.cp_rotate) is CpRotate.KV_GATHER:
        return gather_bytes(setup)
    return ring_bytes(setup)


def gather_bytes(setup: Setup) -> tuple[int, int]:
    """``kv-gather``'s own element-wise bytes (Transformer Engine's ``AttnFuncWithCPAndKVAllGather`` in
    Megatron's ``sbhd`` layout, where its ``select``/``movedim`` + ``contiguous`` calls are no-ops), every op
    reading and writing its tensors once; G = c·K gathered elements of k (and of v), Q the rank's query
    elements, e the activation dtype's bytes:

    - forward: ``index_select`` of the gathered k and v into sequence order (2e a G element, twice); each
      chunk's output copied into the returned one (``out[i].copy_``: 2e a Q element).
    - backward: zeroed gathered dK and dV (e a G element, twice); the same two ``index_select`` calls; dQ's
      two halves copied (2e a Q element); each chunk's dK and dV added into the gathered ones over its key
      prefix (``add_``: 3e an element; the two prefixes hold (2c + 1)/2c of G); dK and dV put back in rank
      order (``index_select``, 2e a G element, twice).

    NB: Llama 3's own code is not public; in the ``bshd`` layout Transformer Engine also copies q's halves,
    the prefixes and dO (not counted)."""
    c = setup.parallel.cp
    dims = Dims.of(setup)
    q = dims.b * dims.a * dims.s * dims.d
    g = c * dims.b * dims.kv * dims.s * dims.d
    e = dims.act.bytes
    reorder = 2 * 2 * e * g
    forward = reorder + 2 * e * q
    prefixes = 2 * 3 * e * (2 * c + 1) * g // (2 * c)
    backward = 2 * e * g + reorder + 2 * e * q + prefixes + reorder
    return forward, backward


def ring_bytes(setup: Setup) -> tuple[int, int]:
    """HBM bytes of the ring's own element-wise work in one attention layer, one micro-batch, on the
    rank that moves the most (the last: its later blocks use half of the received K/V), (forward,
    backward); (0, 0) at cp 1. ``setup``: the rank's (``tp_model``: a/t and kv/t heads). torch 2.13
    ``_templated_ring_attention`` and its backward, default options (``convert_to_f32``), every op reading
    and writing its tensors once (Q = the rank's query elements b·a·(s/c)·d, K = its key elements
    b·kv·(s/c)·d, e the activation dtype's bytes):

    - forward: each block's output cast to fp32 (e + 4 a Q element); each later block merged into the
      running output (``_SDPAMerger``: ``out - sigmoid(Δlse) * (out - block_out)``, three fp32 kernels of
      12, 8 and 12 bytes an element); before every block but the last, ``torch.cat`` of k and v (2e a K
      element, twice); the merged output cast back (4 + e).
    - backward: fp32 zeros for dQ, dK, dV (4 an element); before every block but the last the same K/V
      ``cat``; each block's bf16 gradients added into the fp32 accumulators (4 + e + 4), on this rank's
      later blocks into half of dK and dV by ``_partial_update`` (the half's add, then ``torch.cat`` of the
      whole, 8); after every block the fp32 dK/dV ``cat`` sent on (8 a K element, twice); at the end dQ
      and the received dK/dV cast to e (4 + e).

    The logsumexp's updates ([b, a, s/c] fp32: 1/d of the output's) are not counted, nor k and v's
    ``contiguous()`` copies (none for contiguous inputs). Measured with the kernels' own time taken out
    (benchmarks/ring_kernels.py, an H200, Llama 3.1 8B's shapes at cp 8, K/V repeated to its 32 query
    heads): 14.0 ms forward and 18.2 ms backward on this rank against these bytes' 11.7 and 17.4 ms at
    ``MEMORY`` × 4.8 TB/s."""
    c = setup.parallel.cp
    if c == 1:
        return 0, 0
    dims = Dims.of(setup)
    q = dims.b * dims.a * dims.s * dims.d
    k = dims.b * dims.kv * dims.s * dims.d
    e = dims.act.bytes
    merge = 12 + 8 + 12
    kv_cat = 2 * (2 * e) * k
    forward = 2 * (e + 4) * q + (c - 1) * ((e + 4 + merge) * q + kv_cat)
    accumulate = 4 + e + 4
    dkv_cat = 2 * 8 * k
    first = 2 * accumulate * k + accumulate * q + dkv_cat
    later = 2 * (accumulate * k // 2 + 8 * k) + dkv_cat + accumulate * q
    backward = 4 * (q + 2 * k) + (c - 1) * kv_cat + first + (c - 1) * later + (4 + e) * (q + 2 * k)
    return forward, backward


KV_GATHER_NOT_RUN = (
    "cp-rotate: kv-gather (Llama 3's, Transformer Engine's all_gather context parallelism) is estimated, "
    "not run: trace and profile run torch's ring; use --cp-rotate allgather or alltoall"
)


def check_torch_ring(setup: Setup) -> None:
    """One-line ``ValueError`` where a run would need context parallelism other than torch's ring (what
    ``trace`` and ``profile`` run)."""
    if setup.parallel.cp > 1 and setup.parallel.cp_rotate is CpRotate.KV_GATHER:
        raise ValueError(KV_GATHER_NOT_RUN)
