"""The held-out set's records (benchmarks/heldout.py, heldout_nemo.py, heldout_bridge.py,
heldout_bridge_more.py, heldout_bridge_gb.py, heldout_bridge_moe.py, heldout_bridge_moe_fp8.py): a run's
configuration as its source states it, and the run itself: where it is stated, how it is typed, what it
measured."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stated:
    """The run's configuration as its source states it (checked against the typed setup in tests)."""

    model: str
    gpus: int
    gpu: str
    seq: int
    micro_batch: int
    global_batch: int
    checkpointing: str = "none"
    tp: int = 1
    cp: int = 1
    pp: int = 1
    vpp: int = 1
    """Virtual stages per pipeline rank (Megatron's interleaved schedule; NeMo's table's VP)."""
    pp_layers: tuple[int, ...] = ()
    """Layers per (virtual) pipeline stage where the run's code placed them itself (``--pp-layers``);
    empty: memplan's placement for the implementation."""
    ep: int = 1
    """Expert-parallel degree (``--ep``; Megatron-Bridge's table's EP, its ranks taken from dp)."""
    zero: int = 3
    reduce_dtype: str | None = "fp32"
    """None: memplan's default for the implementation (the source states none)."""
    compile: bool = False
    compile_loss: bool = True
    """Under ``compile``, the loss compiled too (torchtitan 0.3.0's default); False for the December-2024
    runs: their train.py compiled the blocks only ("TODO: compiling loss function causes CUDA errors,
    turning off for now", the ``torch.compile(loss_fn)`` commented out)."""
    fp8: str = "none"
    fp8_tp: bool = False
    """``--fp8-tp``: torchao's float8 tensor-parallel plan (the 2024 ``apply_tp`` under float8)."""
    async_tp: bool = False
    """``--async-tp``: torchtitan's async tensor parallelism (torch's micro-pipelined TP,
    ``time.async_tp``)."""
    fsdp_wrap: str = "units"
    """``--fsdp-wrap``: ``root`` for the runs of torchtitan's 2024 code typed ``--impl torchtitan`` where it
    is modelled (ZeRO-3 without cp or pp): its parallelize_llama wrapped each block and then the model,
    the root unit holding the embedding, final norm and output (``analytic.fsdp.root``)."""
    attention_kernel: str = "auto"
    norm_kernel: str = "auto"
    """``--norm-kernel``: ``composite`` for torchtitan's runs of 2024–25 (their own RMSNorm of plain ops, on a
    torch before ``aten._fused_rms_norm``'s CUDA kernel), where ``--impl torchtitan``'s nn.RMSNorm would
    otherwise run today's fused kernel."""
    impl: str = "reference"
    optimizer_impl: str = ""
    """``--optimizer-impl`` where the run's code names it; empty: memplan's default for ``impl``."""
    loss: str = "standard"
    """``--loss``: the loss kernel the run's code ran where memplan models it (llm-foundry's flash_attn
    cross-entropy: ``xentropy``; Megatron-Bridge's TE fused cross-entropy: ``te``)."""
    clip_grad: bool = True
    """Gradient-norm clipping at 1.0 (``--clip-grad``): llm-foundry's yamls (``algorithms:
    gradient_clipping: clipping_type: norm, clipping_threshold: 1.0``, mpt-7b.yaml and its siblings),
    torchtitan's ``training.max_norm`` default 1.0 (the 2024 and 2025 trainers alike)."""


@dataclass(frozen=True)
class Run:
    """One published run: where it is stated, how it is typed, what it measured (tokens/s per GPU)."""

    name: str
    source: str
    stated: Stated
    published: float
    typed: str
    note: str = ""


def megatron_layout(
    layout: tuple[int, int, int, int], pp_layers: tuple[int, ...] = (), *, userbuffers: bool = False
) -> list[str]:
    """The layout flags of a Megatron-core row (NeMo's and Megatron-Bridge's tables): ``layout`` their
    (TP, PP, CP, VP); sequence parallelism with TP, TE's point-to-point context-parallel ring
    (``--cp-rotate alltoall``), ``--pp-layers`` where given, ``--tp-comm-overlap`` where the row's
    configuration runs TE's userbuffers."""
    tp, pp, cp, vp = layout
    flags = [f"--tp {tp} --sp"] if tp > 1 else []
    flags += [f"--pp {pp}"] if pp > 1 else []
    flags += [f"--vpp {vp}"] if vp > 1 else []
    flags += ["--pp-layers " + ",".join(map(str, pp_layers))] if pp_layers else []
    flags += [f"--cp {cp} --cp-rotate alltoall"] if cp > 1 else []
    return flags + (["--tp-comm-overlap"] if userbuffers else [])


def megatron_stated(
    model: str,
    gpu: str,
    sizes: tuple[int, int, int, int],
    layout: tuple[int, int, int, int],
    zero: int,
    fp8: str,
    *,
    ep: int = 1,
    loss: str = "standard",
) -> Stated:
    """What a Megatron-core row's table states (NeMo's, Megatron-Bridge's): ``sizes`` its (GPUs, sequence,
    MBS, GBS), ``layout`` its (TP, PP, CP, VP), ``ep`` its EP (mixtures of experts); gradients reduced in
    bf16 (their configs' reading)."""
    gpus, seq, mbs, gbs = sizes
    tp, pp, cp, vp = layout
    return Stated(
        model, gpus, gpu, seq, mbs, gbs, tp=tp, cp=cp, pp=pp, vpp=vp, ep=ep, zero=zero, reduce_dtype="bf16",
        fp8=fp8, impl="megatron", loss=loss,
    )  # fmt: skip
