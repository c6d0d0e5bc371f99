"""Whose code runs the step: memplan's reference model, Hugging Face transformers, torchtitan or
Megatron-core. The same model trained by different code keeps different tensors for backward (a fp32
softmax copy, a per-layer mask, a fused qkv buffer): ``Impl`` names the code, ``ImplConfig`` its switches,
and ``blocks.profile`` turns them into what each block keeps. Which family's code runs (``Family``) is
the model's ``family`` (a Hugging Face ``model_type``).
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from memplan.config._base import Frozen


class Impl(StrEnum):
    """The training code whose saved tensors the estimate follows (``--impl``)."""

    REFERENCE = "reference"
    """memplan's own reference model (``memplan/measure/reference/model.py``), what ``trace`` and ``profile``
    run."""
    HF = "hf"
    """Hugging Face transformers' modeling code of the model's family (``modeling_<model_type>.py``)."""
    TORCHTITAN = "torchtitan"
    """torchtitan's Llama (``torchtitan/models/llama3``): ``nn.RMSNorm``, SDPA, its checkpoint modes."""
    MEGATRON = "megatron"
    """Megatron-core GPT layers with fused kernels, as Korthikanti et al. (2022) count them."""


class Family(StrEnum):
    """A Hugging Face ``model_type``: which ``modeling_*.py`` ``--impl hf`` follows."""

    LLAMA = "llama"
    MISTRAL = "mistral"
    QWEN2 = "qwen2"
    QWEN3 = "qwen3"
    GEMMA = "gemma"
    GEMMA2 = "gemma2"
    GEMMA3 = "gemma3_text"
    PHI3 = "phi3"
    OLMO2 = "olmo2"
    GRANITE = "granite"
    STARCODER2 = "starcoder2"
    COHERE = "cohere"
    STABLELM = "stablelm"
    GLM = "glm"
    FALCON = "falcon"
    GPT2 = "gpt2"
    GPT_NEOX = "gpt_neox"
    MIXTRAL = "mixtral"
    QWEN2_MOE = "qwen2_moe"
    QWEN3_MOE = "qwen3_moe"
    GPT_OSS = "gpt_oss"
    PHIMOE = "phimoe"
    DEEPSEEK_V2 = "deepseek_v2"
    DEEPSEEK_V3 = "deepseek_v3"
    LLAMA4 = "llama4_text"


class ExpertsImpl(StrEnum):
    """transformers' ``experts_implementation`` for a mixture of experts (``--experts``)."""

    GROUPED_MM = "grouped_mm"
    """transformers' default: one grouped GEMM over all T·k slots sorted by expert
    (``integrations/moe.py::grouped_mm_experts_forward``)."""
    EAGER = "eager"
    """the modeling file's loop (``MixtralExperts.forward``): per expert ``torch.where``, its tokens' MLP,
    ``index_add_`` back; its shapes are data, so only real tensors run it."""


class AttentionKernel(StrEnum):
    """The flash kernel that runs ``--attention flash`` (step time only: they keep the same tensors)."""

    AUTO = "auto"
    """FlashAttention-2: what torch's SDPA flash backend and transformers' flash_attention_2 run."""
    FA2 = "fa2"
    """FlashAttention-2 (Dao 2023)."""
    FA3 = "fa3"
    """FlashAttention-3 (Shah et al. 2024), Hopper only."""
    FA1 = "fa1"
    """FlashAttention-1 (Dao et al. 2022): flash-attn 1.x's CUDA kernels and its Triton version
    (``flash_attn_triton``, llm-foundry's ``attn_impl: triton``)."""
    CUDNN = "cudnn"
    """cuDNN's fused attention (torch's SDPA ``CUDNN_ATTENTION`` backend, which torchtitan 0.3.0 puts
    first), Hopper only (its rate measured on an H200)."""


class NormKernel(StrEnum):
    """How torch's ``nn.RMSNorm`` runs (``--impl torchtitan``, whose norm it is; ``Profile.torch_rms_norm``):
    memory and step time."""

    AUTO = "auto"
    """What torch dispatches: on CUDA (torch ≥ 2.8) ``aten._fused_rms_norm``'s kernel, which keeps the input
    and the fp32 rstd and runs as one kernel each way; on CPU its composite."""
    COMPOSITE = "composite"
    """The composite, op by op, on any device: what CUDA ran before torch 2.8 (and what torchtitan's 2024
    code, its own RMSNorm of plain ops, ran): the fp32 upcast and normalised x kept."""


class Fp8Recipe(StrEnum):
    """Float8 training of the layers' linears (``--fp8``): torchao's ``Float8Linear`` (--impl reference,
    torchtitan: tensorwise, rowwise; the casts' temporaries in the peak, blocks/fp8.py) or, under --impl
    megatron, Transformer Engine's recipes as Megatron's ``--fp8-recipe`` names them (tensorwise:
    ``Float8CurrentScaling``, delayed: ``DelayedScaling``; float8 saves, weight caches and the quantizers'
    state, blocks/te_fp8.py); the step time: time/fp8.py."""

    NONE = "none"
    TENSORWISE = "tensorwise"
    """One dynamic scale per tensor (cuBLAS's tensorwise kernel): an amax pass, then the cast."""
    ROWWISE = "rowwise"
    """One dynamic scale per row (CUTLASS's rowwise kernel): the row's amax and cast in one pass."""
    DELAYED = "delayed"
    """Transformer Engine's ``DelayedScaling`` (Megatron's default ``--fp8-recipe``, --impl megatron only):
    one scale per tensor taken from an amax history, the cast records the tensor's amax in the same pass;
    the histories are all-reduced and rolled once per forward and once per backward."""
    MXFP8 = "mxfp8"
    """Transformer Engine's ``MXFP8BlockScaling`` (--impl megatron only; Blackwell: compute capability
    10.x): one E8M0 scale per 32 consecutive elements, computed in the cast; no state."""
    BLOCKWISE = "blockwise"
    """Transformer Engine's ``Float8BlockScaling`` (1×128 and 128×128 blocks, fp32 scales): refused, not
    modelled."""


class FsdpWrap(StrEnum):
    """How ``--impl torchtitan`` wraps the model in FSDP2 units under ZeRO-3 (``--fsdp-wrap``)."""

    UNITS = "units"
    """torchtitan 0.3.0's ``apply_fsdp_to_decoder``: the token embedding, each block and [norm, output] a
    unit each (the last not resharded after forward), the root ``fully_shard(model)`` holding nothing."""
    ROOT = "root"
    """torchtitan's ``parallelize_llama`` of 2024 (the code of its 2024 benchmark tables): each block a
    unit, the last not resharded after forward (``reshard_after_forward = int(layer_id) <
    len(model.layers) - 1``), then ``fully_shard(model)``: the root unit holds the embedding, the final
    norm and the output, and the torch of the time never resharded the root after forward
    (``FSDPState._lazy_init``: "For the root, do not reshard after forward", unconditional before torch's
    ``_auto_reshard_after_forward``). ``analytic.fsdp.root``."""


class ImplConfig(Frozen):
    """The implementation and the switches of its code that change what it keeps."""

    impl: Impl = Impl.REFERENCE
    use_cache: bool = Field(
        default=True,
        description="hf: the forward builds a KV cache (transformers' default in training unless "
        "use_cache=False; off under gradient checkpointing, which turns it off)",
    )
    reentrant: bool = Field(
        default=False,
        description="hf: gradient checkpointing with use_reentrant=True (transformers' default is False)",
    )
    flash_attn: bool = Field(
        default=False,
        description="hf: attn_implementation='flash_attention_2' (the flash-attn package, CUDA only) for "
        "--attention flash, instead of transformers' sdpa",
    )
    attention_kernel: AttentionKernel = Field(
        default=AttentionKernel.AUTO,
        description="the flash kernel's implementation, for the step time (time/attention.py)",
    )
    norm_kernel: NormKernel = Field(
        default=NormKernel.AUTO,
        description="torch's nn.RMSNorm (--impl torchtitan): auto, on CUDA the fused aten._fused_rms_norm "
        "kernel (torch >= 2.8); composite, op by op (blocks.norm.cuda_fused_rms_norm)",
    )
    compile: bool = Field(
        default=False,
        description="torch.compile of each block: Inductor fuses element-wise chains (time/elementwise.py); "
        "the partitioner's saved set (blocks.profiles.compile_modelled)",
    )
    compile_loss: bool = Field(
        default=True,
        description="--impl torchtitan --compile: the loss compiled too (torchtitan 0.3.0's "
        "compile.components default ['model', 'loss']); False: the blocks only, the loss eager (torchtitan's "
        "train.py of late 2024: 'TODO: compiling loss function causes CUDA errors, turning off for now'), "
        "its tensors "
        "counted one by one (blocks.head.loss_tensors_known)",
    )
    fp8: Fp8Recipe = Field(
        default=Fp8Recipe.NONE,
        description="float8 training of the layers' linears (time/fp8.py; memory: torchao's casts "
        "blocks/fp8.py, Megatron's Transformer Engine blocks/te_fp8.py)",
    )
    fp8_amax_history_len: int = Field(
        default=1,
        ge=1,
        le=1 << 20,
        description="--fp8 delayed: rows of each amax history (Megatron's --fp8-amax-history-len, default 1; "
        "TE's own DelayedScaling default 1024): fp32 state per quantizer and the scale update's traffic "
        "(blocks/te_fp8.py)",
    )
    fp8_all_gather: bool = Field(
        default=False,
        description="--impl torchtitan --fp8 tensorwise under FSDP2 (ZeRO-3): torchao's "
        "enable_fsdp_float8_all_gather, each converted linear's weight all-gathered in float8 (1 byte an "
        "element and an fp32 scale) with precompute_float8_dynamic_scale_for_fsdp's amax all-reduce a step "
        "(blocks/fp8.py)",
    )
    fp8_tp: bool = Field(
        default=False,
        description="--impl torchtitan --fp8 tensorwise --tp T --sp: torchao's float8 tensor-parallel plan "
        "(Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput; torchtitan's 2024 "
        "apply_tp under float8): each block's inputs cast on their sequence shard and all-gathered in "
        "float8, the row-parallel outputs' gradients cast before the backward's all-gather "
        "(blocks/fp8_tp.py)",
    )
    overlap_grad_reduce: bool = Field(
        default=False,
        description="megatron: --overlap-grad-reduce (Megatron-LM's default off: its data-parallel gradient "
        "reduction runs after the backward, exposed); torch DDP and FSDP overlap theirs by design",
    )
    overlap_param_gather: bool = Field(
        default=False,
        description="megatron: --overlap-param-gather (default off): the distributed optimizer's parameter "
        "all-gather (ZeRO-1) overlapped with the next forward; needs --overlap-grad-reduce",
    )
    fp8_param_gather: bool = Field(
        default=False,
        description="megatron --fp8 tensorwise|delayed --zero 1: Megatron-LM's --fp8-param-gather, float8 "
        "primary weights (TE's fp8_model_init): the layers' linears keep their float8 copies only, no 16-bit "
        "weight, and the distributed optimizer all-gathers them in float8 (blocks/te_fp8.py)",
    )
    fp8_any_layout: bool = Field(
        default=False,
        description="megatron --fp8 tensorwise|delayed on a GPU whose float8 GEMMs take any operand layout "
        "(GpuPreset.fp8_any_layout: Blackwell): Transformer Engine keeps one float8 copy of a tensor, no "
        "transpose (blocks/te_fp8.py); set from --gpu, not an option",
    )
    tp_comm_overlap: bool = Field(
        default=False,
        description="megatron: --tp-comm-overlap, Transformer Engine's userbuffers overlap of the sequence-"
        "parallel all-gathers and reduce-scatters with the GEMMs they feed or drain (time.tp_overlap); "
        "needs --tp T --sp inside a node",
    )
    async_tp: bool = Field(
        default=False,
        description="torchtitan --compile: --async-tp, torchtitan's enable_async_tensor_parallel (torch's "
        "micro-pipelined tensor parallelism: the sequence-parallel all-gathers and reduce-scatters fused "
        "with the GEMMs they feed or drain through symmetric memory, time.async_tp); needs --tp T --sp "
        "inside a node",
    )
    fsdp_wrap: FsdpWrap = Field(
        default=FsdpWrap.UNITS,
        description="torchtitan under ZeRO-3: FSDP2's units as torchtitan 0.3.0 wraps them (units) or as its "
        "2024 parallelize_llama did (root: the embedding, final norm and output one root unit, never "
        "resharded after forward; the last block kept gathered), analytic.fsdp.root",
    )
    experts: ExpertsImpl = Field(
        default=ExpertsImpl.GROUPED_MM,
        description="hf, mixtures of experts: transformers' experts_implementation (default grouped_mm)",
    )
