"""The ``memplan estimate`` command that reproduces a row of ``fit``."""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

from memplan.config import (
    FineTune,
    ImplConfig,
    LossKind,
    Method,
    Offload,
    Optimizer,
    Precision,
    Setup,
    default_cp_rotate,
    default_impl,
    loss_label,
    offload_label,
)
from memplan.search.methods import SAVERS

if TYPE_CHECKING:
    from memplan.search.results import Config, FitResult


def estimate_command(c: Config, r: FitResult) -> str:
    """The ``memplan estimate`` command that gives configuration ``c`` of search ``r`` (the same setup, so the
    same memory and step time): the model as typed, the base's training settings that differ from the
    options' defaults, the searched family's strategy and layout, the GPU as typed, the GPU count and the
    global batch, and the options no setup holds (``FitResult.passthrough``)."""
    s = c.result.setup
    t, st, par = s.training, s.strategy, s.parallel
    f = c.family
    args = ["memplan estimate", f"-m {shlex.quote(r.model_typed or s.model.name)}", f"--seq {t.seq_len}"]
    args += impl_args(s)
    if t.precision is not Precision.BF16_MIXED:
        args.append(f"--precision {t.precision.value}")
    if t.optimizer is not Optimizer.ADAMW:
        args.append(f"--optimizer {t.optimizer.value}")
    if t.optimizer_impl is not None:  # its step's time and temporaries
        args.append(f"--optimizer-impl {t.optimizer_impl.value}")
    if t.clip_grad is not None:
        args.append("--clip-grad" if t.clip_grad else "--no-clip-grad")
    args += [f"--gpu {shlex.quote(r.gpu_typed or r.gpu.name)}", f"--gpus {r.gpus}"]
    args.append(f"--global-batch {r.global_batch}")
    args += [f"--batch {t.micro_batch}", f"--tp {par.tp}"] + (["--sp"] if par.sp else [])
    args.append(f"--pp {par.pp}")
    if par.vpp > 1:
        args.append(f"--vpp {par.vpp}")
    if par.pp_layers is not None:
        args.append("--pp-layers " + ",".join(map(str, par.pp_layers)))
    args += [f"--cp {par.cp}"] if par.cp > 1 else []
    args += (
        [f"--cp-rotate {par.cp_rotate.value}"]
        if par.cp > 1 and par.cp_rotate is not default_cp_rotate(s.impl.impl)
        else []
    )
    args += [f"--ep {par.ep}"] if par.ep > 1 else []
    args += [f"--etp {par.expert_tp}"] if par.fold > 1 else []
    args.append(f"--zero {int(st.zero)}")
    args += [f"--hsdp {st.hsdp}"] if st.hsdp else []
    args += [f"--reduce-dtype {st.reduce_dtype.value}"] if st.reduce_dtype is not None else []
    args += [f"--checkpointing {f.checkpointing.name.lower()}", f"--attention {f.attention.name.lower()}"]
    saver = SAVERS[f.saver]
    if saver.offload is not Offload.NONE:
        args.append(f"--offload {offload_label(saver.offload)}")
    if saver.loss is not LossKind.STANDARD:
        args.append(f"--loss {loss_label(saver.loss, 1)}")
    return " ".join(args + _finetune_args(f.finetune) + [shlex.quote(a) for a in r.passthrough])


def impl_args(s: Setup) -> list[str]:
    """The ``--impl`` and kernel options of ``s`` that differ from their defaults (``fit`` holds them for
    every layout)."""
    impl, default = s.impl, ImplConfig()
    out = [f"--impl {impl.impl.value}"] if impl.impl is not default_impl(s.model) else []
    if impl.attention_kernel is not default.attention_kernel:
        out.append(f"--attention-kernel {impl.attention_kernel.value}")
    out += [f"--norm-kernel {impl.norm_kernel.value}"] if impl.norm_kernel is not default.norm_kernel else []
    out += ["--compile"] if impl.compile else []
    out += ["--no-compile-loss"] if impl.compile and not impl.compile_loss else []
    out += [f"--fsdp-wrap {impl.fsdp_wrap.value}"] if impl.fsdp_wrap is not default.fsdp_wrap else []
    out += [f"--fp8 {impl.fp8.value}"] if impl.fp8 is not default.fp8 else []
    out += ["--fp8-all-gather"] if impl.fp8_all_gather else []
    out += ["--fp8-tp"] if impl.fp8_tp else []
    out += ["--overlap-grad-reduce"] if impl.overlap_grad_reduce else []
    out += ["--overlap-param-gather"] if impl.overlap_param_gather else []
    out += ["--tp-comm-overlap"] if impl.tp_comm_overlap else []
    out += ["--async-tp"] if impl.async_tp else []
    out += ["--fp8-param-gather"] if impl.fp8_param_gather else []
    return out


def _finetune_args(ft: FineTune) -> list[str]:
    """The fine-tuning options that give ``ft`` (nothing for plain full training)."""
    out = [] if ft.method is Method.FULL else [f"--finetune {ft.method.name.lower()}"]
    if ft.method is not Method.FULL:
        out += [f"--lora-rank {ft.rank}", f"--lora-alpha {ft.alpha:g}", f"--lora-dropout {ft.dropout:g}"]
        out.append("--lora-targets " + ",".join(t.value for t in ft.targets))
    if ft.method is Method.QLORA:
        out.append(f"--quant {ft.quant.value}" + (" --double-quant" if ft.double_quant else ""))
    parts = ["embeddings"] * ft.freeze_embeddings + ["lm_head"] * ft.freeze_lm_head
    if ft.freeze_layers is not None:
        parts.append(f"layers:{ft.freeze_layers[0]}-{ft.freeze_layers[1]}")
    return out + ([f"--freeze {','.join(parts)}"] if parts else [])
