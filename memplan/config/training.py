"""How the model is trained: micro-batch, sequence, precision recipe, optimizer, gradient accumulation."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field, model_validator

from memplan.config._base import Frozen


class DType(StrEnum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    INT8 = "int8"
    UINT8 = "uint8"
    """Raw float8 bytes as Transformer Engine stores them (``Float8Tensor._data`` / ``_transpose`` are
    ``torch.uint8``, transformer_engine/pytorch/tensor/float8_tensor.py)."""
    FP8_E4M3 = "fp8_e4m3"
    """torch's ``float8_e4m3fn``: torchao's float8 casts (``Float8TrainingTensor._data``)."""
    BOOL = "bool"
    INT32 = "int32"
    INT64 = "int64"
    UINT64 = "uint64"
    COMPLEX64 = "complex64"
    """Two fp32 (real, imaginary): torchtitan's rotary cache (``torch.polar``)."""

    @property
    def bytes(self) -> int:
        return _DTYPE_BYTES[self]


_DTYPE_BYTES = {
    DType.FP32: 4,
    DType.BF16: 2,
    DType.FP16: 2,
    DType.INT8: 1,
    DType.UINT8: 1,
    DType.FP8_E4M3: 1,
    DType.BOOL: 1,
    DType.INT32: 4,
    DType.INT64: 8,
    DType.UINT64: 8,
    DType.COMPLEX64: 8,
}


class Precision(StrEnum):
    """Precision recipe: the dtype of weights, gradients, master copy, optimizer states and activations."""

    FP32 = "fp32"
    """Everything fp32: weights 4, gradients 4, optimizer states fp32, activations fp32."""
    BF16_MIXED = "bf16-mixed"
    """bf16 weights, gradients and activations; fp32 master weights and optimizer states
    (DeepSpeed / ZeRO mixed precision): 16 bytes/param with AdamW. Under ``--impl megatron`` the gradients
    are its fp32 ``main_grad`` buffer (``blocks.megatron.main_grad_bytes``): 18."""
    FP16_MIXED = "fp16-mixed"
    """As bf16-mixed with fp16 (plus a loss scale, which costs no per-parameter memory)."""
    BF16 = "bf16"
    """Pure bf16: weights, gradients, optimizer states and activations in bf16, no master copy."""
    FSDP2_MIXED = "fsdp2-mixed"
    """FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` on an fp32 model (what
    torchtitan's trainer runs): the fp32 dim-0 shards are the parameters the optimizer steps (no master
    copy), bf16 only in the gathered copies the layers compute with and the unsharded gradients autograd
    makes, gradients reduce-scattered in fp32 into fp32 sharded gradients: 4 + 4 + 8 bytes per shard
    element with AdamW (``blocks.torchtitan.fsdp2_mixed_states``). Needs ZeRO-2/3 (FSDP2) over more than
    one rank. Its per-element bytes below are bf16-mixed's, corrected by FSDP2's split in the engine."""

    @property
    def activation_dtype(self) -> DType:
        return _ACTIVATION_DTYPE[self]

    @property
    def weight_bytes(self) -> int:
        return self.activation_dtype.bytes

    @property
    def grad_bytes(self) -> int:
        return self.activation_dtype.bytes

    @property
    def master_bytes(self) -> int:
        """fp32 master copy kept by the mixed recipes only."""
        return 4 if self in (Precision.BF16_MIXED, Precision.FP16_MIXED, Precision.FSDP2_MIXED) else 0

    @property
    def state_bytes(self) -> int:
        """Bytes of one full-precision optimizer state element (fp32, or bf16 for pure bf16)."""
        return 2 if self is Precision.BF16 else 4


_ACTIVATION_DTYPE = {
    Precision.FP32: DType.FP32,
    Precision.BF16_MIXED: DType.BF16,
    Precision.FP16_MIXED: DType.FP16,
    Precision.BF16: DType.BF16,
    Precision.FSDP2_MIXED: DType.BF16,
}
"""Each recipe's activation (and weight, gradient) dtype: a mapping built once (fit reads it ~10⁵ times)."""


class Optimizer(StrEnum):
    ADAMW = "adamw"
    """Two states (m, v) per parameter."""
    ADAMW_8BIT = "adamw-8bit"
    """bitsandbytes 8-bit AdamW: m and v at 1 byte each (block-wise absmax statistics not counted)."""
    SGD = "sgd"
    """No state."""
    SGD_MOMENTUM = "sgd-momentum"
    """One momentum buffer per parameter."""
    LION = "lion"
    """One momentum buffer per parameter (Chen et al. 2023)."""

    def state_bytes(self, precision: Precision) -> int:
        """Bytes of optimizer state per parameter (the master copy excluded)."""
        if self is Optimizer.ADAMW_8BIT:
            return 2
        n = {Optimizer.ADAMW: 2, Optimizer.SGD: 0, Optimizer.SGD_MOMENTUM: 1, Optimizer.LION: 1}[self]
        return n * precision.state_bytes


class OptimizerImpl(StrEnum):
    """Whose code steps the optimizer (``--optimizer-impl``): the step's temporaries differ
    (``analytic.optimizer_step``)."""

    REFERENCE = "reference"
    """memplan's reference optimizer (measure/reference/optim.py): one tensor at a time, in-place where it
    can."""
    FOR_LOOP = "for-loop"
    """torch.optim.AdamW(foreach=False): ``_single_tensor_adam``, one parameter at a time (torch's pick
    on CPU)."""
    FOREACH = "foreach"
    """torch.optim.AdamW(foreach=True): ``_multi_tensor_adam``, ``torch._foreach_*`` over every parameter
    of a device and dtype (torch's pick on CUDA)."""
    FUSED = "fused"
    """torch.optim.AdamW(fused=True): ``torch._fused_adamw_``, one in-place kernel."""
    BITSANDBYTES = "bitsandbytes"
    """bitsandbytes' ``bnb.optim.AdamW8bit`` (with ``--optimizer adamw-8bit``): block-wise 8-bit states."""


TORCH_ADAMW = (OptimizerImpl.FOR_LOOP, OptimizerImpl.FOREACH, OptimizerImpl.FUSED)


class TrainingConfig(Frozen):
    micro_batch: int = Field(default=1, gt=0, le=1 << 20, description="sequences per micro-batch b")
    seq_len: int = Field(default=2048, gt=0, le=1 << 24, description="tokens per sequence s")
    precision: Precision = Precision.BF16_MIXED
    optimizer: Optimizer = Optimizer.ADAMW
    grad_accum: int = Field(default=1, gt=0, le=1 << 20, description="micro-batches per optimizer step")
    optimizer_impl: OptimizerImpl | None = Field(
        default=None,
        description="whose code steps the optimizer; None: the reference optimizer under --impl reference, "
        "else as torch picks on the device (analytic.optimizer_step.optimizer_impl)",
    )
    clip_grad: bool | None = Field(
        default=None,
        description="gradient-norm clipping before each optimizer step; None: the implementation's default "
        "(time.optimizer.clips: on under megatron, torchtitan and hf, off under the reference)",
    )

    @model_validator(mode="after")
    def _impl_fits_optimizer(self) -> TrainingConfig:
        impl, opt = self.optimizer_impl, self.optimizer
        if impl in TORCH_ADAMW and opt is not Optimizer.ADAMW:
            raise ValueError(
                f"optimizer_impl: {impl} steps torch.optim.AdamW; with --optimizer {opt} use "
                f"{'bitsandbytes or ' if opt is Optimizer.ADAMW_8BIT else ''}reference"
            )
        if impl is OptimizerImpl.BITSANDBYTES and opt is not Optimizer.ADAMW_8BIT:
            raise ValueError("optimizer_impl: bitsandbytes models AdamW8bit; add --optimizer adamw-8bit")
        return self
