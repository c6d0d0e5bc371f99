"""torchao float8 training of the reference model's layers (``--fp8 tensorwise|rowwise``), as torchtitan
converts a model: every ``nn.Linear`` of the transformer layers becomes torchao's ``Float8Linear``
(``torchao.float8.convert_to_float8_training``, torchao 0.18); the lm head (a parameter used through
``F.linear``) stays in the activation dtype.

What that changes, read from torchao 0.18's ``float8/float8_linear.py`` and measured
(tests/measure/test_fp8.py): ``matmul_with_hp_or_float8_args`` saves the high-precision input and the
weight's transposed view (``ctx.save_for_backward(input_hp, weight_hp_t)``): the saved activations are
bf16 training's; every float8 copy (of X and W in forward, of dY twice, W and X in backward) is made
again when needed and freed with the op: transients (``memplan.blocks.fp8``).

Known limitations:
- NB: runs under fake tensors and on real CPU tensors (torch's CPU ``_scaled_mm``); torchao's CUDA
  extension libraries fail to load on a CPU build (a printed warning, not an error).
- NB: a mixture of experts is refused (its experts would take torchao's grouped-GEMM float8 path, and
  the router a Float8Linear of E outputs): not measured.
- NB: delayed scaling (an amax history per tensor) was removed from torchao (0.18's ``ScalingType`` has
  ``DYNAMIC`` and ``DISABLED`` only): there is no amax history buffer to count.
"""

from __future__ import annotations

import contextlib
import io
import logging
from typing import Any

from torch import nn

from memplan.config import Fp8Recipe, Setup

INSTALL = "pip install 'memplan[fp8]' (torchao==0.18.0)"


def require_torchao() -> Any:
    """torchao's float8 module, or a one-line ``ValueError`` saying how to install it. Its CUDA extension
    libraries print a warning on a CPU build while loading: swallowed here."""
    quiet = logging.getLogger("torch.utils._pytree")  # torchao registers enums torch now supports itself
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            import torchao.float8 as float8
    except ImportError as e:
        raise ValueError(f"fp8: --fp8 runs torchao's Float8Linear, not importable ({e}); {INSTALL}") from None
    finally:
        quiet.setLevel(level)
    return float8


def torchao_config(recipe: Fp8Recipe) -> Any:
    """``Float8LinearConfig.from_recipe_name`` for ``--fp8``'s recipe."""
    return require_torchao().Float8LinearConfig.from_recipe_name(Fp8Recipe(recipe).value)


def check_convertible(setup: Setup) -> None:
    """One-line ValueError (field, fix) for a model ``convert_layers`` does not convert under ``--fp8``:
    asked before any run starts (``model.check_runnable``; ``profile --nproc`` before its ranks)."""
    if setup.impl.fp8 is not Fp8Recipe.NONE and setup.model.moe is not None:
        raise ValueError(
            "fp8: the float8 casts are modelled for dense MLPs (torchao's Float8Linear); a mixture of "
            "experts runs torchao's grouped-GEMM float8 path, not measured here; drop --fp8 or use a dense "
            "model"
        )


def convert_layers(model: nn.Module, setup: Setup) -> None:
    """Swap every ``nn.Linear`` of ``model.layers`` for torchao's ``Float8Linear`` (in place) under
    ``--fp8``; nothing otherwise."""
    if setup.impl.fp8 is Fp8Recipe.NONE:
        return
    check_convertible(setup)
    float8 = require_torchao()
    layers = model.get_submodule("layers")
    float8.convert_to_float8_training(layers, config=torchao_config(setup.impl.fp8))
