"""torch's ``nn.RMSNorm`` as a GPU runs it, for a CPU build: ``cuda_rms_norm()``.

``F.rms_norm`` is ``aten::rms_norm``, whose composite ``rms_norm_symint`` (aten/src/ATen/native/
layer_norm.cpp) calls ``aten._fused_rms_norm`` unless the input is channels-last or complex or the weight's
dtype is not the input's. That op has a CUDA kernel, so on a GPU autograd records its own node,
``FusedRmsNormBackward0``, which keeps the input, the weight and the fp32 rstd (``result1``) and runs
``_fused_rms_norm_backward``; a CPU build has no such kernel, so there the op is its composite and
autograd records the decomposed ops (the fp32 upcast x and the fp32 normalised x among the saves). Checked
on torch 2.13 (tests/hf/test_torchtitan_cuda.py): the dispatch table of ``aten::_fused_rms_norm`` (an
``Autograd`` kernel beside the ``CompositeImplicitAutograd`` one) and the node's saved fields; by hand, not
in a test (the process aborts at the CUDA device guard), a fake CUDA tensor's ``rms_norm`` reaching
``_fused_rms_norm`` (``at::_ops::rms_norm::call`` → ``at::_ops::_fused_rms_norm::call`` in its stack).

While ``cuda_rms_norm()`` is open the op has a CPU kernel — torch's own decomposition of its two outputs
(``torch._decomp.decompositions._fused_rms_norm``; under the fake mode only their shapes and dtypes) —
and so does its backward (``_fused_rms_norm_backward``'s decomposition): the autograd node, and with it
what is saved, is torch's CUDA one. The registrations are removed on exit (``Library._destroy``);
re-entrant.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

_OPEN: list[Any] = []
"""The open registration (a ``torch.library.Library``) and its depth."""


@contextmanager
def cuda_rms_norm() -> Iterator[None]:
    """``aten._fused_rms_norm`` and its backward run on CPU tensors as CUDA's dispatch runs them (module
    docstring), for the duration."""
    from torch._decomp import decompositions as d

    if _OPEN:
        _OPEN.append(_OPEN[0])
    else:
        lib = torch.library.Library("aten", "IMPL")
        lib.impl("_fused_rms_norm", d._fused_rms_norm, "CPU")
        lib.impl("_fused_rms_norm_backward", d._fused_rms_norm_backward, "CPU")
        _OPEN.append(lib)
    try:
        yield
    finally:
        lib = _OPEN.pop()
        if not _OPEN:
            lib._destroy()
