"""Pipeline parallelism: which layers, embedding and head a stage holds, and how many micro-batches' saves
are alive on it at the end of its warm-up (1F1B, or interleaved with virtual stages).

Placement (Megatron-LM): stage 0 holds the embedding (and learned positions), the last stage the final
norm and the lm head; with tied embeddings and p > 1 the last stage keeps its own copy of the word embedding
for the head (Megatron's ``word_embeddings_for_head``, kept in sync by an all-reduce). Micro-batches in
flight (Narayanan et al. 2021 §2.2; Korthikanti et al. 2022 §4.2.3): under 1F1B, stage i runs p − i
forwards before its first backward; with the interleaved schedule of m model chunks Megatron's warm-up is
2(p − i − 1) + (m − 1)·p forwards. Both are capped by the micro-batches of the step (``grad_accum``).

``--impl torchtitan``: torchtitan places the layers itself (``config.impl_rules.titan_stage_layers``, its
``_generate_llm_fqn_per_model_part``: the embedding and the head weigh one layer each), filled in as the
setup's ``pp_layers``; its last stage ends with the lm head and holds the logits (``pp.logits``), and a
layer's saved RoPE cache is its module buffer, once per layer (``Group.LAYER_BUFFER``). With ``--vpp M`` it
runs torch's ``ScheduleInterleaved1F1B`` over its p·M virtual stages, whose runtime holds every send to the
step's end: a rank is taken at its largest moment (``torch_interleaved.moments``), not its warm-up's end.

A rank's inventory is grouped (``Group``, by each tensor's block and scope) so that a stage's saves are
each group's bytes times its instances alive (``group_counts``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import Enum

from memplan.analytic.head_moments import freed_before_final_norm
from memplan.analytic.params import ParamCount
from memplan.blocks.attention.rope import is_rope_cache
from memplan.blocks.inventory import Block, Kept, Role, Scope
from memplan.blocks.profiles import profile_of
from memplan.config import DType, NormType, Parallel, Setup


class Group(Enum):
    LAYER = "layer"
    CHECKPOINT = "checkpoint"
    EMBED = "embed"
    HEAD = "head"
    HEAD_FREED = "head_freed"
    """Head tensors released before the final norm's backward peaks (the loss's, the lm head's input...)."""
    STAGE = "stage"
    """Made once per forward of a stage: RoPE tables, the causal mask, the reversible stack's outputs."""
    CHUNK = "chunk"
    """Made once per model chunk and cached for the run: Megatron's RoPE table (``rope_cached_per_chunk``)."""
    LAYER_BUFFER = "layer_buffer"
    """A layer's module buffer autograd saves: one storage per layer of the stage, whatever the forwards in
    flight (torchtitan's per-layer complex RoPE cache, ``Profile.rope_cache_per_layer``, a view of which
    every micro-batch's forward saves)."""
    LAYER_CONSTANTS = "layer_constants"
    """A model constant made of one buffer per layer, alive all step: a stage holds its own layers' once
    (torchtitan's RoPE caches under context parallelism, ``blocks.attention.rope.titan_cp_rules``:
    [L, seq, d/2] in the inventory; its group bytes are one layer's)."""
    MICRO_BATCH_INPUTS = "micro_batch_inputs"
    """A model input of one micro-batch that every checkpointed block keeps (torchtitan's positions under
    context parallelism, ``titan_cp_rules``): one per micro-batch in flight on the rank — under torch's
    interleaving a micro-batch in flight in a later chunk is in flight in the earlier ones too (forwards
    run chunk 0 first, backwards last), so the most forwards in flight of one chunk holding layers."""


def group_of(
    k: Kept, norm: NormType, rope_cached: bool = False, rope_buffers: bool = False, rope_caches: bool = False
) -> Group:
    """``rope_cached``: the profile's ``rope_cached_per_chunk`` (one table per model chunk);
    ``rope_buffers``: its ``rope_cache_per_layer`` (a layer's saved cache is its module buffer);
    ``rope_caches``: that under cp (``rope_caches``: the layers' caches a model constant)."""
    if rope_cached and k.block is Block.ROPE:
        return Group.CHUNK
    if rope_caches and k.block is Block.ROPE and k.role is Role.ROPE_TABLE:
        return Group.LAYER_CONSTANTS
    if rope_caches and k.block is Block.ROPE and k.role is Role.TOKEN_IDS:
        return Group.MICRO_BATCH_INPUTS
    if rope_buffers and is_rope_cache(k):
        return Group.LAYER_BUFFER
    if k.block is Block.CHECKPOINT:
        return Group.CHECKPOINT
    if k.scope is Scope.LAYER:
        return Group.LAYER
    if k.block is Block.EMBED:
        return Group.EMBED
    if freed_before_final_norm(k, norm):
        return Group.HEAD_FREED
    if k.block.in_head:
        return Group.HEAD
    return Group.STAGE


def rope_caches(setup: Setup) -> bool:
    """torchtitan's per-layer RoPE caches under context parallelism: one model constant
    (``Group.LAYER_CONSTANTS``), each stage holding its layers' (measured:
    tests/hf/test_torchtitan_pp_cp.py)."""
    return profile_of(setup).rope_cache_per_layer and setup.parallel.cp > 1


@dataclass(frozen=True, slots=True)
class Stage:
    index: int
    first: bool
    last: bool
    layers: int
    """Layers on this pipeline rank (L/p when even)."""
    chunk_layers: int
    """Layers of the rank's largest model chunk: L/(p·m) when even (= L/p without interleaving)."""
    chunks: int
    """Model chunks whose activations are alive at once (micro-batches × chunks in flight)."""
    embed_micro_batches: int
    in_flight: tuple[int, ...] = ()
    """Layers of each of those ``chunks`` chunk-forwards (uneven virtual stages differ)."""
    chunks_of: tuple[int, ...] = ()
    """Layers of each of the rank's model chunks, chunk 0 first (virtual stage k·p + index)."""
    sends: int = 0
    """Of the chunk-forwards in flight, those whose output goes on to a next stage (not the model's last
    virtual stage)."""
    micro_batches: int = 1
    """Micro-batches of the step (= grad_accum)."""
    chunk_ids: tuple[int, ...] | None = None
    """The local chunk of each of the ``in_flight`` forwards (None: Megatron's ⌊j/p⌋ mod m)."""
    sent_outputs: int | None = None
    """Sent outputs alive (torch's runtime schedules hold every send to the step's end:
    ``torch_interleaved``); None: those in flight that send, plus 1F1B's ``send_work``."""
    sent_grads: int = 0
    """Input gradients sent back and still held (torch's runtime schedules: ``torch_interleaved``)."""
    head_forwards: int | None = None
    """Forwards of the model's last virtual stage in flight (its head's saves); None: 1 on the last stage."""

    @property
    def in_flight_layers(self) -> int:
        """Layer activations alive at the end of the warm-up: Σ of ``in_flight``."""
        return sum(self.in_flight)


def stage_layers(layers: int, parallel: Parallel) -> tuple[int, ...]:
    """Layers on each pipeline stage: ``parallel.pp_layers`` when given, else ⌈L/p⌉ each with the
    p·⌈L/p⌉ − L layers too many taken one by one from the first and the last stage, then the second and the
    second-to-last, … — the stages that also hold the embedding and the head (Llama 3 405B, Dubey et al.
    2024 §3.3.2: 126 layers over 16 stages, the first and last one layer fewer; Megatron's
    ``--decoder-first/last-pipeline-num-layers``)."""
    return _stage_layers(layers, parallel.pp, parallel.vpp, parallel.pp_layers)


@functools.lru_cache(maxsize=4096)
def _stage_layers(layers: int, p: int, m: int, given: tuple[int, ...] | None) -> tuple[int, ...]:
    """``stage_layers`` of p stages of m chunks, ``given`` the ``pp_layers`` (kept: ``fit`` asks again
    for every estimate and timing of a layout)."""
    if given is not None and len(given) == p * m > p:
        return tuple(sum(given[k * p + i] for k in range(m)) for i in range(p))
    if given is not None:
        return given
    full = -(-layers // p)
    counts = [full] * p
    for i in range(p * full - layers):
        counts[i // 2 if i % 2 == 0 else p - 1 - i // 2] -= 1
    return tuple(counts)


def chunk_layers(layers: int, parallel: Parallel) -> tuple[tuple[int, ...], ...]:
    """Each rank's model chunks' layers, chunk 0 first. Virtual stage v = k·p + i is chunk k of rank i
    (Megatron's interleaved placement, Narayanan et al. 2021 §2.2.1). ``pp_layers`` with p·m entries lists
    the virtual stages in model order — Megatron's explicit pipeline layout
    (``--pipeline-model-parallel-layout``, Megatron-LM MR 2795), e.g. Llama 3 405B's 0, 1 × 126, 0: the
    first chunk holds the embedding alone and the last the head alone (Dubey et al. 2024 §3.3.2);
    otherwise L/(p·m) each (``check_layout`` refuses an uneven split without a list)."""
    return _chunk_layers(layers, parallel.pp, parallel.vpp, parallel.pp_layers)


@functools.lru_cache(maxsize=4096)
def _chunk_layers(layers: int, p: int, m: int, given: tuple[int, ...] | None) -> tuple[tuple[int, ...], ...]:
    """``chunk_layers`` of p stages of m chunks, ``given`` the ``pp_layers`` (kept, as ``_stage_layers``)."""
    if m == 1:
        return tuple((n,) for n in _stage_layers(layers, p, m, given))
    virtual = given
    if virtual is None or len(virtual) != p * m:
        virtual = (layers // (p * m),) * (p * m)
    return tuple(tuple(virtual[k * p + i] for k in range(m)) for i in range(p))


def clear_placements() -> None:
    """Forget the memoised placements (``stage_layers``, ``chunk_layers``, ``stage``): for cold-start
    benchmarks (``pieces.clear_caches``)."""
    _stage_layers.cache_clear()
    _chunk_layers.cache_clear()
    _stage.cache_clear()


def representative_stages(counts: tuple[int, ...]) -> tuple[int, ...]:
    """The stages whose memory can be the largest: the first (the embedding, the most micro-batches in
    flight), the last (the head) and each middle stage with more layers than every stage before it — a
    stage with no more layers than an earlier one holds fewer micro-batches in flight, so it never exceeds
    that one."""
    p = len(counts)
    picked = {0, p - 1}
    most = counts[0]
    for i in range(1, p - 1):
        if counts[i] > most:
            picked.add(i)
            most = counts[i]
    return tuple(sorted(picked))


def warmup_forwards(parallel: Parallel, index: int, micro_batches: int) -> int:
    """Chunk-forwards rank ``index`` runs before its first backward, at most all m·n of them: p − i − 1
    under 1F1B, 2(p − i − 1) + (m − 1)·p interleaved (Megatron-LM's ``get_num_warmup_microbatches``,
    Narayanan et al. 2021 §2.2); the rest run one forward, one backward (the steady state)."""
    return _warmup(parallel.pp, parallel.vpp, index, micro_batches)


def _warmup(p: int, m: int, index: int, micro_batches: int) -> int:
    """``warmup_forwards`` of rank ``index`` of p ranks of m chunks."""
    warm = p - index - 1 if m == 1 else 2 * (p - index - 1) + (m - 1) * p
    return min(warm, m * micro_batches)


def stage(parallel: Parallel, index: int, chunks_of: tuple[int, ...], micro_batches: int) -> Stage:
    """Pipeline rank ``index`` of ``parallel.pp`` whose model chunks hold ``chunks_of`` layers (one entry
    without interleaving), under 1F1B (interleaved when vpp > 1)."""
    return _stage(parallel.pp, parallel.vpp, index, chunks_of, micro_batches)


@functools.lru_cache(maxsize=4096)
def _stage(p: int, m: int, index: int, chunks_of: tuple[int, ...], micro_batches: int) -> Stage:
    """``stage`` of a pipeline of p ranks of m chunks (kept: a ``Stage`` is frozen, and ``fit`` asks for the
    same one for every estimate and timing of a layout)."""
    chunks = min(_warmup(p, m, index, micro_batches) + 1, m * micro_batches)
    # forward j runs chunk (j mod p·m) // p (Megatron's get_model_chunk_id: groups of p micro-batches)
    chunk_ids = [(j // p) % m for j in range(chunks)]
    in_flight = tuple(chunks_of[c] for c in chunk_ids)
    sends = sum(1 for c in chunk_ids if c * p + index < p * m - 1)
    return Stage(
        index=index,
        first=index == 0,
        last=index == p - 1,
        layers=sum(chunks_of),
        chunk_layers=max(chunks_of),
        chunks=chunks,
        embed_micro_batches=min(p, micro_batches) if index == 0 else 0,
        in_flight=in_flight,
        chunks_of=chunks_of,
        sends=sends,
        micro_batches=micro_batches,
    )


def replicated_ends(st: Stage, pp: int) -> int:
    """The rank's model chunks that hold layers and send their output on to a next virtual stage (all but
    the model's last, virtual stage p·m − 1): the output gradient of each one's last layer comes back
    through the stage boundary (``blocks.torchtitan.partial_grad_elements``). 0 without pp."""
    m = len(st.chunks_of)
    return sum(1 for k, c in enumerate(st.chunks_of) if c > 0 and k * pp + st.index < pp * m - 1)


def group_counts(st: Stage, segment: int, alone: bool = False) -> dict[Group, int]:
    """Instances of each group's tensors alive on the stage at the end of its warm-up (``alone``: the
    checkpointed layers are single layers, the others keep their saves: ``checkpointing.alone``)."""
    checkpoints = sum(-(-n // segment) for n in st.in_flight) if segment else 0
    head = (1 if st.last else 0) if st.head_forwards is None else st.head_forwards
    return {
        Group.LAYER: st.in_flight_layers - (checkpoints if alone else 0),
        Group.CHECKPOINT: checkpoints,
        Group.EMBED: st.embed_micro_batches,
        Group.HEAD: head,
        Group.HEAD_FREED: head,
        Group.STAGE: sum(1 for n in st.in_flight if n),  # a chunk of only the embedding or head makes none
        Group.CHUNK: sum(1 for n in st.chunks_of if n),
        # a checkpointed layer keeps its input only; NB: interleaved, every chunk counted as having run
        Group.LAYER_BUFFER: 0 if segment else st.layers,
        Group.LAYER_CONSTANTS: st.layers,
        Group.MICRO_BATCH_INPUTS: micro_batches_in_flight(st),
    }


def micro_batches_in_flight(st: Stage) -> int:
    """Micro-batches in flight on the rank (``Group.MICRO_BATCH_INPUTS``): the most forwards in flight of
    one chunk that holds layers (1F1B: its one chunk's; ``chunk_ids`` otherwise, torch's interleaving)."""
    ids = st.chunk_ids if st.chunk_ids is not None else (0,) * len(st.in_flight)
    return max((ids.count(c) for c, n in enumerate(st.chunks_of) if n), default=0)


def boundary_tensors(
    st: Stage,
    p: int,
    tokens: tuple[int, int],
    h: int,
    act: DType,
    frees_outputs: bool,
    shared_input: bool,
    logits: int = 0,
    logits_seq: int | None = None,
) -> list[Kept]:
    """What the pipeline schedule holds at a stage's boundary at the end of its warm-up, beyond autograd's
    saves (``tokens``: the [b, s] one rank sends — s/t under sequence parallelism; ``act``: the activation
    dtype; ``shared_input``: the first layer's norm saves its input storage itself).

    - ``pp.output`` [b, s, h], one per chunk-forward in flight that sends (``Stage.sends``): torch's
      ``PipelineStage.forward_one_chunk`` keeps ``(output, inputs)`` in ``fwd_cache`` until
      ``backward_one_chunk`` pops it (``stage_backward`` runs autograd from that output); under
      ``Schedule1F1B`` one more once the steady state starts (``by_send_work`` below). Megatron
      (``frees_outputs``) keeps a 0-dim placeholder: ``deallocate_output_tensor`` sets ``out.data =
      torch.empty([])`` right after the send.
    - torch's ``PipelineStage`` allocates one receive buffer per micro-batch and direction at its first step
      (``_prepare_forward_infra`` / ``_setup_backward_recv_info``) and keeps them: n [b, s, h] activation
      buffers on each chunk that receives (every virtual stage but the first), n gradient buffers on each
      that sends. A buffer a forward in flight reads is the first layer's norm input when that norm saves
      its input storage (fp32 activations, LayerNorm): that one is counted there (``pp.recv``'s count less
      those forwards). Megatron receives into a fresh tensor per micro-batch, which is the first layer's
      saved norm input, and into a transient gradient: nothing more.
    - ``pp.logits`` [b, s, ``logits``] on the model's last stage when its loss runs outside the stage
      (torchtitan: the stage ends with the lm head, the schedule's ``loss_fn`` computes the loss):
      ``fwd_cache`` keeps that output too, one per forward in flight there (``logits`` = 0: the stage's own
      forward ends with the loss, a scalar). ``logits_seq``: its tokens when not ``tokens``' s (under
      sequence parallelism the vocabulary-parallel lm head's output has the whole sequence).
    """
    b, s = tokens
    shape = (b, s, h)
    out: list[Kept] = []

    def held(name: str, shp: tuple[int, ...], role: Role, count: int, reason: str) -> None:
        if count:
            out.append(
                Kept(
                    name=name,
                    block=Block.PIPELINE,
                    role=role,
                    shape=shp,
                    dtype=act,
                    scope=Scope.MODEL,
                    count=count,
                    reason=reason,
                )
            )

    if frees_outputs:
        held(
            "pp.output",
            (),
            Role.STAGE_OUTPUT,
            st.sends,
            "Megatron's deallocate_output_tensor: the sent output's .data is torch.empty([]) until backward",
        )
        return out
    m, n = len(st.chunks_of), st.micro_batches
    # Schedule1F1B's warm-up keeps its Work list ``send_work`` from the send of micro-batch w − 2 to the
    # step's end (only the warm-up reassigns it; the backend's send work keeps its tensor): once that
    # micro-batch's backward has run, its output is one more beside the w in flight (w ≥ 2) — from the
    # forward after that backward on: steady step k runs B(k) then F(w + k), so at k = w − 2 it needs
    # micro-batch 2w − 2, i.e. n ≥ 2w − 1 (else the step ends with fewer than w in flight then).
    w = st.sends
    by_send_work = 1 if m == 1 and w >= 2 and n >= 2 * w - 1 else 0
    held(
        "pp.output",
        shape,
        Role.STAGE_OUTPUT,
        st.sends + by_send_work if st.sent_outputs is None else st.sent_outputs,
        "torch pipelining's fwd_cache: the stage output, for stage_backward, until its backward"
        + ("" if st.sent_outputs is None else "; the runtime's send_ops to the step's end"),
    )
    held(
        "pp.grad_send",
        shape,
        Role.STAGE_OUTPUT,
        st.sent_grads,
        "torch pipelining's runtime send_ops: each sent input gradient's Work keeps it to the step's end",
    )
    receiving = m - (1 if st.index == 0 else 0)  # virtual stage k·p + i receives unless it is 0
    ids = st.chunk_ids if st.chunk_ids is not None else tuple((j // p) % m for j in range(len(st.in_flight)))
    reading = sum(1 for c, layers in zip(ids, st.in_flight, strict=True) if layers and c * p + st.index > 0)
    held(
        "pp.recv",
        shape,
        Role.RECV_BUFFER,
        n * receiving - (reading if shared_input else 0),
        "torch pipelining's activation receive buffers: one per micro-batch, allocated at the first step",
    )
    last_forwards = st.chunks - st.sends  # chunk-forwards in flight of the model's last virtual stage
    held(
        "pp.logits",
        (b, s if logits_seq is None else logits_seq, logits),
        Role.STAGE_OUTPUT,
        last_forwards if logits and p > 1 else 0,
        "torch pipelining's fwd_cache: the last stage's logits, the loss_fn's input, until its backward",
    )
    sending = m - (1 if st.index == p - 1 else 0)  # virtual stage k·p + i sends unless it is the last
    held(
        "pp.grad_recv",
        shape,
        Role.RECV_BUFFER,
        n * sending,
        "torch pipelining's gradient receive buffers: one per micro-batch, allocated at the first step",
    )
    return out


def stage_params(rank: ParamCount, st: Stage, tied: bool, pp: int) -> ParamCount:
    """The stage's parameters on one rank: its layers, the embedding on the first, the head on the last."""
    head = 0
    if st.last:
        head = rank.embedding if tied and pp > 1 else rank.lm_head  # tied: the head's own copy
    return rank.model_copy(
        update={
            "embedding": rank.embedding if st.first else 0,
            "positions": rank.positions if st.first else 0,
            "num_layers": st.layers,
            "final_norm": rank.final_norm if st.last else 0,
            "lm_head": head,
        }
    )
