"""Every setting of one estimate as the user gives it, declared once: ``Options``.

Field names are the option names (``_`` for ``-``), each with its help text, metavar and help panel;
``cli.common`` derives every command's typer options from them, ``compare --vary`` replaces a field by
name and re-validates, and ``api.setup_of`` turns them into a ``Setup``.
"""

from __future__ import annotations

from memplan.config import (
    AttentionChoice,
    AttentionKernel,
    CpRotate,
    Device,
    ExpertsImpl,
    Fp8Recipe,
    FsdpWrap,
    Impl,
    MethodChoice,
    NormKernel,
    Quant,
    ReduceDtype,
)
from memplan.option_fields import FINETUNE, GPU, PARALLEL, STRATEGY, option, tune
from memplan.options_training import DEFAULT_SEQ as DEFAULT_SEQ
from memplan.options_training import TrainingOptions
from memplan.search.budget import DEFAULT_RESERVE_GIB

DEFAULT_GPU = "h100-sxm"
"""The GPU preset ``--gpu-memory`` takes everything but the memory from when ``--gpu`` is not given."""

LISTS = "(`memplan presets` lists them)"


class Options(TrainingOptions):
    """Every setting of one estimate, declared once: field names are the option names (``_`` for ``-``),
    each with its help text; the CLI, ``compare --vary`` and the setup they build all read them here."""

    checkpointing: str = option(
        "Activation checkpointing: none, full (keep each layer's input), selective (recompute the "
        "attention core), every-K (keep one input per K layers)",
        STRATEGY,
        default="none",
        metavar="none|full|selective|every-K",
    )
    attention: AttentionChoice | None = option(
        "Attention kernel: eager (keeps s×s probabilities) or flash (SDPA flash: q, k, v, out, lse) "
        "[default: flash; eager where the model's code has no flash path memplan models — gemma-2's "
        "softcaps, gpt-oss's sinks, deepseek's MLA on CUDA — a note says so]",
        STRATEGY,
        default=None,
    )
    reversible: bool = option(
        "Reversible (RevNet) layers: backward rebuilds each layer's input from its output",
        STRATEGY,
        default=False,
    )
    zero: int = option(
        "ZeRO stage: 0 none, 1 optimizer states, 2 + gradients, 3 + weights (sharded over --dp)",
        STRATEGY,
        default=0,
        metavar="0-3",
    )
    impl: Impl | None = option(
        "Whose training code the estimate follows: reference (memplan's own model, what trace/profile "
        "run), hf (Hugging Face transformers' modeling code of the model's family), torchtitan (its "
        "Llama), megatron (Megatron-core's fused layers, Korthikanti et al. 2022) [default: reference; hf "
        "for models whose structure only transformers' code has here, e.g. deepseek-v3's MLA, gemma-2's "
        "softcaps, llama-4's chunked attention — a note says so]",
        STRATEGY,
        default=None,
        show_default=False,
    )
    use_cache: bool = option(
        "--impl hf: the forward builds a KV cache (transformers' default in training; gradient "
        "checkpointing turns it off)",
        STRATEGY,
        default=True,
    )
    reentrant: bool = option(
        "--impl hf: gradient checkpointing with use_reentrant=True (transformers' default: False)",
        STRATEGY,
        default=False,
    )
    flash_attn: bool = option(
        "--impl hf --attention flash: transformers' flash_attention_2 (the flash-attn package, CUDA "
        "only: its kernel's [2] int64 RNG state, sliding windows without a mask) instead of its sdpa",
        STRATEGY,
        default=False,
    )
    attention_kernel: AttentionKernel = option(
        "The flash kernel, for the step time: auto (FlashAttention-2, what torch's SDPA flash backend and "
        "flash-attn 2 run), fa2, fa3 (FlashAttention-3, Hopper only), fa1 (FlashAttention-1: "
        "flash-attn 1.x and its Triton version, llm-foundry's attn_impl triton) or cudnn (SDPA's cuDNN "
        "backend: newer torch's own pick on Hopper, torchtitan 0.3.0's first; Hopper only)",
        STRATEGY,
        default=AttentionKernel.AUTO,
    )
    norm_kernel: NormKernel = option(
        "How torch's nn.RMSNorm runs (--impl torchtitan): auto (what torch dispatches: on CUDA the fused "
        "aten._fused_rms_norm kernel of torch >= 2.8, which keeps the input and the fp32 rstd, one kernel "
        "each way) or composite (op by op, the fp32 upcast and normalised x kept: CUDA before torch 2.8, "
        "torchtitan's 2024 RMSNorm)",
        STRATEGY,
        default=NormKernel.AUTO,
    )
    compile: bool = option(
        "torch.compile of each block: Inductor fuses each chain of element-wise ops (norms, SwiGLU, rotary) "
        "into one kernel (step time), and AOTAutograd's partitioner recomputes the fp32 norm upcasts and "
        "silu(g) (memory; --impl reference dense RMSNorm/SwiGLU blocks, else a note; trace --compile)",
        STRATEGY,
        default=False,
    )
    compile_loss: bool = option(
        "--impl torchtitan --compile: compile the loss too, as torchtitan 0.3.0 does (its Inductor buffers "
        "not modelled: the eager loss's bytes); --no-compile-loss: the blocks only, as torchtitan's train.py "
        "of late 2024 ran (fp32 logits, log-probs and gradients each a tensor, blocks/head.py)",
        STRATEGY,
        default=True,
    )
    fsdp_wrap: FsdpWrap = option(
        "--impl torchtitan under --zero 3: FSDP2's units. units: torchtitan 0.3.0's (the embedding, each "
        "block, [norm, output] kept gathered from its forward to its backward); root: its 2024 "
        "parallelize_llama (each block, then a root unit of the embedding, final norm and output held "
        "gathered with its unsharded gradients to the backward's end), e.g. --zero 3 --fsdp-wrap root",
        STRATEGY,
        default=FsdpWrap.UNITS,
    )
    fp8: Fp8Recipe = option(
        "float8 training of the layers' linears: none, tensorwise, rowwise, delayed, mxfp8 or blockwise "
        "scaling (their GEMMs at the GPU's FP8 peak plus the casts' traffic). torchao (--impl reference, "
        "torchtitan: tensorwise, rowwise): the saved activations stay bf16's, the casts' fp32 and float8 "
        "temporaries join the peak at the down projection's backward (trace --fp8, profile --fp8). --impl "
        "megatron: tensorwise and delayed are Megatron's --fp8-recipe (Transformer Engine "
        "Float8CurrentScaling, DelayedScaling): float8 saved linear inputs, cached float8 weights and "
        "transposes and the quantizers' state (delayed: amax histories, all-reduced over tp × dp × cp each "
        "forward and backward) in weights (blocks/te_fp8.py); mxfp8 is MXFP8BlockScaling (E8M0 scales per "
        "32 elements; Blackwell GPUs only); blockwise and TE's rowwise are refused. --impl hf: refused",
        STRATEGY,
        default=Fp8Recipe.NONE,
    )
    fp8_amax_history_len: int = option(
        "--fp8 delayed (--impl megatron): Megatron's --fp8-amax-history-len (default 1; TE's own 1024), rows "
        "of each quantizer's amax history: 4 B a row, 5 quantizers a linear (blocks/te_fp8.py)",
        STRATEGY,
        default=1,
        metavar="ROWS",
        ge=1,
        le=1 << 20,
    )
    fp8_all_gather: bool = option(
        "--impl torchtitan --fp8 tensorwise under FSDP2 (--zero 3, dp > 1): torchtitan's float8.enable_fsdp_"
        "float8_all_gather: each converted linear's weight all-gathered in float8 (1 byte an element, fp32 "
        "scale kept per weight), one all-reduce of the weights' amaxes a step (blocks/fp8.py)",
        STRATEGY,
        default=False,
    )
    fp8_tp: bool = option(
        "--impl torchtitan --fp8 tensorwise --tp T --sp: torchao's float8 tensor-parallel plan (torchtitan's "
        "2024 apply_tp under float8): inputs cast on their sequence shard and all-gathered in float8, the "
        "row-parallel outputs' gradients cast before their all-gather (blocks/fp8_tp.py). Default: "
        "torchtitan 0.3.0's plan, which gathers bf16 and casts the gathered tensor",
        STRATEGY,
        default=False,
    )
    overlap_grad_reduce: bool = option(
        "--impl megatron: Megatron-LM's --overlap-grad-reduce, its data-parallel gradient reduction "
        "overlapped with the backward bucket by bucket (Megatron-LM's default is off: the reduction runs "
        "after the backward, exposed)",
        STRATEGY,
        default=False,
    )
    overlap_param_gather: bool = option(
        "--impl megatron --overlap-grad-reduce: Megatron-LM's --overlap-param-gather, the distributed "
        "optimizer's (--zero 1) parameter all-gather overlapped with the next forward (default off: "
        "gathered after the step, exposed)",
        STRATEGY,
        default=False,
    )
    fp8_param_gather: bool = option(
        "--impl megatron --fp8 tensorwise|delayed --zero 1|3, mxfp8 --zero 1: Megatron-LM's "
        "--fp8-param-gather (mxfp8: with --reuse-grad-buf-for-mxfp8-param-ag): no 16-bit linears (te_fp8.py)",
        STRATEGY,
        default=False,
    )
    tp_comm_overlap: bool = option(
        "--impl megatron --tp T --sp: Megatron-LM's --tp-comm-overlap (TE's userbuffers): the sequence-"
        "parallel collectives run in chunks under the GEMMs they feed or drain (default off: exposed)",
        STRATEGY,
        default=False,
    )
    async_tp: bool = option(
        "--impl torchtitan --compile --tp T --sp: torchtitan's async tensor parallelism (torch's "
        "micro-pipelined TP through symmetric memory): the sequence-parallel collectives run in chunks "
        "under the GEMMs they feed or drain (default off: exposed)",
        STRATEGY,
        default=False,
    )
    experts: ExpertsImpl = option(
        "--impl hf, mixtures of experts: transformers' experts_implementation, grouped_mm (its default: "
        "one grouped GEMM over the T·k slots) or eager (a loop over the experts: index_add_ keeps the "
        "weighted [T·k, h] product); both keep bytes independent of the routing",
        STRATEGY,
        default=ExpertsImpl.GROUPED_MM,
    )
    device: Device = option(
        "Kernels the step runs on (a few saved tensors differ between cuda and cpu)",
        STRATEGY,
        default=Device.CUDA,
    )
    offload: str = option(
        "Host offload: none, or any of optimizer (ZeRO-Offload: master weights, optimizer states and "
        "gradients on the host, the step on the CPU), params (16-bit weights on the host, needs --zero 3), "
        "activations (torch's save_on_cpu), comma-separated",
        STRATEGY,
        default="none",
        metavar="none|optimizer,params,activations",
    )
    loss: str = option(
        "Loss: standard (fp32 log-probs [T, v] kept), chunked:N (torchtune: per chunk), xentropy (flash_attn"
        "'s fused cross-entropy: the logits kept), te (Megatron's TE fused cross-entropy: logits kept, the "
        "gradient written over them), fused (Liger's fused linear cross-entropy: no [T, v] tensor kept)",
        STRATEGY,
        default="standard",
        metavar="standard|chunked:N|xentropy|te|fused",
    )
    tp: int = option("Tensor-parallel degree t", PARALLEL, default=1, metavar="N", gt=0)
    sp: bool = option("Sequence parallelism over the tensor-parallel ranks", PARALLEL, default=False)
    pp: int = option("Pipeline stages p (1F1B)", PARALLEL, default=1, metavar="N", gt=0)
    pp_layers: str | None = option(
        "Layers of each pipeline stage, first to last, e.g. 7,8,8,…,8,7; with --vpp M one per virtual stage "
        "(pp·M, model order; 0 for a chunk of the embedding or head alone) [default: ⌈L/pp⌉ each, the first "
        "and last stages one fewer in turn when pp does not divide the layers]",
        PARALLEL,
        metavar="N,N,…",
        show_default=False,
    )
    vpp: int = option(
        "Virtual stages per pipeline rank (interleaved 1F1B)", PARALLEL, default=1, metavar="M", gt=0
    )
    ep: int = option("Expert-parallel degree (MoE; ranks from dp)", PARALLEL, default=1, metavar="N", gt=0)
    etp: int | None = option(
        "Expert tensor-parallel degree, a divisor of --tp (Megatron-core's --expert-tensor-parallel-size) "
        "[default: --tp]: below --tp is MoE parallel folding under --impl megatron, each rank dispatching "
        "its own s/t tokens to experts split over etp ranks (1: whole experts), --ep ranks drawn from tp/etp "
        "× dp, e.g. --tp 2 --sp --ep 32 --etp 1",
        PARALLEL,
        metavar="N",
        gt=0,
        show_default=False,
    )
    cp: int = option(
        "Context-parallel degree c: ring attention (torch's as torchtitan; TE's under --impl megatron), each "
        "rank holds s/c tokens and exchanges K/V, e.g. --cp 4 --seq 131072; needs flash, s a multiple of 2·c",
        PARALLEL,
        default=1,
        metavar="N",
        gt=0,
    )
    cp_rotate: CpRotate | None = option(
        "--cp: how K/V reach each rank. torch's ring attention (set_rotate_method): allgather (one all-"
        "gather, waited for after the first block; torch's default) or alltoall (a rotation to the next "
        "rank per block, each under the block before); or kv-gather: no ring, K/V all-gathered then one "
        "attention call per local chunk, dK/dV reduce-scattered, both exposed (Llama 3's context "
        "parallelism; Transformer Engine's cp_comm_type all_gather, Megatron-LM's --cp-comm-type "
        "all_gather). Example: --cp 16 --cp-rotate kv-gather [default: alltoall under --impl megatron, "
        "Transformer Engine's point-to-point ring (Megatron-LM's --cp-comm-type p2p); else allgather]",
        PARALLEL,
        show_default=False,
    )
    cp_rank: int | None = option(
        "--cp: the context-parallel rank estimated, 0 … c−1 (its ring blocks differ; the last rank keeps "
        "its merged output in the kernel's layout, one [b, s/c, a·d] less a layer) [default: the most "
        "loaded]. Example: --cp 4 --cp-rank 3",
        PARALLEL,
        default=None,
        metavar="R",
        ge=0,
        show_default=False,
    )
    dp: int | None = option(
        "Data-parallel degree [default: --gpus / (tp·cp·pp), else 1]",
        PARALLEL,
        metavar="N",
        show_default=False,
        gt=0,
    )
    hsdp: int | None = option(
        "Hybrid sharding (HSDP): shard the model states (--zero 1-3) inside groups of R data-parallel ranks, "
        "the innermost of dp, and all-reduce the gradient shards across the dp/R groups, e.g. --hsdp 8 "
        "[default: shard over all of dp]",
        PARALLEL,
        metavar="R",
        show_default=False,
        gt=0,
    )
    reduce_dtype: ReduceDtype | None = option(
        "dtype of the data-parallel gradient reduction (FSDP2's MixedPrecisionPolicy.reduce_dtype; "
        "torchtitan's default fp32; under --impl megatron its main_grad buffer's, where gradients "
        "accumulate: fp32 is --accumulate-allreduce-grads-in-fp32, bf16 --grad-reduce-in-bf16) [default: "
        "the gradients' dtype; fp32 under torchtitan's FSDP2 and under megatron with bf16]",
        STRATEGY,
        show_default=False,
    )
    gpus: int | None = option(
        "Devices in all: tp · cp · pp · dp", PARALLEL, metavar="N", show_default=False, gt=0
    )
    global_batch: int | None = option(
        "Sequences per optimizer step; micro-batches per step = B / (batch · dp)",
        PARALLEL,
        metavar="B",
        show_default=False,
        gt=0,
    )
    grad_accum: int | None = option(
        "Micro-batches per step (the pipeline's, or gradient accumulation) [default: 1]",
        PARALLEL,
        metavar="N",
        show_default=False,
    )
    gpu: str | None = option(
        "GPU preset name (`memplan gpus` lists them) or a GPU preset .toml file with the fields of "
        "presets/gpus/*.toml (memory_bytes, peak_tflops, bandwidths, [topology]): marks fit / not fit, "
        "gives the time",
        GPU,
        metavar="NAME|FILE",
        show_default=False,
    )
    gpu_memory: float | None = option(
        "A custom GPU's memory in GiB (2³⁰ bytes), e.g. 48: judged against this much memory, with the "
        f"rest (FLOP/s, bandwidths, topology) from --gpu, else {DEFAULT_GPU}",
        GPU,
        metavar="GiB",
        show_default=False,
    )
    mfu: float | None = option(
        "Assumed model FLOPs utilisation for the step time [default: predicted from the kernels, the "
        "communication on the topology and the bubble]",
        GPU,
        metavar="F",
        show_default=False,
    )
    step_time: float | None = option(
        "Measured seconds per step: gives the achieved MFU and HFU instead",
        GPU,
        metavar="S",
        show_default=False,
    )
    tokens: float | None = option(
        "Training tokens (e.g. 300e9): gives the training days", GPU, metavar="T", show_default=False
    )
    gpus_per_node: int | None = option(
        "GPUs per node: tensor-parallel and other groups inside it use the intra-node link [default: the "
        "GPU preset's topology]",
        GPU,
        metavar="N",
        show_default=False,
    )
    intra_node_bw: float | None = option(
        "Bandwidth per GPU and direction inside a node, GB/s (NVLink, Infinity Fabric, PCIe) [default: "
        "the GPU preset's]",
        GPU,
        metavar="GB/s",
        show_default=False,
    )
    inter_node_bw: float | None = option(
        "Bandwidth per GPU and direction between nodes, GB/s (InfiniBand/RoCE NICs) [default: the GPU "
        "preset's]",
        GPU,
        metavar="GB/s",
        show_default=False,
    )
    host_memory: float | None = option(
        "GiB of host memory per node: do the offloaded tensors fit [default: the GPU preset's node's]",
        GPU,
        metavar="GiB",
        show_default=False,
    )
    finetune: MethodChoice = option(
        "What trains: full (every parameter), lora (low-rank adapters on a frozen base, peft's LoRA) or "
        "qlora (LoRA on a 4-bit bitsandbytes base), e.g. --finetune lora --lora-rank 16",
        FINETUNE,
        default=MethodChoice.FULL,
    )
    lora_rank: int | None = tune("LoRA rank r (A is r × in, B out × r) [default: 8]", "R")
    lora_alpha: float | None = tune("LoRA α: B·A is scaled by α/r (no memory effect) [default: 16]", "ALPHA")
    lora_dropout: float | None = tune(
        "Dropout 0 ≤ P < 1 on each adapter's input (keeps its bool mask and the dropped input) [default: 0]",
        "P",
    )
    lora_targets: str | None = tune(
        "Linears with adapters: some of q,k,v,o,gate,up,down (GELU: up = fc1, down = fc2) or all-linear, "
        "e.g. q,v (q+v in compare --vary) [default: q,v, as peft for Llama]",
        "q,k,v,o,gate,up,down|all-linear",
    )
    freeze: str | None = tune(
        "Parts that do not train: embeddings, lm_head, layers:A-B (from 0), e.g. embeddings,layers:0-15; "
        "with lora|qlora only layers:A-B (no adapters there)",
        "PARTS",
    )
    quant: Quant | None = tune("QLoRA's 4-bit type (bitsandbytes): nf4 or fp4, absmax per 64 [default: nf4]")
    double_quant: bool = option(
        "QLoRA double quantisation: absmax in uint8 + fp32 per 256 (0.5 → 0.127 bits/weight)",
        FINETUNE,
        default=False,
    )
    reserve: float = option(
        "GiB of each GPU's memory kept back for what memplan does not model (NCCL's tree/NVLS buffers): the "
        "caching allocator's reserved peak must fit the driver's memory less the CUDA context, the "
        "modelled communication buffers and this",
        GPU,
        default=DEFAULT_RESERVE_GIB,
        metavar="GiB",
    )
    expandable_segments: bool = option(
        "replay the step through the caching allocator with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "
        "(one growing segment per pool; torchtitan's launch script sets it)",
        GPU,
        default=False,
    )
