"""The optimizer step's HBM traffic and kernels by implementation (``--optimizer-impl``, issue #21).

Every op of the step reads its input tensors from HBM and writes its output there, element by element;
an op that reads one tensor twice (``addcmul_(g, g)``) reads it once from HBM. Per element of a stepped
parameter, with x the bytes of the stepped tensor (the fp32 master under a mixed recipe, else the weight),
q of one optimizer-state element, g of the gradient the optimizer reads:

- reference (memplan's ``measure/reference/optim.py``, one tensor at a time): under a mixed recipe
  ``grad.float()`` (g₁₆ + 4, then g = 4), the update, and ``p.copy_(master)`` (x + the weight's bytes).
  AdamW's update: ``w.mul_(1 − lr·wd)`` 2x, ``m.lerp_(g)`` 2q + g, ``v.mul_(β₂)`` 2q,
  ``v.addcmul_(g, g)`` 2q + g, ``v.sqrt()`` 2q, ``.div_`` 2q, ``.add_(eps)`` 2q, ``w.addcdiv_(m, denom)``
  2x + 2q: 4x + 14q + 2g, 8 kernels. bf16-mixed: 6 + 80 + 6 = 92 bytes, 10 kernels.
  SGD: ``w.mul_`` 2x, ``w.add_(g)`` 2x + g; with momentum ``st.mul_(0.9).add_(g)`` 4q + g and
  ``w.add_(st)`` 2x + q; Lion: ``w.mul_`` 2x, ``st.mul(β₁)`` 2q, ``.add_(g)`` 2q + g, ``.sign_()`` 2q,
  ``w.add_(update)`` 2x + q, ``g.to(st.dtype)`` (g + q, none when equal), ``st.lerp_`` 2q + q.
- for-loop and foreach (torch 2.13 ``torch/optim/adam.py``: ``_single_tensor_adam`` per parameter,
  ``_multi_tensor_adam`` the same ops as ``torch._foreach_*`` over lists; AdamW is Adam with
  ``decoupled_weight_decay``): ``param.mul_``, ``exp_avg.lerp_``, ``exp_avg_sq.mul_(β₂).addcmul_``,
  ``(exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)``, ``param.addcdiv_`` — the reference's update
  with g = x (torch.optim reads ``p.grad`` in p's dtype): fp32 80 bytes, 8 kernels per tensor (for-loop;
  the step counter lives on the CPU unless ``capturable``).
- fused (``torch._fused_adamw_``): one kernel reads param, grad, exp_avg, exp_avg_sq and writes param,
  exp_avg, exp_avg_sq: 3x + 4q, fp32 28 bytes.
- bitsandbytes (``AdamW8bit``'s CUDA kernel) and the reference's adamw-8bit: one pass that reads and
  writes the master and the states, reads the gradient and writes the working weight.

Launches: the reference and the for-loop launch their kernels per tensor (``launch_kernels``), each with
``efficiency.launch_gap``; foreach's ``multi_tensor_apply`` and the fused kernel launch a few large
kernels for the whole list (each covering up to 320 blocks of 65,536-element chunks: their gaps are
negligible beside their bytes, not charged).

Checked against a traced step on an H200 (docs/step-time.md, "Eager PyTorch on a measured H200"):
Llama-2-7B, the reference optimizer under bf16-mixed: 2,910 kernels (10 for each of 291 tensors), their
shapes' bytes 646.9 GB counting ``addcmul_``'s g twice (96 bytes a parameter; its kernel's 5.6 TB/s,
above the H200's 4.8 TB/s, shows the second read hits the cache: 92 bytes) in 157.7 ms of kernels.

Gradient clipping (``--clip-grad``; ``clips``: each implementation's default unless given — Megatron-LM's
``--clip-grad`` 1.0, torchtitan's ``training.max_norm`` 1.0, transformers' ``TrainingArguments.max_grad_norm``
1.0; memplan's reference step does not clip) runs on the gradients the optimizer reads, before the step
(``clip_ops``, bytes per owned element): torch's ``clip_grad_norm_`` (torch/nn/utils/clip_grad.py, torch 2.13;
torchtitan's ``dist_utils.clip_grad_norm_``, transformers' Trainer through Accelerate, Composer's FSDP
``clip_grad_norm_``) reads every gradient for ``torch._foreach_norm`` (g) and multiplies every one by the
clamped coefficient, always — ``torch._foreach_mul_(grads, clip_coef_clamped)``, no host sync to skip it —
(2g): 3g; Megatron's ``clip_grad_norm_fp32`` (megatron/core/optimizer/clip_grads.py) reads the fp32 main
gradients for ``multi_tensor_l2norm`` (4) and runs ``multi_tensor_scale`` only ``if clip_coeff < 1.0``: 4
(NB: a step whose norm exceeds the threshold moves 8 more, not counted). Both launch a few multi-tensor
kernels (not charged). NB: the all-reduce of the norm (one scalar over the data- and model-parallel groups:
latency only) and, under optimizer offload, the host's clipping pass are not counted.

Megatron's own passes around the step (``framework_ops``, per owned element; ``--impl megatron``, its
``Float16OptimizerWithFloat16Params`` / ``DistributedOptimizer``, megatron/core/optimizer/optimizer.py):
``_copy_model_grads_to_main_grads`` sets ``main_param.grad = model_param.main_grad.float()`` — no copy when
the ``main_grad`` buffer is fp32 (bf16's default, ``blocks.megatron.main_grad_bytes``), a cast (2 + 4)
otherwise; under fp16 the loss scaler's ``_unscale_main_grads_and_check_for_nan``
(``torch._amp_foreach_non_finite_check_and_unscale_``: the fp32 gradients read and written, 8); after the
update ``_copy_main_params_to_model_params`` (``_multi_tensor_copy_this_to_that``: the fp32 master read,
the 16-bit weight written, 4 + 2). Once a step ``train_step`` zeroes each chunk's gradient buffer
(``model_chunk.zero_grad_buffer()`` → ``grad_data.zero_()``): the device's gradient bytes written
(``megatron_zero_bytes``). None of these are torch.optim's (its ``zero_grad(set_to_none=True)`` writes
nothing).

Known limitations (NB): the framework's own passes over the gradients and weights are counted where modelled —
Megatron's here (``framework_ops``), FSDP2's and DDP's copies in ``time.dp_copies`` — and not for DeepSpeed's
flat partitions (``--impl reference`` ZeRO-1/2); the reference adamw-8bit's quantise/dequantise passes are
taken as one pass; the for-loop's launches count the model's tensors, under FSDP1 the flat parameters are
fewer; a pipeline stage's launches are the model's share by layers (the embedding's and head's tensors spread
over them).
"""

from __future__ import annotations

from functools import lru_cache

from memplan.analytic.optimizer_step import optimizer_impl, trainable_shapes
from memplan.blocks import megatron
from memplan.config import Impl, ModelConfig, Optimizer, OptimizerImpl, Precision, Setup
from memplan.config.finetune import FineTune
from memplan.config.impl import ImplConfig
from memplan.strategies.zero import model_states

FP32 = 4
PER_TENSOR = frozenset({OptimizerImpl.REFERENCE, OptimizerImpl.FOR_LOOP})
"""Implementations that launch their kernels once per tensor."""


def _update_ops(kind: Optimizer, x: int, q: int, g: int) -> list[int]:
    """Bytes per element of each kernel of the update proper (module docstring), g the gradient's bytes
    as the update reads it."""
    if kind is Optimizer.ADAMW:
        return [2 * x, 2 * q + g, 2 * q, 2 * q + g, 2 * q, 2 * q, 2 * q, 2 * x + 2 * q]
    if kind is Optimizer.SGD:
        return [2 * x, 2 * x + g]
    if kind is Optimizer.SGD_MOMENTUM:
        return [2 * x, 2 * q, 2 * q + g, 2 * x + q]
    if kind is Optimizer.LION:
        cast = [g + q] if g != q else []
        return [2 * x, 2 * q, 2 * q + g, 2 * q, 2 * x + q, *cast, 3 * q]
    raise ValueError(f"optimizer: no per-op model of {kind}")  # adamw-8bit: one pass (``one_pass_bytes``)


def one_pass_bytes(s: Setup, grad_bytes: int | None = None) -> int:
    """A fused kernel's bytes per parameter: the master and states read and written, the gradient read
    (``grad_bytes`` of it: the recipe's unless given), the working weight written."""
    t = s.training
    p = t.precision
    g = p.grad_bytes if grad_bytes is None else grad_bytes
    return 2 * (p.master_bytes + t.optimizer.state_bytes(p)) + g + p.weight_bytes


def reference_ops(s: Setup) -> list[int]:
    """The reference optimizer's kernels, bytes per element each: the gradient's fp32 copy (mixed recipe,
    16-bit gradient), the update on the master (or the weight), the copy back to the weight."""
    t = s.training
    p = t.precision
    mixed = p.master_bytes > 0
    x = p.master_bytes if mixed else p.weight_bytes
    q = p.state_bytes
    g = p.grad_bytes
    upcast = mixed and g != FP32
    cast = [g + FP32] if upcast else []
    copy = [x + p.weight_bytes] if mixed else []
    return [*cast, *_update_ops(t.optimizer, x, q, FP32 if upcast else g), *copy]


def step_ops(s: Setup) -> list[int]:
    """The step's kernels by implementation, bytes per element of a stepped parameter each (module
    docstring); a one-pass kernel is one entry."""
    impl = optimizer_impl(s)
    kind = s.training.optimizer
    if kind is Optimizer.ADAMW_8BIT or impl is OptimizerImpl.BITSANDBYTES:
        return [one_pass_bytes(s)]
    if impl is OptimizerImpl.REFERENCE:
        return reference_ops(s)
    e = s.training.precision.state_bytes  # torch.optim steps the fp32 master (or the weight) and its grad
    if impl is OptimizerImpl.FUSED:
        return [3 * e + 2 * e * 2]
    return _update_ops(kind, e, e, e)


def bytes_per_param(s: Setup) -> int:
    """HBM bytes the step moves per parameter it owns: the sum of ``step_ops``."""
    return sum(step_ops(s))


def framework_ops(s: Setup) -> list[int]:
    """Megatron's passes around the optimizer step, bytes per owned element each (module docstring); none
    under other implementations or without a master copy."""
    main_grad = megatron.main_grad_bytes(s)
    p = s.training.precision
    if main_grad is None or not p.master_bytes:
        return []
    cast = [main_grad + FP32] if main_grad != FP32 else []
    unscale = [2 * FP32] if p is Precision.FP16_MIXED else []
    return [*cast, *unscale, p.master_bytes + p.weight_bytes]


def megatron_zero_bytes(s: Setup, params: int) -> int:
    """Bytes Megatron's ``zero_grad_buffer`` writes once a step on a device holding ``params`` parameters:
    its gradient buffer, the model states' gradients (``strategies.zero.model_states``); 0 elsewhere."""
    main_grad = megatron.main_grad_bytes(s)
    if main_grad is None:
        return 0
    t, zero = s.training, s.strategy.zero
    states = model_states(params, t.precision, t.optimizer, zero, s.state_shards, grad_bytes=main_grad)
    return states.gradients


CLIPS_BY_DEFAULT = frozenset({Impl.MEGATRON, Impl.TORCHTITAN, Impl.HF})
"""Implementations whose training loop clips the gradient norm unless told not to (module docstring)."""


def clips(s: Setup) -> bool:
    """Whether the step clips the gradient norm: ``--clip-grad`` / ``--no-clip-grad``, else the
    implementation's default (``CLIPS_BY_DEFAULT``)."""
    chosen = s.training.clip_grad
    return chosen if chosen is not None else s.impl.impl in CLIPS_BY_DEFAULT


def clip_ops(s: Setup) -> list[int]:
    """Gradient clipping's kernels, bytes per owned gradient element each (module docstring): none without
    clipping; Megatron's norm of its fp32 main gradients; else torch's norm and multiply of the gradients
    the optimizer reads (its own g: the recipe's gradient for the reference and bitsandbytes, the fp32
    master's — or the weight's — for torch.optim)."""
    if not clips(s):
        return []
    if s.impl.impl is Impl.MEGATRON:
        return [FP32]
    p = s.training.precision
    impl = optimizer_impl(s)
    g = p.grad_bytes if impl in (OptimizerImpl.REFERENCE, OptimizerImpl.BITSANDBYTES) else p.state_bytes
    return [g, 2 * g]


def launch_kernels(s: Setup, layers: int) -> int:
    """Kernels the step launches one by one on a stage of ``layers`` layers: ``step_ops`` per trainable
    tensor for the reference and the for-loop — the model's tensors × layers / L, rounded up —; 0 for
    foreach, fused and bitsandbytes (module docstring)."""
    if optimizer_impl(s) not in PER_TENSOR or s.training.optimizer is Optimizer.ADAMW_8BIT:
        return 0
    tensors = -(-tensor_count(s.model, s.impl, s.finetune) * layers // s.model.num_layers)
    return len(step_ops(s)) * tensors


@lru_cache(maxsize=64)
def tensor_count(model: ModelConfig, impl: ImplConfig, finetune: FineTune) -> int:
    """The tensors the optimizer steps (``trainable_shapes``, which reads only these three), counted once
    per model: ``fit`` evaluates thousands of layouts of one model."""
    return len(trainable_shapes(Setup.model_construct(model=model, impl=impl, finetune=finetune)))
