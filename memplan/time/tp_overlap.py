"""Transformer Engine's userbuffers overlap of the sequence-parallel collectives with the GEMMs
(``--tp-comm-overlap``: Megatron-LM's ``--tp-comm-overlap``, NeMo's ``ub_tp_comm_overlap``, Megatron-Bridge's
``CommOverlapConfig(tp_comm_overlap=True)``): which collectives hide, behind which GEMMs, and how much of
those GEMMs they can use; the buffers it registers outside torch's allocator.

Without it Megatron overlaps two of a layer's sequence-parallel collectives already (the backward's
reduce-scatter of the column-parallel input gradients under their weight gradients, and the re-gather of
their saved inputs under the input-gradient GEMM: ``comm.collectives.tp_rows``, TE's ``bulk`` kind). The
other three wait: the all-gather of the column-parallel linears' inputs (W_QKV, W_fc1) in forward, the
reduce-scatter of the row-parallel outputs (W_O, W_fc2) in forward, the all-gather of the row-parallel
outputs' gradients before their input-gradient GEMMs in backward (and a re-run layer's two).

TE's ``initialize_ub`` (transformer_engine/pytorch/module/base.py, the default ``methods``) runs those as
split GEMMs: ``ring_exchange`` for ``qkv_fprop``, ``fc1_fprop``, ``proj_dgrad``, ``fc2_dgrad`` — the GEMM
runs in tp chunks, one per rank's shard, each chunk's GEMM under the point-to-point transfer of the next
shard (``CommOverlapP2PBase::split_overlap_ag``: the rank's own shard first, nothing to wait for) — and
``pipeline`` (4 splits) for ``proj_fprop`` and ``fc2_fprop``, each output chunk reduce-scattered under the
next chunk's GEMM; Megatron-Bridge's float8 configurations (``training/comm_overlap.py``,
``userbuffers_fp8_*``) run those two as ring exchanges too. Either way the last chunk's GEMM has nothing
left to hide (a ring) or its own chunk's transfer after it (a pipeline), so each collective hides behind
(k − 1)/k of its GEMM, k = tp chunks for a ring; memplan takes the ring for all four (for tp 4 a pipeline
of 4 splits has the same window):

    window(column, forward) = n · (t − 1)/t · share_col · the layers' forward linear seconds
    window(row, forward)    = n · (t − 1)/t · share_row · the layers' forward linear seconds
    window(row, dgrad)      = n · (t − 1)/t · share_row · the same FLOPs at the backward's efficiency
    (re-run: the same at the re-run's linear seconds)

share_row = (a·d + f) / ((a + 2·kv)·d + a·d + m·f), m = 3 for SwiGLU (gate, up, down) else 2, and share_col
= 1 − share_row: each linear's FLOPs are 2·T·in·out over the rank's shard. Under MoE parallel folding
(``--etp 1``) the MoE layer has no sequence-parallel collective to hide: W_QKV and W_O alone overlap,
share_col = T·(a + 2·kv)·d / F and share_row = T·a·d / F, F = T·((a + 2·kv)·d + a·d + E) + S·m·f (the
router on T tokens, the whole experts on S slots; ``shares``). What hides behind a window is
charged as every overlapped NVLink collective is (``predict.exposed``: max(0, its time − the window), plus
``OVERLAP_SLOWDOWN`` of the seconds they share, the comm kernels' and copy engines' contention with the
GEMM; TE's pipeline kind sets ``num_sm`` SMs aside, 16 by default, 12 % of an H100's: below that
slowdown, not charged apart). The head's all-gather and the embedding's reduce-scatter are Megatron's own
(not TE modules): exposed as before.

Buffers (``userbuffer_bytes``): ``initialize_ub`` registers one buffer per GEMM name with the shape
Megatron passes, [s·b/cp, h] (``_initialize_tp_communicators``), outside torch's caching allocator: the
four ring exchanges and the four bulk overlaps (``qkv_dgrad``, ``qkv_wgrad``, ``fc1_dgrad``, ``fc1_wgrad``)
and the two pipelines: ten of [T, h], in float8 (1 byte) for the all-gathers under ``--fp8``
(``fp8_buf``: the name in ``layers_all_gather_overlap``) and in the activation dtype otherwise.

NB: the userbuffers run inside one NVLink domain: a tp group that leaves the node is refused
(``check_node``). TE's cuBLAS workspace repeated for its 3 streams (``_NUM_MAX_UB_STREAMS``), 2 × the
workspace more, is not counted. Megatron-Bridge's per-model configurations (ring-exchange reduce-scatters
of (2t − 1)/t × [T, h], their SM counts) are not read: TE's defaults are.
"""

from __future__ import annotations

from memplan.config import Fp8Recipe, MlpType, Setup
from memplan.presets import Topology
from memplan.time.comm.rows import Critical, Overlap, rank_tokens

UB_GEMMS = 10
"""The GEMM names ``initialize_ub`` makes a buffer for: qkv and fc1's fprop, dgrad and wgrad, proj and
fc2's fprop and dgrad."""
UB_ALL_GATHERS = 6
"""Of those, ``layers_all_gather_overlap`` (float8 buffers under ``--fp8``): qkv_fprop, qkv_dgrad,
proj_dgrad, fc1_fprop, fc1_dgrad, fc2_dgrad."""


def applies(setup: Setup) -> bool:
    """``--tp-comm-overlap`` (its rules, ``config.megatron_rules.check_tp_comm_overlap``: Megatron, tp with
    sp, dense layers or folded experts) or torchtitan's ``--async-tp``, whose fused collectives are these
    and hide the same way (``time.async_tp``)."""
    return setup.impl.tp_comm_overlap or setup.impl.async_tp


def kind(setup: Setup) -> str:
    """What runs the overlap, for the rows' labels: TE's userbuffers or torch's symmetric memory."""
    return "symmetric memory" if setup.impl.async_tp else "userbuffers"


def check_node(setup: Setup, topo: Topology) -> None:
    """A one-line ``ValueError`` where the tp group leaves a node: TE's userbuffers connect the ranks of one
    NVLink domain (``initialize_ub`` colours the ranks by host)."""
    if setup.impl.tp_comm_overlap and setup.parallel.tp > topo.gpus_per_node:
        raise ValueError(
            f"tp_comm_overlap: TE's userbuffers run inside one node's NVLink domain; --tp "
            f"{setup.parallel.tp} spans more than its {topo.gpus_per_node} GPUs: use --tp ≤ "
            f"{topo.gpus_per_node} or drop --tp-comm-overlap"
        )


def shares(setup: Setup) -> tuple[float, float]:
    """(column, row): the overlapped column-parallel (W_QKV, W_fc1) and row-parallel (W_O, W_fc2) linears'
    shares of a layer's linear FLOPs (module docstring). Under MoE parallel folding (``Parallel.fold``) the
    MoE layer runs no sequence-parallel collective: only the attention's W_QKV and W_O overlap, their
    shares of the layer's FLOPs with the router [h, E] on T tokens and the whole experts on its S slots."""
    m = setup.model
    mats = 3 if m.mlp is MlpType.SWIGLU else 2
    q, kv = m.num_heads * m.dim, m.kv_heads * m.dim
    if setup.parallel.fold > 1 and m.moe is not None:  # check_folding: every layer routed experts alone
        t = setup.training.micro_batch * setup.training.seq_len
        total = t * (q + 2 * kv + q + m.moe.experts) + m.moe.slots(t) * mats * m.ffn
        return t * (q + 2 * kv) / total, t * q / total
    row = (q + m.ffn) / (q + 2 * kv + q + mats * m.ffn)
    return 1 - row, row


def windows(c: Critical, forward_s: float, dgrad_s: float, rerun_s: float, n: int) -> dict[Overlap, float]:
    """Seconds each userbuffers overlap hides behind over ``n`` micro-batches (module docstring):
    ``forward_s`` the layers' linears in one micro-batch's forward, ``dgrad_s`` the same FLOPs at the
    backward's efficiency, ``rerun_s`` the re-run layers' linears."""
    t = c.setup.parallel.tp
    used = n * (t - 1) / t
    column, row = shares(c.setup)
    return {
        Overlap.UB_COLUMN_FORWARD: used * column * forward_s,
        Overlap.UB_ROW_FORWARD: used * row * forward_s,
        Overlap.UB_ROW_DGRAD: used * row * dgrad_s,
        Overlap.UB_COLUMN_RERUN: used * column * rerun_s,
        Overlap.UB_ROW_RERUN: used * row * rerun_s,
    }


def userbuffer_bytes(setup: Setup) -> int:
    """Bytes of the userbuffers one rank registers (module docstring): ten of [s·b/cp, h], the all-gathers'
    in float8 under ``--fp8``; 0 without ``--tp-comm-overlap``."""
    if not setup.impl.tp_comm_overlap:
        return 0
    elements = rank_tokens(setup) * setup.model.hidden_size
    e = setup.training.precision.activation_dtype.bytes
    gathers = 1 if setup.impl.fp8 is not Fp8Recipe.NONE else e
    return elements * (UB_ALL_GATHERS * gathers + (UB_GEMMS - UB_ALL_GATHERS) * e)
