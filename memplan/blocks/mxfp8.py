"""MXFP8 tensors as Transformer Engine lays them out (``--impl megatron --fp8 mxfp8``, TE's
``MXFP8BlockScaling``; what the layers keep: blocks/te_fp8.py).

An ``MXFP8Tensor`` of shape [..., K] (M = the product of the leading dimensions) holds, per usage
(transformer_engine/pytorch/tensor/mxfp8_tensor.py, ``MXFP8Quantizer.make_empty`` / ``get_scale_shape``):
- rowwise: data [..., K] uint8 and ``scale_inv`` [round_up(M, 128), round_up(K/32, 4)] uint8 — one E8M0
  scale per 32 consecutive elements of a row (``MXFP8_BLOCK_SCALING_SIZE = 32``), padded to cuBLAS's
  block-scaling-factor layout;
- columnwise: data [..., K] uint8 (the same shape, not transposed: ``get_columnwise_shape`` returns the
  rowwise shape) and ``columnwise_scale_inv`` [round_up(M/32, 4), round_up(K, 128)] uint8 — one scale per
  32 consecutive elements of a column.
``MXFP8BlockScalingRecipeState`` allocates nothing ("MXFP8 quantization does not require state"): the
scales are computed in the cast kernel.

Known limitations (NB): TE requires M and K to be multiples of 32 (``is_quantizable``); memplan does not
check it (TE pads grouped inputs only). Derived from TE's source, not measured.
"""

from __future__ import annotations

BLOCK = 32
"""``MXFP8_BLOCK_SCALING_SIZE`` (transformer_engine/pytorch/constants.py): elements per E8M0 scale."""
SCALE_BYTES = 1
"""An E8M0 scale: ``torch.uint8`` (``make_empty``)."""


def round_up(n: int, multiple: int) -> int:
    """TE's ``round_up_to_nearest_multiple``."""
    return -(-n // multiple) * multiple


def scale_shape(rows: int, cols: int, columnwise: bool) -> tuple[int, int]:
    """The ``scale_inv`` of an [rows, cols] tensor (``MXFP8Quantizer.get_scale_shape``)."""
    if columnwise:
        return round_up(rows // BLOCK, 4), round_up(cols, 128)
    return round_up(rows, 128), round_up(cols // BLOCK, 4)


def scale_bytes(rows: int, cols: int, columnwise: bool) -> int:
    r, c = scale_shape(rows, cols, columnwise)
    return r * c * SCALE_BYTES


def both_bytes(rows: int, cols: int) -> int:
    """Rowwise and columnwise data (1 byte an element each) and both scales: what one cast writes."""
    scales = scale_bytes(rows, cols, columnwise=False) + scale_bytes(rows, cols, columnwise=True)
    return 2 * rows * cols + scales
