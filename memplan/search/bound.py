"""A lower bound of a configuration's predicted step time from one reference sequence's kernels, and the
cut-off it is compared with: what lets ``fit`` skip configurations that cannot be among the fastest it
lists.

The predicted step (``time.predict``) is at least its busy time stretched by the bubble,
busy · (1 + (p − 1)/(m·n)), and busy is at least the busiest stage's kernels, n·(forward + backward)
(``time.compute.kernel_times`` of ``comm.rows.critical_stage``: matrix products, attention, element-wise
work, launch gaps and QLoRA's dequantisation, added; communication only adds). The busiest stage's
kernels come from one reference sequence (``Reference``: b = 1, no tensor or pipeline parallelism, the
layout's cp and its rotation: one estimate per checkpointing, attention and cp), charged at the layout's
tp (sp) and micro-batch size b as ``kernel_times`` charges them there (``Reference.at``):

- a rank's FLOPs are the model's over its t·cp ranks (``compute.stage_flops``), so at b sequences b/t of
  the reference rank's: the linears (forward, backward, re-run; ``compute.matmul_seconds``: the GEMMs'
  wave, tile and roofline efficiencies of the layout's shapes, the FP8 rate under ``--fp8``) and the
  attention core (``compute.attention_seconds``: the flash kernel's fraction on the layout's grid, eager
  attention's batched GEMMs), both linear in the FLOPs, at the layout's own rates;
- the element-wise bytes of the layout's rank (``time.layer_elementwise.streamed_bytes``, forward,
  backward and the checkpoint's re-run, ``compute.layer_stream_bytes``), at ``MEMORY`` × HBM;
- context parallelism's own copies (``strategies.context_parallel.elementwise_bytes``: the ring's merges
  and accumulators or the K/V all-gather's reorders) of the reference rank: a tensor-parallel rank's are
  of its 1/t of the heads, at least 1/t of them, and linear in b;
- under sequence parallelism, the tensor-parallel collectives of a layer that no compute hides
  (``tp_layer_seconds``: six, ten with full checkpointing's re-run, as ``collective_seconds`` times them);
  and, after the bubble as ``predict`` adds them, the pipeline's sends (``pp_step_seconds``).

Left out (never negative): the fp8 casts, launch gaps, dequantisation, every other collective and the
head's tp calls. With e seconds of a layer and x of the head for one sequence (its t·cp ranks together)
and n·b = B/dp sequences per data-parallel rank, a device of a stage with L layers runs at least
(B/dp)·L·e/(t·cp) = B·p·L·e/N seconds (plus B·p·x/N on the last stage). The stage ``critical_stage``
picks has the most forward FLOPs, ties to the later one: the last stage when its layers plus the head's
forward FLOPs in layers are at least any other stage's layers, else a stage of the most layers
(``Sequence.busiest``: the head's FLOPs in layers are the whole model's ratio, which neither tp nor the
micro-batch size changes, so the pick is known but within rounding of a tie). So

    step ≥ B·p/N · busiest · (1 + (p − 1)/(m·n)) + sends

tests/plan/test_fit_search.py checks the bound against every ZeRO stage's prediction over a sample of
layouts and random ones, ``Reference.at`` against ``kernel_times`` (equal, less the terms left out) over
presets of every shape, the copies' claim (≥ 1/t, linear in b), the collectives against ``tp_rows`` and the
sends against ``pp_rows`` (equal), and end to end the rows against a search that prunes nothing.

``Cutoff`` keeps the ``keep`` fastest step times found so far (per method and saver level): a
configuration whose bound exceeds the slowest of them cannot enter the list.

``stages_bound`` is a second, tighter bound, for one configuration and every ZeRO stage of it at once:
the terms of ``time.predict``'s step that do not depend on the ZeRO stage. Only the data-parallel
collectives (``comm.dp.dp_rows``), FSDP2's copy kernels of their gathers and reductions
(``time.dp_copies``: ZeRO-3), gradient clipping and the optimizer step (``compute.owned_params``) read
it; the busiest
stage, its kernels, the tensor-, context-, pipeline- and expert-parallel collectives (and Megatron's fp8
amax all-reduces) and their overlap windows do not (``time.predict.unstaged``: what the stages share).
With every stage-dependent term (and the offload copies, never negative) left out,

    step ≥ busy + busy·(p − 1)/(m·n) + exposed(pp),   busy = n·(forward + backward) + exposed(tp, cp, ep)

computed with ``predict``'s own operations in its order: IEEE addition and multiplication of
non-negative numbers are monotonic, so the bound is ≤ the predicted step of every stage bit for bit.
tests/plan/test_fit_search.py checks it against the prediction of every ZeRO stage over a sample.

NB: the bound holds while ``Reference.at`` charges each class no more than ``time.compute`` does (a new
kernel class, or a rate that reads a field of the setup ``at`` does not set — it sets tp, sp, cp, its
rotation, ep and b — enters there). At an assumed ``--mfu`` the search bounds with ``mfu_bound`` instead.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass, field

from memplan.config import Attention, Checkpointing, Parallel, Setup
from memplan.engine import Result, estimate
from memplan.presets import GpuPreset
from memplan.search.methods import valid
from memplan.strategies import context_parallel
from memplan.strategies.pipeline_parallel import stage_layers
from memplan.time import efficiency, gemm
from memplan.time.calibration import calibrated_topology
from memplan.time.comm.fabric import Collective, collective_seconds, link
from memplan.time.comm.rows import critical_stage, hidden_bytes, stride_in
from memplan.time.compute import (
    StageFlops,
    attention_seconds,
    fp8_layers,
    hbm_bytes_per_s,
    layer_stream_bytes,
    matmul_seconds,
    ring_rerun,
    roofline,
    stage_flops,
)
from memplan.time.predict import IN_STAGE, Unstaged, unstaged
from memplan.time.timing import peak_flops


def tp_layer_seconds(
    x: int,
    par: Parallel,
    gpu: GpuPreset,
    ckpt: Checkpointing = Checkpointing.NONE,
    b: int = 1,
    gathered: int | None = None,
) -> float:
    """The sequence-parallel collectives of one layer that no compute hides, in ``Sequence``'s units (one
    sequence, its t · cp ranks together) at micro-batch ``b``: ``comm.collectives.tp_rows``' two
    all-gathers of the linears' inputs and two reduce-scatters of their outputs in forward and two
    all-gathers of the output gradients in backward, six calls of X = b·x bytes a micro-batch
    (``Overlap.NONE``; x = (s/cp)·h·e, one sequence's, ``Sequence.hidden_bytes``), and a re-run layer's
    (full checkpointing) all-gathers and reduce-scatters, four more — half of each under parallel folding
    (``Parallel.fold``: the MoE's own tokens, no gather over tp); each as ``comm.fabric.
    collective_seconds`` times it; the head's calls left out. 0 without sequence parallelism (``fit``
    searches tp > 1 with sp only). ``gathered``: the bytes one all-gather moves where it is not X — under
    torchao's float8 plan (``--fp8-tp``) the layers' gathers move one byte an element
    (``comm.collectives.float8_gathers``), the reduce-scatters X."""
    t = par.tp
    if t == 1 or not par.sp:
        return 0.0
    on = link(calibrated_topology(gpu), 1, t)  # tp innermost: stride 1 (``comm.rows.order``)
    per = 1 if par.fold > 1 else 2  # the attention's and the MLP's; folded experts gather nothing over tp
    rerun = 1 if ckpt >= Checkpointing.EVERY_K else 0  # a re-run layer's all-gathers, reduce-scatters
    gathers = per * (2 + rerun) * collective_seconds(Collective.ALL_GATHER, b * (gathered or x), t, on)
    scatters = per * (1 + rerun) * collective_seconds(Collective.REDUCE_SCATTER, b * x, t, on)
    return t * par.cp * (gathers + scatters) / b


def pp_step_seconds(x: int, par: Parallel, gpu: GpuPreset, n: int, b: int = 1, apart: int = 0) -> float:
    """The pipeline's sends that no compute hides, per device and step of ``n`` micro-batches of ``b``:
    ``comm.collectives.pp_rows``' one send of ⌊X/t⌋ each way for every micro-batch and chunk
    (``Overlap.NONE``; ``predict`` adds them after the bubble), X = b·x bytes (x one sequence's,
    ``Sequence.hidden_bytes``), each as ``comm.fabric.collective_seconds`` times it; without sp the
    receivers' all-gathers left out (``fit`` searches tp > 1 with sp only). 0 without a pipeline.
    ``apart``: the stages' stride (``comm.rows.stride``: tp·cp, or tp·cp·dp where pp is outermost); 0 for
    tp·cp."""
    if par.pp == 1:
        return 0.0
    on = link(calibrated_topology(gpu), apart or par.tp * par.cp, 2)  # two neighbouring stages
    return 2 * par.vpp * n * collective_seconds(Collective.SEND_RECV, b * x // par.tp, 2, on)


@dataclass(frozen=True)
class Sequence:
    """One sequence's seconds on a layout at a micro-batch size (module docstring; ``Reference.at``), its
    t·cp ranks' together: through one layer (its linears, its attention core, its element-wise bytes and
    cp's copies; forward, backward and the checkpoint's re-run; ``Bound.seconds`` adds the layer's tp
    collectives) and through the lm head; and ``head_layers``, the head's forward FLOPs in layers' (what
    ``time.comm.rows.critical_stage`` weighs the last stage's head by)."""

    layer_seconds: float
    head_seconds: float
    head_layers: float
    hidden_bytes: int
    """x = (s/cp)·h·e: one sequence's hidden states on a context-parallel rank (``comm.rows.hidden_bytes``
    at b = 1), what a tensor- or pipeline-parallel collective moves per sequence."""

    def busiest(self, counts: tuple[int, ...]) -> float:
        """A lower bound of the seconds of the stage ``critical_stage`` picks, over stages of ``counts``
        layers (the last one with the head): it has the most forward FLOPs, ties to the later stage. A
        stage's forward FLOPs are its layers' plus, on the last, the head's, ``head_layers`` layers' worth
        (the ratio ``critical_stage`` weighs by: the whole model's FLOPs, which neither tp nor b changes),
        so the pick is known: the last when it holds at least the most layers of another stage less
        ``head_layers``, else a stage of those most layers. Where the two are within rounding of a tie
        (a billionth), the lesser of their seconds."""
        layer, last = self.layer_seconds, counts[-1]
        if len(counts) == 1:
            return last * layer + self.head_seconds
        top, weight = max(counts[:-1]), last + self.head_layers
        at_last, at_top = last * layer + self.head_seconds, top * layer
        if top > weight * (1 + 1e-9):
            return at_top
        if top < weight * (1 - 1e-9):
            return at_last
        return min(at_last, at_top)


NOTHING = Sequence(0.0, 0.0, 0.0, 0)
"""Where the reference cannot be built: nothing is pruned."""


@dataclass(frozen=True)
class Reference:
    """One reference sequence (b = 1, tp 1, pp 1: one stage of every layer; the layout's cp and rotation)
    of a checkpointing and attention, from which ``Sequence`` is charged at a layout's tp and micro-batch
    size (``at``): its context-parallel rank's FLOPs (``compute.stage_flops``), the ring's copies of one
    layer there, the head's forward FLOPs in layers' and x = (s/cp)·h·e."""

    setup: Setup
    flops: StageFlops
    layers: int
    rerun: bool
    """Whole layers re-run in backward (``Critical.rerun_layers``): full checkpointing."""
    ring_seconds: float
    head_layers: float
    hidden_bytes: int

    def at(self, par: Parallel, b: int, gpu: GpuPreset) -> Sequence:
        """The sequence's seconds on layout ``par``'s tp (sp), cp and ep at micro-batch ``b``, each class as
        ``compute.kernel_times`` charges it there (module docstring). A rank's FLOPs are the model's over
        its t·cp ranks (``stage_flops``): at b sequences, b/t of this reference rank's, so one sequence's
        over its t·cp ranks together is cp × the reference rank's at the layout's rates; its element-wise
        bytes are the layout's own rank's, × t·cp / b."""
        s = self.setup.model_copy(
            update={
                "parallel": par.model_copy(update={"pp": 1, "vpp": 1, "pp_layers": None}),
                "training": self.setup.training.model_copy(update={"micro_batch": b}),
            }
        )
        peak = peak_flops(gpu, s.training.precision)
        e = gemm.efficiencies(s, gpu.sms, roofline(s, gpu, peak))
        mm, fp8_rate = peak * efficiency.matmul(gpu), fp8_layers(s, gpu)
        f = self.flops
        layers = dataclasses.replace(f, head_forward=0.0, head_backward=0.0)
        head = dataclasses.replace(f, linear_forward=0.0, linear_backward=0.0, rerun_linear=0.0)
        linears = sum(matmul_seconds(layers, e, mm, fp8_rate))
        core = sum(attention_seconds(s, f, gpu, peak))
        stream = sum(layer_stream_bytes(s, gpu, whole=self.rerun)) / hbm_bytes_per_s(gpu)
        cp = par.cp
        per_layer = cp * ((linears + core) / self.layers + self.ring_seconds) + par.tp * cp * stream / b
        return Sequence(
            per_layer, cp * sum(matmul_seconds(head, e, mm, fp8_rate)), self.head_layers, self.hidden_bytes
        )


def reference(setup: Setup, gpu: GpuPreset) -> Reference:
    """``Reference`` of ``setup`` (b = 1, no tensor or pipeline parallelism: one stage holds every layer)."""
    c = critical_stage(estimate(setup))
    f, layers = stage_flops(c), c.layers
    # context parallelism's own copies, as ``kernel_times`` adds them: a layer's forward and backward, the
    # forward's again where the layer or its attention re-runs; a tensor-parallel rank's are of its a/t
    # heads (1/t of these: the same over its t ranks), linear in b
    ring_f, ring_b = context_parallel.elementwise_bytes(c.result.pieces.setup, setup.parallel.cp_rotate)
    again = ring_f if ring_rerun(c, f) else 0
    ring = (ring_f + ring_b + again) / hbm_bytes_per_s(gpu)
    layer_forward = (f.linear_forward + f.attention_forward) / layers
    head_layers = f.head_forward / layer_forward if layer_forward else 0.0
    return Reference(setup, f, layers, c.rerun_layers > 0, ring, head_layers, hidden_bytes(setup))


def reference_key(
    base: Setup, ckpt: Checkpointing, attention: Attention, par: Parallel
) -> tuple[object, ...]:
    """What ``reference_setup`` reads of its arguments besides the model, sequence and precision a search
    holds."""
    return (base.finetune, base.offload, base.loss, ckpt, attention, par.cp, par.cp_rotate)


def reference_setup(base: Setup, ckpt: Checkpointing, attention: Attention, par: Parallel) -> Setup:
    """The reference sequence's setup: ``base`` with one sequence a step (b = 1, one micro-batch), this
    checkpointing and attention, and ``par``'s context parallelism alone (its degree and rotation: the
    attention kernels' lengths); not validated (``methods.valid``)."""
    return base.model_copy(
        update={
            "parallel": Parallel(cp=par.cp, cp_rotate=par.cp_rotate),
            "training": base.training.model_copy(update={"micro_batch": 1, "grad_accum": 1}),
            "strategy": base.strategy.model_copy(
                update={"checkpointing": ckpt, "checkpoint_every": 1, "attention": attention}
            ),
            # --fp8-tp, --tp-comm-overlap and --async-tp need tp: the one-device reference runs without
            # them (--async-tp's own kernels left out too) (--fp8-tp changes the casts, left out, and the tp
            # collectives, which ``with_tp`` charges in float8; the userbuffers hide them, ``with_tp``
            # charges none); nor --fp8-param-gather, which needs the distributed optimizer and changes only
            # its gather
            "impl": base.impl.replaced(
                fp8_tp=False, tp_comm_overlap=False, async_tp=False, fp8_param_gather=False
            ),
        }
    )


def _sequence_key(
    base: Setup, ckpt: Checkpointing, attention: Attention, par: Parallel, b: int
) -> tuple[object, ...]:
    """What a sequence depends on (``Reference.at`` sets tp, sp, cp, its rotation, ep, etp and b; the
    reference its method, savers, checkpointing and attention)."""
    return (
        base.finetune,
        base.offload,
        base.loss,
        ckpt,
        attention,
        par.cp,
        par.cp_rotate,
        par.tp,
        par.sp,
        par.ep,
        par.etp,
        b,
    )


@dataclass
class Bound:
    """Lower bounds of step times for the search of ``global_batch`` sequences on ``gpus`` × ``gpu``."""

    gpu: GpuPreset
    gpus: int
    global_batch: int
    float8_gathers: bool = False
    """``--fp8-tp``: the layers' sequence-parallel all-gathers move one byte an element."""
    userbuffers: bool = False
    """``--tp-comm-overlap`` or ``--async-tp``: the layers' sequence-parallel collectives hide under their
    GEMMs (``time.tp_overlap``), so none is charged (what they take beyond their windows is not bounded
    below)."""
    _references: dict[tuple[object, ...], Reference | None] = field(default_factory=dict)
    _sequences: dict[tuple[object, ...], Sequence] = field(default_factory=dict)
    _with_tp: dict[tuple[object, ...], Sequence] = field(default_factory=dict)
    _counts: dict[tuple[object, ...], tuple[int, ...]] = field(default_factory=dict)
    _sends: dict[tuple[object, ...], float] = field(default_factory=dict)

    def reference(
        self, base: Setup, ckpt: Checkpointing, attention: Attention, par: Parallel
    ) -> Reference | None:
        """The reference sequence for this checkpointing, attention and ``par``'s context parallelism (its
        degree and rotation: the attention kernels' lengths); None when it cannot be built."""
        key = reference_key(base, ckpt, attention, par)
        if key not in self._references:
            setup = reference_setup(base, ckpt, attention, par)
            try:
                self._references[key] = reference(setup, self.gpu) if valid(setup) else None
            except ValueError:
                self._references[key] = None
        return self._references[key]

    def sequence(
        self, base: Setup, ckpt: Checkpointing, attention: Attention, par: Parallel, b: int = 1
    ) -> Sequence:
        """``Reference.at`` layout ``par`` and micro-batch ``b`` (``NOTHING`` without a reference)."""
        key = _sequence_key(base, ckpt, attention, par, b)
        if key not in self._sequences:
            ref = self.reference(base, ckpt, attention, par)
            self._sequences[key] = NOTHING if ref is None else ref.at(par, b, self.gpu)
        return self._sequences[key]

    def with_tp(
        self, base: Setup, ckpt: Checkpointing, attention: Attention, par: Parallel, b: int
    ) -> Sequence:
        """``sequence`` with each layer's tensor-parallel collectives added (``tp_layer_seconds``): what
        ``seconds`` charges a layer, kept per sequence."""
        key = _sequence_key(base, ckpt, attention, par, b)
        if key not in self._with_tp:
            one = self.sequence(base, ckpt, attention, par, b)
            e = base.training.precision.activation_dtype.bytes
            gathered = one.hidden_bytes // e if self.float8_gathers else None
            comm = (
                0.0
                if self.userbuffers
                else tp_layer_seconds(one.hidden_bytes, par, self.gpu, ckpt, b, gathered)
            )
            if comm:
                one = dataclasses.replace(one, layer_seconds=one.layer_seconds + comm)
            self._with_tp[key] = one
        return self._with_tp[key]

    def seconds(self, base: Setup, ckpt: Checkpointing, attention: Attention, par: Parallel, n: int) -> float:
        """The bound for layout ``par`` with ``n`` micro-batches per step (module docstring)."""
        dp = self.gpus // (par.tp * par.pp * par.cp)
        b = max(1, self.global_batch // (n * dp))  # n·b·dp sequences (the sort key's n: at least 1)
        one = self.with_tp(base, ckpt, attention, par, b)
        counts_key = (base.model.num_layers, par.pp, par.vpp, par.pp_layers)
        if counts_key not in self._counts:
            self._counts[counts_key] = stage_layers(base.model.num_layers, par)
        busy = self.global_batch * par.pp * one.busiest(self._counts[counts_key]) / self.gpus
        sends_key = (one.hidden_bytes, par.tp, par.cp, par.pp, par.vpp, n, b, dp)
        if sends_key not in self._sends:
            apart = stride_in(base.impl.impl, par, dp, "pp")  # the implementation's placement
            self._sends[sends_key] = pp_step_seconds(one.hidden_bytes, par, self.gpu, n, b, apart)
        sends = self._sends[sends_key]
        # less a billionth: the prediction adds the same terms in another order (rounding)
        return (busy * (1 + (par.pp - 1) / (par.vpp * n)) + sends) * (1 - 1e-9)


def stages_bound(p: Result, gpu: GpuPreset, shared: Unstaged | None = None) -> float:
    """A lower bound of ``timing(q, gpu).step_time_s`` for ``p`` and every ``q`` that differs from it
    only in the ZeRO stage (module docstring): ``predict``'s step without the data-parallel collectives,
    the optimizer step and the offload copies. ``shared``: ``predict.unstaged(p, ...)``, when made."""
    peak = peak_flops(gpu, p.setup.training.precision)
    common = shared or unstaged(p, gpu, peak)
    forward, backward = common.forward, common.backward
    n, par = p.micro_batches, p.parallel
    hidden = common.others_exposed
    in_stage = sum(v for k, v in hidden.items() if k in IN_STAGE)
    compute = n * (forward.total_s + backward.total_s)
    busy = compute + in_stage
    bubble = busy * (par.pp - 1) / (par.vpp * n)
    return busy + bubble + hidden.get("pp", 0.0)


@dataclass
class Cutoff:
    """The ``keep`` fastest step times so far (0: keep everything, prune nothing)."""

    keep: int
    _heap: list[float] = field(default_factory=list)
    """The negated times, a max-heap of the kept ones."""

    def add(self, seconds: float) -> None:
        if not self.keep:
            return
        if len(self._heap) < self.keep:
            heapq.heappush(self._heap, -seconds)
        elif seconds < -self._heap[0]:
            heapq.heapreplace(self._heap, -seconds)

    @property
    def seconds(self) -> float:
        """A configuration slower than this cannot be among the ``keep`` fastest (inf until that many)."""
        if not self.keep or len(self._heap) < self.keep:
            return float("inf")
        return -self._heap[0]
