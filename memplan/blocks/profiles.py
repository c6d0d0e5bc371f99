"""Which profile a setup's code has (``profile_of``): the reference model, or one framework's, per family."""

from __future__ import annotations

from collections.abc import Iterable

from memplan.blocks import fp8, megatron, torchtitan
from memplan.blocks.hf import hf_profile
from memplan.blocks.profile import COMPILED_REFERENCE, REFERENCE, Profile
from memplan.config import (
    Attention,
    Checkpointing,
    Device,
    DType,
    Fp8Recipe,
    GateActivation,
    Impl,
    MlpType,
    NormType,
    PositionType,
    Setup,
    ZeroStage,
)
from memplan.config.finetune import Target
from memplan.config.trainable import adapted, adapter_params, base_trains, fp32_adapters


def checkpoints_alone(setup: Setup) -> bool:
    """Every-K checkpointing of single layers (``Profile.checkpoints_alone``): ⌈L/K⌉ layers checkpointed,
    each alone; the others keep their saves."""
    every_k = setup.strategy.checkpointing is Checkpointing.EVERY_K
    return every_k and profile_of(setup).checkpoints_alone


def reentrant_checkpoint(setup: Setup) -> bool:
    """transformers' checkpointed layers run by torch.utils.checkpoint's ``CheckpointFunction``
    (``use_reentrant=True``, ``ImplConfig.reentrant``): each layer's ``partial(forward, **kwargs)`` is its
    node's ``ctx.run_function``, alive as long as the graph (``analytic.moments.reentrant``)."""
    return setup.impl.impl is Impl.HF and setup.impl.reentrant and bool(setup.strategy.segment)


def hidden_dropouts(setup: Setup) -> tuple[float, float]:
    """(residual, embedding) dropout probabilities the code applies (``Profile.hidden_dropout``)."""
    m, prof = setup.model, profile_of(setup)
    if prof.mlp_dropout_only:
        return m.resid_dropout, 0.0
    return (m.resid_dropout, m.embd_dropout) if prof.hidden_dropout else (0.0, 0.0)


def accumulates_in_place(setup: Setup) -> bool:
    """A later micro-batch's weight gradients are summed into the ``.grad`` an earlier one left and freed
    at once: torch's ``AccumulateGrad`` adds a new gradient into a defined one outside grad mode
    (``variable_grad += new_grad``, torch/csrc/autograd/functions/accumulate_grad.h) and drops it, so with
    ``grad_accum > 1`` a layer's backward keeps none of its own gradients as new storage past the node
    that made them (with one micro-batch the new one is stolen as the ``.grad``: it stays). Where the
    gradients stay whole on the rank (ZeRO 0–1, or one shard; under ZeRO 2–3 FSDP reduce-scatters each
    unit's whole new gradients at its end), in eager autograd (a compiled block's backward returns its
    gradients together) and not Megatron's (weight gradients go to its ``main_grad`` buffer); not under
    reversible layers, whose stack returns every layer's gradients together at its backward's end.
    Measured on CPU by tests/measure/test_peak.py (``ACCUMULATED``).
    NB: not on a pipeline stage, whose moments are not re-derived for its schedule (the warm-up's
    micro-batches in flight beside the first backward, which makes its gradients; the held outputs):
    there the one-micro-batch accounting stays, within tests/measure/test_distributed_pp.py's bound."""
    return (
        setup.training.grad_accum > 1
        and setup.parallel.pp == 1
        and not setup.strategy.reversible
        and (setup.strategy.zero <= ZeroStage.OPTIMIZER or setup.state_shards == 1)
        and setup.impl.impl is not Impl.MEGATRON
        and not profile_of(setup).compiled_block
    )


def made_grad_bytes(setup: Setup) -> int:
    """Bytes per element of the gradients a layer's backward leaves alive once their node has run: the
    recipe's, or none when they are summed into earlier micro-batches' (``accumulates_in_place``)."""
    return 0 if accumulates_in_place(setup) else setup.training.precision.grad_bytes


def top_layer_grads(setup: Setup, count: int, targets: Iterable[Target] = (), summed: bool = True) -> int:
    """Bytes of the gradients the top layer's backward makes for ``count`` of its own parameters, the
    linears of ``targets`` and their norms (the layer-backward moments, ``analytic.moments.layer_backward``):
    all
    of them where its base trains (full training outside ``--freeze``); under LoRA none for the frozen
    base, only its adapters' on ``targets`` (A [r, in] and B [out, r], in the adapters' dtype: peft's fp32
    under ``--impl hf``, ``config.trainable.fp32_adapters``); none where they are summed into an earlier
    micro-batch's (``accumulates_in_place``) unless ``summed`` is false (a gradient alive before its sum).
    Before, a frozen layer was charged its base weights' gradients: at Llama 3 8B's widths under LoRA on
    q, v, 424 MB of a layer backward that the step of transformers and peft never holds
    (tests/hf/test_hf_peak.py)."""
    if summed and accumulates_in_place(setup):
        return 0
    top = setup.model.num_layers - 1
    if base_trains(setup, top):
        return count * setup.training.precision.grad_bytes
    made = frozenset(targets) & adapted(setup, top)
    if not made:
        return 0
    grad = DType.FP32.bytes if fp32_adapters(setup) else setup.training.precision.grad_bytes
    return adapter_params(setup, made) * grad


def profile_of(setup: Setup) -> Profile:
    """The profile of ``setup.impl`` for the model's family (memplan's reference first: ``fit`` asks it tens
    of thousands of times; ``compile_modelled`` is false without ``--compile``)."""
    impl = setup.impl
    if impl.impl is Impl.REFERENCE:
        return COMPILED_REFERENCE if impl.compile and compile_modelled(setup) else REFERENCE
    if impl.impl is Impl.HF:
        return hf_profile(setup)
    if impl.impl is Impl.MEGATRON:
        return megatron.profile(setup)
    return torchtitan.profile(setup, compiled=compile_modelled(setup))


def compiled_sac(setup: Setup) -> bool:
    """``--compile`` with torchtitan's per-op ``SelectiveAC`` (``op_selective``),
    where its partitioner was measured (measure/frameworks/titan.py ``compiled_sac_block_records``: dynamo
    and AOTAutograd's min-cut partitioner over the checkpointed block, which honours the policy's tags):
    the same dense blocks as ``compile_modelled``, one tensor- and context-parallel rank, no float8."""
    m, p = setup.model, setup.parallel
    return (
        setup.impl.compile
        and setup.impl.impl is Impl.TORCHTITAN
        and setup.strategy.checkpointing is Checkpointing.SELECTIVE
        and m.moe is None
        and setup.strategy.attention is Attention.FLASH
        and p.tp == 1
        and p.cp == 1
        and setup.finetune.trains_everything
        and (setup.impl.fp8 is Fp8Recipe.NONE or _compiled_tensorwise(setup))
    )


def _compiled_tensorwise(setup: Setup) -> bool:
    """Tensorwise float8 under compiled ``SelectiveAC`` where it was traced
    (``fp8.compiled_sac_scale_rules``): all five linears converted, the weights all-gathered in bf16."""
    every = fp8.titan_all_converted(setup)
    return setup.impl.fp8 is Fp8Recipe.TENSORWISE and every and not setup.impl.fp8_all_gather


def compile_modelled(setup: Setup) -> bool:
    """``--compile`` changes the saved set (``Profile.compiled_block``) where the partitioner's choice was
    measured (measure/runs/compiled.py): the reference model's and torchtitan's Llama's dense RMSNorm /
    SwiGLU blocks with flash attention and no dropout, on one context-parallel rank, full training, without
    --fp8 or with torchao's where ``fp8.compiled_modelled`` (its rules: ``fp8.compiled_rules``); tp 1, or
    torchtitan's tensor-parallel plan (each block of the rank traced through the partitioner as DTensor
    code on the fake process group,
    ``measure.distributed.titan_compiled.compiled_blocks``: the same choices on the rank's shards, the
    sequence-parallel gathers kept as the eager plan keeps them; without ``--sp`` also what W_O's backward
    gathers in the compiled forward, ``analytic.activations.compiled_tp_gathers``). Elsewhere the estimate
    keeps the eager code's saves and says so (``compile_note``)."""
    m, s, p = setup.model, setup.strategy, setup.parallel
    return (
        setup.impl.compile
        and setup.impl.impl in (Impl.REFERENCE, Impl.TORCHTITAN)
        and m.norm is NormType.RMSNORM
        and m.mlp is MlpType.SWIGLU
        and m.moe is None
        and s.attention is Attention.FLASH
        and not (m.attn_dropout or m.resid_dropout or m.embd_dropout)
        and not (m.qkv_bias or m.out_bias or m.mlp_bias)
        and not m.post_norms
        and not m.parallel_residual
        and m.gate_act is GateActivation.SILU
        and m.position is PositionType.ROPE
        and m.rotary_pct == 1.0
        and m.sliding_window is None
        and m.sliding_window_pattern is None
        and m.attn_softcap is None
        and (p.tp == 1 or setup.impl.impl is Impl.TORCHTITAN)
        and p.cp == 1
        and s.checkpointing in (Checkpointing.NONE, Checkpointing.FULL)
        and not s.reversible
        and setup.finetune.trains_everything
        and (setup.impl.fp8 is Fp8Recipe.NONE or fp8.compiled_modelled(setup))
    )


def compile_note(setup: Setup) -> str | None:
    """One line when ``--compile`` is given but its saved set is not modelled for this setup."""
    if not setup.impl.compile or compile_modelled(setup) or compiled_sac(setup):
        return None
    if setup.strategy.checkpointing is Checkpointing.FULL:
        # Measured (measure/frameworks/titan.py ``compiled_sac_block_records`` on torchtitan's FullAC block:
        # dynamo turns the checkpoint into its higher-order op and the min-cut partitioner recomputes what
        # it tags): the block's input alone, bf16 and float8 (tensorwise, rowwise: the casts are made again
        # in backward) alike, tests/measure/test_fp8.py; the eager FullAC block keeps the same
        return (
            "compile: under --checkpointing full a compiled block keeps its input alone, as the eager one "
            "(float8 too: measured through dynamo and AOTAutograd's partitioner); its re-run's transients "
            "are taken as the eager code's, the step time the compiled kernels'"
        )
    if setup.impl.fp8 is not Fp8Recipe.NONE:
        # The min-cut partitioner keeps each linear's float8 weight cast for backward: one byte per layer
        # parameter per layer (pytorch/pytorch#141881), modelled where it was measured (fp8.compiled_rules)
        return (
            "compile: torch.compile with --fp8 is modelled for tensorwise and rowwise on tp 1 without "
            "--fp8-all-gather or checkpointing: its partitioner keeps every layer's float8 weight casts "
            "(1 byte a parameter, pytorch/pytorch#141881); here the memory is the eager float8 code's, an "
            "underestimate, the step time the compiled kernels'"
        )
    return (
        "compile: torch.compile's saved set is modelled for --impl reference or torchtitan dense "
        "RMSNorm/SwiGLU blocks with flash attention, no dropout or biases, tp 1 (torchtitan: any tp), "
        "cp 1, full training and checkpointing none or full, or torchtitan's selective (measured: "
        "memplan trace --compile); here "
        "the memory is the eager code's, the step time the compiled kernels'"
    )


def dropout_keeps(setup: Setup, dtype: DType) -> DType:
    """What a dropout of a ``dtype`` input keeps: ``native_dropout``'s bool mask, or the noise in the
    input's dtype where the code calls ``nn.Dropout`` on CPU (``Profile.cpu_dropout_noise``)."""
    noise = setup.device is Device.CPU and profile_of(setup).cpu_dropout_noise
    return dtype if noise else DType.BOOL


def op_selective(setup: Setup) -> bool:
    """``--checkpointing selective`` is a per-op policy (torchtitan's ``SelectiveAC``:
    ``Profile.op_selective_checkpoint``), not Korthikanti's attention-core recompute."""
    selective = setup.strategy.checkpointing is Checkpointing.SELECTIVE
    return selective and profile_of(setup).op_selective_checkpoint
