"""The kernel torchtitan's attention runs, swapped in for what a CPU build cannot dispatch itself: torch's
ring over a context-parallel group (``ring_attention``, its kernel ``ring_kernel``) and, on ``--device
cuda``, cuDNN's SDPA op (``cudnn_attention``). Each replaces every block's ``inner_attention.forward``
(``measure.frameworks.titan``'s module docstring says what torch runs in their place on a GPU)."""

from __future__ import annotations

from typing import Any

import torch

from memplan.blocks.attention.core import titan_cudnn
from memplan.config import Device, Setup


def ring_kernel(setup: Setup) -> str:
    """The attention kernel each ring step runs: the CPU flash op on CPU; on CUDA torchtitan's SDPA, cuDNN's
    where torch picks it (``blocks.attention.titan_cudnn``), else flash."""
    if setup.device is not Device.CUDA:
        return "cpu"
    return "cudnn" if titan_cudnn(setup) else "flash"


def ring_attention(model: Any, group: Any, kernel: str = "cpu") -> None:
    """Each block's inner SDPA replaced by torch's ring (``apply_cp_to_forward``'s effect on one rank):
    [b, s/c, heads, d] in and out, as ``ScaledDotProductAttention.forward`` transposes around its SDPA.
    Installed before torchtitan's ``Module.parallelize`` (``distributed.titan.parallelize_part``), the ring
    is the function its tensor-parallel wrapper calls: torchtitan's ``local_map`` region hands it the
    rank's local heads and turns its output back into a DTensor, as it does for its own SDPA."""
    from memplan.measure.reference.context import ring_flash

    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        out, _ = ring_flash(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), group, kernel)
        return out.transpose(1, 2)

    for block in model.layers.values():
        block.attention.inner_attention.forward = forward


def cudnn_attention(model: Any) -> None:
    """``--device cuda``: each block's inner SDPA runs the op torch dispatches on a GPU, which a CPU build
    cannot choose itself (its ``_fused_sdp_choice`` has no CUDA stub; fake CUDA tensors abort in autograd's
    device guard). torchtitan's ``ScaledDotProductAttention.forward`` runs SDPA under ``sdpa_kernel([
    CUDNN_ATTENTION, FLASH_ATTENTION, MATH], set_priority=True)``; torch's ``select_sdp_backend`` takes cuDNN
    where ``can_use_cudnn_attention`` holds (sdp_utils.cpp; ``config.impl_rules`` refuses the rest), and
    SDPA's composite (attention.cpp, ``case SDPBackend::cudnn_attention``) then calls
    ``aten._scaled_dot_product_cudnn_attention(q, k, v, None, compute_logsumexp, dropout_p, is_causal,
    False, scale)`` with the kv heads unrepeated: the same op, arguments and autograd node as here, where
    the fake mode runs its meta kernel (the CUDA kernel's output shapes and dtypes). What a GPU dispatches
    beside it, ``_fused_sdp_choice``, returns an int (nothing a policy caches or autograd saves)."""

    def forward(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        scale: float | None = None,
        enable_gqa: bool = False,
        is_causal: bool = True,
        **kwargs: Any,
    ) -> torch.Tensor:
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, N, L, H), as torchtitan's
        needs_lse = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))  # should_compute_…
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, needs_lse, 0.0, is_causal, False, scale=scale
        )[0]
        return out.transpose(1, 2)

    for block in model.layers.values():
        block.attention.inner_attention.forward = forward
