"""Which setups each implementation's code models (``--impl hf|torchtitan|megatron``; ``Setup``'s
validator, ``config.setup.check_setup``): what each framework's profile covers, torchtitan's Llama and its
parallelisms (its pipeline placement: ``titan_stage_layers``), float8 recipes, torch.compile's loss.
transformers' structures and families, and the implementation and attention a model defaults to, are
``config.hf_rules``'. One-line ``ValueError``s naming the field and the fix."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memplan.config.hf_rules import check_family_layout, check_qk_norm, hf_only_code
from memplan.config.impl import ExpertsImpl, Fp8Recipe, FsdpWrap, Impl
from memplan.config.megatron_rules import (
    check_fp8_experts,
    check_fp8_param_gather,
    check_overlap_grad_reduce,
    check_tp_comm_overlap,
)
from memplan.config.model import MlpType, ModelConfig, NormType, PositionType
from memplan.config.offload import LossKind, Offload
from memplan.config.strategy import Attention, Checkpointing, Device, ZeroStage

if TYPE_CHECKING:
    from memplan.config.setup import Setup


def titan_stage_layers(layers: int, pp: int, first_less: int = 1, last_less: int = 1) -> tuple[int, ...]:
    """Layers on each pipeline stage as torchtitan 0.3.0 places them by default
    (``distributed/pipeline_parallel.py`` ``_generate_llm_fqn_per_model_part``, with ``ParallelismConfig``'s
    ``pipeline_parallel_first_stage_less_layers`` = ``last_stage_less_layers`` = 1): the embedding and the
    head each weigh one layer; the L + 2 "effective layers" are cut into p stages of ⌊(L + 2)/p⌋, the first
    (L + 2) mod p one more; the first and the last stage hold their share less that weight. Llama 3 405B
    (126 layers, pp 16): 128/16 = 8 each, so 7, 8 × 14, 7 — memplan's own placement; 16 layers over 4
    stages: 18 = 4·4 + 2, so 4, 5, 4, 3 (memplan's: 4 each)."""
    per, extra = divmod(layers + first_less + last_less, pp)
    counts = [per + (1 if i < extra else 0) for i in range(pp)]
    counts[0] -= first_less
    counts[-1] -= last_less
    return tuple(counts)


def titan_unmapped(m: ModelConfig) -> dict[str, bool]:
    """What torchtitan's Llama 3 (``torchtitan/models/llama3``) cannot be, by the field to change."""
    return {
        "mlp (torchtitan's Llama has a SwiGLU FeedForward; use mlp = swiglu)": m.mlp is not MlpType.SWIGLU,
        "norm (torchtitan's Llama has RMSNorm; use norm = rmsnorm)": m.norm is not NormType.RMSNORM,
        "position (torchtitan's Llama has RoPE; use position = rope)": m.position is not PositionType.ROPE,
        "qkv_bias / out_bias / mlp_bias (torchtitan's Llama has no biases; set them false)": m.qkv_bias
        or m.out_bias
        or m.mlp_bias,
        "dropout (torchtitan's Llama has none; set attn/resid/embd_dropout 0)": bool(
            m.attn_dropout or m.resid_dropout or m.embd_dropout
        ),
        "moe (torchtitan's Llama 3 is dense; drop moe)": m.moe is not None,
    }


def check_impl(setup: Setup) -> None:
    """A framework profile covers what that framework's own code does on one replica; one-line errors."""
    impl, s, par = setup.impl.impl, setup.strategy, setup.parallel
    if impl is Impl.MEGATRON:
        # Megatron-core runs every layout memplan models, on CUDA only (its fused kernels are CUDA's).
        if setup.device is not Device.CUDA:
            raise ValueError(
                "device: --impl megatron follows Megatron-core's CUDA kernels; use --device cuda"
            )
        if not setup.finetune.trains_everything:
            raise ValueError(
                "finetune: --impl megatron with LoRA, QLoRA or frozen parts is not modelled; use --impl "
                "reference or train every weight"
            )
        return
    if impl is Impl.HF:
        check_qk_norm(setup.model)
        check_family_layout(setup.model)
    if impl is Impl.TORCHTITAN:
        for name, used in titan_unmapped(setup.model).items():
            if used:
                raise ValueError(f"model: --impl torchtitan cannot map {name}")
        if s.attention is Attention.EAGER:
            raise ValueError(
                "attention: --impl torchtitan runs SDPA (torchtitan has no eager attention); "
                "use --attention flash"
            )
        if s.zero is ZeroStage.OPTIMIZER and s.dp > 1:
            raise ValueError(
                "zero: torchtitan shards over dp with FSDP2 only (ZeRO-2 reshard_after_forward=False, "
                "ZeRO-3 True) and has no ZeRO-1; use --zero 0, 2 or 3"
            )
        d = setup.model.dim
        if s.checkpointing is Checkpointing.SELECTIVE and setup.device is Device.CUDA and (d > 128 or d % 8):
            # On CUDA SelectiveAC caches the SDPA op's outputs: cuDNN's where can_use_cudnn_attention holds
            # (strategies.checkpointing.sdpa_cache_rules); above head dim 128 torch's pick depends on the
            # GPU and the cuDNN version (sdp_utils.cpp check_cudnn_tensor_shapes).
            raise ValueError(
                f"checkpointing: torchtitan's SelectiveAC on CUDA is modelled with cuDNN attention (head dim "
                f"<= 128, a multiple of 8), not head dim {d}; use --device cpu or --checkpointing full"
            )
        if par.pp > 1:
            check_titan_pipeline(setup)
        if (
            setup.model.tied_embeddings
            and par.tp > 1
            and s.zero >= ZeroStage.GRADIENTS
            and setup.state_shards > 1
        ):
            # torchtitan 0.3.0's tensor-parallel plan distributes tok_embeddings' and lm_head's weight each
            # as a DTensor parameter of its own before fully_shard wraps [tok_embeddings, norm, lm_head], so
            # the unit holds both; Decoder.init_states' re-tie is undone at the unit's first all-gather
            # (FSDPParam._setattr_on_modules sets each module's own). Traced on the rank: tp 2 holds two
            # [v/t, h] in the unit, tp 1 one (FSDP2's shared_modules).
            raise ValueError(
                "tp: torchtitan's tensor-parallel plan gives a tied embedding and lm head a parameter each "
                "before FSDP2 wraps them (its re-tie after init is undone at the first all-gather), so the "
                "model does not train tied; not modelled: set tied_embeddings false, --tp 1 or --zero 0"
            )
    unmodelled = {
        # torchtitan's TP/SP plan is modelled (blocks/torchtitan.py; measure/distributed/titan.py).
        "--tp/--sp": impl is not Impl.TORCHTITAN and par.tp > 1,
        "--pp": par.pp > 1 and impl is not Impl.TORCHTITAN,
        # torchtitan's context parallel runs torch's ring (measure/frameworks/titan.py,
        # tests/measure/test_titan_context.py).
        "--cp": par.cp > 1 and impl is not Impl.TORCHTITAN,
        "--reversible": s.reversible,
        # torchtitan's SelectiveAC (per op) is modelled (strategies.checkpointing.titan_sac_keeps).
        "--checkpointing selective": impl is not Impl.TORCHTITAN
        and s.checkpointing is Checkpointing.SELECTIVE,
        # torchtitan 0.3.0's FullAC checkpoints every block; its SelectiveAC is per op, not every K.
        "--checkpointing every-K": impl is Impl.TORCHTITAN and s.checkpointing is Checkpointing.EVERY_K,
        # LoRA's saves along the gradient flow (strategies/lora.py) are not checked against torchtitan.
        "--finetune or --freeze": impl is Impl.TORCHTITAN and not setup.finetune.trains_everything,
        "--offload": setup.offload is not Offload.NONE,
        "--loss chunked or fused": setup.loss is not LossKind.STANDARD,
    }
    only = hf_only_code(setup.model)  # then no other --impl runs the model: only dropping the setting helps
    for name, used in unmodelled.items():
        if used and only:
            raise ValueError(
                f"impl: --impl {impl.value} with {name} is not modelled (and {only}); drop that setting"
            )
        if used:
            raise ValueError(
                f"impl: --impl {impl.value} with {name} is not modelled; use --impl reference (memplan's "
                "reference model) or --impl megatron, or drop that setting"
            )


def check_fp8_all_gather(setup: Setup) -> None:
    """``--fp8-all-gather`` where it is modelled and traced: torchtitan's tensorwise ``Float8Linear`` under
    its FSDP2 ZeRO-3 over dp > 1 ranks, without tp, pp, cp (torchao's ``enable_fsdp_float8_all_gather``
    is tensorwise only: ``Float8LinearConfig.__post_init__``)."""
    if not setup.impl.fp8_all_gather:
        return
    s, par = setup.strategy, setup.parallel
    if setup.impl.impl is not Impl.TORCHTITAN or setup.impl.fp8 is not Fp8Recipe.TENSORWISE:
        raise ValueError(
            "fp8_all_gather: FSDP2's float8 all-gather is modelled for torchtitan's tensorwise float8 only "
            "(torchao allows no other recipe); add --impl torchtitan --fp8 tensorwise or drop "
            "--fp8-all-gather"
        )
    if s.zero < ZeroStage.PARAMETERS or s.dp < 2 or s.shard_group != s.dp:
        raise ValueError(
            "fp8_all_gather: the float8 all-gather is FSDP2's (weights gathered per unit); use --zero 3 with "
            "--dp 2 or more (no --hsdp), or drop --fp8-all-gather"
        )
    if par.tp > 1 or par.pp > 1 or par.cp > 1:
        raise ValueError(
            "fp8_all_gather: the float8 all-gather with --tp, --pp or --cp is not modelled; drop them or "
            "--fp8-all-gather"
        )


def check_fp8_tp(setup: Setup) -> None:
    """``--fp8-tp`` where it is modelled and traced: torchao's float8 tensor-parallel styles over torchtitan's
    tensorwise ``Float8Linear`` blocks with sequence parallelism (torchao's styles assume dynamic tensorwise
    scaling: ``_float8_linear_supports_float8_allgather``), on pipeline stages and with cp too (traced)."""
    if not setup.impl.fp8_tp:
        return
    par, impl = setup.parallel, setup.impl
    full = setup.strategy.checkpointing is Checkpointing.FULL
    why = (
        "it needs --impl torchtitan --fp8 tensorwise (torchao's float8 styles are tensorwise only)"
        if impl.impl is not Impl.TORCHTITAN or impl.fp8 is not Fp8Recipe.TENSORWISE
        else "it needs --tp 2 or more with --sp" if par.tp < 2 or not par.sp
        else f"torchao's float8 styles take converted linears only, and torchtitan converts none whose width "
        f"is not a multiple of 16 ({setup.model.name}: {odd})" if (odd := unconverted(setup))
        else "it is modelled with --compile under --checkpointing full only (a compiled block's saves under "
        "the float8 plan are not traced)" if impl.compile and not full
        else ""
    )  # fmt: skip
    if why:
        raise ValueError(f"fp8_tp: torchao's float8 tensor-parallel plan: {why}; or drop --fp8-tp")


def unconverted(setup: Setup) -> str:
    """The widths of a Llama block's linears that torchtitan's float8 converter skips (``module_filter_fn``:
    in or out features not a multiple of 16; ``blocks.fp8.titan_linear_shapes``), named; empty if none."""
    m = setup.model
    widths = {
        "hidden": m.hidden_size,
        "q·k·v": (m.num_heads + 2 * m.kv_heads) * m.dim,
        "heads·d": m.num_heads * m.dim,
        "ffn": m.ffn,
    }
    return ", ".join(f"{k} {v}" for k, v in widths.items() if v % 16)


def check_compile_loss(setup: Setup) -> None:
    """``--no-compile-loss`` only where the loss would be compiled: torchtitan under ``--compile``."""
    if not setup.impl.compile_loss and not (setup.impl.impl is Impl.TORCHTITAN and setup.impl.compile):
        raise ValueError(
            "compile_loss: --no-compile-loss says torchtitan's --compile leaves the loss eager; it needs "
            "--impl torchtitan --compile (drop --no-compile-loss)"
        )


def check_experts(setup: Setup) -> None:
    """``--experts eager`` where it is read: transformers' ``experts_implementation`` (``blocks.hf.moe``), a
    mixture of experts under ``--impl hf``; elsewhere it would change nothing, so one line says so."""
    if setup.impl.experts is ExpertsImpl.GROUPED_MM:
        return
    if setup.impl.impl is not Impl.HF or setup.model.moe is None:
        raise ValueError(
            f"experts: --experts {setup.impl.experts.value} is transformers' experts_implementation, read "
            "for a mixture of experts under --impl hf; drop it"
        )


def check_fsdp_wrap(setup: Setup) -> None:
    """``--fsdp-wrap root`` (torchtitan's 2024 wrapping, ``analytic.fsdp.root``) where it is modelled: one
    line naming what is not."""
    if setup.impl.fsdp_wrap is FsdpWrap.UNITS:
        return
    s, par, m = setup.strategy, setup.parallel, setup.model
    why = (
        "it needs --impl torchtitan" if setup.impl.impl is not Impl.TORCHTITAN
        else "it needs --zero 3 over more than one data-parallel rank" if s.zero < ZeroStage.PARAMETERS
        or s.shard_group == 1
        else "it is modelled without --cp, --pp and --hsdp" if par.cp > 1 or par.pp > 1 or s.hsdp
        else "it is modelled without parameter offload" if Offload.PARAMS in setup.offload
        else "it is modelled for full training" if not setup.finetune.trains_everything
        else f"it is modelled with an untied output ({m.name} ties it to the embedding)"
        if m.tied_embeddings
        else ""
    )  # fmt: skip
    if why:
        raise ValueError(
            f"fsdp_wrap: --fsdp-wrap root (torchtitan's 2024 FSDP2 wrapping): {why}; drop --fsdp-wrap root"
        )


def check_async_tp(setup: Setup) -> None:
    """``--async-tp`` (torchtitan's ``enable_async_tensor_parallel``, ``time.async_tp``) where it runs and is
    modelled: torchtitan's dense Llama on CUDA (symmetric memory is CUDA's), its blocks compiled (Inductor's
    ``micro_pipeline_tp`` pass makes the fused ops: torchtitan refuses async TP without compile), tensor
    parallelism with its sequence-parallel plan (the fused collectives are the SP all-gathers and
    reduce-scatters); that the tp group sits inside one node is the GPU's to say (``time.async_tp``)."""
    if not setup.impl.async_tp:
        return
    par = setup.parallel
    why = (
        "it is torchtitan's (torch's micro-pipelined TP), under --impl torchtitan"
        if setup.impl.impl is not Impl.TORCHTITAN
        else "Inductor's micro-pipeline pass makes its fused ops: add --compile" if not setup.impl.compile
        else "it fuses the sequence-parallel collectives: it needs --tp T --sp with T > 1"
        if par.tp == 1 or not par.sp
        else "symmetric memory is CUDA's: use --device cuda" if setup.device is not Device.CUDA
        else ""
    )  # fmt: skip
    if why:
        raise ValueError(f"async_tp: --async-tp (torchtitan's async tensor parallelism): {why}; or drop it")


def check_fp8(setup: Setup) -> None:
    """``--fp8`` where its float8 code is not modelled: one-line errors (no --fp8 passes unmodelled).
    torchao's Float8Linear: --impl reference, torchtitan (blocks/fp8.py); Transformer Engine under
    Megatron: tensorwise, delayed and mxfp8 (blocks/te_fp8.py), a mixture of experts as
    ``config.megatron_rules.check_fp8_experts`` says."""
    fp8, impl, m = setup.impl.fp8, setup.impl.impl, setup.model
    if setup.impl.fp8_amax_history_len != 1 and not (impl is Impl.MEGATRON and fp8 is Fp8Recipe.DELAYED):
        raise ValueError(
            "fp8_amax_history_len: the amax history is Transformer Engine's delayed scaling; add --impl "
            "megatron --fp8 delayed or drop --fp8-amax-history-len"
        )
    check_fp8_all_gather(setup)
    check_fp8_tp(setup)
    check_overlap_grad_reduce(setup)
    check_tp_comm_overlap(setup)
    check_async_tp(setup)
    check_fp8_param_gather(setup)
    if fp8 is Fp8Recipe.NONE:
        return
    only = hf_only_code(setup.model)
    if impl is Impl.HF and only:
        raise ValueError(
            "fp8: --impl hf runs transformers' bf16 linears (no float8 conversion of them is modelled), and "
            f"{only}; drop --fp8"
        )
    if impl is Impl.HF:
        raise ValueError(
            "fp8: --impl hf runs transformers' bf16 linears (no float8 conversion of them is modelled); use "
            "--impl reference or torchtitan (torchao Float8Linear) or megatron (Transformer Engine)"
        )
    if impl is not Impl.MEGATRON and fp8 is Fp8Recipe.DELAYED:
        # pytorch/ao#1753 deleted delayed scaling from torchao.float8 after v0.9.0 (deprecated in #1680):
        # Float8LinearConfig scales dynamically only.
        raise ValueError(
            f"fp8: --impl {impl.value} runs torchao's Float8Linear, which has no delayed scaling since "
            "torchao 0.10; use --fp8 tensorwise or rowwise, or --impl megatron (Transformer Engine)"
        )
    if impl is not Impl.MEGATRON and fp8 in (Fp8Recipe.MXFP8, Fp8Recipe.BLOCKWISE):
        # torchao's Float8LinearConfig recipes: tensorwise, rowwise, rowwise_with_gw_hp; MX formats are
        # torchao.prototype.mx_formats, not Float8Linear.
        raise ValueError(
            f"fp8: --fp8 {fp8.value} is a Transformer Engine recipe (torchao's Float8Linear has tensorwise "
            "and rowwise only); use --impl megatron, or --fp8 tensorwise or rowwise"
        )
    if impl is not Impl.MEGATRON:
        return
    if fp8 is Fp8Recipe.BLOCKWISE:
        raise ValueError(
            "fp8: --impl megatron --fp8 blockwise (Transformer Engine Float8BlockScaling: 1×128 and 128×128 "
            "blocks, fp32 scales) is not modelled; use --fp8 tensorwise, delayed or mxfp8"
        )
    if fp8 is Fp8Recipe.ROWWISE:
        # Megatron-LM arguments.py: --fp8-recipe choices delayed, tensorwise, mxfp8, blockwise.
        raise ValueError(
            "fp8: Transformer Engine has no rowwise recipe (Megatron's --fp8-recipe: delayed, tensorwise, "
            "mxfp8, blockwise); use --fp8 tensorwise (Float8CurrentScaling) or delayed (DelayedScaling) "
            "with --impl megatron"
        )
    if m.mla is not None:
        raise ValueError(
            "fp8: --impl megatron --fp8 with MLA is not modelled (Transformer Engine's layers with standard "
            "attention only); drop --fp8 or use a model without MLA"
        )
    check_fp8_experts(setup)


def check_titan_pipeline(setup: Setup) -> None:
    """``--impl torchtitan --pp``: its default ``Schedule1F1B`` (``--vpp``: ``Interleaved1F1B``) on pipeline
    ranks, each stage tensor-parallel (``--tp``/``--sp``: torchtitan's plan per model part) and FSDP2-sharded
    over dp under --zero 2/3 (``apply_fsdp_to_decoder`` per model part, ``pp_enabled``), its ``FullAC`` or
    ``SelectiveAC`` per block (a fresh policy and cache per block call: ``measure.distributed.titan_sac``),
    ``--fp8 rowwise`` (torchao's ``Float8Linear`` per model part: the stage keeps bf16's saves),
    ``--compile`` (each block through the partitioner: ``measure.distributed.titan_compiled``; under
    ``FullAC`` at any tp and cp and with float8, the block's input alone), ``--cp``
    (torch's ring over the mesh's cp group, the positions to every stage, with or without tp:
    ``titan_pp_cp``); one-line errors for what is not modelled with it."""
    par = setup.parallel
    if par.vpp > 1:
        check_titan_interleaved(setup)
    # torch.compile's saved set is measured where blocks.profiles.compile_modelled says (any tp, no
    # SelectiveAC, no float8: titan_compiled.compiled_blocks traces a tensor-parallel stage's DTensor
    # block) and, without pp, for SelectiveAC (compiled_sac: dynamo's selective-checkpoint op, which the
    # stages' partitioned blocks do not run); under FullAC a block keeps its input alone, compiled or not
    # (measure.runs.compiled's NB; float8 too, blocks.profiles.compile_note; the stages run the eager FullAC
    # blocks, titan_vpp), at any tp and cp
    full = setup.strategy.checkpointing is Checkpointing.FULL
    with_compile = {
        "--cp": par.cp > 1 and not full,
        "--checkpointing selective": setup.strategy.checkpointing is Checkpointing.SELECTIVE,
        "--fp8": setup.impl.fp8 is not Fp8Recipe.NONE and not full,
    }
    for name, used in with_compile.items():
        if setup.impl.compile and used:
            but = " (with --checkpointing full it is)" if name != "--checkpointing selective" else ""
            raise ValueError(
                f"compile: --impl torchtitan --pp --compile with {name} is not modelled (torch.compile's "
                f"saved set is measured in pipeline stages at cp 1, without SelectiveAC or float8{but}); "
                f"drop --compile or {name}"
            )
    if setup.model.tied_embeddings:
        # torchtitan 0.3.0 models/common/decoder.py update_from_config: NotImplementedError("Weight tying is
        # not supported with Pipeline Parallel.")
        raise ValueError(
            "pp: torchtitan refuses tied embeddings with pipeline parallelism; set tied_embeddings false "
            "or drop --pp"
        )


def check_titan_interleaved(setup: Setup) -> None:
    """``--impl torchtitan --pp P --vpp M``: torch's ``ScheduleInterleaved1F1B`` over the p·M virtual stages
    torchtitan's ``_get_pipeline_metadata`` makes — 2 per rank by default, otherwise
    ⌈(L + 2)/pipeline_parallel_layers_per_stage⌉, which must reach p·M — with n micro-batches a multiple of
    its rounds, max(1, ⌊n/p⌋) (``ScheduleInterleaved1F1B.__init__`` raises otherwise)."""
    par, n, layers = setup.parallel, setup.training.grad_accum, setup.model.num_layers
    virtual = par.pp * par.vpp
    if par.pp_layers is None or len(par.pp_layers) != virtual:
        raise ValueError(
            f"pp_layers: --impl torchtitan --vpp {par.vpp} places one count per virtual stage ({virtual}); "
            "give that many or drop --pp-layers"
        )
    reachable = any(-(-(layers + 2) // per) == virtual for per in range(1, layers + 3))
    if par.vpp != 2 and not reachable:
        raise ValueError(
            f"vpp: no pipeline_parallel_layers_per_stage makes torchtitan cut {layers} + 2 layers into "
            f"{virtual} virtual stages (⌈{layers + 2}/k⌉ never equals it); use --vpp 2 or another --vpp"
        )
    rounds = max(1, n // par.pp)
    if n % rounds:
        raise ValueError(
            f"grad_accum: torch's Interleaved1F1B needs the {n} micro-batches to be a multiple of its "
            f"{rounds} rounds (max(1, ⌊n/pp⌋)); use a multiple of {par.pp} or fewer than {2 * par.pp}"
        )
